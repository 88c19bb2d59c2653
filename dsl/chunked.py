"""The chunked NumPy fp64 reference forward: the algorithm the kernels implement.

Tokens are cut into chunks of C = chunk_size (the spec's, 64 by default); chunks restart
at every sequence start under cu_seqlens. Options are applied once by
:mod:`~linattn.dsl.preprocess` (q carries the scale, g is per key channel). Per chunk
and value head, with S the state entering the chunk ([K, V], K-first), rows i, j in
[0, L), L <= C, and E_ij = exp(g_cum_i - g_cum_j) masked to i >= j (<= 1 for decays):

  1. gate cumsum        g_cum_i = sum_{s <= i} g_s                   (within the chunk)
  2. intra-chunk WY     (delta rule only)
                        A = (I + strict_tril(beta_i sum_k k_i k_j E_ij))^-1
                        w = A (beta * k * exp(g_cum)),   u = A (beta * v)
  3. inter-chunk state  h[chunk] = S;  v_new = u - w S  (delta) or v (additive)
                        S <- exp(g_last) S + (k * exp(g_last - g_cum))^T v_new
  4. output             o = (q * exp(g_cum)) S + tril_incl(sum_k q_i k_j E_ij) v_new

With the value gate (additive rule only) the decay runs along the value channels
instead: gv_cum_i the in-chunk cumsum of gv [V], and the state's columns decay,

  3. (value gate)       S <- S diag(exp(gv_last)) + k^T (v_new * exp(gv_last - gv_cum))
  4. (value gate)       o_i = exp(gv_cum_i) * (q_i S)
                              + sum_{j <= i} (q_i . k_j) v_new_j * exp(gv_cum_i - gv_cum_j)

(the key-channel factors above stay, g being zero). Only exponentials of g_cum (<= 0)
and of differences g_i - g_j with i >= j are taken, so long decays never overflow. The stage functions below act on one chunk for all value
heads at once ([HV, L, ..] arrays); :mod:`~linattn.dsl.chunked_bwd` reuses them.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .preprocess import check_call, prepare, state_from_k_first
from .recurrent import _initial_states
from .spec import OpSpec, Options, SpecError


class Chunk(NamedTuple):
    """Tokens [start, end) of sequence n in batch row b; slot = its index in h."""
    n: int
    b: int
    start: int
    end: int
    slot: int


def chunk_table(dims, chunk_size: int) -> tuple[list, int]:
    """Chunks of every sequence, and NC, the number of chunk slots per batch row.

    Fixed length: slots count the chunks of each batch row (h is [B, NC, ..]); varlen
    (B == 1): slots count chunks over all sequences in order (h is [1, NC_total, ..]).
    """
    chunks, next_slot = [], [0] * dims.B
    for seg in dims.segments:
        for s in range(seg.start, seg.end, chunk_size):
            chunks.append(Chunk(seg.n, seg.b, s, min(s + chunk_size, seg.end), next_slot[seg.b]))
            next_slot[seg.b] += 1
    return chunks, max(next_slot, default=0)


def chunk_inputs(eff, c: Chunk):
    """The chunk's effective inputs as head-major arrays: q, k, g [HV, L, K], v [HV, L, V],
    beta [HV, L] (or None)."""
    take = lambda x: np.ascontiguousarray(np.swapaxes(x[c.b, c.start:c.end], 0, 1))  # noqa: E731
    beta = None if eff.beta is None else take(eff.beta)
    return take(eff.q), take(eff.k), take(eff.v), take(eff.g), beta


def chunk_value_gate(eff, c: Chunk):
    """The chunk's per-value-channel log gate, head-major [HV, L, V]; None without one."""
    if eff.gv is None:
        return None
    return np.ascontiguousarray(np.swapaxes(eff.gv[c.b, c.start:c.end], 0, 1))


def scatter_rows(dst, c: Chunk, x):
    """Write a head-major chunk array x [HV, L, ..] into dst [B, T, HV, ..] at c's rows."""
    dst[c.b, c.start:c.end] = np.swapaxes(x, 0, 1)


def check_chunk_size(spec: OpSpec, chunk_size) -> int:
    """The chunk size to use: the spec's by default. The kernels use 16, 32 or 64; the
    references accept any positive size (tiny chunks make multi-chunk tests cheap)."""
    if spec.rule.maths.vector_inputs:
        raise SpecError(f"{spec.name}: the {spec.rule.value} rule's references are "
                        "dsl.recurrent and dsl.torch_reference (this module's take the "
                        "additive and delta rules)")
    C = spec.chunk_size if chunk_size is None else chunk_size
    if not isinstance(C, (int, np.integer)) or C < 1:
        raise SpecError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return int(C)


# -- stages (one chunk, all heads) -----------------------------------------------------------

def gate_cumsum(g):
    """Stage 1: within-chunk cumulative log decay, [HV, L, K]."""
    return np.cumsum(g, axis=1)


def pair_decays(g_cum):
    """E[h, i, j, c] = exp(g_cum_i - g_cum_j) for i >= j, else 0: [HV, L, L, Kg], where
    Kg = 1 when every key channel decays alike (scalar gate, no gate), else K."""
    if np.all(g_cum == g_cum[..., :1]):
        g_cum = g_cum[..., :1]
    L = g_cum.shape[1]
    keep = np.tril(np.ones((L, L), dtype=bool))[None, :, :, None]
    return np.exp(np.where(keep, g_cum[:, :, None, :] - g_cum[:, None, :, :], -np.inf))


def decayed_dot(a, b, E):
    """M[h, i, j] = sum_k a_ik b_jk E_ijk for a, b [HV, L, K] (E as from pair_decays)."""
    if E.shape[-1] == 1:
        return (a @ np.swapaxes(b, 1, 2)) * E[..., 0]
    return np.einsum("hik,hjk,hijk->hij", a, b, E)


