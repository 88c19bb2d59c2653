"""Mamba-2 (SSD): the additive rule with a scalar gate formed from a step dt, under
mamba_ssm's names: ``mamba_chunk_scan_combined`` (prefill, training) and
``selective_state_update`` (decode). In the spec's terms q = C, k = B (ngroups key
heads shared by nheads value heads), v = x, the state [headdim, dstate] is the v-first
state ([N, HV, V, K]) and the scale is 1; the step, the value scale, the skip term and
the output gate are the spec's call terms (dsl/call_terms.py)."""
import functools

from ..dsl import OpSpec, Options
from . import api, terms, validate

SPEC = OpSpec(
    name="mamba2", rule="additive", gate="scalar", chunk_size=64,
    supports=frozenset({"state_v_first"}), default_scale=1.0,
    step="dt", value_scale="dt", skip=True, output_gate="silu",
    doc="Mamba-2 (SSD): per head h <- exp(A dt) h + B (dt x)^T, y = (h^T C + D x) silu(z); "
        "B, C shared by groups of heads; dt = clamp(softplus(dt + dt_bias), dt_limit).",
)
_OPTS = Options(state_v_first=True)
_INF = float("inf")


def _f32_vector(name, x, n, allow_matrix=None):
    """An optional parameter [n] (or [n, allow_matrix]) of a float dtype; None passes."""
    if x is None:
        return
    validate.check_tensor(name, x, dtypes=validate.FLOAT_DTYPES, contiguous=False)
    shapes = [(n,)] + ([(n, allow_matrix)] if allow_matrix else [])
    if tuple(x.shape) not in shapes:
        raise validate.shape_error(name, x.shape, " or ".join(str(list(s)) for s in shapes))


def _check_limit(dt_limit):
    ok = (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in dt_limit)
          and dt_limit[0] <= dt_limit[1])
    if not ok:
        raise validate.error(f"dt_limit must be a pair (lo, hi) of numbers with lo <= hi, "
                             f"got {dt_limit!r}")


def check_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
               cu_seqlens, dt_limit):
    """Every argument of mamba_chunk_scan_combined, before any device work (one-line
    SpecErrors naming the argument). Returns (nheads, ngroups)."""
    validate.check_tensor("x", x, dtypes=validate.INPUT_DTYPES, contiguous=False)
    if x.dim() != 4:
        raise validate.shape_error("x", x.shape, "[B, T, nheads, headdim]")
    Bn, T, HV, V = x.shape
    validate.check_tensor("dt", dt, dtypes=validate.FLOAT_DTYPES, shape=(Bn, T, HV),
                          contiguous=False)
    _f32_vector("A", A, HV)
    for name, t in (("B", B), ("C", C)):
        validate.check_tensor(name, t, dtypes=validate.FLOAT_DTYPES, contiguous=False)
        if t.dim() != 4 or tuple(t.shape[:2]) != (Bn, T) or t.shape != B.shape:
            raise validate.shape_error(name, t.shape, f"[{Bn}, {T}, ngroups, dstate] "
                                       "(B and C alike)")
    G, K = B.shape[2], B.shape[3]
    if HV % G:
        raise validate.error(f"nheads ({HV}) must be a multiple of ngroups ({G}) of B and C")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise validate.error(f"chunk_size must be a positive int, got {chunk_size!r}")
    _f32_vector("D", D, HV, V)
    _f32_vector("dt_bias", dt_bias, HV)
    if z is not None:
        validate.check_tensor("z", z, dtypes=validate.FLOAT_DTYPES, shape=tuple(x.shape),
                              contiguous=False)
    _check_limit(dt_limit)
    if seq_idx is not None:
        validate.check_tensor("seq_idx", seq_idx, dtypes=validate.INDEX_DTYPES,
                              shape=(Bn, T), contiguous=False)
        if Bn != 1:
            raise validate.error(f"seq_idx needs batch 1 (the sequences packed), got {Bn}")
    if initial_states is not None:
        validate.check_tensor("initial_states", initial_states,
                              dtypes=validate.FLOAT_DTYPES, shape=(Bn, HV, V, K),
                              contiguous=False)
    validate.check_cu_seqlens(cu_seqlens, Bn, T, values=validate.host_checks())
    validate.check_head_dims(K, V)
    validate.check_devices_as("x", x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                           initial_states=initial_states, seq_idx=seq_idx,
                           cu_seqlens=cu_seqlens)
    return HV, G


