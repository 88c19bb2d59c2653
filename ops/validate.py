"""Input checks shared by every linattn op, with messages that say what to fix.

Every check raises :class:`~linattn.dsl.SpecError` (a ValueError) for a bad value or
shape, and TypeError for something that is not a tensor. Each message is one line of at
most 300 characters that names the argument and what is supported; a tensor is described
by its shape and dtype (:func:`describe`), never by its contents. One wording per kind of
error: :func:`dtype_error`, :func:`shape_error`, :func:`device_error`.

Two levels. The public (fla-named) functions check a whole call with :func:`check_call`
before any device work, with fla's leniency (any float dtype for gates, states, A_log;
A_log / dt_bias in any shape squeezable to fla's; the device check last). The kernel
entry points (ops/recurrent.py, ops/chunk.py) check what their kernels take exactly:

    dims = check_qkv(spec, q, k, v)                  # B, T, H, HV, K, V
    check_gate(spec, g, dims, q)
    check_beta(spec, beta, dims, q)
    N = check_cu_seqlens(cu_seqlens, dims.B, dims.T, cu_seqlens_cpu)
    check_state("initial_state", initial_state, N, dims, v_first, torch.float32, q)
"""
from __future__ import annotations

from typing import NamedTuple

from ..dsl import Gate, OpSpec, Options, SpecError
from . import runtime
from .runtime import device_error  # noqa: F401 (re-exported: the one wording)

#: q / k / v dtypes the public functions accept (float32 runs the recurrent kernel)
INPUT_DTYPES = ("float16", "bfloat16", "float32")
#: q / k / v dtypes of the chunked kernels
CHUNK_DTYPES = ("float16", "bfloat16")
#: gates, beta, A_log, dt_bias and states: read in f32 whatever their float dtype
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INDEX_DTYPES = ("int32", "int64")
MAX_MESSAGE = 300


class Dims(NamedTuple):
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int


class Checked(NamedTuple):
    """What :func:`check_call` found: the sizes and the number of sequences."""
    dims: Dims
    N: int


def _torch():
    import torch
    return torch


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


def describe(x) -> str:
    """A short description of an argument: shape and dtype for a tensor (never its values)."""
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return f"a {_name(x.dtype)} tensor of shape {list(x.shape)} on {x.device}"
    text = repr(x)
    return text if len(text) <= 60 else f"a {type(x).__name__}"


def error(message: str) -> SpecError:
    """A SpecError of one line, cut to MAX_MESSAGE characters."""
    line = " ".join(str(message).split())
    return SpecError(line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE - 3] + "...")


def dtype_error(name: str, x, dtypes) -> SpecError:
    return error(f"{name} has dtype {_name(x.dtype)}; expected "
                 f"{' or '.join(dict.fromkeys(_name(d) for d in dtypes))}")


def shape_error(name: str, shape, want: str) -> SpecError:
    return error(f"{name} has shape {list(shape)}; expected {want}")


def _want(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def host_checks() -> bool:
    """Whether value checks that read device memory may run (not while torch.compile
    traces, nor while a CUDA graph is captured; the kernel entry points check then)."""
    import torch
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_tensor(name: str, x, *, like=None, dtypes=None, shape=None, contiguous=True):
    """x is a torch.Tensor (on like's device), of one of ``dtypes``, of exact ``shape``.

    dtypes: iterable of torch dtypes or their names ("bfloat16"); shape: tuple of ints
    (None entries are not checked).
    """
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if like is not None and x.device != like.device:
        raise device_error(name, x.device, like.device)
    if dtypes is not None and _name(x.dtype) not in [_name(d) for d in dtypes]:
        raise dtype_error(name, x, dtypes)
    if shape is not None:
        ok = x.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))
        if not ok:
            raise shape_error(name, x.shape, _want(shape))
    if contiguous and not x.is_contiguous():
        raise error(f"{name} must be contiguous (call .contiguous() first); got strides "
                    f"{x.stride()} for shape {list(x.shape)}")
    return x


def check_cuda(name: str, x):
    """x is on a CUDA device (the one wording of the device error)."""
    if x.device.type != "cuda":
        raise device_error(name, x.device)


