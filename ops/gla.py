"""Gated Linear Attention: the additive rule with a log decay per key channel."""
from ..dsl import OpSpec
from . import api, validate

SPEC = OpSpec(
    name="gla", rule="additive", gate="key", chunk_size=64,
    supports=frozenset({"state_v_first"}), gva=False,
    doc="GLA: S <- diag(exp(g)) S + k v^T; o = S^T (scale q).",
)
#: GLA with fla's ``gv`` instead of ``gk`` (a log decay per value channel), for
#: chunk_gla(gv=...) and fused_recurrent_gla(gv=...); not a registered family: its kernels
#: (the recurrent stage, the three-stage chunked forward) are rendered on first use into
#: ops.runtime.gen_dir()
SPEC_GV = OpSpec(
    name="gla_gv", rule="additive", gate="value", chunk_size=64,
    supports=frozenset({"state_v_first"}), gva=False,
    doc="GLA with a value gate: S <- S diag(exp(gv)) + k v^T; o = S^T (scale q).",
)


def chunk_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, gv=None, **kwargs):
    """fla's chunk_gla (forward). T == 1 takes the decode kernel.

    q, k, g [B, T, H, K] (g: natural-log decay per key channel, any float dtype);
    v [B, T, H, V]; f16 / bf16 / f32 (f32, K not a multiple of 64: the recurrent kernel);
    initial_state [N, H, K, V] ([N, H, V, K] with state_v_first), any float dtype, read
    as f32. Returns (o [B, T, H, V] in q's dtype, final_state f32 or None).
    gv [B, T, H, V] instead of g (fla's name in fused_recurrent_gla): a natural-log decay
    per value channel, S <- S diag(exp(gv)) + k v^T (g and gv together are not supported).

    Differentiable (ops/additive_bwd.py) when any of q, k, v, g (gv), initial_state
    requires grad: gradients for all five, from o's and final_state's (f16 / bf16; V <=
    512, with gv V <= 256: its backward is the key gate's on the transposed state; K > 256
    in key blocks, ops/split.py; anything else raises SpecError).
    """
    opts = api.fla_options(state_v_first=state_v_first, kwargs=kwargs)
    from . import additive_bwd
    if (g is None) == (gv is None):
        raise validate.error("chunk_gla takes g (per key channel) or gv (per value channel): "
                             f"got {'neither' if g is None else 'both'}")
    spec, g = (SPEC, g) if gv is None else (SPEC_GV, gv)
    if additive_bwd.needs_grad(q, k, v, g, initial_state):
        return additive_bwd.train(spec, opts, q, k, v, g, scale, initial_state,
                                  output_final_state, cu_seqlens, cu_seqlens_cpu)
    return api.forward(spec, q, k, v, g, None, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, options=opts,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                        output_final_state=False, reverse=False, state_v_first=False,
                        cu_seqlens=None, cu_seqlens_cpu=None, ssm_state_indices=None,
                        num_accepted_tokens=None, inplace_final_state=False, **kwargs):
    """fla's fused_recurrent_gla: the token-by-token kernel for any T.

    q, k [B, T, H, K]; v [B, T, H, V]; gk [B, T, H, K] (a natural-log decay per key
    channel: S <- diag(exp(gk)) S) or gv [B, T, H, V] (per value channel:
    S <- S diag(exp(gv)); fla's name), f32 or q's dtype; neither: plain linear attention
    (the additive rule without a gate). gk and gv together and ``reverse`` are not
    supported; the state pool arguments as fused_recurrent_gated_delta_rule's.
    Differentiable as chunk_gla (chunk_linear_attn without normalize for neither gate):
    their training runs the call."""
    from . import linear_attn
    api.reject({"reverse": reverse})
    if api.recurrent_trains(q, k, v, gk, gv, initial_state, ssm_state_indices=ssm_state_indices,
                            num_accepted_tokens=num_accepted_tokens,
                            inplace_final_state=inplace_final_state, kwargs=kwargs):
        common = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                      output_final_state=output_final_state, cu_seqlens_cpu=cu_seqlens_cpu)
        if gk is None and gv is None and not state_v_first:
            return linear_attn.chunk_linear_attn(q, k, v, normalize=False, **common, **kwargs)
        return chunk_gla(q, k, v, g=gk, gv=gv, state_v_first=state_v_first, **common,
                         **kwargs)
    if gk is not None and gv is not None:
        raise validate.error("fused_recurrent_gla takes gk or gv, not both: both at once "
                             "is not supported yet")
    opts = api.fla_options(state_v_first=state_v_first, kwargs=kwargs, chunk_sizes=None)
    spec, g = ((SPEC, gk) if gk is not None else (SPEC_GV, gv) if gv is not None
               else (linear_attn.SPEC, None))
    return api.recurrent(spec, q, k, v, g, None, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=opts,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         ssm_state_indices=ssm_state_indices,
                         num_accepted_tokens=num_accepted_tokens,
                         inplace_final_state=inplace_final_state)
