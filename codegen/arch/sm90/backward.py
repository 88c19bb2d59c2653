"""Hopper's chunked backward of the additive rule (GLA, simple GLA, linear attention):
stages generated from the spec (codegen/templates/chunk_bwd_*). The state gradient comes
from one of two reverse passes:

  walk (where its tiles fill the GPU: chains x tiles >= the SMs)
  chunk_bwd_dstate_gate   per chunk, in parallel (gated): q e^G and the chunk's decay e^{G_last}
  chunk_bwd_dstate_walk   per sequence, last chunk first: dh = decay (.) dh + scale qg^T do,
                          one tensor-core product a chunk, dh in registers (block_k x
                          block_v a CTA), leaving the gradient of the state leaving each chunk

  scan (few chains: the GLAChunkBwd rows' 8 chains of 256 chunks)
  chunk_bwd_dstate_local  per chunk, in parallel: its own term X = scale (q e^G)^T do, into
                          the row of the state entering it, and its decay
  chunk_bwd_dstate_scan   per sequence, last chunk first: dh = decay (.) dh + X, element
                          by element (the transition is diagonal): no matrix product is
                          serialised, but X goes through memory (f32, written and read)

then

  chunk_bwd_dqkvg         per chunk, in parallel: dq, dk, dv, dg from the states (f32, the
                          forward's or recomputed), their gradients and the intra-chunk pairs
"""
from __future__ import annotations

from ...pipeline import AdditiveBackwardProblem, Buffer, DeltaBackwardProblem, Plan, launch
from . import hardware as hw
from .hardware import NAME, NUM_SMS

#: per-chunk stages: value block of dstate_local's block_k x block_v f32 accumulator
LOCAL_BLOCK_V = 64
#: the per-chunk stages' key block: all of K up to 128; above, K / block_k CTAs a chunk
#: and head of 128 channels (K = 256: each CTA then is the K = 128 one), else 64 (K = 192:
#: the K = 64 one), K padded to a multiple of 64 (backward_dims: dstate_local's warpgroup
#: GEMM has M = block_k, a multiple of 64; 48 or 96 do not lower). Every term of
#: dstate_local is per key channel; in dqkvg a CTA forms dq, dk (dg) of its channels from
#: dA (all of V, formed again by each) and writes f32 partials of dv (and of a scalar
#: gate's dg) that the host sums
MAX_BLOCK_K = 128
BLOCK_K_MULTIPLE = 64
#: dqkvg: two warpgroups (a CTA's fragments and the element passes over 64 x K split in
#: two), the value dimension walked in blocks of 32 (the value tiles are then small enough
#: for two CTAs an SM at K = 64: dqkvg_smem); two CTAs an SM where their shared memory
#: fits (min_blocks 2 caps the registers at 128: 127, no spills, at K = V = 64). Key
#: blocks over 64 channels (one CTA an SM: K <= 128 not a multiple of DQKVG_BLOCK_K, or a
#: probe's 128) walk V in blocks of 64 where that fits: half the steps of their two value
#: loops (run s19-2, GLA-1.3B's [4, 4096, 4, 256 / 512] bf16 at key block 128: dqkvg
#: 1.752 -> 1.415 ms; 128 needs 258 KB). The state tiles come by asynchronous copies two
#: value blocks ahead (state_stages 2; run s26-1 at f32 states: dqkvg 1.169 -> 1.129 ms at
#: [4, 4096, 4, 256, 512], 0.674 -> 0.677 at [4, 4096, 8, 128, 128]; 96 KB, 128 registers,
#: no spills with both in 16 bits; f32 ones spill at some shapes: element loads there)
DQKVG = dict(threads=256)
DQKVG_STATE_STAGES = 2
#: dqkvg's key block where K is a multiple of it: two CTAs an SM (128 registers), dv's
#: key-block partials added in f32 (runs s24-3 / s24-4, GLA's dqkvg in ms: K = 256,
#: V = 512, 4 x 4k: 1.347 at 128 -> 1.268 at 64; 4 x 4k, 8 heads, K = V = 128: 0.771 ->
#: 0.685 before dg's h_out term came from h_in, which made 64 faster and 128 slower)
DQKVG_BLOCK_K = 64
DQKVG_BLOCK_V = 32
DQKVG_WIDE_BLOCK_V = 64
SM_SMEM_BYTES = hw.SMEM_PER_SM      # shared memory of one SM (a CTA reserves 1 KB more)


