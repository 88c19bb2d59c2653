"""Dispatch shared by the fla-named functions of every family.

A public call (``chunk_*`` -> :func:`forward`, ``fused_recurrent_*`` -> :func:`recurrent`)
runs in three steps:

1. ``validate.check_call``: every argument, in fla's terms, before any device work (the
   device check last); the call's one check (the torch.library ops run the unchecked
   ``chunk.run_chunk_forward`` / ``recurrent.run_recurrent``);
2. :func:`choose_path` picks the kernels:

   * ``"recurrent"``, the fused recurrent (decode) kernel: T == 1 without cu_seqlens,
     float32 inputs (the kernel reads them and computes in f32: exact, sequential in T),
     head dims the chunked kernels lack (the delta rules' V up to 512, K = 256 with a
     per-key gate: the arch's chunk_head_limits), and
     every ``fused_recurrent_*`` call;
   * ``"chunk"``, the chunked forward (ops/chunk.py), otherwise;

3. ``inputs.kernel_inputs`` (ops/inputs.py) puts the arguments in the form the kernels
   take (A_log / dt_bias as f32 [HV] / [HV * K], zeros for a missing dt_bias, gates and
   beta in f32 or q's dtype, KDA's lower-bounded gate applied, states in f32),
   zero-padded once to the head dims of the path's kernels (the chunked ones' K: the
   arch's chunk_k), and the call goes through the torch.library op of its spec and path
   (ops/library.py), so torch.compile and CUDA graphs see one opaque op.

``fla_options`` maps fla's keyword names onto :class:`Options` and checks fla's keywords
that change nothing here (``chunk_size``, ``chunk_indices``, ...); anything else is
refused in one line (:func:`reject`) instead of being silently ignored.
"""
from __future__ import annotations

from ..codegen.arch import DEFAULT_ARCH, get_arch
from ..codegen.plan import plan
from ..dsl import OpSpec, Options
from . import exact_train, runtime, split, validate
from .inputs import head_dims, kernel_inputs, ones_beta
from .padding import pad_heads, round_up, unpad
from .recurrent import GATE_PARAM_DTYPES
from .recurrent import fused_recurrent  # noqa: F401 (the kernel entry point, re-exported)

_CHUNKED: dict = {}



def has_chunked_forward(spec: OpSpec) -> bool:
    hit = _CHUNKED.get(spec.hash)
    if hit is None:
        hit = _CHUNKED[spec.hash] = bool(plan(spec, "fwd"))
    return hit


def chunk_supports(spec: OpSpec, dims: validate.Dims, dtype, arch: str = DEFAULT_ARCH) -> bool:
    """Whether the chunked kernels take this call (dtype, head dims as the arch's
    chunk_head_limits say, the spec's chunk size; see ops/chunk.py); the others take the
    recurrent kernel."""
    k_max, v_max = get_arch(arch).chunk_head_limits(spec.rule.value, spec.gate.value)
    return (validate._name(dtype) in validate.CHUNK_DTYPES and has_chunked_forward(spec)
            and spec.chunk_size in get_arch(arch).CHUNK_SIZES
            and dims.K % 16 == 0 and 16 <= dims.K <= k_max
            and dims.V % 16 == 0 and 16 <= dims.V <= v_max)


def choose_path(spec: OpSpec, dims: validate.Dims, dtype, varlen: bool,
                arch: str = DEFAULT_ARCH) -> str:
    """"chunk" or "recurrent" for a chunk_* call on ``arch`` (see the module docstring)."""
    decode = dims.T == 1 and not varlen
    return "chunk" if not decode and chunk_supports(spec, dims, dtype, arch) else "recurrent"


def padded_dims(dims: validate.Dims, v_first: bool = False) -> validate.Dims:
    """The dims a call runs at: its own where every kernel's multiples hold (K of 16, V of
    8; with value-first states the recurrent kernel's K is a power of two), else K and V
    rounded up to them (zero channels: ops/padding.py)."""
    K = round_up(dims.K, 16)
    K = 1 << (K - 1).bit_length() if v_first else K
    if K == dims.K and dims.V % 8 == 0:
        return dims
    return dims._replace(K=K, V=round_up(dims.V, 16))


