"""Hopper (sm_90a: H100 / H200): compile target and per-stage tuning.

Tuning is a function of the static problem (head dims, dtypes) and, optionally, of a
call's dynamic sizes (``sizes``: e.g. {"N": 4}, to fill the GPU), never of the data; the
problem itself (sizes, dtypes, flags) is passed to build() separately.
"""
from __future__ import annotations

NAME = "sm90"
TARGET = {"kind": "cuda", "arch": "sm_90a"}
CAPABILITIES = ((9,),)          # every 9.x device (matched as (major,) prefix)
NUM_SMS = 132                   # H100 SXM / H200


def _recurrent(problem: dict, sizes: dict | None = None) -> dict:
    """State tile K x block_v in fp32 registers, 8 value columns per warp.

    Decode reads and writes the fp32 state once, so the grid must cover the GPU:
    N * HV * V / block_v CTAs of 4 * block_v threads. Each thread holds K / 4 state
    elements whatever block_v is; block_v only sets the CTA size.
    """
    V, HV = problem["V"], problem["HV"]
    block_v = next(b for b in (32, 16, 8) if V % b == 0) if V % 8 == 0 else 8
    n = (sizes or {}).get("N")
    # few sequences (small-batch decode): smaller CTAs spread the same warps over more SMs
    while n is not None and block_v > 8 and n * HV * (V // block_v) < NUM_SMS:
        block_v //= 2
    return {"block_v": block_v, "threads": 4 * block_v}


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
