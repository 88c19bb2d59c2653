"""The value gate (fla's ``gv``: S_t = S_{t-1} diag(exp(gv_t)) + k_t v_t^T, gv [B, T, HV, V]):
the spec, and its fp64 references checking each other (CPU).

NumPy recurrent == NumPy chunked == torch chunked == torch recurrent == a closed form
written here (o_t = e^{G_t} * (q_t^T S_0) + sum_{s <= t} (q_t . k_s) v_s e^{G_t - G_s},
G the cumulative gate), for strong (-0.1 rand per token, long sequences) and weak
(-1e-3) gates, every option set, GVA, varlen with empty and one-token sequences, the
initial and the final state in both layouts.
"""
import numpy as np
import pytest
import torch

from linattn.dsl import OpSpec, Options, SpecError, value_gate_spec
from linattn.dsl import torch_reference as tr
from linattn.dsl.chunked import chunked_forward
from linattn.dsl.chunked_bwd import chunked_backward
from linattn.dsl.recurrent import random_inputs, recurrent_backward, recurrent_forward

SPEC = value_gate_spec()
TOL = 1e-10
OPTIONS = [pytest.param(Options(), id="plain"),
           pytest.param(Options(l2norm_qk=True), id="l2norm"),
           pytest.param(Options(state_v_first=True), id="v_first"),
           pytest.param(Options(gate_in_kernel=True, l2norm_qk=True, state_v_first=True),
                        id="gate_in_kernel-l2norm-v_first")]
# (B, T, H, HV, K, V, cu_seqlens, chunk_size)
SIZES = [
    pytest.param(1, 1, 1, 1, 8, 8, None, 16, id="B1-T1-K8-V8-c16"),
    pytest.param(2, 63, 1, 2, 16, 8, None, 16, id="B2-T63-HV2-K16-V8-c16"),
    pytest.param(1, 130, 2, 4, 8, 12, None, 64, id="B1-T130-H2-HV4-K8-V12-c64"),
    pytest.param(1, 100, 1, 2, 8, 16, [0, 1, 2, 40, 57, 100], 16, id="varlen-1-1-38-17-43-c16"),
    pytest.param(1, 131, 1, 2, 16, 8, [0, 65, 66, 66, 131], 64, id="varlen-65-1-0-65-c64"),
]


def close(a, b, what, tol=TOL):
    a, b = np.asarray(a), np.asarray(b)
    err = np.abs(a - b).max() / max(1.0, np.abs(b).max())
    assert err < tol, f"{what}: max error {err:.3g} (tol {tol})"


def inputs(opts, B, T, H, HV, K, V, cu, rng, strength=None):
    """random_inputs, with the raw gate replaced by -strength * U(0, 1) when given."""
    x = random_inputs(SPEC, opts, B, T, H, HV, K, V, rng, cu_seqlens=cu)
    if strength is not None and not opts.gate_in_kernel:
        x["g"] = -strength * rng.uniform(0.0, 1.0, x["g"].shape)
    return x


