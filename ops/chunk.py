"""The chunked (prefill) forward: three generated stages run in order.

    chunk_prepare  grid (NT, HV):             gate activation + within-chunk cumsum, l2norm
                                              of k, beta transform, WY form A, w, u
    chunk_state    grid (V/BV, N * HV):       sequential inter-chunk pass: h, v_new, final
    chunk_output   grid (V/BV, NT, HV):       o = scale (q h + causal(q k^T) v_new), gated

Tokens live on one flat axis: a fixed-length batch [B, T] is viewed as B sequences of T
tokens laid end to end, exactly like a varlen batch with cu_seqlens = [0, T, 2T, ...].
Host-side chunk tables (built from cu_seqlens_cpu when given, so no device sync) map each
of the NT chunks to its first token and valid length, and each sequence to its chunks.

Supported: every rule x gate (DeltaNet, GDN, KDA, GLA and the other combinations); K, V
multiples of 16 up to 256 (K <= 128 with the per-key gate; tested at K = V = 64 and 128);
f16 / bf16 inputs. The per-key gate uses its own first stage (chunk_prepare_key template:
A_qk and the WY form through 16-row sub-blocks, so every exponential is of a non-positive
number) and hands the state and output stages ready operands (kg, qg, A_qk, g_last).
"""
from __future__ import annotations

import contextlib
import os
import types
from collections import OrderedDict

import numpy as np

from ..codegen.arch import get_arch
from ..dsl import Gate, OpSpec, Options, SpecError
from . import runtime

STAGES = ("chunk_prepare", "chunk_state", "chunk_output")
FUSED_STAGES = ("chunk_qk", "chunk_state_output")      # the fused path's last two
SPLIT_PREPARE_STAGES = ("chunk_kkt_inverse", "chunk_wu")   # chunk_prepare as two (PREPARE_SPLIT)
SPLIT_STAGES = ("chunk_segment_state", "chunk_segment_combine")   # the split state pass
ARCH = "sm90"
_ARCH = get_arch(ARCH)          # tiles and SM count of the arch table
SUPPORTED_GATES = (Gate.NONE, Gate.SCALAR, Gate.KEY)


# -- host-side chunk tables ---------------------------------------------------------------