def pad_inputs(spec: OpSpec, options: Options, x: dict, dims, padded) -> dict:
    """kernel_inputs' x zero-padded from head dims ``dims`` to ``padded``
    (padding.pad_heads); the call's outputs are the padded run's, sliced (padding.unpad)."""
    names = ("q", "k", "v", "g", "dt_bias", "initial_state")
    out = dict(x, **dict(zip(names, pad_heads(
        spec.gate.channels, options.state_v_first, dims.K, dims.V, padded.K, padded.V,
        *(x[n] for n in names)))))
    if x.get("rule_inputs"):         # the rule's vector inputs: in K or V (zeros)
        import torch.nn.functional as F
        axes = spec.rule.maths.vector_axes
        out["rule_inputs"] = {n: F.pad(t, (0, padded.K - dims.K) if axes[n][1] == "K" else
                                       (0, padded.V - dims.V))
                              for n, t in x["rule_inputs"].items()}
    return out


def forward(spec: OpSpec, q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
            output_final_state=False, options: Options = Options(), cu_seqlens=None,
            cu_seqlens_cpu=None, A_log=None, dt_bias=None, lower_bound=None, g_gamma=None,
            rule_inputs=None, beta_ones=False):
    """(o, final_state or None) of a chunk_* call of ``spec``; shapes as the family's
    functions (ops/<family>.py); ``beta_ones``: a missing beta means ones (fla's Comba).
    The kernels' outputs carry no gradient: a call autograd would record trains exactly
    in torch (ops/exact_train.py; the families with generated backward kernels route
    theirs to ops/autograd.py or ops/additive_bwd.py first)."""
    extra = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, g_gamma=g_gamma,
                 initial_state=initial_state)
    if validate.needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias, g_gamma,
                           *(rule_inputs or {}).values()):
        if rule_inputs and has_backward(spec):
            from . import autograd
            ones = beta is None and (beta_ones or not spec.has_beta)   # (GDN-2: no beta)
            return autograd.train(spec, options, q, k, v, g, ones_beta(q, v) if ones else beta,
                                  scale, initial_state, output_final_state, cu_seqlens,
                                  cu_seqlens_cpu, A_log, dt_bias, lower_bound=lower_bound,
                                  rule_inputs=rule_inputs)
        exact_train.note_no_kernels(spec, q)
        return exact_train.train(spec, options, q, k, v, g, beta, scale=scale,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu, rule_inputs=rule_inputs,
                                 beta_ones=beta_ones, **extra)
    wide = split.wide_keys(spec, options, q)
    chk = validate.check_call(spec, options, q, k, v, g, beta, cu_seqlens=cu_seqlens,
                              cu_seqlens_cpu=cu_seqlens_cpu, scale=scale,
                              values=validate.host_checks(), rule_inputs=rule_inputs,
                              beta_optional=beta_ones, sizes=None if wide else head_dims,
                              **extra)
    if wide:
        def block(q, k, g, initial_state, scale):
            return forward(spec, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, options=options,
                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                           g_gamma=g_gamma)
        return split.by_key_blocks(spec, block, q, k, g, initial_state, scale,
                                   options.state_v_first)
    x, opts = kernel_inputs(spec, options, chk.dims, q, k, v, g, beta, **extra,
                            rule_inputs=rule_inputs)
    padded = padded_dims(chk.dims)
    path = choose_path(spec, padded, x["q"].dtype, cu_seqlens is not None,
                       runtime.arch_of(x["q"].device))
    if path == "recurrent":
        padded = padded_dims(chk.dims, options.state_v_first)
    else:               # the chunked kernels' K (the arch's chunk_k): the call's one padding
        from .chunk import kernel_k
        padded = padded._replace(K=kernel_k(spec, padded.K, x["q"].device))
    x = pad_inputs(spec, opts, x, chk.dims, padded)
    from . import library
    o, ht = library.run(spec, path, x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"],
                        x["dt_bias"], x["initial_state"], cu_seqlens, cu_seqlens_cpu,
                        spec.scale_for(chk.dims.K, scale), bool(output_final_state), opts,
                        rule_inputs=x.get("rule_inputs"))
    return unpad(opts.state_v_first, chk.dims.K, chk.dims.V, o.to(q.dtype),
                 ht if output_final_state else None)


def has_backward(spec: OpSpec) -> bool:
    """Whether ``chunk`` is differentiable: the delta rule without a gate (DeltaNet), with
    the scalar gate (Gated DeltaNet) or the per-key gate (KDA), and the additive rule with
    any gate (the value gate through its key-gated twin), at DeltaNet's chunk size (the
    generated backward's, ops/chunk_bwd.py CHUNK); a rule with vector inputs at the gates
    its backward is generated for (RuleMaths.backward_gates: Comba's scalar gate, trained
    through :func:`forward`'s route to ops/autograd.py)."""
    from .chunk_bwd import CHUNK
    maths = spec.rule.maths
    return spec.chunk_size == CHUNK and (
        not maths.vector_inputs or spec.gate.value in maths.backward_gates)