def _ctas_fit(smem: int, ctas: int = 1) -> bool:
    """Whether ``ctas`` CTAs of ``smem`` bytes of shared memory each fit one SM."""
    return ctas * (smem + 1024) <= SM_SMEM_BYTES


#: the scan: state elements per CTA (block_k x block_v), largest first. Every CTA walks
#: all chunks of its sequence (the chain is as long whatever the tile); the tile decides
#: how many SMs share the streaming of X and dh (2 x 4 bytes a state element a chunk), so
#: the first tile whose CTAs cover every SM wins, else the smallest.
SCAN_TILES = ((16, 32), (16, 16), (8, 16))
#: X tiles in flight: a step's dependent work is one FMA and a store, so the scan runs at
#: (tiles in flight) / (load latency); 4 x 0.5 us from L2 ~ 8 steps a us (not measured)
SCAN_STAGES = 4


#: the delta rule's reverse dh pass: pipeline depth (0: plain loop; >= 1: TMA producer warps
#: prefetch the next chunks' inputs). 2 for every gate: DeltaNet's since session 5 (0, 1, 2
#: GPU-checked); the gated ones' since session 16 (GDN 4k, token-first rows: dh 0.99 ->
#: 0.51 ms at 2)
DH_NUM_STAGES = 2


def dh_config(V: int, chains: int) -> dict:
    """The reverse dh pass's tuning for V value channels and ``chains`` (sequences x value
    heads): its pipeline depth and value block (the state pass's rule)."""
    from .stages import state_block_v
    return {"num_stages": DH_NUM_STAGES, "block_v": state_block_v(V, chains)}


#: the delta rule's backward stages, in order (the scalar and the per-key gate)
DELTA_STAGES = ("chunk_bwd_dv_local", "chunk_bwd_dh", "chunk_bwd_dqkw", "chunk_bwd_wy")
#: without a gate, the folded form: the reverse pass's dh-free parts (dh_local = q^T do -
#: w^T dv_local, the operator -(w^T k)) formed per chunk in parallel by fold_local, the
#: pass left one K x K x block_v product a chunk (fold_walk; the four stages' dh step is
#: three products and two round trips through shared memory), and one tail a chunk
#: (fold_tail: dv2 = dv_local + k dh, dq, dk, dw, then back through A, w, u; dv2, dw and
#: dk's first terms never in memory). Run s34-1 (H100, DeltaNetChunkBwd bf16, ms): train-2k
#: 0.0572 -> 0.0412, 4k 0.1094 -> 0.0770, 8k 0.2061 -> 0.1608, 16k 0.3926 -> 0.3115,
#: deltanet-1.3b-train 0.0363 -> 0.0356; the tail split in two (fold_dqkw, then the wy
#: stage) was 0.0481 / 0.0929 / 0.1868 / 0.3490 / 0.0410 (bench/LOG.md)
FOLD_STAGES = ("chunk_bwd_fold_local", "chunk_bwd_fold_walk", "chunk_bwd_fold_tail")
#: the folded walk's pipeline depth (chunks whose operator and dh_local tile are in
#: flight). Run s34-3 (H100, DeltaNetChunkBwd bf16, 8 chains, K = V = 64, block_v 16; walk
#: / whole backward in ms): depth 1 0.0228 / 0.0508 at train-2k, 0.2419 / 0.4192 at 16k;
#: 2 0.0130 / 0.0412, 0.1327 / 0.3108; 3 0.0121 / 0.0401, 0.0956 / 0.2727. Block 32 / 64
#: slower at depth 2 (16k: walk 0.1638 / 0.3027); dh^T in registers feeding the product
#: (wgmma_rs, block 64) 0.2058-0.3285 at 16k: slower (bench/LOG.md)
FOLD_WALK_NUM_STAGES = 3


