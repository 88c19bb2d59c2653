"""Shared test machinery.

* the default run is the fast suite: tests marked ``compile`` (sm_90a compiles) or
  ``slow`` (long reference sweeps) are deselected unless also marked ``representative``;
  ``pytest --exhaustive`` runs everything (CI runs both).
* ``gpu`` marker: such tests skip cleanly where CUDA is not available.
* NaN poisoning: in every ``gpu`` test, fresh floating-point allocations made through
  torch.empty / empty_like / empty_strided / new_empty are filled with NaN, so an output
  element a kernel never writes cannot pass a comparison.
* ``rng``: a fresh NumPy generator per test (seeded from the test id and the clock, and
  printed on failure) so every run sees new random inputs.
* ``fresh_plans``: forget ops.chunk's memoised plans before and after a test, for tests
  that monkeypatch the arch's rules (codegen.arch.sm90.forward / stages constants).
"""
import json
import os
import time
import zlib
from pathlib import Path

import numpy as np
import pytest


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests
        return False


#: markers of the exhaustive suite's tests, deselected by default (``--exhaustive`` runs
#: them; a test marked ``representative`` too stays in the default run)
EXHAUSTIVE = ("compile", "slow")

#: the long reference sweeps (seconds a case on two cores), marked ``slow`` here in one
#: place: test -> the parameter ids the default run keeps (one or two representatives);
#: () marks every case. A case added to a listed sweep goes to the exhaustive suite.
SLOW_SWEEPS = {
    "test_additive_bwd.py::test_training_matches_fp64_autograd":
        ("gla-v-first-saved-walk", "scalar-GVA2-varlen-recomputed-scan"),
    "test_additive_bwd.py::test_value_gate_trains_through_its_twin": ("gv-T63-v-first",),
    "test_additive_bwd.py::test_family_functions_train": (),
    "test_additive_bwd.py::test_contract_matches_reference":
        ("walk-1-63-3-32-64-False", "scan-2-64-1-64-32-True"),
    "test_autograd.py::test_gradients_match_fp64_autograd": ("B1-T65-h0-dht",),
    "test_autograd.py::test_gdn_gradients_match_fp64_autograd": ("T64-GVA2-gik",),
    "test_autograd.py::test_gdn_bf16_gate_gradient_through_rounding_emulators": (),
    "test_chunk_bwd.py::test_backward_plumbing_and_stage_math":
        ("1-3-63-64-128", "1-1-65-128-64"),
    "test_chunk_prepare_split.py::test_prepare_math_against_fp64_reference": ("deltanet-3",),
    "test_chunk_walk.py::test_walk_pipeline_matches_reference":
        ("model-gdn", "L2-deltanet-options", "L1-gdn-weak"),
    "test_chunk_walk.py::test_walk_saves_every_chunks_state": ("model-gdn",),
    "test_chunk_additive.py::test_split_matches_reference": ("additive_scalar-segments2",),
    "test_chunk_additive.py::test_split_is_exact": ("2-tile1-additive_none",),
    "test_chunk_additive.py::test_split_states_match_reference":
        ("kv-gla-config2", "vfirst-gla-config2"),
    "test_chunk_additive.py::test_gpu_step_cases_bind": (),
    "test_chunk_fused.py::test_pipeline_matches_reference":
        ("additive_none-plain-fused", "gla-state_v_first-3stage", "kda-plain-3stage"),
    "test_chunk_fused.py::test_delta_three_stage_matches_reference": ("gdn-plain",),
    "test_chunk_fused.py::test_delta_three_stage_at_narrow_heads": ("64-48",),
    "test_distributed.py::test_gloo_processes_match_single_process": (),
    "test_distributed.py::test_gloo_processes_gradients_match_single_process": ("gla-2-gloo",),
    "test_value_gate_chunk.py::test_pipeline_matches_reference": ("l2norm_qk-H2-HV4-K128-V32",),
    "test_value_gate_chunk.py::test_states_match_reference": ("kv",),
    "test_dropin.py::test_additive_keys_past_256_train_in_key_blocks": (),
    "test_kda_bwd.py::test_training_matches_fp64_autograd": ("lower-bound",),
    "test_kda_bwd.py::test_token_first_rebuild_stages_match_reference": ("whole-GVA2",),
    "test_kda_bwd.py::test_stages_token_first_match_reference": ("cu0-1-2-64-64-dtype0",),
    "test_symbolic.py::test_full_differentiation_matches_steps": ("delta_scalar",),
    "test_symbolic.py::test_symbolic_varlen_and_dims": ("delta_scalar-K3-V2-HV2",),
}


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="also run the exhaustive tests: every sm_90a compile (marker "
                          "'compile') and the long reference sweeps (marker 'slow'); "
                          "without it they are deselected but for one representative each")
    parser.addoption("--arch", default=None,
                     help="GPU tests: plan every call for this arch (codegen.arch.ARCHES) "
                          "instead of the device's, e.g. --arch sm80 on Hopper (the sm80 "
                          "kernels' compute_80 PTX runs there); see force_arch")


