"""Hopper's hardware facts (H100 SXM / H200, sm_90a) and the placement model the plans'
cost rules share: CTAs of one kernel, one per SM, each starting as an SM frees up."""
from __future__ import annotations

from .. import placement

NAME = "sm90"
LABEL = "Hopper"
TARGET = {"kind": "cuda", "arch": "sm_90a"}
CAPABILITIES = ((9,),)          # every 9.x device (matched as (major,) prefix)
COMPILE_TARGETS = ("sm_90a",)   # the SMs its code runs on
NUM_SMS = 132                   # H100 SXM / H200
MAX_GRID_YZ = 65535             # CUDA's limit on gridDim.y and gridDim.z (x: 2^31 - 1)
SMEM_BYTES = 227 * 1024         # dynamic shared memory a CTA may use
SMEM_PER_SM = 228 * 1024        # shared memory of one SM (its CTAs' claims, 1 KB each more)
#: the training backward's shared memory a CTA by (rule, gate) where a device of the arch
#: may give less (ops.runtime.check_training; unlisted: SMEM_BYTES): none, every 9.x device
#: gives SMEM_BYTES
BACKWARD_SMEM_BYTES: dict = {}
#: what the templates and plans may use beyond mma.sync / cp.async (the stage table's
#: Stage.requires, the templates' arch member templates/arch/<NAME>.py.jinja): warpgroup
#: MMAs, TMA copies, setmaxnreg and warpgroup roles (warp specialization)
FEATURES = frozenset({"wgmma", "tma", "setmaxnreg", "warpgroups"})
#: the delta backward's stage knobs beyond the templates' defaults (backward.py
#: delta_backward_params): none on sm90
DELTA_BACKWARD_TUNING: dict = {}
#: the additive rule's fused state + output pass: its largest state tile (elements), where
#: tighter than additive.MAX_TILE (None: that)
FUSED_MAX_TILE = None
#: chunk_bwd_dqkvg two CTAs an SM (128 registers) where their shared memory fits
DQKVG_TWO_CTAS = True


def makespan(durations: tuple, sms: int = NUM_SMS) -> float:
    """Finish time of CTAs (durations, in launch order) placed one per SM as SMs free up."""
    return placement.makespan(durations, sms)