def intermediate_states(spec: OpSpec, q, k, v, g=None, beta=None, *, chunk_size=None,
                        **kw):
    """fla's ``return_intermediate_states`` (chunk_kda, inference only): (o, final_state
    or None, h), h the state entering each 64-token chunk in q's dtype, [B, NT, HV, K, V]
    ([..., V, K] with state_v_first; with cu_seqlens B == 1 and NT counts every
    sequence's chunks, sequence by sequence): the training forward's saved states
    (ops/autograd.py train_forward, whose keywords ``kw`` are)."""
    import torch
    refuse_states_grad(q, k, v, g, beta, kw.get("initial_state"), kw.get("A_log"),
                       kw.get("dt_bias"))
    if chunk_size not in (None, 64):
        raise validate.error(f"return_intermediate_states=True needs chunk_size=64 (its "
                             f"states are per 64-token chunk), got "
                             f"{validate.describe(chunk_size)}")
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, v)):
        K, V = q.shape[3], v.shape[3]      # (the chunked forward pads K itself)
        arch = runtime.arch_of(q.device)
        if not chunk_supports(spec, validate.Dims(*q.shape[:3], v.shape[2],
                                                  round_up(K, 16), V), q.dtype, arch):
            k_max, v_max = get_arch(arch).chunk_head_limits(spec.rule.value, spec.gate.value)
            raise validate.error(
                f"return_intermediate_states=True runs the chunked kernels: float16 / "
                f"bfloat16, K up to {k_max}, V a multiple of 16 up to {v_max}; got "
                f"{validate._name(q.dtype)}, K={K}, V={V}")
    from . import autograd
    o, final, saved = autograd.train_forward(spec, q, k, v, g, beta, **kw)
    h = saved["h"]
    h = h.unsqueeze(0) if kw.get("cu_seqlens") is not None else h.unflatten(0, (q.shape[0], -1))
    if kw["options"].state_v_first:
        h = h.transpose(-1, -2).contiguous()
    return o, final, h


def refuse_states_grad(*tensors) -> None:
    """fla's return_intermediate_states is for inference: refused in one line on inputs
    that need gradients."""
    if validate.needs_grad(*tensors):
        raise validate.error("return_intermediate_states=True is for inference: call it "
                             "under torch.inference_mode() or torch.no_grad()")


def recurrent(spec: OpSpec, q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
              output_final_state=False, options: Options = Options(), cu_seqlens=None,
              cu_seqlens_cpu=None, A_log=None, dt_bias=None, lower_bound=None,
              g_gamma=None, beta_ones=False, ssm_state_indices=None,
              num_accepted_tokens=None, inplace_final_state=False, rule_inputs=None):
    """(o, final_state or None) of a fused_recurrent_* call: the recurrent kernel for any
    T; ``beta_ones``: a missing beta means ones (fla's fused_recurrent delta rules). With
    ``ssm_state_indices`` initial_state is a pool of states [P, HV, K, V] (ops/recurrent.py);
    ``inplace_final_state`` writes the final states into initial_state, which is
    returned as the final state. A call autograd would record (a family whose chunk_*
    twin has no backward kernels: the same function of its inputs) trains exactly in torch
    (ops/exact_train.py), one whose twin has (Comba's: :func:`has_backward`) as that twin;
    a state pool does not train."""
    extra = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, g_gamma=g_gamma,
                 initial_state=initial_state)
    pool = dict(ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens)
    if validate.needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias, g_gamma,
                           *(rule_inputs or {}).values()):
        _refuse_pool_grad(ssm_state_indices, num_accepted_tokens, inplace_final_state)
        if rule_inputs and has_backward(spec):      # (as its chunk_* twin: the kernels)
            return forward(spec, q, k, v, g, beta, scale=scale,
                           output_final_state=output_final_state, options=options,
                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                           rule_inputs=rule_inputs, beta_ones=beta_ones, **extra)
        exact_train.note_no_kernels(spec, q)
        return exact_train.train(spec, options, q, k, v, g, beta, scale=scale,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu, rule_inputs=rule_inputs,
                                 beta_ones=beta_ones, **extra)
    wide = (split.wide_keys(spec, options, q) and ssm_state_indices is None
            and not inplace_final_state)
    chk = validate.check_call(spec, options, q, k, v, g, beta, cu_seqlens=cu_seqlens,
                              cu_seqlens_cpu=cu_seqlens_cpu, scale=scale,
                              inplace_final_state=inplace_final_state, beta_optional=beta_ones,
                              values=validate.host_checks(), rule_inputs=rule_inputs,
                              sizes=None if wide else head_dims, **extra, **pool)
    if wide:
        def block(q, k, g, initial_state, scale):
            return recurrent(spec, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, options=options,
                             cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                             g_gamma=g_gamma, beta_ones=beta_ones)
        return split.by_key_blocks(spec, block, q, k, g, initial_state, scale,
                                   options.state_v_first)
    padded = padded_dims(chk.dims, options.state_v_first)
    if padded != chk.dims and (ssm_state_indices is not None or inplace_final_state):
        raise validate.error(f"a state pool (ssm_state_indices / inplace_final_state) needs "
                             f"K a multiple of 16 (with state_v_first a power of two) and V "
                             f"of 8, got K={chk.dims.K}, V={chk.dims.V}")
    x, opts = kernel_inputs(spec, options, chk.dims, q, k, v, g, beta, **extra,
                            rule_inputs=rule_inputs, param_dtypes=GATE_PARAM_DTYPES)
    x = pad_inputs(spec, opts, x, chk.dims, padded)
    pool = {n: t if t is None else t.contiguous() for n, t in pool.items()}
    from . import library
    o, ht = library.run(spec, "recurrent", x["q"], x["k"], x["v"], x["g"], x["beta"],
                        x["A_log"], x["dt_bias"], x["initial_state"], cu_seqlens,
                        cu_seqlens_cpu, spec.scale_for(chk.dims.K, scale),
                        bool(output_final_state), opts, inplace=bool(inplace_final_state),
                        rule_inputs=x.get("rule_inputs"), **pool)
    if inplace_final_state:
        return o.to(q.dtype), initial_state
    return unpad(opts.state_v_first, chk.dims.K, chk.dims.V, o.to(q.dtype),
                 ht if output_final_state else None)


