"""The gate activations of fla's ``use_gate_in_kernel`` by torch (so that torch.autograd
differentiates them), and fla's standalone gate functions on them: fused_gdn_gate,
fused_kda_gate."""
from . import validate


def activate(g, A_log=None, dt_bias=None, lower_bound=None, per_channel=False):
    """g's activation in f32 (f64 kept): -exp(A_log) softplus(g + dt_bias), or with
    ``lower_bound`` (KDA's lower-bounded gate) lower_bound * sigmoid(exp(A_log) (g +
    dt_bias)) (exp(A_log) -> 1 without A_log). g [..., H] (one gate a head) or, with
    ``per_channel``, [..., H, C]; A_log H elements; dt_bias H (x C) elements."""
    import torch
    from ..dsl.torch_reference import softplus_fla
    x = g if g.dtype == torch.float64 else g.float()
    H = x.shape[-2] if per_channel else x.shape[-1]
    shape = (H, 1) if per_channel else (H,)
    if dt_bias is not None:
        x = x + dt_bias.to(x.dtype).reshape((H, -1) if per_channel else (H,))
    a = None if A_log is None else torch.exp(A_log.to(x.dtype).reshape(shape))
    if lower_bound is not None:
        return float(lower_bound) * torch.sigmoid(x if a is None else a * x)
    return -a * softplus_fla(x)


def _check(name, g, A_log, dt_bias, per_channel):
    import torch
    if not (isinstance(g, torch.Tensor) and g.is_floating_point()
            and g.dim() >= (2 if per_channel else 1)):
        raise validate.error(f"{name}: g must be a float tensor [..., H{', K' * per_channel}]"
                             f", got {validate.describe(g)}")
    H = g.shape[-2] if per_channel else g.shape[-1]
    n = H * (g.shape[-1] if per_channel else 1)
    for arg, t, want in (("A_log", A_log, H), ("dt_bias", dt_bias, n)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.numel() != want):
            raise validate.error(f"{name}: {arg} must have {want} elements, got "
                                 f"{validate.describe(t)}")


def fused_gdn_gate(g, A_log, dt_bias=None, output_dtype=None):
    """fla's fused_gdn_gate: -exp(A_log) softplus(g + dt_bias), g [..., HV], A_log and
    dt_bias HV elements; f32 math, the result in ``output_dtype`` (default float32);
    differentiable (torch)."""
    import torch
    _check("fused_gdn_gate", g, A_log, dt_bias, False)
    return activate(g, A_log, dt_bias).to(output_dtype or torch.float32)


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=None):
    """fla's fused_kda_gate: -exp(A_log) softplus(g + dt_bias) per key channel, or with
    ``lower_bound`` lower_bound * sigmoid(exp(A_log) (g + dt_bias)) (A_log optional then);
    g [..., H, K], A_log H elements, dt_bias H * K; f32 math, the result in
    ``output_dtype`` (default float32); differentiable (torch)."""
    import torch
    if A_log is None and lower_bound is None:
        raise validate.error("fused_kda_gate needs A_log (or lower_bound)")
    _check("fused_kda_gate", g, A_log, dt_bias, True)
    return activate(g, A_log, dt_bias, lower_bound, per_channel=True).to(
        output_dtype or torch.float32)


def check_safe_gate(safe_gate, lower_bound, use_gate_in_kernel) -> None:
    """fla's rules for KDA's safe gate: with use_gate_in_kernel, safe_gate needs a
    lower_bound in [-5, 0). safe_gate itself changes no result here (linattn's per-key
    chunk stages only ever exponentiate non-positive numbers); lower_bound changes the
    gate activation when use_gate_in_kernel (see inputs.kernel_inputs), else nothing."""
    if lower_bound is not None and (isinstance(lower_bound, bool)
                                    or not isinstance(lower_bound, (int, float))):
        raise validate.error(f"lower_bound must be a number or None, got "
                                 f"{validate.describe(lower_bound)}")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise validate.error("safe_gate=True with use_gate_in_kernel=True needs "
                                     "lower_bound (a float in [-5, 0), e.g. -5)")
        if not -5 <= lower_bound < 0:
            raise validate.error(f"lower_bound must be in the safe range [-5, 0), "
                                     f"got {lower_bound}")
