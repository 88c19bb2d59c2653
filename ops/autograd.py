"""Training through the chunked delta rule: a torch.autograd.Function over the generated
forward (ops/chunk.py) and backward (ops/chunk_bwd.py) stages.

The forward runs the ordinary chunked forward and saves only its inputs. The backward
recomputes what it needs, as fla does:

    l2norm (torch, fp32)   q, k -> q / |q|, k / |k|    (use_qk_l2norm_in_kernel; its
                                                        backward by torch.autograd)
    layout                 [B, T, H, D] -> head-first [N, H, L, D]; varlen sequences are
                           zero-padded to the longest (zero rows leave the state and
                           every real row's gradient unchanged)
    chunk_bwd_wy_recompute A, w, u;  chunk_state (from h0): S entering each chunk
    chunk_bwd_* stages     dq, dk, dv, dbeta, dh0 from do * scale and dht

The scale is folded into do: o = scale * f(q, ...) and the final state does not depend on
it, so every gradient is that of f under do * scale.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dsl import Options, SpecError
from . import chunk_bwd

#: head dims the backward stages are generated for
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class DeltaRuleCall:
    """The non-tensor arguments of one differentiable chunk_delta_rule call (spec: the
    family's OpSpec, the delta rule without a gate)."""
    spec: object
    scale: float
    l2norm_qk: bool = False
    output_final_state: bool = False
    cu: tuple | None = None                 # host cu_seqlens (varlen) or None
    cu_seqlens: object = field(default=None, compare=False)      # device copy (forward)
    cu_seqlens_cpu: object = field(default=None, compare=False)


def needs_grad(*tensors) -> bool:
    """True when autograd would record a call on these tensors."""
    import torch
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def run_forward(call: DeltaRuleCall, q, k, v, beta, initial_state):
    """(o, final_state or None) from the chunked forward (tests replace this on the CPU)."""
    from . import api
    return api.forward(call.spec, q, k, v, None, beta, scale=call.scale,
                       initial_state=initial_state,
                       output_final_state=call.output_final_state,
                       options=Options(l2norm_qk=call.l2norm_qk), cu_seqlens=call.cu_seqlens,
                       cu_seqlens_cpu=call.cu_seqlens_cpu)


class ChunkDeltaRuleFunction:
    """Namespace of the autograd Function (built lazily so importing needs no torch)."""
    _fn = None

    @classmethod
    def apply(cls, call, q, k, v, beta, initial_state):
        if cls._fn is None:
            cls._fn = _make_function()
        return cls._fn.apply(call, q, k, v, beta, initial_state)


def _make_function():
    import torch

    class _ChunkDeltaRule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, call, q, k, v, beta, initial_state):
            o, final = run_forward(call, q, k, v, beta, initial_state)
            ctx.call = call
            ctx.save_for_backward(q, k, v, beta, initial_state)
            ctx.set_materialize_grads(False)
            return o, final

        @staticmethod
        def backward(ctx, do, dht):
            q, k, v, beta, initial_state = ctx.saved_tensors
            grads = deltanet_backward(ctx.call, q, k, v, beta, initial_state, do, dht)
            return (None, *(g if need else None
                            for g, need in zip(grads, ctx.needs_input_grad[1:])))

    return _ChunkDeltaRule


