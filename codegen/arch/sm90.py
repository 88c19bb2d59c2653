"""Hopper (sm_90a: H100 / H200): compile target and per-stage tuning.

Tuning is a function of the static problem (head dims, dtypes), never of the data; the
problem itself (sizes, dtypes, flags) is passed to build() separately.
"""
from __future__ import annotations

NAME = "sm90"
TARGET = {"kind": "cuda", "arch": "sm_90a"}
CAPABILITIES = ((9,),)          # every 9.x device (matched as (major,) prefix)
NUM_SMS = 132                   # H100 SXM / H200


def _recurrent(problem: dict) -> dict:
    """State tile K x block_v in fp32 registers, one value block per CTA.

    Decode reads and writes the fp32 state once, so the grid must cover the GPU:
    small value blocks give more CTAs (B * HV * V / block_v) and fewer registers.
    """
    K, V = problem["K"], problem["V"]
    block_v = min(V, 16 if K > 128 else 32)
    return {"block_v": block_v, "threads": 128}


#: stage name -> tuning function(problem dict) -> dict of build() tuning knobs
TUNING = {
    "recurrent": _recurrent,
}


def tuning(stage: str, problem: dict) -> dict:
    """Tuning knobs for ``stage`` at ``problem`` ({} where the template's defaults stand)."""
    fn = TUNING.get(stage)
    return fn(problem) if fn else {}
