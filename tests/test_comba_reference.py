"""Comba's fp64 references (dsl: the comba rule, S_t = e^g S_{t-1} + k (beta (v -
S_{t-1}^T p))^T) against a naive loop written from the formula, the chunked form against
the recurrent one, and the recurrent backward against finite differences (CPU)."""
import numpy as np
import pytest
import torch

from linattn.dsl import recurrent as R
from linattn.dsl import torch_reference as TR
from linattn.dsl.spec import Options, OpSpec, SpecError, comba_specs

SPECS = {s.name: s for s in comba_specs()}


def _naive(x, scale, HV):
    """The formula token by token (no options), fp64: the read before the decay."""
    q, k, v, p, beta = (np.asarray(x[n], dtype=np.float64) for n in ("q", "k", "v", "p", "beta"))
    B, T, H, K = q.shape
    V = v.shape[-1]
    g = np.zeros((B, T, HV)) if x.get("g") is None else np.asarray(x["g"])
    S = np.zeros((B, HV, K, V)) if x.get("initial_state") is None else x["initial_state"].copy()
    o = np.zeros((B, T, HV, V))
    for b in range(B):
        for t in range(T):
            for h in range(HV):
                kh = h // (HV // H)
                read = S[b, h].T @ p[b, t, kh]
                u = beta[b, t, h] * (v[b, t, h] - read)
                S[b, h] = np.exp(g[b, t, h]) * S[b, h] + np.outer(k[b, t, kh], u)
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, kh])
    return o, S


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recurrent_matches_the_formula(name):
    spec, rng = SPECS[name], np.random.default_rng(1)
    x = R.random_inputs(spec, Options(), 2, 19, 2, 4, 16, 8, rng)
    o, ht = R.recurrent_forward(spec, **x)
    o2, h2 = _naive(x, 16 ** -0.5, 4)
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_allclose(ht, h2, atol=1e-12)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("opts", [Options(), Options(l2norm_qk=True, beta_sigmoid=True,
                                                     allow_neg_eigval=True, state_v_first=True)])
def test_chunked_matches_recurrent(name, opts):
    spec, rng = SPECS[name], np.random.default_rng(2)
    opts = Options(**{n: True for n in opts.enabled()},
                   gate_in_kernel=spec.has_gate and opts.l2norm_qk)
    x = R.random_inputs(spec, opts, 1, 45, 2, 4, 16, 8, rng, cu_seqlens=[0, 13, 45])
    o, ht = R.recurrent_forward(spec, options=opts, **x)
    t = {n: None if a is None else torch.tensor(a) for n, a in x.items()}
    o2, h2 = TR.recurrent_forward(spec, options=opts, **t)
    o3, h3 = TR.chunked_forward(spec, options=opts, chunk_size=16, **t)
    for a, b in ((o, o2), (ht, h2), (o, o3), (ht, h3)):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-11)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recurrent_backward_finite_differences(name):
    spec, rng = SPECS[name], np.random.default_rng(3)
    opts = Options(l2norm_qk=True, beta_sigmoid=True, gate_in_kernel=spec.has_gate)
    x = R.random_inputs(spec, opts, 1, 6, 1, 2, 4, 3, rng)
    do = rng.standard_normal((1, 6, 2, 3))
    dht = rng.standard_normal(x["initial_state"].shape)
    grads = R.recurrent_backward(spec, do=do, dht=dht, options=opts, **x)

    def loss(**kw):
        o, ht = R.recurrent_forward(spec, options=opts, **dict(x, **kw))
        return float((o * do).sum() + (ht * dht).sum())
    names = {"q": "dq", "k": "dk", "v": "dv", "p": "dp", "beta": "dbeta",
             "initial_state": "dh0"}
    if spec.has_gate:
        names.update(g="dg", A_log="dA_log", dt_bias="ddt_bias")
    for name_in, name_out in names.items():
        a = np.array(x[name_in], dtype=np.float64)
        num = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            e = np.zeros_like(a)
            e[i] = 1e-6
            num[i] = (loss(**{name_in: a + e}) - loss(**{name_in: a - e})) / 2e-6
        np.testing.assert_allclose(grads[name_out], num, atol=1e-6, rtol=1e-5,
                                   err_msg=name_out)


def test_comba_gates_and_inputs():
    with pytest.raises(SpecError, match="comba rule takes gate"):
        OpSpec(name="c", rule="comba", gate="key")
    spec, rng = SPECS["comba_scalar"], np.random.default_rng(4)
    x = R.random_inputs(spec, Options(), 1, 4, 1, 1, 16, 8, rng)
    with pytest.raises(SpecError, match="p is required"):
        R.recurrent_forward(spec, **dict(x, p=None))
    with pytest.raises(SpecError, match="p must have shape"):
        R.recurrent_forward(spec, **dict(x, p=x["p"][:, :3]))


@pytest.mark.parametrize("rule", ["comba", "gdn2", "dplr"])
def test_references_without_the_rule_refuse_it(rule):
    """The numpy chunked forward / backward and the symbolic reference take the additive
    and delta rules; the new rules' are the recurrences and torch's chunked form."""
    from linattn.dsl import chunked, chunked_bwd, symbolic
    gate = {"comba": "scalar", "gdn2": "key", "dplr": "key"}[rule]
    spec = OpSpec(name="x", rule=rule, gate=gate)
    x = R.random_inputs(spec, Options(), 1, 3, 1, 1, 4, 4, np.random.default_rng(0))
    q, k, v, g = (x[n] for n in "qkvg")
    for fn in (lambda: chunked.chunked_forward(spec, q, k, v, g, x["beta"]),
               lambda: chunked_bwd.chunked_backward(spec, q, k, v, g, x["beta"], do=v),
               lambda: symbolic.symbolic_reference(spec, q, k, v, g, x["beta"])):
        with pytest.raises(SpecError, match=f"{rule} rule"):
            fn()
