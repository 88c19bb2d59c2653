"""Ampere / Ada's hardware facts (sm_80: A100; the same code serves sm_86 and sm_89, the
capabilities 8.x) and the placement model the plans' cost rules share: CTAs of one
kernel, one per SM, each starting as an SM frees up.

The numbers are the A100's (108 SMs, 164 KB of shared memory an SM, 163 KB a CTA). An
RTX 30xx / A6000 (8.6) or L40S / RTX 4090 (8.9) has 99 KB a CTA: the default forward
plans fit (80 KB at most), the delta rule's backward does not (BACKWARD_SMEM_BYTES:
training refused there); their own numbers would be a module like this one.
"""
from __future__ import annotations

from .. import placement

NAME = "sm80"
LABEL = "Ampere / Ada"
TARGET = {"kind": "cuda", "arch": "sm_80"}
CAPABILITIES = ((8,),)          # every 8.x device (matched as (major,) prefix): 8.0, 8.6, 8.9
#: the SMs its code runs on (the sm_80 cubin; CI compiles the CUDA for each with ptxas)
COMPILE_TARGETS = ("sm_80", "sm_86", "sm_89")
NUM_SMS = 108                   # A100
MAX_GRID_YZ = 65535             # CUDA's limit on gridDim.y and gridDim.z (x: 2^31 - 1)
SMEM_BYTES = 163 * 1024         # dynamic shared memory a CTA may use (A100)
SMEM_PER_SM = 164 * 1024        # shared memory of one SM (its CTAs' claims, 1 KB each more)
#: the training backward's shared memory a CTA (bytes; its largest stage, default plans at
#: K = V = 128 bf16, sm_80 lowering) by (rule, gate): ops.runtime.check_training refuses
#: training on a device that gives a CTA less. The delta rule's exceed an 8.6 / 8.9 card's
#: 99 KB (DeltaNet's chunk_bwd_wy 104.2 KB, Gated DeltaNet's chunk_bwd_dqkw 153.8 KB) and
#: KDA's the A100's 163 KB (chunk_bwd_dqkw 176.5 KB: its sm80 tiles are not written yet);
#: the additive rule's fit both (GLA's chunk_bwd_dqkvg 96 KB; linear attention, simple GLA,
#: retention 64.5 KB; a value gate trains as its key twin). The forward's: 80 KB at most.
BACKWARD_SMEM_BYTES = {("delta", "none"): 106752, ("delta", "scalar"): 157440,
                       ("delta", "key"): 180736, ("additive", "none"): 65536,
                       ("additive", "scalar"): 66048, ("additive", "key"): 98304,
                       ("additive", "value"): 98304}
#: beyond mma.sync / cp.async: nothing (no wgmma, TMA, setmaxnreg or warpgroup roles); the
#: stages requiring them (the delta rule's walk) are not generated, their templates' pieces
#: take this arch's form (templates/arch/sm80.py.jinja)
FEATURES = frozenset()
#: the deepest T.Pipelined loop of dynamic length the templates emit
#: (templates/arch/sm80.py.jinja pipeline_stages): TileLang 0.1.15 lowers such a cp.async
#: pipeline of 2+ stages with several copies into cp.async.wait_group(7 - c * 4), a wait
#: count depending on the loop index ("Downcast from tirx.Sub to ir.IntImm failed" at
#: sm_80 codegen: chunk_state, chunk_state_summary / _output, chunk_bwd_dstate_walk /
#: _scan). 1: a step's loads, then its compute, no prefetch (the plans' num_stages stay
#: sm90's, the kernels take the smaller). Loops of static length (chunk_bwd_dqkvg's value
#: blocks) and chunk_bwd_dh's (its copies compile at 2) keep theirs.
MAX_PIPELINE_STAGES = 1
#: the delta backward's stage knobs beyond the templates' defaults (backward.py
#: delta_backward_params): chunk_bwd_wy in two warpgroups' threads, its mma.sync
#: fragments at 128 threads spilled (sm_80 ptxas, K = V = 128 bf16: 255 registers, 8 bytes
#: spilled; 256 threads: 234, none)
DELTA_BACKWARD_TUNING = {"chunk_bwd_wy": {"threads": 256}, "chunk_bwd_dh": {"threads": 256}}
#: (chunk_bwd_dh too: GDN's at 128 threads spilled 16 bytes at 255 registers; 256: 180, none)
#: the additive rule's fused state + output pass: its largest state tile (elements); its
#: mma.sync fragments at 128 x 64 spilled (sm_80 ptxas, GLA K = V = 128 bf16: 255
#: registers, 16 bytes; 128 x 32: 234, none); the delta rule's (KDA) fused pass spilled
#: 64 bytes at 128 x 32: above this tile it takes the three-stage pipeline (stages.py)
FUSED_MAX_TILE = 128 * 32
#: chunk_bwd_dqkvg two CTAs an SM (its registers capped at 128): not on sm80, where its
#: mma.sync fragments spilled under the cap (linear attention K = V = 128: 8 bytes)
DQKVG_TWO_CTAS = False


def makespan(durations: tuple, sms: int = NUM_SMS) -> float:
    """Finish time of CTAs (durations, in launch order) placed one per SM as SMs free up."""
    return placement.makespan(durations, sms)
