"""The additive rule's chunked backward, stage by stage as its kernels compute it (fp64
NumPy, with an optional emulation of the kernels' rounding to the input dtype).

Forward (one sequence, value head, chunk of C rows; q carries the scale; G = the in-chunk
cumulative log gate per key channel, G_l its last valid row; rows past the chunk's end are
zero with g = 0, so G stays at G_l there):

    o_i   = (q_i e^{G_i}) h_in + sum_{j <= i} A_ij v_j,   A_ij = sum_k q_ik k_jk e^{G_ik - G_jk}
    h_out = diag(e^{G_l}) h_in + sum_j (k_j e^{G_l - G_j})^T v_j

Stage 1, chunk_bwd_dstate (sequential per sequence, last chunk first; dh = dht or 0):
    dh_leaving[t] = dh;  dh <- diag(e^{G_l}) dh + (q e^{G})^T do           ... dh0 = dh
    (the transition is diagonal, so rows of dh (key channels) are independent)

Stage 2, chunk_bwd_dqkvg (every chunk in parallel; dh = dh_leaving of the chunk):
    dA  = tril_incl(do v^T)
    dq  = e^{G} (do h_in^T)              + sum_j dA_ij k_j e^{G_i - G_j}
    dk  = e^{G_l - G} (v dh^T)           + sum_i dA_ij q_i e^{G_i - G_j}
    dv  = A^T do + (k e^{G_l - G}) dh
    dG  = q dq - k dk                    (per row and key channel)
    dg  = reverse cumsum of dG within the chunk + rowsum(h_out * dh)
the last term being d/dG_l of both state terms, e^{G_l} <h_in, dh> + sum_j k_j dk_state_j,
which is <h_out, dh> per key channel (every row's g feeds G_l); formed that way, h_out is
not read.

The pair sums go through tensor-core GEMMs without exponentials of positive numbers: the
chunk's rows fall into blocks of 16; for the block pairs below the diagonal the decay
factors through a reference row r = 16 I (the first row of block I):
e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j}, both <= 1 for j < r <= i, so
    A[I, :r]   = (q e^{G - G_r})[I] (k e^{G_r - G})[:r]^T
    dq[I]     += e^{G_i - G_r} (dA[I, :r] (k e^{G_r - G})[:r])
    dk[J]     += e^{G_r - G_j} (dA[r:, J]^T (q e^{G - G_r})[r:])      (r = 16 (J + 1))
each product added to its block's rows with its scaling, and the 16 x 16 blocks on the
diagonal are summed element by element (one exponential per pair and channel); the state
terms are added scaled by e^G (dq) and e^{G_l - G} (dk). A scalar gate has one decay per
row, E_ij = e^{G_i - G_j} <= 1, applied to the C x C products directly; no gate, E = 1
and no dg.

Above K = 128 the kernel forms stage 2 in key blocks (:func:`chunk_grads_key_blocks`):
every term but dv (and a scalar gate's dg) is per key channel, and those two are sums of
the blocks' partials.
"""
from __future__ import annotations

import numpy as np

from .chunked import (check_chunk_size, chunk_table, chunk_inputs, chunked_forward,
                      scatter_rows)
from .preprocess import (Prepared, check_call, prepare, prepare_vjp, state_from_k_first,
                         state_to_k_first)
from .recurrent import _initial_states
from .spec import Gate, OpSpec, Options, Rule, SpecError, key_twin

SUB = 16


def rounding(dtype):
    """x -> x rounded to ``dtype`` ("float16", "bfloat16") and back to fp64, round to
    nearest even (what a cast to the GEMM operand dtype does); None: no rounding."""
    if dtype is None:
        return lambda x: x
    if dtype == "float16":
        return lambda x: np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)
    if dtype != "bfloat16":
        raise SpecError(f"rounding emulates float16 or bfloat16, got {dtype!r}")

    def bf16(x):
        u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.astype(np.uint32).view(np.float32).astype(np.float64)
    return bf16


