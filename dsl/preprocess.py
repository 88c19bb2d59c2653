"""Raw call inputs -> the effective inputs every reference consumes, and the way back.

One implementation shared by the recurrent, chunked and kernel-checking code, so the
per-call options (:class:`~linattn.dsl.spec.Options`) are applied in exactly one place.

Effective inputs (:class:`Prepared`, NumPy fp64, GVA already expanded to the value heads):

    q    [B, T, HV, K]   scale * l2norm?(q[.., key_head(hv), :])      (scale folded in)
    k    [B, T, HV, K]   l2norm?(k[.., key_head(hv), :])
    v    [B, T, HV, V]   v
    g    [B, T, HV, K]   per-key-channel natural-log decay: the key gate as given, the
                         scalar gate broadcast over K, zeros for no gate or a value gate;
                         with gate_in_kernel  g <- -exp(A_log[hv]) * softplus(g + dt_bias)
    beta [B, T, HV]      delta rule: sigmoid?(beta) (* 2 with allow_neg_eigval);
                         None for the additive rule
    gv   [B, T, HV, V]   per-value-channel natural-log decay (the value gate, activated
                         as g is); None for every other gate. The step's decay is
                         S <- diag(exp(g)) S diag(exp(gv)).

``prepare_vjp`` maps gradients of these back to the raw inputs (folding the GVA groups,
the l2norm, the sigmoid, the gate activation and the gate broadcast).

:func:`check_call` validates shapes and returns :class:`Dims`, including the sequence
segments (one per batch row, or one per cu_seqlens sequence with B == 1).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .spec import OpSpec, Options, SpecError

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


class Prepared(NamedTuple):
    """Effective inputs of the recurrence (see the module docstring for shapes)."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: Optional[np.ndarray]
    gv: Optional[np.ndarray] = None
    x: Optional[dict] = None            # the rule's vector inputs (rule.vector_inputs) at
                                        # the value heads: Comba's p [B, T, HV, K], GDN-2's b, w


class Segment(NamedTuple):
    """One sequence: batch row b, tokens [start, end), state index n."""
    n: int
    b: int
    start: int
    end: int


class Dims(NamedTuple):
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    segments: tuple


# -- validation ----------------------------------------------------------------------------

def _shape(x, name, want):
    x = np.asarray(x)
    if x.shape != tuple(want):
        raise SpecError(f"{name} must have shape {tuple(want)}, got {x.shape}")
    return x


def check_call(spec: OpSpec, options: Options, q, k, v, g=None, beta=None,
               initial_state=None, cu_seqlens=None, A_log=None, dt_bias=None,
               rule_inputs=None) -> Dims:
    """Validate one call's inputs against the spec; return its :class:`Dims`.

    q, k [B, T, H, K]; v [B, T, HV, V]; g spec.gate_shape; beta [B, T, HV] (delta only);
    initial_state [N, HV, K, V] ([N, HV, V, K] with state_v_first); cu_seqlens [N+1];
    A_log [HV], dt_bias [HV] (scalar gate), [HV*K] (key gate) or [HV*V] (value gate)
    with gate_in_kernel.
    """
    spec.check_options(options)
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.ndim != 4:
        raise SpecError(f"q must be [B, T, H, K], got shape {q.shape}")
    B, T, H, K = q.shape
    _shape(k, "k", q.shape)
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise SpecError(f"v must be [B={B}, T={T}, HV, V], got shape {v.shape}")
    HV, V = v.shape[2:]
    spec.check_heads(H, HV)
    if spec.has_gate:
        if g is None:
            raise SpecError(f"{spec.name} has a {spec.gate.value} gate: g is required")
        _shape(g, "g", spec.gate_shape(B, T, HV, K, V))
    elif g is not None:
        raise SpecError(f"{spec.name} has no gate: g must be None")
    if spec.has_beta:
        if beta is None:
            raise SpecError(f"{spec.name} uses the delta rule: beta is required")
        _shape(beta, "beta", (B, T, HV))
    elif beta is not None:
        raise SpecError(f"{spec.name} uses the additive rule: beta must be None")
    check_rule_inputs(spec, rule_inputs, B, T, H, HV, K, V)
    if options.gate_in_kernel:
        if A_log is None:
            raise SpecError("gate_in_kernel needs A_log [HV]")
        _shape(A_log, "A_log", (HV,))
        if dt_bias is not None:
            n_bias = HV * spec.gate.n_channels(K, V)
            if np.asarray(dt_bias).size != n_bias:
                what = f"HV*{spec.gate.channels}" if spec.gate.channels else "HV"
                raise SpecError(f"dt_bias must have {n_bias} elements ({what}), "
                                f"got shape {np.shape(dt_bias)}")
    if cu_seqlens is None:
        segments = tuple(Segment(b, b, 0, T) for b in range(B))
    else:
        cu = np.asarray(cu_seqlens)
        if B != 1:
            raise SpecError(f"with cu_seqlens the batch size must be 1, got B={B}")
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
            raise SpecError(f"cu_seqlens must be [N+1] nondecreasing from 0 to T={T}, "
                            f"got {cu.tolist()}")
        segments = tuple(Segment(n, 0, int(cu[n]), int(cu[n + 1])) for n in range(cu.size - 1))
    N = len(segments)
    if initial_state is not None:
        want = (N, HV, V, K) if options.state_v_first else (N, HV, K, V)
        _shape(initial_state, "initial_state", want)
    return Dims(B, T, H, HV, K, V, N, segments)


