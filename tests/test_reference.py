"""The NumPy fp64 references check each other: recurrent == chunked, forward and backward.

Every rule x gate combination (dsl.all_rule_gate_specs()) with every option set, GVA,
varlen with ragged lengths (including 1), both state layouts and awkward sizes. The
recurrent backward is also checked against central finite differences of its forward.
"""
import numpy as np
import pytest

from linattn.dsl import Options, SpecError
from linattn.dsl.chunked import chunked_forward
from linattn.dsl.chunked_bwd import chunked_backward
from linattn.dsl.recurrent import random_inputs, recurrent_backward, recurrent_forward

from _ref_inputs import SPECS, all_options, assert_close, spec_option_params

TOL = 1e-10
#: the gate's gradients (dg, dA_log, dt_bias) are sums over K x V products that can cancel:
#: one-element dg reached 1.7e-10 (LINATTN_SEED=1952477638, additive_scalar B1-T1), while a
#: wrong formula is off by O(1)
TOL_GATE = 1e-8

# (id, B, T, H, HV, K, V, cu_seqlens, chunk_size)
SIZES = [
    pytest.param(1, 1, 1, 1, 8, 8, None, 16, id="B1-T1-K8-V8-c16"),
    pytest.param(2, 63, 1, 2, 16, 8, None, 16, id="B2-T63-HV2-K16-V8-c16"),
    pytest.param(1, 65, 2, 2, 8, 16, None, 64, id="B1-T65-H2-K8-V16-c64"),
    pytest.param(2, 130, 1, 2, 16, 8, None, 64, id="B2-T130-HV2-K16-V8-c64"),
    pytest.param(1, 130, 2, 4, 8, 4, None, 32, id="B1-T130-H2-HV4-K8-V4-c32"),
    pytest.param(1, 100, 1, 2, 8, 16, [0, 1, 2, 40, 57, 100], 16, id="varlen-1-1-38-17-43-c16"),
    pytest.param(1, 131, 1, 2, 16, 8, [0, 65, 66, 66, 131], 64, id="varlen-65-1-0-65-c64"),
]


def _inputs(spec, opts, B, T, H, HV, K, V, cu, rng, initial_state=True):
    return random_inputs(spec, opts, B, T, H, HV, K, V, rng, cu_seqlens=cu,
                         initial_state=initial_state)


@pytest.mark.parametrize("spec, opts", spec_option_params())
def test_chunked_forward_matches_recurrent(spec, opts, rng):
    inp = _inputs(spec, opts, 2, 37, 1, 2, 8, 4, None, rng)
    o, ht = recurrent_forward(spec, options=opts, **inp)
    out = chunked_forward(spec, options=opts, chunk_size=16, **inp)
    assert_close(out["o"], o, TOL, "o")
    assert_close(out["final_state"], ht, TOL, "final_state")


@pytest.mark.parametrize("B, T, H, HV, K, V, cu, C", SIZES)
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_chunked_forward_sizes(spec, B, T, H, HV, K, V, cu, C, rng):
    opts = all_options(spec)
    inp = _inputs(spec, opts, B, T, H, HV, K, V, cu, rng)
    o, ht = recurrent_forward(spec, options=opts, **inp)
    out = chunked_forward(spec, options=opts, chunk_size=C, **inp)
    assert_close(out["o"], o, TOL, "o")
    assert_close(out["final_state"], ht, TOL, "final_state")


GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")


def _cotangents(spec, opts, inp, rng, with_dht=True):
    o, ht = recurrent_forward(spec, options=opts, **inp)
    return rng.standard_normal(o.shape), (rng.standard_normal(ht.shape) if with_dht else None)


def _assert_grads_match(got, want, inp, spec, opts):
    """Same gradients, None exactly where the input does not apply."""
    expect_none = dict(dg=not spec.has_gate, dbeta=not spec.has_beta,
                       dh0=inp["initial_state"] is None,
                       dA_log=not opts.gate_in_kernel,
                       ddt_bias=not opts.gate_in_kernel or inp["dt_bias"] is None)
    for name in GRADS:
        assert (want[name] is None) == expect_none.get(name, False), name
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            tol = TOL_GATE if name in ("dg", "dA_log", "ddt_bias") else TOL
            assert_close(got[name], want[name], tol, name)


@pytest.mark.parametrize("spec, opts", spec_option_params())
def test_chunked_backward_matches_recurrent(spec, opts, rng):
    inp = _inputs(spec, opts, 2, 37, 1, 2, 8, 4, None, rng)
    do, dht = _cotangents(spec, opts, inp, rng)
    want = recurrent_backward(spec, options=opts, do=do, dht=dht, **inp)
    got = chunked_backward(spec, options=opts, do=do, dht=dht, chunk_size=16, **inp)
    _assert_grads_match(got, want, inp, spec, opts)


