"""The dplr rule's chunked backward through its kernels (docs/design.md "DPLR's
backward"): the host side of codegen/arch/sm90/dplr.py's dplr_bwd_plan.

Not wired: the public functions (ops/dplr.py, ops/iplr.py) still train exactly in torch
(ops/exact_train.py) until the kernels are checked on a GPU (tests/test_dplr_bwd_gpu.py).
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
    da, db [B, T, H, K], dv [B, T, HV, V], dg [B, T, HV, K] (with g), all f32, and
    dinitial_state [N, HV, K, V] f32 (store_dh0 and an initial state).
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
    grads = {f"d{n}": out[f"d{n}"].view(B * T, H, HV // H, K).sum(2).view(B, T, H, K)
             for n in "qkab"}
    grads["dv"] = out["dv"].view(B, T, HV, V)
    if g is not None:
        grads["dg"] = out["dg"].view(B, T, HV, K)
    if store_dh0 and initial_state is not None:
        grads["dinitial_state"] = out["dh0"]
    return grads
