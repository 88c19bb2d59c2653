"""The chunked NumPy fp64 reference backward: the algorithm the backward kernels implement.

Gradients of L = sum(o * do) + sum(ht * dht), chunk-wise, in the stage order of
:mod:`~linattn.dsl.chunked` reversed. Notation as there (one chunk, all value heads,
E_ij = exp(g_cum_i - g_cum_j) for i >= j, q carrying the scale):

  0. recompute          the forward's h (state entering each chunk), A, w, u, v_new
  1. reverse state pass per sequence from dS = dht, last chunk first:
                        dh[chunk] = dS  (gradient of the state LEAVING the chunk)
       output           dS_in  = (q exp(g_cum))^T do,     dv_new = Aqk^T do
       state update     dS_in += exp(g_last) dS,          dv_new += k_dec dS
                        (k_dec = k exp(g_last - g_cum))
       v_new = u - w S  du = dv_new,  dw = -dv_new S^T,  dS_in -= w^T dv_new   (delta)
       then dS = dS_in for the chunk before; dh0 = dS after the first chunk
  2. intra-chunk terms  dAqk = tril_incl(do v_new^T): dq, dk through Aqk = sum_k q k E
  3. WY backward        (delta) u = A beta v, w = A (beta k exp(g_cum)):
                        dA = du (beta v)^T + dw (beta k exp(g_cum))^T
                        dAkk = strict_tril(-A^T dA A^T); through Akk = beta sum_k k k E
  4. gate               every use of exp(g_cum) gives a dg_cum term (E contributes to both
                        of its rows); dg = reverse cumsum of dg_cum within the chunk
  5. preprocessing VJP  to the raw inputs (:func:`~linattn.dsl.preprocess.prepare_vjp`)
"""
from __future__ import annotations

import numpy as np

from .chunked import (advance_state, check_chunk_size, chunk_inputs, chunk_table, decayed_dot,
                      gate_cumsum, new_values, pair_decays, scatter_rows, wy_representation)
from .preprocess import (Prepared, check_call, prepare, prepare_vjp, state_from_k_first,
                         state_to_k_first)
from .recurrent import _initial_states
from .spec import OpSpec, Options, SpecError


def _pair_grads(dM, a, b, E):
    """Gradients of M_ij = sum_k a_ik b_jk E_ijk given dM [HV, L, L]:
    (da [HV,L,K], db [HV,L,K], dg_cum [HV,L,K]); E_ijk = exp(g_cum_ik - g_cum_jk), so
    row i of g_cum gets sum_j dM_ij a_ik b_jk E_ijk = a_ik da_ik and row j loses b_jk db_jk."""
    if E.shape[-1] == 1:
        P = dM * E[..., 0]
        da, db = P @ b, np.swapaxes(P, 1, 2) @ a
    else:
        P = dM[..., None] * E
        da = np.einsum("hijk,hjk->hik", P, b)
        db = np.einsum("hijk,hik->hjk", P, a)
    return da, db, a * da - b * db


def chunk_backward(rule, q, k, v, beta, g, S, do, dS_out):
    """Backward of one chunk (all heads). q, k, g [HV, L, K]; v, do [HV, L, V]; beta
    [HV, L] or None; S the state entering, dS_out the gradient of the state leaving
    ([HV, K, V]). Returns (dq, dk, dv, dg, dbeta or None, dS_in) for the effective inputs."""
    g_cum = gate_cumsum(g)
    E = pair_decays(g_cum)
    exp_g = np.exp(g_cum)
    g_last = g_cum[:, -1, :]
    k_dec = k * np.exp(g_last[:, None, :] - g_cum)
    delta = rule.maths.reads_state                  # (the WY form's backward: the delta rule's)
    A = w = u = None
    if delta:
        A, w, u = wy_representation(rule, k, v, beta, g_cum, E)
    v_new = new_values(rule, v, w, u, S)
    St = np.swapaxes(S, 1, 2)
    # 1. output and state update
    q_dec = q * exp_g
    dS = np.swapaxes(q_dec, 1, 2) @ do + np.exp(g_last)[:, :, None] * dS_out
    dq = (do @ St) * exp_g
    dg_cum = (do @ St) * q_dec
    Aqk = decayed_dot(q, k, E)
    dv_new = np.swapaxes(Aqk, 1, 2) @ do + k_dec @ dS_out
    dk_dec = v_new @ np.swapaxes(dS_out, 1, 2)
    dk = dk_dec * np.exp(g_last[:, None, :] - g_cum)
    dg_cum -= dk_dec * k_dec
    dg_cum[:, -1, :] += (np.sum(dk_dec * k_dec, axis=1)
                         + np.exp(g_last) * np.sum(S * dS_out, axis=-1))
    # 2. intra-chunk attention
    dAqk = np.tril(do @ np.swapaxes(v_new, 1, 2))
    dq_pair, dk_pair, dg_pair = _pair_grads(dAqk, q, k, E)
    dq += dq_pair
    dk += dk_pair
    dg_cum += dg_pair
    dbeta = None
    if delta:
        # v_new = u - w S
        dw = -dv_new @ St
        dS -= np.swapaxes(w, 1, 2) @ dv_new
        # 3. WY: u = A (beta v), w = A (beta k exp(g_cum)), A = (I + Akk)^-1
        bv = beta[:, :, None] * v
        bk = beta[:, :, None] * k * exp_g
        At = np.swapaxes(A, 1, 2)
        dA = dv_new @ np.swapaxes(bv, 1, 2) + dw @ np.swapaxes(bk, 1, 2)
        dAkk = np.tril(-At @ dA @ At, -1)
        dbv, dbk = At @ dv_new, At @ dw
        dv = beta[:, :, None] * dbv
        dk += beta[:, :, None] * exp_g * dbk
        dg_cum += dbk * bk
        kk = decayed_dot(k, k, E)
        dbeta = (np.sum(dbv * v, axis=-1) + np.sum(dbk * k * exp_g, axis=-1)
                 + np.sum(dAkk * kk, axis=-1))
        dk_i, dk_j, dg_pair = _pair_grads(dAkk * beta[:, :, None], k, k, E)
        dk += dk_i + dk_j
        dg_cum += dg_pair
    else:
        dv = dv_new
    # 4. gate: g_cum = cumsum(g)  =>  dg = reverse cumsum of dg_cum
    dg = np.flip(np.cumsum(np.flip(dg_cum, axis=1), axis=1), axis=1)
    return dq, dk, dv, dg, dbeta, dS


