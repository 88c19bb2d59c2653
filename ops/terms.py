"""The call terms (dsl/call_terms.py) around a training call's generated kernels: the
value scale v' = dt v and the skip term o + D v as autograd Functions whose forward and
backward are each one pass over the [B, T, HV, V] tensors, in the inputs' dtypes, with the
products formed in float32 and rounded once (the values of dsl/call_terms.py's torch
expressions at float32, bit for bit, without their float32 copies of v, o and the
gradients). The step and gate ([B, T, HV]) stay torch autograd (dsl/call_terms.py step).

Per x-sized tensor (B T HV V elements, 2 bytes in 16 bits) the forward reads x, writes
v' once and reads o, x, writes y once; the backward writes dx twice (one pass each term,
summed by autograd) and reads each term's gradient and x once more for its reduction
(ds: over V; dD: over B, T (and V)), the products in float32 by a [1, 1, 1, 1] float32
zero added to them (so the 16-bit operands are read as they are)."""
from __future__ import annotations

from ..dsl import OpSpec
from ..dsl import call_terms


def gate_and_value(spec: OpSpec, x, dt, A, dt_bias=None, dt_softplus=False, dt_limit=None):
    """dsl/call_terms.py gate_and_value at float32 for the ops: (v' [B, T, HV, V] in x's
    dtype, g = A dt [B, T, HV] float32); v' = x dt formed in float32, rounded once (one
    pass over x, and over its gradient in the backward)."""
    import torch
    s = call_terms.step(dt.float(), None if dt_bias is None else dt_bias.float(),
                        dt_softplus, dt_limit)
    g = s * A.float().reshape(-1)
    if spec.value_scale == "dt":
        x = _function("ScaledValue").apply(x, s)
    return x, g


def epilogue(spec: OpSpec, o, x, D=None, z=None, dtype=None):
    """dsl/call_terms.py epilogue, returned in ``dtype`` (default o's): o + D x (D [HV] or
    [HV, V]) formed in float32 and rounded once to ``dtype`` (float32 while an output gate
    follows), then o * silu(z), rounded once."""
    import torch
    import torch.nn.functional as F
    dtype = dtype or o.dtype
    gate = spec.output_gate == "silu" and z is not None
    if spec.skip and D is not None:
        o = _function("Skip").apply(o, x, D, torch.float32 if gate else dtype)
    if gate:
        o = o * F.silu(z)
    return o.to(dtype)


def _products(a, b):
    """a * b [..] float32 from 16-bit (or float32) a, b: one pass (a float32 zero of one
    element added, so the product is formed in float32; exact for 16-bit a, b)."""
    import torch
    zero = torch.zeros((1,) * a.dim(), dtype=torch.float32, device=a.device)
    return torch.addcmul(zero, a, b)


def _function(name: str):
    """The autograd Function ``name`` (built on first use: importing needs no torch)."""
    if name not in _FUNCTIONS:
        _FUNCTIONS.update(_make_functions())
    return _FUNCTIONS[name]


_FUNCTIONS: dict = {}


def _make_functions() -> dict:
    import torch

    class ScaledValue(torch.autograd.Function):
        """v' = x s[..., None] in x's dtype; x [B, T, HV, V], s [B, T, HV] float32."""
        @staticmethod
        def forward(ctx, x, s):
            ctx.save_for_backward(x, s)
            return torch.mul(x, s.unsqueeze(-1), out=torch.empty_like(x))

        @staticmethod
        def backward(ctx, dv):
            x, s = ctx.saved_tensors
            dx = ds = None
            if ctx.needs_input_grad[0]:
                dx = torch.mul(dv, s.unsqueeze(-1), out=torch.empty_like(x))
            if ctx.needs_input_grad[1]:
                ds = _products(dv, x).sum(-1)
            return dx, ds

    class Skip(torch.autograd.Function):
        """y = o + D x in ``dtype``; o, x [B, T, HV, V], D [HV] or [HV, V]."""
        @staticmethod
        def forward(ctx, o, x, D, dtype):
            Dm = D.float().reshape(x.shape[2], -1)
            ctx.save_for_backward(x, D)
            return torch.addcmul(o, x, Dm, out=torch.empty(o.shape, dtype=dtype,
                                                           device=o.device))

        @staticmethod
        def backward(ctx, dy):
            x, D = ctx.saved_tensors
            Dm = D.float().reshape(x.shape[2], -1)
            dx = dD = None
            if ctx.needs_input_grad[1]:
                dx = torch.mul(dy, Dm, out=torch.empty_like(x))
            if ctx.needs_input_grad[2]:
                dims = (0, 1) if Dm.shape[1] > 1 else (0, 1, 3)
                dD = _products(dy, x).sum(dims).reshape(D.shape)
            return dy, dx, dD, None

    return {"ScaledValue": ScaledValue, "Skip": Skip}
