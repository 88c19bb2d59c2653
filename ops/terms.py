"""The call terms (dsl/call_terms.py) around a training call's generated kernels: the
value scale v' = dt v and the skip term o + D v as autograd Functions whose forward and
backward are each one pass over the [B, T, HV, V] tensors, in the inputs' dtypes, with the
products formed in float32 and rounded once (the values of dsl/call_terms.py's torch
expressions at float32, bit for bit, without their float32 copies of v, o and the
gradients). The step and gate ([B, T, HV]) stay torch autograd (dsl/call_terms.py step).

:func:`train` (Mamba-2's training) puts the value scale, the additive call
(additive_bwd.run_forward / additive_backward) and the skip term in one Function, so that
dv' reaches the terms' backward as the kernels leave it (f32 where dqkvg's key blocks add
it: no cast) and x's gradient is formed once, dx = dy D (rounded into x's dtype) + dv' s
(added in f32, rounded once): no autograd add of x's two gradients. Each term is a piece
the Function composes (value scale: s or None; skip: D or None).

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


def train(spec: OpSpec, options, q, k, x, dt, A, *, dt_bias=None, dt_softplus=False,
          dt_limit=None, D=None, z=None, initial_state=None, scale=1.0, cu_seqlens=None,
          dtype=None, formed=None):
    """A differentiable additive call of a spec with call terms (step 'dt'): the step and
    gate A dt ([B, T, HV]) and the output gate by torch autograd; the value scale, the
    additive call and the skip term one autograd Function (:func:`_terms_call`: dv'
    reaches the terms' backward as the kernels leave it, dx formed once). q, k
    [B, T, H, K], x [B, T, HV, V] 16-bit; the rest as :func:`gate_and_value` /
    :func:`epilogue`. Returns (y in ``dtype`` (x's), final state). formed: the value
    scale and the skip term as the forward kernels form them (ops/mamba2.py
    kernel_terms, no output gate), or None: torch forms them. Calls the kernels do not
    take as they are (float32, key blocks, padded head dims) go through
    :func:`gate_and_value`, additive_bwd.train and :func:`epilogue`."""
    import torch
    import torch.nn.functional as F
    from . import additive_bwd
    dtype = dtype or x.dtype
    s = call_terms.step(dt.float(), None if dt_bias is None else dt_bias.float(),
                        dt_softplus, dt_limit)
    g = s * A.float().reshape(-1)
    call = additive_bwd.training_call(spec, options, q, k, x, g, scale, initial_state, True,
                                      cu_seqlens)
    if call is None:
        v = _function("ScaledValue").apply(x, s) if spec.value_scale == "dt" else x
        o, ht = additive_bwd.train(spec, options, q, k, v, g, scale, initial_state, True,
                                   cu_seqlens, None)
        return epilogue(spec, o, x, D, z, dtype), ht
    gate = spec.output_gate == "silu" and z is not None
    kernel = None if formed is None else (formed, dt.detach().float().contiguous())
    y, ht = _function("TermsCall").apply(
        call, torch.float32 if gate else dtype, q.contiguous(), k.contiguous(),
        x.contiguous(), s if spec.value_scale == "dt" else None, g.contiguous(),
        initial_state, D if spec.skip else None, kernel)
    return ((y * F.silu(z)).to(dtype) if gate else y), ht


def terms_backward(x, s, D, dy, dv, need_x=True, need_s=True, need_D=True):
    """The value scale's and the skip term's backward around an additive call: x
    [B, T, HV, V] 16-bit, s [B, T, HV] f32 (None: no value scale), D [HV] or [HV, V]
    (None: no skip), dy y's gradient (any float dtype; None: zero), dv v' = x s's (f32 as
    the key blocks add it, or 16-bit). Returns (dx in x's dtype, ds f32, dD f32): dx =
    dv s + dy D with one pass over dv (dy D rounded once into dx, dv s added to it in f32
    and rounded once), ds = sum_V dv x and dD = sum (dy x) from f32 products."""
    import torch
    dx = ds = dD = None
    Dm = None if D is None else D.float().reshape(x.shape[2], -1)
    if need_s and s is not None:
        ds = _products(dv, x).sum(-1)
    if need_D and D is not None:
        dD = (torch.zeros(D.shape, dtype=torch.float32, device=D.device) if dy is None
              else _skip_dD(dy, x, D))
    if need_x:
        if Dm is not None and dy is not None:
            dx = torch.mul(dy, Dm, out=torch.empty_like(x))
        if s is None:
            dx = dv.to(x.dtype) if dx is None else dx.add_(dv)
        elif dx is None:
            dx = _scaled(dv, s, x.dtype)
        else:
            dx = torch.addcmul(dx, dv, s.unsqueeze(-1), out=dx)
    return dx, ds, dD


def kernel_terms_grads(x, s, D, dx, ds, dD):
    """The terms' gradients as dqkvg leaves them (additive_bwd.run_backward's terms) in
    the inputs' shapes: dx (f32 where the key blocks add it) in x's dtype, ds [B, T, HV]
    f32 (None without the value scale), dD [HV, V] summed over V for a D per head."""
    dx = dx.view(x.shape).to(x.dtype)
    ds = None if s is None else ds.view(s.shape)
    if D is not None:
        dD = (dD.sum(-1) if D.float().reshape(D.shape[0], -1).shape[1] == 1 else dD)
        dD = dD.reshape(D.shape)
    return dx, ds, dD


def _products(a, b):
    """a * b [..] float32 from 16-bit (or float32) a, b: one pass (a float32 zero of one
    element added, so the product is formed in float32; exact for 16-bit a, b)."""
    import torch
    zero = torch.zeros((1,) * a.dim(), dtype=torch.float32, device=a.device)
    return torch.addcmul(zero, a, b)


def _scaled(x, s, dtype=None):
    """x s[..., None] rounded once into ``dtype`` (x's): the value scale v' = x s, or its
    gradient's dx = dv' s; x itself without a scale (s None)."""
    import torch
    if s is None:
        return x
    return torch.mul(x, s.unsqueeze(-1), out=torch.empty_like(x, dtype=dtype or x.dtype))


def _skip(o, x, D, dtype):
    """y = o + D x rounded once into ``dtype``; D [HV] or [HV, V]."""
    import torch
    Dm = D.float().reshape(x.shape[2], -1)
    return torch.addcmul(o, x, Dm, out=torch.empty(o.shape, dtype=dtype, device=o.device))


def _skip_dD(dy, x, D):
    """D's gradient sum (dy x) from f32 products, in D's shape ([HV] or [HV, V])."""
    dims = (0, 1) if D.float().reshape(x.shape[2], -1).shape[1] > 1 else (0, 1, 3)
    return _products(dy, x).sum(dims).reshape(D.shape)


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
            return _scaled(x, s)

        @staticmethod
        def backward(ctx, dv):
            x, s = ctx.saved_tensors
            dx = ds = None
            if ctx.needs_input_grad[0]:
                dx = _scaled(dv, s, x.dtype)
            if ctx.needs_input_grad[1]:
                ds = _products(dv, x).sum(-1)
            return dx, ds

    class Skip(torch.autograd.Function):
        """y = o + D x in ``dtype``; o, x [B, T, HV, V], D [HV] or [HV, V]."""
        @staticmethod
        def forward(ctx, o, x, D, dtype):
            ctx.save_for_backward(x, D)
            return _skip(o, x, D, dtype)

        @staticmethod
        def backward(ctx, dy):
            x, D = ctx.saved_tensors
            Dm = D.float().reshape(x.shape[2], -1)
            dx = dD = None
            if ctx.needs_input_grad[1]:
                dx = torch.mul(dy, Dm, out=torch.empty_like(x))
            if ctx.needs_input_grad[2]:
                dD = _skip_dD(dy, x, D)
            return dy, dx, dD, None

    return {"ScaledValue": ScaledValue, "Skip": Skip, "TermsCall": _terms_call()}


def _terms_call():
    """The autograd Function of the value scale, an additive call and the skip term:
    forward v' = x s (x's dtype, rounded once), (o, final) = additive_bwd.run_forward,
    y = o + D x in ``dtype``, or (kernel: (the formed terms, the raw dt)) y, final from
    the kernels forming v' and the skip term themselves (x is kept, v' is not); backward
    additive_bwd.additive_backward with the terms formed by dqkvg where the arch's does
    (additive_bwd.dqkvg_terms: dx, ds, dD from the kernel, v' = x s formed by dqkvg and the
    states' recompute), else additive_backward(raw_dv) then :func:`terms_backward` (no
    cast of dv, no autograd add of x's two gradients)."""
    import torch
    from . import additive_bwd

    class TermsCall(torch.autograd.Function):
        @staticmethod
        def forward(ctx, call, dtype, q, k, x, s, g, initial_state, D, kernel):
            v = None
            if kernel is not None:          # (v' and o + D x formed by the kernels)
                o, final, states = additive_bwd.run_forward(call, q, k, x, kernel[1],
                                                            initial_state, terms=kernel[0])
            else:
                v = _scaled(x, s)
                o, final, states = additive_bwd.run_forward(call, q, k, v, g, initial_state)
                if D is not None:
                    o = _skip(o, x, D, dtype)
            ctx.call, ctx.kernel = call, kernel
            ctx.save_for_backward(q, k, v, g, initial_state, states, x, s, D)
            ctx.set_materialize_grads(False)
            return o, final

        @staticmethod
        def backward(ctx, dy, dht):
            q, k, v, g, h0, states, x, s, D = ctx.saved_tensors
            need = ctx.needs_input_grad
            dq = dk = dv = dg = dh0 = None
            kt = (additive_bwd.dqkvg_terms(ctx.call, q, s, D, ctx.kernel) if any(need[2:8])
                  else None)
            if kt is not None:      # (the terms' gradients formed by dqkvg)
                kt["value"] = v     # (v' where the forward kept it: the recompute's)
                dq, dk, dx, dg, dh0, ds, dD = additive_bwd.additive_backward(
                    ctx.call, q, k, x, g, h0, states, dy, dht, raw_dv=True, terms=kt)
                dx, ds, dD = kernel_terms_grads(x, s, D, dx, ds, dD)
                return (None, None, dq if need[2] else None, dk if need[3] else None,
                        dx if need[4] else None, ds if need[5] else None,
                        dg if need[6] else None, dh0 if need[7] else None,
                        dD if need[8] else None, None)
            if any(need[2:8]):      # (else only dD: the call's gradients unused)
                v = _scaled(x, s) if v is None else v
                dq, dk, dv, dg, dh0 = additive_bwd.additive_backward(
                    ctx.call, q, k, v, g, h0, states, dy, dht, raw_dv=True)
            dx, ds, dD = terms_backward(x, s, D, dy, dv, need[4], need[5], need[8])
            return (None, None, dq if need[2] else None, dk if need[3] else None, dx, ds,
                    dg if need[6] else None, dh0 if need[7] else None, dD, None)

    return TermsCall
