"""Hopper's chunked forward: which pipeline a call runs, with which tiles (a Plan).

Pipelines (codegen/pipeline.py has the Plan structure):

  walk        the delta rule with no / a scalar gate: chunk_kkt_inverse (A_b, g_cum, the
              l2-normalised q, k), then chunk_walk (state, WY step and output per chunk in
              one kernel of four warpgroups; with save_states it also stores each chunk's
              16-bit state into h)
  walk-fused  the walk with the WY inverse formed inside (chunk_walk_fused: a fourth warpgroup
              forms each chunk's A_b and gate cumsum a chunk ahead of the walk): one kernel,
              no A_b / g_cum round trip through memory. For many chains (the batched rows),
              sequences unsplit (INVERSE_IN_WALK)
  walk-split  the same when (sequences x value heads x value blocks) leave SMs idle: each
              sequence cut into segments of L chunks; chunk_walk_map forms each segment's
              affine map (only what its start still reaches, see that template), then
              chunk_segment_combine chains them into every segment's start state and
              chunk_walk runs all segments at once
  fused       chunk prepare (chunk_prepare for the additive rule, chunk_prepare_key for the
              per-key gate, kkt + chunk_wu for the delta rule where the walk does not fit),
              chunk_qk (no / scalar gate), chunk_state_output
  three-stage the prepare, chunk_state (h per chunk), chunk_output: with few chains, and
              for the per-chunk states (return_states; save_states outside the walk's
              family: chunk_state writes h)
  fused-split, three-stage-split
              the additive rule with few chains: chunk_state_summary (each segment's
              exact summary) before the state pass, which walks the segments from their
              chained starts (additive.py: the split, key and value blocks, the form)

The value block and the segment length of the walk come from a cost model of the SMs'
makespan (the walk is one CTA per SM), with per-step times measured on the H200.
"""
from __future__ import annotations

from ...pipeline import Buffer, ForwardProblem, Plan, launch
from . import hardware as hw
from .dplr import dplr_plan
from .hardware import NAME, SMEM_BYTES, makespan
from .stages import (kkt_launch, n_segments, prepare_buffers, saved_names, segment_chunks,
                     stage_plan)