def states_by_chunks(call, seq: dict, *, initial_state=None, cu_seqlens=None,
                     state_shape: tuple, chunk: int = 64):
    """fla's ``return_intermediate_states`` of a function without a training forward that
    keeps its states (chunk_gdn2): ``call(**seq_slices, initial_state=S,
    output_final_state=True) -> (o, S')`` run ``chunk`` tokens at a time from each chunk's
    entering state S, which it collects. seq: the per-token inputs [B, T, ...]; state_shape:
    one state's [HV, K, V] (or [HV, V, K]). Returns (o, final_state f32, h), h [B, NT, *state]
    in q's dtype ([1, NT_total, ...] with cu_seqlens, sequence by sequence; cu_seqlens: the
    offsets, read on the host). Inference only: the caller refuses inputs that need
    gradients."""
    import torch
    q = seq["q"]
    B, T = q.shape[:2]
    if cu_seqlens is None:
        runs = [(slice(0, B), 0, T)]
    else:
        cu = cu_seqlens.tolist()
        runs = [(slice(n, n + 1), cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs, finals, hs = [], [], []
    for rows, t0, t1 in runs:
        S = (torch.zeros((rows.stop - rows.start,) + tuple(state_shape), device=q.device)
             if initial_state is None else initial_state[rows].float())
        for c0 in range(t0, t1, chunk):
            hs.append(S)
            o, S = call(**{n: x[:, c0:min(t1, c0 + chunk)] for n, x in seq.items()},
                        initial_state=S, output_final_state=True)
            outs.append(o)
        finals.append(S)
    if not outs:                                    # (no tokens at all)
        outs.append(call(**seq, initial_state=initial_state, output_final_state=False)[0])
    shape = tuple(state_shape)
    if cu_seqlens is None:
        h = torch.stack(hs, 1) if hs else q.new_zeros((B, 0) + shape)
    else:
        h = torch.cat(hs, 0).unsqueeze(0) if hs else q.new_zeros((1, 0) + shape)
    return torch.cat(outs, 1), torch.cat(finals, 0), h.to(q.dtype)


def recurrent_trains(*tensors, ssm_state_indices=None, num_accepted_tokens=None,
                     inplace_final_state=False, kwargs=None) -> bool:
    """Whether a fused_recurrent_* call of a family whose fla function trains (DeltaNet,
    GLA, simple GLA, linear attention, retention) needs gradients: it then runs as its
    chunk_* twin's training (the same function of its inputs). A state pool does not
    train (refused in one line); ``chunk_size``, which fused_recurrent ignores, is dropped
    from kwargs."""
    if not validate.needs_grad(*tensors):
        return False
    _refuse_pool_grad(ssm_state_indices, num_accepted_tokens, inplace_final_state)
    if kwargs is not None:
        kwargs.pop("chunk_size", None)
    return True


def _refuse_pool_grad(ssm_state_indices, num_accepted_tokens, inplace_final_state) -> None:
    if ssm_state_indices is not None or num_accepted_tokens is not None or inplace_final_state:
        raise validate.error("a state pool (ssm_state_indices / num_accepted_tokens / "
                             "inplace_final_state) has no backward: run it under "
                             "torch.no_grad()")


def fla_options(use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                allow_neg_eigval=False, use_gate_in_kernel=False, state_v_first=False,
                kwargs=None, chunk_sizes=(64,), family=None) -> Options:
    """fla's flag names -> Options; fla's other keywords (``kwargs``) checked: the old name
    ``transpose_state_layout`` of ``state_v_first`` is accepted (warned; not with it, as
    fla), ``chunk_size`` must be one
    of fla's values for the function (``chunk_sizes``; None: a fused_recurrent call, which
    ignores it as fla does; ``family``: the name fla's message gives), the rest must be
    no-ops."""
    kwargs = dict(kwargs or {})
    if "state_v_first" in kwargs:      # (a function without the parameter: chunk_delta_rule)
        state_v_first = bool(kwargs.pop("state_v_first")) or state_v_first
    if "transpose_state_layout" in kwargs:      # fla's rules for its old name
        if state_v_first:
            raise validate.error("Cannot pass both `state_v_first` and the deprecated "
                                 "`transpose_state_layout`.")
        import warnings
        warnings.warn("`transpose_state_layout` is deprecated and renamed to "
                      "`state_v_first`.", DeprecationWarning, stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    size = kwargs.pop("chunk_size", None)
    if chunk_sizes is not None and size is not None:
        check_chunk_size(size, chunk_sizes, family)
    reject(kwargs)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise validate.error("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                             "(beta becomes 2 * sigmoid(beta))")
    return Options(l2norm_qk=bool(use_qk_l2norm_in_kernel),
                   beta_sigmoid=bool(use_beta_sigmoid_in_kernel),
                   allow_neg_eigval=bool(allow_neg_eigval),
                   gate_in_kernel=bool(use_gate_in_kernel),
                   state_v_first=bool(state_v_first))


def check_chunk_size(chunk_size, allowed: tuple, family=None) -> None:
    """fla's chunk_size, one of the function's fla values (``allowed``; fla's message
    names the ``family`` where its tests match on it: KDA, GDN-2). It sets how fla's
    kernels split the sequence, not the result: linattn runs every allowed value on its
    chunk-64 kernels (the same recurrence; the chunk size moves only rounding)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or (
            chunk_size not in allowed):
        *head, last = [str(c) for c in allowed]
        choices = (last if not head else f"either {head[0]} or {last}" if len(head) == 1
                   else f"{', '.join(head)}, or {last}")
        raise validate.error(f"`chunk_size` must be {choices}"
                             f"{f' for {family}' if family else ''}, got "
                             f"{validate.describe(chunk_size)}")


#: fla keywords that change nothing in a forward call when left at these values (None in
#: the tuple: any value; chunk_indices is derived from cu_seqlens here)
_HARMLESS = {"chunk_indices": None, "cp_context": (None,), "safe_gate": (False,),
             "lower_bound": (None,), "disable_recompute": (False, True),
             "return_intermediate_states": (False,), "reverse": (False,), "gv": (None,),
             "head_first": (False,), "use_graph": (False,), "max_num_seqs": None}


def reject(kwargs: dict) -> None:
    """Raise for any keyword linattn does not implement (unless it is at a no-op value);
    the message shows each value's type and shape, never a tensor's contents."""
    def harmless(name, value):
        if name not in _HARMLESS:
            return False
        allowed = _HARMLESS[name]
        plain = value is None or isinstance(value, (bool, int, float))
        return allowed is None or (plain and value in allowed)
    bad = {k: v for k, v in kwargs.items() if not harmless(k, v)}
    if bad:
        got = ", ".join(f"{k}={validate.describe(v)}" for k, v in sorted(bad.items()))
        unknown = [k for k in bad if k not in _HARMLESS]
        hint = (f" ({', '.join(sorted(unknown))}: not an argument of this function)"
                if unknown else " (only the defaults of these arguments are supported)")
        raise validate.error(f"linattn does not support {got}{hint}")