def delta_stages(gate: str) -> tuple:
    """The delta rule's backward stages for ``gate``, in order."""
    return FOLD_STAGES if gate == "none" else DELTA_STAGES


def delta_backward_params(p: DeltaBackwardProblem) -> dict:
    """stage -> build() params of the delta rule's backward stages (delta_stages): the dh
    pass (or the folded walk) with p's flags and dh_config's tuning (or a probe's p.dh),
    dqkw (the fold's tail) with the states' dtype."""
    common = dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype)
    folded = p.gate == "none"
    dh = dict(common, **{**dh_config(p.V, p.chains),
                         **hw.DELTA_BACKWARD_TUNING.get("chunk_bwd_dh", {}),
                         **({"num_stages": FOLD_WALK_NUM_STAGES} if folded else {}),
                         **dict(p.dh)},
              **({"use_dht": True} if p.use_dht else {}),
              **({"store_dh0": True} if p.store_dh0 else {}))
    dqkw = dict(common, **({"state_dtype": p.state_dtype} if p.state_dtype else {}))
    if folded:
        first, walk, tail = FOLD_STAGES
        return {first: common, walk: dh, tail: dqkw}
    return {"chunk_bwd_dv_local": common, "chunk_bwd_dh": dh, "chunk_bwd_dqkw": dqkw,
            "chunk_bwd_wy": dict(common, **hw.DELTA_BACKWARD_TUNING.get("chunk_bwd_wy", {}))}


def delta_backward_plan(p: DeltaBackwardProblem, params: dict | None = None) -> Plan:
    """The delta rule's backward stages (delta_stages) over p's Ttot tokens and NT chunks
    (params: the stages' own, else delta_backward_params). Each intermediate is allocated just
    before its first stage and released after its last reader, with what the recompute
    gave that no later stage reads (aqk, qg, kg, g_last, w, u, A): dv_local, dv2 (the
    gradient of v_new: the dh pass's output, the WY stage's du), dh (the gradient of each
    chunk's leaving state), dk_part, dw and, gated, dg_part; the outputs dq, dk, dv, dbeta
    (and dg) where the caller binds none."""
    params = params or delta_backward_params(p)
    if p.gate == "none":
        return _fold_plan(p, params)
    T_, HV, K, V = p.Ttot, p.HV, p.K, p.V
    dg = (T_, HV, K) if p.gate == "key" else (T_, HV)
    out = lambda n, shape, dt="input": Buffer(n, shape, dt, "chunk_bwd_wy", True)  # noqa: E731
    bufs = [Buffer("dv_local", (T_, HV, V), "input", "chunk_bwd_dv_local"),
            Buffer("dv2", (T_, HV, V), "input", "chunk_bwd_dh"),
            Buffer("dh", (p.NT, HV, K, V), "input", "chunk_bwd_dh"),
            Buffer("dq", (T_, HV, K), "input", "chunk_bwd_dqkw", True),
            Buffer("dk_part", (T_, HV, K), "float32", "chunk_bwd_dqkw"),
            Buffer("dw", (T_, HV, K), "input", "chunk_bwd_dqkw"),
            Buffer("dg_part", dg, "float32", "chunk_bwd_dqkw")]
    bufs += [out("dk", (T_, HV, K)), out("dv", (T_, HV, V)), out("dbeta", (T_, HV)),
             out("dg", dg, "float32")]
    stage = lambda s, **kw: launch(s, params[s], **kw)  # noqa: E731
    launches = (stage("chunk_bwd_dv_local", release=("aqk",)),
                stage("chunk_bwd_dh", dh_out="dh", release=("dv_local", "qg", "kg", "g_last")),
                stage("chunk_bwd_dqkw", release=("dh", "w", "u")),
                stage("chunk_bwd_wy", du="dv2",
                      release=("A", "dw", "dv2", "dk_part", "dg_part")))
    return Plan("delta-backward", NAME, launches, tuple(bufs))


