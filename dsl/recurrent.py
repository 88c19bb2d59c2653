"""The token-by-token NumPy fp64 reference, forward and reverse-mode backward.

Derived from an :class:`~linattn.dsl.spec.OpSpec` (rule, gate) and an
:class:`~linattn.dsl.spec.Options` value; the options are applied by
:mod:`~linattn.dsl.preprocess`, so this file only runs the recurrence on the effective
inputs. Per token t and value head (state S [K, V], K-first, g per key channel,
gv per value channel with the value gate):

    S_a = diag(exp(g_t)) S diag(exp(gv_t))      decay first
    delta:    S = S_a + k_t (beta_t (v_t - S_a^T k_t))^T
    additive: S = S_a + k_t v_t^T
    o_t = S^T q_t                               (q_t carries the scale)

Also :func:`random_inputs`, realistic fp64 inputs for any spec and option set.
"""
from __future__ import annotations

import numpy as np

from .preprocess import (check_call, prepare, prepare_vjp, state_from_k_first,
                         state_to_k_first, Prepared)
from .spec import OpSpec, Options, SpecError


def _initial_states(dims, options, initial_state):
    """[N, HV, K, V] fp64 initial states (zeros when none was given)."""
    if initial_state is None:
        return np.zeros((dims.N, dims.HV, dims.K, dims.V))
    return np.array(state_to_k_first(options, initial_state), dtype=np.float64)


def _beta_at(eff, b, t):
    """Token t's beta [HV, 1] (broadcast over V), None for a rule without beta."""
    return None if eff.beta is None else eff.beta[b, t][:, None]


def _x_at(eff, b, t):
    """Token t's vector inputs of the rule, name -> [HV, K or V]."""
    return {n: a[b, t] for n, a in (eff.x or {}).items()}


def _scale_at(rule, eff, b, t):
    """The input that scales token t's write (beta [HV, 1], GDN-2's w [HV, V]) or None."""
    if rule.scale_input == "beta":
        return _beta_at(eff, b, t)
    return eff.x[rule.scale_input][b, t] if rule.scale_input else None


def _read_key(rule, eff, b, t):
    """Token t's key the rule's write reads the state through [HV, K] (k; Comba's p)."""
    return rule.read_key(eff.k[b, t], _x_at(eff, b, t))


def _run_tokens(spec, eff, dims, h0, keep_states=False):
    """Run the recurrence. Returns o [B,T,HV,V], final [N,HV,K,V] and, if asked, the
    state before each token's update, [B, T, HV, K, V] (for the backward)."""
    o = np.zeros((dims.B, dims.T, dims.HV, dims.V))
    final = np.zeros_like(h0)
    before = np.zeros((dims.B, dims.T, dims.HV, dims.K, dims.V)) if keep_states else None
    for seg in dims.segments:
        S = h0[seg.n].copy()                                   # [HV, K, V]
        for t in range(seg.start, seg.end):
            if keep_states:
                before[seg.b, t] = S
            q, k, v, g = (x[seg.b, t] for x in (eff.q, eff.k, eff.v, eff.g))
            rule, S_prev = spec.rule.maths, S
            S = np.exp(g)[:, :, None] * S
            if eff.gv is not None:
                S = S * np.exp(eff.gv[seg.b, t])[:, None, :]
            S_read, rk = (S if rule.reads_decayed else S_prev), _read_key(rule, eff, seg.b, t)
            lift = rule.lift_key(k, _x_at(eff, seg.b, t))
            if lift is not None:                # DPLR: the read back along b, first
                S = S + lift[:, :, None] * np.einsum("hkv,hk->hv", S_read, rk)[:, None, :]
            v = rule.write(v, _scale_at(rule, eff, seg.b, t),
                           lambda: np.einsum("hkv,hk->hv", S_read, rk))
            S = S + k[:, :, None] * v[:, None, :]
            o[seg.b, t] = np.einsum("hkv,hk->hv", S, q)
        final[seg.n] = S
    return o, final, before


