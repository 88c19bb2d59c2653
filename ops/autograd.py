"""Training through the chunked delta rule: a torch.autograd.Function over the generated
forward (ops/chunk.py) and backward (ops/chunk_bwd.py) stages.

The forward runs the chunked forward keeping its per-chunk states h [NT, HV, K, V] (the
16-bit states its kernels already form: the walk's, or chunk_state's) and the WY inverse
[Ttot, HV, 64] (its prepare's costly part; fla keeps its A likewise): A itself as A_inv
(none / scalar gate), or A with A_qk (per-key gate: the pair sums too; fla keeps its
A_qk, A_kk), and saves them with its inputs. The backward rebuilds the rest of what it
needs from them.

Every gate (:func:`packed_backward`: DeltaNet, Gated DeltaNet, KDA) runs on the call's own
token-first tensors [B T, H, D] and packed varlen, cut into chunks by the forward's tables:

    rebuild                from the kept A: w, u and, with l2norm, q, k l2-normalised;
                           the scalar gate's in-chunk cumulative log gate
                           (chunk_bwd_kkt_rebuild, chunk_wu); the per-key gate's w, u, qg,
                           kg, g_last and cumulative gate (chunk_bwd_key_rebuild)
    chunk_bwd_* stages     dq, dk (per value head), dv, dbeta, dg, dh0 from do and dht,
                           the scale in q (none / scalar gate: dq = scale * the gradient
                           of f) or in do (per-key gate)
    chunk_bwd_key_grads    dq, dk summed over each key head's value heads (GVA), times dq's
                           factor, through the l2norm's backward

The gate's activation (use_gate_in_kernel: g <- -exp(A_log) softplus(g + dt_bias), or
KDA's lower-bounded form) and beta's sigmoid are differentiated by torch (per-token
tensors, small beside q, k, v).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dsl import OpSpec, Options, SpecError
from . import chunk_bwd, exact_train, padding, validate
from .inputs import head_dims, kernel_inputs
from .validate import needs_grad  # noqa: F401 (the families' test: autograd.needs_grad)

#: head dims the backward stages are generated for (a call of smaller dims runs zero-padded
#: to the next one: :func:`kernel_dims`)
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class DeltaRuleCall:
    """The non-tensor arguments of one differentiable chunk_delta_rule (or, with a scalar
    gate spec, chunk_gated_delta_rule) call (spec: the family's OpSpec)."""
    spec: object
    scale: float
    l2norm_qk: bool = False
    output_final_state: bool = False
    gate_in_kernel: bool = False
    beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    lower_bound: float | None = None        # KDA's lower-bounded gate (with gate_in_kernel)
    state_v_first: bool = False             # the caller's states [N, HV, V, K]
    cu: tuple | None = None                 # host cu_seqlens (varlen) or None
    rule_names: tuple = ()                  # the rule's vector inputs (Comba's p), in order
    cu_seqlens: object = field(default=None, compare=False)      # device copy (forward)
    cu_seqlens_cpu: object = field(default=None, compare=False)

    @property
    def options(self) -> Options:
        return Options(l2norm_qk=self.l2norm_qk, gate_in_kernel=self.gate_in_kernel,
                       beta_sigmoid=self.beta_sigmoid, allow_neg_eigval=self.allow_neg_eigval)

    @property
    def gated(self) -> bool:
        """A gate of either kind (the scalar gate's or the per-key gate's backward)."""
        return chunk_bwd.is_gated(self.spec) or chunk_bwd.is_key(self.spec)

    @property
    def keyed(self) -> bool:
        return chunk_bwd.is_key(self.spec)


def run_forward(call: DeltaRuleCall, q, k, v, beta, initial_state, g=None, A_log=None,
                dt_bias=None, rule_inputs=None):
    """(o, final_state or None, saved) from the chunked forward (tests replace this on the
    CPU); saved: h [NT, HV, K, V] in q's dtype, the state entering each chunk, and the
    WY inverse: A_inv (none / scalar gate) or A, aqk (per-key gate), [Ttot, HV, 64]
    (:func:`train_forward`, the plan's saved); rule_inputs: the rule's vector inputs by
    name."""
    extra = {"lower_bound": call.lower_bound} if call.lower_bound is not None else {}
    if rule_inputs:
        extra["rule_inputs"] = rule_inputs
    beta = beta if call.spec.has_beta else None     # (GDN-2: the backward's ones only)
    return train_forward(call.spec, q, k, v, g, beta, scale=call.scale,
                         initial_state=initial_state,
                         output_final_state=call.output_final_state,
                         options=call.options, cu_seqlens=call.cu_seqlens,
                         cu_seqlens_cpu=call.cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias,
                         **extra)


def train_forward(spec: OpSpec, q, k, v, g=None, beta=None, *, scale=None,
                  initial_state=None, output_final_state=False, options: Options = Options(),
                  cu_seqlens=None, cu_seqlens_cpu=None, A_log=None, dt_bias=None,
                  lower_bound=None, rule_inputs=None):
    """(o, final_state or None, saved) of a training forward (this module's Function):
    the chunked forward for every T, keeping what its backward reads (ops/chunk.py
    chunk_forward's save_states: h [NT, HV, K, V] in q's dtype, the state entering each
    chunk; the per-key gate's A and aqk too). Checks and kernel inputs as ops/api.py
    forward; called inside the autograd Function, not through a torch.library op (as the
    additive rule's training forward)."""
    from .chunk import run_chunk_forward
    extra = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                 initial_state=initial_state)
    chk = validate.check_call(spec, options, q, k, v, g, beta, cu_seqlens=cu_seqlens,
                              cu_seqlens_cpu=cu_seqlens_cpu, scale=scale,
                              values=validate.host_checks(), sizes=head_dims,
                              rule_inputs=rule_inputs, **extra)
    x, opts = kernel_inputs(spec, options, chk.dims, q, k, v, g, beta, **extra,
                            rule_inputs=rule_inputs)
    return run_chunk_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                             scale=spec.scale_for(chk.dims.K, scale),
                             initial_state=x["initial_state"],
                             output_final_state=bool(output_final_state), options=opts,
                             cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                             A_log=x["A_log"], dt_bias=x["dt_bias"], save_states=True,
                             rule_inputs=x.get("rule_inputs"))