def _boundaries(x, seq_idx, cu_seqlens):
    """cu_seqlens int32 on x's device (None: one sequence per batch row): the given one,
    else where seq_idx changes (one host read)."""
    import torch
    if cu_seqlens is not None or seq_idx is None:
        return cu_seqlens
    s = seq_idx[0].cpu()
    cuts = (torch.nonzero(s[1:] != s[:-1]).flatten() + 1).tolist()
    return torch.tensor([0] + cuts + [int(s.shape[0])], dtype=torch.int32, device=x.device)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, _INF),
                              return_final_states=False, return_varlen_states=False):
    """mamba_ssm's mamba_chunk_scan_combined: x [B, T, nheads, headdim] (f16 / bf16; f32
    runs the recurrent kernel, and trains exactly in torch: ops/exact_train.py);
    dt [B, T, nheads]; A [nheads]; B, C [B, T, ngroups, dstate]; D [nheads] or
    [nheads, headdim]; z like x; dt_bias [nheads]; initial_states [B, nheads, headdim,
    dstate]; seq_idx [B, T] int (batch 1; the state resets where it changes) and / or
    cu_seqlens [N + 1] (the same boundaries; needed for return_varlen_states).
    chunk_size: any positive int (the result does not depend on it; the kernels run 64).
    Returns out [B, T, nheads, headdim] in x's dtype, then final_states f32 with
    return_final_states, then varlen_states [N, nheads, headdim, dstate] f32 with
    return_varlen_states. Differentiable in every tensor (ops/additive_bwd.py)."""
    if return_varlen_states and cu_seqlens is None:
        raise validate.error("return_varlen_states=True needs cu_seqlens")
    check_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
               cu_seqlens, dt_limit)
    import torch
    cu = _boundaries(x, seq_idx, cu_seqlens)
    h0 = initial_states
    if cu is not None and h0 is not None:       # the first sequence starts from it
        rest = h0.new_zeros((cu.shape[0] - 2,) + tuple(h0.shape[1:]))
        h0 = torch.cat([h0, rest], 0)
    q, k = C.to(x.dtype), B.to(x.dtype)
    if _terms_in_kernels(x, dt, A, B, C, D, z, dt_bias, h0):
        formed = kernel_terms(A, D, None if z is None else z.to(x.dtype).flatten(0, 1),
                              dt_bias, dt_softplus, dt_limit)
        y, ht = _chunk_kernel(SPEC, q, k, x, dt.float(), None, 1.0, h0, True, _OPTS, cu,
                              None, terms=formed)
    elif validate.needs_grad(x, dt, A, B, C, D, z, dt_bias, h0):
        formed = None       # (with z: its gate in torch, which keeps o + D x for dz)
        if z is None and _chunk_takes(x, B):
            formed = kernel_terms(A, D, None, dt_bias, dt_softplus, dt_limit)
        y, ht = terms.train(SPEC, _OPTS, q, k, x, dt, A, dt_bias=dt_bias,
                            dt_softplus=dt_softplus, dt_limit=dt_limit, D=D, z=z,
                            initial_state=h0, cu_seqlens=cu, dtype=x.dtype, formed=formed)
    else:
        v, g = terms.gate_and_value(SPEC, x, dt, A, dt_bias, dt_softplus, dt_limit)
        o, ht = _run(q, k, v, g, h0, True, cu)
        y = terms.epilogue(SPEC, o, x, D, z, x.dtype)
    out = (y,)
    if return_final_states:
        out += (ht[-1:] if cu is not None else ht,)
    if return_varlen_states:
        out += (ht,)
    return out[0] if len(out) == 1 else out


def _terms_in_kernels(x, *tensors) -> bool:
    """Whether the chunked kernels form the call terms (one pass over x, dt, z, no torch
    pass around them): a forward (no autograd: training goes by terms.train, whose
    forward forms them in the kernels too where z is off) of 16-bit x at head dims the
    chunked kernels take."""
    return not validate.needs_grad(x, *tensors) and _chunk_takes(x, tensors[2])


