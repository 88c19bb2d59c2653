"""GPU correctness of the DeltaNet chunk contracts (ops/contracts.py deltanet_chunk_fwd /
deltanet_chunk_bwd, the kernels of ops/chunk_bwd.py) against the fp64 torch reference
(dsl.torch_reference: chunked forward and autograd of it), on the GPU in fp64.

Per case (fresh random inputs; q, k l2-normalised, beta = sigmoid, v and do normal):
  test_backward   the backward on the reference forward's outputs (rounded to the
                  input dtype, S f32) vs the fp64 gradients: the backward's own error
                  (also with the reverse pass's tuning variants; no gate: the folded
                  form, the arch's FOLD_STAGES)
  test_forward    our forward's (o, S, Aw, w, u) vs the fp64 forward
  test_fwd_bwd    our forward then our backward vs the fp64 gradients
||x - ref|| / ||ref|| per output: < 1e-2 bf16, < 5e-3 f16; NaN never passes (outputs
are NaN-poisoned by conftest); inputs must come back unchanged. Every kernel is compiled
first in parallel processes. A JSON summary goes to $OUT_DIR (else $OUT)/chunk_bwd_gpu.json when
set (each case's errors, pass/fail).

Run: python3 -m pytest -q tests/test_chunk_bwd_gpu.py   (skips without a GPU)
"""
import math
import time

import pytest
from conftest import record_errors, rel_err, write_summary

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

F64 = torch.float64
RESULTS = []
SHORT = {"float16": "f16", "bfloat16": "bf16"}


def case(B, H, L, K, V, dtype, name=None):
    return pytest.param(dict(B=B, H=H, L=L, K=K, V=V, dtype=dtype),
                        id=name or f"B{B}-H{H}-L{L}-K{K}-V{V}-{SHORT[dtype]}")


CASES = [case(2, 4, L, 64, 64, dt, f"train-{L // 1024}k-{SHORT[dt]}")
         for L in (2048, 4096, 8192, 16384) for dt in ("float16", "bfloat16")]
CASES += [
    case(1, 16, 256, 128, 128, "bfloat16", "deltanet-1.3b-train-bf16"),
    case(2, 4, 63, 64, 64, "bfloat16"),
    case(1, 2, 65, 64, 64, "float16"),
    case(2, 2, 130, 64, 64, "bfloat16"),
    case(1, 3, 130, 128, 128, "float16"),
    case(1, 2, 1, 64, 64, "bfloat16"),
    case(1, 2, 200, 64, 128, "bfloat16"),
    case(1, 2, 200, 128, 64, "float16"),
]
#: the reverse dh pass's tuning variants (num_stages, block_v), checked on a few cases
DH_VARIANTS = [(0, 16), (1, 16), (2, 32), (0, 64)]      # the default is (2, 16) at H=4
DH_VARIANT_CASES = [CASES[2], CASES[9], CASES[10], CASES[11], CASES[12]]


def precompile_jobs(items, device="cuda"):
    """The (spec, stage, arch, params) jobs of the selected tests (``items``: this
    module's), from the plans (no tensors: ``device`` unused)."""
    from linattn.ops import chunk, chunk_bwd
    from linattn.ops.deltanet import SPEC
    fwd, bwd = [], []
    for item in items:
        if not hasattr(item, "callspec"):
            continue
        p, name = item.callspec.params["p"], item.originalname
        dims = dict(H=p["H"], K=p["K"], V=p["V"], dtype=p["dtype"], B=p["B"])
        if name in ("test_forward", "test_fwd_bwd"):
            fwd += [(SPEC, s, pr) for s, pr in
                    chunk_bwd.forward_params(**dims, L=p["L"]).items()]
        if name == "test_forward":
            continue
        extra = {}
        if name == "test_backward_dh_variants":
            extra = dict(dh={"num_stages": item.callspec.params["num_stages"],
                             "block_v": item.callspec.params["block_v"]})
        bwd.append(chunk_bwd.backward_params(**dims, **extra))
    return chunk.stage_jobs(fwd) + chunk_bwd.stage_jobs(bwd)


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    """Compile the kernels the selected tests run first (parallel processes, TileLang's
    disk cache); write the JSON summary at the end."""
    from _cpu_plan import module_items
    from linattn.ops import runtime
    t0 = time.time()
    errors = runtime.precompile(precompile_jobs(module_items(request)))
    print(f"precompiled in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  compile error:", e)
    yield
    write_summary("chunk_bwd_gpu", {"compile_errors": errors, "results": RESULTS})


_REFS = {}