def pytest_collection_modifyitems(config, items):
    _mark_slow_sweeps(items)
    _deselect_exhaustive(config, items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _mark_slow_sweeps(items):
    """Mark SLOW_SWEEPS's cases ``slow`` but for the representatives each keeps."""
    for item in items:
        test, _, param = item.nodeid.partition("[")
        keep = SLOW_SWEEPS.get(test.split("/")[-1])
        if keep is not None and param.rstrip("]") not in keep:
            item.add_marker(pytest.mark.slow)


def _deselect_exhaustive(config, items):
    """The default run (fast): tests marked compile / slow are deselected unless marked
    representative, --exhaustive is given, a -m expression selects by marker itself, or
    the test was named on the command line (path::test)."""
    if config.getoption("exhaustive") or config.getoption("markexpr"):
        return
    named = _named_tests(config)
    drop = [it for it in items if any(m in it.keywords for m in EXHAUSTIVE)
            and "representative" not in it.keywords
            and not any(it.nodeid == n or it.nodeid.startswith((n + "[", n + "::"))
                        for n in named)]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if id(it) not in dropped]


def _named_tests(config) -> list:
    """Node ids (relative to the root) of the tests named on the command line."""
    out = []
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        if sep:
            rel = Path(path).resolve().relative_to(config.rootpath).as_posix()
            out.append(f"{rel}::{rest}")
    return out


def _poisoned(fn):
    import torch

    def wrapper(*args, **kwargs):
        t = fn(*args, **kwargs)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            t.fill_(float("nan"))
        return t
    wrapper.__wrapped__ = fn
    return wrapper


@pytest.fixture(autouse=True)
def nan_poison(request, monkeypatch):
    """Fill new float allocations with NaN inside GPU tests."""
    if "gpu" not in request.keywords:
        yield
        return
    import torch
    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, _poisoned(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
    yield


@pytest.fixture
def fresh_plans():
    """ops.chunk memoises plans per (arch, problem, config): a test that patches the arch's
    rules must not see (or leave behind) plans made under other rules."""
    from linattn.ops import chunk
    chunk._plan.cache_clear()
    yield
    chunk._plan.cache_clear()


def _force(name: str, setitem) -> None:
    """Every CUDA device's entry of ops.runtime's arch table set to ``name``."""
    import torch
    from linattn.codegen.arch import get_arch
    from linattn.ops import runtime
    get_arch(name)                              # (a clear error for an unknown name)
    for index in range(torch.cuda.device_count()):
        setitem(runtime._ARCH_BY_DEVICE, index, name)


@pytest.fixture(scope="session", autouse=True)
def forced_arch(request):
    """--arch NAME: the whole session's calls planned for NAME (every GPU test through that
    arch's kernels); the device's own arch without it."""
    name = request.config.getoption("--arch")
    if not name or not _cuda_available():
        yield name
        return
    mp = pytest.MonkeyPatch()
    _force(name, mp.setitem)
    yield name
    mp.undo()


@pytest.fixture
def force_arch(monkeypatch):
    """``force_arch("sm80")``: this test's calls planned for that arch on every CUDA device,
    whatever its compute capability (ops.runtime resolves a call's arch from its device
    once per device; the test sets that table's entries, undone after the test). The
    product has no such knob: a call's arch is its device's."""
    return lambda name: _force(name, monkeypatch.setitem)


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("LINATTN_SEED", "0")) or (
        zlib.crc32(request.node.nodeid.encode()) ^ time.time_ns()) & 0xFFFFFFFF
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed} (rerun with LINATTN_SEED={seed})")
    return np.random.default_rng(seed)