def build_chunk_tables(cu_seqlens, chunk_size: int = 64):
    """Chunk tables for sequences cu[n] .. cu[n+1] (a list or 1-D int array, cu[0] == 0).

    Returns int32 NumPy arrays:
      chunk_bos [NT]      first token (flat index) of each chunk
      chunk_len [NT]      valid tokens of each chunk, 1..chunk_size
      chunk_offsets [N+1] sequence n owns chunks chunk_offsets[n] .. chunk_offsets[n+1]
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise SpecError(f"cu_seqlens must start at 0 and be nondecreasing, got {cu.tolist()}")
    lens = np.diff(cu)
    counts = (lens + chunk_size - 1) // chunk_size
    offsets = np.concatenate([[0], np.cumsum(counts)])
    seq_of_chunk = np.repeat(np.arange(lens.size), counts)
    local = np.arange(offsets[-1]) - offsets[:-1][seq_of_chunk]
    bos = cu[:-1][seq_of_chunk] + local * chunk_size
    length = np.minimum(chunk_size, cu[1:][seq_of_chunk] - bos)
    return bos.astype(np.int32), length.astype(np.int32), offsets.astype(np.int32)


_TABLE_CACHE: OrderedDict = OrderedDict()
_TABLE_CACHE_SIZE = 64


def _device_tables(cu: tuple, chunk_size: int, device):
    """(cu32, chunk_bos, chunk_len, chunk_offsets) as int32 device tensors, cached by cu."""
    import torch
    key = (cu, chunk_size, str(device))
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        _TABLE_CACHE.move_to_end(key)
        return hit
    bos, length, offsets = build_chunk_tables(cu, chunk_size)
    host = np.concatenate([np.asarray(cu, dtype=np.int32), bos, length, offsets])
    dev = torch.from_numpy(host).to(device, non_blocking=True)
    n1, nt = len(cu), bos.size
    out = (dev[:n1], dev[n1:n1 + nt], dev[n1 + nt:n1 + 2 * nt], dev[n1 + 2 * nt:])
    _TABLE_CACHE[key] = out
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return out


# -- loading and compiling the generated stages -------------------------------------------



def check_supported(spec: OpSpec) -> None:
    if spec.gate not in SUPPORTED_GATES:
        raise SpecError(f"{spec.name}: the chunked forward supports gates "
                        f"{[g.value for g in SUPPORTED_GATES]}, not {spec.gate.value!r} (yet)")


def stage_module(spec: OpSpec, stage: str) -> types.ModuleType:
    """The generated module of chunked-forward ``stage`` for ``spec`` (ops.runtime loads
    it: the checked-in file, refused when stale; specs outside the registry rendered)."""
    check_supported(spec)
    return runtime.stage_module(spec, stage, ARCH)


def compiled_stage(spec: OpSpec, stage: str, **params):
    """The compiled TileLang kernel of ``stage`` at ``params`` (memoised by ops.runtime)."""
    check_supported(spec)
    return runtime.compile_stage(spec, stage, ARCH, params)


#: set to 16 / 32 / 64 to force the state pass's value block (probing); None = heuristic
STATE_BLOCK_V_OVERRIDE = None
#: pipeline depth of the state pass (0: plain loop, 128 threads; >= 1: TMA producer warps
#: prefetch the next chunks' k, w, u while the consumer warpgroup computes)
STATE_NUM_STAGES = int(os.environ.get("LINATTN_CHUNK_STATE_STAGES", "2"))
#: consumer threads of the state pass: 128 (one warpgroup holds the K x block_v state) or
#: 256 (two warpgroups split it, half the registers each; both compile to one CTA per SM
#: with the producer warpgroup: 256 / 384 threads). 256 needs block_v >= 32 (at 16 the
#: split w S GEMM is 8 columns wide, not a wgmma shape): smaller blocks keep 128. 256
#: not yet GPU-run
STATE_THREADS = int(os.environ.get("LINATTN_CHUNK_STATE_THREADS", "128"))
#: state pass CTAs per SM the registers are capped for (__launch_bounds__ minimum blocks;
#: the consumer warpgroup's setmaxnreg share: 232 at 2). 1 (default): one CTA per SM, 240
#: registers (a 128-consumer CTA needs 33.8 K of the SM's 64 K). 2 with num_stages 1 (~64
#: KB of shared memory at K = 128, block 16) lets two sequential chains share an SM, e.g.
#: with SPLIT's segments. Compiles without spills; not yet GPU-run (probe variants occ2*).
STATE_MIN_BLOCKS = int(os.environ.get("LINATTN_CHUNK_STATE_MIN_BLOCKS", "1"))
#: scalar gate: the state pass stores v_new straight from registers instead of through
#: shared memory. On: alone, the smem path measured faster (session 2 sweep: state pass
#: 3.58 -> 3.30 ms at q35-397b-tp1-65536, 0.079 -> 0.078 at prefill-4k), but with h by
#: TMA store as well the benchmark's prefill-4k / tp8-8192 came out 5-6 % slower (run
#: s2-6/7): the sweep's best measured combination is h by TMA, v_new from registers
STATE_V_NEW_FROM_FRAGMENT = os.environ.get("LINATTN_CHUNK_VNEW_FRAGMENT", "1") == "1"
#: the state pass writes h straight from registers instead of one TMA store per chunk.
#: Off: the TMA store measured faster (same sweep: 3.58 -> 2.90 ms, 0.079 -> 0.074 ms)
STATE_H_FROM_FRAGMENT = os.environ.get("LINATTN_CHUNK_H_FRAGMENT", "0") == "1"
#: run the fused path: chunk_qk + chunk_state_output (o formed inside the state pass, no
#: per-chunk states h written) instead of chunk_state + chunk_output. True / False force
#: it; None (default, LINATTN_CHUNK_FUSE_OUTPUT unset or "auto") asks the arch table by
#: (sequences x value heads): see fuse_output()
FUSE_OUTPUT = {"1": True, "0": False}.get(os.environ.get("LINATTN_CHUNK_FUSE_OUTPUT", "auto"))
#: the per-(chunk, head) stages (chunk_prepare / kkt_inverse / wu / qk / output) launch
#: with the value head as the fastest grid index: CTAs running together share a chunk,
#: so the H heads' q / k rows are read once from DRAM for all HV / H value heads of a group
#: and all heads of a token block come in one contiguous region (instead of chunk-fastest,
#: where each value head of a group re-reads q / k from DRAM). Default since run s3-3:
#: q35-397b-tp1-65536 (4 value heads per group) chunk_wu 1.26 -> 0.99 ms, chunk_qk 0.90 ->
#: 0.77, the fused path 6.09 -> 5.67 ms; equal within noise where H == HV
HEADS_FASTEST = os.environ.get("LINATTN_CHUNK_HEADS_FASTEST", "1") == "1"
#: the fused path's chunk_qk with one CTA per (chunk, key head) looping over the group's
#: value heads (q k^T formed once per group; GVA only); not yet GPU-run
QK_GROUP_LOOP = os.environ.get("LINATTN_CHUNK_QK_GROUP_LOOP", "0") == "1"
#: chunk_output loads q, k and v_new as whole tiles (vectorised / TMA copies) instead of
#: row-predicated element loads; not yet GPU-checked (tests/test_chunk_fwd_gpu.py has it)
OUTPUT_TILE_LOADS = os.environ.get("LINATTN_CHUNK_OUTPUT_TILES", "0") == "1"
#: chunk_output stores o through shared memory as whole-row vector stores (default since
#: run s3-3: output stage 0.043 -> 0.040 ms at GDN prefill-4k, 2.15 -> 2.06 at tp1-65536)
OUTPUT_STAGE_O = os.environ.get("LINATTN_CHUNK_OUTPUT_STAGE_O", "1") == "1"
#: the fused path's q operand (no / scalar gate): "raw" = the state pass reads q (or the
#: l2-normalised q chunk_qk writes, [Ttot, H, K]) and applies exp(g_cum) itself; "gated"
#: = chunk_qk writes qg = q exp(g_cum) [Ttot, HV, K] (the first fused version)
FUSED_Q = os.environ.get("LINATTN_CHUNK_FUSED_Q", "raw")
#: how chunk_prepare inverts I + A: "blocked" (16 x 16 diagonal blocks then block rows,
#: every thread busy), "column" (forward substitution, one column per thread) or "tc"
#: (diagonal blocks, then the merge as four tf32 tensor-core products)
PREPARE_INVERSE = os.environ.get("LINATTN_CHUNK_INVERSE", "tc")
#: chunk_prepare's threads: 128 (GPU-verified default) or 256 (two warpgroups: ~110
#: registers instead of ~184, twice the warps per SM for the latency-bound phases)
PREPARE_THREADS = int(os.environ.get("LINATTN_CHUNK_PREPARE_THREADS", "128"))
#: the per-key gate's chunk_prepare (KDA, GLA: one kernel, 144 KB of shared memory at K =
#: V = 128 with the "tc" inverse, so one CTA per SM): its threads and its inverse
#: (PREPARE_KEY_INVERSE, None = PREPARE_INVERSE). 256 threads since run s5-3 (two
#: warpgroups for the element-wise diagonal blocks and decays, 138 registers instead of
#: 235): prepare 0.705 -> 0.471 ms at KDA kda-tp2-4096, 0.311 -> 0.297 at GLA K = 128
#: ragged; the 19 KDAFwd prefill rows 1.29-1.66x faster (run s5-4a). Measured and dropped: the
#: "blocked" inverse (112 KB, 2 CTAs per SM: +0.025 ms at 256 threads), a conflict-free
#: (16, K)-tile form of the diagonal blocks (3.5x slower: 64 serial block-reductions) and
#: the fast exponential (+0.03 ms).
PREPARE_KEY_THREADS = int(os.environ.get("LINATTN_CHUNK_PREPARE_KEY_THREADS", "256"))
PREPARE_KEY_INVERSE = os.environ.get("LINATTN_CHUNK_PREPARE_KEY_INVERSE") or None
#: ... and its diagonal blocks' channel loop skewed per lane (no bank conflicts on the
#: 16 rows j a warp reads; ncu, run s5-6: the shared-memory pipe 71 % busy, short-scoreboard
#: stalls on it first). Expected: that loop ~6x fewer shared-memory wavefronts; not yet
#: GPU-run (probe variant key-skew, GPU test variant "skew").
PREPARE_KEY_SKEW = os.environ.get("LINATTN_CHUNK_PREPARE_KEY_SKEW", "0") == "1"
#: chunk_prepare issues v's loads at the start (registers) so they overlap the inverse
#: (default since run 5: prepare 0.103 -> 0.095 ms on GDN prefill-4k, GPU-checked)
PREPARE_PREFETCH = os.environ.get("LINATTN_CHUNK_PREPARE_PREFETCH", "1") == "1"
#: split each sequence's state pass across CTAs when few (sequence, head) pairs would leave
#: SMs idle: chunk_segment_state (each segment's affine map, in parallel), then
#: chunk_segment_combine (chains them: each segment's start state, the final state), then
#: the state pass (or the fused state+output pass) per segment, in parallel
SPLIT = os.environ.get("LINATTN_CHUNK_SPLIT", "0") == "1"
#: segment length in chunks when splitting (None: segment_chunks' cost model)
SPLIT_SEGMENT_CHUNKS = (int(os.environ["LINATTN_CHUNK_SPLIT_L"])
                        if os.environ.get("LINATTN_CHUNK_SPLIT_L") else None)
#: delta rule (no / scalar gate): chunk_prepare split in two kernels as fla does:
#: chunk_kkt_inverse (gate cumsum, l2norm, beta, A diag(beta) written) then chunk_wu
#: (w, u as GEMMs). Default since run s3-1 (with the warp inverse, 64 threads, and the wu
#: loop): prepare 0.095 -> 0.040 ms at GDN prefill-4k, 5.46 -> 2.16 ms at tp1-65536
PREPARE_SPLIT = os.environ.get("LINATTN_CHUNK_PREPARE_SPLIT", "1") == "1"
#: the split path's inverse ("tc": 143 regs, 66 KB smem; "blocked": 58 regs, 37 KB; "warp":
#: one warp per (chunk, head), 255 regs, 20 KB: 8 CTAs per SM)
PREPARE_SPLIT_INVERSE = os.environ.get("LINATTN_CHUNK_SPLIT_INVERSE", "warp")
#: threads of chunk_kkt_inverse with PREPARE_SPLIT_INVERSE="warp": 32 (one warp per
#: (chunk, head), as fla's kkt_solve) or 64; None = the build default (32 for "warp", else 128)
PREPARE_SPLIT_KKT_THREADS = int(os.environ.get("LINATTN_CHUNK_SPLIT_KKT_THREADS", "64")) or None
#: the split path's stored A: None = the input dtype (as fla), or "float32"
PREPARE_SPLIT_A_DTYPE = os.environ.get("LINATTN_CHUNK_SPLIT_A_DTYPE") or None
#: chunk_wu's columns per CTA (64: (K + V) / 64 CTAs per (chunk, head))
PREPARE_SPLIT_BLOCK_N = int(os.environ.get("LINATTN_CHUNK_SPLIT_BLOCK_N", "64"))
#: chunk_wu's grid: "grid" (one CTA per (chunk, head, column block)) or "loop" (one CTA
#: per (chunk, head): A_b loaded once, whole k / v tiles)
PREPARE_SPLIT_WU = os.environ.get("LINATTN_CHUNK_SPLIT_WU", "loop")


#: named settings of the prepare knobs above, timed by bench/chunk_probe.py --prepare and
#: checked by tests/test_chunk_fwd_gpu.py (the split ones replace chunk_prepare for the
#: delta rule without a key gate only)
_SPLIT_TC = dict(PREPARE_SPLIT=True, PREPARE_SPLIT_INVERSE="tc", PREPARE_SPLIT_KKT_THREADS=None)
_SPLIT_WARP32 = dict(PREPARE_SPLIT=True, PREPARE_SPLIT_INVERSE="warp",
                     PREPARE_SPLIT_KKT_THREADS=None)
_SPLIT_WARP64 = dict(_SPLIT_WARP32, PREPARE_SPLIT_KKT_THREADS=64)
PREPARE_VARIANTS = {
    # measured and dropped (bench/LOG.md runs 5, s2-3, s3-1): t256, t256-prefetch,
    # split-blocked, split-a32, split-bn128 (the knobs stay). Each names every split knob,
    # so a variant means the same whatever the defaults are.
    # the single fused kernel (default until session 3; 0.095 ms at GDN prefill-4k)
    "fused": dict(PREPARE_SPLIT=False),
    # fla-style split: chunk_kkt_inverse (A diag(beta)) then chunk_wu (w, u GEMMs)
    "split": dict(_SPLIT_TC, PREPARE_SPLIT_WU="grid"),
    # chunk_kkt_inverse one warp (or two) per (chunk, head), ~20 KB smem, 8 CTAs per SM
    "split-warp": dict(_SPLIT_WARP32, PREPARE_SPLIT_WU="grid"),
    "split-warp64": dict(_SPLIT_WARP64, PREPARE_SPLIT_WU="grid"),
    "split-warp-a32": dict(_SPLIT_WARP32, PREPARE_SPLIT_WU="grid",
                           PREPARE_SPLIT_A_DTYPE="float32"),
    # chunk_wu one CTA per (chunk, head): A_b loaded once, whole k / v tiles
    "split-wuloop": dict(_SPLIT_TC, PREPARE_SPLIT_WU="loop"),
    "split-wuloop-bn128": dict(_SPLIT_TC, PREPARE_SPLIT_WU="loop", PREPARE_SPLIT_BLOCK_N=128),
    # both (split-warp64-wuloop is the default since run s3-1: 0.040 ms at prefill-4k)
    "split-warp-wuloop": dict(_SPLIT_WARP32, PREPARE_SPLIT_WU="loop"),
    "split-warp64-wuloop": dict(_SPLIT_WARP64, PREPARE_SPLIT_WU="loop"),
}


@contextlib.contextmanager
def using(**knobs):
    """Set this module's tuning knobs (e.g. FUSE_OUTPUT=True) for a block and restore them
    after (the probe and the tests compare paths with it); an unknown name raises."""
    module = globals()
    unknown = [name for name in knobs if not name.isupper() or name not in module]
    if unknown:
        raise AttributeError(f"ops.chunk has no knob {unknown}")
    saved = {name: module[name] for name in knobs}
    try:
        module.update(knobs)
        yield
    finally:
        module.update(saved)


def wu_block_n(K: int, V: int) -> int:
    """chunk_wu's column block: PREPARE_SPLIT_BLOCK_N, halved until it divides K and V."""
    bn = PREPARE_SPLIT_BLOCK_N
    while bn > 16 and (K % bn or V % bn):
        bn //= 2
    return bn


