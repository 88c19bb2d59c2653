"""Input checks shared by every linattn op, with messages that say what to fix.

Every check raises :class:`~linattn.dsl.SpecError` (a ValueError) for a bad value or
shape, and TypeError for something that is not a tensor. They take shapes and names
explicitly so the chunked and the recurrent paths reuse them.

    dims = check_qkv(spec, q, k, v)                  # B, T, H, HV, K, V
    check_gate(spec, options, g, dims)
    check_beta(spec, beta, dims)
    N = check_cu_seqlens(cu_seqlens, dims.B, dims.T, cu_seqlens_cpu)
    check_state("initial_state", initial_state, N, dims, v_first, torch.float32, q)
"""
from __future__ import annotations

from typing import NamedTuple

from ..dsl import Gate, OpSpec, Options, SpecError

INPUT_DTYPES = ("float16", "bfloat16")


class Dims(NamedTuple):
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int


def _torch():
    import torch
    return torch


def check_tensor(name: str, x, *, like=None, dtypes=None, shape=None, contiguous=True):
    """x is a torch.Tensor (on like's device), of one of ``dtypes``, of exact ``shape``.

    dtypes: iterable of torch dtypes or their names ("bfloat16"); shape: tuple of ints
    (None entries are not checked).
    """
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if like is not None and x.device != like.device:
        raise SpecError(f"{name} is on {x.device}, q is on {like.device}: put every input "
                        "on the same CUDA device")
    if dtypes is not None:
        names = [d if isinstance(d, str) else str(d).replace("torch.", "") for d in dtypes]
        if str(x.dtype).replace("torch.", "") not in names:
            raise SpecError(f"{name} has dtype {x.dtype}; expected {' or '.join(names)}")
    if shape is not None:
        ok = x.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise SpecError(f"{name} has shape {list(x.shape)}; expected {want}")
    if contiguous and not x.is_contiguous():
        raise SpecError(f"{name} must be contiguous (call .contiguous() first); "
                        f"got strides {x.stride()} for shape {list(x.shape)}")
    return x


def check_cuda(name: str, x):
    if x.device.type != "cuda":
        raise SpecError(f"{name} is on {x.device}; linattn kernels need CUDA tensors")


def check_qkv(spec: OpSpec, q, k, v, *, require_cuda=False) -> Dims:
    """q, k [B, T, H, K] and v [B, T, HV, V], same device, f16/bf16, matching dtypes."""
    check_tensor("q", q, dtypes=INPUT_DTYPES)
    if q.dim() != 4:
        raise SpecError(f"q must be [B, T, H, K], got shape {list(q.shape)}")
    if require_cuda:
        check_cuda("q", q)
    B, T, H, K = q.shape
    check_tensor("k", k, like=q, dtypes=[q.dtype], shape=(B, T, H, K))
    check_tensor("v", v, like=q, dtypes=[q.dtype], shape=(B, T, None, None))
    HV, V = v.shape[2], v.shape[3]
    spec.check_heads(H, HV)
    return Dims(B, T, H, HV, K, V)


def check_gate(spec: OpSpec, g, dims: Dims, q=None):
    """g: None for gate none; [B, T, HV] (scalar) or [B, T, HV, K] (key), q's dtype or f32."""
    if spec.gate is Gate.NONE:
        if g is not None:
            raise SpecError(f"{spec.name} has no gate; g must be None")
        return None
    if g is None:
        raise SpecError(f"{spec.name} needs g of shape "
                        f"{list(spec.gate_shape(dims.B, dims.T, dims.HV, dims.K))}")
    dtypes = ["float32"] + ([q.dtype] if q is not None else list(INPUT_DTYPES))
    return check_tensor("g", g, like=q, dtypes=dtypes,
                        shape=spec.gate_shape(dims.B, dims.T, dims.HV, dims.K))


def check_beta(spec: OpSpec, beta, dims: Dims, q=None):
    """beta [B, T, HV] for the delta rule (q's dtype or f32); None for the additive rule."""
    if not spec.has_beta:
        if beta is not None:
            raise SpecError(f"{spec.name} uses the additive rule; beta must be None")
        return None
    if beta is None:
        raise SpecError(f"{spec.name} needs beta of shape [{dims.B}, {dims.T}, {dims.HV}]")
    dtypes = ["float32"] + ([q.dtype] if q is not None else list(INPUT_DTYPES))
    return check_tensor("beta", beta, like=q, dtypes=dtypes, shape=(dims.B, dims.T, dims.HV))


