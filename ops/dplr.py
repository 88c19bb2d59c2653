"""DPLR (fla's generalized delta rule, diagonal plus low rank): S <- diag(exp(gk)) S +
b (a^T S) + k v^T, a, b keys of their own; RWKV-7's functions are its own with q = r,
gk = w (fla's chunk_rwkv7 / fused_recurrent_rwkv7)."""
from ..dsl import OpSpec
from . import api, dplr_bwd

SPEC = OpSpec(
    name="dplr", rule="dplr", gate="key", chunk_size=64, supports=frozenset(),
    doc="DPLR: S <- diag(exp(gk)) S + b (a^T S) + k v^T (S before the decay); "
        "o = S^T (scale q).",
)


def _check_bound(lower_bound) -> None:
    """fla's lower_bound for DPLR: the caller's promise lower_bound <= gk < 0, which
    changes no result here; a number or None."""
    if lower_bound is not None and (isinstance(lower_bound, bool)
                                    or not isinstance(lower_bound, (int, float))):
        raise api.validate.error(f"lower_bound must be a number or None, got "
                                 f"{api.validate.describe(lower_bound)}")


def run(spec, q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens,
        cu_seqlens_cpu, kwargs, chunk_sizes):
    """The kernels of a DPLR-form spec (DPLR, IPLR) for a public call: fla's keywords
    checked (``chunk_sizes``: a chunk_* call's allowed chunk_size, None for a
    fused_recurrent_* one); a chunk_* call the chunked kernels take that needs gradients
    trains through the backward's kernels (ops/dplr_bwd.py), any other that needs them
    exactly in torch (ops/exact_train.py)."""
    if chunk_sizes is not None and kwargs.get("chunk_size") is None:
        kwargs.pop("chunk_size", None)           # (fla's default: 16)
    opts = api.fla_options(kwargs=kwargs, chunk_sizes=chunk_sizes)
    if (chunk_sizes is not None and dplr_bwd.trains(q, k, v, a, b, gk, initial_state)
            and chunked(spec, q, v, opts)):
        return dplr_bwd.train(spec, opts, q, k, v, a, b, gk, scale, initial_state,
                              output_final_state, cu_seqlens, cu_seqlens_cpu)
    entry = (api.forward if chunk_sizes is not None and chunked(spec, q, v, opts)
             else api.recurrent)
    return entry(spec, q, k, v, gk, None, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, options=opts,
                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                 rule_inputs={"a": a, "b": b})


def chunked(spec, q, v, opts) -> bool:
    """Whether a chunk_* call may take the chunked kernels (chunk_prepare_dplr,
    chunk_state_dplr; api.forward then picks them or, at T = 1, the recurrent kernel):
    the arch's dplr_chunked (its stages generated) and dplr_fits (K at the
    kernels' chunk_k, V, the state layout). Anything else the recurrent kernel."""
    import torch
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.is_cuda
            and q.dim() == 4 and v.dim() == 4):
        return False
    from ..codegen.arch import get_arch
    from .runtime import arch_of
    arch = get_arch(arch_of(q.device))
    K = arch.chunk_k(spec.rule.value, spec.gate.value, q.shape[-1])
    return arch.dplr_chunked(spec.gate.value) and arch.dplr_fits(K, v.shape[-1],
                                                                 opts.state_v_first)


def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                          output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                          safe_gate=False, chunk_size=None, disable_recompute=False,
                          cp_context=None, lower_bound=None, **kwargs):
    """fla's chunk_dplr_delta_rule: S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_t^T S_{t-1})
    + k_t v_t^T, o_t = S_t^T (scale q_t) (fla's S_t = S_t (D_t + a_t b_t^T) + v_t k_t^T,
    its state value-first).

    q, k, a, b [B, T, H, K]; v [B, T, HV, V] (HV % H == 0), f16 / bf16 / f32; gk
    [B, T, HV, K] natural-log decay per key channel, any float dtype. initial_state
    [N, HV, K, V], read as f32; N = B, or len(cu_seqlens) - 1 (then B == 1). safe_gate,
    disable_recompute and lower_bound (a promise on gk) change nothing; chunk_size 16,
    32 or 64 (None: fla's 16). Returns (o [B, T, HV, V] in q's dtype, final_state f32 or
    None).

    Runs the chunked kernels (chunk_prepare_dplr, chunk_state_dplr) where they fit
    (sm90; K <= 128, V a multiple of 32 up to 256, key-first states), else the
    recurrent kernel; a 16-bit call there that needs gradients trains through the
    backward's kernels (ops/dplr_bwd.py), any other exactly in torch (ops/exact_train.py).
    """
    _check_bound(lower_bound)
    kw = dict(kwargs, chunk_size=chunk_size, cp_context=cp_context,
              disable_recompute=disable_recompute)
    return run(SPEC, q, k, v, a, b, gk, scale, initial_state, output_final_state,
               cu_seqlens, cu_seqlens_cpu, kw, (16, 32, 64))


def fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                    output_final_state=False, reverse=False,
                                    cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla's fused_recurrent_dplr_delta_rule: as chunk_dplr_delta_rule, token by token
    (``reverse=True`` is not supported)."""
    return run(SPEC, q, k, v, a, b, gk, scale, initial_state, output_final_state,
               cu_seqlens, cu_seqlens_cpu, dict(kwargs, reverse=reverse), None)


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                disable_recompute=False, cp_context=None, lower_bound=None, **kwargs):
    """fla's chunk_rwkv7: chunk_dplr_delta_rule with q = r and gk = w (the log decay
    [B, T, H, K]); scale defaults to 1.0 (fla's)."""
    if "head_first" in kwargs:
        raise api.validate.error("head_first has been removed: inputs are [B, T, H, ...]")
    return chunk_dplr_delta_rule(r, k, v, a, b, w, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state,
                                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                 safe_gate=safe_gate, chunk_size=chunk_size,
                                 disable_recompute=disable_recompute, cp_context=cp_context,
                                 lower_bound=lower_bound, **kwargs)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None,
                          output_final_state=True, cu_seqlens=None, **kwargs):
    """fla's fused_recurrent_rwkv7: fused_recurrent_dplr_delta_rule with q = r, gk = w;
    scale None is K ** -0.5 and output_final_state defaults to True (fla's)."""
    if "head_first" in kwargs:
        raise api.validate.error("head_first has been removed: inputs are [B, T, H, ...]")
    return fused_recurrent_dplr_delta_rule(r, k, v, a, b, w, scale=scale,
                                           initial_state=initial_state,
                                           output_final_state=output_final_state,
                                           cu_seqlens=cu_seqlens, **kwargs)


def fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=None,
                              output_final_state=False, reverse=False, cu_seqlens=None,
                              **kwargs):
    """fla's fused_mul_recurrent_rwkv7: RWKV-7's recurrence with DPLR's a, b formed from
    kk and a (fla: a_dplr = -kk, b_dplr = kk * a), i.e. fused_recurrent_dplr_delta_rule
    with q = r, gk = w; scale defaults to 1.0, None to K ** -0.5 (fla's)."""
    if "head_first" in kwargs:
        raise api.validate.error("head_first has been removed: inputs are [B, T, H, ...]")
    import torch
    for name, x in (("kk", kk), ("a", a)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return fused_recurrent_dplr_delta_rule(r, k, v, -kk, kk * a, w, scale=scale,
                                           initial_state=initial_state,
                                           output_final_state=output_final_state,
                                           reverse=reverse, cu_seqlens=cu_seqlens, **kwargs)
