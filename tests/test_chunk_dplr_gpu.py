"""GPU correctness of the dplr rule's chunked forward (chunk_prepare_dplr, or without a
decay chunk_prepare_iplr, then chunk_state_dplr; codegen/arch/sm90/dplr.py): the public
chunk_* functions, and a GVA call through run_chunk_forward, against the fp64 NumPy recurrence
(RWKV-7-like inputs as tests/test_dplr_gpu.py's; ||out - ref|| / ||ref|| below 1e-2 bf16,
5e-3 f16). Each case also asserts the chunked stages ran (not the recurrent kernel).

    python3 -m pytest -q tests/test_chunk_dplr_gpu.py          (skips without a GPU)
"""
import numpy as np
import pytest

import linattn
from linattn.dsl import Options
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec
from test_dplr_gpu import TOL, _case, _rel, fla_args

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


@pytest.fixture
def launched(monkeypatch):
    """The stages launched, in order."""
    from linattn.ops import runtime
    seen, real = [], runtime.launch_kernel

    def spy(spec, arch, stage, *a, **kw):
        seen.append(stage)
        return real(spec, arch, stage, *a, **kw)
    monkeypatch.setattr(runtime, "launch_kernel", spy)
    return seen


@pytest.mark.parametrize("fn, fam", [("chunk_dplr_delta_rule", "dplr"),
                                     ("chunk_iplr_delta_rule", "iplr"),
                                     ("chunk_rwkv7", "dplr")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 300, 4, 64, 64), (2, 200, 2, 128, 128),
                                   (1, 1000, 2, 128, 64), (2, 64, 2, 64, 128)],
                         ids=["varlen-64", "B2-128", "varlen-long", "one-chunk"])
def test_public_chunked_against_fp64(launched, fn, fam, dtype, shape):
    B, T, H, K, V = shape
    cu = [0, T // 3, T // 3 + 1, T] if B == 1 else None
    x, t = _case(fam, B, T, H, K, V, dtype, cu=cu)
    scale = 1.0 if fn == "chunk_rwkv7" else None
    want_o, want_h = recurrent_forward(get_spec(fam), scale=scale, **x)
    o, ht = getattr(linattn, fn)(*fla_args(fn, fam, t), initial_state=t["initial_state"],
                                 output_final_state=True, cu_seqlens=t.get("cu_seqlens"))
    prepare = "chunk_prepare_iplr" if fam == "iplr" else "chunk_prepare_dplr"
    assert launched == [prepare, "chunk_state_dplr"], launched
    assert _rel(o, want_o) < TOL[dtype], _rel(o, want_o)
    assert _rel(ht, want_h) < TOL[dtype], _rel(ht, want_h)


@pytest.mark.parametrize("name", ["dplr", "iplr"])
def test_gva_probe_against_fp64(name):
    """H = 2 key heads, HV = 4 value heads, no initial state."""
    from linattn.ops import chunk
    spec, rng = get_spec(name), np.random.default_rng(3)
    cu = [0, 130, 131, 400]
    x = random_inputs(spec, Options(), 1, 400, 2, 4, 128, 64, rng, cu_seqlens=cu)
    x["initial_state"] = None
    t = {n: None if a is None or n == "cu_seqlens" else torch.tensor(a).cuda()
         for n, a in x.items()}
    for n in "qkvabg":
        if t[n] is not None:
            t[n] = t[n].to(torch.float32 if n == "g" else torch.bfloat16)
            x[n] = t[n].double().cpu().numpy()
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    o, ht = chunk.run_chunk_forward(spec, t["q"], t["k"], t["v"], t["g"], None, None, None,
                                    True, Options(), cu_t, cu_t.cpu(),
                                    rule_inputs={"a": t["a"], "b": t["b"]})
    want_o, want_h = recurrent_forward(spec, **x)
    assert _rel(o, want_o) < TOL["bfloat16"] and _rel(ht, want_h) < TOL["bfloat16"]