def wu_params(K: int, V: int) -> dict:
    """chunk_wu's tuning params: block_n, and loop_columns when PREPARE_SPLIT_WU is "loop"."""
    return dict(block_n=wu_block_n(K, V),
                **({"loop_columns": True} if PREPARE_SPLIT_WU == "loop" else {}))


def state_block_v(V: int, n_seq_heads: int, seq_chunks: tuple | None = None) -> int:
    """The state pass's value block: STATE_BLOCK_V_OVERRIDE, else the arch table's (from
    the chains and, for varlen calls, each sequence's chunk count)."""
    if STATE_BLOCK_V_OVERRIDE is not None:
        return STATE_BLOCK_V_OVERRIDE
    try:
        return _ARCH.chunk_state_block_v(V, n_seq_heads, seq_chunks)
    except ValueError as e:
        raise SpecError(str(e)) from None


def fuse_output(n_seq_heads: int, dtype: str = "bfloat16", K: int = 128) -> bool:
    """Whether a call with ``n_seq_heads`` (sequences x value heads) state chains in
    ``dtype`` and key dimension ``K`` runs the fused path: FUSE_OUTPUT when set, else the
    arch table's rule."""
    if FUSE_OUTPUT is not None:
        return bool(FUSE_OUTPUT)
    return _ARCH.chunk_fuse_output(n_seq_heads, dtype, K)


