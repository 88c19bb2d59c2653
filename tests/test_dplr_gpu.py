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


def _case(fam, B, T, H, K, V, dtype, cu=None, seed=0):
    rng = np.random.default_rng(seed)
    x = random_inputs(get_spec(fam), Options(), B, T, H, H, K, V, rng, cu_seqlens=cu)
    kk = x["a"]                                          # unit keys
    x["a"], x["b"] = -kk, kk / (1.0 + np.exp(-rng.standard_normal(kk.shape[:3] + (1,))))
    dt, t = getattr(torch, dtype), {}
    for n, a in x.items():
        if a is None or n == "cu_seqlens":
            continue
        t[n] = torch.tensor(a).to(torch.float32 if n in ("g", "initial_state") else dt).cuda()
        x[n] = t[n].double().cpu().numpy()
    if cu is not None:
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32).cuda()
    return x, t


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
    q, k, v, a, b = (t[n] for n in ("q", "k", "v", "a", "b"))
    before = [z.clone() for z in (q, k, v, a, b)]
    if "rwkv7" in fn:
        o, ht = getattr(linattn, fn)(q, t["g"], k, v, a, b, **kw)
    else:
        o, ht = getattr(linattn, fn)(q, k, v, a, b, *([t["g"]] if fam == "dplr" else []), **kw)
    torch.cuda.synchronize()
    assert _rel(o.cpu(), want_o) < TOL[dtype]
    assert _rel(ht.cpu(), want_h) < TOL[dtype]
    assert all(torch.equal(z, y) for z, y in zip(before, (q, k, v, a, b)))


@pytest.mark.parametrize("fn", ["chunk_rwkv7", "fused_recurrent_rwkv7",
                                "chunk_dplr_delta_rule", "fused_recurrent_iplr_delta_rule"])
def test_against_fla(fn):
    """fla's own function on the same inputs (RWKV-7 1.5B-7B heads: K = V = 64)."""
    pytest.importorskip("fla.ops")
    import fla.ops.generalized_delta_rule as gdr
    import fla.ops.rwkv7 as rwkv7
    fam = "iplr" if "iplr" in fn else "dplr"
    x, t = _case(fam, 2, 256, 4, 64, 64, "bfloat16")
    q, k, v, a, b, g = (t[n] for n in ("q", "k", "v", "a", "b", "g"))
    args = ((q, g, k, v, a, b) if "rwkv7" in fn else
            (q, k, v, a, b) + ((g,) if fam == "dplr" else ()))
    kw = dict(initial_state=t["initial_state"], output_final_state=True)
    o, ht = getattr(linattn, fn)(*args, **kw)
    theirs = getattr(rwkv7 if "rwkv7" in fn else gdr, fn)
    fo, fht = theirs(*args, **kw)
    want_o, want_h = recurrent_forward(get_spec(fam), scale=1.0 if fn == "chunk_rwkv7"
                                       else None, **x)
    assert _rel(o.cpu(), want_o) <= max(1e-2, 1.5 * _rel(fo.float().cpu(), want_o))
    assert _rel(ht.cpu(), want_h) <= max(1e-2, 1.5 * _rel(fht.float().cpu(), want_h))