def check_trainable(q, k, v, beta, initial_state, options: Options, cu_seqlens):
    """Raise SpecError for what the backward does not support (never a wrong gradient)."""
    import torch
    if beta is None:
        raise SpecError("the DeltaNet backward needs beta")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise SpecError(f"the DeltaNet backward needs q, k [B, T, H, K] and v [B, T, H, V] "
                        f"with the same heads, got {tuple(q.shape)}, {tuple(k.shape)}, "
                        f"{tuple(v.shape)}")
    if tuple(beta.shape) != tuple(q.shape[:3]):
        raise SpecError(f"the DeltaNet backward needs beta [B, T, H] = {tuple(q.shape[:3])}, "
                        f"got {tuple(beta.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or \
            v.dtype != q.dtype:
        raise SpecError(f"the DeltaNet backward needs q, k, v in one of float16 / bfloat16, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
        raise SpecError(f"the DeltaNet backward is generated for K, V in {HEAD_DIMS}, got "
                        f"K={q.shape[-1]}, V={v.shape[-1]}")
    unsupported = [n for n in ("beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
                               "state_v_first") if getattr(options, n)]
    if unsupported:
        raise SpecError(f"the DeltaNet backward does not support {unsupported} (yet)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise SpecError(f"cu_seqlens needs B == 1, got B={q.shape[0]}")


# -- layouts --------------------------------------------------------------------------------

class _Layout:
    """[B, T, H, (D)] <-> head-first [N, H, L, (D)]: a transpose for fixed length; for
    varlen (B == 1, host cu) each sequence is a row of N, zero-padded to the longest."""

    def __init__(self, B, T, cu, device):
        import torch
        self.cu = cu
        if cu is None:
            return
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        self.N, self.L = len(lens), max(lens, default=0)
        seq = torch.repeat_interleave(torch.arange(self.N), torch.tensor(lens, dtype=torch.long))
        pos = torch.arange(cu[-1]) - torch.tensor(cu[:-1], dtype=torch.long)[seq]
        self.seq, self.pos = seq.to(device), pos.to(device)

    def to_head_first(self, x):
        if self.cu is None:
            return x.transpose(1, 2).contiguous()
        out = x.new_zeros(self.N, self.L, *x.shape[2:])
        out[self.seq, self.pos] = x[0]
        return out.transpose(1, 2).contiguous()

    def from_head_first(self, y):
        if self.cu is None:
            return y.transpose(1, 2).contiguous()
        return y.transpose(1, 2)[self.seq, self.pos].unsqueeze(0)


def _l2norm(x):
    from ..dsl.torch_reference import l2norm
    return l2norm(x.float()).to(x.dtype)


def deltanet_backward(call: DeltaRuleCall, q, k, v, beta, initial_state, do, dht):
    """Gradients of chunk_delta_rule under sum(o * do) + sum(final_state * dht).

    q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] (f16 / bf16; beta any float dtype);
    initial_state [N, H, K, V] or None; do like v or None (0); dht [N, H, K, V] or None
    (0). Returns (dq, dk, dv, dbeta, dh0) in the inputs' shapes and dtypes (dh0 None
    without an initial state).
    """
    import torch
    dt = q.dtype
    B, T, H, K = q.shape
    if call.l2norm_qk:
        with torch.enable_grad():
            q_raw, k_raw = q.detach().requires_grad_(), k.detach().requires_grad_()
            q_in, k_in = _l2norm(q_raw), _l2norm(k_raw)
    else:
        q_in, k_in = q, k
    do_s = torch.zeros_like(v) if do is None else (do.float() * call.scale).to(dt)
    lay = _Layout(B, T, call.cu, q.device)
    qh, kh, vh, doh, bh = (lay.to_head_first(x.detach()) for x in
                           (q_in, k_in, v, do_s, beta.to(dt)))
    h0 = None if initial_state is None else initial_state.detach().float()
    dhth = None if dht is None else dht.float().contiguous()
    A, w, u, S = chunk_bwd.recompute_for_backward(kh, vh, bh, h0)
    dq, dk, dv, dbeta, dh0 = chunk_bwd.backward_stages(doh, qh, kh, vh, bh, S, A, w, u,
                                                       dht=dhth, want_dh0=h0 is not None)
    dq, dk, dv, dbeta = (lay.from_head_first(x) for x in (dq, dk, dv, dbeta))
    if call.l2norm_qk:
        dq, dk = torch.autograd.grad((q_in, k_in), (q_raw, k_raw), (dq, dk))
    return (dq, dk, dv, dbeta.to(beta.dtype),
            None if dh0 is None else dh0.to(initial_state.dtype))