#: the walk's time per chunk step of one CTA (us) by value block at K = 128, bf16 (session
#: 6, runs s6-3 / s6-4: prefill-4k 64 CTAs at block 32: 1.67 us a step, 64 CTAs at block
#: 64: 1.85; q35-2b-8x8192 128 CTAs at block 128: 2.68, there at 82 % of the copy bandwidth)
WALK_STEP_US = {16: 1.55, 32: 1.67, 64: 1.85, 128: 2.68}
#: ... its K dependence: step(K) = step(128) (WALK_STEP_K0 + (1 - WALK_STEP_K0) K / 128)
WALK_STEP_K0 = 0.5
#: the map pass's step relative to the walk's (no output group; run s6-2's walk without
#: output: 0.073 vs 0.108 ms at block 32, 0.168 vs 0.218 at block 128)
MAP_STEP_FRACTION = 0.75
#: chunks the map pass walks per segment under a real gate (the warm-up to e^-16: GDN's
#: gates are ~ -8 a chunk; weak heads are mapped in full, which this does not foresee)
MAP_WARM_CHUNKS = 2
#: the combine's time per segment of a sequence (us) at value block 16 with B prefetched:
#: a copy of B, plus M S (a K x K x 16 tf32 product) where the map was formed (run s7-2:
#: 0.9 - 1.0 us a segment under a real gate, prefill-4k / q35-2b-16384, launch included;
#: 1.1 exact at K = 64, DeltaNet [2, 16384, 4, 64] at 16 segments a sequence)
COMBINE_STEP_US = 0.8
COMBINE_EXACT_STEP_US = 1.2                 # at K = 128, scaled by (K / 128)^2
#: the combine's value block: its step is bound by the CTA's M S product and element
#: passes, not by the loads (run s7-1, DeltaNet [2, 16384, 4, 64], 8 exact segments a
#: sequence, B read without prefetch: 28.3 us at block 64, 15.1 at 32; run s7-2 at
#: block 16 with B prefetched: 9.6 at 4 segments, 18.3 at 16)
COMBINE_BLOCK_V = 16
#: each launch's fixed cost in the split (us; run s6-5: the map and combine of short
#: segments take 9 - 15 us of which ~6 is launch and prologue)
LAUNCH_US = 5.0
#: HBM bytes per us the walk streams at (3.5 TB/s: run s6-4, q35-2b-8x8192)
WALK_BYTES_PER_US = 3.5e6
#: segment lengths tried (chunks; chunk_walk_map's MAX_SEGMENT is the longest)
SEGMENT_CHUNKS = (2, 4, 8, 16, 32, 64, 128, 256)
MAX_SEGMENT = 256
#: register budgets of the walk's warpgroups (state, WY, output, loads): ptxas, no spills
WALK_REGS = (168, 160, 160, 24)
MAP_REGS = (184, 176, 24, 24)
#: ... of chunk_walk_fused (state, WY, output, inverse + loads): ptxas at K = V = 128, bf16,
#: block 128, GDN and DeltaNet: the inverse group spills one register (8 bytes) at 120 (16 at
#: 112, 96 at 96), the state group none at 160, the WY none at 112, the output none at 120
#: (DeltaNet's spilled 48 bytes at 112)
FUSED_REGS = (160, 112, 120, 120)
#: the WY inverse inside the walk (walk-fused) where the chains fill the SMs: chains x
#: value blocks >= min_fill x SMs, sequences unsplit (the seed release's one-kernel rule:
#: sequences x heads >= 0.75 x SMs at K = V = 128). Each chunk's inverse (~2 us of the
#: fourth warpgroup) runs beside the walk a chunk ahead, instead of chunk_kkt_inverse before
#: it. Run s35-2 (H100, GDN bf16, K = V = 128, 128 chains, ms kkt + walk -> fused):
#: q35-2b-8x8192 0.6434 -> 0.6172, its trained gates 0.6474 -> 0.6228, q35-397b-tp4-8x1024
#: 0.0885 -> 0.0876 (bench/LOG.md). l2norm_qk (the normalised q, k the walk reads) and
#: save_states (the training forward keeps A) stay on chunk_kkt_inverse.
INVERSE_IN_WALK = dict(default=True, min_fill=0.75)


def walk_smem(K: int, BV: int, itemsize: int = 2, chunk: int = 64) -> int:
    """Shared memory of chunk_walk: two stages of q, k, v, A_b and the exchanged tiles."""
    stages = 2 * chunk * (2 * K + BV + chunk) * itemsize
    tiles = (chunk * K + K * BV + chunk * BV + chunk * chunk + chunk * BV) * itemsize
    return stages + tiles + 4 * 1024


def fused_walk_smem(K: int, BV: int, itemsize: int = 2, chunk: int = 64) -> int:
    """... of chunk_walk_fused: chunk_walk's and the inverse group's (L in f32, its 16 x 16
    and 16 x chunk transposes, beta and the raw gate)."""
    return (walk_smem(K, BV, itemsize, chunk) + 4 * (chunk * chunk + 16 * 16 + 16 * chunk
                                                     + 2 * chunk))


def walk_blocks(p: ForwardProblem, fused: bool = False) -> tuple:
    """The value blocks chunk_walk (chunk_walk_fused) can run at for p (fitting shared
    memory), largest first."""
    smem = fused_walk_smem if fused else walk_smem
    return tuple(bv for bv in (128, 64, 32, 16)
                 if p.V % bv == 0 and p.K % 64 == 0 and smem(p.K, bv) <= SMEM_BYTES)


def _step_us(p: ForwardProblem, bv: int) -> float:
    return WALK_STEP_US[bv] * (WALK_STEP_K0 + (1 - WALK_STEP_K0) * p.K / 128)