def closed_form(x, scale=None):
    """o and the final state of one unpacked batch (no options) as explicit sums."""
    q, k, v, gv, h0 = x["q"], x["k"], x["v"], x["g"], x["initial_state"]
    B, T, H, K = q.shape
    HV = v.shape[2]
    q = np.repeat(q, HV // H, axis=2) * (K ** -0.5 if scale is None else scale)
    k = np.repeat(k, HV // H, axis=2)
    G = np.cumsum(gv, axis=1)                                     # [B, T, HV, V]
    o = np.einsum("bthk,bhkv->bthv", q, h0) * np.exp(G)
    qk = np.einsum("bthk,bshk->bhts", q, k) * np.tril(np.ones((T, T)))
    decay = np.exp(G[:, :, None] - G[:, None, :])                 # [B, t, s, HV, V]
    decay = np.where(np.tril(np.ones((T, T), bool))[None, :, :, None, None], decay, 0.0)
    o += np.einsum("bhts,bshv,btshv->bthv", qk, v, decay)
    ht = h0 * np.exp(G[:, -1])[:, :, None, :] + np.einsum(
        "bshk,bshv->bhkv", k, v * np.exp(G[:, -1:] - G))
    return o, ht


# -- the spec ---------------------------------------------------------------------------------

def test_spec_accepts_the_value_gate():
    s = OpSpec(name="vg", rule="additive", gate="value")
    assert s.gate.per_value and not s.gate.per_key and s.gate.channels == "V"
    assert s.gate_shape(2, 5, 4, 64, 32) == (2, 5, 4, 32)
    assert s.gate.n_channels(64, 32) == 32
    assert s.key == "vg_additive_value_c64"
    with pytest.raises(SpecError, match="needs V"):
        s.gate_shape(2, 5, 4, 64)


def test_spec_refuses_delta_with_value_gate():
    with pytest.raises(SpecError, match="gate 'value' needs the additive rule") as e:
        OpSpec(name="vg", rule="delta", gate="value")
    assert "\n" not in str(e.value)


def test_unknown_gate_lists_value():
    with pytest.raises(SpecError, match="'value'"):
        OpSpec(name="x", rule="additive", gate="values")


def test_check_call_wants_gv_per_value_channel(rng):
    x = random_inputs(SPEC, Options(), 1, 4, 1, 1, 8, 12, rng)
    x["g"] = x["g"][..., :8]                                       # K channels, not V
    with pytest.raises(SpecError, match=r"g must have shape \(1, 4, 1, 12\)"):
        recurrent_forward(SPEC, **x)


def test_token_and_chunked_backward_refuse_the_value_gate(rng):
    """Its backward is dsl.additive_bwd's (tests/test_additive_bwd_reference.py); the
    references written for the other gates say so rather than ignore gv."""
    x = random_inputs(SPEC, Options(), 1, 4, 1, 1, 8, 8, rng)
    for backward in (recurrent_backward, chunked_backward):
        with pytest.raises(SpecError, match="gate 'value''s is dsl.additive_bwd"):
            backward(SPEC, **x, do=np.ones((1, 4, 1, 8)))


# -- the references ---------------------------------------------------------------------------

@pytest.mark.parametrize("strength", [0.1, 1e-3, 2.0], ids=["g0.1", "g1e-3", "g2"])
def test_recurrent_matches_closed_form(strength, rng):
    x = inputs(Options(), 2, 50, 2, 4, 8, 12, None, rng, strength)
    o, ht = recurrent_forward(SPEC, **x)
    o_cf, ht_cf = closed_form(x)
    close(o, o_cf, "o")
    close(ht, ht_cf, "final_state")


def test_the_gate_acts_on_value_channels(rng):
    """A gate on one value channel changes that output column only."""
    x = inputs(Options(), 1, 20, 1, 1, 8, 6, None, rng, 0.0)
    o0, _ = recurrent_forward(SPEC, **x)
    x["g"][..., 2] = -0.5
    o1, ht1 = recurrent_forward(SPEC, **x)
    changed = np.abs(o1 - o0).max(axis=(0, 1, 2)) > 1e-6
    assert changed.tolist() == [False, False, True, False, False, False]


@pytest.mark.parametrize("strength", [0.1, 1e-3], ids=["g0.1", "g1e-3"])
@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("B, T, H, HV, K, V, cu, C", SIZES)
def test_chunked_matches_recurrent(B, T, H, HV, K, V, cu, C, opts, strength, rng):
    x = inputs(opts, B, T, H, HV, K, V, cu, rng, strength)
    o, ht = recurrent_forward(SPEC, options=opts, **x)
    out = chunked_forward(SPEC, options=opts, chunk_size=C, **x)
    close(out["o"], o, "o")
    close(out["final_state"], ht, "final_state")
    assert out["g_cum"].shape == (B, T, HV, V)


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("B, T, H, HV, K, V, cu, C", SIZES)
def test_torch_references_match_numpy(B, T, H, HV, K, V, cu, C, opts, rng):
    x = inputs(opts, B, T, H, HV, K, V, cu, rng, 0.1)
    o, ht = recurrent_forward(SPEC, options=opts, **x)
    tx = {n: None if a is None else torch.from_numpy(np.asarray(a)) for n, a in x.items()}
    o_c, ht_c = tr.chunked_forward(SPEC, options=opts, chunk_size=C, **tx)
    o_r, ht_r = tr.recurrent_forward(SPEC, options=opts, **tx)
    for what, got, want in (("chunked o", o_c, o), ("chunked ht", ht_c, ht),
                            ("recurrent o", o_r, o), ("recurrent ht", ht_r, ht)):
        close(got.numpy(), want, what)


def test_no_initial_state_and_intermediates(rng):
    x = inputs(Options(), 1, 40, 1, 2, 8, 8, None, rng, 0.1)
    x["initial_state"] = None
    o, ht = recurrent_forward(SPEC, **x)
    tx = {n: None if a is None else torch.from_numpy(np.asarray(a)) for n, a in x.items()}
    r = tr.chunked_forward(SPEC, chunk_size=16, intermediates=True, **tx)
    close(r["o"].numpy(), o, "o")
    close(r["final_state"].numpy(), ht, "final_state")
    assert r["g_cum"].shape == (1, 40, 2, 8) and r["h"].shape == (1, 3, 2, 8, 8)
    close(r["h"][:, 0].numpy(), np.zeros((1, 2, 8, 8)), "h[0]")


# -- the sympy reference (tiny sizes: the formulas written again, gradients by sympy) ------

@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("cu", [None, [0, 1, 1, 4]], ids=["batch", "varlen-1-0-3"])
def test_symbolic_matches_numpy(opts, cu, rng):
    from linattn.dsl.symbolic import symbolic_reference
    B = 2 if cu is None else 1
    x = inputs(opts, B, 4, 1, 2, 2, 3, cu, rng, 0.5)
    sym = symbolic_reference(SPEC, options=opts, **x)
    o, ht = recurrent_forward(SPEC, options=opts, **x)
    out = chunked_forward(SPEC, options=opts, chunk_size=2, **x)
    for what, got in (("recurrent o", o), ("chunked o", out["o"])):
        close(got, sym["o"], what)
    for what, got in (("recurrent ht", ht), ("chunked ht", out["final_state"])):
        close(got, sym["final_state"], what)


def test_symbolic_gradients_match_finite_differences(rng):
    """sympy's gradients for the value gate (a backward reference to come) against central
    differences of the NumPy forward, for every raw input."""
    from linattn.dsl.symbolic import symbolic_reference
    opts = Options(gate_in_kernel=True)
    x = inputs(opts, 1, 3, 1, 2, 2, 3, None, rng)
    do = rng.standard_normal((1, 3, 2, 3))
    dht = rng.standard_normal((1, 2, 2, 3))
    sym = symbolic_reference(SPEC, options=opts, do=do, dht=dht, **x)

    def loss(y):
        o, ht = recurrent_forward(SPEC, options=opts, **y)
        return float(np.sum(o * do) + np.sum(ht * dht))
    for name, grad in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("g", "dg"),
                       ("initial_state", "dh0"), ("A_log", "dA_log"), ("dt_bias", "ddt_bias")):
        fd = np.zeros_like(x[name])
        for idx in np.ndindex(*x[name].shape):
            plus, minus = dict(x), dict(x)
            plus[name], minus[name] = x[name].copy(), x[name].copy()
            plus[name][idx] += 1e-6
            minus[name][idx] -= 1e-6
            fd[idx] = (loss(plus) - loss(minus)) / 2e-6
        close(sym[grad], fd, grad, tol=1e-6)
