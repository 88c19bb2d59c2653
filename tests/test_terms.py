"""The call terms around a training call's kernels (ops/terms.py), on the CPU: the value
scale and the skip term as one-pass autograd Functions give, bit for bit, what
dsl/call_terms.py's torch expressions give at float32 (forward and every gradient), and
they make no float32 copy of an x-sized tensor beyond the products their reductions
need (ds over V, dD over the tokens). The Function of the value scale, the call and the
skip term (terms.train; the call faked) against the fp64 expressions, and its backward's
x-sized passes."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

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


# -- the value scale, the additive call and the skip term as one Function ----------------------

def _fake_call(monkeypatch):
    """additive_bwd's call replaced by o = v' e^g (x's dtype) whose backward leaves dv' in
    f32 (as dqkvg's key blocks add it) and dg = sum_V do v' e^g; the terms' backward by
    torch (terms_backward: where dqkvg does not form them; tests/test_additive_bwd.py's
    Mamba-2 tests run dqkvg's through the stages' fakes)."""
    from linattn.ops import additive_bwd

    def run_forward(call, q, k, v, g, h0):
        return torch.mul(v, g.exp().unsqueeze(-1), out=torch.empty_like(v)), None, None

    def backward(call, q, k, v, g, h0, states, do, dht, raw_dv=False):
        assert raw_dv and states is None and dht is None
        with _disable_current_modes():      # (the kernels' work: not traced)
            e = g.exp().unsqueeze(-1)
            dv = torch.mul(do, e)                               # (f32: no cast after)
            dg = torch.addcmul(torch.zeros(1, 1, 1, 1), do, v).mul_(e).sum(-1)
        return None, None, dv, dg, None
    monkeypatch.setattr(additive_bwd, "run_forward", run_forward)
    monkeypatch.setattr(additive_bwd, "additive_backward", backward)
    monkeypatch.setattr(additive_bwd, "training_call", lambda *a, **k: "call")
    monkeypatch.setattr(additive_bwd, "dqkvg_terms", lambda *a, **k: None)


def _terms_call_step(p, lim=(0.01, 2.0)):
    q = torch.zeros(*p["x"].shape[:2], 1, 16, dtype=BF)
    y, _ = terms.train(mamba2.SPEC, mamba2._OPTS, q, q, p["x"], p["dt"], p["A"],
                       dt_bias=p["dt_bias"], dt_softplus=True, dt_limit=lim, D=p["D"],
                       z=p["z"], dtype=BF)
    return y


def _terms_call_reference(p, lim=(0.01, 2.0)):
    """The same step in fp64 by dsl/call_terms.py's expressions."""
    r = {n: None if t is None else t.detach().double().requires_grad_(True)
         for n, t in p.items()}
    v, g = call_terms.gate_and_value(mamba2.SPEC, r["x"], r["dt"], r["A"], r["dt_bias"],
                                     True, lim)
    y = call_terms.epilogue(mamba2.SPEC, v * g.exp().unsqueeze(-1), r["x"], r["D"], r["z"])
    return y, r


@pytest.mark.parametrize("z", [False, True], ids=["no-z", "z"])
@pytest.mark.parametrize("D_shape", [lambda HV, V: (HV,), lambda HV, V: (HV, V)],
                         ids=["D-heads", "D-channels"])
def test_terms_call_gradients_are_the_fp64_expressions(monkeypatch, z, D_shape):
    """terms.train's Function (the call faked) against torch autograd of dsl/call_terms.py's
    expressions in fp64: the output and the gradient of every term input."""
    _fake_call(monkeypatch)
    p = _inputs(z, D_shape, seed=11)
    del p["o"]
    y = _terms_call_step(p)
    want, r = _terms_call_reference(p)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    names = [n for n, t in p.items() if t is not None]
    got = torch.autograd.grad(y, [p[n] for n in names], dy.to(BF))
    ref = torch.autograd.grad(want, [r[n] for n in names], dy)
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    for n, a, b in zip(names, got, ref):
        assert a.dtype == p[n].dtype and a.shape == p[n].shape, n
        err = float((a.double() - b).norm() / b.norm())
        assert err < 1e-2, (n, err)


class _XSized(TorchDispatchMode):
    """Records (op, output dtype, input dtypes) of the ops writing ``numel`` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                ins = tuple(a.dtype for a in args if isinstance(a, torch.Tensor)
                            and a.numel() == self.numel)
                self.ops.append((func.overloadpacket.__name__, t.dtype, ins))
        return out


def test_terms_call_backward_casts_no_dv_and_adds_no_gradients(monkeypatch):
    """The Function's backward: dv' read in f32 as the call leaves it (no cast to x's
    dtype), dx formed as dy D into x's dtype then dv' s added to it (no autograd add of
    two gradients of x), ds's and dD's products."""
    _fake_call(monkeypatch)
    p = _inputs(False, lambda HV, V: (HV,), seed=12)
    del p["o"]
    y = _terms_call_step(p)
    dy = torch.ones_like(y)
    with _XSized(p["x"].numel()) as seen:
        y.backward(dy)
    made = [op for op in seen.ops if not op[0].startswith("empty")]
    assert made == [("addcmul", F32, (F32, BF)),        # ds's products (dv' x)
                    ("addcmul", F32, (BF, BF)),         # dD's products (dy x)
                    ("mul", BF, (BF,)),                 # dx = dy D
                    ("addcmul", BF, (BF, F32)),         # dx += dv' s
                    ("detach", BF, (BF,))], seen.ops    # (x.grad: a view, no copy)
