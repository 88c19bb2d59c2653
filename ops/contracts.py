"""The benchmark table's contract ops that are not fla functions (DESIGN.md, "The ten
operators"), on top of the same generated kernels.

Implemented here: the two one-step recurrent contracts, which keep the state in the
input dtype and return it as a new tensor (the input state is not modified), the
DeltaNet chunk forward / backward pair and the GLA chunk forward / backward pair.
"""
from __future__ import annotations

from ..dsl import SpecError
from . import deltanet, gla
from .recurrent import fused_recurrent


def _step(spec, q, k, v, gate, beta, state, scale):
    """One token for [B, H, D] tensors through the fused recurrent kernel."""
    for name, x in (("q", q), ("k", k), ("v", v), ("state", state)):
        if getattr(x, "dim", lambda: -1)() != (4 if name == "state" else 3):
            raise SpecError(f"{name} must be {'[B, H, DK, DV]' if name == 'state' else '[B, H, D]'}, "
                            f"got {tuple(getattr(x, 'shape', ()))}")
    if state.dtype != q.dtype:
        raise SpecError(f"state must have q's dtype {q.dtype} (this contract keeps the state "
                        f"in the input dtype), got {state.dtype}")
    add_t = lambda x: None if x is None else x.unsqueeze(1)  # noqa: E731  [B, H, ..] -> [B, 1, H, ..]
    o, new_state = fused_recurrent(spec, add_t(q), add_t(k), add_t(v), add_t(gate), add_t(beta),
                                   scale=scale, initial_state=state, output_final_state=True,
                                   state_dtype=state.dtype)
    return o.squeeze(1), new_state


def deltanet_recurrent_fwd(q, k, v, beta, state):
    """DeltaNetRecurrentFwd: one decode step, no scale.

    q, k [B, H, DK]; v [B, H, DV]; beta [B, H]; state [B, H, DK, DV]; all in one dtype.
    v' = beta (v - S^T k); S' = S + k v'^T; o = S'^T q. Returns (o [B, H, DV],
    new_state [B, H, DK, DV]) in the input dtype (fp32 arithmetic inside).
    """
    return _step(deltanet.SPEC, q, k, v, None, beta, state, 1.0)


def gla_recurrent_fwd(q, k, v, gk, state, scale=-1.0):
    """GLARecurrentFwd: one GLA decode step.

    q, k, gk [B, H, DK] (gk: natural-log decay); v [B, H, DV]; state [B, H, DK, DV]; one
    dtype. S' = diag(exp gk) S + k v^T; o = scale S'^T q, scale <= 0 meaning DK^-0.5.
    Returns (o [B, H, DV], new_state) in the input dtype.
    """
    scale = None if scale is None or scale <= 0 else scale
    return _step(gla.SPEC, q, k, v, gk, None, state, scale)


def deltanet_chunk_fwd(q, k, v, beta):
    """DeltaNetChunkFwd: head-first q, k [B, H, L, DK], v [B, H, L, DV], beta [B, H, L]
    (f16 / bf16; DK, DV in {64, 128}); chunk 64, no scale, zero initial state.

    Returns (o, S, Aw, Au, w, u): o [B, H, L, DV]; S [B, H, NC+1, DK, DV] f32 (S[0] = 0,
    S[t] the state entering chunk t, S[NC] the final state); Aw = Au =
    (I + tril(beta K K^T, -1))^-1 per chunk [B, H, L, 64]; w = Aw (beta k); u = Au (beta v);
    all but S in the input dtype. The head-first tensors are read as they are (each
    (batch, head) pair runs as one sequence of the chunked forward): no layout conversion.
    """
    from .chunk_bwd import chunk_forward_intermediates
    return chunk_forward_intermediates(q, k, v, beta)


def deltanet_chunk_bwd(do, q, k, v, beta, S, Aw, Au, w, u):
    """DeltaNetChunkBwd: (do, q, k, v, beta, S, Aw, Au, w, u) as deltanet_chunk_fwd
    returned them (do shaped like o) -> (dq, dk, dv, dbeta), the gradients of
    sum(o * do), shaped like q, k, v, beta and in the input dtype (fp32 accumulation)."""
    from .chunk_bwd import chunk_backward
    return chunk_backward(do, q, k, v, beta, S, Aw, Au, w, u)


def gla_chunk_fwd(q, k, v, g, scale=-1.0, initial_state=None):
    """GLAChunkFwd: q, k, g [B, T, H, K] (g: natural-log decay per key channel), v [B, T,
    H, V] (f16 / bf16, one dtype); scale <= 0 (or None) meaning K^-0.5; initial_state f32
    [B, H, K, V] or None (zero).

    Returns (o [B, T, H, V] in the input dtype, final_state f32 [B, H, K, V], h f32
    [B, NC+1, H, K, V]): h[:, c] the state entering chunk c (chunk 64), h[:, NC] the final
    state (the backward's input); final_state is the view h[:, NC]. The state pass writes
    h itself from its f32 registers (no conversion pass; the output reads the states
    rounded to the input dtype).
    """
    from . import chunk
    scale = None if scale is None or scale <= 0 else scale
    # shapes, dtypes, devices: checked by the chunked forward (fla's chunk_gla rules)
    o, final, states = chunk.chunk_forward(gla.SPEC, q, k, v, g, None, scale=scale,
                                           initial_state=initial_state,
                                           output_final_state=True, return_states=True)
    B, T, HV, V = v.shape
    NC = -(-T // gla.SPEC.chunk_size)
    return o, final, states.view(B, NC + 1, HV, q.shape[-1], V)


def gla_chunk_bwd(q, k, v, g, h, do, dht=None, scale=-1.0, initial_state=None):
    """GLAChunkBwd: (q, k, v, g, h, do, dht) -> (dq, dk, dv, dg), the gradients of
    sum(o * do) + sum(final_state * dht) for gla_chunk_fwd started from h[:, 0]; h as
    gla_chunk_fwd returned it ([B, NC+1, H, K, V] f32), dht [B, H, K, V] f32 or None;
    scale <= 0 (or None) meaning K^-0.5. All four f32 (fla's), shaped like q, k, v, g;
    with initial_state (the forward's, h[:, 0]) given, dh0 [B, H, K, V] f32 follows.
    The kernels: ops/additive_bwd.py (three stages, no recompute: h is the forward's)."""
    from .additive_bwd import gla_chunk_bwd as run
    scale = None if scale is None or scale <= 0 else scale
    return run(q, k, v, g, h, do, dht, scale=scale, initial_state=initial_state)
