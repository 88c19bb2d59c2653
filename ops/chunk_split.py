"""The segment tables of the sequence split (codegen/arch/<arch>/forward.py's walk-split).

The state pass is sequential per (sequence, value head, value block): with few sequences x
heads most SMs idle. Per chunk the update is affine, S' = A_t S + B_t, so each sequence
is cut into segments of L chunks (never across a sequence boundary): chunk_walk_map forms
each segment's map, chunk_segment_combine chains them into the segments' start states,
and chunk_walk runs the segments as if they were sequences.
"""
from __future__ import annotations

import numpy as np

from ..dsl import SpecError


def build_segment_tables(cu_seqlens, seg_chunks: int, chunk_size: int = 64):
    """Segments of at most ``seg_chunks`` chunks for sequences cu[n] .. cu[n+1].

    Returns int32 NumPy arrays:
      seg_cu [NS+1]             segment s spans tokens seg_cu[s] .. seg_cu[s+1]
      seg_chunk_offsets [NS+1]  segment s starts at global chunk seg_chunk_offsets[s]
                                (global chunk numbering of build_chunk_tables)
      seq_seg_offsets [N+1]     sequence n owns segments seq_seg_offsets[n] .. [n+1]
    Every sequence owns at least one segment (an empty one: one empty segment).
    """
    if seg_chunks < 1:
        raise SpecError(f"segment length must be >= 1 chunk, got {seg_chunks}")
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise SpecError(f"cu_seqlens must start at 0 and be nondecreasing, got {cu.tolist()}")
    counts = (np.diff(cu) + chunk_size - 1) // chunk_size
    chunk_offsets = np.concatenate([[0], np.cumsum(counts)])
    nseg = np.maximum((counts + seg_chunks - 1) // seg_chunks, 1)
    seq_seg_offsets = np.concatenate([[0], np.cumsum(nseg)])
    seq_of_seg = np.repeat(np.arange(counts.size), nseg)
    local = np.arange(seq_seg_offsets[-1]) - seq_seg_offsets[:-1][seq_of_seg]
    seg_cu = np.concatenate([cu[:-1][seq_of_seg] + local * seg_chunks * chunk_size, cu[-1:]])
    seg_c0 = np.concatenate([chunk_offsets[:-1][seq_of_seg] + local * seg_chunks,
                             chunk_offsets[-1:]])
    return seg_cu.astype(np.int32), seg_c0.astype(np.int32), seq_seg_offsets.astype(np.int32)