def _pad(x, C):
    """[HV, L, ..] -> [HV, C, ..], zero rows past L."""
    pad = [(0, 0), (0, C - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return np.pad(x, pad)


def _blocks(C):
    """Reference rows r = 16, 32, .. < C of the blocks below the first."""
    return range(SUB, C, SUB)


def _same_block(C):
    idx = np.arange(C) // SUB
    return (idx[:, None] == idx[None, :]) & np.tri(C, dtype=bool)


def _key_pairs(q, k, G, dA, rnd, dq, dk):
    """A (tril_incl, the raw products) and the pair terms of dq, dk for the per-key gate,
    as the kernel forms them (module docstring). q, k, G [HV, C, K]; dA [HV, C, C] as the
    GEMMs read it (rounded, masked); dq, dk [HV, C, K] hold the state terms on entry
    (unscaled by the gate) and the complete gradients on return."""
    HV, C, K = q.shape
    rows = np.arange(C)
    dq *= np.exp(G)
    dk *= np.exp(G[:, -1:, :] - G)
    A = np.zeros((HV, C, C))
    for r in _blocks(C):
        blk = (rows >= r) & (rows < r + SUB)
        prev = (rows >= r - SUB) & (rows < r)
        Qr = rnd(np.where((rows >= r)[None, :, None], q * np.exp(G - G[:, r:r + 1]), 0))
        Kr = rnd(np.where((rows < r)[None, :, None], k * np.exp(G[:, r:r + 1] - G), 0))
        A[:, blk] = (Qr @ np.swapaxes(Kr, 1, 2))[:, blk]
        dq[:, blk] += (dA @ Kr)[:, blk] * np.exp(G[:, blk] - G[:, r:r + 1])
        dk[:, prev] += (np.swapaxes(dA, 1, 2) @ Qr)[:, prev] * np.exp(G[:, r:r + 1] - G[:, prev])
    diag = _same_block(C)
    for i in range(C):                       # element by element, exponents <= 0
        js = np.nonzero(diag[i])[0]
        e = np.exp(G[:, i:i + 1, :] - G[:, js, :])            # [HV, n, K]
        A[:, i, js] = np.einsum("hk,hjk,hjk->hj", q[:, i], k[:, js], e)
        dq[:, i] += np.einsum("hj,hjk,hjk->hk", dA[:, i, js], k[:, js], e)
        dk[:, js] += dA[:, i, js][..., None] * q[:, i:i + 1] * e
    return A


def chunk_grads(gate: Gate, q, k, v, do, g, h_in, dh, rnd=rounding(None)):
    """Stage 2 for one chunk, all value heads: q, k, g [HV, C, K] (g per key channel; a
    scalar gate broadcast over K), v, do [HV, C, V], rows past the chunk's end zero;
    h_in, dh [HV, K, V] (the state entering, the gradient of the one leaving). Returns
    (dq, dk, dv, dg) with dg [HV, C, K] (summed over K for a scalar gate by the caller).
    rnd: the rounding of GEMM operands (:func:`rounding`). rowsum(h_out * dh) is formed
    as the kernel forms it, e^{G_l} rowsum(h_in * dh) + colsum(k * dk_state), h_out
    = diag(e^{G_l}) h_in + (k e^{G_l - G})^T v not read."""
    HV, C, K = q.shape
    G = np.cumsum(g, axis=1)
    G_l = G[:, -1:, :]
    tril = np.tri(C, dtype=bool)
    h_s, dh_s = rnd(h_in), rnd(dh)
    dA_f = np.where(tril, do @ np.swapaxes(v, 1, 2), 0)
    dq = do @ np.swapaxes(h_s, 1, 2)                          # state terms, ungated
    dk = v @ np.swapaxes(dh_s, 1, 2)
    hd = np.exp(G_l) * np.sum(h_in * dh, axis=-1)[:, None, :] + \
        np.sum(k * dk * np.exp(G_l - G), axis=1, keepdims=True)
    kdec = rnd(k * np.exp(G_l - G))
    if gate is Gate.KEY:
        dA = rnd(dA_f)
        A = _key_pairs(q, k, G, dA, rnd, dq, dk)
    else:
        E = np.where(tril, np.exp(G[:, :, None, 0] - G[:, None, :, 0]), 0)
        A = (q @ np.swapaxes(k, 1, 2)) * E
        dA = rnd(dA_f * E)
        dq = dq * np.exp(G) + dA @ k
        dk = dk * np.exp(G_l - G) + np.swapaxes(dA, 1, 2) @ q
    dv = np.swapaxes(rnd(A), 1, 2) @ do + kdec @ dh_s
    dG = q * dq - k * dk
    dg = np.flip(np.cumsum(np.flip(dG, 1), 1), 1) + hd
    return dq, dk, dv, dg


def chunk_grads_key_blocks(gate: Gate, q, k, v, do, g, h_in, dh, block_k: int,
                           rnd=rounding(None)):
    """Stage 2 as chunk_bwd_dqkvg forms it in key blocks of block_k channels (K > 128):
    :func:`chunk_grads` on each block's channels alone. dq, dk and dg are per key
    channel, and dA reads no key channel, so they come out whole; A and (k e^{G_l - G}) dh
    are sums over the channels, so each block's dv (A_b^T do + kd_b dh_b) is a partial,
    as is a block's share of a scalar gate's dg (its channels' columns summed). Returns
    (dq, dk [HV, C, K], dv [K / block_k, HV, C, V] partials, dg [HV, C, K])."""
    K = q.shape[-1]
    if K % block_k:
        raise SpecError(f"block_k={block_k} must divide K={K}")
    cut = lambda x, b: x[..., b:b + block_k]  # noqa: E731
    outs = [chunk_grads(gate, cut(q, b), cut(k, b), v, do, cut(g, b),
                        *(s[:, b:b + block_k] for s in (h_in, dh)), rnd)
            for b in range(0, K, block_k)]
    dq, dk, dg = (np.concatenate([o[i] for o in outs], axis=-1) for i in (0, 1, 3))
    return dq, dk, np.stack([o[2] for o in outs]), dg


def dstate_step(q, g, do, dh, rnd=rounding(None)):
    """Stage 1, one chunk: the gradient of the state entering it from dh (leaving it);
    q, g [HV, C, K], do [HV, C, V], dh [HV, K, V] (f32 in the kernel)."""
    G = np.cumsum(g, axis=1)
    qg = rnd(q * np.exp(G))
    return np.exp(G[:, -1, :])[:, :, None] * dh + np.swapaxes(qg, 1, 2) @ do


def additive_backward(spec: OpSpec, q, k, v, g=None, *, do, dht=None,
                      options: Options = Options(), scale=None, initial_state=None,
                      cu_seqlens=None, chunk_size=None, round_to=None) -> dict:
    """Gradients of L = sum(o * do) + sum(ht * dht) for an additive-rule spec, by the
    kernels' two stages (chunk sizes that are multiples of 16).

    Arguments as :func:`~linattn.dsl.recurrent.recurrent_backward`; round_to: "float16" /
    "bfloat16" rounds every GEMM operand the kernels round (q, k, v, do taken as given).
    Returns dict(dq, dk, dv, dg, dh0 (None without an initial state), states
    [NS, HV, K, V], dstates [NS, HV, K, V]: per sequence, the state entering each chunk
    then the final state, and the gradient of each (row of chunk t: offset_n + n + t,
    offset_n = chunks before sequence n; the kernels' layout, K-first)).
    """
    if spec.rule is not Rule.ADDITIVE:
        raise SpecError(f"{spec.name}: additive_backward is the additive rule's backward")
    if spec.gate.per_value:
        return value_gate_backward(spec, q, k, v, g, do=do, dht=dht, options=options,
                                   scale=scale, initial_state=initial_state,
                                   cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                   round_to=round_to)
    C = check_chunk_size(spec, chunk_size)
    if C % SUB:
        raise SpecError(f"the additive backward's chunks are multiples of {SUB}, got {C}")
    dims = check_call(spec, options, q, k, v, g, None, initial_state, cu_seqlens)
    eff = prepare(spec, options, q, k, v, g, None, scale)
    rnd = rounding(round_to)
    chunks, _ = chunk_table(dims, C)
    by_seq = [[c for c in chunks if c.n == n] for n in range(dims.N)]
    rows = np.cumsum([0] + [len(cs) + 1 for cs in by_seq])
    states = np.zeros((rows[-1], dims.HV, dims.K, dims.V))
    dstates = np.zeros_like(states)
    h0 = _initial_states(dims, options, initial_state)
    dS = (np.zeros_like(h0) if dht is None
          else np.array(state_to_k_first(options, dht), dtype=np.float64))
    do = np.asarray(do, dtype=np.float64)
    padded = lambda c: [_pad(x, C) for x in chunk_inputs(eff, c)[:4]]  # noqa: E731
    for n, cs in enumerate(by_seq):
        S = h0[n]
        for t, c in enumerate(cs):                      # the forward's states
            qc, kc, vc, gc = padded(c)
            states[rows[n] + t] = S
            G = np.cumsum(gc, axis=1)
            S = (np.exp(G[:, -1])[:, :, None] * S
                 + np.swapaxes(kc * np.exp(G[:, -1:] - G), 1, 2) @ vc)
        states[rows[n] + len(cs)] = S
        dh = dS[n]
        for t in reversed(range(len(cs))):               # stage 1
            qc, _, _, gc = padded(cs[t])
            doc = _pad(np.swapaxes(do[cs[t].b, cs[t].start:cs[t].end], 0, 1), C)
            dstates[rows[n] + t + 1] = dh
            dh = dstate_step(qc, gc, doc, dh, rnd)
        dS[n] = dh
    grads = Prepared(*(np.zeros_like(x) for x in eff[:4]), None)
    for n, cs in enumerate(by_seq):                      # stage 2
        for t, c in enumerate(cs):
            qc, kc, vc, gc = padded(c)
            doc = _pad(np.swapaxes(do[c.b, c.start:c.end], 0, 1), C)
            r = rows[n] + t
            out = chunk_grads(spec.gate, qc, kc, vc, doc, gc, states[r], dstates[r + 1], rnd)
            L = c.end - c.start
            for dst, x in zip(grads, out):
                scatter_rows(dst, c, x[:, :L])
    res = prepare_vjp(spec, options, q, k, v, g, None, scale, None, None, grads)
    res["dh0"] = None if initial_state is None else state_from_k_first(options, dS)
    res.update(states=states, dstates=dstates)
    return res


def value_gate_backward(spec: OpSpec, q, k, v, g, *, do, dht=None,
                        options: Options = Options(), scale=None, initial_state=None,
                        cu_seqlens=None, chunk_size=None, round_to=None) -> dict:
    """:func:`additive_backward` of a value-gated spec, by its key-gated twin
    (dsl.spec.key_twin) on the effective inputs: the twin's backward of (q', k', v', do')
    = (do, v, k, q) (q carrying the scale, k at HV heads) over the transposed states gives
    dv, dk, dg and dh0, and the twin's forward output of (do, v, k) from h0 is dq. The
    twin's K-first state is the value gate's V-first one, so states, dht and dh0 keep
    their arrays with the state layout flipped. Returns as additive_backward, states and
    dstates the twin's (K-first: [NS, HV, V, K])."""
    check_call(spec, options, q, k, v, g, None, initial_state, cu_seqlens)
    eff = prepare(spec, options, q, k, v, g, None, scale)
    twin, do = key_twin(spec), np.asarray(do, dtype=np.float64)
    call = dict(options=Options(state_v_first=not options.state_v_first), scale=1.0,
                initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    dq = chunked_forward(twin, do, eff.v, eff.k, eff.gv, **call)["o"]
    tw = additive_backward(twin, do, eff.v, eff.k, eff.gv, do=eff.q, dht=dht,
                           round_to=round_to, **call)
    res = prepare_vjp(spec, options, q, k, v, g, None, scale, None, None,
                      Prepared(dq, tw["dv"], tw["dk"], None, None, tw["dg"]))
    res.update(dh0=tw["dh0"], states=tw["states"], dstates=tw["dstates"])
    return res