def wy_representation(rule, k, v, beta, g_cum, E):
    """Stage 2, the rule's factors of the chunk (dsl/family.py chunk_factors): the delta
    rule's A [HV, L, L], w [HV, L, K], u [HV, L, V]; None for the additive rule."""
    return rule.maths.chunk_factors(k, v, beta, g_cum, lambda a, b: decayed_dot(a, b, E))


def new_values(rule, v, w, u, S):
    """Stage 3a: the values the chunk writes into the state, [HV, L, V]."""
    return rule.maths.new_values(v, w, u, S)


def advance_state(k, g_cum, S, v_new, gv_cum=None):
    """Stage 3b: the state leaving the chunk, [HV, K, V] (gv_cum [HV, L, V]: the value
    gate's in-chunk cumsum, or None)."""
    g_last = g_cum[:, -1, :]
    k_decayed = k * np.exp(g_last[:, None, :] - g_cum)
    S = np.exp(g_last)[:, :, None] * S
    if gv_cum is not None:
        gv_last = gv_cum[:, -1:, :]
        S = S * np.exp(gv_last)
        v_new = v_new * np.exp(gv_last - gv_cum)
    return S + np.swapaxes(k_decayed, 1, 2) @ v_new


def chunk_output(q, k, g_cum, E, S, v_new, gv_cum=None):
    """Stage 4: o [HV, L, V] (q already carries the scale; gv_cum as advance_state)."""
    qk = decayed_dot(q, k, E)
    inter = (q * np.exp(g_cum)) @ S
    if gv_cum is None:
        return inter + qk @ v_new
    Ev = pair_decays(gv_cum)                                   # [HV, L, L, V]
    return inter * np.exp(gv_cum) + np.einsum("hij,hjv,hijv->hiv", qk, v_new, Ev)


# -- the whole forward -----------------------------------------------------------------------

def chunked_forward(spec: OpSpec, q, k, v, g=None, beta=None, *, options: Options = Options(),
                    scale=None, initial_state=None, cu_seqlens=None, A_log=None,
                    dt_bias=None, chunk_size=None) -> dict:
    """Chunk-wise forward in fp64, with the intermediates the kernels produce.

    Arguments as :func:`~linattn.dsl.recurrent.recurrent_forward`, plus chunk_size
    (default spec.chunk_size). Returns a dict:
      o           [B, T, HV, V]
      final_state [N, HV, K, V] ([N, HV, V, K] with state_v_first)
      g_cum       within-chunk cumsum of the effective log gate, g's shape ([B, T, HV],
                  [B, T, HV, K] or, value gate, [B, T, HV, V]); None without a gate
      A           [B, T, HV, C]: row t holds row (t - chunk start) of its chunk's inverse,
                  columns past the chunk's length are 0 (delta rule; None for additive)
      w [B, T, HV, K], u [B, T, HV, V]   (delta rule; None for additive)
      v_new       [B, T, HV, V] (u - w h, undecayed; v for additive)
      h           state entering each chunk, [B, NC, HV, K, V] ([.., V, K] with
                  state_v_first); varlen: [1, NC_total, ..] with chunks numbered globally
      prepared    the effective inputs (:class:`~linattn.dsl.preprocess.Prepared`)
    """
    C = check_chunk_size(spec, chunk_size)
    dims = check_call(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    eff = prepare(spec, options, q, k, v, g, beta, scale, A_log, dt_bias)
    B, T, HV, K, V = dims.B, dims.T, dims.HV, dims.K, dims.V
    h0 = _initial_states(dims, options, initial_state)
    chunks, NC = chunk_table(dims, C)
    delta = spec.rule.maths.reads_state
    o = np.zeros((B, T, HV, V))
    g_cum_all = np.zeros((B, T, HV, V if spec.gate.per_value else K))
    A_all = np.zeros((B, T, HV, C)) if delta else None
    w_all = np.zeros((B, T, HV, K)) if delta else None
    u_all = np.zeros((B, T, HV, V)) if delta else None
    v_new_all = np.zeros((B, T, HV, V))
    h = np.zeros((B, NC, HV, K, V))
    final = h0.copy()
    for c in chunks:
        S = final[c.n].copy()                                    # state entering the chunk
        qc, kc, vc, gc, bc = chunk_inputs(eff, c)
        g_cum = gate_cumsum(gc)
        gvc = chunk_value_gate(eff, c)
        gv_cum = None if gvc is None else gate_cumsum(gvc)
        E = pair_decays(g_cum)
        w = u = None
        if delta:
            A, w, u = wy_representation(spec.rule, kc, vc, bc, g_cum, E)
            scatter_rows(A_all[..., :c.end - c.start], c, A)
            scatter_rows(w_all, c, w)
            scatter_rows(u_all, c, u)
        h[c.b, c.slot] = S
        v_new = new_values(spec.rule, vc, w, u, S)
        scatter_rows(o, c, chunk_output(qc, kc, g_cum, E, S, v_new, gv_cum))
        scatter_rows(g_cum_all, c, g_cum if gv_cum is None else gv_cum)
        scatter_rows(v_new_all, c, v_new)
        final[c.n] = advance_state(kc, g_cum, S, v_new, gv_cum)
    g_cum_out = (None if not spec.has_gate else g_cum_all if spec.gate.channels
                 else g_cum_all[..., 0])
    return dict(o=o, final_state=state_from_k_first(options, final), g_cum=g_cum_out,
                A=A_all, w=w_all, u=u_all, v_new=v_new_all,
                h=state_from_k_first(options, h), prepared=eff)