def recurrent_forward(spec: OpSpec, q, k, v, g=None, beta=None, *, options: Options = Options(),
                      scale=None, initial_state=None, cu_seqlens=None, A_log=None,
                      dt_bias=None, **rule_inputs):
    """Token-by-token forward in fp64.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] / [B, T, HV, K] / [B, T, HV, V]
    (spec.gate_shape) / None; beta [B, T, HV]
    (delta) or None; initial_state [N, HV, K, V] ([N, HV, V, K] with state_v_first) or None;
    cu_seqlens [N+1] (then B == 1). Returns (o [B, T, HV, V], final_state in the
    initial state's layout, [N, HV, K, V] or [N, HV, V, K]).
    """
    dims = check_call(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias,
                      rule_inputs)
    eff = prepare(spec, options, q, k, v, g, beta, scale, A_log, dt_bias, rule_inputs)
    o, final, _ = _run_tokens(spec, eff, dims, _initial_states(dims, options, initial_state))
    return o, state_from_k_first(options, final)


def recurrent_backward(spec: OpSpec, q, k, v, g=None, beta=None, *, do, dht=None,
                       options: Options = Options(), scale=None, initial_state=None,
                       cu_seqlens=None, A_log=None, dt_bias=None, **rule_inputs) -> dict:
    """Reverse-mode through the token loop: gradients of L = sum(o*do) + sum(ht*dht).

    do [B, T, HV, V]; dht like the final state (None = zero). Returns dict(dq, dk, dv, dg,
    dbeta, dh0, dA_log, ddt_bias) w.r.t. the RAW inputs (None where not applicable:
    dg without a gate, dbeta for the additive rule, dh0 without an initial state,
    dA_log / ddt_bias without gate_in_kernel / dt_bias).
    """
    if spec.gate.per_value:
        raise SpecError(f"{spec.name}: recurrent_backward takes gates 'none', 'scalar' and "
                        "'key'; gate 'value''s is dsl.additive_bwd.additive_backward")
    dims = check_call(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias,
                      rule_inputs)
    eff = prepare(spec, options, q, k, v, g, beta, scale, A_log, dt_bias, rule_inputs)
    h0 = _initial_states(dims, options, initial_state)
    _, _, before = _run_tokens(spec, eff, dims, h0, keep_states=True)
    do = np.asarray(do, dtype=np.float64)
    dS_final = np.zeros_like(h0) if dht is None else state_to_k_first(options, dht)
    grads = Prepared(*(np.zeros_like(x) for x in eff[:4]),
                     None if eff.beta is None else np.zeros_like(eff.beta),
                     x={n: np.zeros_like(a) for n, a in (eff.x or {}).items()})
    dh0 = np.zeros_like(h0)
    for seg in dims.segments:
        dS = dS_final[seg.n].copy()                            # grad of the state after t
        for t in reversed(range(seg.start, seg.end)):
            b = seg.b
            qt, kt, vt, gt = (x[b, t] for x in (eff.q, eff.k, eff.v, eff.g))
            S_a = np.exp(gt)[:, :, None] * before[b, t]        # decayed state
            rule = spec.rule.maths
            bt = _scale_at(rule, eff, b, t)
            S_read = S_a if rule.reads_decayed else before[b, t]
            rk = _read_key(rule, eff, b, t)
            read = np.einsum("hkv,hk->hv", S_read, rk)          # S_a^T k (Comba: S^T p)
            v_in = rule.write(vt, bt, lambda: read)
            xt = _x_at(eff, b, t)
            lift = rule.lift_key(kt, xt)
            S = S_a + kt[:, :, None] * v_in[:, None, :]
            if lift is not None:
                S = S + lift[:, :, None] * read[:, None, :]
            # o_t = S^T q
            grads.q[b, t] = np.einsum("hkv,hv->hk", S, do[b, t])
            dS = dS + qt[:, :, None] * do[b, t][:, None, :]
            # S = S_a + k v_in^T
            dk = np.einsum("hkv,hv->hk", dS, v_in)
            dv_in = np.einsum("hkv,hk->hv", dS, kt)
            dS_a, dS_read = dS, 0.0
            grads.v[b, t], dbeta, dr = rule.write_vjp(vt, bt, read, dv_in)
            if lift is not None:                              # S += lift r^T
                dr = (0.0 if dr is None else dr) + np.einsum("hkv,hk->hv", dS, lift)
                dk_lift, dx = rule.lift_key_vjp(kt, xt, np.einsum("hkv,hv->hk", dS, read))
                dk = dk + dk_lift
                for n, d in dx.items():
                    grads.x[n][b, t] += d
            if dbeta is not None:                             # (beta's, or GDN-2's w's)
                (grads.beta if rule.scale_input == "beta" else
                 grads.x[rule.scale_input])[b, t] = dbeta
            if dr is not None:                                # the rule read r = S_read^T rk
                drk = np.einsum("hkv,hv->hk", S_read, dr)
                if rule.reads_decayed:
                    dS_a = dS_a + rk[:, :, None] * dr[:, None, :]
                else:                                         # (the state before the decay)
                    dS_read = rk[:, :, None] * dr[:, None, :]
                dk_read, dx = rule.read_key_vjp(kt, _x_at(eff, b, t), drk)
                dk = dk + dk_read
                for n, d in dx.items():
                    grads.x[n][b, t] += d
            grads.k[b, t] = dk
            # S_a = diag(exp(g)) S_prev
            grads.g[b, t] = np.sum(S_a * dS_a, axis=-1)
            dS = np.exp(gt)[:, :, None] * dS_a + dS_read
        dh0[seg.n] = dS
    out = prepare_vjp(spec, options, q, k, v, g, beta, scale, A_log, dt_bias, grads,
                      rule_inputs)
    out["dh0"] = None if initial_state is None else state_from_k_first(options, dh0)
    return out


