"""Hopper's chunked forward for what the walk does not run (the per-key gate, the additive
rule, the per-chunk states of the chunk contracts, heads too wide for the walk): a prepare
stage, then the sequential state pass and the output, fused (chunk_qk +
chunk_state_output: o formed inside the state pass) or as three stages (chunk_state
writes h per chunk, chunk_output reads it). The rules and their measurements follow."""
from __future__ import annotations

import dataclasses

from ...pipeline import Buffer, ForwardProblem, Plan, launch
from . import additive
from . import hardware as hw
from .dplr import DPLR_MAX_K, DPLR_MAX_V
from .hardware import NAME, NUM_SMS, makespan

#: the state pass's time per chunk step of one CTA by value block, relative (run s2-5's
#: sweep at q35-397b-tp1-65536: 4 / 2 / 1 waves of CTAs took 4.88 / 4.80 / 3.58 ms at
#: block 16 / 32 / 64, i.e. 1.19 / 2.34 / 3.50 us per step; prefill-4k at block 16: 1.17)
CHUNK_STATE_STEP_COST = {16: 1.19, 32: 2.34, 64: 3.50}
#: the fused state + output path pays off from this many (sequence, value head) chains.
#: Run s3-1 (bf16, K = V = 128), fused vs 3-stage: 0.97x at 8 chains, 1.00x at 16, 1.06x
#: at 64, 1.08x at 128; run s3-3 (chunk_qk's stores through shared memory): 0.98x at 8,
#: 1.05x at 16, 1.19x at 64. f16 from 8 (its 3-stage state pass is ~15 % slower than bf16's,
#: run s3-3; runs s5-1 / s5-3: f16 tp8-8192 fused 0.224 ms vs 3-stage 0.245). bf16 with
#: K <= 64 from 32 (run s5-5, GDN prefill-narrow-state: 3-stage 0.111 ms, fused 0.115).
FUSE_MIN_CHAINS = {"float16": 8}
FUSE_MIN_CHAINS_DEFAULT = 16
FUSE_MIN_CHAINS_SMALL_K = {"bfloat16": 32}
#: the per-key gate's prepare (chunk_prepare_key): one CTA per (chunk, head), the pair
#: sums by bisection levels on tensor cores down to diag x diag diagonal blocks summed
#: element by element, channels in panels of up to 64. Runs s8-3 / s8-6 at kda-tp1-4096
#: (us, prepare alone): the predecessor (every 16 x 16 diagonal block element by element
#: from shared memory, 256 threads) ~930; this one at diag 8 with TileLang's column cumsum
#: 724, with the register cumsum 527; diag 4: 419 (tp2-16384 1062 -> 839, tp8-4096 71 -> 56,
#: GLA prefill-8k 94 -> 74). Threads (run s22-1, us): the delta rule at 256 threads with two
#: CTAs an SM (128 registers) against 128 threads: kda-tp1-4096 416 -> 376, tp2-16384 822 ->
#: 729, tp8-4096 56.5 -> 52.7, tp1-4x1024 415 -> 375 (256 at one CTA: 521 / 1021; at three:
#: 384 / 743). The additive rule gains from 256 where its grid leaves SMs idle (gla-short,
#: 80 CTAs: 33.1 -> 22.6) and at K > 128 (run s22-4, GLA-1.3B K = 256: 2 x 4k 165 -> 131,
#: 16k 271 -> 257), not at K <= 128 on a full grid (gla-continue-b4, 320 CTAs: 46 -> 54 at
#: two CTAs, 51 at three; prefill-8k and varlen-ragged +-1 %). A probe may force diag /
#: block_k / threads / min_ctas (config key_diag, key_block_k, key_threads, key_min_ctas).
KEY_PREPARE = {"delta": dict(diag=4, threads=256, min_ctas=2),
               "additive": dict(diag=4, threads=128, min_ctas=1)}
