"""The dplr rule's chunked forward (DPLR, IPLR, RWKV-7): chunk_prepare_dplr per (chunk,
value head), then chunk_state_dplr walking each (sequence, value head)'s chunks
(torch_reference._dplr_chunks; docs/design.md "DPLR's chunked form").

The public chunk_* calls (ops/dplr.py) take it where it fits (dplr_fits), for
inference; checked against fp64 on an H100 (tests/test_chunk_dplr_gpu.py, run s38-2).
"""
from __future__ import annotations

from ...pipeline import Buffer, ForwardProblem, Plan, launch
from . import hardware as hw
from .hardware import NAME

#: the prepare holds all of K in shared memory (184 KB at K = V = 128; sm_90a compile)
DPLR_MAX_K = 128
#: V: the state pass's value blocks and the prepare's u panels are 64 or 32 wide
DPLR_MAX_V = 256
DPLR_V_MULTIPLE = 32
#: the state pass's TMA stages (K = 128, BV = 64: 226 KB of shared memory at 2)
DPLR_STATE_STAGES = 2
#: the prepare's threads (128 or 256; probe config prepare_threads). chunk_prepare_dplr is
#: one CTA an SM at 184 KB, so its warps alone hide the latency: 256 (s40-2, H100: 4k
#: 0.486 -> 0.218 ms a call at 128 -> 256). chunk_prepare_iplr (88 KB, two CTAs an SM): 128,
#: as measured (s40-2: IPLR 4k 0.31 ms, fla 0.376)
PREPARE_THREADS = {"chunk_prepare_dplr": 256, "chunk_prepare_iplr": 128}


def dplr_chunked(gate: str) -> bool:
    """Whether the public chunk_* calls of the dplr rule take the chunked kernels on this
    arch (its stages generated: Stage.requires)."""
    return "tma" in hw.FEATURES and gate in ("none", "key")


def dplr_fits(K: int, V: int, state_v_first: bool) -> bool:
    """The calls the chunked kernels take (K as the kernels run it: arch.chunk_k's)."""
    return (K % 16 == 0 and K <= DPLR_MAX_K and V % DPLR_V_MULTIPLE == 0 and V <= DPLR_MAX_V
            and not state_v_first)


def _refusal(p: ForwardProblem) -> str:
    if "tma" not in hw.FEATURES:
        return f"the dplr rule's chunked stages are sm90's (not generated for {NAME})"
    if not dplr_fits(p.K, p.V, p.state_v_first):
        return (f"K={p.K}, V={p.V}, state_v_first={p.state_v_first}: the dplr rule's chunked "
                f"forward takes K <= {DPLR_MAX_K} (multiple of 16), V a multiple of "
                f"{DPLR_V_MULTIPLE} up to {DPLR_MAX_V}, key-first states")
    if p.return_states or p.save_states or p.states_only or p.terms:
        return "the dplr rule's chunked forward: inference only (no states out, no terms)"
    return ""


def _prepare_stage(p: ForwardProblem) -> str:
    """chunk_prepare_dplr (the pairs by bisection under the decay); without a decay
    chunk_prepare_iplr (the pairs as plain GEMMs, half the shared memory; s40-2, H100:
    IPLR 4k 0.41 -> 0.31 ms, b4-4k 0.97 -> 0.58)."""
    return "chunk_prepare_iplr" if p.gate == "none" else "chunk_prepare_dplr"


def dplr_plan(p: ForwardProblem, config: dict) -> Plan:
    """prepare (w, u, qg, bg, kg [Ttot, HV, K|V], aqb, aqk [Ttot, HV, 64] in the input
    dtype, g_last [NT, HV, K] f32), then the state pass writing o and the final state."""
    why = _refusal(p)
    if why:
        raise ValueError(why)
    common = dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype)
    stage = _prepare_stage(p)
    prep = dict(common, threads=config.get("prepare_threads", PREPARE_THREADS[stage]),
                **({"g_dtype": p.g_dtype} if p.gate == "key" else {}))
    state = dict(common, has_initial_state=p.has_initial_state,
                 output_final_state=p.output_final_state,
                 block_v=64 if p.V % 64 == 0 else 32, num_stages=DPLR_STATE_STAGES)
    C = p.chunk_size
    bufs = [Buffer(n, (p.Ttot, p.HV, p.K), "input") for n in ("w", "qg", "bg", "kg")]
    bufs += [Buffer("u", (p.Ttot, p.HV, p.V), "input"),
             Buffer("aqb", (p.Ttot, p.HV, C), "input"), Buffer("aqk", (p.Ttot, p.HV, C), "input"),
             Buffer("g_last", (p.NT, p.HV, p.K), "float32")]
    launches = (launch(stage, prep, a="a_in", b="b_in"),
                launch("chunk_state_dplr", state,
                       release=("w", "u", "qg", "bg", "kg", "aqb", "aqk", "g_last")))
    return Plan("dplr-chunked", NAME, launches, tuple(bufs),
                reasons=("the dplr rule: its prepare (one inverse, four pair sums) and "
                         "state pass (r = w S + u; writes along b and k)",))


def grad_dtype(p) -> str:
    """The dtype chunk_bwd_pairs_dplr stores dq, dk, da, db in: the input dtype, the one
    the caller returns (the kernel's store rounds as the host's cast would, without an f32
    copy written and read back: 4 x 134 MB at train-4k), but f32 where the host sums each
    key head's group of value heads (HV != H). dv and dg, per value head and never
    summed, are stored in the input dtype and the gate's by their stages."""
    return "float32" if p.HV != p.H else p.dtype


