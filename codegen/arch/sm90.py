"""Hopper (sm_90a: H100 / H200): compile target and per-stage tuning.

Tuning is a function of the static problem (head dims, dtypes) and, optionally, of a
call's dynamic sizes (``sizes``: e.g. {"N": 4}, to fill the GPU), never of the data; the
problem itself (sizes, dtypes, flags) is passed to build() separately.
"""
from __future__ import annotations

import functools

NAME = "sm90"
TARGET = {"kind": "cuda", "arch": "sm_90a"}
CAPABILITIES = ((9,),)          # every 9.x device (matched as (major,) prefix)
NUM_SMS = 132                   # H100 SXM / H200
MAX_GRID_YZ = 65535             # CUDA's limit on gridDim.y and gridDim.z (x: 2^31 - 1)


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def recurrent_layout_ok(K: int, V: int, block_v: int, threads: int, vec: int, warps_k: int,
                        state_v_first: bool) -> bool:
    """The recurrent template's thread-map constraints (its check_params has the reasons)."""
    pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    if V % block_v or block_v % 8 or threads % 32 or not 32 <= threads <= 1024:
        return False
    if not pow2(vec) or vec > 8 or block_v % vec or K % vec or K * block_v // threads > 128:
        return False
    if state_v_first:
        lanes_k = max(x for x in (1, 2, 4, 8, 16, 32) if (K // vec) % x == 0)
        return block_v % (threads // lanes_k) == 0
    warps = threads // 32
    if warps % warps_k or block_v % (vec * (warps // warps_k)):
        return False
    lanes_v = block_v // (vec * (warps // warps_k))
    return pow2(lanes_v) and lanes_v <= 32 and K % ((32 // lanes_v) * warps_k) == 0


def _recurrent(problem: dict, sizes: dict | None = None) -> dict:
    """State tile K x block_v in fp32 registers, about 32 elements per thread (64 for
    the doubled block of 16-bit states).

    One state access is 16 bytes (vec = 4 fp32 or 8 bf16 / f16 values); a warp reads
    block_v * element-size bytes of each of its state rows (K-first), the CTA's warps
    split K (warps_k) and exchange partial sums through shared memory. Decode reads and
    writes the state once, so the grid N * HV * V / block_v must cover the 132 SMs: with
    few sequences block_v shrinks (smaller CTAs over more SMs). Falls back to the
    smallest valid tile for unusual sizes.
    """
    K, V, HV = problem["K"], problem["V"], problem["HV"]
    v_first = bool(problem.get("state_v_first"))
    item = _ITEMSIZE.get(problem.get("state_dtype", "float32"), 4)
    block_v = next((b for b in (32, 16, 8) if V % b == 0), 8)
    n = (sizes or {}).get("N")
    while n is not None and block_v > 8 and n * HV * (V // block_v) < NUM_SMS:
        block_v //= 2
    # 16-bit states with CTAs to spare: twice the block (64 values a thread) halves the
    # CTAs and their fixed costs (run 2 sweep, DeltaNetRecurrentFwd serving-b8-h64 bf16:
    # 12.6 us at block 64 vs 16.9 us at 32; measured only there, so kept to 16-bit states
    # and grids of >= 6 CTAs per SM at the doubled block)
    if (item == 2 and n is not None and not v_first and V % (2 * block_v) == 0
            and n * HV * (V // (2 * block_v)) >= 6 * NUM_SMS):
        block_v *= 2
    # f32 states with the value rows first and a grid that fits one wave of resident CTAs
    # (32 per SM) at one warp per 8 value rows: that warp, 32-byte loads (run s5-3 sweep,
    # GDNFwd decode-vfirst-b17 [N 17, HV 12, 128 x 128]: 9.15 us at (32, 128 threads,
    # vec 4), 8.54 at (16, 64, vec 8), 8.16 at (8, 32, vec 8); fla 9.12; the only v-first
    # decode row of the table, so kept to grids this small)
    if v_first and item == 4 and n is not None and V % 8 == 0 \
            and n * HV * (V // 8) <= 32 * NUM_SMS \
            and recurrent_layout_ok(K, V, 8, 32, 8, 1, True):
        return {"block_v": 8, "threads": 32, "vec": 8, "warps_k": 1}
    per_thread = 64 if block_v == 64 and item == 2 else 32
    for vec in (16 // item, 4, 2, 1):
        threads = max(32, min(256, K * block_v // per_thread))
        warps_k = 1 if v_first else threads // 32
        if recurrent_layout_ok(K, V, block_v, threads, vec, warps_k, v_first):
            return {"block_v": block_v, "threads": threads, "vec": vec, "warps_k": warps_k}
    for threads in (32, 64, 128, 256):      # unusual K / V: v1's one-warp-per-8-columns map
        bv = threads // 4
        if recurrent_layout_ok(K, V, bv, threads, 4, 1, v_first):
            return {"block_v": bv, "threads": threads, "vec": 4, "warps_k": 1}
    return {"block_v": 8, "threads": 32, "vec": 4 if K % 4 == 0 else 1, "warps_k": 1}


#: the state pass's time per chunk step of one CTA by value block, relative (run s2-5's
#: sweep at q35-397b-tp1-65536: 4 / 2 / 1 waves of CTAs took 4.88 / 4.80 / 3.58 ms at
#: block 16 / 32 / 64, i.e. 1.19 / 2.34 / 3.50 us per step; prefill-4k at block 16: 1.17)
CHUNK_STATE_STEP_COST = {16: 1.19, 32: 2.34, 64: 3.50}


@functools.lru_cache(maxsize=256)
def _state_makespan(bv: int, V: int, heads: int, seq_chunks: tuple) -> float:
    """Finish time of the state pass's CTAs ((sequence, head) chains x V / bv value
    blocks, launched in grid order: value block fastest, then head, then sequence) placed
    one per SM as SMs free up; each runs its sequence's chunk count x the step cost."""
    import heapq
    step = CHUNK_STATE_STEP_COST[bv]
    sms = [0.0] * NUM_SMS
    end = 0.0
    for n_chunks in seq_chunks:
        for _ in range(heads * (V // bv)):
            start = heapq.heappop(sms)
            done = start + n_chunks * step
            heapq.heappush(sms, done)
            end = max(end, done)
    return end


def chunk_state_block_v(V: int, n_seq_heads: int, seq_chunks: tuple | None = None) -> int:
    """Value block of the chunked state pass. The pass is sequential per CTA and its
    pipelined CTA fills an SM (256 threads x ~240 registers), so the time is the makespan
    of its CTAs over the SMs, each taking (chunks of its sequence) x (the step cost of the
    block, CHUNK_STATE_STEP_COST): the block with the shortest makespan (ties: the larger
    block). With equal sequences this is "the smallest block that keeps the CTAs in one
    wave, else 64" (run 4: q35-397b-tp1-65536, 64 heads: one wave at block 64); with
    unequal ones (seq_chunks: chunk count per sequence) a smaller block can win: the short
    sequences' CTAs finish early and the long ones' step is cheaper (varlen 1024 + 7168
    tokens, 32 heads: block 32 instead of 64)."""
    divisors = [bv for bv in (16, 32, 64) if V % bv == 0]
    if not divisors:
        raise ValueError(f"V={V} must be a multiple of 16")
    if seq_chunks and (len(set(seq_chunks)) == 1 or n_seq_heads * V // 16 > 8 * NUM_SMS):
        seq_chunks = None     # equal lengths, or many waves: the equal-length rule
    if not seq_chunks:
        seq_chunks = (1,) * n_seq_heads
        heads = 1
    else:
        seq_chunks = tuple(seq_chunks)
        if n_seq_heads % len(seq_chunks):
            raise ValueError(f"{n_seq_heads} chains is not a multiple of {len(seq_chunks)} "
                             "sequences")
        heads = n_seq_heads // len(seq_chunks)
    return min(reversed(divisors),
               key=lambda bv: _state_makespan(bv, V, heads, seq_chunks))


#: the fused state + output path pays off from this many (sequence, value head) chains.
#: Run s3-1 (bf16, K = V = 128), fused vs 3-stage: 0.97x at 8 chains (tp8-8192), 1.00x at
#: 16 (prefill-4k), 1.06x at 64 (tp1-65536), 1.08x at 128 (tp4-8x1024); run s3-3, after
#: chunk_qk's stores went through shared memory: 0.98x at 8 (vs the 3-stage path with o
#: staged), 1.05x at 16 (0.150 vs 0.158 ms), 1.19x at 64, 1.18x at 48 (q35-27b-16384). With
#: few chains the sequential pass is the critical path and o's work only lengthens it;
#: with more, skipping h's round trip through HBM wins.
#: f16 from 8: the 3-stage path's state pass is ~15 % slower in f16 than in bf16 (run s3-3,
#: prefill-4k: 0.087 vs 0.075 ms; same CUDA source up to the element type, cause open),
#: the fused kernel is not (prefill-4k f16 0.148 vs bf16 0.147 ms). At 8 chains the bf16
#: paths are within 2 % (tp8-8192: fused 0.224, 3-stage 0.220) while f16's 3-stage path
#: took 0.248. Measured with this rule (runs s5-1, s5-3): f16 tp8-8192 fused 0.224 ms vs
#: 3-stage 0.245 (fla 0.237), tp8-16384 0.435 (fla 0.466).
CHUNK_FUSE_OUTPUT_MIN_CHAINS = {"float16": 8}
CHUNK_FUSE_OUTPUT_MIN_CHAINS_DEFAULT = 16
#: ... and with K <= 64 in bf16, from 32 (run s5-5 probe, GDN prefill-narrow-state [1, 4096,
#: 16, 64], 16 chains: 3-stage 0.111 ms (state 0.064 + output 0.019 after the prepare),
#: fused 0.115 (chunk_qk 0.015 + state_output 0.072), fla 0.113: at half the state the
#: saved h round trip is worth less than the output work added to the sequential pass).
#: Measured on GDN only; GLAFwd varlen-4x1k (K = 64, 16 chains) took 0.0562 ms with it vs
#: 0.0549 fused (runs s5-8 / s5-4a).
CHUNK_FUSE_OUTPUT_MIN_CHAINS_SMALL_K = {"bfloat16": 32}


def chunk_fuse_output(n_seq_heads: int, dtype: str = "bfloat16", K: int = 128) -> bool:
    """Whether the chunked forward runs the fused state + output path."""
    table = CHUNK_FUSE_OUTPUT_MIN_CHAINS_SMALL_K if K <= 64 else {}
    m = table.get(dtype) or CHUNK_FUSE_OUTPUT_MIN_CHAINS.get(dtype, CHUNK_FUSE_OUTPUT_MIN_CHAINS_DEFAULT)
    return n_seq_heads >= m


def chunk_output_block_v(V: int) -> int:
    """Value block of the chunked output stage: all of V up to 128, so q k^T is formed
    once per chunk."""
    for bv in (128, 64, 32, 16):
        if V % bv == 0:
            return bv
    raise ValueError(f"V={V} must be a multiple of 16")


#: stage name -> tuning function(problem dict[, sizes]) -> dict of build() tuning knobs
TUNING = {
    "recurrent": _recurrent,
}


def tuning(stage: str, problem: dict, sizes: dict | None = None) -> dict:
    """Tuning knobs for ``stage`` at ``problem`` ({} where the template's defaults stand).

    sizes: dynamic sizes of one call (e.g. {"N": 4}) for stages whose best tiles depend
    on them; each distinct result is one more compile.
    """
    fn = TUNING.get(stage)
    if fn is None:
        return {}
    return fn(problem, sizes) if sizes else fn(problem)
