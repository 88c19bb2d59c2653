"""Gated DeltaNet's backward (scalar gate), the NumPy chunked reference
(dsl/chunked_bwd.py) against torch.autograd of the fp64 token-by-token recurrence
(dsl/torch_reference.py): the formulas the gated backward kernels implement, before any
kernel. Realistic ranges: q, k l2-normalised, g = logsigmoid(x) / 8 (and a fast decay),
beta = sigmoid(x); GVA, varlen, h0 and dht, gate-in-kernel (A_log, dt_bias)."""
import numpy as np
import pytest
import torch

from linattn.dsl import Options
from linattn.dsl import torch_reference as tref
from linattn.dsl.chunked_bwd import chunked_backward
from linattn.ops.gdn import SPEC

F64 = torch.float64


def _inputs(seed, B, T, H, HV, K, V, N, gdiv, gate_in_kernel):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    x = dict(q=q, k=k, v=r(B, T, HV, V), beta=torch.sigmoid(r(B, T, HV)),
             initial_state=r(N, HV, K, V))
    if gate_in_kernel:
        x.update(g=r(B, T, HV), A_log=torch.log(torch.rand(HV, generator=g, dtype=F64) * 4 + .5),
                 dt_bias=r(HV) * 0.5)
    else:
        x["g"] = torch.nn.functional.logsigmoid(r(B, T, HV)) / gdiv
    return x, r(B, T, HV, V), r(N, HV, K, V)


CASES = [
    pytest.param(1, 64, 1, 1, 16, 8, None, 8, False, id="T64"),
    pytest.param(2, 130, 2, 4, 16, 8, None, 8, False, id="B2-T130-GVA2"),
    pytest.param(1, 100, 1, 2, 8, 16, [0, 1, 40, 57, 100], 1, False, id="varlen-fastdecay"),
    pytest.param(2, 70, 2, 2, 16, 8, None, 8, True, id="gate-in-kernel"),
]


@pytest.mark.parametrize("B, T, H, HV, K, V, cu, gdiv, gik", CASES)
def test_chunked_backward_matches_torch_autograd(B, T, H, HV, K, V, cu, gdiv, gik):
    N = B if cu is None else len(cu) - 1
    x, do, dht = _inputs(7 + T, B, T, H, HV, K, V, N, gdiv, gik)
    opts = Options(l2norm_qk=True, gate_in_kernel=gik)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    cu_t = None if cu is None else torch.tensor(cu)
    o, ht = tref.recurrent_forward(SPEC, options=opts, cu_seqlens=cu_t, **leaves)
    ((o * do).sum() + (ht * dht).sum()).backward()
    got = chunked_backward(SPEC, **{n: t.numpy() for n, t in x.items()}, do=do.numpy(),
                           dht=dht.numpy(), options=opts, cu_seqlens=None if cu is None
                           else np.array(cu), chunk_size=64)
    names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0",
                 A_log="dA_log", dt_bias="ddt_bias")
    for n, t in leaves.items():
        want = t.grad.numpy()
        err = np.linalg.norm(got[names[n]] - want) / np.linalg.norm(want)
        assert err < 1e-10, (n, err)
