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
#: the dtypes the kernel reads gate_in_kernel's A_log and dt_bias in (both the same one)
GATE_PARAM_DTYPES = ("float32", "bfloat16", "float16")


@contextlib.contextmanager
def tuning_override(**knobs):
    """Within the block, calls without ``tuning=`` use these knobs (block_v, threads, vec,
    warps_k) instead of the arch table's: lets a probe sweep the fla-named wrappers."""
    with runtime.overriding(_OVERRIDE, knobs):
        yield


def fused_recurrent(spec: OpSpec, q, k, v, g=None, beta=None, scale=None, initial_state=None,
                    output_final_state=False, options: Options = Options(), cu_seqlens=None,
                    A_log=None, dt_bias=None, state_dtype=None, cu_seqlens_cpu=None,
                    tuning=None, ssm_state_indices=None, num_accepted_tokens=None,
                    inplace_final_state=False, rule_inputs=None):
    """Recurrent forward of ``spec``; inputs are never modified (but for the in-place
    state: see inplace_final_state).

    q, k:    [B, T, H, K]  f16 / bf16 / f32
    v:       [B, T, HV, V] same dtype; HV % H == 0 (value head hv reads key head hv // (HV/H))
    g:       [B, T, HV] (scalar gate), [B, T, HV, K] (key gate) or [B, T, HV, V] (value
             gate), natural-log decay
             (raw, before the activation, with options.gate_in_kernel); f32 or q's dtype
    beta:    [B, T, HV] (delta rule); f32 or q's dtype
    rule_inputs: the rule's key-shaped inputs, name -> [B, T, H, K] in q's dtype (the
             comba rule's erase key p)
    scale:   multiplies q (default spec.default_scale, K ** -0.5)
    initial_state: [N, HV, K, V] ([N, HV, V, K] with options.state_v_first), f32, f16
             or bf16 (read as f32); N = B, or len(cu_seqlens) - 1 with varlen; with
             ssm_state_indices a pool [P, HV, K, V] (any P)
    cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (then B == 1);
             cu_seqlens_cpu: its CPU copy (checks without a device sync)
    A_log:   [HV], dt_bias: [HV] (scalar gate), [HV * K] (key gate) or [HV * V]
             (value gate), both f32, bf16 or f16 (the same), with
             options.gate_in_kernel: g <- -exp(A_log) * softplus(g + dt_bias)
    state_dtype: dtype of the final state (default torch.float32; the
             DeltaNetRecurrentFwd / GLARecurrentFwd contracts keep it in q's dtype; with
             inplace_final_state the initial state's)
    ssm_state_indices: int32/int64 [N] or [N, S]: sequence n starts from pool slot
             [n] or [n, c] (c = num_accepted_tokens[n] - 1 with num_accepted_tokens
             int [N], else 0); a slot outside [0, P) skips the sequence (its o rows
             are zeros; nothing read or written)
    inplace_final_state: write into initial_state: the final state to row n (no pool),
             slot [n] ([N]) or, after each token t, slot [n, t] ([N, S]); returns
             initial_state as the final state. Slots not named are never touched.
    tuning:  optional override of the arch table's knobs (block_v, threads, vec,
             warps_k: see codegen/arch/<arch>/decode.py), for probes and sweeps

    Returns (o [B, T, HV, V] in q's dtype, final_state in the initial state's layout and
    ``state_dtype`` when output_final_state, else None). Checks every argument, then
    :func:`run_recurrent`.
    """
    _check(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log,
           dt_bias, state_dtype, scale, ssm_state_indices=ssm_state_indices,
           num_accepted_tokens=num_accepted_tokens, inplace=bool(inplace_final_state),
           rule_inputs=rule_inputs)
    return run_recurrent(spec, q, k, v, g, beta, scale, initial_state, output_final_state,
                         options, cu_seqlens, A_log, dt_bias, state_dtype, tuning,
                         ssm_state_indices, num_accepted_tokens, inplace_final_state,
                         rule_inputs=rule_inputs)


