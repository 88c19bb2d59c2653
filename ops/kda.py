"""Kimi Delta Attention: the delta rule with a log decay per key channel."""
from ..dsl import OpSpec
from . import api
from .gates import check_safe_gate

SPEC = OpSpec(
    name="kda", rule="delta", gate="key", chunk_size=64,
    supports=frozenset({"l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
                        "state_v_first"}),
    doc="KDA: S <- diag(exp(g)) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).",
)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, A_log=None,
              dt_bias=None, **kwargs):
    """fla's chunk_kda (forward). T == 1 takes the decode kernel.

    q, k [B, T, H, K]; v [B, T, HV, V], f16 / bf16 / f32 (f32, and K not a
    multiple of 64: the recurrent kernel); g [B, T, HV, K] natural-log decay per key channel (raw with
    use_gate_in_kernel: -exp(A_log) * softplus(g + dt_bias), or with ``lower_bound``
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), A_log optional then); A_log with
    HV elements, dt_bias [HV * K] / [HV, K] or None; beta [B, T, HV]. initial_state
    [N, HV, K, V] ([N, HV, V, K] with state_v_first), any float dtype, read as f32.
    safe_gate (fla's rules checked) and disable_recompute change nothing in a forward;
    chunk_size: fla's 32 or 64, both on the chunk-64 kernels. Returns (o [B, T, HV, V],
    final_state f32 or None), and with return_intermediate_states (inference only, fla's
    h): the state entering each 64-token chunk too, in q's dtype (api.intermediate_states).

    Differentiable (ops/autograd.py) when any of q, k, v, g, beta, initial_state, A_log,
    dt_bias requires grad: gradients for all of them, from o's and final_state's (K, V up
    to 128, below 64 / 128 zero-padded to them; float16 / bfloat16 (float32 exactly in
    torch, ops/exact_train.py); the gate's activation,
    l2norm and beta's sigmoid by torch; anything the backward does not support raises
    SpecError).
    """
    check_safe_gate(safe_gate, lower_bound, use_gate_in_kernel)
    opts = api.fla_options(use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, use_gate_in_kernel, state_v_first, kwargs,
                           chunk_sizes=(32, 64), family="KDA")
    if return_intermediate_states:
        return api.intermediate_states(
            SPEC, q, k, v, g, beta, chunk_size=kwargs.get("chunk_size"), scale=scale,
            initial_state=initial_state, output_final_state=output_final_state,
            options=opts, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    from . import autograd
    if autograd.needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return autograd.train(SPEC, opts, q, k, v, g, beta, scale, initial_state,
                              output_final_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias,
                              lower_bound=lower_bound)
    return api.forward(SPEC, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                       A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, state_v_first=False, cu_seqlens=None,
                        cu_seqlens_cpu=None, ssm_state_indices=None,
                        num_accepted_tokens=None, inplace_final_state=False, **kwargs):
    """fla's fused_recurrent_kda: the token-by-token kernel for any T. Shapes as
    chunk_kda; the state pool arguments as fused_recurrent_gated_delta_rule's.
    Differentiable as chunk_kda (with gradients the call runs its training).
    """
    check_safe_gate(False, lower_bound, use_gate_in_kernel)
    opts = api.fla_options(use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, use_gate_in_kernel, state_v_first, kwargs,
                           chunk_sizes=None)
    if api.recurrent_trains(q, k, v, g, beta, initial_state, A_log, dt_bias,
                            ssm_state_indices=ssm_state_indices,
                            num_accepted_tokens=num_accepted_tokens,
                            inplace_final_state=inplace_final_state):
        from . import autograd
        return autograd.train(SPEC, opts, q, k, v, g, beta, scale, initial_state,
                              output_final_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias,
                              lower_bound=lower_bound)
    return api.recurrent(SPEC, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=opts,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                         ssm_state_indices=ssm_state_indices,
                         num_accepted_tokens=num_accepted_tokens,
                         inplace_final_state=inplace_final_state)


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
                            scale=None, output_final_state=False, inplace_final_state=True,
                            state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                            num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                            allow_neg_eigval=False, lower_bound=None, out=None, **kwargs):
    """fla's fused_recurrent_kda_fwd (the serving entry vLLM calls): fused_recurrent_kda
    with fla's order and defaults (inplace_final_state=True: initial_state is the state
    pool, updated in place and returned); ``out``, a tensor of v's shape and dtype, takes
    o. Not differentiable."""
    import torch
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != getattr(v, "shape", None) or (
                out.dtype != v.dtype):
            raise api.validate.error(f"out must be a tensor of v's shape and dtype, got "
                                     f"{api.validate.describe(out)}")
    with torch.no_grad():
        o, ht = fused_recurrent_kda(
            q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, lower_bound, state_v_first, cu_seqlens,
            ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
            inplace_final_state=inplace_final_state, **kwargs)
    return (o if out is None else out.copy_(o)), ht
