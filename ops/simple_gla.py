"""Simple GLA: the additive rule with one scalar log decay per head and token."""
from ..dsl import OpSpec
from . import api

SPEC = OpSpec(
    name="simple_gla", rule="additive", gate="scalar", chunk_size=64,
    supports=frozenset({"state_v_first"}), gva=False,
    doc="Simple GLA: S <- exp(g) S + k v^T; o = S^T (scale q).",
)


def _spec(g, g_gamma):
    """Without g and g_gamma fla's simple GLA is plain linear attention."""
    from . import linear_attn
    return SPEC if g is not None or g_gamma is not None else linear_attn.SPEC


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                     output_final_state=False, state_v_first=False, cu_seqlens=None,
                     cu_seqlens_cpu=None, **kwargs):
    """fla's chunk_simple_gla (forward). T == 1 takes the decode kernel.

    q, k [B, T, H, K]; v [B, T, H, V]; f16 / bf16 / f32 (f32: the recurrent kernel);
    g [B, T, H] natural-log decay per head and token and / or g_gamma [H] (a decay per
    head, the same at every token; with both the decay is g + g_gamma, as in fla);
    neither: no decay. initial_state [N, H, K, V] ([N, H, V, K] with state_v_first), any
    float dtype, read as f32; chunk_size: a power of two from 16 to 256 (fla: any power of
    two), all on the chunk-64 kernels.
    Returns (o [B, T, H, V] in q's dtype, final_state f32 or None).

    Differentiable (ops/additive_bwd.py) when any of q, k, v, g, g_gamma, initial_state
    requires grad (g + g_gamma formed by torch, so g_gamma's gradient is g's summed);
    limits as chunk_gla's.
    """
    opts = api.fla_options(state_v_first=state_v_first, kwargs=kwargs,
                           chunk_sizes=(16, 32, 64, 128, 256))
    from . import additive_bwd
    if additive_bwd.needs_grad(q, k, v, g, g_gamma, initial_state):
        if g_gamma is not None:
            B, T, H = q.shape[0], q.shape[1], v.shape[2]
            gam = g_gamma.float().reshape(1, 1, H)
            g = (gam if g is None else g.float() + gam).expand(B, T, H)
        return additive_bwd.train(_spec(g, None), opts, q, k, v, g, scale, initial_state,
                                  output_final_state, cu_seqlens, cu_seqlens_cpu)
    return api.forward(_spec(g, g_gamma), q, k, v, g, None, scale=scale,
                       initial_state=initial_state, output_final_state=output_final_state,
                       options=opts, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                       g_gamma=g_gamma)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False,
                               cu_seqlens=None, cu_seqlens_cpu=None, ssm_state_indices=None,
                               num_accepted_tokens=None, inplace_final_state=False,
                               **kwargs):
    """fla's fused_recurrent_simple_gla: the token-by-token kernel for any T. Shapes as
    chunk_simple_gla; ``reverse`` is not supported; the state pool arguments as
    fused_recurrent_gated_delta_rule's. Differentiable as chunk_simple_gla (its training
    runs the call)."""
    api.reject({"reverse": reverse})
    if api.recurrent_trains(q, k, v, g, g_gamma, initial_state,
                            ssm_state_indices=ssm_state_indices,
                            num_accepted_tokens=num_accepted_tokens,
                            inplace_final_state=inplace_final_state, kwargs=kwargs):
        return chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                                state_v_first, cu_seqlens, cu_seqlens_cpu, **kwargs)
    opts = api.fla_options(state_v_first=state_v_first, kwargs=kwargs, chunk_sizes=None)
    return api.recurrent(_spec(g, g_gamma), q, k, v, g, None, scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state,
                         options=opts, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         g_gamma=g_gamma, ssm_state_indices=ssm_state_indices,
                         num_accepted_tokens=num_accepted_tokens,
                         inplace_final_state=inplace_final_state)


def fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None, **kwargs):
    """fla's fused_chunk_simple_gla (fla's other algorithm for the same function):
    chunk_simple_gla, in fla's argument order."""
    return chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                            cu_seqlens=cu_seqlens, **kwargs)


def parallel_simple_gla(q, k, v, g=None, scale=None, output_attentions=False,
                        cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla's parallel_simple_gla: (o, attn or None), o as chunk_simple_gla's (no state);
    with ``output_attentions`` (not with cu_seqlens, as fla) also the attention scores
    attn [B, H, T, T] f32 (:func:`attention_scores`)."""
    if output_attentions and cu_seqlens is not None:
        raise api.validate.error("output_attentions=True is not supported with cu_seqlens "
                                 "(as fla)")
    o, _ = chunk_simple_gla(q, k, v, g, scale=scale, cu_seqlens=cu_seqlens,
                            cu_seqlens_cpu=cu_seqlens_cpu, **kwargs)
    return o, attention_scores(q, k, g, scale) if output_attentions else None


def attention_scores(q, k, g, scale):
    """The causal scores of the additive rule with a scalar gate, materialized by torch
    (differentiable): attn[b, h, i, j] = scale q_i . k_j exp(G_i - G_j) for j <= i, else
    0, with G the running sum of g [B, T, H] over T (None: no decay); f32 [B, H, T, T]."""
    import torch
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = (t.float().transpose(1, 2) for t in (q, k))
    attn = scale * qf @ kf.transpose(-1, -2)
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if g is not None:
        G = g.float().cumsum(1).transpose(1, 2)
        attn = attn * (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, -torch.inf).exp()
    return attn.masked_fill(~causal, 0.0)