def _chunk_takes(x, B) -> bool:
    """Whether the chunked kernels take a call of x (16-bit, T > 1) and B at their head
    dims (the forward that forms the call terms)."""
    Bn, T, HV, V = x.shape
    dims = validate.Dims(Bn, T, B.shape[2], HV, B.shape[3], V)
    return T > 1 and api.chunk_supports(SPEC, dims, x.dtype)


def _chunk_kernel(*args, **kwargs):
    """The chunked forward's kernels with the call terms formed in them
    (ops/chunk.py run_chunk_forward; the tests replace it on the CPU)."""
    from .chunk import run_chunk_forward
    return run_chunk_forward(*args, **kwargs)


def _run(q, k, v, g, h0, final, cu_seqlens):
    """The generated chunked kernels of SPEC (a forward: training goes by terms.train)."""
    return api.forward(SPEC, q, k, v, g, None, scale=1.0, initial_state=h0,
                       output_final_state=final, options=_OPTS, cu_seqlens=cu_seqlens)


def _tied(name, x, axes):
    """x's value along ``axes`` must be one (Mamba-2's tied dt / A / dt_bias: stride 0)."""
    if x is not None and any(x.stride(a) != 0 and x.shape[a] != 1 for a in axes):
        raise validate.error(f"{name} must be the same along headdim (and dstate for A), "
                             f"as Mamba-2's (stride-0 expanded): a per-channel {name} is "
                             "Mamba-1's selective scan, not SSD")


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None):
    """mamba_ssm's selective_state_update, Mamba-2's form: state [batch, nheads, headdim,
    dstate] (f16 / bf16 / f32, updated in place; or a pool [P, ...] read and written at
    state_batch_indices [batch], a slot outside [0, P) skipped, its out zeros); x, z
    [batch, nheads, headdim]; dt [batch, nheads, headdim] and A [nheads, headdim, dstate],
    dt_bias [nheads, headdim] tied (stride 0) along headdim / dstate; B, C [batch,
    ngroups, dstate]; D [nheads] or [nheads, headdim]. Returns out [batch, nheads,
    headdim] in x's dtype. One kernel: the step, the decay, the value scale, the skip term
    and the output gate are formed in the recurrent kernel (the spec's call terms)."""
    q, k, v, g, terms = _decode_inputs(state, x, dt, A, B, C, D, z, dt_bias,
                                       state_batch_indices, dt_softplus)
    o, _ = _decode_kernel(SPEC, q, k, v, g, None, scale=1.0, initial_state=state,
                          options=_OPTS, ssm_state_indices=state_batch_indices,
                          inplace_final_state=True, terms=terms)
    return o[:, 0]


def _decode_kernel(*args, **kwargs):
    """The recurrent kernel (ops/recurrent.py run_recurrent; the tests replace it on the
    CPU)."""
    from .recurrent import run_recurrent
    return run_recurrent(*args, **kwargs)


def kernel_terms(A, D, z, dt_bias, dt_softplus, dt_limit=None):
    """The call terms the kernels form (the decode's run_recurrent, the chunked
    run_chunk_forward: their ``terms``): the step from the raw dt (g) with dt_bias,
    softplus and the clamp to dt_limit (None: none), the decay exp(A dt), the value scale,
    D x, silu(z). A, dt_bias [nheads]; D [nheads] or [nheads, headdim]; z as the kernel
    reads it (in x's dtype). D one value a head ([nheads], or repeated along headdim by
    stride 0) is read as [nheads] (skip_per_head)."""
    per_head = D is not None and (D.dim() == 1 or D.stride(1) == 0)
    flags = dict(step_dt=True, step_bias_on=dt_bias is not None,
                 step_softplus=bool(dt_softplus), step_clamp=dt_limit is not None,
                 value_scale=True, skip=D is not None, skip_per_head=per_head,
                 output_gate=z is not None)
    tensors = {"step_A": A.float().contiguous()}
    if dt_bias is not None:
        tensors["step_bias"] = dt_bias.float().contiguous()
    if dt_limit is not None:
        tensors["step_limit"] = _limit_tensor(float(dt_limit[0]), float(dt_limit[1]), A.device)
    if per_head:        # (Mamba2's D repeated along headdim: one value a head, no copy)
        tensors["skip_D"] = (D if D.dim() == 1 else D[:, 0]).float().contiguous()
    elif D is not None:
        tensors["skip_D"] = D.float().contiguous()
    if z is not None:
        tensors["gate_z"] = z.contiguous()
    return {"flags": flags, "tensors": tensors}


