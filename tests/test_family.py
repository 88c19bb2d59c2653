"""The family's members (dsl/family.py): every rule and gate has its object, and each
object's maths is the transition the spec's docstring states."""
import numpy as np
import pytest
import sympy as sp

from linattn.dsl import Gate, Rule
from linattn.dsl.family import GATES, RULES

RNG = np.random.default_rng(7)
HV, K, V = 3, 5, 4


def test_every_rule_and_gate_has_its_object():
    assert {r.value for r in Rule} == set(RULES)
    assert {g.value for g in Gate} == set(GATES)
    for r in Rule:
        assert r.maths.name == r.value
    for g in Gate:
        assert g.maths.name == g.value and g.channels == g.maths.channels


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_gate_decay_is_the_diagonal_product(gate):
    """decay(S, e^g) == D S (rows) or S D (columns), D = diag(e^g) over the gate's axis,
    with g of the gate's shape; decay_matrix the same on one head's matrices."""
    S = RNG.standard_normal((HV, K, V))
    shape = gate.maths.shape(1, 1, HV, K, V)
    g = RNG.standard_normal(shape[2:]) if shape else np.zeros(HV)
    d = np.exp(gate.maths.per_channel(g))
    got = gate.maths.decay(S, d)
    for h in range(HV):
        if not gate.maths.takes_input:
            want = S[h]
        elif gate.channels == "V":
            want = S[h] @ np.diag(np.exp(g[h]))
        else:
            want = np.diag(np.broadcast_to(np.exp(g[h]), (K,))) @ S[h]
        np.testing.assert_allclose(got[h], want, rtol=1e-14)
        D = np.diag(np.broadcast_to(np.exp(g[h]), (V if gate.channels == "V" else K,)))
        got_m = gate.maths.decay_matrix(sp.Matrix(S[h]), sp.Matrix(D))
        np.testing.assert_allclose(np.array(got_m, dtype=float), want, rtol=1e-14)


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_gate_splits_into_row_and_column_decays(gate):
    """key_decay / value_decay: the per-key and per-value log decays the references run
    on; dg_of sums them back to g's shape (the adjoint of the split)."""
    shape = gate.maths.shape(1, 1, HV, K, V)
    if not shape:
        assert gate.maths.key_decay(None) is None and gate.maths.value_decay(None) is None
        return
    g = RNG.standard_normal(shape[2:])
    rows, cols = gate.maths.key_decay(g), gate.maths.value_decay(g)
    assert (rows is None) == (gate.channels == "V") and (cols is None) == (gate.channels != "V")
    dk, dv = RNG.standard_normal((HV, K)), RNG.standard_normal((HV, V))
    # <dg_of(dk, dv), x> == <dk, key_decay(x)> + <dv, value_decay(x)> for any x
    x = RNG.standard_normal(shape[2:])
    lhs = np.sum(gate.maths.dg_of(dk, dv) * x)
    rhs = sum(np.sum(d * np.broadcast_to(y, d.shape)) for d, y in
              ((dk, gate.maths.key_decay(x)), (dv, gate.maths.value_decay(x))) if y is not None)
    assert lhs == pytest.approx(rhs, rel=1e-12)


@pytest.mark.parametrize("rule", [r for r in Rule if r.maths.scale_input in ("", "beta")],
                         ids=[r.value for r in Rule if r.maths.scale_input in ("", "beta")])
def test_rule_write_and_its_vjp(rule):
    """write() is the spec's: v (additive) or beta (v - S_a^T k) (delta); write_vjp is
    its adjoint (checked by central differences in v, beta and the read S_a^T k)."""
    v, r = RNG.standard_normal((HV, V)), RNG.standard_normal((HV, V))
    beta = RNG.uniform(0.1, 1.0, (HV, 1)) if "beta" in rule.maths.inputs else None
    w = rule.maths.write(v, beta, lambda: r)
    np.testing.assert_allclose(w, v if beta is None else beta * (v - r), rtol=1e-15)
    if beta is not None:            # write = written(v) - S_a^T erase(k), S_a^T k = r
        np.testing.assert_allclose(w, rule.maths.written(v, beta) - beta * r, rtol=1e-12)
    dw = RNG.standard_normal((HV, V))
    dv, dbeta, dr = rule.maths.write_vjp(v, beta, r, dw)
    eps = 1e-6
    L = lambda v, b, r: np.sum(dw * rule.maths.write(v, b, lambda: r))  # noqa: E731
    e = RNG.standard_normal((HV, V))
    assert np.sum(dv * e) == pytest.approx((L(v + eps * e, beta, r) - L(v - eps * e, beta, r))
                                           / (2 * eps), rel=1e-7)
    if beta is None:
        assert dbeta is None and dr is None
        return
    eb = RNG.standard_normal((HV, 1))
    assert np.sum(dbeta * eb[:, 0]) == pytest.approx(
        (L(v, beta + eps * eb, r) - L(v, beta - eps * eb, r)) / (2 * eps), rel=1e-7)
    assert np.sum(dr * e) == pytest.approx((L(v, beta, r + eps * e) - L(v, beta, r - eps * e))
                                           / (2 * eps), rel=1e-7)


def test_delta_chunk_factors_invert_the_wy_system():
    """The delta rule's (A, w, u): A (I + strict_tril(beta kk)) = I, w = A (beta k e^g),
    u = A (beta v); the additive rule has none and writes v itself."""
    L = 6
    k, v = RNG.standard_normal((HV, L, K)), RNG.standard_normal((HV, L, V))
    beta, g = RNG.uniform(0.1, 1.0, (HV, L)), -RNG.uniform(0, 0.3, (HV, L, 1)).cumsum(1)
    dot = lambda a, b: a @ np.swapaxes(b, 1, 2) * np.exp(g - np.swapaxes(g, 1, 2))  # noqa: E731
    kk = dot(k, k)
    A, w, u = Rule.DELTA.maths.chunk_factors(k, v, beta, g, dot)
    M = np.eye(L) + beta[:, :, None] * np.tril(kk, -1)
    np.testing.assert_allclose(A @ M, np.broadcast_to(np.eye(L), A.shape), atol=1e-12)
    np.testing.assert_allclose(w, A @ (beta[:, :, None] * k * np.exp(g)), rtol=1e-12)
    np.testing.assert_allclose(u, A @ (beta[:, :, None] * v), rtol=1e-12)
    S = RNG.standard_normal((HV, K, V))
    np.testing.assert_allclose(Rule.DELTA.maths.new_values(v, w, u, S), u - w @ S)
    b = beta[:, :, None]            # the generalized delta form's vectors
    np.testing.assert_allclose(Rule.DELTA.maths.erase(k, b), b * k)
    np.testing.assert_allclose(Rule.DELTA.maths.written(v, b), b * v)
    assert Rule.ADDITIVE.maths.erase(k, b) is None and Rule.ADDITIVE.maths.written(v, b) is v
    assert Rule.ADDITIVE.maths.chunk_factors(k, v, beta, g, dot) is None
    assert Rule.ADDITIVE.maths.new_values(v, None, None, S) is v