def run_recurrent(spec: OpSpec, q, k, v, g=None, beta=None, scale=None, initial_state=None,
                  output_final_state=False, options: Options = Options(), cu_seqlens=None,
                  A_log=None, dt_bias=None, state_dtype=None, tuning=None,
                  ssm_state_indices=None, num_accepted_tokens=None,
                  inplace_final_state=False, terms=None, rule_inputs=None):
    """:func:`fused_recurrent` on arguments already checked (its own checks, or the public
    call's ops/validate.py check_call: torch.library's recurrent ops), so that a call is
    checked once. ``terms``: a spec's call terms formed in the kernel (dsl/call_terms.py;
    ops/mamba2.py): {"flags": build() keywords, "tensors": the kernel's tensors by name};
    the terms' tensors a call leaves out are placeholders."""
    import torch
    pool = dict(ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                inplace=bool(inplace_final_state))
    (B, T, H, K), (HV, V) = q.shape, v.shape[2:]
    dims = validate.Dims(B, T, H, HV, K, V)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    state_dtype = _state_dtype(state_dtype, initial_state, pool["inplace"])
    scale = spec.scale_for(K, scale)
    in_pool = ssm_state_indices is not None
    o = torch.empty(dims.B, dims.T, dims.HV, dims.V, dtype=q.dtype, device=q.device)
    ht = initial_state if inplace_final_state else (
        torch.empty(validate.state_shape(N, dims, options.state_v_first), dtype=state_dtype,
                    device=q.device) if output_final_state else None)
    if q.numel() == 0 or o.numel() == 0 or N == 0:
        o.zero_()
        if ht is not None and not inplace_final_state:
            ht.copy_(_start_states(initial_state, N, **pool) if initial_state is not None
                     else torch.zeros_like(ht))
        return o, ht
    problem = _problem(spec, options, dims, q, g, beta, initial_state, state_dtype,
                       output_final_state, cu_seqlens, **pool, rule_inputs=rule_inputs,
                       A_log=A_log)
    problem.update((terms or {}).get("flags", {}))
    arch = runtime.arch_of(q.device)
    kernel, module, _ = runtime.get_kernel(spec, STAGE, arch, sizes={"N": N},
                                           **problem, **(tuning or _OVERRIDE))
    slot_dtype = getattr(torch, problem.get("slot_dtype", "int32"))
    stand_in = lambda dtype: runtime.placeholder(q.device, dtype)  # noqa: E731
    tensors = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
        "h0": initial_state if initial_state is not None else stand_in(state_dtype),
        "cu_seqlens": cu_seqlens if cu_seqlens is not None else stand_in(torch.int32),
        "slots": ssm_state_indices if in_pool else stand_in(slot_dtype),
        "accepted": (num_accepted_tokens.to(slot_dtype) if num_accepted_tokens is not None
                     else stand_in(slot_dtype)),
        "scale": scale, "o": o, "ht": ht if ht is not None else stand_in(state_dtype),
    }
    tensors.update(rule_inputs or {})
    if not options.gate_in_kernel:
        tensors["A_log"] = tensors["dt_bias"] = stand_in(torch.float32)
    tensors.update((terms or {}).get("tensors", {}))
    kernel(*[tensors[name] if name in tensors else stand_in(torch.float32)
             for name in module.args(**problem)])
    return o, ht


def _start_states(initial_state, N, ssm_state_indices=None, num_accepted_tokens=None,
                  inplace=False):
    """Each sequence's starting state (a call without tokens: its final state)."""
    import torch
    if ssm_state_indices is None:
        return initial_state
    idx = ssm_state_indices.long()
    if idx.dim() == 2:
        col = (num_accepted_tokens.long() - 1 if num_accepted_tokens is not None
               else torch.zeros(N, dtype=torch.long, device=idx.device))
        idx = idx.gather(1, col.clamp(0, idx.shape[1] - 1).unsqueeze(1))[:, 0]
    live = (idx >= 0) & (idx < initial_state.shape[0])
    out = initial_state[idx.clamp(0, initial_state.shape[0] - 1)].float()
    return out * live.view(-1, 1, 1, 1)