def check_devices(q, **tensors) -> None:
    """The last check of a call: q on a CUDA device linattn has kernels for (codegen.arch.ARCHES), and
    every other tensor given (None: skipped; cu_seqlens_cpu is not passed) on q's device."""
    check_cuda("q", q)
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise device_error(name, t.device, q.device)
    runtime.device_arch(q.device)    # a clear error on a GPU without linattn kernels


def check_qkv(spec: OpSpec, q, k, v, *, dtypes=INPUT_DTYPES, like=True,
              contiguous=True, mixed=False) -> Dims:
    """q, k [B, T, H, K] and v [B, T, HV, V] of one dtype (one of ``dtypes``; ``mixed``:
    each of its own, as fla's kernels read them); with ``like`` on q's device too."""
    check_tensor("q", q, dtypes=dtypes, contiguous=contiguous)
    if q.dim() != 4:
        raise shape_error("q", q.shape, "[B, T, H, K]")
    B, T, H, K = q.shape
    ref = q if like else None
    same = dtypes if mixed else [q.dtype]
    check_tensor("k", k, like=ref, dtypes=same, shape=(B, T, H, K), contiguous=contiguous)
    check_tensor("v", v, like=ref, dtypes=same, shape=(B, T, None, None),
                 contiguous=contiguous)
    HV, V = v.shape[2], v.shape[3]
    spec.check_heads(H, HV)
    return Dims(B, T, H, HV, K, V)


def check_gate(spec: OpSpec, g, dims: Dims, q=None, dtypes=None, contiguous=True):
    """g: None for gate none; [B, T, HV] (scalar), [B, T, HV, K] (key) or [B, T, HV, V]
    (value); dtypes default f32 or q's dtype (the kernels')."""
    if spec.gate is Gate.NONE:
        if g is not None:
            raise error(f"{spec.name} has no gate; g must be None, got {describe(g)}")
        return None
    want = spec.gate_shape(dims.B, dims.T, dims.HV, dims.K, dims.V)
    if g is None:
        raise error(f"{spec.name} needs g of shape {list(want)}")
    if dtypes is None:
        dtypes = ["float32"] + ([q.dtype] if q is not None else list(CHUNK_DTYPES))
    return check_tensor("g", g, like=q, dtypes=dtypes, shape=want, contiguous=contiguous)


def check_beta(spec: OpSpec, beta, dims: Dims, q=None, dtypes=None, contiguous=True):
    """beta [B, T, HV] for the delta rule (dtypes default f32 or q's dtype); None for the
    additive rule."""
    if not spec.has_beta:
        if beta is not None:
            raise error(f"{spec.name} uses the additive rule; beta must be None, "
                        f"got {describe(beta)}")
        return None
    if beta is None:
        raise error(f"{spec.name} needs beta of shape [{dims.B}, {dims.T}, {dims.HV}]")
    if dtypes is None:
        dtypes = ["float32"] + ([q.dtype] if q is not None else list(CHUNK_DTYPES))
    return check_tensor("beta", beta, like=q, dtypes=dtypes, shape=(dims.B, dims.T, dims.HV),
                        contiguous=contiguous)


def check_gate_params(spec: OpSpec, options: Options, A_log, dt_bias, dims: Dims, q=None,
                      dtypes=("float32",)):
    """The kernels' A_log [HV] and dt_bias ([HV] scalar gate, [HV * K] or [HV, K] key
    gate, [HV * V] or [HV, V] value gate), of one of ``dtypes`` and the same one, both
    given with gate_in_kernel. Returns dt_bias flattened (a view) or None.
    """
    if not options.gate_in_kernel:
        if A_log is not None or dt_bias is not None:
            raise error("A_log / dt_bias are only used with use_gate_in_kernel=True")
        return None
    if A_log is None:
        raise error(f"use_gate_in_kernel=True needs A_log of shape [{dims.HV}]")
    check_tensor("A_log", A_log, like=q, dtypes=dtypes, shape=(dims.HV,))
    C = spec.gate.n_channels(dims.K, dims.V)
    n = dims.HV * C
    if dt_bias is None:
        raise error(f"use_gate_in_kernel=True needs dt_bias of shape [{n}] here "
                    "(the public functions pass zeros for none)")
    if spec.gate.channels and dt_bias.dim() == 2:
        check_tensor("dt_bias", dt_bias, like=q, dtypes=[A_log.dtype], shape=(dims.HV, C))
        return dt_bias.reshape(n)
    check_tensor("dt_bias", dt_bias, like=q, dtypes=[A_log.dtype], shape=(n,))
    return dt_bias