@pytest.mark.parametrize("B, T, H, HV, K, V, cu, C", SIZES)
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_chunked_backward_sizes(spec, B, T, H, HV, K, V, cu, C, rng):
    opts = all_options(spec)
    inp = _inputs(spec, opts, B, T, H, HV, K, V, cu, rng)
    do, dht = _cotangents(spec, opts, inp, rng)
    want = recurrent_backward(spec, options=opts, do=do, dht=dht, **inp)
    got = chunked_backward(spec, options=opts, do=do, dht=dht, chunk_size=C, **inp)
    _assert_grads_match(got, want, inp, spec, opts)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_backward_without_state_or_dht(spec, rng):
    opts = Options()
    inp = _inputs(spec, opts, 1, 40, 1, 1, 8, 4, None, rng, initial_state=False)
    do, _ = _cotangents(spec, opts, inp, rng)
    want = recurrent_backward(spec, do=do, **inp)
    got = chunked_backward(spec, do=do, chunk_size=16, **inp)
    _assert_grads_match(got, want, inp, spec, opts)


@pytest.mark.parametrize("opts_id", ["plain", "all"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_recurrent_backward_finite_differences(spec, opts_id, rng):
    """Central differences of the recurrent forward (varlen, GVA, every raw input)."""
    opts = Options() if opts_id == "plain" else all_options(spec)
    inp = _inputs(spec, opts, 1, 5, 1, 2, 3, 2, [0, 1, 5], rng)
    do, dht = _cotangents(spec, opts, inp, rng)
    grads = recurrent_backward(spec, options=opts, do=do, dht=dht, **inp)

    def loss():
        o, ht = recurrent_forward(spec, options=opts, **inp)
        return np.sum(o * do) + np.sum(ht * dht)

    names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0",
                 A_log="dA_log", dt_bias="ddt_bias")
    for name, gname in names.items():
        x = inp[name]
        if x is None:
            continue
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + 1e-6
            up = loss()
            x[idx] = old - 1e-6
            fd[idx] = (up - loss()) / 2e-6
            x[idx] = old
        assert_close(grads[gname], fd, 1e-6, gname)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_chunked_backward_dh(spec, rng):
    """dh[c] (gradient of the state leaving chunk c) equals dh0 of the suffix after c."""
    opts, C = Options(state_v_first=True), 16
    inp = _inputs(spec, opts, 1, 50, 1, 2, 8, 4, None, rng)
    do, dht = _cotangents(spec, opts, inp, rng)
    got = chunked_backward(spec, options=opts, do=do, dht=dht, chunk_size=C, **inp)
    h = chunked_forward(spec, options=opts, chunk_size=C, **inp)["h"]
    assert got["dh"].shape == h.shape == (1, 4, 2, 4, 8)
    assert_close(got["dh"][0, -1], dht[0], TOL, "dh[last]")
    for c in range(3):
        s = (c + 1) * C
        sub = {n: (x[:, s:] if n in ("q", "k", "v", "g", "beta") and x is not None else x)
               for n, x in inp.items()}
        sub["initial_state"] = h[:, c + 1]
        tail = recurrent_backward(spec, options=opts, do=do[:, s:], dht=dht, **sub)
        assert_close(got["dh"][0, c], tail["dh0"][0], TOL, f"dh[{c}]")


@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_chunked_intermediates(spec, v_first, rng):
    """h equals the recurrent state at each chunk start; v_new, w, u, A, g_cum fit."""
    opts = Options(state_v_first=v_first)
    cu = [0, 20, 21, 60]
    C = 16
    inp = _inputs(spec, opts, 1, 60, 1, 2, 8, 4, cu, rng)
    out = chunked_forward(spec, options=opts, chunk_size=C, **inp)
    eff = out["prepared"]
    starts = [(n, s) for n in range(3) for s in range(cu[n], cu[n + 1], C)]
    assert out["h"].shape[:2] == (1, len(starts))
    for slot, (n, s) in enumerate(starts):
        sub = dict(inp, cu_seqlens=None, initial_state=inp["initial_state"][n:n + 1])
        for name in ("q", "k", "v", "g", "beta"):
            if sub[name] is not None:
                sub[name] = sub[name][:, cu[n]:s]
        want = sub["initial_state"][0] if s == cu[n] else \
            recurrent_forward(spec, options=opts, **sub)[1][0]
        assert_close(out["h"][0, slot], want, TOL, f"h[{slot}]")
        h_kv = np.swapaxes(out["h"][0, slot], -1, -2) if v_first else out["h"][0, slot]
        rows = slice(s, min(s + C, cu[n + 1]))
        v_new = out["v_new"][0, rows]                           # [L, HV, V]
        if spec.has_beta:
            w, u = out["w"][0, rows], out["u"][0, rows]
            assert_close(v_new, u - np.einsum("lhk,hkv->lhv", w, h_kv), TOL, "v_new")
            L = rows.stop - rows.start
            A = np.swapaxes(out["A"][0, rows, :, :L], 0, 1)    # [HV, L, L]
            assert np.allclose(np.triu(A, 1), 0) and np.allclose(np.diagonal(A, 0, 1, 2), 1)
            assert np.all(out["A"][0, rows, :, L:] == 0)
            beta = eff.beta[0, rows].T[..., None]                   # [HV, L, 1]
            k_hl = np.swapaxes(eff.k[0, rows], 0, 1)                 # [HV, L, K]
            g_cum = np.cumsum(np.swapaxes(eff.g[0, rows], 0, 1), axis=1)
            decay = np.exp(g_cum[:, :, None, :] - g_cum[:, None, :, :])
            kk = np.einsum("hik,hjk,hijk->hij", k_hl, k_hl, decay)
            A_inv = np.eye(L) + np.tril(beta * kk, -1)
            assert_close(A @ A_inv, np.broadcast_to(np.eye(L), A.shape), TOL, "A")
            assert_close(np.swapaxes(u, 0, 1), A @ (beta * np.swapaxes(eff.v[0, rows], 0, 1)),
                         TOL, "u")
            assert_close(np.swapaxes(w, 0, 1), A @ (beta * k_hl * np.exp(g_cum)), TOL, "w")
        else:
            assert out["w"] is None and out["u"] is None and out["A"] is None
            assert_close(v_new, eff.v[0, rows], TOL, "v_new")
        if spec.has_gate:
            g = inp["g"][0, rows]
            assert_close(out["g_cum"][0, rows], np.cumsum(g, axis=0), TOL, "g_cum")
        else:
            assert out["g_cum"] is None


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_long_decay_does_not_overflow(spec, rng):
    """Strong decays over a long chunk: no inf/NaN, and still equal to the recurrence."""
    inp = _inputs(spec, Options(), 1, 64, 1, 1, 8, 8, None, rng)
    if spec.has_gate:
        inp["g"] = inp["g"] - 20.0                              # exp(g_cum) ~ 1e-550 at the end
    o, ht = recurrent_forward(spec, **inp)
    out = chunked_forward(spec, chunk_size=64, **inp)
    assert np.all(np.isfinite(out["o"])) and np.all(np.isfinite(out["w"] if spec.has_beta else 0))
    assert_close(out["o"], o, TOL, "o")
    assert_close(out["final_state"], ht, TOL, "final_state")


def test_missing_initial_state_is_zero(rng):
    spec = SPECS[4]                                               # delta_scalar
    inp = _inputs(spec, Options(), 2, 20, 1, 1, 4, 4, None, rng, initial_state=False)
    o, ht = recurrent_forward(spec, **inp)
    o0, ht0 = recurrent_forward(spec, **dict(inp, initial_state=np.zeros_like(ht)))
    assert np.array_equal(o, o0) and np.array_equal(ht, ht0)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_random_inputs_are_realistic(spec, rng):
    for opts in (Options(), all_options(spec)):
        inp = _inputs(spec, opts, 2, 9, 1, 2, 8, 4, None, rng)
        assert inp["q"].shape == inp["k"].shape == (2, 9, 1, 8) and inp["v"].shape == (2, 9, 2, 4)
        if not opts.l2norm_qk:
            assert np.allclose(np.linalg.norm(inp["k"], axis=-1), 1.0)
        if spec.has_beta and not opts.beta_sigmoid:
            assert np.all((inp["beta"] > 0) & (inp["beta"] < 1))
        if spec.has_gate and not opts.gate_in_kernel:
            assert inp["g"].shape == spec.gate_shape(2, 9, 2, 8) and np.all(inp["g"] < 0)
        assert (inp["g"] is None) == (not spec.has_gate)
        assert (inp["beta"] is None) == (not spec.has_beta)
        want = (2, 2, 4, 8) if opts.state_v_first else (2, 2, 8, 4)
        assert inp["initial_state"].shape == want


@pytest.mark.parametrize("change, match", [
    (dict(g=None), "g is required"),
    (dict(beta=np.ones((1, 4, 2, 1))), "beta must have shape"),
    (dict(cu_seqlens=[0, 2, 1, 4]), "cu_seqlens"),
    (dict(cu_seqlens=[0, 2, 3]), "cu_seqlens"),
    (dict(initial_state=np.zeros((1, 2, 4, 4))), "initial_state must have shape"),
    (dict(v=np.zeros((1, 4, 3, 4))), "HV % H"),
], ids=["no-g", "beta-shape", "cu-decreasing", "cu-short", "state-shape", "gva-uneven"])
def test_bad_inputs_raise(change, match, rng):
    spec = SPECS[5]                                               # delta_key
    inp = _inputs(spec, Options(), 1, 4, 2, 2, 8, 4, None, rng)
    with pytest.raises(SpecError, match=match):
        recurrent_forward(spec, **dict(inp, **change))


def test_unsupported_option_and_varlen_batch_raise(rng):
    spec = SPECS[0]                                               # additive_none
    inp = _inputs(spec, Options(), 2, 4, 1, 1, 4, 4, None, rng)
    with pytest.raises(SpecError, match="does not support"):
        chunked_forward(spec, options=Options(beta_sigmoid=True), **inp)
    with pytest.raises(SpecError, match="batch size must be 1"):
        chunked_forward(spec, **dict(inp, cu_seqlens=[0, 2, 4]))
    with pytest.raises(SpecError, match="chunk_size"):
        chunked_forward(spec, chunk_size=0, **inp)