#: the additive rule's prepare where its grid (chunks x value heads) is below the SMs or
#: K > 128
KEY_PREPARE_WIDE = dict(diag=4, threads=256, min_ctas=2)
#: chunk_wu: one CTA per (chunk, head), A_b loaded once, GEMMs of 64 columns (run s3-1:
#: the split prepare 0.095 -> 0.040 ms at GDN prefill-4k with the one-warp inverse), fewer
#: where 64 does not divide K and V
WU_BLOCK_N = 64
#: the state pass's K: a multiple of 64 (its k^T v_new GEMM has K rows, a warpgroup's
#: wgmma takes M in 64s: K = 96 failed to compile, run s8-3); the op pads other K of the
#: per-key gate and the additive rule with zero channels (chunk_k, __init__.py)
STATE_K_MULTIPLE = 64
#: the state pass: two TMA pipeline stages (s2-5 sweep); one where two do not fit: the
#: delta rule's fused pass at K > 128 (two stages of w, kg, qg, aqk, u asked for 243 KB at
#: K = 256, block 32; one: 132 KB). The additive rule's (no w) keeps two: 178 KB at K = 256,
#: block 32 (its one-stage pass: 2.09 us a step at GLA-1.3B 16k, chunk_state's 0.92, run
#: s22-4)
STATE_STAGES = 2
#: the additive rule's fused state pass under GVA with no or a scalar gate (Mamba-2's
#: layer: 128 value heads over 8 key heads): chunk_qk forms tril_incl(q k^T) once per key
#: head, undecayed (4 MB at 4k tokens instead of 134 MB per value head), and the state
#: pass applies its value head's decay (a 64 x 64 element pass a step) over two
#: warpgroups that split each GEMM's columns and each pass in half. Run s37-1 (H100,
#: Mamba-2 fwd [1, T, 128, 64], dstate 128, 8 groups; ms at 4k / 16k): 128 threads, A_qk
#: per value head 0.2855 / 1.0490 (chunk_qk 106 / 388 us of it); 256 threads 0.2716 /
#: 1.0022; per key head 0.3465 / 1.3423 (the decay pass on one warpgroup's chain); both
#: 0.2506 / 0.9318. Elsewhere (GLA's per-key gate, no GVA) 128 threads stay, unmeasured.
AQK_PER_KEY_HEAD = True
FUSED_STATE_THREADS = dict(threads=256, min_tile=128 * 64)
#: the call terms (dsl/call_terms.py) by the stage that forms them, as build() flags: the
#: prepare forms the step (g = A dt, and dt per token, dt_c, for the value scale), the
#: state pass scales the values it takes, the output's stages add the skip term and the
#: output gate (so no pass over x, dt or o runs outside the kernels)
PREPARE_TERMS = ("step_dt", "step_bias_on", "step_softplus", "step_clamp", "value_scale")
STATE_TERMS = ("value_scale",)
OUTPUT_TERMS = ("value_scale", "skip", "skip_per_head", "output_gate")
#: each call term's tensor by the flag under which a stage reads it; a stage without the
#: flag declares it as a placeholder [1] and is handed the plan's term_none (its shape
#: follows the flag: the call's tensor would not fit it)
TERM_TENSORS = {"step_A": "step_dt", "step_bias": "step_bias_on", "step_limit": "step_clamp",
                "dt_c": "value_scale", "skip_D": "skip", "gate_z": "output_gate"}
#: the chunked forward's head dims, multiples of 16 up to: K 256; V 256, but 512 for the
#: additive rule (its state pass splits K and V into tiles within the register budget,
#: additive.py). Other calls take the recurrent kernel (ops/api.py).
MAX_K = 256
MAX_V = 256
ADDITIVE_MAX_V = 512


# -- shared with the walk's plan (forward.py) --------------------------------------

def segment_chunks(seq_chunks: tuple, L: int) -> list:
    """Chunk counts of the segments of each sequence (L = 0: the sequences themselves)."""
    if not L:
        return [[n] for n in seq_chunks]
    return [[min(L, n - s) for s in range(0, n, L)] or [0] for n in seq_chunks]


def n_segments(seq_chunks: tuple, L: int) -> int:
    """Segments of the split at length L (every sequence, an empty one too, owns one)."""
    return sum(len(seq) for seq in segment_chunks(seq_chunks, L))


def _kkt(p: ForwardProblem, heads_fastest: bool) -> dict:
    return dict(H=p.H, HV=p.HV, K=p.K, dtype=p.dtype,
                g_dtype=p.g_dtype if p.gate == "scalar" else "float32",
                beta_dtype=p.beta_dtype, l2norm_qk=p.l2norm_qk, beta_sigmoid=p.beta_sigmoid,
                allow_neg_eigval=p.allow_neg_eigval, gate_in_kernel=p.gate_in_kernel,
                heads_fastest=heads_fastest)