class ChunkDeltaRuleFunction:
    """Namespace of the autograd Function (built lazily so importing needs no torch)."""
    _fn = None

    @classmethod
    def apply(cls, call, q, k, v, beta, initial_state, g=None, A_log=None, dt_bias=None,
              rule_inputs=None):
        """g, A_log, dt_bias: the gate's inputs (call.spec gated); rule_inputs: the rule's
        vector inputs by name (call.rule_names; their gradients too). The Function runs the
        states key-first ([N, HV, K, V]: a state_v_first call's transposed in and out) at
        head dims in HEAD_DIMS (others zero-padded, :func:`pad_dims`, o and the final
        state sliced back), each by differentiable torch ops around it. q, k, v are made
        contiguous here, once: the Function keeps these for its backward (a model's views,
        e.g. Qwen3.5's split of its convolution's [B, C, T] output, were copied by the
        forward's kernel inputs and again by the backward)."""
        if cls._fn is None:
            cls._fn = _make_function()
        q, k, v = (x.contiguous() for x in (q, k, v))
        rule = [rule_inputs[n].contiguous() for n in call.rule_names]
        if call.state_v_first and initial_state is not None:
            initial_state = initial_state.transpose(-1, -2).contiguous()
        K, V = q.shape[-1], v.shape[-1]
        Kp, Vp = kernel_dims(K, V)
        if (Kp, Vp) != (K, V):
            q, k, v, initial_state, g, dt_bias = pad_dims(call, Kp, Vp, q, k, v, initial_state,
                                                          g, dt_bias)
            rule = pad_rule_inputs(call, K, V, Kp, Vp, rule)
        o, final = padding.unpad(False, K, V, *cls._fn.apply(
            call, q, k, v, beta, initial_state, g, A_log, dt_bias, *rule))
        if call.state_v_first and final is not None:
            final = final.transpose(-1, -2)
        return o, None if final is None else final.contiguous()