def check_rule_inputs(spec: OpSpec, rule_inputs, B, T, H, HV, K, V) -> None:
    """The rule's vector inputs (name -> array; Comba's p, GDN-2's b, w): each given, of
    its shape (rule.input_dims), none other."""
    rule_inputs = {n: x for n, x in (rule_inputs or {}).items() if x is not None}
    for name, shape in spec.rule.maths.input_dims(B, T, HV, H, K, V):
        if name in spec.rule.maths.vector_inputs:
            if name not in rule_inputs:
                raise SpecError(f"{spec.name} uses the {spec.rule.value} rule: {name} is "
                                "required")
            _shape(rule_inputs.pop(name), name, shape)
    if rule_inputs:
        raise SpecError(f"{spec.name} uses the {spec.rule.value} rule, which takes no "
                        f"{', '.join(sorted(rule_inputs))}")


# -- state layout ---------------------------------------------------------------------------

def state_to_k_first(options: Options, s):
    """[.., K, V] view of a state given in the options' layout (None passes through)."""
    if s is None:
        return None
    s = np.asarray(s, dtype=np.float64)
    return np.swapaxes(s, -1, -2) if options.state_v_first else s


def state_from_k_first(options: Options, s):
    """A [.., K, V] state in the options' layout ([.., V, K] with state_v_first)."""
    return np.ascontiguousarray(np.swapaxes(s, -1, -2)) if options.state_v_first else s


# -- elementwise pieces -----------------------------------------------------------------------

def softplus(x):
    """fla's softplus: x where x > 20, else log1p(exp(x))."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD))))


def softplus_grad(x):
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > SOFTPLUS_THRESHOLD, 1.0, sigmoid(x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def l2norm(x):
    """x * 1/sqrt(sum(x^2) + 1e-6) over the last dim."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def l2norm_vjp(x, dy):
    r = 1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
    return r * dy - x * r ** 3 * np.sum(x * dy, axis=-1, keepdims=True)


def _dt_bias_table(spec, HV, K, dt_bias, V=None):
    """dt_bias as an array broadcastable against g ([HV], [HV, K] or [HV, V]); zeros
    when absent."""
    shape = (HV, spec.gate.n_channels(K, V)) if spec.gate.channels else (HV,)
    if dt_bias is None:
        return np.zeros(shape)
    return np.asarray(dt_bias, dtype=np.float64).reshape(shape)


