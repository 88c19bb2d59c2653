"""GDN-2 (Gated DeltaNet 2): the delta rule with a per-key-channel erase gate b and a
per-value-channel write gate w, and KDA's per-key decay (fla's chunk_gdn2 /
fused_recurrent_gdn2)."""
from ..dsl import OpSpec
from . import api
from .gates import check_safe_gate

SPEC = OpSpec(
    name="gdn2", rule="gdn2", gate="key", chunk_size=64,
    supports=frozenset({"l2norm_qk", "gate_in_kernel", "state_v_first"}),
    doc="GDN-2: S <- (I - k (b . k)^T) diag(exp(g)) S + k (w . v)^T; o = S^T (scale q).",
)


def chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None,
               cu_seqlens_cpu=None, safe_gate=False, lower_bound=None,
               disable_recompute=False, return_intermediate_states=False,
               state_v_first=False, A_log=None, dt_bias=None, **kwargs):
    """fla's chunk_gdn2: S_t = (I - k_t (b_t . k_t)^T) diag(exp(g_t)) S_{t-1} +
    k_t (w_t . v_t)^T, o_t = S_t^T (scale q_t).

    q, k [B, T, H, K]; v [B, T, HV, V] (HV % H == 0), f16 / bf16 / f32; g [B, T, HV, K]
    natural-log decay per key channel (raw with use_gate_in_kernel: -exp(A_log) *
    softplus(g + dt_bias), or with ``lower_bound`` lower_bound * sigmoid(exp(A_log) *
    (g + dt_bias)), A_log optional then); b [B, T, HV, K] the erase gate, w [B, T, HV, V]
    the write gate, any float dtype (read as f32). initial_state [N, HV, K, V] ([N, HV,
    V, K] with state_v_first), read as f32; N = B, or len(cu_seqlens) - 1 (then B == 1).
    safe_gate (fla's rules checked) and disable_recompute change nothing in a forward;
    chunk_size: 64 (fla's only value). Returns (o [B, T, HV, V] in q's dtype,
    final_state f32 or None).

    Runs the chunked kernels (the per-key gate's prepare with b . k as the erase vector
    and w . v as the written value, then KDA's state and output stages) where they take
    the call (ops/api.py choose_path: T > 1, f16 / bf16, K <= 256, V a multiple of 16 up
    to 256), the recurrent kernel otherwise. A 16-bit call that needs gradients (K, V up
    to 128) trains through the generated backward (ops/autograd.py: KDA's per-key stages
    with b . k as the erase vector and w . v as the written value; db, dw too); float32
    and wider heads train exactly in torch (ops/exact_train.py). return_intermediate_states=True
    (inference only) also returns fla's h, the state entering each 64-token chunk
    (:func:`_intermediate_states`).
    """
    check_safe_gate(safe_gate, lower_bound, use_gate_in_kernel)
    opts = api.fla_options(use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                           state_v_first=state_v_first, kwargs=kwargs, chunk_sizes=(64,),
                           family="GDN-2")
    if return_intermediate_states:
        return _intermediate_states(opts, q, k, v, g, b, w, scale, initial_state,
                                    output_final_state, cu_seqlens, cu_seqlens_cpu, A_log,
                                    dt_bias, lower_bound)
    return api.forward(SPEC, q, k, v, g, None, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log,
                       dt_bias=dt_bias, lower_bound=lower_bound, rule_inputs={"b": b, "w": w})


def _intermediate_states(opts, q, k, v, g, b, w, scale, initial_state, output_final_state,
                         cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, lower_bound):
    """fla's return_intermediate_states=True: (o, final_state or None, h), h the state
    entering each 64-token chunk in q's dtype, [B, NT, HV, K, V] ([.., V, K] with
    state_v_first; [1, NT_total, ...] with cu_seqlens): the call checked, then run chunk by
    chunk from each entering state (api.states_by_chunks). Inference only."""
    api.refuse_states_grad(q, k, v, g, b, w, initial_state, A_log, dt_bias)
    d = api.validate.check_call(
        SPEC, opts, q, k, v, g, None, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        scale=scale, values=api.validate.host_checks(), rule_inputs={"b": b, "w": w}).dims
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=opts.l2norm_qk, A_log=A_log,
              use_gate_in_kernel=opts.gate_in_kernel, lower_bound=lower_bound,
              dt_bias=dt_bias, state_v_first=opts.state_v_first)

    def call(q, k, v, g, b, w, initial_state, output_final_state):
        return chunk_gdn2(q, k, v, g, b, w, initial_state=initial_state,
                          output_final_state=output_final_state, **kw)
    o, final, h = api.states_by_chunks(
        call, dict(q=q, k=k, v=v, g=g, b=b, w=w), initial_state=initial_state,
        cu_seqlens=cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu,
        state_shape=(d.HV, d.V, d.K) if opts.state_v_first else (d.HV, d.K, d.V))
    return o, (final if output_final_state else None), h


def fused_recurrent_gdn2(q, k, v, g, b, w, A_log=None, dt_bias=None, scale=None,
                         initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                         lower_bound=None, state_v_first=False, cu_seqlens=None,
                         cu_seqlens_cpu=None, ssm_state_indices=None,
                         num_accepted_tokens=None, inplace_final_state=False, **kwargs):
    """fla's fused_recurrent_gdn2: the token-by-token kernel for any T. Shapes as
    chunk_gdn2; the state pool arguments (``ssm_state_indices``, ``num_accepted_tokens``,
    ``inplace_final_state``) as fused_recurrent_gated_delta_rule's. Not differentiable
    (fla's is inference-only)."""
    check_safe_gate(False, lower_bound, use_gate_in_kernel)
    opts = api.fla_options(use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                           state_v_first=state_v_first, kwargs=kwargs, chunk_sizes=None)
    return api.recurrent(SPEC, q, k, v, g, None, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=opts,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log,
                         dt_bias=dt_bias, lower_bound=lower_bound,
                         ssm_state_indices=ssm_state_indices,
                         num_accepted_tokens=num_accepted_tokens,
                         inplace_final_state=inplace_final_state,
                         rule_inputs={"b": b, "w": w})