def saved_names(p: ForwardProblem) -> tuple:
    """What a training forward (save_states) keeps for the backward (Plan.saved): the
    states entering each chunk and, for the delta rule, the WY inverse it formed (the
    per-key gate's A with A_qk; the other gates' A itself as A_inv, beside the A_b the
    walk reads), so the backward does not form the inverse again."""
    if not p.save_states:
        return ()
    if p.rule_kind != "delta":
        return ("h",)
    return ("h", "A", "aqk") if p.gate == "key" else ("h", "A_inv")


def prepare_buffers(p: ForwardProblem) -> list:
    """chunk_kkt_inverse's outputs (chunk_kkt_inverse_save's A_inv too)."""
    C, gated = p.chunk_size, p.gate == "scalar"
    out = [Buffer("A", (p.Ttot, p.HV, C), "input"),
           Buffer("g_cum", (p.HV, p.NT * C) if gated else (p.Ttot, p.HV)),
           Buffer("chunk_norm", (p.HV, p.NT))]
    if p.l2norm_qk:
        names = ("qn", "kn") + ((f"{p.erase_key}n",) if p.erase_key else ())
        out += [Buffer(n, (p.Ttot, p.H, p.K), "input") for n in names]
    if "A_inv" in saved_names(p):
        out += [Buffer("A_inv", (p.Ttot, p.HV, C), "input")]
    return out


def kkt_launch(p: ForwardProblem):
    """chunk_kkt_inverse, reading the raw q, k (writing qn, kn when l2norm_qk); in a
    training forward chunk_kkt_inverse_save, writing A itself into A_inv as well."""
    heads_fastest = p.NT <= hw.MAX_GRID_YZ
    binds = {} if p.l2norm_qk else dict(qn="q", kn="k")
    if p.erase_key and not p.l2norm_qk:     # (Comba's p: its normalised copy unwritten)
        binds[f"{p.erase_key}n"] = f"{p.erase_key}_in"
    params = _kkt(p, heads_fastest)
    if "A_inv" in saved_names(p):
        return launch("chunk_kkt_inverse_save", params, **binds, A_out="A_inv")
    return launch("chunk_kkt_inverse", params, **binds)


def chunk_head_limits(rule: str, gate: str) -> tuple:
    """(K max, V max) of the chunked forward for a rule and gate."""
    if rule == "dplr":          # (its own kernels: dplr.py)
        return DPLR_MAX_K, DPLR_MAX_V
    return MAX_K, ADDITIVE_MAX_V if rule == "additive" else MAX_V


def state_stages(p: ForwardProblem, fused: bool) -> int:
    return 1 if fused and p.K > 128 and p.rule_kind == "delta" else STATE_STAGES


def wu_block_n(K: int, V: int) -> int:
    return next(bn for bn in (WU_BLOCK_N, 32, 16) if K % bn == 0 and V % bn == 0)