@functools.lru_cache(maxsize=16)
def _limit_tensor(lo: float, hi: float, device):
    """dt_limit as the kernels' step_limit [2] f32 on ``device``, made once (no host copy a
    call: a CUDA graph may capture the call)."""
    import torch
    return torch.tensor([lo, hi], dtype=torch.float32, device=device)


def _decode_inputs(state, x, dt, A, B, C, D, z, dt_bias, idx, dt_softplus):
    """selective_state_update's arguments checked (before device work) and as the
    kernel's: (q, k [batch, 1, ngroups, dstate], v [batch, 1, nheads, headdim] (x),
    g [batch, 1, nheads] f32 (the raw dt), terms)."""
    validate.check_tensor("x", x, dtypes=validate.INPUT_DTYPES, contiguous=False)
    if x.dim() != 3:
        raise validate.shape_error("x", x.shape, "[batch, nheads, headdim]")
    b, HV, V = x.shape
    validate.check_tensor("dt", dt, dtypes=validate.FLOAT_DTYPES, shape=(b, HV, V),
                          contiguous=False)
    validate.check_tensor("A", A, dtypes=validate.FLOAT_DTYPES, contiguous=False)
    for name, t in (("B", B), ("C", C)):
        validate.check_tensor(name, t, dtypes=validate.FLOAT_DTYPES, contiguous=False)
        if t.dim() != 3 or t.shape[0] != b or t.shape != B.shape:
            raise validate.shape_error(name, t.shape, f"[{b}, ngroups, dstate] (B and C alike)")
    G, K = B.shape[1], B.shape[2]
    if HV % G:
        raise validate.error(f"nheads ({HV}) must be a multiple of ngroups ({G}) of B and C")
    if tuple(A.shape) != (HV, V, K):
        raise validate.shape_error("A", A.shape, f"[{HV}, {V}, {K}] (nheads, headdim, dstate)")
    _f32_vector("D", D, HV, V)
    if dt_bias is not None:
        validate.check_tensor("dt_bias", dt_bias, dtypes=validate.FLOAT_DTYPES,
                              shape=(HV, V), contiguous=False)
    if z is not None:
        validate.check_tensor("z", z, dtypes=validate.FLOAT_DTYPES, shape=(b, HV, V),
                              contiguous=False)
    _tied("dt", dt, (2,))
    _tied("A", A, (1, 2))
    _tied("dt_bias", dt_bias, (1,))
    if K not in (16, 32, 64, 128, 256) or V % 8 or V > 512:
        raise validate.error(f"selective_state_update needs dstate in 16, 32, 64, 128, 256 "
                             f"and headdim a multiple of 8 up to 512, got dstate={K}, "
                             f"headdim={V}")
    validate.check_tensor("state", state, dtypes=validate.INPUT_DTYPES)
    if state.dim() != 4 or tuple(state.shape[1:]) != (HV, V, K) or (
            idx is None and state.shape[0] != b):
        raise validate.shape_error("state", state.shape, f"[{b if idx is None else 'P'}, "
                                   f"{HV}, {V}, {K}] (batch, nheads, headdim, dstate)")
    if idx is not None:
        validate.check_tensor("state_batch_indices", idx, dtypes=validate.INDEX_DTYPES,
                              shape=(b,), contiguous=False)
    validate.check_devices_as("x", x, state=state, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                           state_batch_indices=idx)
    q, k, v = (t.to(x.dtype).unsqueeze(1).contiguous() for t in (C, B, x))
    g = dt[:, :, 0].float().unsqueeze(1).contiguous()
    bias = None if dt_bias is None else dt_bias[:, 0]
    z = None if z is None else z.to(x.dtype).unsqueeze(1)
    return q, k, v, g, kernel_terms(A[:, 0, 0], D, z, bias, dt_softplus)