def _bwd_buffers(p) -> tuple:
    """The backward's intermediates (docs/design.md "DPLR's backward"): the recompute's,
    the walk's, the per-chunk stages' (f32 gradients, but dw and dm in the input dtype)
    and the outputs per value head (dq, dk, da, db in grad_dtype's, dv in the input dtype,
    dg in the gate's)."""
    T, HV, K, V, C, NT = p.Ttot, p.HV, p.K, p.V, p.chunk_size, p.NT
    bufs = [Buffer(n, (T, HV, K), "input") for n in ("w", "qg", "bg", "kg")]
    bufs += [Buffer(n, (T, HV, C), "input") for n in ("aqb", "aqk", "xinv", "aak")]
    bufs += [Buffer("u", (T, HV, V), "input"), Buffer("g_last", (NT, HV, K), "float32"),
             Buffer("h", (NT, HV, K, V), "input", at="chunk_bwd_state_dplr"),
             Buffer("r", (T, HV, V), "input", at="chunk_bwd_state_dplr"),
             Buffer("dh", (NT, HV, K, V), "input", at="chunk_bwd_dstate_dplr"),
             Buffer("dr", (T, HV, V), "input", at="chunk_bwd_dstate_dplr"),
             Buffer("dv_direct", (T, HV, V), "float32", at="chunk_bwd_dstate_dplr")]
    # dw and dm in the input dtype: the next stage's GEMMs take them so (the same rounding
    # at the store as at the load; f32 would be 134 MB and 268 MB more written and read at
    # train-4k); dmd f32: dm's diagonals the pairs take outside their GEMMs
    bufs += [Buffer(n, (T, HV, K), "input" if n == "dw" else "float32",
                    at="chunk_bwd_dqkw_dplr") for n in ("dqg", "dw", "dbg", "dkg")]
    bufs += [Buffer("dgl", (NT, HV, K), "float32", at="chunk_bwd_dqkw_dplr"),
             Buffer("dx", (T, HV, K), "float32", at="chunk_bwd_wy_dplr"),
             Buffer("dm", (T, HV, 4 * C), "input", at="chunk_bwd_wy_dplr"),
             Buffer("dmd", (T, HV, 2), "float32", at="chunk_bwd_wy_dplr"),
             Buffer("dv", (T, HV, V), "input", at="chunk_bwd_wy_dplr", output=True)]
    bufs += [Buffer(n, (T, HV, K), grad_dtype(p), at="chunk_bwd_pairs_dplr", output=True)
             for n in ("dq", "dk", "da", "db")]
    if p.gate == "key":
        bufs.append(Buffer("dg", (T, HV, K), p.g_dtype, at="chunk_bwd_pairs_dplr",
                           output=True))
    return tuple(bufs)


def dplr_bwd_plan(p, config: dict) -> Plan:
    """The dplr rule's backward (codegen.pipeline.DplrBackwardProblem): the prepare again
    writing X and A_ak, the state pass saving h and r, the reverse walk, then per chunk
    dqkw, wy and pairs; dq, dk, da, db per value head in grad_dtype's (f32 where the host
    sums each key head's group), dv in the input dtype, dg in the gate's, dh0 f32.
    CPU-checked (tests/test_dplr_bwd.py); GPU check: tests/test_dplr_bwd_gpu.py (passed
    in runs s42-1 / s42-3 with every gradient stored f32; the 16-bit stores not yet run
    there)."""
    if "tma" not in hw.FEATURES or not dplr_fits(p.K, p.V, False):
        raise ValueError(f"the dplr rule's chunked backward: sm90, K <= {DPLR_MAX_K}, V a "
                         f"multiple of {DPLR_V_MULTIPLE} up to {DPLR_MAX_V} (K={p.K}, V={p.V})")
    common = dict(H=p.H, HV=p.HV, K=p.K, V=p.V, dtype=p.dtype)
    keyed = p.gate == "key"
    prepare = "chunk_bwd_prepare_dplr" if keyed else "chunk_bwd_prepare_iplr"
    block_v = 64 if p.V % 64 == 0 else 32
    gd = {"g_dtype": p.g_dtype} if keyed else {}
    launches = (
        launch(prepare, dict(common, threads=config.get(
            "prepare_threads", PREPARE_THREADS[prepare.replace("_bwd", "")]), **gd),
               a="a_in", b="b_in"),
        launch("chunk_bwd_state_dplr", dict(common, has_initial_state=p.has_initial_state,
                                            block_v=block_v, num_stages=DPLR_STATE_STAGES)),
        launch("chunk_bwd_dstate_dplr", dict(common, use_dht=p.use_dht, store_dh0=p.store_dh0,
                                             block_v=block_v, num_stages=DPLR_STATE_STAGES),
               release=("qg", "bg", "kg", "aqb", "aqk")),
        launch("chunk_bwd_dqkw_dplr", dict(common, block_v=block_v),
               release=("h", "dh", "g_last")),
        launch("chunk_bwd_wy_dplr", dict(common, block_v=block_v),
               release=("xinv", "aak", "w", "u", "r", "dr", "dw", "dv_direct")),
        launch("chunk_bwd_pairs_dplr", dict(common, grad_dtype=grad_dtype(p), **gd),
               a="a_in", b="b_in",
               release=("dm", "dmd", "dx", "dqg", "dbg", "dkg", "dgl")))
    return Plan("dplr-chunked-bwd", NAME, launches, _bwd_buffers(p),
                reasons=("the dplr rule's backward: the recompute (X, A_ak, h, r), the "
                         "reverse walk, then dqkw, wy and pairs per chunk",
                         f"dq, dk, da, db stored {grad_dtype(p)}: "
                         + ("the host sums each key head's group" if p.HV != p.H
                            else "the caller's dtype, no host cast")))
