"""Exact training in torch: the chunked algorithm in fp64, differentiated by
torch.autograd (dsl/torch_reference.py chunked_forward).

Two kinds of call train this way: float32 calls (the generated kernels take float16 /
bfloat16; fla's own float32 tests train so), and calls of a spec with no generated
backward (the generalized delta rules: Comba, GDN-2, DPLR / IPLR / RWKV-7, each where its
kernels do not take the call; a user spec outside the trained rules and gates), in any
dtype. The spec's chunked forward runs in
fp64 on the call's device, every option applied as the kernels apply it, and
torch.autograd gives the gradients: exact, at torch's speed (no generated kernel), for
correctness work rather than for speed. Everything is checked first, as a kernel call is
(the device check last).
"""
from __future__ import annotations

import dataclasses


def is_float32(q) -> bool:
    import torch
    return getattr(q, "dtype", None) == torch.float32


_NOTED: set = set()


def note_no_kernels(spec, q) -> None:
    """Warn once per spec that a 16-bit call of a family with no backward kernels trains
    here (correct, but at torch's speed and fp64 memory)."""
    import warnings
    if not is_float32(q) and spec.name not in _NOTED:
        _NOTED.add(spec.name)
        warnings.warn(f"linattn: {spec.name} has no backward kernels yet; calls that need "
                      f"gradients train exactly in torch (fp64, far slower than kernels)",
                      stacklevel=4)


def train(spec, options, q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
          output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, A_log=None,
          dt_bias=None, lower_bound=None, g_gamma=None, rule_inputs=None, beta_ones=False):
    """(o [B, T, HV, V] in q's dtype, final state float32 or None) of a call of ``spec``
    (any rule and gate), differentiable in every tensor input; ``beta_ones``: a missing
    beta means ones; ``g_gamma`` [HV]: a decay per head added to g (simple GLA's);
    ``rule_inputs``: the rule's vector inputs by name (Comba's p, GDN-2's b, w, ...)."""
    import torch

    from ..dsl import torch_reference as tref
    from . import gates, validate
    validate.check_call(spec, options, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                        initial_state=initial_state, cu_seqlens=cu_seqlens,
                        cu_seqlens_cpu=cu_seqlens_cpu, lower_bound=lower_bound, scale=scale,
                        g_gamma=g_gamma, beta_optional=beta_ones, rule_inputs=rule_inputs,
                        values=validate.host_checks())
    if options.gate_in_kernel and lower_bound is not None:   # KDA's lower-bounded gate
        g = gates.activate(g.double(), A_log, dt_bias, lower_bound, per_channel=True)
        A_log = dt_bias = None
        options = dataclasses.replace(options, gate_in_kernel=False)
    if g_gamma is not None:
        gamma = g_gamma.double().view(1, 1, -1)
        g = gamma.expand(*v.shape[:3]) if g is None else g.double() + gamma
    if beta is None and beta_ones and spec.has_beta:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    o, final = tref.chunked_forward(spec, q, k, v, g, beta, options=options,
                                    scale=spec.scale_for(q.shape[-1], scale),
                                    initial_state=initial_state,
                                    cu_seqlens=None if cu is None else cu.cpu(),
                                    A_log=A_log, dt_bias=dt_bias,
                                    chunk_size=safe_chunk(spec, options, g, A_log, dt_bias),
                                    **(rule_inputs or {}))
    return o.to(q.dtype), (final.float() if output_final_state else None)


#: the largest |exponent| the fp64 chunked reference may form (exp(709) is its limit)
EXP_LIMIT = 500.0


def safe_chunk(spec, options, g, A_log=None, dt_bias=None) -> int:
    """The chunk size for the fp64 chunked reference (exact at any size): the spec's, halved
    while a chunk's decay from its middle could exceed EXP_LIMIT (the reference forms
    exp(+-(cumulative log decay)) about the middle token: fla's masked gates of -1000, or
    strong gates in the kernel, overflowed to inf and gave NaN), down to 1 (token by
    token)."""
    import torch
    from . import gates
    C = spec.chunk_size
    if g is None or not spec.has_gate:
        return C
    with torch.no_grad():
        x = g.detach().double()
        if options.gate_in_kernel:
            x = gates.activate(x, None if A_log is None else A_log.detach(),
                               None if dt_bias is None else dt_bias.detach(),
                               per_channel=spec.gate.value != "scalar")
        worst = float(x.abs().max()) if x.numel() else 0.0
    while C > 1 and worst * (C - C // 2) > EXP_LIMIT:
        C //= 2
    return C