def kernel_dims(K: int, V: int) -> tuple:
    """(K, V) the training kernels run a call of head dims K, V at: each the least of
    HEAD_DIMS at or above it (check_trainable refuses larger)."""
    return tuple(next(d for d in HEAD_DIMS if d >= x) for x in (K, V))


def pad_dims(call, Kp, Vp, q, k, v, initial_state, g, dt_bias):
    """The call's tensors zero-padded to head dims Kp, Vp (ops/padding.py: exact) by
    differentiable torch ops (autograd drops the padding's gradients); the initial state
    key-first here."""
    K, V, HV = q.shape[-1], v.shape[-1], v.shape[2]
    if initial_state is not None and tuple(initial_state.shape[1:]) != (HV, K, V):
        raise SpecError(f"initial_state must be [N, HV, K, V] = [N, {HV}, {K}, {V}], got "
                        f"{tuple(initial_state.shape)}")
    if call.keyed and dt_bias is not None and dt_bias.numel() != HV * K:
        raise SpecError(f"dt_bias must have HV * K = {HV * K} elements, got "
                        f"{dt_bias.numel()}")
    q, k, v, g, dt_bias, initial_state = padding.pad_heads(
        "K" if call.keyed else None, False, K, V, Kp, Vp, q, k, v, g, dt_bias, initial_state)
    return q, k, v, initial_state, g, dt_bias


def pad_rule_inputs(call, K, V, Kp, Vp, rule: list) -> list:
    """The rule's vector inputs zero-padded along their channel axis (K or V: RuleMaths.
    vector_axes) to Kp, Vp, by differentiable torch ops (as :func:`pad_dims`)."""
    import torch.nn.functional as F
    axes = call.spec.rule.maths.vector_axes
    return [F.pad(x, (0, Kp - K if axes[n][1] == "K" else Vp - V))
            for n, x in zip(call.rule_names, rule)]


def _make_function():
    import torch

    class _ChunkDeltaRule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, call, q, k, v, beta, initial_state, g, A_log, dt_bias, *rule):
            gate = (g, A_log, dt_bias) if call.gated else ()
            named = dict(zip(call.rule_names, rule))
            o, final, saved = run_forward(call, q, k, v, beta, initial_state, *gate,
                                          **({"rule_inputs": named} if named else {}))
            ctx.call, ctx.saved_names = call, tuple(saved)
            ctx.save_for_backward(q, k, v, beta, initial_state, g, A_log, dt_bias, *rule,
                                  *saved.values())
            ctx.set_materialize_grads(False)
            return o, final

        @staticmethod
        def backward(ctx, do, dht):
            q, k, v, beta, initial_state, g, A_log, dt_bias, *kept = ctx.saved_tensors
            n = len(ctx.call.rule_names)
            rule = dict(zip(ctx.call.rule_names, kept[:n]))
            kept = dict(zip(ctx.saved_names, kept[n:]))
            h = kept.pop("h")
            if ctx.call.gated or ctx.call.keyed:
                grads = gated_backward(ctx.call, q, k, v, g, beta, initial_state, A_log,
                                       dt_bias, do, dht, h, kept, rule)
                grads = grads[:3] + (grads[4], grads[5], grads[3]) + grads[6:]
            else:
                grads = deltanet_backward(ctx.call, q, k, v, beta, initial_state, do, dht, h,
                                          kept)
                grads = grads + (None, None, None)
            return (None, *(x if need else None
                            for x, need in zip(grads, ctx.needs_input_grad[1:])))

    return _ChunkDeltaRule