def _state_makespan(bv: int, V: int, heads: int, seq_chunks: tuple) -> float:
    step = CHUNK_STATE_STEP_COST[bv]
    return makespan(tuple(n * step for n in seq_chunks for _ in range(heads * (V // bv))))


def state_block_v(V: int, n_chains: int, seq_chunks: tuple | None = None) -> int:
    """Value block of chunk_state: the makespan of its CTAs over the SMs (one CTA per SM),
    each (chunks of its sequence) x CHUNK_STATE_STEP_COST; ties: the larger block. Equal
    lengths (or many waves) reduce to "the smallest block that keeps one wave, else 64"."""
    divisors = [bv for bv in (16, 32, 64) if V % bv == 0]
    if not divisors:
        raise ValueError(f"V={V} must be a multiple of 16")
    if seq_chunks and (len(set(seq_chunks)) == 1 or n_chains * V // 16 > 8 * NUM_SMS):
        seq_chunks = None
    if not seq_chunks:
        seq_chunks, heads = (1,) * n_chains, 1
    else:
        heads = n_chains // len(seq_chunks)
    return min(reversed(divisors), key=lambda bv: _state_makespan(bv, V, heads, tuple(seq_chunks)))


def output_block_v(V: int, gate: str = "") -> int:
    """chunk_output's value block: all of V up to 128, so q k^T is formed once per chunk
    (up to 64 with the value gate: its f32 gate tile and level operands take the shared
    memory, 168 KB at K = 256, block 64)."""
    for bv in (128, 64, 32, 16) if gate != "value" else (64, 32, 16):
        if V % bv == 0:
            return bv
    raise ValueError(f"V={V} must be a multiple of 16")


def fuse_output(n_chains: int, dtype: str, K: int) -> bool:
    table = FUSE_MIN_CHAINS_SMALL_K if K <= 64 else {}
    return n_chains >= (table.get(dtype) or FUSE_MIN_CHAINS.get(dtype, FUSE_MIN_CHAINS_DEFAULT))


def key_prepare(p: ForwardProblem, config: dict) -> dict:
    """chunk_prepare_key's tuning for p: KEY_PREPARE by rule (the additive rule's
    KEY_PREPARE_WIDE below one CTA an SM or at K > 128), or a probe's key_diag /
    key_block_k / key_threads / key_min_ctas."""
    wide = p.rule_kind == "additive" and (p.NT * p.HV < hw.NUM_SMS or p.K > 128)
    base = KEY_PREPARE_WIDE if wide else KEY_PREPARE[p.rule_kind]
    forced = {"diag": config.get("key_diag"), "block_k": config.get("key_block_k"),
              "threads": config.get("key_threads"), "min_ctas": config.get("key_min_ctas")}
    return dict(base, **{k: v for k, v in forced.items() if v is not None})


def _prepare(p: ForwardProblem, order: dict, config: dict) -> tuple:
    """(launches, buffers, bind for the state / output stages) of the prepare step."""
    C, key = p.chunk_size, p.gate == "key"
    common = dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype)
    flags = dict(g_dtype=p.g_dtype if p.gate != "none" else "float32",
                 beta_dtype=p.beta_dtype if p.rule_kind == "delta" else "float32",
                 l2norm_qk=p.l2norm_qk, beta_sigmoid=p.beta_sigmoid,
                 allow_neg_eigval=p.allow_neg_eigval, gate_in_kernel=p.gate_in_kernel)
    delta = p.rule_kind == "delta"
    bufs = [Buffer("w", (p.Ttot if delta else 1, p.HV, p.K), "input")]   # (additive: unused)
    if p.gate == "value":
        return _value_prepare(p, bufs, dict(common, **flags, **order))
    bufs += [Buffer("u", (p.Ttot, p.HV, p.V), "input")] if delta else []
    if key and p.states_only and not delta:     # (what the state pass reads: kg, g_last)
        bufs += [Buffer("kg", (p.Ttot, p.HV, p.K), "input"), Buffer("g_last", (p.NT, p.HV, p.K))]
        prep = launch("chunk_prepare_states", dict(common, **flags, **order, **key_prepare(p, config)),
                      u="v")
        return [prep], bufs, dict(k="kg", g_cum="g_last", u="v")
    if key:
        bufs += [Buffer("aqk", (p.Ttot, p.HV, C), "input"), Buffer("qg", (p.Ttot, p.HV, p.K), "input"),
                 Buffer("kg", (p.Ttot, p.HV, p.K), "input"), Buffer("g_last", (p.NT, p.HV, p.K))]
        keep_a = "A" in saved_names(p)       # (training: the backward rebuilds from A, A_qk)
        bufs += [Buffer("A", (p.Ttot, p.HV, C), "input")] if keep_a else []
        prep = launch("chunk_prepare_save" if keep_a else "chunk_prepare",
                      dict(common, **flags, **order, **key_prepare(p, config),
                           **dict(p.rule_dtypes)),
                      **({} if delta else {"u": "v"}), **({"A_out": "A"} if keep_a else {}))
        return [prep], bufs, dict(k="kg", g_cum="g_last", u="u" if delta else "v", q="qg",
                                  aqk="aqk")
    bind = dict(u="u" if delta else "v", k="kn" if p.l2norm_qk else "k")
    if delta:
        bufs += prepare_buffers(p)
        wu = dict(common, block_n=wu_block_n(p.K, p.V), beta_dtype=p.beta_dtype, **order)
        erase = (p.erase_key + ("n" if p.l2norm_qk else "_in")) if p.erase_key else bind["k"]
        return [kkt_launch(p), launch("chunk_wu", wu, k=erase)], bufs, bind
    gated = p.gate == "scalar"
    bufs += [Buffer("g_cum", (p.HV, p.NT * C) if gated else (p.Ttot, p.HV))]
    if p.l2norm_qk:
        bufs += [Buffer("kn", (p.Ttot, p.H, p.K), "input")]
    if "value_scale" in p.terms:
        bufs += [Buffer("dt_c", (p.HV, p.NT * C))]
    if not (gated or p.l2norm_qk):
        return [], bufs, bind
    prep = launch("chunk_prepare", dict(common, **flags, **order,
                                        **terms_params(p, PREPARE_TERMS)),
                  u="v", kn=bind["k"])
    return [prep], bufs, bind


def terms_params(p: ForwardProblem, stage_terms: tuple) -> dict:
    """The build() flags of the call terms p's stage forms (stage_terms: *_TERMS)."""
    return {t: True for t in stage_terms if t in p.terms}


def with_term_placeholders(p: ForwardProblem, launches: list, bufs: list) -> tuple:
    """(launches, buffers) with each launch's unread call-term tensors (TERM_TENSORS)
    bound to term_none, a [1] f32 buffer, where the call has terms."""
    if not p.terms:
        return launches, bufs
    out = []
    for la in launches:
        off = {t: "term_none" for t, f in TERM_TENSORS.items()
               if f in p.terms and not la.kwargs.get(f)}
        out.append(dataclasses.replace(la, bind=tuple(sorted(dict(la.bind, **off).items()))))
    return out, bufs + [Buffer("term_none", (1,))]


def check_terms(p: ForwardProblem) -> None:
    """ValueError unless the chunked stages form p's call terms: the additive rule's,
    its per-chunk states not kept for a backward (which reads no terms); a recompute of
    the states (states_only: no output) forms the step and the value scale alone."""
    if p.terms and (p.rule != "additive" or p.save_states):
        raise ValueError(f"call terms {list(p.terms)}: the chunked forward forms them in the "
                         "additive rule's forward alone (no training forward's states)")
    extra = set(p.terms) - set(PREPARE_TERMS + STATE_TERMS)
    if p.states_only and extra:
        raise ValueError(f"call terms {sorted(extra)}: a recompute of the states forms the "
                         "step and the value scale alone (it has no output)")


def state_threads(p: ForwardProblem, choice, config: dict) -> int:
    """The fused additive state pass's threads: FUSED_STATE_THREADS where it reads A_qk
    per key head (aqk_per_key_head) at a tile of min_tile or more on an arch with
    warpgroups (sm80 keeps 128), else 128; or config's state_threads."""
    if "state_threads" in config:
        if config["state_threads"] not in (128, 256):
            raise ValueError(f"plan config state_threads={config['state_threads']!r}: 128 "
                             "or 256")
        return config["state_threads"]
    wide = ("warpgroups" in hw.FEATURES and choice.fused and aqk_per_key_head(p, config)
            and choice.block_k * choice.block_v >= FUSED_STATE_THREADS["min_tile"])
    return FUSED_STATE_THREADS["threads"] if wide else 128


def aqk_per_key_head(p: ForwardProblem, config: dict) -> bool:
    """Whether the fused pass reads A_qk per key head (AQK_PER_KEY_HEAD: the additive
    rule with no or a scalar gate under GVA), or config's aqk_per_key_head."""
    able = p.rule == "additive" and p.gate in ("none", "scalar") and p.HV > p.H
    if "aqk_per_key_head" in config:
        if config["aqk_per_key_head"] and not able:
            raise ValueError("plan config aqk_per_key_head: the additive rule with no or a "
                             "scalar gate and more value heads than key heads only")
        return bool(config["aqk_per_key_head"])
    return AQK_PER_KEY_HEAD and able


def _value_prepare(p: ForwardProblem, bufs: list, params: dict) -> tuple:
    """The value gate's prepare: g_cum (the cumsum per value channel, read by the output),
    g_last and vg = v e^(g_last - g_cum) (read by the state pass), kn with l2norm_qk."""
    k = "kn" if p.l2norm_qk else "k"
    bufs = bufs + [Buffer("g_cum", (p.Ttot, p.HV, p.V)), Buffer("g_last", (p.NT, p.HV, p.V)),
                   Buffer("vg", (p.Ttot, p.HV, p.V), "input")]
    if p.l2norm_qk:
        bufs.append(Buffer("kn", (p.Ttot, p.H, p.K), "input"))
    prep = launch("chunk_prepare", params, u="vg", kn=k)
    return [prep], bufs, dict(u="vg", k=k, g_cum="g_last")


def stage_plan(p: ForwardProblem, config: dict) -> Plan:
    """The fused or three-stage plan of p (config may force "fused"; for the additive
    rule also the sequence split, key and value blocks: additive.choose)."""
    check_terms(p)
    if p.K % STATE_K_MULTIPLE:
        raise ValueError(f"K={p.K}: the chunked state pass takes K a multiple of "
                         f"{STATE_K_MULTIPLE} (this rule and gate; ops.chunk pads other K: arch.chunk_k)")
    many = p.NT > hw.MAX_GRID_YZ
    if many and p.return_states:
        raise ValueError(f"{p.NT} chunks: the per-chunk states of more than {hw.MAX_GRID_YZ} "
                         "chunks in one call are not supported")
    forms = [config["fused"]] if "fused" in config else [True, False]
    if p.states_only and not (p.return_states and p.rule_kind == "additive"):
        raise ValueError("states_only: the additive rule's recompute of its states "
                         "(return_states) alone")
    if p.save_states or p.states_only or (p.rule_kind == "delta"
                                          and (p.return_states or p.gate != "key")):
        forms = [False]         # (the delta rule's fused path is the walk; its fused state
                                # pass writes no per-chunk states, the additive rule's only
                                # in f32; save_states' h is chunk_state's buffer)
    if p.gate == "value":       # (its output is chunk_output's)
        if config.get("fused"):
            raise ValueError("plan config fused=True: the value gate has no fused state + "
                             "output pass (yet)")
        forms = [False]
    if many:                    # (chunk_output's grid has the chunks on gridDim.y)
        forms = [f for f in forms if f]
    if not forms:
        raise ValueError(f"{p.NT} chunks: the three-stage pipeline takes at most "
                         f"{hw.MAX_GRID_YZ} chunks in one call")
    if p.rule_kind == "additive":
        choice = additive.choose(p, config, output_block_v(p.V, p.gate), forms)
    else:
        fused = (fuse_output(p.N * p.HV, p.dtype, p.K) or many) if len(forms) > 1 else forms[0]
        bv = state_block_v(p.V, p.N * p.HV, p.seq_chunks)
        if fused and not many and len(forms) > 1 and p.K * bv > (hw.FUSED_MAX_TILE or p.K * bv):
            fused = False           # (the arch's fused state pass takes smaller tiles)
        choice = additive.StateChoice(0, p.K, bv, fused)
    order = {} if many else {"heads_fastest": True}
    launches, bufs, bind = _prepare(p, order, config)
    common = dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype)
    state = dict(common, state_v_first=p.state_v_first, has_initial_state=p.has_initial_state,
                 output_final_state=p.output_final_state or p.return_states,
                 block_v=choice.block_v, num_stages=state_stages(p, choice.fused))
    if p.return_states:
        state["states_out"] = True
    sbind = {a: bind[a] for a in ("k", "u", "g_cum") if a in bind}
    if p.rule_kind == "additive":
        s_launches, s_bufs, s_bind = _additive_pieces(p, choice, sbind)
        launches, bufs = launches + s_launches, bufs + s_bufs
        state.update(block_k=choice.block_k, segment_starts=bool(choice.segments))
        sbind.update(s_bind)
        threads = state_threads(p, choice, config)
        state.update({"threads": threads} if threads != 128 else {})
    per_key = aqk_per_key_head(p, config)
    if choice.fused:
        if p.gate != "key":
            qk, qk_bufs, bind = _qk(p, per_key, order, bind)
            launches, bufs = launches + [qk], bufs + qk_bufs
            state.update(q_gated=False, **({"aqk_per_key_head": True} if per_key else {}))
        launches.append(launch("chunk_state_output", dict(state, **terms_params(p, OUTPUT_TERMS)),
                               **sbind, qg=bind["q"], aqk=bind["aqk"]))
    else:
        bufs += [Buffer("h", (1 if p.states_only else p.NT, p.HV, p.K, p.V), "input")]
        if p.rule_kind == "delta":
            bufs += [Buffer("v_new", (p.Ttot, p.HV, p.V), "input")]
        if p.states_only:       # (a training recompute: its states in the input dtype)
            state.update(h_out=False, ht_dtype=p.dtype)
        launches.append(launch("chunk_state", dict(state, **terms_params(p, STATE_TERMS)), **sbind,
                               **({} if p.rule_kind == "delta" else {"v_new": "v"})))
    if not (choice.fused or p.states_only):
        out = dict(common, l2norm_qk=p.l2norm_qk, block_v=output_block_v(p.V, p.gate), **order,
                   **terms_params(p, OUTPUT_TERMS))
        g_out = "g_cum" if p.gate == "value" else bind.get("g_cum", "g_cum")
        launches.append(launch("chunk_output", out, q=bind.get("q", "q"),
                               k=bind.get("aqk", bind["k"]), g_cum=g_out,
                               **({} if p.rule_kind == "delta" else {"v_new": "v"})))
    launches, bufs = with_term_placeholders(p, launches, bufs)
    name = ("fused" if choice.fused else "three-stage") + ("-split" if choice.segments else "")
    return Plan(name, NAME, tuple(launches), tuple(bufs), choice.segments,
                reasons=(_why(p, choice, config),), saved=saved_names(p))


def _qk(p: ForwardProblem, per_key: bool, order: dict, bind: dict) -> tuple:
    """(chunk_qk's launch, its buffers, the bindings after it) for the fused pass's A_qk:
    per value head, or per key head undecayed (per_key: aqk_per_key_head)."""
    bufs = [Buffer("aqk", (p.Ttot, p.H if per_key else p.HV, p.chunk_size), "input")]
    if p.l2norm_qk:
        bufs.append(Buffer("qn", (p.Ttot, p.H, p.K), "input"))
    qk = dict(H=p.H, HV=p.HV, K=p.K, dtype=p.dtype, l2norm_qk=p.l2norm_qk, **order,
              q_out="normed" if p.l2norm_qk else "none",
              **({"per_key_head": True} if per_key else {}))
    q = "qn" if p.l2norm_qk else "q"
    return launch("chunk_qk", qk, k=bind["k"], qg=q), bufs, dict(bind, q=q, aqk="aqk")


def _additive_pieces(p: ForwardProblem, choice, sbind: dict) -> tuple:
    """(launches, buffers, state-pass bindings) of the pieces the additive rule's state
    pass walks: whole sequences, or segments after chunk_state_summary."""
    state = (1, p.HV, p.K, p.V)
    decay = (p.HV, p.V if p.gate == "value" else p.K)     # (per value / key channel)
    if not choice.segments:
        return [], [Buffer("seg_none", state), Buffer("decay_none", (1,) + decay)], dict(
            seg_seq="final_row", seg_first="final_row", seg_state="seg_none",
            seg_decay="decay_none")
    ns = n_segments(p.seq_chunks, choice.segments)
    tables = dict(cu_seqlens="seg_cu", chunk_offsets="seg_c0")
    summary = launch("chunk_state_summary", dict(
        H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype, block_k=choice.summary_block_k,
        block_v=choice.summary_block_v, num_stages=STATE_STAGES,
        **terms_params(p, STATE_TERMS)), **sbind, **tables)
    # (it summarises map_seg's segments: all but each sequence's last)
    bufs = [Buffer("seg_state", (ns,) + state[1:]), Buffer("seg_decay", (ns,) + decay)]
    return [summary], bufs, dict(tables, final_row="seg_final_row")


def _why(p: ForwardProblem, choice, config: dict) -> str:
    """The plan's reason line."""
    if p.rule_kind != "additive":
        return ("the per-chunk states are asked for" if p.return_states
                else f"{p.N * p.HV} chains: " + ("o inside the state pass" if choice.fused
                                                 else "the state pass alone is the critical path"))
    what = (f"segments of {choice.segments} chunks (summaries at block "
            f"{choice.summary_block_k} x {choice.summary_block_v}), " if choice.segments
            else "whole sequences, ")
    how = ("o inside the state pass" if choice.fused else "the states alone" if p.states_only
           else "h per chunk, then chunk_output")
    how += (", every chunk's state" + (" in the input dtype" if p.states_only else " in f32")
            if p.return_states else "")
    model = f"config {config}" if config else f"models fastest: {choice.us:.0f} us"
    return (f"{p.N * p.HV} chains, additive rule: {what}state tile {choice.block_k} x "
            f"{choice.block_v}, {how} ({model})")
