"""Kimi Delta Attention: the delta rule with a log decay per key channel."""
from ..dsl import OpSpec
from . import api

SPEC = OpSpec(
    name="kda", rule="delta", gate="key", chunk_size=64,
    supports=frozenset({"l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
                        "state_v_first"}),
    doc="KDA: S <- diag(exp(g)) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).",
)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None, A_log=None, dt_bias=None, **kwargs):
    """fla's chunk_kda (forward). T == 1 takes the decode kernel.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] natural-log decay per key channel
    (raw with A_log [HV], dt_bias [HV * K] when use_gate_in_kernel); beta [B, T, HV].
    initial_state f32 [N, HV, K, V] ([N, HV, V, K] with state_v_first).
    Returns (o [B, T, HV, V], final_state f32 or None). safe_gate / lower_bound are not
    supported.
    """
    opts = api.options_from_fla(use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                allow_neg_eigval, use_gate_in_kernel, state_v_first, kwargs)
    return api.forward(SPEC, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                       A_log=A_log, dt_bias=dt_bias)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """fla's fused_recurrent_kda: the token-by-token kernel for any T. Shapes as chunk_kda."""
    opts = api.options_from_fla(use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                allow_neg_eigval, use_gate_in_kernel, state_v_first, kwargs)
    return api.fused_recurrent(SPEC, q, k, v, g, beta, scale=scale,
                               initial_state=initial_state,
                               output_final_state=output_final_state, options=opts,
                               cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
