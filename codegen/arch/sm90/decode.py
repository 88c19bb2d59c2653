"""The chunked kernels' head dim and the decode kernel's tuning (its tile from the
SM count: hardware.NUM_SMS).

Tuning is a function of the static problem (head dims, dtypes) and, optionally, of a
call's dynamic sizes (``sizes``: e.g. {"N": 4}, to fill the GPU), never of the data; the
problem itself (sizes, dtypes, flags) is passed to build() separately.
"""
from __future__ import annotations

from .hardware import NUM_SMS
from .stages import STATE_K_MULTIPLE


def chunk_k(rule: str, gate: str, K: int) -> int:
    """The head dim K the chunked forward's kernels run a call of head dim K at: K rounded
    up to a multiple of STATE_K_MULTIPLE for every rule and gate (the op pads q, k, the
    gate and the states with zero channels, which leave every output unchanged). The walk
    too: its state GEMMs have K rows, which 4 warps of a warpgroup MMA cover only in 64s
    (K = 48, 96, 112 failed to compile, run s17-1 and sm_90a on the CPU)."""
    return -(-K // STATE_K_MULTIPLE) * STATE_K_MULTIPLE


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
    warps = threads // 32       # (the K-reduction over warps_k warps: a power of two)
    if warps % warps_k or not pow2(warps_k) or block_v % (vec * (warps // warps_k)):
        return False
    lanes_v = block_v // (vec * (warps // warps_k))
    return pow2(lanes_v) and lanes_v <= 32 and K % ((32 // lanes_v) * warps_k) == 0


#: Decode at a full grid (f32 states, the block-64 tile's grids below), rules of session
#: 32's experiment (bench/LOG.md) where the GPU timed them against the direct kernel:
#: - "ctas_per_sm": resident CTAs an SM (each CTA claims 1 / (n + 1) of the SM's shared
#:   memory): 3 keeps 96 KB of state reads in flight an SM, as KDA's 144-register tile does
#:   and flashinfer's big-batch kernel (6 CTAs of 16 KB). Run s41-2 (H100, decode_probe, %
#:   of the same run's copy bandwidth, without / with): GDN q35-gva-decode-b64 94 -> 96,
#:   b256 94 -> 96, KDA kda-tp1-decode-b64 95 -> 95 (state pools: not timed).
#: (The experiment's other rule, a CTA streaming 4 tiles through a shared-memory ring, lost
#: to the direct kernel in s41-2 and was deleted: bench/LOG.md.)
DECODE_FULL_GRID = {
    "ctas_per_sm": 3,
}


def _full_grid(tile: dict) -> dict:
    """The block-64 tile of a full grid, with DECODE_FULL_GRID's rules where they are on."""
    if DECODE_FULL_GRID["ctas_per_sm"]:
        tile["ctas_per_sm"] = DECODE_FULL_GRID["ctas_per_sm"]
    return tile


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
    # f32 states with the value rows first and a bigger grid: 16 value rows a CTA, one warp
    # per 4, 16 state values a thread (run s40-6 / s40-7 sweep, Mamba-2 decode [N, 128, 64 x
    # 128], us at N 8 / 32 / 64 / 128 / 256: 29.4 / 107 / 212 / 421 / 836 at (32, 128
    # threads, vec 4) -> 27.0 / 94.4 / 183 / 361 / 716; (16, 64, vec 8) 28.0 / 94.8 / 184 /
    # 362 / 717; (8, 64, vec 4) 28.2 / 98.8 / 192 / 380 / 753; mamba_ssm 26.6 / 101 / 201
    # / 388 / 777; measured only at K 128, V 64)
    if v_first and item == 4 and n is not None and V % 16 == 0 \
            and recurrent_layout_ok(K, V, 16, 128, 4, 1, True):
        return {"block_v": 16, "threads": 128, "vec": 4, "warps_k": 1}
    # f32 states (K <= 128) with a grid of >= 16 CTAs per SM at block 64: 64 values x 128
    # threads, one warp per 16 value columns (run s7-2 sweep, KDA pool decode [N, 32, 128,
    # 128]: N 64 84.6 -> 78.6 us, N 256 327 -> 296 (fla 77.5, 321); N 8 (4 CTAs per SM):
    # 13.8 at the default, 14.7 at this tile)
    # A state pool from 8 CTAs per SM at block 64: each CTA first reads its slot, then the
    # state at that slot, a dependent load more per CTA; half the CTAs pay it half as often
    # (run s31-2, KDA pool [N 128, HV 8, 128 x 128] f32, 2048 CTAs: 42.5 -> 41.1 us, fla
    # 41.6; the same grid without a pool, KDAFwd kda-tp8-decode-b256: 37.6 -> 38.0; pool
    # N 8 / HV 32, 512 CTAs: 12.9 -> 13.6)
    min_ctas = 8 if problem.get("state_pool") else 16
    if (item == 4 and not v_first and n is not None and K <= 128 and V % 64 == 0
            and n * HV * (V // 64) >= min_ctas * NUM_SMS
            and recurrent_layout_ok(K, V, 64, 128, 4, 1, False)):
        return _full_grid({"block_v": 64, "threads": 128, "vec": 4, "warps_k": 1})
    per_thread = 64 if block_v == 64 and item == 2 else 32
    threads = max(32, min(256, K * block_v // per_thread))
    threads = 1 << (threads.bit_length() - 1)      # (K = 96, 160, 192: 64, 128 threads)
    for vec in (16 // item, 4, 2, 1):
        warps_k = 1 if v_first else threads // 32
        if recurrent_layout_ok(K, V, block_v, threads, vec, warps_k, v_first):
            return {"block_v": block_v, "threads": threads, "vec": vec, "warps_k": warps_k}
    for threads in (32, 64, 128, 256):      # unusual K / V: v1's one-warp-per-8-columns map
        bv = threads // 4
        if recurrent_layout_ok(K, V, bv, threads, 4, 1, v_first):
            return {"block_v": bv, "threads": threads, "vec": 4, "warps_k": 1}
    return {"block_v": 8, "threads": 32, "vec": 4 if K % 4 == 0 else 1, "warps_k": 1}


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
