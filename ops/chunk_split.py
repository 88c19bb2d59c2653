"""The split state pass of the chunked forward (ops/chunk.py, SPLIT / LINATTN_CHUNK_SPLIT=1).

The state pass is sequential per (sequence, value head, value block): with few value
heads (tensor-parallel shapes: 2-16 heads) most SMs idle. Per chunk the update is affine,
S' = A_t S + B_t, so each sequence is cut into segments of L chunks (never across a
sequence boundary) and

  1. chunk_segment_state    grid ((K+V)/BV, NS * HV): each segment's map [A_seg | B_seg]
                            (the recurrence on [I | 0] with values [0 | u]), in parallel
  2. chunk_segment_combine  grid (V/BV, N * HV): S_start(s+1) = A_seg(s) S_start(s) +
                            B_seg(s) from the initial state; writes the final state
  3. chunk_state (or chunk_state_output) run on the segments as if they were sequences,
     from their start states: h / v_new / o exactly as the unsplit pass writes them.

Stability (delta rule): A_seg is the product of the tokens' transitions alpha_t (I - beta_t
k_t k_t^T); with |k_t| = 1 (l2norm), beta_t in [0, 2] and alpha_t <= 1 each has spectral
norm <= 1, so A_seg is non-expansive and the combine does not amplify rounding errors.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..dsl import SpecError

#: the combine's cost per segment step, in units of one chunk step of the state pass
COMBINE_STEP_COST = 1.0


def build_segment_tables(cu_seqlens, seg_chunks: int, chunk_size: int = 64):
    """Segments of at most ``seg_chunks`` chunks for sequences cu[n] .. cu[n+1].

    Returns int32 NumPy arrays:
      seg_cu [NS+1]             segment s spans tokens seg_cu[s] .. seg_cu[s+1]
      seg_chunk_offsets [NS+1]  segment s starts at global chunk seg_chunk_offsets[s]
                                (global chunk numbering of build_chunk_tables)
      seq_seg_offsets [N+1]     sequence n owns segments seq_seg_offsets[n] .. [n+1]
    An empty sequence owns no segment.
    """
    if seg_chunks < 1:
        raise SpecError(f"segment length must be >= 1 chunk, got {seg_chunks}")
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise SpecError(f"cu_seqlens must start at 0 and be nondecreasing, got {cu.tolist()}")
    counts = (np.diff(cu) + chunk_size - 1) // chunk_size
    chunk_offsets = np.concatenate([[0], np.cumsum(counts)])
    nseg = (counts + seg_chunks - 1) // seg_chunks
    seq_seg_offsets = np.concatenate([[0], np.cumsum(nseg)])
    seq_of_seg = np.repeat(np.arange(counts.size), nseg)
    local = np.arange(seq_seg_offsets[-1]) - seq_seg_offsets[:-1][seq_of_seg]
    seg_cu = np.concatenate([cu[:-1][seq_of_seg] + local * seg_chunks * chunk_size, cu[-1:]])
    seg_c0 = np.concatenate([chunk_offsets[:-1][seq_of_seg] + local * seg_chunks,
                             chunk_offsets[-1:]])
    return seg_cu.astype(np.int32), seg_c0.astype(np.int32), seq_seg_offsets.astype(np.int32)


def _waves(ctas: int, num_sms: int) -> int:
    return -(-ctas // num_sms)


def fill_block(cols: int, rows: int, num_sms: int, divides=()) -> int:
    """Smallest column block of 16 / 32 / 64 (dividing ``cols`` and every ``divides``)
    that keeps rows * cols / block CTAs within one wave, else the largest."""
    blocks = [b for b in (16, 32, 64) if cols % b == 0 and all(d % b == 0 for d in divides)]
    if not blocks:
        raise SpecError(f"{cols} (and {divides}) must be multiples of 16")
    fits = [b for b in blocks if rows * (cols // b) <= num_sms]
    return min(fits) if fits else max(blocks)


def split_cost(chunk_counts, HV, K, V, seg_chunks, num_sms):
    """Modelled time of the split pass in chunk steps: (waves of step 1 + waves of step 3)
    x segment length + the combine's steps (longest sequence's segment count)."""
    counts = np.asarray(chunk_counts, dtype=np.int64)
    nseg = (counts + seg_chunks - 1) // seg_chunks
    NS = int(nseg.sum())
    L = int(min(seg_chunks, counts.max()))
    b1 = fill_block(K + V, NS * HV, num_sms, (K, V))
    b3 = fill_block(V, NS * HV, num_sms)
    return (L * (_waves(NS * HV * (K + V) // b1, num_sms) + _waves(NS * HV * V // b3, num_sms))
            + COMBINE_STEP_COST * int(nseg.max()))


def segment_chunks(chunk_counts, HV, K, V, num_sms, override=None) -> int:
    """Segment length in chunks for the split pass, or 0 when not splitting is cheaper
    (modelled: the unsplit pass takes waves x longest sequence's chunks)."""
    counts = np.asarray(chunk_counts, dtype=np.int64)
    if counts.size == 0 or counts.max() <= 1:
        return 0
    if override is not None:
        return int(override)
    N = counts.size
    base = counts.max() * _waves(N * HV * V // fill_block(V, N * HV, num_sms), num_sms)
    best, best_cost = 0, float(base)
    L = 2
    while L < counts.max():
        cost = split_cost(counts, HV, K, V, L, num_sms)
        if cost < best_cost:
            best, best_cost = L, cost
        L *= 2
    return best


_TABLE_CACHE: OrderedDict = OrderedDict()


def _device_segment_tables(cu: tuple, seg_chunks: int, chunk_size: int, device):
    """(seg_cu, seg_chunk_offsets, seq_seg_offsets) int32 device tensors, cached."""
    import torch
    key = (cu, seg_chunks, chunk_size, str(device))
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        _TABLE_CACHE.move_to_end(key)
        return hit
    parts = build_segment_tables(cu, seg_chunks, chunk_size)
    dev = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
    a, b = parts[0].size, parts[1].size
    out = (dev[:a], dev[a:a + b], dev[a + b:])
    _TABLE_CACHE[key] = out
    if len(_TABLE_CACHE) > 64:
        _TABLE_CACHE.popitem(last=False)
    return out


def run_segment_maps(chunk_mod, spec, options, cu, *, HV, K, V, H, dtype, k_state, w, u,
                     g_cum, h0, final, has_initial_state, output_final_state, state_params):
    """Steps 1 and 2 of the split pass. Returns None when the cost model says not to split,
    else (seq_tables, state_params) for step 3: seq_tables = (seg_cu, seg_chunk_offsets,
    starts [NS, HV, K, V] f32, placeholder final state [1, HV, K, V]) to pass to
    chunk_state / chunk_state_output in place of (cu_seqlens, chunk_offsets, h0, ht), and
    that stage's params run on NS segments from their start states. ``final`` (the
    caller's final state, user layout) is written here when output_final_state."""
    import torch
    C = spec.chunk_size
    counts = [-(-(cu[n + 1] - cu[n]) // C) for n in range(len(cu) - 1)]
    L = segment_chunks(counts, HV, K, V, chunk_mod._ARCH.NUM_SMS, chunk_mod.SPLIT_SEGMENT_CHUNKS)
    if L <= 0:
        return None
    dev = u.device
    seg_cu, seg_c0, seq_seg = _device_segment_tables(cu, L, C, dev)
    NS = seg_cu.numel() - 1
    N = len(cu) - 1
    f32 = torch.float32
    seg_map = torch.empty(NS, HV, K, K + V, dtype=f32, device=dev)
    starts = torch.empty(NS, HV, K, V, dtype=f32, device=dev)
    p1 = dict(H=H, HV=HV, K=K, V=V, dtype=dtype,
              block_v=fill_block(K + V, NS * HV, chunk_mod._ARCH.NUM_SMS, (K, V)),
              num_stages=chunk_mod.STATE_NUM_STAGES)
    chunk_mod.compiled_stage(spec, "chunk_segment_state", **p1)(
        k_state, w, u, g_cum, seg_cu, seg_c0, seg_map)
    p2 = dict(HV=HV, K=K, V=V, state_v_first=options.state_v_first,
              has_initial_state=bool(has_initial_state),
              output_final_state=bool(output_final_state),
              block_v=fill_block(V, N * HV, chunk_mod._ARCH.NUM_SMS))
    chunk_mod.compiled_stage(spec, "chunk_segment_combine", **p2)(
        seg_map, seq_seg, h0, starts, final)
    p3 = dict(state_params, state_v_first=False, has_initial_state=True,
              output_final_state=False, block_v=fill_block(V, NS * HV, chunk_mod._ARCH.NUM_SMS)
              if chunk_mod.STATE_BLOCK_V_OVERRIDE is None else
              chunk_mod.STATE_BLOCK_V_OVERRIDE)
    placeholder = torch.empty(1, HV, K, V, dtype=f32, device=dev)
    return (seg_cu, seg_c0, starts, placeholder), p3