def _squeezes_to(x, shape: tuple) -> bool:
    """x's shape is ``shape`` once its size-1 dims are dropped (fla's [1, 1, H, 1] for [H])."""
    drop = lambda s: [d for d in s if d != 1]  # noqa: E731
    return drop(x.shape) == drop(shape)


def check_fla_gate_params(spec: OpSpec, options: Options, A_log, dt_bias, dims: Dims,
                          lower_bound=None) -> None:
    """fla's A_log / dt_bias: used only with use_gate_in_kernel (ignored otherwise, as in
    fla); A_log with HV elements ([HV], [1, 1, HV, 1], ...; optional with KDA's
    lower_bound), dt_bias optional ([HV], or [HV * K] / [HV, K] with the per-key gate,
    [HV * V] / [HV, V] with the per-value gate);
    any float dtype (read as f32)."""
    if not options.gate_in_kernel:
        return
    K = spec.gate.n_channels(dims.K, dims.V)
    if A_log is None and lower_bound is None:
        raise error(f"use_gate_in_kernel=True needs A_log of shape [{dims.HV}]")
    for name, x, shapes in (("A_log", A_log, [(dims.HV,)]),
                            ("dt_bias", dt_bias, [(dims.HV * K,), (dims.HV, K)])):
        if x is None:
            continue
        check_tensor(name, x, dtypes=FLOAT_DTYPES[:3], contiguous=False)
        if not any(_squeezes_to(x, s) for s in shapes):
            raise shape_error(name, x.shape, " or ".join(_want(s) for s in shapes)
                              + " (size-1 dims allowed)")


def check_cu_seqlens(cu_seqlens, B: int, T: int, cu_seqlens_cpu=None, q=None,
                     values: bool = True) -> int:
    """Validate varlen offsets; returns N (number of sequences; B without cu_seqlens).

    cu_seqlens: 1-D int32/int64 [N + 1], starts at 0, nondecreasing, last == T, B == 1.
    The values are checked on ``cu_seqlens_cpu`` when given (no device sync), else on a
    host copy of cu_seqlens; ``values=False`` skips them (torch.compile tracing, CUDA
    graph capture: the kernel entry point checks them when the call runs).
    """
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise error("cu_seqlens_cpu given without cu_seqlens")
        return B
    check_tensor("cu_seqlens", cu_seqlens, like=q, dtypes=INDEX_DTYPES)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise shape_error("cu_seqlens", cu_seqlens.shape, "[N + 1] with N >= 1")
    if B != 1:
        raise error(f"with cu_seqlens the batch size must be 1 (sequences packed along T), "
                    f"got B={B}")
    host = cu_seqlens_cpu
    if host is not None:
        check_tensor("cu_seqlens_cpu", host, dtypes=INDEX_DTYPES,
                     shape=tuple(cu_seqlens.shape))
        if host.device.type != "cpu":
            raise error(f"cu_seqlens_cpu must be on the CPU, got {host.device}")
    if values:
        check_offsets((host if host is not None else cu_seqlens.detach().cpu()).tolist(), T)
    return cu_seqlens.numel() - 1


def check_offsets(vals: list, T: int) -> None:
    """cu_seqlens values: 0 first, nondecreasing, T last (the message names one entry)."""
    if vals[0] != 0:
        raise error(f"cu_seqlens must start at 0, got cu_seqlens[0]={vals[0]}")
    bad = next((i for i in range(1, len(vals)) if vals[i] < vals[i - 1]), None)
    if bad is not None:
        raise error(f"cu_seqlens must be nondecreasing, got cu_seqlens[{bad - 1}]="
                    f"{vals[bad - 1]} > cu_seqlens[{bad}]={vals[bad]}")
    if vals[-1] != T:
        raise error(f"cu_seqlens must end at T={T} (the packed length), got {vals[-1]}")


def state_shape(N: int, dims: Dims, v_first: bool) -> tuple:
    return (N, dims.HV, dims.V, dims.K) if v_first else (N, dims.HV, dims.K, dims.V)


