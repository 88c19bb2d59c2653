"""Gated DeltaNet: the delta rule with one scalar log decay per value head and token."""
from ..dsl import OpSpec
from . import api
from .inputs import ones_beta

SPEC = OpSpec(
    name="gdn", rule="delta", gate="scalar", chunk_size=64,
    supports=frozenset({"l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
                        "state_v_first"}),
    doc="Gated DeltaNet: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).",
)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None, **kwargs):
    """fla's chunk_gated_delta_rule. T == 1 takes the decode kernel.

    q, k [B, T, H, K]; v [B, T, HV, V] (HV % H == 0), f16 / bf16 / f32 (f32: the
    recurrent kernel); g, beta [B, T, HV], any float dtype; g is a natural-log decay
    (raw with use_gate_in_kernel: g <- -exp(A_log) * softplus(g + dt_bias), A_log with
    HV elements ([HV], [1, 1, HV, 1], ...), dt_bias [HV] or None for no bias); beta is
    post-sigmoid unless use_beta_sigmoid_in_kernel (2 sigmoid with allow_neg_eigval).
    initial_state [N, HV, K, V] ([N, HV, V, K] with state_v_first), any float dtype, read
    as f32; N = B, or len(cu_seqlens) - 1 (then B == 1). chunk_size: fla's 16, 32 or 64,
    all run on the chunk-64 kernels (the same recurrence).
    Returns (o [B, T, HV, V] in q's dtype, final_state f32 or None).

    Differentiable (ops/autograd.py) when any of q, k, v, g, beta, initial_state, A_log,
    dt_bias requires grad: gradients for all of them, from o's and final_state's (K, V up
    to 128, below 64 / 128 zero-padded to them; float16 / bfloat16; float32 exactly in
    torch, ops/exact_train.py; anything the backward does not support raises SpecError).
    """
    opts = api.fla_options(use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, use_gate_in_kernel, state_v_first, kwargs,
                           chunk_sizes=(16, 32, 64))
    from . import autograd
    if autograd.needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return autograd.train(SPEC, opts, q, k, v, g, beta, scale, initial_state,
                              output_final_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias)
    return api.forward(SPEC, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                       A_log=A_log, dt_bias=dt_bias)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, cu_seqlens_cpu=None,
                                     ssm_state_indices=None, num_accepted_tokens=None,
                                     inplace_final_state=False, **kwargs):
    """fla's fused_recurrent_gated_delta_rule: the token-by-token kernel for any T.

    As chunk_gated_delta_rule; additionally, as in fla, ``gk`` [B, T, HV, K] (a per-key
    decay: the KDA spec) may replace ``g``, neither means no decay (the DeltaNet spec),
    and a missing beta means ones. ``gv`` (per-value decay) is not supported.

    State pool (fla's / vLLM's continuous batching): with ``ssm_state_indices`` int [N]
    (one slot per sequence) or [N, S] (per token), initial_state is a pool [P, HV, K, V]
    (any P; f32, f16 or bf16): sequence n starts from slot ssm_state_indices[n] (or
    [n, num_accepted_tokens[n] - 1] with ``num_accepted_tokens`` [N], speculative
    decoding; [n, 0] without). ``inplace_final_state=True`` writes into the pool: the
    final state into slot [n] ([N] form), or the state after each token t into slot
    [n, t] ([N, S] form); it returns (o, initial_state). Without it the final states
    are returned as usual ([N, HV, K, V] f32). A negative or out-of-range slot is never
    read (the sequence is skipped: its o rows are zeros) nor written; a slot not named
    is never touched.

    Differentiable as the chunk_* function of its spec (with gradients the call runs that
    function's training: the same recurrence); a state pool is not.
    """
    from . import deltanet, kda
    if gv is not None:
        api.reject({"gv": gv})
    if g is not None and gk is not None:
        raise api.validate.error("give g (scalar decay) or gk (per-key decay), not both")
    spec, gate = (SPEC, g) if g is not None else (kda.SPEC, gk) if gk is not None else (
        deltanet.SPEC, None)
    if spec is deltanet.SPEC and use_gate_in_kernel:
        raise api.validate.error("use_gate_in_kernel=True needs g (the raw gate input)")
    opts = api.fla_options(use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, use_gate_in_kernel, state_v_first, kwargs,
                           chunk_sizes=None)
    if api.recurrent_trains(q, k, v, gate, beta, initial_state, A_log, dt_bias,
                            ssm_state_indices=ssm_state_indices,
                            num_accepted_tokens=num_accepted_tokens,
                            inplace_final_state=inplace_final_state):
        from . import autograd
        beta = ones_beta(q, v) if beta is None else beta
        return autograd.train(spec, opts, q, k, v, gate, beta, scale, initial_state,
                              output_final_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias)
    return api.recurrent(spec, q, k, v, gate, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=opts,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         A_log=A_log, dt_bias=dt_bias, beta_ones=True,
                         ssm_state_indices=ssm_state_indices,
                         num_accepted_tokens=num_accepted_tokens,
                         inplace_final_state=inplace_final_state)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
