"""DPLR's fp64 references (dsl: the dplr rule, S_t = diag(e^g) S_{t-1} + b (a^T S_{t-1}) +
k v^T; IPLR without the gate) against a naive loop written from fla's formula, the
torch recurrence against the NumPy one, and the recurrent backward against finite
differences (CPU)."""
import numpy as np
import pytest
import torch

from linattn.dsl import recurrent as R
from linattn.dsl import torch_reference as TR
from linattn.dsl.spec import Options, OpSpec, SpecError, dplr_specs

SPECS = {s.name: s for s in dplr_specs()}


def _naive(x, scale, HV):
    """fla's dplr recurrence in its words: kv = k v^T + (S * a).sum(K) * b; S = S e^g + kv."""
    q, k, v, a, b = (np.asarray(x[n], dtype=np.float64) for n in "qkvab")
    B, T, H, K = q.shape
    g = np.zeros((B, T, HV, K)) if x.get("g") is None else x["g"]
    S = x["initial_state"].copy()
    o = np.zeros(v.shape)
    for n in range(B):
        for t in range(T):
            for h in range(HV):
                kh = h // (HV // H)
                kv = np.outer(k[n, t, kh], v[n, t, h]) + np.outer(b[n, t, kh],
                                                                  S[n, h].T @ a[n, t, kh])
                S[n, h] = np.exp(g[n, t, h])[:, None] * S[n, h] + kv
                o[n, t, h] = S[n, h].T @ (scale * q[n, t, kh])
    return o, S


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recurrent_matches_the_formula(name):
    spec = SPECS[name]
    x = R.random_inputs(spec, Options(), 2, 15, 2, 2, 16, 8, np.random.default_rng(1))
    o, ht = R.recurrent_forward(spec, **x)
    o2, h2 = _naive(x, 16 ** -0.5, 2)
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_allclose(ht, h2, atol=1e-12)
    t = {n: None if a is None else torch.tensor(a) for n, a in x.items()}
    o3, h3 = TR.recurrent_forward(spec, **t)
    np.testing.assert_allclose(o, o3.numpy(), atol=1e-12)
    np.testing.assert_allclose(ht, h3.numpy(), atol=1e-12)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("C", [4, 16])
def test_chunked_matches_recurrent(name, C):
    """The chunked form (two WY factors: the reads r = w S + u, o = q S + A_qb r + A_qk v)
    against the token recurrence: ragged sequences (a chunk cut mid-way, a sequence
    shorter than a chunk), initial states, GVA, keys not normalised, strong decays."""
    spec, rng = SPECS[name], np.random.default_rng(3)
    x = R.random_inputs(spec, Options(), 1, 45, 2, 4, 8, 5, rng, cu_seqlens=[0, 3, 26, 45])
    if spec.has_gate:
        x["g"] = x["g"] * 4.0
    t = {n: None if a is None else torch.tensor(a) for n, a in x.items()}
    o, ht = TR.recurrent_forward(spec, **t)
    o2, h2 = TR.chunked_forward(spec, chunk_size=C, **t)
    torch.testing.assert_close(o2, o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(h2, ht, atol=1e-10, rtol=1e-10)
    inter = TR.chunked_forward(spec, chunk_size=C, intermediates=True, **t)
    torch.testing.assert_close(inter["o"], o, atol=1e-10, rtol=1e-10)
    assert inter["v_new"].shape == (1, 45, 4, 5) and inter["h"].shape[1] == sum(
        -(-n // C) for n in (3, 23, 19))


def test_chunked_gradients_match_recurrent():
    """Autograd through the chunked form equals the recurrent backward (dsl.recurrent)."""
    spec, rng = SPECS["dplr_key"], np.random.default_rng(4)
    x = R.random_inputs(spec, Options(), 1, 20, 1, 2, 4, 3, rng, cu_seqlens=[0, 7, 20])
    do, dht = rng.standard_normal((1, 20, 2, 3)), rng.standard_normal(x["initial_state"].shape)
    want = R.recurrent_backward(spec, do=do, dht=dht, **x)
    t = {n: torch.tensor(a, requires_grad=True) for n, a in x.items() if a is not None
         and n != "cu_seqlens"}
    o, ht = TR.chunked_forward(spec, cu_seqlens=x["cu_seqlens"], chunk_size=4, **t)
    ((o * torch.tensor(do)).sum() + (ht * torch.tensor(dht)).sum()).backward()
    for name, a in t.items():
        key = "dh0" if name == "initial_state" else "d" + name
        np.testing.assert_allclose(a.grad.numpy(), want[key], atol=1e-9, err_msg=name)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recurrent_backward_finite_differences(name):
    spec, rng = SPECS[name], np.random.default_rng(2)
    opts = Options(state_v_first=True)
    x = R.random_inputs(spec, opts, 1, 5, 1, 2, 4, 3, rng, cu_seqlens=[0, 2, 5])
    do, dht = rng.standard_normal((1, 5, 2, 3)), rng.standard_normal(x["initial_state"].shape)
    grads = R.recurrent_backward(spec, do=do, dht=dht, options=opts, **x)

    def loss(**kw):
        o, ht = R.recurrent_forward(spec, options=opts, **dict(x, **kw))
        return float((o * do).sum() + (ht * dht).sum())
    names = ["q", "k", "v", "a", "b", "initial_state"] + (["g"] if spec.has_gate else [])
    for name in names:
        arr = np.array(x[name], dtype=np.float64)
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            e = np.zeros_like(arr)
            e[i] = 1e-6
            num[i] = (loss(**{name: arr + e}) - loss(**{name: arr - e})) / 2e-6
        want = "dh0" if name == "initial_state" else "d" + name
        np.testing.assert_allclose(grads[want], num, atol=1e-6, rtol=1e-5, err_msg=name)


def test_dplr_spec_checks():
    with pytest.raises(SpecError, match="dplr rule takes gate 'none'"):
        OpSpec(name="x", rule="dplr", gate="scalar")
    with pytest.raises(SpecError, match="options state_v_first only"):
        OpSpec(name="x", rule="dplr", gate="key", supports={"l2norm_qk"})
