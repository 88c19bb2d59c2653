"""Comba: the delta rule whose erase key p is not the write key k, with one scalar log
decay per value head and token (fla's chunk_comba / fused_recurrent_comba)."""
from ..dsl import OpSpec
from . import api

SPEC = OpSpec(
    name="comba", rule="comba", gate="scalar", chunk_size=64,
    supports=frozenset({"l2norm_qk", "state_v_first"}),     # (fla's comba options)
    doc="Comba: S <- exp(g) S + k (beta (v - S^T p))^T (S before the decay); "
        "o = S^T (scale q).",
)


def chunk_comba(q, k, v, p, g, beta=None, scale=None, initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                cu_seqlens_cpu=None, **kwargs):
    """fla's chunk_comba: S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}^T p_t))^T,
    o_t = S_t^T (scale q_t); the write reads the state before the token's decay through
    the auxiliary key p.

    q, k, p [B, T, H, K]; v [B, T, HV, V] (HV % H == 0), f16 / bf16 / f32; g, beta
    [B, T, HV], any float dtype (g a natural-log decay; beta post-sigmoid; None: ones); p
    None means k (fla's default); with use_qk_l2norm_in_kernel q, k and p are
    l2-normalised. initial_state [N, HV, K, V] ([N, HV, V, K] with state_v_first=True,
    a keyword), read as f32; N = B, or len(cu_seqlens) - 1 (then B == 1). Returns
    (o [B, T, HV, V] in q's dtype, final_state f32 or None).

    Runs the chunked kernels (the scalar gate's kkt inverse and w, u with p as the erase
    key under the exclusive decay, then GDN's state and output stages) where they take
    the call (ops/api.py choose_path), the recurrent kernel otherwise. A 16-bit call that
    needs gradients trains through the generated backward (the delta rule's stages with p
    as the erase key; GPU-checked against fla's gradients in run s43-1), a float32 one
    exactly in torch (ops/exact_train.py).
    """
    opts = api.fla_options(use_qk_l2norm_in_kernel, kwargs=kwargs, chunk_sizes=(64,))
    p = k if p is None else p
    return api.forward(SPEC, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                       beta_ones=True, rule_inputs={"p": p})


def fused_recurrent_comba(q, k, p, v, g, beta=None, scale=None, initial_state=None,
                          output_final_state=False, use_qk_l2norm_in_kernel=False,
                          cu_seqlens=None, cu_seqlens_cpu=None, ssm_state_indices=None,
                          num_accepted_tokens=None, inplace_final_state=False, **kwargs):
    """fla's fused_recurrent_comba (note fla's order: q, k, p, v): the token-by-token
    kernel for any T; as :func:`chunk_comba` (beta None: ones; p None: k), plus a state
    pool (``ssm_state_indices`` [N] or [N, S], ``num_accepted_tokens``,
    ``inplace_final_state``: as fused_recurrent_gated_delta_rule). fla's per-value beta
    [B, T, HV, V] is not supported (beta must be [B, T, HV])."""
    opts = api.fla_options(use_qk_l2norm_in_kernel, kwargs=kwargs, chunk_sizes=None)
    p = k if p is None else p
    return api.recurrent(SPEC, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=opts,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         beta_ones=True, ssm_state_indices=ssm_state_indices,
                         num_accepted_tokens=num_accepted_tokens,
                         inplace_final_state=inplace_final_state, rule_inputs={"p": p})