def check_state(name: str, state, N, dims: Dims, v_first: bool, dtype, q=None,
                contiguous=True):
    """A state [N, HV, K, V] ([N, HV, V, K] when v_first) of ``dtype`` (a dtype or a list
    of them); N None: any number of rows (a state pool). None: skipped."""
    if state is None:
        return None
    torch = _torch()
    if (N is not None and isinstance(state, torch.Tensor) and state.dim() == 4
            and state.shape[0] != N):
        raise error(f"{name} holds {state.shape[0]} states but there are N={N} sequences "
                    "(N = B, or len(cu_seqlens) - 1 with varlen)")
    layout = "[N, HV, V, K] (state_v_first)" if v_first else "[N, HV, K, V]"
    dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype]
    shape = state_shape(N, dims, v_first)
    try:
        return check_tensor(name, state, like=q, dtypes=dtypes, shape=shape,
                            contiguous=contiguous)
    except SpecError as e:
        raise error(f"{e} (layout {layout})") from None


def check_pool(ssm_state_indices, num_accepted_tokens, initial_state, inplace: bool, N: int):
    """A state pool (fla's continuous batching): ssm_state_indices int [N] (one slot per
    sequence) or [N, S] (per token: read at num_accepted_tokens[n] - 1, or 0; written
    after each token with inplace_final_state); num_accepted_tokens int [N] needs the
    [N, S] form; inplace_final_state needs initial_state (the pool, [P, HV, K, V])."""
    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise error("num_accepted_tokens needs ssm_state_indices [N, S] (the slots "
                        "each sequence's tokens write)")
    else:
        check_tensor("ssm_state_indices", ssm_state_indices, dtypes=INDEX_DTYPES,
                     contiguous=False)
        x = ssm_state_indices
        if x.dim() not in (1, 2) or x.shape[0] != N or (x.dim() == 2 and x.shape[1] < 1):
            raise shape_error("ssm_state_indices", x.shape, f"[{N}] or [{N}, S] (N sequences)")
        if num_accepted_tokens is not None:
            if x.dim() != 2:
                raise error("num_accepted_tokens needs ssm_state_indices of shape [N, S] "
                            f"(got {list(x.shape)})")
            check_tensor("num_accepted_tokens", num_accepted_tokens, dtypes=INDEX_DTYPES,
                         shape=(N,), contiguous=False)
    if inplace and initial_state is None:
        raise error("inplace_final_state=True needs initial_state (the states to update)")


def check_head_dims(K: int, V: int, *, k_multiple=16, k_max=256, v_multiple=8, v_max=512,
                    what="this kernel"):
    """K and V within a kernel's limits."""
    mult = lambda m: f"multiple of {m} " if m > 1 else ""  # noqa: E731
    if K % k_multiple or not k_multiple <= K <= k_max:
        raise error(f"{what} supports K (key head dim) {mult(k_multiple)}in "
                    f"[{k_multiple}, {k_max}], got K={K}")
    if V % v_multiple or not v_multiple <= V <= v_max:
        raise error(f"{what} supports V (value head dim) {mult(v_multiple)}in "
                    f"[{v_multiple}, {v_max}], got V={V}")


def check_scale(spec: OpSpec, K: int, scale) -> float:
    return spec.scale_for(K, scale)


def needs_grad(*tensors) -> bool:
    """True when autograd would record a call on these tensors."""
    torch = _torch()
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def reject_grad(spec: OpSpec, *tensors) -> None:
    """Raise when autograd would record a call that has no backward (a state update in
    place, the decode kernel called directly): its outputs carry no gradient, so training
    through it would silently drop it."""
    if needs_grad(*tensors):
        raise error(f"{spec.name}: this call (a state update, no backward) does not train; "
                    f"run it under torch.no_grad() or detach its inputs")


