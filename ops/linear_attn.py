"""Linear attention: the additive rule without a gate (Katharopoulos et al. 2020)."""
from ..dsl import OpSpec
from . import api

SPEC = OpSpec(
    name="linear_attn", rule="additive", gate="none", chunk_size=64,
    supports=frozenset({"state_v_first"}), gva=False,
    doc="Linear attention: S <- S + k v^T; o = S^T (scale q).",
)


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                      normalize=True, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla's chunk_linear_attn (forward). T == 1 takes the decode kernel.

    q, k [B, T, H, K]; v [B, T, H, V]; f16 / bf16 / f32 (f32: the recurrent kernel);
    scale default K^-0.5. normalize (fla's default True): o_t / (scale q_t . z_t +
    1e-10) with z_t = z0 + sum_{s <= t} k_s per sequence (in f32, after the kernel).
    initial_state: [N, H, K, V] (any float dtype, read as f32) or, with normalize, the
    pair (kv_state, z_state [N, 1, H, K]). Returns (o [B, T, H, V] in q's dtype,
    final_state f32 or None), final_state being (kv_state or None, z_state f32 [N, 1, H,
    K]) with normalize.

    Differentiable (ops/additive_bwd.py) when any of q, k, v, initial_state requires grad
    (normalize and z_state by torch); limits as chunk_gla's.
    """
    opts = api.fla_options(kwargs=kwargs)
    kv0, z0 = _split_state(initial_state, normalize, q, cu_seqlens)
    from . import additive_bwd
    if additive_bwd.needs_grad(q, k, v, kv0):     # (normalize: torch ops, differentiable)
        o, ht = additive_bwd.train(SPEC, opts, q, k, v, None, scale, kv0, output_final_state,
                                   cu_seqlens, cu_seqlens_cpu)
    else:
        o, ht = api.forward(SPEC, q, k, v, None, None, scale=scale, initial_state=kv0,
                            output_final_state=output_final_state, options=opts,
                            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    if not normalize:
        return o, ht
    o, z = normalize_output(o, q, k, SPEC.scale_for(q.shape[-1], scale), z0, cu_seqlens)
    return o, (ht, z)


def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None,
                                output_final_state=False, reverse=False, normalize=False,
                                cu_seqlens=None, cu_seqlens_cpu=None, ssm_state_indices=None,
                                num_accepted_tokens=None, inplace_final_state=False, **kwargs):
    """fla's fused_recurrent_linear_attn: the token-by-token kernel for any T. As
    chunk_linear_attn, with normalize off by default (as in fla); ``reverse`` is not
    supported; the state pool arguments (not with normalize) as
    fused_recurrent_gated_delta_rule's. Differentiable as chunk_linear_attn (its
    training runs the call)."""
    api.reject({"reverse": reverse})
    if api.recurrent_trains(q, k, v, *(initial_state if isinstance(initial_state, tuple)
                                       else (initial_state,)),
                            ssm_state_indices=ssm_state_indices,
                            num_accepted_tokens=num_accepted_tokens,
                            inplace_final_state=inplace_final_state, kwargs=kwargs):
        return chunk_linear_attn(q, k, v, scale, initial_state, output_final_state, normalize,
                                 cu_seqlens, cu_seqlens_cpu, **kwargs)
    opts = api.fla_options(kwargs=kwargs, chunk_sizes=None)
    if normalize and (ssm_state_indices is not None or inplace_final_state):
        raise api.validate.error("normalize=True is not supported with a state pool "
                                 "(ssm_state_indices / inplace_final_state)")
    kv0, z0 = _split_state(initial_state, normalize, q, cu_seqlens)
    o, ht = api.recurrent(SPEC, q, k, v, None, None, scale=scale, initial_state=kv0,
                          output_final_state=output_final_state, options=opts,
                          cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                          ssm_state_indices=ssm_state_indices,
                          num_accepted_tokens=num_accepted_tokens,
                          inplace_final_state=inplace_final_state)
    if not normalize:
        return o, ht
    o, z = normalize_output(o, q, k, SPEC.scale_for(q.shape[-1], scale), z0, cu_seqlens)
    return o, (ht, z)


def _split_state(initial_state, normalize, q, cu_seqlens):
    """fla's initial_state forms: a tensor, or (kv_state, z_state) with normalize; z_state
    is checked here ([N, 1, H, K], any float dtype), the rest by the call's checks."""
    if not isinstance(initial_state, (tuple, list)):
        return initial_state, None
    if not normalize or len(initial_state) != 2:
        raise api.validate.error("initial_state as a pair (kv_state, z_state) needs "
                                 "normalize=True")
    kv0, z0 = initial_state
    if z0 is not None and getattr(q, "dim", lambda: 0)() == 4:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        api.validate.check_tensor("z_state", z0, dtypes=api.validate.FLOAT_DTYPES,
                                  shape=(N, 1, q.shape[2], q.shape[3]), contiguous=False)
    return kv0, z0


def normalize_output(o, q, k, scale: float, z0=None, cu_seqlens=None):
    """fla's normalize step: (o / (scale q . z + 1e-10), z_state), z_t = z0 + the sum of
    k over the sequence's tokens up to t (f32; per sequence with cu_seqlens).
    o, q, k [B, T, H, *]; z0 [N, 1, H, K] or None. Returns o in its dtype and z_state
    f32 [N, 1, H, K]."""
    import torch
    B, T, H, K = k.shape
    if cu_seqlens is None:
        z = k.float().cumsum(1) + (z0.float() if z0 is not None else 0.0)
        z_state = z[:, -1:] if T > 0 else torch.zeros(B, 1, H, K, device=k.device) + (
            z0.float() if z0 is not None else 0.0)
    else:      # per sequence: differences of one f64 running sum over the packed tokens
        run = torch.cat([k.new_zeros(1, H, K, dtype=torch.float64),
                         k[0].double().cumsum(0)])
        cu = cu_seqlens.long()
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=k.device), right=True)
        z = (run[1:] - run[cu[:-1]][seq]).float()
        z_state = (run[cu[1:]] - run[cu[:-1]]).float().unsqueeze(1)
        if z0 is not None:
            z, z_state = z + z0.float()[:, 0][seq], z_state + z0.float()
        z = z.unsqueeze(0)
    denom = (q.float() * scale * z).sum(-1, keepdim=True) + 1e-10
    return (o.float() / denom).to(o.dtype), z_state


#: fla's fused_chunk_linear_attn (fla's other algorithm for the same function, the same
#: arguments)
fused_chunk_linear_attn = chunk_linear_attn
