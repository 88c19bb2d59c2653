"""linattn: linear attention kernels generated from specs.

Public functions follow flash-linear-attention's signatures::

    import linattn
    o, ht = linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta,
                                                     output_final_state=True)

A variant of your own is an :class:`OpSpec` anywhere (README, "Add a variant")::

    ops = linattn.build(linattn.OpSpec(name="simple_gla_user", rule="additive",
                                       gate="scalar"))
    o, ht = ops.chunk(q, k, v, g, output_final_state=True)
"""
__version__ = "0.1.0"

# Absolute imports: test runners import this file by path under the checkout folder's
# name (pytest sets up the repository root as a package), where relative imports fail.

from linattn.dsl import Gate, OpSpec, Options, Rule, SpecError  # noqa: F401
from linattn.ops.build import Ops, build  # noqa: F401
from linattn.ops.deltanet import chunk_delta_rule, fused_recurrent_delta_rule  # noqa: F401
from linattn.ops.gdn import (chunk_gated_delta_rule, chunk_gdn,  # noqa: F401
                      fused_recurrent_gated_delta_rule, fused_recurrent_gdn)
from linattn.ops.gates import fused_gdn_gate, fused_kda_gate  # noqa: F401
from linattn.ops.gla import chunk_gla, fused_recurrent_gla  # noqa: F401
from linattn.ops.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: F401
from linattn.ops.linear_attn import (chunk_linear_attn, fused_chunk_linear_attn,  # noqa: F401
                                    fused_recurrent_linear_attn)
from linattn.ops.retention import (chunk_retention, fused_chunk_retention,  # noqa: F401
                                  fused_recurrent_retention, parallel_retention)
from linattn.ops.simple_gla import (chunk_simple_gla, fused_chunk_simple_gla,  # noqa: F401
                                   fused_recurrent_simple_gla, parallel_simple_gla)
from linattn.ops.mamba2 import mamba_chunk_scan_combined, selective_state_update  # noqa: F401
from linattn.ops.lightning import (chunk_lightning_attn,  # noqa: F401
                                  fused_recurrent_lightning_attn)
from linattn.ops import library as _library

_library.register_all()     # torch.ops.linattn.<path>_<op>: see ops/library.py
from linattn.ops.comba import chunk_comba, fused_recurrent_comba  # noqa: F401,E402
from linattn.ops.gdn2 import chunk_gdn2, fused_recurrent_gdn2  # noqa: F401,E402
from linattn.ops.dplr import (chunk_dplr_delta_rule, chunk_rwkv7,  # noqa: F401,E402
                              fused_mul_recurrent_rwkv7, fused_recurrent_dplr_delta_rule,
                              fused_recurrent_rwkv7)
from linattn.ops.iplr import chunk_iplr_delta_rule, fused_recurrent_iplr_delta_rule  # noqa: F401,E402