def walk_time_us(p: ForwardProblem, bv: int, L: int, fused: bool = False) -> float:
    """Modelled time of the walk (and the split's map + combine when L) at value block bv
    (fused: chunk_walk_fused, which reads no A_b; its inverse assumed hidden)."""
    step = _step_us(p, bv)
    segs = segment_chunks(p.seq_chunks, L)
    heads = p.HV * (p.V // bv)
    walk = makespan(tuple(c * step for seq in segs for c in seq for _ in range(heads)))
    bytes_ = p.Ttot * (2 * p.H * p.K + p.HV * (2 * p.V + (0 if fused else p.chunk_size))) * 2
    walk = max(walk, bytes_ / WALK_BYTES_PER_US)
    if not L or all(len(seq) == 1 for seq in segs):
        return walk
    mapped = [c for seq in segs for c in seq[:-1]]
    gated = p.gate == "scalar"
    warm = (lambda c: min(c, MAP_WARM_CHUNKS)) if gated else (lambda c: c)
    cols = (p.V if gated else p.K + p.V) // bv
    maps = makespan(tuple(warm(c) * step * MAP_STEP_FRACTION
                          for c in mapped for _ in range(p.HV * cols)))
    combine_step = COMBINE_STEP_US + (0 if gated else COMBINE_EXACT_STEP_US * (p.K / 128) ** 2)
    combine = max(len(seq) for seq in segs) * combine_step
    return walk + maps + combine + 2 * LAUNCH_US


def walk_choice(p: ForwardProblem, config: dict, fused: bool = False) -> tuple:
    """(value block, segment length or 0, modelled us): the cheapest by walk_time_us, or
    config's block_v / segments where given. Segments are only tried for sequences
    longer than a segment (never with the inverse in the walk: fused)."""
    longest = max(p.seq_chunks, default=0)
    fits = walk_blocks(p, fused)
    if "block_v" in config and config["block_v"] not in fits:
        raise ValueError(f"plan config block_v={config['block_v']}: the walk runs at value "
                         f"blocks {fits} at K={p.K}, V={p.V}")
    if "segments" in config and not (isinstance(config["segments"], int)
                                     and config["segments"] >= 0):
        raise ValueError(f"plan config segments={config['segments']!r}: a segment length "
                         "in chunks (0: no split)")
    blocks = [config["block_v"]] if "block_v" in config else fits
    lengths = ([config["segments"]] if "segments" in config else (0,) if fused
               else (0,) + tuple(L for L in reversed(SEGMENT_CHUNKS) if L < longest))
    best = None
    for bv in blocks:
        for L in lengths:
            if n_segments(p.seq_chunks, L) * p.HV > hw.MAX_GRID_YZ:    # (gridDim.y)
                continue
            t = walk_time_us(p, bv, L, fused)
            if best is None or t < best[2] * 0.98:   # ties: the earlier (larger block, fewer segments)
                best = (bv, L, t)
    return best


def walks(rule: str, gate: str) -> bool:
    """The walk's family: the delta rule with no or a scalar gate."""
    return rule == "delta" and gate in ("none", "scalar")


def walk_applies(p: ForwardProblem) -> bool:
    """The walk plans p: its family, no per-chunk states, a value block that fits, and an
    arch with warpgroup roles (hardware.FEATURES; elsewhere the three-stage pipeline)."""
    return ("warpgroups" in hw.FEATURES and walks(p.rule, p.gate) and not p.return_states
            and bool(walk_blocks(p)))


#: the spec chunk sizes the chunked forward runs at: the kernels are GPU-checked at 64 only
#: (run s7-4: a chunk-32 delta-rule user spec came out wrong, o 0.98 relative: the kkt
#: inverse's diagonal pass ran no column when the chunk had fewer rows than its 64
#: threads; fixed in the template, not yet re-run on the GPU). Other chunk sizes take the
#: recurrent kernel (ops/api.py chunk_supports).
CHUNK_SIZES = (64,)

#: what a probe or test may set in forward_plan's config (the per-key prepare's in
#: stages.key_prepare; block_k: the additive rule's state pass, additive.py)
CONFIG_KEYS = ("block_v", "segments", "fused", "key_diag", "key_block_k", "key_threads",
               "key_min_ctas", "block_k", "inverse_in_walk", "state_threads",
               "aqk_per_key_head", "inverse_stub", "prepare_threads")


def forward_plan(p: ForwardProblem, config: tuple = ()) -> Plan:
    """The plan of one chunked-forward call. config: (key, value) pairs forcing a choice
    (CONFIG_KEYS: the walk's block_v, segment length and inverse_in_walk,
    the other pipelines' fused, the per-key prepare's key_diag / key_block_k; the dplr
    rule's own form: dplr.py)."""
    config = dict(config)
    bad = sorted(set(config) - set(CONFIG_KEYS))
    if bad:
        raise ValueError(f"unknown plan config {bad}; known: {list(CONFIG_KEYS)}")
    if p.N * p.HV > hw.MAX_GRID_YZ:    # (each pipeline's state pass: sequences x heads on y)
        raise ValueError(f"{p.N} sequences x {p.HV} value heads: the chunked forward takes "
                         f"at most {hw.MAX_GRID_YZ} (sequence, head) pairs in one call")
    if p.rule == "dplr":               # (its own form: dplr.py)
        return dplr_plan(p, config)
    if walk_applies(p) and "fused" not in config and not p.terms:
        return _walk_plan(p, config)
    return stage_plan(p, config)


def inverse_in_walk(p: ForwardProblem, config: dict) -> bool:
    """Whether the walk forms the WY inverse itself (walk-fused): config's inverse_in_walk,
    else INVERSE_IN_WALK's rule where its default is on: (sequence, value head) chains x
    value blocks (at the largest block chunk_walk_fused takes) >= min_fill x SMs."""
    blocks = walk_blocks(p, fused=True)
    why = ("l2norm_qk (the walk reads the normalised q, k)" if p.l2norm_qk
           else "save_states (the training forward keeps A)" if p.save_states
           else "a split sequence (the maps read A_b)" if config.get("segments")
           else f"no value block fits its shared memory at K={p.K}" if not blocks else "")
    if "inverse_in_walk" in config:
        if config["inverse_in_walk"] and why:
            raise ValueError(f"plan config inverse_in_walk: not with {why}")
        return bool(config["inverse_in_walk"])
    fill = p.N * p.HV * (p.V // blocks[0]) if blocks else 0
    return (INVERSE_IN_WALK["default"] and not why
            and fill >= INVERSE_IN_WALK["min_fill"] * hw.NUM_SMS)


def _walk_plan(p: ForwardProblem, config: dict) -> Plan:
    if inverse_in_walk(p, config):
        return _fused_walk_plan(p, config)
    choice = walk_choice(p, config)
    if choice is None:
        raise ValueError(f"no walk configuration fits {dict(config)} (segments x value heads "
                         f"<= {hw.MAX_GRID_YZ}, the value block a divisor of V={p.V})")
    bv, L, t = choice
    split = bool(L) and any(c > L for c in p.seq_chunks)
    if split and L > MAX_SEGMENT:
        raise ValueError(f"segments of {L} chunks: chunk_walk_map takes at most {MAX_SEGMENT}")
    qk = dict(q="qn", k="kn", a="A") if p.l2norm_qk else dict(a="A")
    gate = {} if p.gate == "scalar" else dict(g_cum="gate_none")
    walk = dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype, state_v_first=p.state_v_first,
                has_initial_state=p.has_initial_state or split,
                output_final_state=p.output_final_state, block_v=bv, regs=WALK_REGS,
                **({"states_out": True} if p.save_states else {}))
    buffers = prepare_buffers(p) + ([] if p.gate == "scalar" else [Buffer("gate_none", (1,))])
    # h: every chunk's entering state (each segment's CTA walks its own chunks: each once)
    buffers.append(Buffer("h", (p.NT, p.HV, p.K, p.V), "input") if p.save_states
                   else Buffer("h_none", (1, p.HV, p.K, p.V), "input"))
    hbind = {} if p.save_states else {"h": "h_none"}
    reasons = [f"the delta rule's walk fits at value blocks {walk_blocks(p)}; block {bv}"
               f"{f' with segments of {L} chunks' if split else ', one CTA per sequence'}"
               + (f" (config {config})" if config else f" models fastest ({t:.0f} us)")]
    launches = [kkt_launch(p)]
    if split:
        state = (p.HV, p.V, p.K) if p.state_v_first else (p.HV, p.K, p.V)
        n_seg = n_segments(p.seq_chunks, L)
        buffers += [Buffer("seg_map", (n_seg, p.HV, p.K, p.K + p.V)),
                    Buffer("exact", (n_seg, p.HV), "int32"), Buffer("starts", (n_seg,) + state),
                    Buffer("ht_none", (1,) + state)]
        mbv = max(b for b in walk_blocks(p) if p.K % b == 0 and b <= bv)
        mbind = {a: t for a, t in dict(qk, **gate).items() if a != "q"}
        if p.gate != "scalar":
            mbind["chunk_norm"] = "gate_none"
        launches.append(launch("chunk_walk_map", dict(H=p.H, HV=p.HV, K=p.K, V=p.V,
                                                      dtype=p.dtype, block_v=mbv, regs=MAP_REGS),
                             **mbind))
        launches.append(launch("chunk_segment_combine", dict(
            HV=p.HV, K=p.K, V=p.V, state_v_first=p.state_v_first,
            has_initial_state=p.has_initial_state, output_final_state=False,
            block_v=COMBINE_BLOCK_V), ht="ht_none"))
        walk_bind = dict(qk, **gate, **hbind, cu_seqlens="seg_cu", chunk_offsets="seg_c0",
                         h0="starts", final_row="seg_final_row")
    else:
        walk_bind = dict(qk, **gate, **hbind)
    launches.append(launch("chunk_walk", walk, **walk_bind))
    return Plan("walk-split" if split else "walk", NAME, tuple(launches), tuple(buffers),
                L if split else 0, tuple(reasons), saved=saved_names(p))


def _fused_walk_plan(p: ForwardProblem, config: dict) -> Plan:
    """walk-fused: chunk_walk_fused alone, reading q, k, v, g, beta as the call gives them."""
    choice = walk_choice(p, config, fused=True)
    if choice is None:
        raise ValueError(f"no fused walk configuration fits {dict(config)}")
    bv, _, t = choice
    stub = config.get("inverse_stub", 0)
    if stub not in (0, 1):
        raise ValueError(f"plan config inverse_stub={stub!r}: 1 (X = I, a wrong answer: "
                         "the walk's time with the inverse free)")
    walk = dict(_fused_walk_params(p), block_v=bv, regs=FUSED_REGS,
                **({"inverse_stub": stub} if stub else {}))
    reasons = [f"{p.N * p.HV} chains x {p.V // bv} value blocks: the WY inverse inside the "
               f"walk, block {bv}, one CTA per sequence"
               + (f" (config {config})" if config else f" (rule {INVERSE_IN_WALK}; "
                                                       f"models {t:.0f} us)")]
    return Plan("walk-fused", NAME, (launch("chunk_walk_fused", walk),), (), 0,
                tuple(reasons), saved=saved_names(p))


def _fused_walk_params(p: ForwardProblem) -> dict:
    """The problem keywords of chunk_walk_fused."""
    return dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype,
                g_dtype=p.g_dtype if p.gate == "scalar" else "float32",
                beta_dtype=p.beta_dtype, beta_sigmoid=p.beta_sigmoid,
                allow_neg_eigval=p.allow_neg_eigval, gate_in_kernel=p.gate_in_kernel,
                state_v_first=p.state_v_first, has_initial_state=p.has_initial_state,
                output_final_state=p.output_final_state)