def chunked_backward(spec: OpSpec, q, k, v, g=None, beta=None, *, do, dht=None,
                     options: Options = Options(), scale=None, initial_state=None,
                     cu_seqlens=None, A_log=None, dt_bias=None, chunk_size=None) -> dict:
    """Chunk-wise backward in fp64.

    Arguments as :func:`~linattn.dsl.recurrent.recurrent_backward`, plus chunk_size
    (default spec.chunk_size). Returns the same dict (dq, dk, dv, dg, dbeta, dh0, dA_log,
    ddt_bias; raw-input gradients, None where not applicable) plus
    dh: gradient of the state leaving each chunk, laid out like chunked_forward's h
    ([B, NC, HV, K, V], [.., V, K] with state_v_first; [1, NC_total, ..] for varlen).
    """
    C = check_chunk_size(spec, chunk_size)
    if spec.gate.per_value:
        raise SpecError(f"{spec.name}: chunked_backward takes gates 'none', 'scalar' and "
                        "'key'; gate 'value''s is dsl.additive_bwd.additive_backward")
    dims = check_call(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    eff = prepare(spec, options, q, k, v, g, beta, scale, A_log, dt_bias)
    h0 = _initial_states(dims, options, initial_state)
    chunks, NC = chunk_table(dims, C)
    do = np.asarray(do, dtype=np.float64)
    # 0. recompute the states entering each chunk
    entering, final = [], h0.copy()
    for c in chunks:
        qc, kc, vc, gc, bc = chunk_inputs(eff, c)
        g_cum = gate_cumsum(gc)
        S = final[c.n].copy()
        w = u = None
        if spec.rule.maths.reads_state:
            _, w, u = wy_representation(spec.rule, kc, vc, bc, g_cum, pair_decays(g_cum))
        entering.append(S)
        final[c.n] = advance_state(kc, g_cum, S, new_values(spec.rule, vc, w, u, S))
    # 1.-4. reverse pass, last chunk first (chunks of a sequence are contiguous)
    grads = Prepared(*(np.zeros_like(x) for x in eff[:4]),
                     None if eff.beta is None else np.zeros_like(eff.beta))
    dS_seq = np.zeros_like(h0) if dht is None else np.array(state_to_k_first(options, dht))
    dh = np.zeros((dims.B, NC, dims.HV, dims.K, dims.V))
    for c, S in zip(reversed(chunks), reversed(entering)):
        qc, kc, vc, gc, bc = chunk_inputs(eff, c)
        doc = np.ascontiguousarray(np.swapaxes(do[c.b, c.start:c.end], 0, 1))
        dh[c.b, c.slot] = dS_seq[c.n]
        dq, dk, dv, dg, dbeta, dS_seq[c.n] = chunk_backward(spec.rule, qc, kc, vc, bc, gc, S,
                                                            doc, dS_seq[c.n])
        for dst, x in zip(grads, (dq, dk, dv, dg, dbeta)):
            if dst is not None:
                scatter_rows(dst, c, x)
    out = prepare_vjp(spec, options, q, k, v, g, beta, scale, A_log, dt_bias, grads)
    out["dh0"] = None if initial_state is None else state_from_k_first(options, dS_seq)
    out["dh"] = state_from_k_first(options, dh)
    return out
