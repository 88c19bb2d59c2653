"""Hopper's state pass of the additive rule (GLA, simple GLA, linear attention): which
pieces its CTAs walk, at which tile, and whether the output is formed inside it.

The additive rule's transition is diagonal, S <- diag(d_t) S + kg_t^T v_t per chunk, so

* the rows of S evolve independently: the state pass splits over key blocks as well as
  value blocks (one CTA per block_k x block_v tile; the fused output reads all of K);
* a segment of L chunks acts on the state entering it exactly as S_end = diag(e^G)
  S_start + B (G: the segment's summed log decays, B: its end state from zero). With few
  (sequence, value head) chains the sequences are cut into segments: chunk_state_summary
  walks every segment but each sequence's last from zero (B, G), then chunk_state (h per
  chunk) or chunk_state_output (o inside) walks every segment from its true start, which
  each CTA forms first by chaining its sequence's earlier summaries (segment_starts).
  Nothing is approximated: the split's result differs from the unsplit walk's only by
  f32 rounding.

The choice minimises a makespan model of the SMs (hardware.makespan: each CTA, in launch
order, takes the first free SM), built from per-step times measured on the H200; a
probe or test forces any part of it through the plan config (segments, block_k,
block_v, fused). Every time is in us.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import hardware as hw

#: chunk_state's time per chunk step of one CTA: STEP_FIXED_US + STEP_ELEMENT_US per
#: element of its f32 state tile (block_k x block_v). The shape from run s2-5's sweep of
#: the delta rule's pass (K = 128: 1.19 / 2.34 / 3.50 us a step at value blocks 16 / 32 /
#: 64; the warp-specialised CTA's 240 registers a consumer thread leave one CTA a SM, an
#: SM is one slot of the makespan), scaled to the additive rule's own step (run s5-3, GLA
#: [1, 4096, 16, 128] ragged, 128 x 16 tiles: chunk_state 52 us over a 64-step critical
#: path, 0.81 us a step; chunk_state_output 68 us, 1.06)
STEP_FIXED_US = 0.29
STEP_ELEMENT_US = 2.6e-4
#: a step relative to chunk_state's at the same tile: the summary (no h stored), the
#: contracts' f32 states (states_out: every state stored from registers as well; not
#: measured yet) and the fused output (q S and A_qk v in the step: 1.06 / 0.81, above)
SUMMARY_STEP = 0.85
STATES_OUT_STEP = 1.15
FUSED_STEP = 1.3
#: chaining one earlier segment's summary into a segment's start (a block_k x block_v
#: f32 tile and block_k decays from L2; the chain is serial per CTA)
CHAIN_STEP_US = 0.3
#: chunk_output's CTA (a chunk x value head x value block): OUTPUT_FIXED_US +
#: OUTPUT_MAC_US per multiply-add of its GEMMs (run s5-3: GLA [1, 4096, 16, 128] and KDA
#: [1, 16384, 4, 128], 1024 CTAs of 1.6 M multiply-adds each, 31 us)
OUTPUT_FIXED_US = 0.5
OUTPUT_MAC_US = 1.9e-6
#: a kernel's fixed cost in the state pass (launch, prologue, tail; as forward.LAUNCH_US)
LAUNCH_US = 5.0
#: the f32 state tile of a 128-thread CTA: at most 64 registers a thread
MAX_TILE = 64 * 128
#: the tiles tried (a block divides its head dim)
BLOCKS_K = (32, 64, 128, 256)
BLOCKS_V = (16, 32, 64, 128)
#: the state pass at two warpgroups (plan config state_threads=256) splits each GEMM's
#: columns between them: block_v 32 or more gives each a wgmma N of 16 or more (block_v
#: 16 left N = 8 of a 16-wide MN-major operand, no canonical GMMA layout: TileLang refused
#: Mamba-2's K = 128, V = 64 tile, run s35)
TWO_WARPGROUPS_MIN_BLOCK_V = 32
#: segment lengths tried (chunks)
SEGMENT_CHUNKS = (2, 4, 8, 16, 32, 64, 128, 256)
#: a grid of more CTAs than this many per SM is modelled by its total work (the exact
#: placement's waves matter little there and would cost the planner time)
EXACT_WAVES = 8


@dataclass(frozen=True)
class StateChoice:
    """The additive rule's state pass for one call: segment length in chunks (0: whole
    sequences), the main pass's tile and output form, the summary's tile, modelled us."""
    segments: int
    block_k: int
    block_v: int
    fused: bool
    summary_block_k: int = 0
    summary_block_v: int = 0
    us: float = 0.0


def span(per_piece, copies: int) -> float:
    """Makespan over the SMs (hardware.makespan) of a grid whose CTAs take per_piece's
    durations, each `copies` times in a row (the tiles of a piece lie on gridDim.x);
    beyond EXACT_WAVES waves, the total work per SM."""
    per_piece = tuple(per_piece)
    n = len(per_piece) * copies
    if not n:
        return 0.0
    longest = max(per_piece)
    if n > EXACT_WAVES * hw.NUM_SMS:
        return max(sum(per_piece) * copies / hw.NUM_SMS, longest)
    if min(per_piece) == longest:                       # equal CTAs: whole waves
        return -(-n // hw.NUM_SMS) * longest
    return hw.makespan(tuple(d for d in per_piece for _ in range(copies)))


def pieces(seq_chunks: tuple, L: int) -> list:
    """Chunk counts of the pieces of each sequence: segments of L chunks (0: the whole
    sequence); every sequence, an empty one too, owns at least one piece."""
    if not L:
        return [[n] for n in seq_chunks]
    return [[min(L, n - s) for s in range(0, n, L)] or [0] for n in seq_chunks]


def step_us(block_k: int, block_v: int) -> float:
    return STEP_FIXED_US + STEP_ELEMENT_US * block_k * block_v


def tiles(K: int, V: int, fused: bool) -> list:
    """(block_k, block_v) the state pass runs at: blocks dividing K and V, within MAX_TILE
    elements; the fused output takes block_k = K."""
    ks = [K] if fused else [b for b in BLOCKS_K if K % b == 0] or [K]
    most = min(MAX_TILE, hw.FUSED_MAX_TILE or MAX_TILE) if fused else MAX_TILE
    return [(bk, bv) for bk in ks for bv in BLOCKS_V if V % bv == 0 and bk * bv <= most]


def output_us(p, block_v: int) -> float:
    """chunk_output over every (chunk, value head, value block)."""
    macs = 64 * p.K * block_v + 64 * 64 * block_v + (0 if p.gate == "key" else 64 * 64 * p.K)
    cta = OUTPUT_FIXED_US + OUTPUT_MAC_US * macs
    return span((cta,), p.NT * p.HV * (p.V // block_v)) + LAUNCH_US


def walk_us(p, L: int, bk: int, bv: int, fused: bool) -> float:
    """The main state pass (from the chained starts when split) at tile (bk, bv)."""
    segs = pieces(p.seq_chunks, L)
    split = any(len(s) > 1 for s in segs)
    step = (step_us(bk, bv) * (FUSED_STEP if fused else 1.0)
            * (STATES_OUT_STEP if p.return_states else 1.0))
    per_tile = [c * step + (j * CHAIN_STEP_US if split else 0.0)
                for seq in segs for j, c in enumerate(seq)]
    return span(per_tile, p.HV * (p.K // bk) * (p.V // bv)) + LAUNCH_US


def summary_us(p, L: int, bk: int, bv: int) -> float:
    """chunk_state_summary over the segments but each sequence's last at tile (bk, bv)."""
    step = step_us(bk, bv) * SUMMARY_STEP
    per_tile = [c * step for seq in pieces(p.seq_chunks, L) for c in seq[:-1]]
    return span(per_tile, p.HV * (p.K // bk) * (p.V // bv)) + LAUNCH_US


def _forced(config: dict, key: str, allowed) -> list:
    if key not in config:
        return list(allowed)
    if config[key] not in allowed:
        raise ValueError(f"plan config {key}={config[key]!r}: the additive rule's state pass "
                         f"takes {key} in {sorted(set(allowed))} here")
    return [config[key]]


def choose(p, config: dict, output_block_v: int, forms=(True, False)) -> StateChoice:
    """The fastest modelled state pass of problem p (codegen.pipeline.ForwardProblem)
    among the output forms allowed (fused True / False: the caller's rules) and within
    config's forced choices (segments, block_k, block_v). Ties (within 2 %) go to the
    earlier candidate: no split, the fused form, larger tiles."""
    longest = max(p.seq_chunks, default=0)
    if "segments" in config and not (isinstance(config["segments"], int)
                                     and config["segments"] >= 0):
        raise ValueError(f"plan config segments={config['segments']!r}: a segment length "
                         "in chunks (0: no split)")
    lengths = ([config["segments"]] if "segments" in config
               else [0] + [L for L in reversed(SEGMENT_CHUNKS) if L < longest])
    best = None
    for L in lengths:
        segs = pieces(p.seq_chunks, L)
        if sum(map(len, segs)) * p.HV > hw.MAX_GRID_YZ:       # (pieces x heads on gridDim.y)
            continue
        split = any(len(s) > 1 for s in segs)
        summary = (0.0, 0, 0)
        if split:
            summary = min(((summary_us(p, L, bk, bv), bk, bv)
                           for bk, bv in _tiles(p, config, False)), default=None)
            if summary is None:
                continue
        for fused in forms:
            out = 0.0 if fused else output_us(p, output_block_v)
            for bk, bv in reversed(_tiles(p, config, fused)):     # larger tiles first
                t = summary[0] + walk_us(p, L if split else 0, bk, bv, fused) + out
                if best is None or t < best.us * 0.98:
                    best = StateChoice(L if split else 0, bk, bv, fused, summary[1],
                                       summary[2], t)
    if best is None:
        raise ValueError(f"no state pass of the additive rule fits plan config {config} "
                         f"(K={p.K}, V={p.V}, segments x value heads <= {hw.MAX_GRID_YZ})")
    return best


def _tiles(p, config: dict, fused: bool) -> list:
    """tiles() within config's forced block_k / block_v (each checked against what the
    state pass can take at these head dims; at two warpgroups block_v >= 32)."""
    every = tiles(p.K, p.V, False) + tiles(p.K, p.V, True)
    if config.get("state_threads") == 256:
        every = [(bk, bv) for bk, bv in every if bv >= TWO_WARPGROUPS_MIN_BLOCK_V]
    bks = _forced(config, "block_k", sorted({bk for bk, _ in every}))
    bvs = _forced(config, "block_v", sorted({bv for _, bv in every}))
    return [(bk, bv) for bk, bv in tiles(p.K, p.V, fused) if bk in bks and bv in bvs]