def check_call(spec: OpSpec, options: Options, q, k, v, g=None, beta=None, *, A_log=None,
               dt_bias=None, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None,
               lower_bound=None, ssm_state_indices=None, num_accepted_tokens=None,
               inplace_final_state=False, scale=None, g_gamma=None, beta_optional=False,
               values=True, sizes=None, rule_inputs=None) -> Checked:
    """Every argument of one public call, in fla's terms, before any device work; the
    device check comes last (a bad g on the CPU reports g). As fla's input_guard, any
    strides are accepted (inputs.kernel_inputs makes copies), except for a state updated in
    place. See the public functions for
    the shapes; ``g_gamma``: simple GLA's per-head decay [HV] (then g may be None);
    ``beta_optional``: beta None means ones; ``values``: check cu_seqlens' values too
    (off while tracing); ``sizes(dims)``: the caller's check of the head dims (the kernel
    path's limits), run before the device check."""
    spec.check_options(options)
    dims = check_qkv(spec, q, k, v, like=False, contiguous=False, mixed=True)
    if g_gamma is not None:
        check_tensor("g_gamma", g_gamma, dtypes=FLOAT_DTYPES[:3], contiguous=False)
        if not _squeezes_to(g_gamma, (dims.HV,)):
            raise shape_error("g_gamma", g_gamma.shape, f"[{dims.HV}] (one log decay a head)")
    if g is not None or g_gamma is None:
        check_gate(spec, g, dims, dtypes=FLOAT_DTYPES[:3], contiguous=False)
    if beta is not None or not beta_optional:
        check_beta(spec, beta, dims, dtypes=FLOAT_DTYPES[:3], contiguous=False)
    check_fla_gate_params(spec, options, A_log, dt_bias, dims, lower_bound)
    check_rule_inputs(spec, dims, rule_inputs, contiguous=False)
    N = check_cu_seqlens(cu_seqlens, dims.B, dims.T, cu_seqlens_cpu, values=values)
    check_pool(ssm_state_indices, num_accepted_tokens, initial_state, inplace_final_state, N)
    pool = ssm_state_indices is not None
    check_state("initial_state", initial_state, None if pool else N, dims,
                options.state_v_first, FLOAT_DTYPES if not inplace_final_state
                else FLOAT_DTYPES[:3], contiguous=inplace_final_state)
    spec.scale_for(dims.K, scale)
    if sizes is not None:
        sizes(dims)
    used = options.gate_in_kernel
    check_devices(q, k=k, v=v, g=g, g_gamma=g_gamma, beta=beta,
                  A_log=A_log if used else None,
                  dt_bias=dt_bias if used else None, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                  num_accepted_tokens=num_accepted_tokens, **(rule_inputs or {}))
    return Checked(dims, N)


def check_devices_as(name: str, x, **tensors) -> None:
    """check_devices with the leading tensor named ``name`` instead of q (mamba_ssm's x)."""
    try:
        check_devices(x, **tensors)
    except SpecError as e:
        msg = str(e)
        msg = name + msg[1:] if msg.startswith("q is on") else msg
        raise SpecError(msg.replace("(q is on", f"({name} is on")) from None


def check_rule_inputs(spec: OpSpec, dims: Dims, rule_inputs, q=None, contiguous=True):
    """The rule's vector inputs (``rule_inputs``: name -> tensor; dsl rule.input_dims:
    Comba's p [B, T, H, K] in q's dtypes, GDN-2's b [B, T, HV, K] and w [B, T, HV, V] in
    any float dtype; with ``q`` a key-like one in q's dtype and each on q's device): each
    one the rule takes given, none other."""
    rule, rule_inputs = spec.rule.maths, dict(rule_inputs or {})
    for name, shape in rule.input_dims(*dims[:2], dims.HV, dims.H, dims.K, dims.V):
        if name not in rule.vector_inputs:
            continue
        x = rule_inputs.pop(name, None)
        if x is None:
            raise error(f"{spec.name} needs {name} of shape [{', '.join(map(str, shape))}] "
                        f"(the {spec.rule.value} rule's)")
        key = rule.vector_axes[name][0] == "H"
        dtypes = ([q.dtype] if q is not None else INPUT_DTYPES) if key else (
            ["float32", q.dtype] if q is not None else FLOAT_DTYPES)
        check_tensor(name, x, like=q, dtypes=dtypes, shape=shape, contiguous=contiguous)
    extra = sorted(n for n, x in rule_inputs.items() if x is not None)
    if extra:
        raise error(f"{spec.name} uses the {spec.rule.value} rule, which takes no "
                    f"{', '.join(extra)}")
