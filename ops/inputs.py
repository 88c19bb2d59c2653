"""A checked call's arguments in the form the kernels take: :func:`kernel_inputs`, shared
by the dispatch (ops/api.py forward / recurrent) and the training forward
(ops/autograd.py train_forward), with the head-dims check both pass to check_call
(:func:`head_dims`) and fla's missing beta (:func:`ones_beta`).
"""
from __future__ import annotations

import dataclasses

from ..dsl import OpSpec, Options
from . import gates, runtime, validate


def head_dims(dims) -> None:
    """Head dims some kernel takes, zero-padded where needed (ops/api.py padded_dims):
    the recurrent kernel's limits are the wider ones (the chunked kernels' calls outside
    theirs take it, see api.choose_path); check_call's ``sizes``."""
    validate.check_head_dims(dims.K, dims.V, k_multiple=1, v_multiple=1,
                             what="linattn (the recurrent kernel; the chunked ones: K, V up "
                             "to 256)")


def ones_beta(q, v):
    """fla's missing beta: ones [B, T, HV] in q's dtype."""
    import torch
    return torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)


def kernel_inputs(spec: OpSpec, options: Options, dims, q, k, v, g, beta, *, A_log=None,
                  dt_bias=None, lower_bound=None, g_gamma=None, initial_state=None,
                  rule_inputs=None, param_dtypes=("float32",)):
    """({q, k, v, g, beta, A_log, dt_bias, initial_state}, options) in the kernels' form
    (after check_call): contiguous (an in-place state is already), gates and beta in f32
    or q's dtype (ones for a missing beta), simple
    GLA's g_gamma added to g, A_log / dt_bias [HV] / [HV * K] / [HV * V] (zeros for no
    dt_bias) f32, or both in their dtype where they share one of ``param_dtypes`` (the
    recurrent kernel reads bf16 / f16 ones: no cast per decode step).
    KDA's ``lower_bound`` with use_gate_in_kernel: the gate lower_bound * sigmoid(
    exp(A_log) * (g + dt_bias)) (exp(A_log) -> 1 without A_log) is formed here in f32 and
    the kernels take it as a ready log decay. States: f32, f16 and bf16 as they are
    (the kernels read them as f32; an in-place one is updated in its dtype), f64 as f32.
    q, k, v of mixed dtypes (fla's kernels read each as it is): all three in their
    promoted dtype (an exact upcast; the caller returns o in q's dtype)."""
    import torch
    common = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = (t if t.dtype == common else t.to(common) for t in (q, k, v))

    def f32(x):
        return x if x is None else (x if x.dtype in (torch.float32, q.dtype)
                                    else x.float()).contiguous()
    if g_gamma is not None:
        gam = g_gamma.reshape(1, 1, dims.HV).float()
        g = (gam if g is None else g.float() + gam).expand(dims.B, dims.T, dims.HV).contiguous()
    if spec.has_beta and beta is None:
        beta = ones_beta(q, v)
    gate_params = options.gate_in_kernel and spec.has_gate
    HV, n = dims.HV, dims.HV * spec.gate.n_channels(dims.K, dims.V)
    keep = (A_log is not None and dt_bias is not None and A_log.dtype == dt_bias.dtype
            and runtime.dtype_name(A_log.dtype) in param_dtypes)
    param = (lambda t: t) if keep else (lambda t: t.float())  # noqa: E731
    a = param(A_log.reshape(HV)).contiguous() if gate_params and A_log is not None else None
    b = param(dt_bias.reshape(n)).contiguous() if gate_params and dt_bias is not None else None
    if gate_params and lower_bound is not None:
        g = gates.activate(g, a, b, lower_bound, per_channel=True)
        options, a, b = dataclasses.replace(options, gate_in_kernel=False), None, None
    elif gate_params and b is None:
        from .runtime import zeros
        b = zeros(q.device, n)
    h0 = initial_state
    if h0 is not None:       # (an in-place state passed the checks contiguous, not f64)
        h0 = (h0.float() if h0.dtype == torch.float64 else h0).contiguous()
    x = dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=f32(g),
             beta=f32(beta), A_log=a, dt_bias=b, initial_state=h0)
    if rule_inputs:     # the rule's vector inputs: a key (p) in q's dtype, gates f32 or q's
        axes = spec.rule.maths.vector_axes
        x["rule_inputs"] = {n: t.to(common).contiguous() if axes[n][0] == "H" else f32(t)
                            for n, t in rule_inputs.items()}
    return x, options