#: the output stage's value block (None: all of V up to 128, so q k^T is formed once)
OUTPUT_BLOCK_V_OVERRIDE = None


def output_block_v(V: int) -> int:
    """The output stage's value block: OUTPUT_BLOCK_V_OVERRIDE, else the arch table's."""
    if OUTPUT_BLOCK_V_OVERRIDE is not None:
        return OUTPUT_BLOCK_V_OVERRIDE
    try:
        return _ARCH.chunk_output_block_v(V)
    except ValueError as e:
        raise SpecError(str(e)) from None


# -- the forward ---------------------------------------------------------------------------

def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _check_device(name, t):
    if not t.is_cuda:
        from .validate import device_error
        raise device_error(name, t.device)
    if name == "q":
        from .runtime import device_arch
        arch = device_arch(t.device)       # clear error on a GPU without linattn kernels
        if arch != ARCH:
            raise SpecError(f"the chunked forward is generated for {ARCH} only, not {arch}")


def _check_inputs(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu,
                  A_log, dt_bias):
    """B's shared checks (ops/validate.py); returns (dims, N)."""
    from . import validate as val
    dims = val.check_qkv(spec, q, k, v, dtypes=val.CHUNK_DTYPES)
    val.check_head_dims(dims.K, dims.V, k_multiple=16, k_max=256, v_multiple=16, v_max=256,
                        what="the chunked forward")
    val.check_gate(spec, g, dims, q)
    val.check_beta(spec, beta, dims, q)
    val.check_gate_params(spec, options, A_log, dt_bias, dims, q)
    N = val.check_cu_seqlens(cu_seqlens, dims.B, dims.T, cu_seqlens_cpu, q)
    if initial_state is not None:
        val.check_state("initial_state", initial_state, N, dims, options.state_v_first,
                        initial_state.dtype, q)
        if not initial_state.is_floating_point():
            raise SpecError(f"initial_state must be floating point, got {initial_state.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):      # the device check last
        _check_device(name, t)
    return dims, N


def chunk_forward(spec: OpSpec, q, k, v, g=None, beta=None, scale=None, initial_state=None,
                  output_final_state=False, options: Options = Options(), cu_seqlens=None,
                  cu_seqlens_cpu=None, A_log=None, dt_bias=None, return_states=False):
    """Chunked forward of ``spec`` (fla's chunk_gated_delta_rule semantics).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (scalar gate, natural log; raw when
    options.gate_in_kernel); beta [B, T, HV] (delta rule); scale (default K^-0.5);
    initial_state [N, HV, K, V] ([N, HV, V, K] with state_v_first), any float dtype, read
    as f32; cu_seqlens [N+1] (B == 1) and cu_seqlens_cpu its CPU copy; A_log, dt_bias [HV].
    Returns (o [B, T, HV, V] in q's dtype, final_state f32 in the state layout or None).
    return_states=True (the GLAChunkFwd contract): the 3-stage path, and a third result,
    states f32 [NT + N, HV, K, V] (or [..., V, K] with state_v_first): per sequence, the
    state entering each of its chunks, in order, then its final state (sequence n's rows
    start at chunk_offsets[n] + n); the final state returned is a view of those rows when
    the sequences are equal in length. They are the pass's f32 states (the output reads
    them rounded to q's dtype). Inputs are never modified.
    """
    import torch
    check_supported(spec)
    spec.check_options(options)
    (B, T, H, HV, K, V), N = _check_inputs(spec, options, q, k, v, g, beta, initial_state,
                                           cu_seqlens, cu_seqlens_cpu, A_log, dt_bias)
    if spec.gate is Gate.KEY and K > 128:
        raise SpecError(f"the chunked forward with a per-key gate supports K <= 128, got K={K}")
    scale = spec.scale_for(K, scale)
    dev = q.device
    dtype = _dtype_name(q)
    C = spec.chunk_size

    if cu_seqlens is not None:   # values checked above (on cu_seqlens_cpu when given)
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        cu = tuple(int(x) for x in host.tolist())
    else:
        cu = tuple(range(0, (B + 1) * T, T)) if T > 0 else (0,) * (B + 1)
    assert len(cu) == N + 1
    cu32, chunk_bos, chunk_len, chunk_offsets = _device_tables(cu, C, dev)
    NT = chunk_bos.numel()
    Ttot = B * T

    state_shape = (N, HV, V, K) if options.state_v_first else (N, HV, K, V)

    flat = lambda x, *tail: x.reshape(Ttot, *tail).contiguous()  # noqa: E731 (views when contiguous)
    qf, kf, vf = flat(q, H, K), flat(k, H, K), flat(v, HV, V)
    empty = lambda *shape, dt=torch.float32: torch.empty(shape, dtype=dt, device=dev)  # noqa: E731

    key_gate = spec.gate is Gate.KEY
    dt = q.dtype
    # g_cum: the within-chunk cumsum in chunk-padded rows [HV, NT * C] (scalar gate), the
    # last rows [NT, HV, K] (key gate), an unused [Ttot, HV] without a gate
    g_cum = (empty(NT, HV, K) if key_gate else empty(HV, NT * C) if spec.has_gate
             else empty(Ttot, HV))
    gf = (flat(g, HV, K) if key_gate else flat(g, HV)) if spec.has_gate else g_cum
    betaf = flat(beta, HV) if spec.has_beta else empty(Ttot, HV)
    dt_len = HV * K if key_gate else HV
    if options.gate_in_kernel:
        A_log_t, dt_bias_t = A_log, dt_bias.reshape(dt_len)
    else:
        A_log_t, dt_bias_t = empty(HV), empty(dt_len)
    w = empty(Ttot, HV, K, dt=dt)
    u = empty(Ttot, HV, V, dt=dt) if spec.has_beta else vf   # additive: the state reads v
    o = empty(Ttot, HV, V, dt=dt)
    # with return_states the final states are rows of the states tensor (taken below)
    full_final = output_final_state and (Ttot == 0 or not return_states)
    final = empty(*state_shape) if full_final else empty(1, *state_shape[1:])
    if Ttot == 0:
        if output_final_state:
            final.copy_(initial_state.float() if initial_state is not None else 0.0)
        out = o.reshape(B, T, HV, V), (final if output_final_state else None)
        if return_states:     # each sequence's one row: its final (= initial) state
            return out + (final if output_final_state else
                          (initial_state.float() if initial_state is not None
                           else empty(N, *state_shape[1:]).zero_()),)
        return out

    # the value-head-fastest grids put the chunk index on gridDim.y, and chunk_output has
    # it there in either order: past the limit, chunk-fastest grids and the fused path
    many_chunks = NT > _ARCH.MAX_GRID_YZ
    if many_chunks and return_states:
        raise SpecError(f"{NT} chunks: the per-chunk states of more than "
                        f"{_ARCH.MAX_GRID_YZ} chunks in one call are not supported")
    fused = (fuse_output(N * HV, dtype, K) or many_chunks) and not return_states
    params = stage_params(spec, options, H=H, HV=HV, K=K, V=V, dtype=dtype,
                          g_dtype=_dtype_name(gf), beta_dtype=_dtype_name(betaf), N=N,
                          has_initial_state=initial_state is not None,
                          output_final_state=bool(output_final_state), fused=fused,
                          states_out=return_states,
                          seq_chunks=(tuple(-(-(e - b) // C) for b, e in zip(cu, cu[1:]))
                                      if cu_seqlens is not None else None), n_chunks=NT)
    runtime.announce(spec, ARCH, params)      # recording(): note every stage at once
    if key_gate:
        # prepare writes qg = q e^G and the causal gated A_qk (the output's q and k
        # operands) and kg = k e^(G_last - G) (the state's k operand)
        q_out, k_out, k_state = empty(Ttot, HV, K, dt=dt), empty(Ttot, HV, C, dt=dt), \
            empty(Ttot, HV, K, dt=dt)
        prep = compiled_stage(spec, "chunk_prepare", **params["chunk_prepare"])
        prep(qf, kf, vf, gf, betaf, A_log_t, dt_bias_t, chunk_bos, chunk_len,
             k_out, q_out, k_state, g_cum, w, u)
    else:
        kn = torch.empty_like(kf) if options.l2norm_qk else kf
        q_out, k_out, k_state = qf, kn, kn
        if "chunk_prepare" in params:
            prep = compiled_stage(spec, "chunk_prepare", **params["chunk_prepare"])
            prep(kf, vf, gf, betaf, A_log_t, dt_bias_t, chunk_bos, chunk_len, g_cum, kn, w, u)
        elif "chunk_kkt_inverse" in params:     # split prepare (PREPARE_SPLIT)
            kkt = params["chunk_kkt_inverse"]
            A = empty(Ttot, HV, C, dt=getattr(torch, kkt["a_dtype"] or dtype))
            compiled_stage(spec, "chunk_kkt_inverse", **kkt)(
                kf, gf, betaf, A_log_t, dt_bias_t, chunk_bos, chunk_len, g_cum, kn, A)
            compiled_stage(spec, "chunk_wu", **params["chunk_wu"])(
                kn, vf, A, g_cum, chunk_bos, chunk_len, w, u)

    h0 = (initial_state.to(torch.float32).contiguous() if initial_state is not None
          else empty(1, *state_shape[1:]))
    state_stage = "chunk_state_output" if fused else "chunk_state"
    (seq_cu, seq_c0, seq_h0, seq_ht), state_params = (cu32, chunk_offsets, h0, final), \
        params[state_stage]
    if return_states:   # the per-chunk states and the final ones, f32, in one tensor
        states = empty(NT + N, *state_shape[1:])
        seq_ht = states
    if SPLIT and not return_states:   # segments as sequences from their start states
        import sys
        from .chunk_split import run_segment_maps
        split = run_segment_maps(
            sys.modules[__name__], spec, options, cu, HV=HV, K=K, V=V, H=H, dtype=dtype,
            k_state=k_state, w=w, u=u, g_cum=g_cum, h0=h0, final=final,
            has_initial_state=initial_state is not None,
            output_final_state=output_final_state, state_params=state_params)
        if split is not None:
            (seq_cu, seq_c0, seq_h0, seq_ht), state_params = split
    if fused:
        if not key_gate:   # the output operands qg, A_qk (the key gate's prepare wrote them)
            if params["chunk_qk"].get("q_out", "gated") == "gated":
                q_out = empty(Ttot, HV, K, dt=dt)
            else:          # q itself, or its normalised copy: the state pass gates it
                q_out = empty(Ttot, H, K, dt=dt) if options.l2norm_qk else qf
            k_out = empty(Ttot, HV, C, dt=dt)
            compiled_stage(spec, "chunk_qk", **params["chunk_qk"])(
                qf, kn, g_cum, chunk_bos, chunk_len, q_out, k_out)
        state = compiled_stage(spec, "chunk_state_output", **state_params)
        state(k_state, w, u, g_cum, seq_cu, seq_c0, seq_h0, seq_ht, q_out, k_out, o,
              float(scale))
        return o.reshape(B, T, HV, V), (final if output_final_state else None)

    h = empty(NT, HV, K, V, dt=dt)
    v_new = empty(Ttot, HV, V, dt=dt) if spec.has_beta else vf
    state = compiled_stage(spec, "chunk_state", **state_params)
    state(k_state, w, u, g_cum, seq_cu, seq_c0, seq_h0, h, v_new, seq_ht)

    out = compiled_stage(spec, "chunk_output", **params["chunk_output"])
    out(q_out, k_out, v_new, h, g_cum, chunk_bos, chunk_len, o, float(scale))
    if not return_states:
        return o.reshape(B, T, HV, V), (final if output_final_state else None)
    if output_final_state:   # sequence n's last row: chunk_offsets[n + 1] + n
        if cu_seqlens is None:
            final = states.view(N, NT // N + 1, *state_shape[1:])[:, -1]
        else:                # (on the device: no host sync)
            last = chunk_offsets[1:].long() + torch.arange(N, device=dev)
            final = states.index_select(0, last)
    return o.reshape(B, T, HV, V), (final if output_final_state else None), states


def _prepare_tuning(spec: OpSpec) -> dict:
    """chunk_prepare's tuning knobs that differ from its template's defaults: the scalar /
    no-gate template's (PREPARE_INVERSE, _THREADS, _PREFETCH) or the per-key gate's
    (PREPARE_KEY_INVERSE falling back to PREPARE_INVERSE, _THREADS, _SKEW)."""
    key = spec.gate is Gate.KEY
    inverse = (PREPARE_KEY_INVERSE or PREPARE_INVERSE) if key else PREPARE_INVERSE
    threads = PREPARE_KEY_THREADS if key else PREPARE_THREADS
    out = {"inverse": inverse} if spec.has_beta else {}
    if threads != 128:
        out["threads"] = threads
    if key and PREPARE_KEY_SKEW:
        out["skew"] = True
    if not key and PREPARE_PREFETCH and spec.has_beta:
        out["prefetch"] = True
    return out


def stage_params(spec: OpSpec, options: Options, *, H, HV, K, V, dtype, g_dtype="float32",
                 beta_dtype="float32", N=1, has_initial_state=False,
                 output_final_state=False, fused=False, seq_chunks=None,
                 n_chunks=None, states_out=False) -> dict:
    """stage name -> build() params of the stages one call runs (chunk_prepare is skipped
    when there is nothing to prepare: no gate, no beta, no l2norm; fused=True: chunk_qk
    and chunk_state_output instead of chunk_state and chunk_output; PREPARE_SPLIT: the
    delta rule's chunk_kkt_inverse and chunk_wu instead of chunk_prepare). seq_chunks: each
    sequence's chunk count for a varlen call (the state pass's block); n_chunks: the
    call's chunk count (the per-chunk grids' order must fit gridDim.y); states_out: the
    3-stage state pass also writes every chunk's state and the final one in f32 (the chunk
    contracts' states; implies output_final_state). Uses the module's
    tuning knobs (STATE_NUM_STAGES, PREPARE_INVERSE, PREPARE_THREADS, PREPARE_PREFETCH,
    STATE_BLOCK_V_OVERRIDE, HEADS_FASTEST, ...)."""
    common = dict(H=H, HV=HV, K=K, V=V, dtype=dtype)
    # the per-chunk grids (value heads fastest puts the chunk on gridDim.y: n_chunks, the
    # call's chunk count when known, must fit)
    order = ({"heads_fastest": True}
             if HEADS_FASTEST and (n_chunks or 0) <= _ARCH.MAX_GRID_YZ else {})
    out = {}
    if spec.has_gate or spec.has_beta or options.l2norm_qk:     # (a key gate always has)
        out["chunk_prepare"] = dict(
            common, g_dtype=g_dtype if spec.has_gate else "float32",
            beta_dtype=beta_dtype if spec.has_beta else "float32",
            l2norm_qk=options.l2norm_qk, beta_sigmoid=options.beta_sigmoid,
            allow_neg_eigval=options.allow_neg_eigval, gate_in_kernel=options.gate_in_kernel,
            **_prepare_tuning(spec), **order)
    if PREPARE_SPLIT and spec.has_beta and spec.gate is not Gate.KEY:
        prep = out.pop("chunk_prepare")
        for name in ("V", "inverse", "threads", "prefetch"):
            prep.pop(name, None)
        out["chunk_kkt_inverse"] = dict(prep, inverse=PREPARE_SPLIT_INVERSE,
                                        a_dtype=PREPARE_SPLIT_A_DTYPE,
                                        **({"threads": PREPARE_SPLIT_KKT_THREADS}
                                           if PREPARE_SPLIT_KKT_THREADS else {}))
        out["chunk_wu"] = dict(common, a_dtype=PREPARE_SPLIT_A_DTYPE, **wu_params(K, V), **order)
    state_bv = state_block_v(V, N * HV, seq_chunks)
    out["chunk_state"] = dict(common, state_v_first=options.state_v_first,
                              has_initial_state=bool(has_initial_state),
                              output_final_state=bool(output_final_state or states_out),
                              block_v=state_bv,
                              num_stages=STATE_NUM_STAGES,
                              **({"v_new_from_fragment": True}
                                 if STATE_V_NEW_FROM_FRAGMENT and spec.gate is Gate.SCALAR
                                 and spec.has_beta else {}),
                              **({"h_from_fragment": True} if STATE_H_FROM_FRAGMENT else {}),
                              **({"threads": STATE_THREADS}
                                 if STATE_THREADS != 128 and state_bv >= 32 else {}),
                              **({"min_blocks": STATE_MIN_BLOCKS} if STATE_MIN_BLOCKS > 1
                                 and not (STATE_THREADS != 128 and state_bv >= 32) else {}),
                              **({"states_out": True} if states_out and not fused else {}))
    out["chunk_output"] = dict(common, l2norm_qk=options.l2norm_qk, block_v=output_block_v(V),
                               **({"tile_loads": True} if OUTPUT_TILE_LOADS else {}),
                               **({"stage_o": True} if OUTPUT_STAGE_O else {}), **order)
    if fused:
        out["chunk_state_output"] = out.pop("chunk_state")
        del out["chunk_output"]
        if spec.gate is not Gate.KEY:
            out["chunk_qk"] = dict(H=H, HV=HV, K=K, dtype=dtype, l2norm_qk=options.l2norm_qk,
                                   **order,
                                   **({"group_loop": True} if QK_GROUP_LOOP and HV > H else {}))
            if FUSED_Q == "raw":
                out["chunk_qk"]["q_out"] = "normed" if options.l2norm_qk else "none"
                out["chunk_state_output"]["q_gated"] = False
            elif FUSED_Q != "gated":
                raise SpecError(f"LINATTN_CHUNK_FUSED_Q must be 'raw' or 'gated', got {FUSED_Q!r}")
    return out


# -- compiling ahead of time, in parallel (the GPU tests and the probe use it) ------------

def precompile(jobs, workers=None) -> list:
    """Compile (spec, stage, params) jobs in parallel processes (runtime.precompile);
    returns the error strings (empty when every job compiled)."""
    return runtime.precompile([(spec, stage, ARCH, params) for spec, stage, params in jobs],
                              workers)
