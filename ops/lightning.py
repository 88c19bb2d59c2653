"""Lightning attention: the additive rule with a decay fixed per head and layer, fla's
chunk_lightning_attn / fused_recurrent_lightning_attn (fla 0.6). The spec's ``decay``
names the layer: head h of H decays by exp(-8 h / H (1 - layer / layers)) per token, as
fla's g_gamma, so a call passes layer_idx and num_layers and no gate; its kernels are the
scalar gate's."""
from ..dsl import OpSpec
from . import api, validate

SPEC = OpSpec(
    name="lightning", rule="additive", gate="scalar", chunk_size=64,
    supports=frozenset({"state_v_first"}), gva=False,
    decay="-8 * h / H * (1 - layer / layers)",
    doc="Lightning attention: S <- exp(-8 h / H (1 - l / L)) S + k v^T; o = S^T (scale q).",
)


def layer_gate(q, v, layer_idx, num_layers):
    """g [B, T, H] f32 on q's device: every token of head h decays by the spec's decay at
    (layer_idx, num_layers); the layer arguments checked first (one-line errors)."""
    import torch
    for name, x in (("layer_idx", layer_idx), ("num_layers", num_layers)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise validate.error(f"{name} must be an int, got {type(x).__name__}")
    if num_layers < 1:
        raise validate.error(f"num_layers must be >= 1, got {num_layers}")
    if not 0 <= layer_idx < num_layers:
        raise validate.error(f"layer_idx must be in [0, num_layers) = [0, {num_layers}), "
                             f"got {layer_idx}")
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4
            and v.dim() == 4):
        return None                     # (the call's validation names the argument)
    B, T, H = v.shape[:3]
    gamma = torch.tensor(SPEC.head_decay(H, layer_idx, num_layers), dtype=torch.float32)
    return gamma.to(q.device).view(1, 1, H).expand(B, T, H).contiguous()


def chunk_lightning_attn(q, k, v, layer_idx, num_layers, scale=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                         **kwargs):
    """fla's chunk_lightning_attn: q, k, v [B, T, H, K / V] (f16 / bf16; f32 runs the
    recurrent kernel), layer_idx in [0, num_layers); initial_state
    [N, H, K, V] (read as f32). Returns (o [B, T, H, V], final_state f32 or None).
    Differentiable in q, k, v and initial_state (ops/additive_bwd.py)."""
    g = layer_gate(q, v, layer_idx, num_layers)
    opts = api.fla_options(kwargs=kwargs, chunk_sizes=(16, 32, 64, 128, 256))
    from . import additive_bwd
    if additive_bwd.needs_grad(q, k, v, initial_state):
        return additive_bwd.train(SPEC, opts, q, k, v, g, scale, initial_state,
                                  output_final_state, cu_seqlens, cu_seqlens_cpu)
    return api.forward(SPEC, q, k, v, g, None, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


def fused_recurrent_lightning_attn(q, k, v, layer_idx, num_layers, scale=None,
                                   initial_state=None, output_final_state=False,
                                   reverse=False, cu_seqlens=None, cu_seqlens_cpu=None,
                                   **kwargs):
    """fla's fused_recurrent_lightning_attn: the token-by-token kernel for any T;
    arguments as chunk_lightning_attn's, ``reverse`` not supported. Differentiable (as
    chunk_lightning_attn)."""
    api.reject({"reverse": reverse})
    g = layer_gate(q, v, layer_idx, num_layers)
    if api.recurrent_trains(q, k, v, initial_state, kwargs=kwargs):
        return chunk_lightning_attn(q, k, v, layer_idx, num_layers, scale, initial_state,
                                    output_final_state, cu_seqlens, cu_seqlens_cpu, **kwargs)
    opts = api.fla_options(kwargs=kwargs, chunk_sizes=None)
    return api.recurrent(SPEC, q, k, v, g, None, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=opts,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
