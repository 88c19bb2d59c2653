"""Ampere / Ada (sm_80, serving 8.x: A100, A10 / A6000 / RTX 30xx, L4 / L40S / RTX 40xx):
mma.sync and cp.async, no TMA, wgmma, setmaxnreg or warpgroup roles (hardware.FEATURES).

The pipelines' composition is sm90's modules (forward.py, stages.py, additive.py,
backward.py, decode.py), loaded as this package's own: the package path falls back to
codegen/arch/sm90/, so their ``from . import hardware`` reads this arch's numbers
(hardware.py: SMs, shared memory, FEATURES). A module of the same name here would
override one. What differs by FEATURES: the delta rule's walk (warpgroup roles) is not
planned (forward.walk_applies; its stages are not generated, plan.Stage.requires), so
DeltaNet / GDN run the fused / three-stage pipelines (chunk_kkt_inverse, chunk_wu, the
state pass, the output); the templates' arch pieces (templates/arch/sm80.py.jinja) put
mma.sync GEMMs where sm90 issues wgmma and plain stores where it issues TMA.

Speed on Ampere / Ada cards is not measured: the tunings and cost constants are sm90's
(H200-measured), scaled only by this arch's SM count and shared memory.
"""
from __future__ import annotations

from pathlib import Path

__path__.append(str(Path(__file__).parent.parent / "sm90"))   # noqa: F821  (sm90's modules as this arch's)

from .forward import CHUNK_SIZES, CONFIG_KEYS, forward_plan, walks  # noqa: E402,F401
from .stages import chunk_head_limits  # noqa: E402,F401
from .dplr import dplr_bwd_plan, dplr_chunked, dplr_fits  # noqa: E402,F401  (the dplr rule's chunked forward: on, and the calls it takes)
from .backward import DQKVG_TERMS, additive_backward_plan, backward_dims, save_states  # noqa: E402,F401
from .backward import (DELTA_STAGES, FOLD_STAGES, delta_backward_params,  # noqa: E402,F401
                       delta_backward_plan, delta_stages, dh_config)
from .hardware import CAPABILITIES, FEATURES, NAME, NUM_SMS, SMEM_PER_SM, TARGET  # noqa: E402,F401
from .decode import (DECODE_FULL_GRID, TUNING, chunk_k, recurrent_layout_ok,  # noqa: E402,F401
                     tuning)
