"""linattn: linear attention kernels generated from specs.

Public functions follow flash-linear-attention's signatures::

    import linattn
    o, ht = linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta,
                                                     output_final_state=True)
"""
__version__ = "0.1.0"

from .dsl import Gate, OpSpec, Options, Rule, SpecError  # noqa: F401
