"""The delta rule with a per-key gate (KDA): the chunked backward, stage by stage as its
kernels compute it (fp64 NumPy, with an optional emulation of the kernels' rounding of
GEMM operands to the input dtype).

Forward, one chunk of C rows and one value head (q without the scale: the host folds it
into do; G = the in-chunk cumulative log gate per key channel, G_l its last row; the host
pads every sequence to whole chunks with zero rows and g = 0, so G stays at G_l there):

    A   = (I + strict_tril(beta_i sum_c k_ic k_jc e^{G_ic - G_jc}))^-1
    w   = A (beta k e^G),  u = A (beta v),  v_new = u - w S
    o   = (q e^G) S + Aqk v_new,   Aqk_ij = sum_c q_ic k_jc e^{G_ic - G_jc}   (i >= j)
    S'  = diag(e^{G_l}) S + (k e^{G_l - G})^T v_new

Stage 0, recompute (the forward's per-key prepare, A written as well; then its state
pass): A, w, u, Aqk, qg = q e^G, kg = k e^{G_l - G}, g_last = G_l; S per chunk (f32).

Stage 1, dv_local (per chunk): dv_local = Aqk^T do.

Stage 2, dh (sequential per sequence, last chunk first; dh = dht or 0):
    dh_leaving[t] = dh;  dv2 = dv_local + kg dh
    dh <- diag(e^{G_l}) dh + qg^T do - w^T dv2                            ... dh0 = dh

Stage 3, dqkw (per chunk; S, dh the state entering and the gradient of the one leaving):
    v_new = u - w S;  dw = -dv2 S^T;  ds = tril_incl(do v_new^T)
    dq = e^G (do S^T)          + sum_j ds_ij k_j e^{G_i - G_j}
    dk = e^{G_l - G} (v_new dh^T) + sum_i ds_ij q_i e^{G_i - G_j}       (the WY part: stage 4)
    dG = q dq - k dk;   dG[last] += sum_i k_i dk_state_i + e^{G_l} rowsum(S * dh)
the last-row term being d/dG_l of both state terms (every row's g feeds G_l).

Stage 4, wy (per chunk; du = dv2):
    dbk = A^T dw,  dbv = A^T du,  dv = beta dbv
    dM  = strict_tril(-A^T (du (beta v)^T + dw (beta k e^G)^T) A^T)
    X_i = sum_j dM_ij k_j e^{G_i - G_j},  Y_j = sum_i dM_ij beta_i k_i e^{G_i - G_j}
    dk    = dk_part + beta e^G dbk + beta X + Y
    dbeta = rowsum(dbv v) + rowsum(dbk k e^G) + rowsum(k X)
    dG   += beta k e^G dbk + beta k X - k Y
    dg    = the reverse cumulative sum of dG within the chunk (per key channel)

The pair sums (Aqk's and A's gradients) go through tensor-core GEMMs without
exponentials of positive numbers, as the additive rule's backward does
(dsl/additive_bwd.py): the rows fall into blocks of 16; below the diagonal the decay
factors through the first row r of a block, e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j}
(both <= 1 for j < r <= i), and the 16 x 16 blocks on the diagonal are summed element
by element (:func:`pair_grads`).
"""
from __future__ import annotations

import numpy as np

from .additive_bwd import rounding
from .chunked import check_chunk_size, chunk_inputs, chunk_table, scatter_rows
from .preprocess import (Prepared, check_call, prepare, prepare_vjp, state_from_k_first,
                         state_to_k_first)
from .recurrent import _initial_states
from .spec import Gate, OpSpec, Options, Rule, SpecError

SUB = 16
_T = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731


