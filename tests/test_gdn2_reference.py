"""GDN-2's fp64 references (dsl: the gdn2 rule, S_t = (I - k (b . k)^T) diag(e^g) S +
k (w . v)^T) against a naive loop written from the formula, the chunked torch form
against the recurrent one, KDA as the special case b = w = beta, and the recurrent
backward against finite differences (CPU)."""
import numpy as np
import pytest
import torch

from linattn.dsl import recurrent as R
from linattn.dsl import torch_reference as TR
from linattn.dsl.spec import Options, OpSpec, SpecError, gdn2_spec

SPEC = gdn2_spec()


def _naive(x, scale, HV):
    q, k, v, g, b, w = (np.asarray(x[n], dtype=np.float64) for n in "qkvgbw")
    B, T, H, K = q.shape
    S = x["initial_state"].copy()
    o = np.zeros(v.shape)
    for n in range(B):
        for t in range(T):
            for h in range(HV):
                kh = h // (HV // H)
                S[n, h] = np.exp(g[n, t, h])[:, None] * S[n, h]
                u = w[n, t, h] * v[n, t, h] - S[n, h].T @ (b[n, t, h] * k[n, t, kh])
                S[n, h] = S[n, h] + np.outer(k[n, t, kh], u)
                o[n, t, h] = S[n, h].T @ (scale * q[n, t, kh])
    return o, S


def test_recurrent_matches_the_formula():
    x = R.random_inputs(SPEC, Options(), 2, 17, 2, 4, 16, 8, np.random.default_rng(1))
    assert x["b"].shape == (2, 17, 4, 16) and x["w"].shape == (2, 17, 4, 8)
    o, ht = R.recurrent_forward(SPEC, **x)
    o2, h2 = _naive(x, 16 ** -0.5, 4)
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_allclose(ht, h2, atol=1e-12)


def test_kda_is_b_equal_w_equal_beta():
    kda = OpSpec(name="kda_like", rule="delta", gate="key")
    x = R.random_inputs(kda, Options(), 1, 9, 2, 2, 16, 8, np.random.default_rng(2))
    beta = x.pop("beta")
    o, ht = R.recurrent_forward(kda, beta=beta, **x)
    o2, h2 = R.recurrent_forward(SPEC, b=np.repeat(beta[..., None], 16, -1),
                                 w=np.repeat(beta[..., None], 8, -1), **x)
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_allclose(ht, h2, atol=1e-12)


@pytest.mark.parametrize("opts", [Options(), Options(l2norm_qk=True, gate_in_kernel=True,
                                                     state_v_first=True)])
def test_chunked_matches_recurrent(opts):
    x = R.random_inputs(SPEC, opts, 1, 45, 2, 4, 16, 8, np.random.default_rng(3),
                        cu_seqlens=[0, 13, 45])
    o, ht = R.recurrent_forward(SPEC, options=opts, **x)
    t = {n: None if a is None else torch.tensor(a) for n, a in x.items()}
    for fn in (TR.recurrent_forward, lambda *a, **k: TR.chunked_forward(*a, chunk_size=16,
                                                                        **k)):
        o2, h2 = fn(SPEC, options=opts, **t)
        np.testing.assert_allclose(o, o2.numpy(), atol=1e-11)
        np.testing.assert_allclose(ht, h2.numpy(), atol=1e-11)


def test_recurrent_backward_finite_differences():
    opts = Options(l2norm_qk=True, gate_in_kernel=True)
    rng = np.random.default_rng(4)
    x = R.random_inputs(SPEC, opts, 1, 5, 1, 2, 4, 3, rng)
    do, dht = rng.standard_normal((1, 5, 2, 3)), rng.standard_normal(x["initial_state"].shape)
    grads = R.recurrent_backward(SPEC, do=do, dht=dht, options=opts, **x)

    def loss(**kw):
        o, ht = R.recurrent_forward(SPEC, options=opts, **dict(x, **kw))
        return float((o * do).sum() + (ht * dht).sum())
    for name in ("q", "k", "v", "g", "b", "w", "initial_state", "A_log", "dt_bias"):
        a = np.array(x[name], dtype=np.float64)
        num = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            e = np.zeros_like(a)
            e[i] = 1e-6
            num[i] = (loss(**{name: a + e}) - loss(**{name: a - e})) / 2e-6
        want = {"initial_state": "dh0", "A_log": "dA_log", "dt_bias": "ddt_bias"}.get(
            name, "d" + name)
        np.testing.assert_allclose(grads[want], num, atol=1e-6, rtol=1e-5, err_msg=name)


def test_gdn2_spec_checks():
    with pytest.raises(SpecError, match="gdn2 rule takes gate 'key'"):
        OpSpec(name="x", rule="gdn2", gate="scalar")
    with pytest.raises(SpecError, match="no beta"):
        OpSpec(name="x", rule="gdn2", gate="key", supports={"beta_sigmoid"})
    x = R.random_inputs(SPEC, Options(), 1, 4, 1, 1, 16, 8, np.random.default_rng(5))
    with pytest.raises(SpecError, match="w is required"):
        R.recurrent_forward(SPEC, **dict(x, w=None))
    with pytest.raises(SpecError, match="b must have shape"):
        R.recurrent_forward(SPEC, **dict(x, b=x["w"]))
    with pytest.raises(SpecError, match="takes no p"):
        R.recurrent_forward(SPEC, p=x["k"], **x)
