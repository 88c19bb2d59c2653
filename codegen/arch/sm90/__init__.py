"""Hopper (sm_90a: H100 / H200): the hardware facts (hardware.py), the chunked forward's
plans (forward.py: the delta rule's walk; stages.py: the prepare / state / output
pipelines) and the decode kernel's tuning.

Tuning is a function of the static problem (head dims, dtypes) and, optionally, of a
call's dynamic sizes (``sizes``: e.g. {"N": 4}, to fill the GPU), never of the data; the
problem itself (sizes, dtypes, flags) is passed to build() separately.
"""
from __future__ import annotations

from .forward import CHUNK_SIZES, CONFIG_KEYS, forward_plan, walks  # noqa: F401  (the chunked forward's plan)
from .stages import chunk_head_limits  # noqa: F401  (the chunked forward's head dims)
from .dplr import dplr_bwd_plan, dplr_chunked, dplr_fits  # noqa: F401  (the dplr rule's chunked forward: on, and the calls it takes)
from .backward import DQKVG_TERMS, additive_backward_plan, backward_dims, save_states  # noqa: F401  (the additive rule's backward)
from .backward import (DELTA_STAGES, FOLD_STAGES, delta_backward_params,  # noqa: F401
                       delta_backward_plan, delta_stages, dh_config)  # (the delta rule's backward)
from .hardware import CAPABILITIES, FEATURES, NAME, NUM_SMS, SMEM_PER_SM, TARGET  # noqa: F401
from .decode import (DECODE_FULL_GRID, TUNING, chunk_k, recurrent_layout_ok,  # noqa: F401
                     tuning)
