"""IPLR (fla's generalized delta rule, identity plus low rank): S <- S + b (a^T S) +
k v^T, no decay (fla's chunk_iplr_delta_rule / fused_recurrent_iplr_delta_rule)."""
from ..dsl import OpSpec
from .dplr import run

SPEC = OpSpec(
    name="iplr", rule="dplr", gate="none", chunk_size=64, supports=frozenset(),
    doc="IPLR: S <- S + b (a^T S) + k v^T; o = S^T (scale q).",
)


def chunk_iplr_delta_rule(q, k, v, a, b, scale=None, initial_state=None,
                          output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                          **kwargs):
    """fla's chunk_iplr_delta_rule: S_t = S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,
    o_t = S_t^T (scale q_t). Shapes and kernels as chunk_dplr_delta_rule (no gk); no
    backward kernels yet (a call that needs gradients trains exactly
    in torch: ops/exact_train.py)."""
    return run(SPEC, q, k, v, a, b, None, scale, initial_state, output_final_state,
               cu_seqlens, cu_seqlens_cpu, kwargs, (16, 32, 64))


def fused_recurrent_iplr_delta_rule(q, k, v, a, b, scale=None, initial_state=None,
                                    output_final_state=False, cu_seqlens=None,
                                    cu_seqlens_cpu=None, **kwargs):
    """fla's fused_recurrent_iplr_delta_rule: as chunk_iplr_delta_rule, token by token."""
    return run(SPEC, q, k, v, a, b, None, scale, initial_state, output_final_state,
               cu_seqlens, cu_seqlens_cpu, kwargs, None)
