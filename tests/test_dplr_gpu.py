"""GPU correctness of DPLR's, IPLR's and RWKV-7's public functions (the generated
recurrent kernels: decode, short and long sequences, varlen) against the fp64 NumPy
recurrence of the dplr rule, and against fla's functions where fla is installed.
RWKV-7-like inputs (a = -kk, b = kk * sigmoid(.), kk unit keys: a contractive
transition). Inputs rounded to the kernel dtype first; ||out - ref|| / ||ref|| below 1e-2
(bf16) / 5e-3 (f16); outputs NaN-poisoned by conftest.

    python3 -m pytest -q tests/test_dplr_gpu.py          (skips without a GPU)
"""
import numpy as np
import pytest

import linattn
from linattn.dsl import Options
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-4}


def _rel(a, b):
    a, b = (x.double().cpu().numpy() if isinstance(x, torch.Tensor)
            else np.asarray(x, dtype=np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _case(fam, B, T, H, K, V, dtype, cu=None, seed=0, device="cuda"):
    """(x: NumPy fp64 inputs of the recurrence, t: the same as tensors on ``device``, g and
    the initial state f32, the rest in ``dtype``; IPLR has no g)."""
    rng = np.random.default_rng(seed)
    x = random_inputs(get_spec(fam), Options(), B, T, H, H, K, V, rng, cu_seqlens=cu)
    kk = x["a"]                                          # unit keys
    x["a"], x["b"] = -kk, kk / (1.0 + np.exp(-rng.standard_normal(kk.shape[:3] + (1,))))
    dt, t = getattr(torch, dtype), {}
    for n, a in x.items():
        if a is None or n == "cu_seqlens":
            continue
        t[n] = torch.tensor(a).to(torch.float32 if n in ("g", "initial_state") else dt)
        t[n] = t[n].to(device)
        x[n] = t[n].double().cpu().numpy()
    if cu is not None:
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    return x, t


#: test_against_fla's functions: name -> family
FLA_FUNCTIONS = {"chunk_rwkv7": "dplr", "fused_recurrent_rwkv7": "dplr",
                 "chunk_dplr_delta_rule": "dplr", "fused_recurrent_iplr_delta_rule": "iplr"}


def fla_args(fn, fam, t) -> tuple:
    """``fn``'s positional tensors in fla's order from _case's ``t`` (of family ``fam``):
    RWKV-7 (r, w, k, v, a, b), DPLR (q, k, v, a, b, gk), IPLR (q, k, v, a, b: no gate)."""
    q, k, v, a, b = (t[n] for n in ("q", "k", "v", "a", "b"))
    if "rwkv7" in fn:
        return q, t["g"], k, v, a, b
    return (q, k, v, a, b, t["g"]) if fam == "dplr" else (q, k, v, a, b)


@pytest.mark.parametrize("fn, fam", [
    ("chunk_dplr_delta_rule", "dplr"), ("fused_recurrent_dplr_delta_rule", "dplr"),
    ("chunk_iplr_delta_rule", "iplr"), ("fused_recurrent_iplr_delta_rule", "iplr"),
    ("chunk_rwkv7", "dplr"), ("fused_recurrent_rwkv7", "dplr")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(2, 1, 4, 64, 64), (1, 300, 4, 64, 64),
                                   (2, 65, 2, 128, 128), (1, 40, 2, 100, 72)])
def test_against_fp64(fn, fam, dtype, shape):
    B, T, H, K, V = shape
    cu = [0, T // 3, T] if B == 1 and T > 2 else None
    x, t = _case(fam, B, T, H, K, V, dtype, cu=cu)
    scale = 1.0 if fn == "chunk_rwkv7" else None
    want_o, want_h = recurrent_forward(get_spec(fam), scale=scale, **x)
    kw = dict(initial_state=t["initial_state"], output_final_state=True,
              cu_seqlens=t.get("cu_seqlens"))
    args = fla_args(fn, fam, t)
    before = [z.clone() for z in args]
    o, ht = getattr(linattn, fn)(*args, **kw)
    torch.cuda.synchronize()
    assert _rel(o.cpu(), want_o) < TOL[dtype]
    assert _rel(ht.cpu(), want_h) < TOL[dtype]
    assert all(torch.equal(z, y) for z, y in zip(before, args))


@pytest.mark.parametrize("fn", list(FLA_FUNCTIONS))
def test_against_fla(fn):
    """fla's own function on the same inputs (RWKV-7 1.5B-7B heads: K = V = 64): both
    against the fp64 recurrence, linattn's error within 1.5 x fla's (or 1e-2); fla's below
    5e-2, so that the bound means something (inputs read alike)."""
    pytest.importorskip("fla.ops")
    import fla.ops.generalized_delta_rule as gdr
    import fla.ops.rwkv7 as rwkv7
    fam = FLA_FUNCTIONS[fn]
    x, t = _case(fam, 2, 256, 4, 64, 64, "bfloat16")
    args = fla_args(fn, fam, t)
    kw = dict(initial_state=t["initial_state"], output_final_state=True)
    o, ht = getattr(linattn, fn)(*args, **kw)
    theirs = getattr(rwkv7 if "rwkv7" in fn else gdr, fn)
    fo, fht = theirs(*args, **kw)
    want_o, want_h = recurrent_forward(get_spec(fam), scale=1.0 if fn == "chunk_rwkv7"
                                       else None, **x)
    errs = {"o": (_rel(o.cpu(), want_o), _rel(fo.float().cpu(), want_o)),
            "ht": (_rel(ht.cpu(), want_h), _rel(fht.float().cpu(), want_h))}
    print(f"{fn}: (linattn, fla) errors vs fp64 {errs}")
    for ours, fla_err in errs.values():
        assert fla_err < 5e-2
        assert ours <= max(1e-2, 1.5 * fla_err)