def _fold_plan(p: DeltaBackwardProblem, params: dict) -> Plan:
    """delta_backward_plan without a gate (FOLD_STAGES): dv_local, dh_local (f32) and the
    operator nwk from the first stage, dh from the walk, every output from the tail."""
    T_, HV, K, V, NT = p.Ttot, p.HV, p.K, p.V, p.NT
    first, walk, tail = FOLD_STAGES
    bufs = (Buffer("dv_local", (T_, HV, V), "input", first),
            Buffer("dh_local", (NT, HV, K, V), "float32", first),
            Buffer("nwk", (NT, HV, K, K), "input", first),
            Buffer("dh", (NT, HV, K, V), "input", walk),
            Buffer("dq", (T_, HV, K), "input", tail, True))
    bufs += tuple(Buffer(n, shape, "input", tail, True) for n, shape in
                  (("dk", (T_, HV, K)), ("dv", (T_, HV, V)), ("dbeta", (T_, HV))))
    stage = lambda s, **kw: launch(s, params[s], **kw)  # noqa: E731
    launches = (stage(first),
                stage(walk, dh_out="dh", release=("dh_local", "nwk")),
                stage(tail, release=("dh", "w", "u", "dv_local", "A")))
    return Plan("delta-backward-fold", NAME, launches, bufs)


def value_block(V: int, most: int = 64) -> int:
    """The largest of 64, 32, 16 (at most ``most``) dividing V."""
    return next(b for b in (64, 32, 16) if b <= most and V % b == 0)