def check_gate_params(spec: OpSpec, options: Options, A_log, dt_bias, dims: Dims, q=None):
    """A_log [HV] and dt_bias ([HV] scalar gate, [HV * K] or [HV, K] key gate), f32.

    Returns dt_bias flattened to 1-D (a view) or None.
    """
    if not options.gate_in_kernel:
        if A_log is not None or dt_bias is not None:
            raise SpecError("A_log / dt_bias are only used with use_gate_in_kernel=True")
        return None
    if A_log is None:
        raise SpecError(f"use_gate_in_kernel=True needs A_log of shape [{dims.HV}]")
    check_tensor("A_log", A_log, like=q, dtypes=["float32"], shape=(dims.HV,))
    n = dims.HV * (dims.K if spec.gate is Gate.KEY else 1)
    if dt_bias is None:
        raise SpecError(f"use_gate_in_kernel=True needs dt_bias of shape [{n}] "
                        "(pass zeros for no bias)")
    if spec.gate is Gate.KEY and dt_bias.dim() == 2:
        check_tensor("dt_bias", dt_bias, like=q, dtypes=["float32"], shape=(dims.HV, dims.K))
        return dt_bias.reshape(n)
    check_tensor("dt_bias", dt_bias, like=q, dtypes=["float32"], shape=(n,))
    return dt_bias


def check_cu_seqlens(cu_seqlens, B: int, T: int, cu_seqlens_cpu=None, q=None) -> int:
    """Validate varlen offsets; returns N (number of sequences; B without cu_seqlens).

    cu_seqlens: 1-D int32/int64 [N + 1], starts at 0, nondecreasing, last == T, B == 1.
    The values are checked on ``cu_seqlens_cpu`` when given (no device sync), else on a
    host copy of cu_seqlens.
    """
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise SpecError("cu_seqlens_cpu given without cu_seqlens")
        return B
    check_tensor("cu_seqlens", cu_seqlens, like=q, dtypes=["int32", "int64"])
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise SpecError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape "
                        f"{list(cu_seqlens.shape)}")
    if B != 1:
        raise SpecError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), "
                        f"got B={B}")
    host = cu_seqlens_cpu
    if host is not None:
        check_tensor("cu_seqlens_cpu", host, dtypes=["int32", "int64"],
                     shape=tuple(cu_seqlens.shape))
        if host.device.type != "cpu":
            raise SpecError(f"cu_seqlens_cpu must be on the CPU, got {host.device}")
    else:
        host = cu_seqlens.detach().cpu()
    vals = host.tolist()
    if vals[0] != 0:
        raise SpecError(f"cu_seqlens must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise SpecError(f"cu_seqlens must be nondecreasing, got {vals}")
    if vals[-1] != T:
        raise SpecError(f"cu_seqlens must end at T={T} (the packed length), got {vals[-1]}")
    return len(vals) - 1


def state_shape(N: int, dims: Dims, v_first: bool) -> tuple:
    return (N, dims.HV, dims.V, dims.K) if v_first else (N, dims.HV, dims.K, dims.V)


def check_state(name: str, state, N: int, dims: Dims, v_first: bool, dtype, q=None):
    """A state [N, HV, K, V] ([N, HV, V, K] when v_first) of ``dtype`` (None: skip)."""
    if state is None:
        return None
    torch = _torch()
    if isinstance(state, torch.Tensor) and state.dim() == 4 and state.shape[0] != N:
        raise SpecError(f"{name} holds {state.shape[0]} states but there are N={N} sequences "
                        "(N = B, or len(cu_seqlens) - 1 with varlen)")
    layout = "[N, HV, V, K] (state_v_first)" if v_first else "[N, HV, K, V]"
    try:
        return check_tensor(name, state, like=q, dtypes=[dtype], shape=state_shape(N, dims, v_first))
    except SpecError as e:
        raise SpecError(f"{e} (layout {layout})") from None


def check_head_dims(K: int, V: int, *, k_multiple=16, k_max=256, v_multiple=8, v_max=512,
                    what="this kernel"):
    """K and V within a kernel's limits."""
    if K % k_multiple or not k_multiple <= K <= k_max:
        raise SpecError(f"{what} supports K (key head dim) multiple of {k_multiple} in "
                        f"[{k_multiple}, {k_max}], got K={K}")
    if V % v_multiple or not v_multiple <= V <= v_max:
        raise SpecError(f"{what} supports V (value head dim) multiple of {v_multiple} in "
                        f"[{v_multiple}, {v_max}], got V={V}")


def check_scale(spec: OpSpec, K: int, scale) -> float:
    return spec.scale_for(K, scale)


def reject_grad(spec: OpSpec, *tensors) -> None:
    """Raise when autograd would record a call on ``tensors``: the kernels' outputs carry
    no gradient, so training through them would silently drop it."""
    torch = _torch()
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors):
        raise SpecError(f"{spec.name}: no backward is generated for this call (only "
                        f"DeltaNet's chunk_delta_rule is differentiable so far); run it "
                        f"under torch.no_grad() or detach its inputs")