def _check(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu,
           A_log, dt_bias, state_dtype, scale, ssm_state_indices=None,
           num_accepted_tokens=None, inplace=False, rule_inputs=None):
    """The kernel's checks (device last): (dims, N, state_dtype, scale)."""
    import torch
    validate.reject_grad(spec, q, k, v, g, beta, initial_state, A_log, dt_bias,
                         *(rule_inputs or {}).values())
    spec.check_options(options)
    dims = validate.check_qkv(spec, q, k, v)
    validate.check_gate(spec, g, dims, q)
    validate.check_beta(spec, beta, dims, q)
    validate.check_rule_inputs(spec, dims, rule_inputs, q)
    validate.check_gate_params(spec, options, A_log, dt_bias, dims, q, GATE_PARAM_DTYPES)
    N = validate.check_cu_seqlens(cu_seqlens, dims.B, dims.T, cu_seqlens_cpu, q,
                                  values=validate.host_checks())
    states = (torch.float32, torch.float16, torch.bfloat16)
    state_dtype = _state_dtype(state_dtype, initial_state, inplace)
    if state_dtype not in states:
        raise validate.error(f"state_dtype must be float32, float16 or bfloat16, "
                             f"got {state_dtype}")
    validate.check_pool(ssm_state_indices, num_accepted_tokens, initial_state, inplace, N)
    if ssm_state_indices is not None:
        validate.check_tensor("ssm_state_indices", ssm_state_indices, like=q)
        if initial_state is None:
            raise validate.error("ssm_state_indices needs initial_state (the state pool)")
    v_first = options.state_v_first
    validate.check_state("initial_state", initial_state,
                         None if ssm_state_indices is not None else N, dims, v_first, states,
                         q)
    validate.check_head_dims(dims.K, dims.V, what="the recurrent kernel")
    if v_first and dims.K not in (16, 32, 64, 128, 256):
        raise validate.error(f"state_v_first in the recurrent kernel needs K in 16, 32, 64, "
                             f"128, 256; got K={dims.K}")
    scale = spec.scale_for(dims.K, scale)
    validate.check_cuda("q", q)
    return dims, N, state_dtype, scale


def _state_dtype(state_dtype, initial_state, inplace: bool):
    """The final state's dtype: an in-place state's own, else state_dtype (f32 by default)."""
    import torch
    if inplace and initial_state is not None:
        return initial_state.dtype
    return torch.float32 if state_dtype is None else state_dtype


def _problem(spec, options, dims, q, g, beta, initial_state, state_dtype, output_final_state,
             cu_seqlens, ssm_state_indices=None, num_accepted_tokens=None,
             inplace=False, rule_inputs=None, A_log=None) -> dict:
    """The build() keywords describing one call (sizes, dtypes, flags)."""
    problem = dict(H=dims.H, HV=dims.HV, K=dims.K, V=dims.V,
                   dtype=runtime.dtype_name(q.dtype),
                   state_dtype=runtime.dtype_name(state_dtype),
                   l2norm_qk=options.l2norm_qk, beta_sigmoid=options.beta_sigmoid,
                   allow_neg_eigval=options.allow_neg_eigval,
                   gate_in_kernel=options.gate_in_kernel, state_v_first=options.state_v_first,
                   has_initial_state=initial_state is not None,
                   output_final_state=bool(output_final_state) and not inplace,
                   varlen=cu_seqlens is not None,
                   index_dtype=runtime.dtype_name(cu_seqlens.dtype) if cu_seqlens is not None
                   else "int32")
    if initial_state is not None and initial_state.dtype != state_dtype:
        problem["h0_dtype"] = runtime.dtype_name(initial_state.dtype)
    if ssm_state_indices is not None:
        problem.update(state_pool=True, slot_dtype=runtime.dtype_name(ssm_state_indices.dtype),
                       slots_per_token=ssm_state_indices.dim() == 2,
                       accepted_tokens=num_accepted_tokens is not None)
    if inplace:
        problem["inplace"] = True
    if spec.has_gate:
        problem["g_dtype"] = runtime.dtype_name(g.dtype)
    if options.gate_in_kernel and runtime.dtype_name(A_log.dtype) != "float32":
        problem["gate_param_dtype"] = runtime.dtype_name(A_log.dtype)   # (f32: the default)
    if spec.has_beta:
        problem["beta_dtype"] = runtime.dtype_name(beta.dtype)
    for name in spec.rule.maths.dtype_inputs:      # (GDN-2's b, w)
        problem[f"{name}_dtype"] = runtime.dtype_name(rule_inputs[name].dtype)
    return problem
