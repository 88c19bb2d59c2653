"""The call terms around a training call's kernels (ops/terms.py), on the CPU: the value
scale and the skip term as one-pass autograd Functions give, bit for bit, what
dsl/call_terms.py's torch expressions give at float32 (forward and every gradient), and
they make no float32 copy of an x-sized tensor beyond the products their reductions
need (ds over V, dD over the tokens)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linattn.dsl import call_terms
from linattn.ops import mamba2, terms

BF, F32 = torch.bfloat16, torch.float32


def _inputs(z, D_shape, seed=3, Bn=2, T=37, HV=4, V=8):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    p = dict(x=r(Bn, T, HV, V).to(BF), dt=r(Bn, T, HV) - 1.0, A=-torch.rand(HV, generator=gen),
             dt_bias=0.5 * r(HV), D=r(*D_shape(HV, V)), z=r(Bn, T, HV, V).to(BF) if z else None,
             o=r(Bn, T, HV, V).to(BF))
    return {n: None if t is None else t.requires_grad_(True) for n, t in p.items()}


def _step(p, gate_and_value, epilogue):
    """One call's terms around a stand-in for the kernels (o + v' read back as 16 bits:
    the additive call's output in x's dtype, depending on v')."""
    lim = (0.01, 2.0)
    if gate_and_value is terms.gate_and_value:
        v, g = gate_and_value(mamba2.SPEC, p["x"], p["dt"], p["A"], p["dt_bias"], True, lim)
    else:
        v, g = gate_and_value(mamba2.SPEC, p["x"], p["dt"], p["A"], p["dt_bias"], True, lim,
                              dtype=F32)
    o = (p["o"] + v * g.exp().unsqueeze(-1).to(BF)).to(BF)
    if epilogue is terms.epilogue:
        return epilogue(mamba2.SPEC, o, p["x"], p["D"], p["z"], BF)
    return epilogue(mamba2.SPEC, o, p["x"], p["D"], p["z"]).to(BF)


@pytest.mark.parametrize("z", [False, True], ids=["no-z", "z"])
@pytest.mark.parametrize("D_shape", [lambda HV, V: (HV,), lambda HV, V: (HV, V)],
                         ids=["D-heads", "D-channels"])
def test_terms_are_dsl_s_float32_expressions_bit_for_bit(z, D_shape):
    got_p, want_p = _inputs(z, D_shape), _inputs(z, D_shape)
    y = _step(got_p, terms.gate_and_value, terms.epilogue)
    want = _step(want_p, call_terms.gate_and_value, call_terms.epilogue)
    assert y.dtype == want.dtype == BF and torch.equal(y, want)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(BF)
    names = [n for n, t in got_p.items() if t is not None]
    got = torch.autograd.grad(y, [got_p[n] for n in names], dy)
    ref = torch.autograd.grad(want, [want_p[n] for n in names], dy)
    for n, a, b in zip(names, got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), n


class _Float32Copies(TorchDispatchMode):
    """Counts the ops whose output is a float32 tensor of ``numel`` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == F32 and t.numel() == self.numel:
                self.ops.append(func.overloadpacket.__name__)
        return out


def test_terms_make_no_float32_copies_but_the_reductions_products():
    p = _inputs(False, lambda HV, V: (HV,))
    with _Float32Copies(p["x"].numel()) as seen:
        y = _step(p, terms.gate_and_value, terms.epilogue)
        y.backward(torch.ones_like(y))
    assert sorted(seen.ops) == ["addcmul", "addcmul"], seen.ops     # ds's and dD's products