def expand_heads(x, HV):
    """[B, T, H, D] -> [B, T, HV, D]: value head hv reads key head hv // (HV // H)."""
    return np.repeat(x, HV // x.shape[2], axis=2)


def fold_heads(dx, H):
    """Adjoint of expand_heads: [B, T, HV, D] -> [B, T, H, D] summing each group."""
    B, T, HV, D = dx.shape
    return dx.reshape(B, T, H, HV // H, D).sum(axis=3)


# -- the forward map and its VJP -------------------------------------------------------------

def prepare(spec: OpSpec, options: Options, q, k, v, g=None, beta=None, scale=None,
            A_log=None, dt_bias=None, rule_inputs=None) -> Prepared:
    """Raw inputs -> :class:`Prepared` (fp64; q carries the scale; g always [B,T,HV,K];
    gv [B,T,HV,V] with a value gate, else None)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    s = spec.scale_for(K, scale)
    if options.l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    q_eff = s * expand_heads(q, HV)
    k_eff = expand_heads(k, HV)
    g_eff, gv_eff = np.zeros((B, T, HV, K)), None
    if spec.has_gate:
        g_act = np.asarray(g, dtype=np.float64)
        if options.gate_in_kernel:
            x = g_act + _dt_bias_table(spec, HV, K, dt_bias, V)
            a = np.exp(np.asarray(A_log, dtype=np.float64))
            a = a[:, None] if spec.gate.channels else a
            g_act = -a * softplus(x)
        rows, gv_eff = spec.gate.maths.key_decay(g_act), spec.gate.maths.value_decay(g_act)
        if rows is not None:
            g_eff += rows
    beta_eff = None
    if spec.has_beta:
        beta_eff = np.asarray(beta, dtype=np.float64)
        if options.beta_sigmoid:
            beta_eff = sigmoid(beta_eff) * (2.0 if options.allow_neg_eigval else 1.0)
    x_eff = None
    if spec.rule.maths.vector_inputs:   # a key of its own as k (l2norm, key heads)
        x_eff = {}
        for name in spec.rule.maths.vector_inputs:
            a = np.asarray(rule_inputs[name], dtype=np.float64)
            if spec.rule.maths.vector_axes[name][0] == "H":
                a = expand_heads(l2norm(a) if options.l2norm_qk else a, HV)
            x_eff[name] = a
    return Prepared(q_eff, k_eff, v, g_eff, beta_eff, gv_eff, x_eff)


def prepare_vjp(spec: OpSpec, options: Options, q, k, v, g, beta, scale, A_log, dt_bias,
                grads: Prepared, rule_inputs=None) -> dict:
    """Gradients of the effective inputs (a :class:`Prepared`) -> raw-input gradients.

    Returns dict(dq [B,T,H,K], dk [B,T,H,K], dv [B,T,HV,V], dg (g's shape or None),
    dbeta ([B,T,HV] or None), dA_log ([HV] or None), ddt_bias (dt_bias's shape or None)).
    """
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    H, K = q.shape[2], q.shape[3]
    HV, V = np.shape(v)[2:]
    s = spec.scale_for(K, scale)
    dq = fold_heads(s * grads.q, H)
    dk = fold_heads(grads.k, H)
    if options.l2norm_qk:
        dq, dk = l2norm_vjp(q, dq), l2norm_vjp(k, dk)
    out = dict(dq=dq, dk=dk, dv=np.array(grads.v, dtype=np.float64), dg=None, dbeta=None,
               dA_log=None, ddt_bias=None)
    if spec.has_gate:
        dg = np.array(spec.gate.maths.dg_of(grads.g, grads.gv))
        if options.gate_in_kernel:
            x = np.asarray(g, dtype=np.float64) + _dt_bias_table(spec, HV, K, dt_bias, V)
            a = np.exp(np.asarray(A_log, dtype=np.float64))
            a = a[:, None] if spec.gate.channels else a
            g_act = -a * softplus(x)
            dA = (dg * g_act).sum(axis=(0, 1))
            out["dA_log"] = dA.sum(axis=-1) if spec.gate.channels else dA
            dg = -a * softplus_grad(x) * dg
            if dt_bias is not None:
                out["ddt_bias"] = dg.sum(axis=(0, 1)).reshape(np.shape(dt_bias))
        out["dg"] = dg
    if spec.has_beta:
        dbeta = np.array(grads.beta, dtype=np.float64)
        if options.beta_sigmoid:
            sg = sigmoid(beta)
            dbeta = dbeta * (2.0 if options.allow_neg_eigval else 1.0) * sg * (1.0 - sg)
        out["dbeta"] = dbeta
    for name in spec.rule.maths.vector_inputs:      # (grads.x: at the value heads)
        d = grads.x[name]
        if spec.rule.maths.vector_axes[name][0] == "H":
            d = fold_heads(d, H)
            if options.l2norm_qk:
                d = l2norm_vjp(np.asarray(rule_inputs[name], dtype=np.float64), d)
        out["d" + name] = d
    return out