def write_summary(name: str, doc) -> str | None:
    """Write a GPU test module's JSON summary to $OUT_DIR (else $OUT) as <name>.json, or
    <name>_<worker>.json under pytest-xdist so workers do not overwrite each other.
    Returns the path, or None when neither variable is set."""
    out = os.environ.get("OUT_DIR") or os.environ.get("OUT")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = os.path.join(out, f"{name}_{worker}.json" if worker else f"{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


#: relative error limits of the GPU gradient checks (vs fp64)
GRAD_TOL = {"bfloat16": 1e-2, "float16": 5e-3}


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in fp64 (torch tensors); NaN when x holds a NaN."""
    import torch
    x, ref = x.to(torch.float64), ref.to(torch.float64)
    if torch.isnan(x).any():
        return float("nan")
    den = torch.linalg.norm(ref)
    return float(torch.linalg.norm(x - ref) / (den if den > 0 else 1.0))


def token_sum_scale(terms, n: int) -> float:
    """The scale a gradient of n entries that is a sum over tokens (g_gamma, dt_bias,
    A_log) is judged at: its terms can cancel, so its error is measured against the norm
    of the sums of |terms| (terms [B, T, ...], the fp64 reference's per-token terms; every
    axis past the tokens that the n entries do not keep is summed too)."""
    import torch
    mag = terms.detach().to(torch.float64).abs().sum(dim=(0, 1)).reshape(n, -1).sum(-1)
    return float(torch.linalg.norm(mag))


def token_sum_err(got, want, terms) -> float:
    """||got - want|| / token_sum_scale(terms): the error of a token-sum gradient."""
    import torch
    diff = got.to(torch.float64) - want.to(torch.float64)
    return float(torch.linalg.norm(diff)) / token_sum_scale(terms, got.numel())


def assert_token_sum_of(total, per_token, terms, what: str):
    """total (a gradient summed over tokens) is the token sum of per_token [B, T, ...]
    (linattn's own, checked on its own) to f32 rounding, at token_sum_scale(terms)."""
    import torch
    own = per_token.to(torch.float64).sum(dim=(0, 1)).reshape(-1)
    gap = token_sum_err(total.reshape(-1), own, terms)
    assert gap < 1e-5, (f"{what} vs the token sum of its terms' gradient", gap)


def record_errors(results: list, test: str, p: dict, errs: dict, seed, **extra):
    """Append one GPU check (its relative errors against GRAD_TOL[p["dtype"]]) to a test
    module's results, print it, and fail on any error over the limit (NaN fails too)."""
    import math
    tol = GRAD_TOL[p["dtype"]]
    ok = all(e < tol for e in errs.values())       # NaN compares False
    results.append(dict(test=test, **p, **extra, seed=seed, tol=tol, passed=ok,
                        errors={n: (None if math.isnan(e) else e) for n, e in errs.items()}))
    print(test, p, {n: f"{e:.2e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"{test}: rel errors over {tol}: {bad}"