def _inputs_and_refs(p, seed):
    """Inputs in the case's dtype and the fp64 forward / gradients, cached per case
    (all cases together hold a few GiB on the GPU)."""
    key = tuple(sorted(p.items()))
    if key not in _REFS:
        from linattn.dsl import torch_reference as tref
        g = torch.Generator(device="cuda").manual_seed(seed)
        B, H, L, K, V = (p[n] for n in "BHLKV")
        dt = getattr(torch, p["dtype"])
        rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=F64)  # noqa: E731
        q = torch.nn.functional.normalize(rnd(B, H, L, K), dim=-1).to(dt)
        k = torch.nn.functional.normalize(rnd(B, H, L, K), dim=-1).to(dt)
        v, do = rnd(B, H, L, V).to(dt), rnd(B, H, L, V).to(dt)
        beta = torch.sigmoid(rnd(B, H, L)).to(dt)
        fwd = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
        grads = tref.deltanet_chunk_bwd(do, q, k, v, beta)
        _REFS[key] = ((q, k, v, beta, do), fwd, grads, seed)
    return _REFS[key]


def _seed(rng):
    return int(rng.integers(1, 2**31))


@pytest.mark.parametrize("p", CASES)
def test_backward(p, rng):
    _check_backward(p, rng)


@pytest.mark.parametrize("num_stages,block_v", DH_VARIANTS,
                         ids=[f"stages{a}-bv{b}" for a, b in DH_VARIANTS])
@pytest.mark.parametrize("p", DH_VARIANT_CASES)
def test_backward_dh_variants(p, num_stages, block_v, rng):
    _check_backward(p, rng, dh={"num_stages": num_stages, "block_v": block_v},
                    dh_num_stages=num_stages, dh_block_v=block_v)


def _check_backward(p, rng, dh=None, **extra):
    """The contract backward (chunk_backward with the reverse pass's variant dh, if
    given)."""
    from linattn.ops.chunk_bwd import chunk_backward
    (q, k, v, beta, do), fwd, grads, seed = _inputs_and_refs(p, _seed(rng))
    dt = q.dtype
    _, S, Aw, Au, w, u = fwd
    args = [do, q, k, v, beta, S.float(), Aw.to(dt), Au.to(dt), w.to(dt), u.to(dt)]
    saved = [a.clone() for a in args]
    out = chunk_backward(*args, dh=dh)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(args, saved)), "inputs modified"
    for name, x, like in zip(("dq", "dk", "dv", "dbeta"), out, (q, k, v, beta)):
        assert x.shape == like.shape and x.dtype == dt, name
    record_errors(RESULTS, "backward", p, {n: rel_err(x, r) for n, x, r in
                                           zip(("dq", "dk", "dv", "dbeta"), out, grads)},
                  seed, **extra)


@pytest.mark.parametrize("p", CASES)
def test_forward(p, rng):
    from linattn.ops.contracts import deltanet_chunk_fwd
    (q, k, v, beta, do), fwd, grads, seed = _inputs_and_refs(p, _seed(rng))
    saved = [a.clone() for a in (q, k, v, beta)]
    o, S, Aw, Au, w, u = deltanet_chunk_fwd(q, k, v, beta)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, beta), saved)), "inputs modified"
    NC = math.ceil(p["L"] / 64)
    assert S.shape == (p["B"], p["H"], NC + 1, p["K"], p["V"]) and S.dtype == torch.float32
    assert torch.equal(Aw, Au)
    assert torch.equal(S[:, :, 0], torch.zeros_like(S[:, :, 0]))
    ro, rS, rA, _, rw, ru = fwd
    errs = dict(o=rel_err(o, ro), S=rel_err(S, rS), A=rel_err(Aw, rA), w=rel_err(w, rw),
                u=rel_err(u, ru))
    record_errors(RESULTS, "forward", p, errs, seed)


@pytest.mark.parametrize("p", CASES)
def test_fwd_bwd(p, rng):
    from linattn.ops.contracts import deltanet_chunk_bwd, deltanet_chunk_fwd
    (q, k, v, beta, do), fwd, grads, seed = _inputs_and_refs(p, _seed(rng))
    o, S, Aw, Au, w, u = deltanet_chunk_fwd(q, k, v, beta)
    out = deltanet_chunk_bwd(do, q, k, v, beta, S, Aw, Au, w, u)
    torch.cuda.synchronize()
    record_errors(RESULTS, "fwd_bwd", p, {n: rel_err(x, r) for n, x, r in
                                          zip(("dq", "dk", "dv", "dbeta"), out, grads)}, seed)
