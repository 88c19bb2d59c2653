"""GPU correctness of GDN-2's public functions (the generated recurrent kernel: decode,
short and long sequences, varlen, state pools) against the fp64 NumPy recurrence of the
gdn2 rule, and against fla's chunk_gdn2 / fused_recurrent_gdn2 where fla is installed.
Inputs rounded to the kernel dtype first; ||out - ref|| / ||ref|| below 1e-2 (bf16) /
5e-3 (f16) for o and the final state; outputs NaN-poisoned by conftest.

    python3 -m pytest -q tests/test_gdn2_gpu.py          (skips without a GPU)
"""
import numpy as np
import pytest

import linattn
from linattn.dsl import Options
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SPEC = get_spec("gdn2")
TOL = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-4}


def _rel(a, b):
    a, b = (x.double().cpu().numpy() if isinstance(x, torch.Tensor)
            else np.asarray(x, dtype=np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _case(opts, B, T, H, HV, K, V, dtype, cu=None, seed=0, gate_dtype=torch.float32,
          dev="cuda"):
    x = random_inputs(SPEC, opts, B, T, H, HV, K, V, np.random.default_rng(seed),
                      cu_seqlens=cu)
    dt, t = getattr(torch, dtype), {}
    for n, a in x.items():
        if a is None or n == "cu_seqlens":
            continue
        kind = dt if n in ("q", "k", "v") else gate_dtype if n in "gbw" else torch.float32
        t[n] = torch.tensor(a).to(kind).to(dev)
        x[n] = t[n].double().cpu().numpy()
    if cu is not None:
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32).to(dev)
    return x, t


FNS = ["chunk_gdn2", "fused_recurrent_gdn2"]
DTYPES = ["bfloat16", "float16", "float32"]
SHAPES = [(2, 1, 2, 4, 128, 128), (1, 300, 2, 4, 64, 128), (2, 65, 4, 4, 128, 64),
          (1, 40, 1, 2, 100, 72)]
FLAGS = [(False, False, False), (True, True, True)]
#: the three-stage pipeline (8 chains), and the fused state + output pass (16 chains)
LONG = [((1, 1000, 2, 4, 128, 128), [0, 333, 1000]), ((2, 257, 4, 4, 64, 64), None),
        ((4, 200, 2, 4, 128, 128), None)]
NAMES = ("q", "k", "v", "g", "b", "w")


def _fp64_call(dtype, shape, l2norm, v_first, gate_in_kernel, dev="cuda"):
    """(x, t, kw, opts) of test_against_fp64's case."""
    B, T, H, HV, K, V = shape
    opts = Options(l2norm_qk=l2norm, state_v_first=v_first, gate_in_kernel=gate_in_kernel)
    cu = [0, T // 3, T] if B == 1 and T > 2 else None
    x, t = _case(opts, B, T, H, HV, K, V, dtype, cu=cu, gate_dtype=getattr(torch, dtype),
                 dev=dev)
    kw = dict(initial_state=t["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=l2norm, cu_seqlens=t.get("cu_seqlens"),
              state_v_first=v_first)
    if gate_in_kernel:
        kw.update(use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"])
    return x, t, kw, opts


def _long_call(gate_dtype, shape, cu, dev="cuda"):
    """(x, t, kw, opts) of test_chunked_kernels' case."""
    opts = Options(l2norm_qk=True)
    x, t = _case(opts, *shape, "bfloat16", cu=cu, seed=5, gate_dtype=gate_dtype, dev=dev)
    kw = dict(initial_state=t["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=t.get("cu_seqlens"))
    return x, t, kw, opts


def precompile_jobs(items=None, device="cuda"):
    """The (spec, stage, arch, params) jobs of this module's chunk_gdn2 /
    fused_recurrent_gdn2 calls (every test's; items unused), recorded from dry calls on
    ``device`` (tests/_cpu_plan.py: "cpu" lists them without a GPU)."""
    from _cpu_plan import dry_jobs
    calls = [(fn, _fp64_call(d, s, *f, dev=device)) for fn in FNS for d in DTYPES
             for s in SHAPES for f in FLAGS]
    calls += [("chunk_gdn2", _long_call(gd, *c, dev=device))
              for gd in (torch.float32, torch.bfloat16) for c in LONG]
    _, t = _case(Options(), 2, 200, 4, 4, 128, 128, "bfloat16", gate_dtype=torch.bfloat16,
                 dev=device)
    calls += [(fn, (None, t, dict(initial_state=t["initial_state"], output_final_state=True),
                    None)) for fn in FNS]                               # (test_against_fla)
    return dry_jobs([(fn, [t[n] for n in NAMES], kw) for fn, (_, t, kw, _) in calls])


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
@pytest.mark.parametrize("l2norm, v_first, gate_in_kernel", FLAGS)
def test_against_fp64(fn, dtype, shape, l2norm, v_first, gate_in_kernel):
    x, t, kw, opts = _fp64_call(dtype, shape, l2norm, v_first, gate_in_kernel)
    want_o, want_h = recurrent_forward(SPEC, options=opts, **x)
    ins = [t[n] for n in NAMES]
    before = [a.clone() for a in ins]
    o, ht = getattr(linattn, fn)(*ins, **kw)
    torch.cuda.synchronize()
    assert _rel(o.cpu(), want_o) < TOL[dtype]
    assert _rel(ht.cpu(), want_h) < TOL[dtype]
    assert all(torch.equal(a, b) for a, b in zip(before, ins))


def test_state_pool_in_place():
    x, t = _case(Options(), 1, 4, 2, 4, 128, 128, "bfloat16", cu=[0, 1, 2, 3, 4], seed=3)
    pool = torch.randn(9, 4, 128, 128, device="cuda")
    slots = torch.tensor([7, -1, 2, 4], dtype=torch.int32, device="cuda")
    want = pool.double().cpu().numpy()
    o, ht = linattn.fused_recurrent_gdn2(*(t[n] for n in ("q", "k", "v", "g", "b", "w")),
                                         initial_state=pool, cu_seqlens=t["cu_seqlens"],
                                         ssm_state_indices=slots, inplace_final_state=True)
    torch.cuda.synchronize()
    assert ht is pool
    for n, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.all(o[:, n] == 0)
            continue
        sl = {k: x[k][:, n:n + 1] for k in ("q", "k", "v", "g", "b", "w")}
        ro, rh = recurrent_forward(SPEC, **sl, initial_state=want[s:s + 1])
        assert _rel(o[:, n:n + 1].cpu(), ro) < 1e-2
        assert _rel(pool[s:s + 1].cpu(), rh) < 1e-2


@pytest.mark.parametrize("fn", ["chunk_gdn2", "fused_recurrent_gdn2"])
def test_against_fla(fn):
    """fla's own function on the same inputs (bf16 q, k, v, g, b, w)."""
    fla = pytest.importorskip("fla.ops.gdn2")
    x, t = _case(Options(), 2, 200, 4, 4, 128, 128, "bfloat16", gate_dtype=torch.bfloat16)
    ins = [t[n] for n in ("q", "k", "v", "g", "b", "w")]
    kw = dict(initial_state=t["initial_state"], output_final_state=True)
    o, ht = getattr(linattn, fn)(*ins, **kw)
    fo, fht = getattr(fla, fn)(*ins, **kw)
    want_o, want_h = recurrent_forward(SPEC, **x)
    assert _rel(o.cpu(), want_o) <= max(1e-2, 1.5 * _rel(fo.float().cpu(), want_o))
    assert _rel(ht.cpu(), want_h) <= max(1e-2, 1.5 * _rel(fht.float().cpu(), want_h))


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, cu", LONG)
def test_chunked_kernels(monkeypatch, gate_dtype, shape, cu):
    """chunk_gdn2 runs the chunked kernels (the per-key prepare with the erase vector b . k
    and the written value w . v) on long and ragged sequences, b and w in f32 or bf16,
    against the fp64 recurrence."""
    from linattn.ops import library
    ran, real = [], library.run
    monkeypatch.setattr(library, "run", lambda spec, path, *a, **kw: ran.append(path) or
                        real(spec, path, *a, **kw))
    x, t, kw, opts = _long_call(gate_dtype, shape, cu)
    want_o, want_h = recurrent_forward(SPEC, options=opts, **x)
    o, ht = linattn.chunk_gdn2(*(t[n] for n in NAMES), **kw)
    torch.cuda.synchronize()
    assert ran == ["chunk"]
    assert _rel(o.cpu(), want_o) < TOL["bfloat16"]
    assert _rel(ht.cpu(), want_h) < TOL["bfloat16"]
