"""GPU correctness of Comba's public functions (the generated recurrent kernel: decode,
short and long sequences, varlen, state pools) against the fp64 NumPy recurrence of the
comba rule, and against fla's chunk_comba / fused_recurrent_comba where fla is installed.
Inputs are rounded to the kernel dtype first; ||out - ref|| / ||ref|| below 1e-2 (bf16) /
5e-3 (f16) for o and the final state; outputs NaN-poisoned by conftest.

    python3 -m pytest -q tests/test_comba_gpu.py          (skips without a GPU)
"""
import numpy as np
import pytest

import linattn
from linattn.dsl import Options
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SPEC = get_spec("comba")
TOL = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-4}


def _rel(a, b):
    a, b = (x.double().cpu().numpy() if isinstance(x, torch.Tensor)
            else np.asarray(x, dtype=np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _case(opts, B, T, H, HV, K, V, dtype, cu=None, seed=0, dev="cuda"):
    x = random_inputs(SPEC, opts, B, T, H, HV, K, V, np.random.default_rng(seed),
                      cu_seqlens=cu)
    dt = getattr(torch, dtype)
    t = {}
    for n, a in x.items():
        if a is None or n == "cu_seqlens":
            continue
        kind = dt if n in ("q", "k", "v", "p") else torch.float32
        t[n] = torch.tensor(a).to(kind).to(dev)
        x[n] = t[n].double().cpu().numpy()          # the reference sees the rounded inputs
    if cu is not None:
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32).to(dev)
    return x, t


FNS = ["chunk_comba", "fused_recurrent_comba"]
DTYPES = ["bfloat16", "float16", "float32"]
SHAPES = [(2, 1, 2, 4, 128, 128), (1, 300, 2, 4, 64, 128), (2, 65, 4, 4, 128, 64),
          (1, 40, 1, 2, 100, 72)]
LAYOUTS = [(False, False), (True, True)]
LONG = [((1, 1000, 2, 4, 128, 128), [0, 333, 1000]), ((2, 257, 4, 4, 64, 64), None)]


def _fp64_call(fn, dtype, shape, l2norm, v_first, dev="cuda"):
    """(x, t, args, kw) of test_against_fp64's case."""
    B, T, H, HV, K, V = shape
    opts = Options(l2norm_qk=l2norm, state_v_first=v_first)
    cu = [0, T // 3, T] if B == 1 and T > 2 else None
    x, t = _case(opts, B, T, H, HV, K, V, dtype, cu=cu, dev=dev)
    kw = dict(initial_state=t["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=l2norm, cu_seqlens=t.get("cu_seqlens"),
              state_v_first=v_first)
    q, k, v, p = (t[n] for n in ("q", "k", "v", "p"))
    args = (q, k, v, p) if fn == "chunk_comba" else (q, k, p, v)
    return x, t, args + (t["g"], t["beta"]), kw


def _long_call(l2norm, shape, cu, dev="cuda"):
    """(x, t, args, kw) of test_chunked_kernels' case (beta in bf16)."""
    opts = Options(l2norm_qk=l2norm)
    x, t = _case(opts, *shape, "bfloat16", cu=cu, seed=7, dev=dev)
    t["beta"] = t["beta"].to(torch.bfloat16)
    x["beta"] = t["beta"].double().cpu().numpy()
    kw = dict(initial_state=t["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=l2norm, cu_seqlens=t.get("cu_seqlens"))
    return x, t, tuple(t[n] for n in ("q", "k", "v", "p", "g", "beta")), kw


def precompile_jobs(items=None, device="cuda"):
    """The (spec, stage, arch, params) jobs of this module's chunk_comba /
    fused_recurrent_comba calls (every test's; items unused), recorded from dry calls on
    ``device`` (tests/_cpu_plan.py: "cpu" lists them without a GPU)."""
    from _cpu_plan import dry_jobs
    calls = [(fn, _fp64_call(fn, *c, dev=device)) for fn in FNS for c in
             ((d, s, *lay) for d in DTYPES for s in SHAPES for lay in LAYOUTS)]
    calls += [("chunk_comba", _long_call(l2, *c, dev=device)) for l2 in (False, True)
              for c in LONG]
    _, t = _case(Options(), 2, 200, 4, 4, 128, 128, "bfloat16", dev=device)  # (against_fla)
    order = {"chunk_comba": "qkvp", "fused_recurrent_comba": "qkpv"}
    calls += [(fn, (None, t, tuple(t[n] for n in order[fn]) + (t["g"], t["beta"]),
                    dict(initial_state=t["initial_state"], output_final_state=True)))
              for fn in FNS]
    return dry_jobs([(fn, args, kw) for fn, (_, _, args, kw) in calls])


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """The kernels of this module's calls compiled in parallel processes first
    (precompile_jobs; TileLang's disk cache)."""
    from linattn.ops import runtime
    for e in runtime.precompile(precompile_jobs()):   # (a failed compile fails its tests)
        print("compile error:", e)
    yield


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("l2norm, v_first", LAYOUTS)
def test_against_fp64(fn, dtype, shape, l2norm, v_first):
    x, t, args, kw = _fp64_call(fn, dtype, shape, l2norm, v_first)
    want_o, want_h = recurrent_forward(SPEC, options=Options(l2norm_qk=l2norm,
                                                             state_v_first=v_first), **x)
    q, k, v, p = (t[n] for n in ("q", "k", "v", "p"))
    before = [a.clone() for a in (q, k, v, p)]
    o, ht = getattr(linattn, fn)(*args, **kw)
    torch.cuda.synchronize()
    assert _rel(o.cpu(), want_o) < TOL[dtype]
    assert _rel(ht.cpu(), want_h) < TOL[dtype]
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, p)))


def test_state_pool_in_place():
    x, t = _case(Options(), 1, 4, 2, 4, 128, 128, "bfloat16", cu=[0, 1, 2, 3, 4], seed=3)
    pool = torch.randn(9, 4, 128, 128, device="cuda")
    slots = torch.tensor([7, -1, 2, 4], dtype=torch.int32, device="cuda")
    want = pool.double().cpu().numpy()
    o, ht = linattn.fused_recurrent_comba(t["q"], t["k"], t["p"], t["v"], t["g"], t["beta"],
                                          initial_state=pool, cu_seqlens=t["cu_seqlens"],
                                          ssm_state_indices=slots, inplace_final_state=True)
    torch.cuda.synchronize()
    assert ht is pool
    for n, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.all(o[:, n] == 0)
            continue
        sl = {k: x[k][:, n:n + 1] for k in ("q", "k", "v", "g", "beta", "p")}
        ro, rh = recurrent_forward(SPEC, **sl, initial_state=want[s:s + 1])
        assert _rel(o[:, n:n + 1].cpu(), ro) < 1e-2
        assert _rel(pool[s:s + 1].cpu(), rh) < 1e-2


@pytest.mark.parametrize("fn", ["chunk_comba", "fused_recurrent_comba"])
def test_against_fla(fn):
    """fla's own function on the same inputs (H == HV, fla's chunk_comba's heads)."""
    fla = pytest.importorskip("fla.ops.comba")
    x, t = _case(Options(), 2, 200, 4, 4, 128, 128, "bfloat16")
    q, k, v, p = (t[n] for n in ("q", "k", "v", "p"))
    args = (q, k, v, p) if fn == "chunk_comba" else (q, k, p, v)
    kw = dict(initial_state=t["initial_state"], output_final_state=True)
    o, ht = getattr(linattn, fn)(*args, t["g"], t["beta"], **kw)
    fo, fht = getattr(fla, fn)(*args, t["g"], t["beta"], **kw)
    want_o, want_h = recurrent_forward(SPEC, **x)
    assert _rel(o.cpu(), want_o) <= max(1e-2, 1.5 * _rel(fo.float().cpu(), want_o))
    assert _rel(ht.cpu(), want_h) <= max(1e-2, 1.5 * _rel(fht.float().cpu(), want_h))


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("shape, cu", LONG)
def test_chunked_kernels(monkeypatch, l2norm, shape, cu):
    """chunk_comba runs the chunked kernels (the kkt inverse and w, u with p as the erase
    key under the exclusive decay; GDN's state and output stages) on long and ragged
    sequences, against the fp64 recurrence; beta in bf16."""
    from linattn.ops import library
    ran, real = [], library.run
    monkeypatch.setattr(library, "run", lambda spec, path, *a, **kw: ran.append(path) or
                        real(spec, path, *a, **kw))
    x, t, args, kw = _long_call(l2norm, shape, cu)
    want_o, want_h = recurrent_forward(SPEC, options=Options(l2norm_qk=l2norm), **x)
    o, ht = linattn.chunk_comba(*args, **kw)
    torch.cuda.synchronize()
    assert ran == ["chunk"]
    assert _rel(o.cpu(), want_o) < TOL["bfloat16"]
    assert _rel(ht.cpu(), want_h) < TOL["bfloat16"]
