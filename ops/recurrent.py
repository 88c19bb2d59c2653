"""The fused recurrent forward (decode, short sequences, varlen) for any spec.

One generated kernel (stage "recurrent") per spec runs the recurrence token by token
with the state on chip; see generated/<arch>/<op>/recurrent.py. The fla-named wrappers
(fused_recurrent_gated_delta_rule, ...) in ops/<family>.py call :func:`fused_recurrent`.
"""
from __future__ import annotations

import contextlib

from ..dsl import OpSpec, Options
from . import runtime, validate

STAGE = "recurrent"
#: knobs applied to every call that passes no ``tuning`` (probes: see tuning_override)
_OVERRIDE: dict = {}


@contextlib.contextmanager
def tuning_override(**knobs):
    """Within the block, calls without ``tuning=`` use these knobs (block_v, threads, vec,
    warps_k) instead of the arch table's: lets a probe sweep the fla-named wrappers."""
    prev = dict(_OVERRIDE)
    _OVERRIDE.clear()
    _OVERRIDE.update(knobs)
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(prev)


def fused_recurrent(spec: OpSpec, q, k, v, g=None, beta=None, scale=None, initial_state=None,
                    output_final_state=False, options: Options = Options(), cu_seqlens=None,
                    A_log=None, dt_bias=None, state_dtype=None, cu_seqlens_cpu=None,
                    tuning=None, ssm_state_indices=None, num_accepted_tokens=None,
                    inplace_final_state=False):
    """Recurrent forward of ``spec``; inputs are never modified.

    q, k:    [B, T, H, K]  f16 / bf16 / f32
    v:       [B, T, HV, V] same dtype; HV % H == 0 (value head hv reads key head hv // (HV/H))
    g:       [B, T, HV] (scalar gate) or [B, T, HV, K] (key gate), natural-log decay
             (raw, before the activation, with options.gate_in_kernel); f32 or q's dtype
    beta:    [B, T, HV] (delta rule); f32 or q's dtype
    scale:   multiplies q (default spec.default_scale, K ** -0.5)
    initial_state: [N, HV, K, V] ([N, HV, V, K] with options.state_v_first) of
             ``state_dtype``; N = B, or len(cu_seqlens) - 1 with varlen
    cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (then B == 1);
             cu_seqlens_cpu: its CPU copy (checks without a device sync)
    A_log:   [HV] f32, dt_bias: [HV] (scalar gate) or [HV * K] (key gate) f32, with
             options.gate_in_kernel: g <- -exp(A_log) * softplus(g + dt_bias)
    state_dtype: dtype of initial and final states (default torch.float32; the
             DeltaNetRecurrentFwd / GLARecurrentFwd contracts keep it in q's dtype)
    tuning:  optional override of the arch table's knobs (block_v, threads, vec,
             warps_k: see codegen/arch/sm90.py), for probes and sweeps

    Returns (o [B, T, HV, V] in q's dtype, final_state in the initial state's layout and
    ``state_dtype`` when output_final_state, else None).
    """
    import torch
    if ssm_state_indices is not None or num_accepted_tokens is not None or inplace_final_state:
        raise validate.error("ssm_state_indices / num_accepted_tokens / inplace_final_state "
                             "are not supported yet")
    dims, N, state_dtype, scale = _check(spec, options, q, k, v, g, beta, initial_state,
                                         cu_seqlens, cu_seqlens_cpu, A_log, dt_bias,
                                         state_dtype, scale)
    v_first = options.state_v_first
    o = torch.empty(dims.B, dims.T, dims.HV, dims.V, dtype=q.dtype, device=q.device)
    ht = (torch.empty(validate.state_shape(N, dims, v_first), dtype=state_dtype, device=q.device)
          if output_final_state else None)
    if q.numel() == 0 or o.numel() == 0 or N == 0:
        if ht is not None:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht
    problem = _problem(spec, options, dims, q, g, beta, initial_state, state_dtype,
                       output_final_state, cu_seqlens)
    arch = runtime.device_arch(q.device)
    kernel, module, _ = runtime.get_kernel(spec, STAGE, arch, sizes={"N": N},
                                           **problem, **(tuning or _OVERRIDE))
    dummy_f32 = runtime.placeholder(q.device, torch.float32)
    tensors = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
        "h0": initial_state if initial_state is not None else runtime.placeholder(q.device, state_dtype),
        "cu_seqlens": cu_seqlens if cu_seqlens is not None else runtime.placeholder(q.device, torch.int32),
        "scale": scale, "o": o,
        "ht": ht if ht is not None else runtime.placeholder(q.device, state_dtype),
    }
    if not options.gate_in_kernel:
        tensors["A_log"] = tensors["dt_bias"] = dummy_f32
    kernel(*[tensors[name] for name in module.args(**problem)])
    return o, ht


def _check(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu,
           A_log, dt_bias, state_dtype, scale):
    """The kernel's checks (device last): (dims, N, state_dtype, scale)."""
    import torch
    from .api import host_checks
    validate.reject_grad(spec, q, k, v, g, beta, initial_state, A_log, dt_bias)
    spec.check_options(options)
    dims = validate.check_qkv(spec, q, k, v)
    validate.check_gate(spec, g, dims, q)
    validate.check_beta(spec, beta, dims, q)
    validate.check_gate_params(spec, options, A_log, dt_bias, dims, q)
    N = validate.check_cu_seqlens(cu_seqlens, dims.B, dims.T, cu_seqlens_cpu, q,
                                  values=host_checks())
    state_dtype = torch.float32 if state_dtype is None else state_dtype
    if state_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise validate.error(f"state_dtype must be float32, float16 or bfloat16, "
                             f"got {state_dtype}")
    v_first = options.state_v_first
    validate.check_state("initial_state", initial_state, N, dims, v_first, state_dtype, q)
    validate.check_head_dims(dims.K, dims.V, what="the recurrent kernel")
    if v_first and dims.K not in (16, 32, 64, 128, 256):
        raise validate.error(f"state_v_first in the recurrent kernel needs K in 16, 32, 64, "
                             f"128, 256; got K={dims.K}")
    scale = spec.scale_for(dims.K, scale)
    validate.check_cuda("q", q)
    return dims, N, state_dtype, scale


def _problem(spec, options, dims, q, g, beta, initial_state, state_dtype, output_final_state,
             cu_seqlens) -> dict:
    """The build() keywords describing one call (sizes, dtypes, flags)."""
    problem = dict(H=dims.H, HV=dims.HV, K=dims.K, V=dims.V,
                   dtype=runtime.dtype_name(q.dtype),
                   state_dtype=runtime.dtype_name(state_dtype),
                   l2norm_qk=options.l2norm_qk, beta_sigmoid=options.beta_sigmoid,
                   allow_neg_eigval=options.allow_neg_eigval,
                   gate_in_kernel=options.gate_in_kernel, state_v_first=options.state_v_first,
                   has_initial_state=initial_state is not None,
                   output_final_state=bool(output_final_state),
                   varlen=cu_seqlens is not None,
                   index_dtype=runtime.dtype_name(cu_seqlens.dtype) if cu_seqlens is not None
                   else "int32")
    if spec.has_gate:
        problem["g_dtype"] = runtime.dtype_name(g.dtype)
    if spec.has_beta:
        problem["beta_dtype"] = runtime.dtype_name(beta.dtype)
    return problem