def backward_dims(K: int, V: int) -> tuple:
    """(K, V) the backward's kernels run a call of head dims K, V at: K rounded up to a
    multiple of 64 (dstate_local's warpgroup GEMM: M = block_k), V to a multiple of
    DQKVG_BLOCK_V (dqkvg's value tiles; V = 48 did not compile). The op pads q, k, the
    gate, v, do, the states and dht with zeros: every real gradient unchanged, the padded
    ones dropped."""
    up = lambda x, m: -(-x // m) * m  # noqa: E731
    return up(K, BLOCK_K_MULTIPLE), up(V, DQKVG_BLOCK_V)


def key_block(K: int) -> int:
    """The per-chunk stages' key channels a CTA at kernel head dim K (MAX_BLOCK_K)."""
    if K <= MAX_BLOCK_K:
        return K
    if K % BLOCK_K_MULTIPLE:
        raise ValueError(f"K={K}: the backward's kernels run K > {MAX_BLOCK_K} at multiples "
                         f"of {BLOCK_K_MULTIPLE} (backward_dims)")
    return MAX_BLOCK_K if K % MAX_BLOCK_K == 0 else BLOCK_K_MULTIPLE


def dqkvg_smem(p: AdditiveBackwardProblem, bv: int, bk: int, group_loop: bool = False) -> int:
    """Bytes of shared memory chunk_bwd_dqkvg holds at its peak (the pair terms or the
    state terms; buffers of disjoint lifetimes share memory) at value block bv and key
    block bk, 16-bit inputs; group_loop: :func:`_group_loop_smem`."""
    C, K = p.chunk_size, bk
    x = 2 * C * bv if {"value_scale", "skip"} & set(p.terms) else 0    # (the terms: x)
    if group_loop:
        return _group_loop_smem(p, bv, bk, x)
    if p.gate != "key":                 # q, k, A, dA, v, do, h, dh, kd
        return 2 * (4 * C * K + 2 * C * C + 2 * C * bv + 2 * K * bv) + x
    held = C * K * (2 + 2 + 4 + 8) + 16 * K + 4 * C * C        # q, k, G, dq / dk diag, A, dA
    return held + max(4 * C * K,                               # Qr, Kr (A's rows; the pair terms)
                      2 * C * K + 4 * C * bv + 4 * K * bv + 4 * K + x)   # kd, v, do, h, dh


#: dqkvg under group_loop: the small buffers (gate rows, dg's sums, reductions' scratch)
#: beside the tiles _group_loop_smem counts, from three sm_90a compiles at the
#: Nemotron-H row (5.5 to 7.5 KB)
GROUP_LOOP_SMEM_SLACK = 8192


def _group_loop_smem(p: AdditiveBackwardProblem, bv: int, bk: int, x: int) -> int:
    """dqkvg_smem under group_loop: every tile is live across the loop over the group's
    value heads, so none shares memory (q, k, kd, A, dA, v, do, h, dh, x, the state
    stages of 16-bit states) and the group's dq, dk sums (f32) come on top. Within 1 %
    above the compiles (sm_90a, K 128, V 64, the terms, 16-bit states): 118016 bytes at
    block_k 64 / block_v 32, 200192 at 128 / 32, 259584 at 128 / 64."""
    C, K = p.chunk_size, bk
    stages = DQKVG_STATE_STAGES * 2 * 2 * K * bv if p.state_dtype != "float32" else 0
    return (2 * (3 * C * K + 2 * C * C + 2 * C * bv + 2 * K * bv) + x + stages
            + 8 * C * K + GROUP_LOOP_SMEM_SLACK)


def _dqkvg_block_v(p: AdditiveBackwardProblem, block_k: int, group_loop: bool) -> int:
    """dqkvg's value block: DQKVG_WIDE_BLOCK_V for key blocks over 64 channels where V
    takes it and its shared memory fits one CTA, else DQKVG_BLOCK_V (or what divides V)."""
    wide = DQKVG_WIDE_BLOCK_V
    if block_k > 64 and p.V % wide == 0 and \
            _ctas_fit(dqkvg_smem(p, wide, block_k, group_loop)):
        return wide
    return value_block(p.V, DQKVG_BLOCK_V)


def scan_tile(p: AdditiveBackwardProblem) -> tuple:
    """(block_k, block_v) of chunk_bwd_dstate_scan."""
    fits = [(bk, bv) for bk, bv in SCAN_TILES if p.K % bk == 0 and p.V % bv == 0]
    if not fits:
        raise ValueError(f"K={p.K}, V={p.V}: the backward's scan needs multiples of 8 and 16")
    for bk, bv in fits:
        if p.N * p.HV * (p.K // bk) * (p.V // bv) >= NUM_SMS:
            return bk, bv
    return fits[-1]


#: training keeps the forward's per-chunk states (f32, 4 K V / 64 bytes a token and value
#: head) for the backward where they take no more memory than fla's chunk_gla keeps
#: beyond its inputs (A, f32, 4 x 64 bytes a token and head): K V <= 64 x 64; else the
#: backward recomputes them (one more prepare and state pass: GLAChunkFwd's time again)
SAVE_STATES_MAX_KV = 64 * 64
#: the call terms (dsl/call_terms.py) dqkvg forms, as its build() flags: the value scale
#: (v' = s x formed where v is read; ds's row sums) and the skip term (D do added to x's
#: gradient; dD's chunk partials). sm90's alone: sm80's column sum (through shared memory,
#: templates/arch/sm80.py.jinja) is not compiled with them yet, so its calls keep torch's
DQKVG_TERMS = ("skip", "skip_per_head", "value_scale") if "warpgroups" in hw.FEATURES else ()


def save_states(K: int, V: int) -> bool:
    """Whether a training forward keeps its states for the backward (else recomputed)."""
    return K * V <= SAVE_STATES_MAX_KV


#: the walk: state elements per CTA (block_k x block_v; block_k a multiple of 64, the
#: product's M), largest first: the first whose CTAs cover every SM, else the scan runs.
#: A step is one load of qg, do (pipelined) and a 64-deep product; the scan's step is as
#: long but the walk spares local's X (f32, written and read again)
WALK_TILES = ((128, 64), (64, 64), (64, 32), (64, 16))
WALK_STAGES = 2


def walk_tile(p: AdditiveBackwardProblem):
    """(block_k, block_v) of chunk_bwd_dstate_walk, or None where no tile's CTAs cover
    every SM (then local + scan)."""
    for bk, bv in WALK_TILES:
        if p.K % bk == 0 and p.V % bv == 0 and \
                p.N * p.HV * (p.K // bk) * (p.V // bv) >= NUM_SMS:
            return bk, bv
    return None


#: what a probe or test may set in additive_backward_plan's config ("dstate_pass": "walk"
#: or "scan")
BACKWARD_CONFIG_KEYS = ("scan_block_k", "scan_block_v", "scan_stages", "dqkvg_threads",
                        "dqkvg_min_blocks", "dqkvg_block_v", "dqkvg_block_k", "dstate_pass",
                        "dqkvg_state_stages", "dqkvg_direct_states")


def additive_backward_plan(p: AdditiveBackwardProblem, config: tuple = ()) -> Plan:
    """The three backward stages of p with their tiles, and the buffers between them:
    dstate [NT + N, HV, K, V] f32 (rows as the states': per sequence, entering each
    chunk, then the final one) and, with a gate, decay [NT, HV, K] f32. config: (key,
    value) pairs forcing a choice (BACKWARD_CONFIG_KEYS; probes)."""
    config = dict(config)
    bad = sorted(set(config) - set(BACKWARD_CONFIG_KEYS))
    if bad:
        raise ValueError(f"unknown backward plan config {bad}; known: {list(BACKWARD_CONFIG_KEYS)}")
    if p.N * p.HV > hw.MAX_GRID_YZ:
        raise ValueError(f"{p.N} sequences x {p.HV} value heads: the backward takes at most "
                         f"{hw.MAX_GRID_YZ} (sequence, head) pairs in one call")
    if p.NT > hw.MAX_GRID_YZ:            # (the per-chunk stages put the chunks on gridDim.y / z)
        raise ValueError(f"{p.NT} chunks: the backward takes at most {hw.MAX_GRID_YZ} chunks "
                         "in one call")
    if set(p.terms) - set(DQKVG_TERMS):
        raise ValueError(f"call terms {sorted(set(p.terms) - set(DQKVG_TERMS))}: the backward "
                         f"forms {list(DQKVG_TERMS)} here")
    gated = p.gate != "none"
    order = {"heads_fastest": True}     # the value heads of a chunk together (q, k through L2)
    heads = dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype)
    g = {"g_dtype": p.g_dtype} if gated else {}
    kbk = key_block(p.K)
    kblocks = {"block_k": kbk} if kbk < p.K else {}
    loop = _group_loop(p)
    dbk = config.get("dqkvg_block_k", kbk if loop else
                     DQKVG_BLOCK_K if p.K % DQKVG_BLOCK_K == 0 else kbk)
    if p.K % dbk or dbk % 16:
        raise ValueError(f"plan config dqkvg_block_k={dbk}: a multiple of 16 dividing K={p.K}")
    dbv = config.get("dqkvg_block_v", _dqkvg_block_v(p, dbk, loop))
    # two CTAs: their shared memory fits, and block_k <= 64 (dq, dk and a product in flight
    # are three 64 x block_k f32 fragments, 3 block_k / 4 registers a thread: over 128 at
    # 128); never under group_loop (128 registers spill there: 24 bytes at block_k 64)
    two = (hw.DQKVG_TWO_CTAS and _ctas_fit(dqkvg_smem(p, dbv, dbk, loop), 2)
           and dbk <= 64 and not loop)
    dqkvg = dict(DQKVG, block_v=dbv, min_blocks=config.get("dqkvg_min_blocks", 2 if two else 1),
                 **({"threads": config["dqkvg_threads"]} if "dqkvg_threads" in config else {}),
                 **({"state_stages": config["dqkvg_state_stages"]}
                    if "dqkvg_state_stages" in config else {}),
                 **({"direct_states": config["dqkvg_direct_states"]}
                    if "dqkvg_direct_states" in config else {}),
                 **({"block_k": dbk} if dbk < p.K else {}), **{t: True for t in p.terms},
                 **({"group_loop": True} if loop else {}))
    launches, bufs, why = _dstate_pass(p, config, heads, g, kblocks, order)
    # dstate as the states (the walk rounds its rows as it writes them; the scan sums into
    # its rows in place, so they stay f32)
    walked = launches[-1].stage == "chunk_bwd_dstate_walk"
    dstate_dtype = p.state_dtype if walked else "float32"
    if dstate_dtype != "float32":
        dqkvg.setdefault("state_stages", DQKVG_STATE_STAGES)
    launches += (launch("chunk_bwd_dqkvg", dict(heads, **g, grad_dtype=p.grad_dtype, **dqkvg,
                                                state_dtype=p.state_dtype,
                                                dstate_dtype=dstate_dtype, **order)),)
    bufs = (Buffer("dstate", (p.NT + p.N, p.HV, p.K, p.V), dstate_dtype),) + bufs
    if gated:
        bufs += (Buffer("decay", (p.NT, p.HV, p.K)),)
    return Plan("additive-backward", NAME, launches, bufs, reasons=(why,))


def _group_loop(p: AdditiveBackwardProblem) -> bool:
    """Whether dqkvg's CTA per (chunk, key head, key block) walks the group's value heads
    in turn, dq, dk summed on chip and stored once in grad_dtype (no f32 atomic adds, no
    host zeros and cast): the plan's choice for every GVA spec (HV > H) without a
    per-key gate (the template's group_loop flag; a per-key gate's dqkvg keeps the atomic
    adds). Its key block is the per-chunk stages' (key_block: all of K up to 128, so x
    and do are read once and dx stored, not added), its value block the widest whose
    shared memory fits (_group_loop_smem), one CTA an SM. Measured in run s43-1 (H100,
    Mamba-2 training at the Nemotron-H-8B layer, bench/ssd_probe.py: train-4096 2.020 ->
    1.854 ms, train-8192 3.867 -> 3.590 ms against the atomic adds; design.md, "Next:
    dqkvg"). Where its shared memory does not fit one CTA at the narrowest value block
    (sm80 at K = 128 with 16-bit states: ~192 KB), the atomic adds."""
    if p.HV == p.H or p.gate == "key":
        return False
    return _ctas_fit(dqkvg_smem(p, value_block(p.V, DQKVG_BLOCK_V), key_block(p.K), True))


def _dstate_pass(p: AdditiveBackwardProblem, config: dict, heads: dict, g: dict,
                 kblocks: dict, order: dict) -> tuple:
    """(launches, extra buffers, reason) of the reverse pass for the state gradient: the
    walk where walk_tile finds a tile (or config["dstate_pass"] says so), else local + scan."""
    flags = dict(use_dht=p.use_dht, store_dh0=p.store_dh0)
    tile = walk_tile(p)
    forced = config.get("dstate_pass")
    if forced not in (None, "walk", "scan"):
        raise ValueError(f"plan config dstate_pass={forced!r}: 'walk' or 'scan'")
    if forced == "walk" and tile is None:
        tile = next((bk, bv) for bk, bv in reversed(WALK_TILES) if p.K % bk == 0 and p.V % bv == 0)
    chains = p.N * p.HV
    if tile is not None and forced != "scan":
        bk, bv = tile
        walk = launch("chunk_bwd_dstate_walk", dict(heads, **flags, block_k=bk, block_v=bv,
                                                    num_stages=WALK_STAGES,
                                                    state_dtype=p.state_dtype))
        why = (f"{chains} chains x {(p.K // bk) * (p.V // bv)} tiles of {bk} x {bv}: the walk")
        if not g:
            return (walk,), (), why
        gate = launch("chunk_bwd_dstate_gate", dict(H=p.H, HV=p.HV, K=p.K, dtype=p.dtype, **g,
                                                    **kblocks))
        return (gate, walk), (Buffer("qg", (p.NT * p.chunk_size, p.HV, p.K), "input"),), why
    bk, bv = scan_tile(p)
    bk, bv = config.get("scan_block_k", bk), config.get("scan_block_v", bv)
    scan = dict(HV=p.HV, K=p.K, V=p.V, **flags, block_k=bk, block_v=bv,
                num_stages=config.get("scan_stages", SCAN_STAGES))
    local = launch("chunk_bwd_dstate_local", dict(heads, **g, block_v=value_block(p.V, LOCAL_BLOCK_V),
                                                 **kblocks, **order))
    why = f"{chains} chains x {(p.K // bk) * (p.V // bv)} tiles of {bk} x {bv}: local + scan"
    return (local, launch("chunk_bwd_dstate_scan", scan)), (), why