# -- realistic random inputs -------------------------------------------------------------------

def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def random_inputs(spec: OpSpec, options: Options, B, T, H, HV, K, V, rng, cu_seqlens=None,
                  initial_state=True) -> dict:
    """Realistic fp64 inputs keyed like the reference arguments.

    q, k ~ N(0, 1), l2-normalised unless options.l2norm_qk (then the kernel does it);
    v ~ N(0, 1); beta in (0, 1) (raw logits with beta_sigmoid); g = logsigmoid(N(2, 1))
    style decays per value head, key channel or value channel (raw pre-activations with gate_in_kernel,
    plus A_log = log U(1, 16) and dt_bias = inverse softplus of dt in [1e-3, 0.1]);
    initial_state 0.1 N(0, 1) in the options' layout. cu_seqlens, when given, is copied
    through (and B must be 1). Keys: q, k, v, g, beta, A_log, dt_bias, initial_state,
    cu_seqlens (absent ones are None).
    """
    spec.check_options(options)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if not options.l2norm_qk:
        q = q / np.linalg.norm(q, axis=-1, keepdims=True)
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    out = dict(q=q, k=k, v=rng.standard_normal((B, T, HV, V)), g=None, beta=None,
               A_log=None, dt_bias=None, initial_state=None,
               cu_seqlens=None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64))
    rule = spec.rule.maths
    for name, shape in rule.input_dims(B, T, HV, H, K, V):
        if name not in rule.vector_inputs:
            continue
        if rule.vector_axes[name][0] == "H":    # a key of its own (l2-normalised as k)
            p = rng.standard_normal(shape)
            out[name] = p if options.l2norm_qk else p / np.linalg.norm(p, axis=-1,
                                                                       keepdims=True)
        else:                                   # a gate in (0, 1) (GDN-2's b, w)
            out[name] = 1.0 / (1.0 + np.exp(-rng.standard_normal(shape)))
    if spec.has_beta:
        logits = rng.standard_normal((B, T, HV))
        out["beta"] = logits if options.beta_sigmoid else 1.0 / (1.0 + np.exp(-logits))
    if spec.has_gate:
        shape = spec.gate_shape(B, T, HV, K, V)
        if options.gate_in_kernel:
            out["g"] = rng.standard_normal(shape)
            out["A_log"] = np.log(rng.uniform(1.0, 16.0, HV))
            n_bias = HV * spec.gate.n_channels(K, V)
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), n_bias))
            out["dt_bias"] = dt + np.log(-np.expm1(-dt))
        else:
            out["g"] = _logsigmoid(rng.normal(2.0, 1.0, shape))
    if initial_state:
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        shape = (N, HV, V, K) if options.state_v_first else (N, HV, K, V)
        out["initial_state"] = 0.1 * rng.standard_normal(shape)
    return out