def _pad(x, C):
    """[HV, L, ..] -> [HV, C, ..], zero rows past L."""
    return np.pad(x, [(0, 0), (0, C - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def pair_grads(dM, a, b, G, rnd=rounding(None)):
    """The gradients of M_ij = sum_c a_ic b_jc e^{G_ic - G_jc} (i >= j) from dM:
    (da_i = sum_{j <= i} dM_ij b_j e^{G_i - G_j}, db_j = sum_{i >= j} dM_ij a_i e^{G_i - G_j})
    for a, b, G [HV, C, K] and dM [HV, C, C] (lower triangular, as the GEMMs read it), as
    the kernels form them: per first row r = 16, 32, .. of the blocks below the first,
    Ar = a e^{G - G_r} (rows >= r) and Br = b e^{G_r - G} (rows < r), rounded as GEMM
    operands; dM Br gives da on the rows of block [r, r + 16), dM^T Ar gives db on the
    rows of block [r - 16, r), each scaled by its own factor; the diagonal blocks are
    summed element by element (one exponential per pair and channel). The masked rows'
    exponents are clamped at 0 (as the kernels do), so none is positive."""
    HV, C, K = a.shape
    rows = np.arange(C)
    da, db = np.zeros_like(a), np.zeros_like(b)
    for r in range(SUB, C, SUB):
        blk = (rows >= r) & (rows < r + SUB)
        prev = (rows >= r - SUB) & (rows < r)
        Ar = rnd(np.where((rows >= r)[None, :, None], a * np.exp(np.minimum(G - G[:, r:r + 1], 0)), 0))
        Br = rnd(np.where((rows < r)[None, :, None], b * np.exp(np.minimum(G[:, r:r + 1] - G, 0)), 0))
        da[:, blk] += (dM @ Br)[:, blk] * np.exp(G[:, blk] - G[:, r:r + 1])
        db[:, prev] += (_T(dM) @ Ar)[:, prev] * np.exp(G[:, r:r + 1] - G[:, prev])
    for r0 in range(0, C, SUB):                    # diagonal blocks, exponents <= 0
        for i in range(r0, r0 + SUB):
            js = np.arange(r0, i + 1)
            e = np.exp(G[:, i:i + 1, :] - G[:, js, :])         # [HV, n, K]
            da[:, i] += np.einsum("hj,hjk,hjk->hk", dM[:, i, js], b[:, js], e)
            db[:, js] += dM[:, i, js][..., None] * a[:, i:i + 1] * e
    return da, db


def recompute(q, k, v, beta, g, rnd=rounding(None)):
    """Stage 0 for one chunk (all value heads): q, k, g [HV, C, K], v [HV, C, V], beta
    [HV, C]. Returns dict(G, A, w, u, aqk, qg, kg, g_last), rounded where the kernel
    stores them in the input dtype (G, g_last f32)."""
    G = np.cumsum(g, axis=1)
    C = G.shape[1]
    E = np.exp(np.where(np.tri(C, dtype=bool)[None, :, :, None],
                        G[:, :, None, :] - G[:, None, :, :], -np.inf))
    kk = np.einsum("hik,hjk,hijk->hij", k, k, E) * np.tri(C, k=-1)
    A = rnd(np.linalg.inv(np.eye(C) + beta[:, :, None] * kk))
    G_l = G[:, -1:, :]
    return dict(G=G, A=A, w=rnd(A @ rnd(beta[:, :, None] * k * np.exp(G))),
                u=rnd(A @ rnd(beta[:, :, None] * v)),
                aqk=rnd(np.einsum("hik,hjk,hijk->hij", q, k, E)),
                qg=rnd(q * np.exp(G)), kg=rnd(k * np.exp(G_l - G)), g_last=G_l[:, 0])


def advance_state(kg, g_last, w, u, S, rnd=rounding(None)):
    """The state pass, one chunk: the state leaving it ([HV, K, V], f32 in the kernel)."""
    v_new = rnd(u - w @ rnd(S))
    return np.exp(g_last)[:, :, None] * S + _T(kg) @ v_new


def dv_local(aqk, do, rnd=rounding(None)):
    """Stage 1: Aqk^T do (stored in the input dtype)."""
    return rnd(_T(aqk) @ do)


def dh_step(qg, kg, w, do, g_last, dvl, dh, rnd=rounding(None)):
    """Stage 2, one chunk: (dv2, the gradient of the state entering it) from dh (of the
    state leaving it, f32)."""
    dv2 = rnd(dvl + kg @ rnd(dh))
    return dv2, np.exp(g_last)[:, :, None] * dh + _T(qg) @ do - _T(w) @ dv2


def dqkw(q, k, w, u, do, G, dv2, S, dh, rnd=rounding(None)):
    """Stage 3, one chunk: (dq (input dtype), dk_part (f32), dw (input dtype), dg_part
    [HV, C, K] f32) from the state entering it S and the gradient of the one leaving dh."""
    S_s, dh_s = rnd(S), rnd(dh)
    G_l = G[:, -1:, :]
    v_new = rnd(u - w @ S_s)
    dw = rnd(-dv2 @ _T(S_s))
    dq = (do @ _T(S_s)) * np.exp(G)
    dk = (v_new @ _T(dh_s)) * np.exp(G_l - G)
    dg_last = np.sum(k * dk, axis=1) + np.exp(G_l[:, 0]) * np.sum(S * dh, axis=-1)
    ds = rnd(np.tril(do @ _T(v_new)))
    da, db = pair_grads(ds, q, k, G, rnd)
    dq, dk = dq + da, dk + db
    dG = q * dq - k * dk
    dG[:, -1] += dg_last
    return rnd(dq), dk, dw, dG


def wy(k, v, beta, G, A, dw, du, dk_part, dg_part, rnd=rounding(None)):
    """Stage 4, one chunk: (dk, dv, dbeta (input dtype), dg [HV, C, K] f32: the gradient
    of the chunk's per-token log gate)."""
    b = beta[:, :, None]
    eG = np.exp(G)
    bk, bv = rnd(b * k * eG), rnd(b * v)
    dbk, dbv = _T(A) @ dw, _T(A) @ du
    dbeta = np.sum(dbv * v, axis=-1) + np.sum(dbk * k * eG, axis=-1)
    dk = dk_part + b * eG * dbk
    dG = dg_part + b * k * eG * dbk
    dA = rnd(du @ _T(bv) + dw @ _T(bk))
    dM = rnd(np.tril(-(rnd(_T(A) @ dA) @ _T(A)), -1))
    X, Y = pair_grads(dM, b * k, k, G, rnd)
    dk = dk + b * X + Y
    dbeta = dbeta + np.sum(k * X, axis=-1)
    dG = dG + b * k * X - k * Y
    dg = np.flip(np.cumsum(np.flip(dG, 1), 1), 1)
    return rnd(dk), rnd(b * dbv), rnd(dbeta), dg


def delta_key_backward(spec: OpSpec, q, k, v, g, beta, *, do, dht=None,
                       options: Options = Options(), scale=None, initial_state=None,
                       cu_seqlens=None, A_log=None, dt_bias=None, chunk_size=None,
                       round_to=None) -> dict:
    """Gradients of L = sum(o * do) + sum(ht * dht) for a delta-rule spec with a per-key
    gate, by the kernels' stages (chunk sizes that are multiples of 16).

    Arguments as :func:`~linattn.dsl.recurrent.recurrent_backward`; round_to: "float16" /
    "bfloat16" rounds what the kernels round (q, k, v, do taken as given). Returns
    dict(dq, dk, dv, dg, dbeta, dh0 (None without an initial state), dA_log, ddt_bias
    (None without the gate in the kernel / dt_bias)) in the raw inputs' shapes.
    """
    if spec.rule is not Rule.DELTA or spec.gate is not Gate.KEY:
        raise SpecError(f"{spec.name}: delta_key_backward is the delta rule's with a "
                        f"per-key gate")
    C = check_chunk_size(spec, chunk_size)
    if C % SUB:
        raise SpecError(f"the per-key backward's chunks are multiples of {SUB}, got {C}")
    dims = check_call(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, A_log,
                      dt_bias)
    eff = prepare(spec, options, q, k, v, g, beta, scale, A_log, dt_bias)
    s = spec.scale_for(dims.K, scale)
    rnd = rounding(round_to)
    chunks, _ = chunk_table(dims, C)
    by_seq = [[c for c in chunks if c.n == n] for n in range(dims.N)]
    do = np.asarray(do, dtype=np.float64) * s             # the host folds the scale in
    h0 = _initial_states(dims, options, initial_state)
    dS = (np.zeros_like(h0) if dht is None
          else np.array(state_to_k_first(options, dht), dtype=np.float64))
    grads = Prepared(*(np.zeros_like(x) for x in eff[:5]))

    def padded(c):
        qc, kc, vc, gc, bc = chunk_inputs(eff, c)
        doc = np.swapaxes(do[c.b, c.start:c.end], 0, 1)
        return [_pad(x, C) for x in (qc / s, kc, vc, gc, bc, doc)]

    for n, cs in enumerate(by_seq):
        xs = [padded(c) for c in cs]
        rec = [recompute(qc, kc, vc, bc, gc, rnd) for qc, kc, vc, gc, bc, _ in xs]
        states, S = [], h0[n]
        for r in rec:                                       # the forward's states
            states.append(S)
            S = advance_state(r["kg"], r["g_last"], r["w"], r["u"], S, rnd)
        dh = dS[n].copy()           # (dstates keeps it; dS[n] is overwritten below)
        dstates, dv2s = [None] * len(cs), [None] * len(cs)
        for t in reversed(range(len(cs))):                  # stage 2 (1 inside)
            r, doc = rec[t], xs[t][5]
            dstates[t] = dh
            dv2s[t], dh = dh_step(r["qg"], r["kg"], r["w"], doc, r["g_last"],
                                  dv_local(r["aqk"], doc, rnd), dh, rnd)
        dS[n] = dh
        for t, c in enumerate(cs):                          # stages 3 and 4
            qc, kc, vc, gc, bc, doc = xs[t]
            r = rec[t]
            dq, dk_part, dw, dg_part = dqkw(qc, kc, r["w"], r["u"], doc, r["G"], dv2s[t],
                                            states[t], dstates[t], rnd)
            dk, dv, dbeta, dg = wy(kc, vc, bc, r["G"], r["A"], dw, dv2s[t], dk_part, dg_part,
                                   rnd)
            L = c.end - c.start
            for dst, x in zip(grads, (dq / s, dk, dv, dg, dbeta)):
                scatter_rows(dst, c, x[:, :L])
    out = prepare_vjp(spec, options, q, k, v, g, beta, scale, A_log, dt_bias, grads)
    out["dh0"] = None if initial_state is None else state_from_k_first(options, dS)
    return out
