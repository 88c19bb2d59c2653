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
