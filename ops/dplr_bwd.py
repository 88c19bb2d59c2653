"""The dplr rule's chunked backward through its kernels (docs/design.md "DPLR's
backward"): the host side of codegen/arch/sm90/dplr.py's dplr_bwd_plan.

Wired: a 16-bit chunk_* call of the dplr rule that needs gradients, where the chunked
forward fits, trains here (ops/dplr.py run -> :func:`train`); its GPU check is
tests/test_dplr_bwd_gpu.py (passed in runs s42-1 / s42-3, before the kernels stored the
gradients in the caller's dtypes and dw, dm in 16 bits: not yet run since).
"""
from __future__ import annotations

from ..codegen.arch import get_arch
from ..codegen.pipeline import DplrBackwardProblem
from ..dsl import SpecError
from . import chunk, runtime


def _problem(spec, q, v, g, cu, initial_state, dht, store_dh0) -> DplrBackwardProblem:
    (B, T, H, K), (HV, V) = q.shape, v.shape[2:]
    C = spec.chunk_size
    return DplrBackwardProblem(
        gate=spec.gate.value, H=H, HV=HV, K=K, V=V, dtype=chunk._dtype_name(q), Ttot=B * T,
        seq_chunks=tuple(-(-(e - s) // C) for s, e in zip(cu, cu[1:])),
        g_dtype=chunk._dtype_name(g) if g is not None else "float32",
        has_initial_state=initial_state is not None, use_dht=dht is not None,
        store_dh0=bool(store_dh0), chunk_size=C)


def dplr_backward(spec, q, k, v, a, b, g, do, *, scale=None, initial_state=None, dht=None,
                  cu_seqlens=None, cu_seqlens_cpu=None, store_dh0=True, config=None) -> dict:
    """Gradients of a dplr-rule call (o, final state) = chunk_dplr_delta_rule(q, k, v, a, b,
    g, scale, initial_state) given do [B, T, HV, V] and dht [N, HV, K, V] (f32; None: no
    gradient into the final state).

    q, k, a, b [B, T, H, K] and v, do in one 16-bit dtype; g [B, T, HV, K] (None: IPLR);
    K a multiple of 64 up to 128 (the kernels' own K; no padding here). Returns dq, dk,
    da, db [B, T, H, K] (q's dtype where HV == H, as the kernel stored them; f32 sums of
    each key head's group where HV != H), dv [B, T, HV, V] in v's dtype, dg [B, T, HV, K]
    in g's (with g), and dinitial_state [N, HV, K, V] f32 (store_dh0 and an initial state).
    """
    import torch
    (B, T, H, K), (HV, V) = q.shape, v.shape[2:]
    arch = runtime.arch_of(q.device)
    if get_arch(arch).chunk_k(spec.rule.value, spec.gate.value, K) != K:
        raise SpecError(f"dplr_backward: K={K} is not a kernel K (pad it to a multiple of 64)")
    cu = chunk._cu_tuple(B, T, cu_seqlens, cu_seqlens_cpu)
    p = _problem(spec, q, v, g, cu, initial_state, dht, store_dh0)
    try:
        plan = get_arch(arch).dplr_bwd_plan(p, dict(config or {}))
    except ValueError as e:
        raise SpecError(str(e)) from None
    flat = lambda t, *tail: t.reshape(B * T, *tail).contiguous()  # noqa: E731
    f32 = dict(dtype=torch.float32, device=q.device)
    x = dict(q=flat(q, H, K), k=flat(k, H, K), a_in=flat(a, H, K), b_in=flat(b, H, K),
             v=flat(v, HV, V), do=flat(do, HV, V), scale=float(spec.scale_for(K, scale)))
    if g is not None:
        x["g"] = flat(g, HV, K)
    one = (1, HV, K, V)
    x["h0"] = initial_state.float().contiguous() if initial_state is not None else \
        torch.empty(one, **f32)
    x["dht"] = dht.float().contiguous() if dht is not None else torch.empty(one, **f32)
    x["dh0"] = torch.empty((p.N,) + one[1:] if store_dh0 else one, **f32)
    x.update(chunk._tables(cu, spec.chunk_size, q.device, 0))
    out = runtime.run_plan(spec, plan, x)
    group = lambda t: t.view(B, T, H, K) if HV == H else \
        t.view(B * T, H, HV // H, K).sum(2).view(B, T, H, K)  # noqa: E731
    grads = {f"d{n}": group(out[f"d{n}"]) for n in "qkab"}
    grads["dv"] = out["dv"].view(B, T, HV, V)
    if g is not None:
        grads["dg"] = out["dg"].view(B, T, HV, K)
    if store_dh0 and initial_state is not None:
        grads["dinitial_state"] = out["dh0"]
    return grads


class DplrChunkFunction:
    """Namespace of the autograd Function of a dplr-rule call through the kernels (built
    lazily so importing needs no torch): the forward's plan (ops/chunk.py), the backward's
    recompute and five stages (:func:`dplr_backward`); :func:`train` calls it for the
    public chunk_* calls."""
    _fn = None

    @classmethod
    def apply(cls, spec, q, k, v, a, b, g, scale, initial_state, output_final_state,
              cu_seqlens=None, cu_seqlens_cpu=None):
        """(o [B, T, HV, V] in q's dtype, final state f32 or None), differentiable in q, k,
        v, a, b, g and initial_state (chunk_dplr_delta_rule's arguments; g None: IPLR)."""
        if cls._fn is None:
            cls._fn = _make_function()
        cu = dict(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return cls._fn.apply(spec, float(spec.scale_for(q.shape[-1], scale)),
                             bool(output_final_state), cu, q, k, v, a, b, g, initial_state)


def _pad_k(K, Kp, *xs):
    """Zero key channels up to Kp (the last axis of [B, T, *, K] tensors; exact: zero keys
    and a zero log decay add nothing)."""
    import torch.nn.functional as F
    return tuple(x if x is None or Kp == K else F.pad(x, (0, Kp - K)) for x in xs)


def _make_function():
    import torch
    from ..dsl import Options

    class _DplrChunk(torch.autograd.Function):
        @staticmethod
        def forward(ctx, spec, scale, output_final_state, cu, q, k, v, a, b, g, h0):
            o, ht = chunk.run_chunk_forward(spec, q, k, v, g, None, scale, h0,
                                            output_final_state, Options(), rule_inputs={
                                                "a": a, "b": b}, **cu)
            ctx.spec, ctx.scale, ctx.cu = spec, scale, cu
            ctx.save_for_backward(q, k, v, a, b, g, h0)
            ctx.set_materialize_grads(False)
            return o, ht

        @staticmethod
        def backward(ctx, do, dht):
            q, k, v, a, b, g, h0 = ctx.saved_tensors
            K = q.shape[-1]
            Kp = get_arch(runtime.arch_of(q.device)).chunk_k("dplr", ctx.spec.gate.value, K)
            qp, kp, ap, bp, gp = _pad_k(K, Kp, q, k, a, b, g)
            h0p, dhtp = (None if x is None else torch.nn.functional.pad(x, (0, 0, 0, Kp - K))
                         for x in (h0, dht))
            do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
            d = dplr_backward(ctx.spec, qp, kp, v, ap, bp, gp, do, scale=ctx.scale,
                              initial_state=h0p, dht=dhtp, store_dh0=h0 is not None, **ctx.cu)
            cut = lambda n, x, axis=-1: None if x is None else d[n].narrow(  # noqa: E731
                axis, 0, K).to(x.dtype).contiguous()   # (no copy where stored so, unpadded)
            return (None, None, None, None, cut("dq", q), cut("dk", k), d["dv"].to(v.dtype),
                    cut("da", a), cut("db", b), cut("dg", g), cut("dinitial_state", h0, -2))

    return _DplrChunk


def trains(q, k, v, a, b, gk, initial_state) -> bool:
    """Whether a chunk_* call of the dplr rule that the chunked forward takes (ops/dplr.py
    chunked) trains through the kernels: autograd records it, q, k, v, a, b share one
    16-bit dtype, and it has tokens (else ops/exact_train.py, exact in torch)."""
    import torch
    from . import validate
    return (isinstance(q, torch.Tensor) and q.dtype in (torch.float16, torch.bfloat16)
            and q.numel() > 0 and validate.needs_grad(q, k, v, a, b, gk, initial_state)
            and all(isinstance(x, torch.Tensor) and x.dtype == q.dtype for x in (k, v, a, b)))


def train(spec, opts, q, k, v, a, b, gk, scale, initial_state, output_final_state,
          cu_seqlens, cu_seqlens_cpu):
    """A differentiable chunk_* call of the dplr rule (chunk_dplr_delta_rule, chunk_rwkv7,
    chunk_iplr_delta_rule: gk None), checked as the exact path checks it, then
    :class:`DplrChunkFunction`. Returns (o, final_state or None)."""
    from . import validate
    validate.check_call(spec, opts, q, k, v, gk, None, initial_state=initial_state,
                        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, scale=scale,
                        values=validate.host_checks(), rule_inputs={"a": a, "b": b})
    return DplrChunkFunction.apply(spec, q, k, v, a, b, gk, scale, initial_state,
                                   output_final_state, cu_seqlens, cu_seqlens_cpu)