def wide_heads(q, v) -> bool:
    """A 16-bit call whose K or V the backward kernels do not take (past HEAD_DIMS): it
    trains on ops/exact_train.py's exact torch path instead (correct, at torch's speed)."""
    return (getattr(q, "dim", lambda: 0)() == 4 and getattr(v, "dim", lambda: 0)() == 4
            and max(q.shape[-1], v.shape[-1]) > HEAD_DIMS[-1])


def check_trainable(q, k, v, beta, initial_state, options: Options, cu_seqlens, g=None,
                    spec=None, rule_inputs=None):
    """Raise SpecError for what the backward does not support (never a wrong gradient).
    spec: a scalar-gate spec checks Gated DeltaNet's call (g [B, T, HV], GVA allowed), a
    per-key-gate spec KDA's (g [B, T, HV, K]); rule_inputs: the rule's vector inputs
    (:func:`check_rule_inputs`)."""
    import torch
    keyed = chunk_bwd.is_key(spec)
    gated = chunk_bwd.is_gated(spec) or keyed
    what = (f"the {spec.name} backward" if rule_inputs else "the KDA backward" if keyed
            else "the Gated DeltaNet backward" if gated else "the DeltaNet backward")
    if beta is None:
        raise SpecError(f"{what} needs beta")
    heads_ok = v.dim() == 4 and q.dim() == 4 and (
        v.shape[2] % max(q.shape[2], 1) == 0 if gated else v.shape[2] == q.shape[2])
    if not heads_ok or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        heads = "HV a multiple of H" if gated else "the same heads"
        raise SpecError(f"{what} needs q, k [B, T, H, K] and v [B, T, HV, V] with {heads}, "
                        f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    want = tuple(v.shape[:3])
    if tuple(beta.shape) != want:
        raise SpecError(f"{what} needs beta [B, T, HV] = {want}, got {tuple(beta.shape)}")
    gwant = want + (q.shape[-1],) if keyed else want
    if gated and (g is None or tuple(g.shape) != gwant):
        raise SpecError(f"{what} needs g [B, T, HV{', K' if keyed else ''}] = {gwant}, got "
                        f"{None if g is None else tuple(g.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or \
            v.dtype != q.dtype:
        raise SpecError(f"{what} needs q, k, v in one of float16 / bfloat16, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 0 < q.shape[-1] <= HEAD_DIMS[-1] or not 0 < v.shape[-1] <= HEAD_DIMS[-1]:
        raise SpecError(f"{what} supports K, V in [1, {HEAD_DIMS[-1]}], got "
                        f"K={q.shape[-1]}, V={v.shape[-1]}")
    names = () if gated else ("beta_sigmoid", "allow_neg_eigval", "gate_in_kernel")
    unsupported = [n for n in names if getattr(options, n)]
    if unsupported:
        raise SpecError(f"{what} does not support {unsupported} (yet)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise SpecError(f"cu_seqlens needs B == 1, got B={q.shape[0]}")
    check_rule_inputs(spec, q, v, rule_inputs, what)
    from . import runtime
    runtime.check_training(q.device, "delta", "key" if keyed else "scalar" if gated else "none",
                           what)


def check_rule_inputs(spec, q, v, rule_inputs, what: str) -> None:
    """Each of the rule's vector inputs (RuleMaths.vector_axes) shaped [B, T, H or HV, K
    or V]; a key of its own (key heads) in q's dtype."""
    sizes = {"H": q.shape[2], "HV": v.shape[2], "K": q.shape[-1], "V": v.shape[-1]}
    for name, x in (rule_inputs or {}).items():
        heads, chans = spec.rule.maths.vector_axes[name]
        want = tuple(q.shape[:2]) + (sizes[heads], sizes[chans])
        if tuple(x.shape) != want or (heads == "H" and x.dtype != q.dtype):
            raise SpecError(f"{what} needs {name} {want} in {q.dtype}, got "
                            f"{tuple(x.shape)} in {x.dtype}")


def deltanet_backward(call: DeltaRuleCall, q, k, v, beta, initial_state, do, dht, h, kept):
    """Gradients of chunk_delta_rule under sum(o * do) + sum(final_state * dht).

    q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] (f16 / bf16; beta any float dtype);
    initial_state [N, H, K, V] or None; do like v or None (0); dht [N, H, K, V] or None
    (0); h [NT, H, K, V]: the forward's per-chunk states, kept: its A_inv (run_forward).
    Returns (dq, dk, dv, dbeta, dh0) in the inputs' shapes and dtypes (dh0 None without an
    initial state).
    """
    dq, dk, dv, dbeta, _, dh0 = packed_backward(call, q, k, v, beta.float(), None,
                                                initial_state, do, dht, h, kept)
    return (dq, dk, dv, dbeta.to(beta.dtype),
            None if dh0 is None else dh0.to(initial_state.dtype))


def packed_backward(call: DeltaRuleCall, q, k, v, b_in, g_in, initial_state, do, dht, h,
                    kept, rule=None):
    """The delta rule's backward (every gate) on the call's own token-first tensors (packed
    varlen as it comes, no padding): the rebuild from what its forward kept (_rebuild:
    A_inv, or the per-key gate's A, aqk),
    the four stages, then dq, dk summed over each key head's value heads through the
    l2norm's backward. b_in, g_in: the effective beta, log gate (f32; [B, T, HV] scalar,
    [B, T, HV, K] per key, None: no gate); rule: the rule's vector inputs by name (an erase
    key of its own, RuleMaths.erase_key: rebuilt, read and differentiated as k). Returns
    (dq, dk, dv (input dtype), dbeta, dg (like g_in, or None), dh0 [N, HV, K, V] f32 (or
    None)) and, with rule, {name: its gradient}."""
    import torch
    from . import chunk, runtime
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    Ttot, dt, dev = B * T, q.dtype, q.device
    arch = runtime.arch_of(dev)
    cu = call.cu if call.cu is not None else tuple(T * b for b in range(B + 1))
    N, gated, n = len(cu) - 1, g_in is not None, cu[-1]   # tokens past cu[-1]: in no sequence
    if n == 0:              # no token: the final state is the initial one
        dh0 = None if initial_state is None else (
            torch.zeros(initial_state.shape, dtype=torch.float32, device=dev)
            if dht is None else dht.float().clone())
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                b_in.new_zeros(B, T, HV), None if g_in is None else torch.zeros_like(g_in),
                dh0) + (({n: torch.zeros_like(x) for n, x in rule.items()},) if rule else ())
    flat = lambda x: x.reshape(Ttot, *x.shape[2:])[:n].contiguous()  # noqa: E731
    # (dht's placeholder is never read, dh0 written whole where stored: no fill kernel)
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=dev)  # noqa: E731
    sizes = dict(H=H, HV=HV, K=K, V=V, dtype=str(dt).replace("torch.", ""), chains=N * HV,
                 l2norm=call.l2norm_qk, use_dht=dht is not None,
                 store_dh0=initial_state is not None, spec=call.spec)
    params = (chunk_bwd.key_train_params(**sizes, arch=arch) if call.keyed
              else chunk_bwd.train_params(**sizes, arch=arch))
    runtime.announce(call.spec, arch, params)      # recording(): all at once
    tables = chunk._tables(cu, chunk_bwd.CHUNK, dev, 0)
    qf, kf, vf, bf = flat(q.detach()), flat(k.detach()), flat(v.detach()), flat(b_in.to(dt))
    rf = {name: flat(x.detach() if call.spec.rule.maths.vector_axes[name][0] == "H"
                     else x.detach().float()) for name, x in (rule or {}).items()}
    x, q_scale = _rebuild(call, params, tables, qf, kf, vf, bf,
                            flat(g_in) if gated else None,
                            flat(torch.zeros_like(v) if do is None else do), kept, rf)
    x.update(tables, v=vf, beta=bf, S=h,
             state_row=chunk_bwd.state_rows(tables["chunk_bos"].numel(), 0, dev),
             dht=f32(1, HV, K, V) if dht is None else dht.float().contiguous(),
             dh0=f32(N, HV, K, V) if initial_state is not None else f32(1, HV, K, V))
    chunk_bwd.run_stages(call.spec, params, x)
    dq, dk = chunk_bwd.key_grads(x, qf, kf, q_scale, params, call.spec)
    shape = lambda y: _tokens(y, B, T)  # noqa: E731
    return (shape(dq), shape(dk), shape(x["dv"]), shape(x["dbeta"]),
            shape(x["dg"]) if gated else None,
            x["dh0"] if initial_state is not None else None) + (
        ({n: shape(chunk_bwd.rule_grads(x, n, t, params, call.spec))
          for n, t in rf.items()},) if rule else ())


def _rebuild(call: DeltaRuleCall, params, tables, q, k, v, beta, g, do, kept, rule=None):
    """The stages' inputs rebuilt from the forward's kept WY inverse on the flat tokens, with
    the call's scale in: the none / scalar gate's stages read scale q (dq's factor then
    the scale); the per-key gate's rebuild (from kept: A, aqk) forms its q terms from the
    raw q, so the scale goes into do instead (dq's factor 1). Returns (the stages' dict,
    dq's factor)."""
    n = q.shape[0]                       # (the kept tensors span all B T tokens)
    if call.keyed:
        x = chunk_bwd.key_rebuild_packed(q, k, v, beta, g, kept["A"][:n], kept["aqk"][:n],
                                         tables, params, call.spec, rule)
        x["do"] = do * call.scale
        return x, 1.0
    x = chunk_bwd.rebuild(q, k, v, beta, g, kept["A_inv"][:n], tables, params, call.spec,
                          erase=(rule or {}).get(call.spec.rule.maths.erase_key))
    x.update(q=(x["q"] * call.scale).to(q.dtype), do=do)
    return x, call.scale


def _tokens(y, B, T):
    """y [n, ...] over the first n tokens as [B, T, ...] (the tokens past n, in no
    sequence, get zero gradients)."""
    import torch
    if y.shape[0] < B * T:
        y = torch.cat([y, y.new_zeros(B * T - y.shape[0], *y.shape[1:])])
    return y.view(B, T, *y.shape[1:])


def _gated_inputs(call: DeltaRuleCall, g, beta, A_log, dt_bias):
    """The effective g, beta of a gated call from its raw inputs, by torch (so that
    torch.autograd differentiates the activations): the gate's activation
    -exp(A_log) softplus(g + dt_bias) (f32, as the kernels and fla; per key channel for
    KDA, or its lower_bound * sigmoid(exp(A_log) (g + dt_bias))), beta's sigmoid. (q, k's
    l2norm is the rebuild's and chunk_bwd_key_grads'.)"""
    import torch
    from . import gates
    g_in = g.float()
    if call.gate_in_kernel:     # (per key channel: A_log [HV] -> [HV, 1], dt_bias [HV, K])
        g_in = gates.activate(g_in, A_log, dt_bias, call.lower_bound, per_channel=call.keyed)
    b_in = beta.float()
    if call.beta_sigmoid:
        b_in = torch.sigmoid(b_in) * (2.0 if call.allow_neg_eigval else 1.0)
    return g_in, b_in


def gated_backward(call: DeltaRuleCall, q, k, v, g, beta, initial_state, A_log, dt_bias, do,
                   dht, h, kept, rule=None):
    """Gradients of chunk_gated_delta_rule (scalar gate g [B, T, HV]; A_log, dt_bias [HV])
    or chunk_kda (per-key gate g [B, T, HV, K]; dt_bias HV * K elements) under
    sum(o * do) + sum(final_state * dht).

    q, k [B, T, H, K], v [B, T, HV, V] (f16 / bf16; HV a multiple of H); beta [B, T, HV]
    (any float dtype); A_log, dt_bias with gate_in_kernel, else None; initial_state
    [N, HV, K, V] or None; do like v or None (0); dht [N, HV, K, V] or None (0); h
    [NT, HV, K, V]: the forward's per-chunk states, kept: what else it kept (run_forward's
    saved: A_inv, or the per-key gate's A, aqk). Returns
    (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) in the inputs' shapes and dtypes (None
    for an input not given), then the gradient of each of rule's vector inputs (by
    call.rule_names): :func:`packed_backward` on the call's tensors, the gate's and
    beta's activations differentiated by torch around it.
    """
    import torch
    raw = [None if x is None else x.detach().requires_grad_()
           for x in (g, beta, A_log, dt_bias)]
    with torch.enable_grad():
        g_in, b_in = _gated_inputs(call, *raw)

    dq, dk, dv, dbeta, dg, dh0, *drule = packed_backward(
        call, q, k, v, b_in.detach(), g_in.detach(), initial_state, do, dht, h, kept, rule)
    leaves = [x for x in raw if x is not None]
    grads = iter(torch.autograd.grad((g_in, b_in), leaves, (dg, dbeta.float()),
                                     allow_unused=True))
    dg, dbeta, dA_log, ddt_bias = [None if x is None else _cast(next(grads), x) for x in raw]
    return (dq, dk, dv, dg, dbeta,
            None if dh0 is None else dh0.to(initial_state.dtype), dA_log, ddt_bias,
            *(_cast(drule[0][n], rule[n]) for n in call.rule_names))


def _cast(d, x):
    return None if d is None else d.to(x.dtype)


def train(spec, opts: Options, q, k, v, g, beta, scale, initial_state, output_final_state,
          cu_seqlens, cu_seqlens_cpu, A_log=None, dt_bias=None, lower_bound=None,
          rule_inputs=None):
    """A differentiable call of a gated delta-rule spec (chunk_gated_delta_rule: the
    scalar gate; chunk_kda: the per-key gate, lower_bound its lower-bounded gate; Comba:
    the scalar gate and rule_inputs, its erase key p by name): checked, then the autograd
    Function. Returns (o, final_state or None)."""
    if opts.gate_in_kernel and A_log is None and lower_bound is None:
        raise SpecError("use_gate_in_kernel=True needs A_log")
    if exact_train.is_float32(q) or wide_heads(q, v):
        return exact_train.train(spec, opts, q, k, v, g, beta if spec.has_beta else None,
                                 scale=scale,
                                 initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lower_bound if opts.gate_in_kernel else None,
                                 rule_inputs=rule_inputs)
    check_trainable(q, k, v, beta, initial_state, opts, cu_seqlens, g=g, spec=spec,
                    rule_inputs=rule_inputs)
    cu = None
    if cu_seqlens is not None:
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        cu = tuple(int(x) for x in host.tolist())
    call = DeltaRuleCall(
        spec=spec, scale=spec.scale_for(q.shape[-1], scale), l2norm_qk=opts.l2norm_qk,
        output_final_state=bool(output_final_state), gate_in_kernel=opts.gate_in_kernel,
        beta_sigmoid=opts.beta_sigmoid, allow_neg_eigval=opts.allow_neg_eigval,
        lower_bound=(None if lower_bound is None or not opts.gate_in_kernel
                     else float(lower_bound)), state_v_first=opts.state_v_first, cu=cu,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        rule_names=tuple(rule_inputs or ()))
    return ChunkDeltaRuleFunction.apply(call, q, k, v, beta, initial_state, g, A_log,
                                        dt_bias, rule_inputs)
