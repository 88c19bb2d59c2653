"""DeltaNet: the delta rule without a gate."""
from ..dsl import OpSpec
from . import api
from .inputs import ones_beta

SPEC = OpSpec(
    name="deltanet", rule="delta", gate="none", chunk_size=64,
    supports=frozenset({"l2norm_qk", "state_v_first"}),
    doc="DeltaNet (Yang et al. 2024): S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).",
)


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                     **kwargs):
    """fla's chunk_delta_rule. T == 1 takes the decode kernel.

    q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; f16 / bf16 / f32 (f32: the
    recurrent kernel); scale default K^-0.5; initial_state [N, H, K, V] of any float
    dtype, read as f32 (N = B, or len(cu_seqlens) - 1 with B == 1); chunk_size: fla's 16,
    32 or 64, all on the chunk-64 kernels.
    Returns (o [B, T, H, V] in q's dtype, final_state f32 or None).

    Differentiable (ops/autograd.py) when any of q, k, v, beta, initial_state requires
    grad: gradients for all five, from o's and final_state's (K, V up to 128, below
    64 / 128 zero-padded to them; f16 / bf16; float32 exactly in torch,
    ops/exact_train.py; anything the backward does not support raises SpecError).
    """
    opts = api.fla_options(use_qk_l2norm_in_kernel, kwargs=kwargs, chunk_sizes=(16, 32, 64))
    from . import autograd
    if autograd.needs_grad(q, k, v, beta, initial_state):
        from . import exact_train
        if exact_train.is_float32(q) or autograd.wide_heads(q, v):
            return exact_train.train(SPEC, opts, q, k, v, None, beta, scale=scale,
                                     initial_state=initial_state,
                                     output_final_state=output_final_state,
                                     cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        autograd.check_trainable(q, k, v, beta, initial_state, opts, cu_seqlens)
        cu = None
        if cu_seqlens is not None:
            host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
            cu = tuple(int(x) for x in host.tolist())
        call = autograd.DeltaRuleCall(
            spec=SPEC, scale=SPEC.scale_for(q.shape[-1], scale), l2norm_qk=opts.l2norm_qk,
            output_final_state=bool(output_final_state), state_v_first=opts.state_v_first,
            cu=cu, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return autograd.ChunkDeltaRuleFunction.apply(call, q, k, v, beta, initial_state)
    return api.forward(SPEC, q, k, v, None, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, cu_seqlens_cpu=None, ssm_state_indices=None,
                               num_accepted_tokens=None, inplace_final_state=False,
                               **kwargs):
    """fla's fused_recurrent_delta_rule: the token-by-token kernel for any T; a missing
    beta means ones (as in fla). Shapes as chunk_delta_rule; the state pool arguments
    (ssm_state_indices, num_accepted_tokens, inplace_final_state) as
    fused_recurrent_gated_delta_rule's. Differentiable as chunk_delta_rule (its training
    runs the call)."""
    if api.recurrent_trains(q, k, v, beta, initial_state, ssm_state_indices=ssm_state_indices,
                            num_accepted_tokens=num_accepted_tokens,
                            inplace_final_state=inplace_final_state, kwargs=kwargs):
        beta = ones_beta(q, v) if beta is None else beta
        return chunk_delta_rule(q, k, v, beta, scale, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, **kwargs)
    opts = api.fla_options(use_qk_l2norm_in_kernel, kwargs=kwargs, chunk_sizes=None)
    return api.recurrent(SPEC, q, k, v, None, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=opts,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         beta_ones=True, ssm_state_indices=ssm_state_indices,
                         num_accepted_tokens=num_accepted_tokens,
                         inplace_final_state=inplace_final_state)
