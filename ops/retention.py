"""Retention (RetNet): the additive rule with a decay per head fixed by the spec, fla's
chunk_retention / fused_recurrent_retention. The spec declares the decay (``decay``: the
log of 1 - 2^(-5 - h) for value head h), so a call passes no gate; the functions are those
of ``linattn.build(SPEC)`` (forward, decode, and training through the additive backward)."""
from ..dsl import OpSpec
from . import api
from .build import build

SPEC = OpSpec(
    name="retention", rule="additive", gate="scalar", chunk_size=64,
    supports=frozenset({"state_v_first"}), gva=False, decay="log(1 - 2**(-5 - h))",
    doc="Retention: S <- gamma_h S + k v^T, gamma_h = 1 - 2^(-5 - h); o = S^T (scale q).",
)
_OPS = []


def _ops():
    if not _OPS:
        _OPS.append(build(SPEC))
    return _OPS[0]


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla's chunk_retention: q, k [B, T, H, K], v [B, T, H, V] (f16 / bf16), head h
    decaying by 1 - 2^(-5 - h) per token; initial_state [N, H, K, V] (any float dtype,
    read as f32). Returns (o [B, T, H, V], final_state f32 or None). Differentiable.
    chunk_size: as fla's (its chunk_simple_gla's), a power of two from 16 to 256, all on
    the chunk-64 kernels (the same recurrence)."""
    size = kwargs.pop("chunk_size", None)
    if size is not None:
        api.check_chunk_size(size, (16, 32, 64, 128, 256))
    return _ops().chunk(q, k, v, scale, initial_state, output_final_state,
                        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, **kwargs)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None,
                              output_final_state=False, reverse=False, state_v_first=False,
                              cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla's fused_recurrent_retention: the token-by-token kernel for any T; arguments as
    chunk_retention's (in fla's order), ``reverse`` not supported."""
    api.reject({"reverse": reverse})
    return _ops().fused_recurrent(q, k, v, scale, initial_state, output_final_state,
                                  state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                  cu_seqlens_cpu=cu_seqlens_cpu, **kwargs)


#: fla's fused_chunk_retention (fla's other algorithm for the same function, the same
#: arguments)
fused_chunk_retention = chunk_retention


def parallel_retention(q, k, v, scale=None, output_attentions=False, cu_seqlens=None,
                       **kwargs):
    """fla's parallel_retention: (o, attn or None), o as chunk_retention's (no state);
    with ``output_attentions`` (not with cu_seqlens, as fla) also attn [B, H, T, T] f32,
    scale q_i . k_j gamma_h^(i - j) for j <= i (simple_gla.attention_scores)."""
    from .build import fixed_gate
    from .simple_gla import attention_scores
    if output_attentions and cu_seqlens is not None:
        raise api.validate.error("output_attentions=True is not supported with cu_seqlens "
                                 "(as fla)")
    o, _ = chunk_retention(q, k, v, scale, cu_seqlens=cu_seqlens, **kwargs)
    return o, attention_scores(q, k, fixed_gate(SPEC, q, v), scale) if output_attentions \
        else None
