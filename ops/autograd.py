"""Training through the chunked delta rule: a torch.autograd.Function over the generated
forward (ops/chunk.py) and backward (ops/chunk_bwd.py) stages.

The forward runs the chunked forward keeping its per-chunk states h [NT, HV, K, V] (the
16-bit states its kernels already form: the walk's, or chunk_state's) and saves them with
its inputs. The backward recomputes the rest of what it needs, as fla does.

DeltaNet and Gated DeltaNet (:func:`packed_backward`) run on the call's own token-first
tensors [B T, H, D] and packed varlen, cut into chunks by the forward's tables:

    chunk_kkt_inverse,     A, w, u (and q, k l2-normalised, the scalar gate's in-chunk
    chunk_wu               cumulative log gate g_cum) by the forward's own prepare
    chunk_bwd_* stages     dq, dk (per value head), dv, dbeta, dg, dh0 from do and dht,
                           with q scaled (o = f(scale q): dq = scale * the gradient of f)
    chunk_bwd_key_grads    dq, dk summed over each key head's value heads (GVA), dq times
                           the scale, through the l2norm's backward

KDA (the per-key gate, :func:`_key_stages`) runs on head-first copies, each sequence
padded to a multiple of 64 (zero rows with g = 0 leave every gradient unchanged):

    chunk_bwd_gather       token-first q, k, v, do -> head-first [N, HV, L, D] in one pass:
                           key heads expanded to the value heads (GVA), q, k l2-normalised
                           (use_qk_l2norm_in_kernel, f32 as the forward), do * scale;
                           varlen sequences zero-padded to the longest of their length group
    chunk_bwd_wy_recompute the forward's per-key prepare (A written too)
    chunk_bwd_* stages     on the head-first rows as one-head sequences (S: the forward's h,
                           read through a row table per layout, _Layout.state_rows)
    chunk_bwd_scatter      head-first dq, dk, dv -> token-first: summed over each key head's
                           value heads, through the l2norm's backward

The gate's activation (use_gate_in_kernel: g <- -exp(A_log) softplus(g + dt_bias), or
KDA's lower-bounded form) and beta's sigmoid are differentiated by torch (per-token
tensors, small beside q, k, v).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dsl import Options, SpecError
from . import chunk_bwd

#: head dims the backward stages are generated for
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
    cu: tuple | None = None                 # host cu_seqlens (varlen) or None
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


def needs_grad(*tensors) -> bool:
    """True when autograd would record a call on these tensors."""
    import torch
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def run_forward(call: DeltaRuleCall, q, k, v, beta, initial_state, g=None, A_log=None,
                dt_bias=None):
    """(o, final_state or None, h [NT, HV, K, V] in q's dtype: the state entering each
    chunk) from the chunked forward (tests replace this on the CPU)."""
    from . import api
    extra = {"lower_bound": call.lower_bound} if call.lower_bound is not None else {}
    return api.train_forward(call.spec, q, k, v, g, beta, scale=call.scale,
                       initial_state=initial_state,
                       output_final_state=call.output_final_state,
                       options=call.options, cu_seqlens=call.cu_seqlens,
                       cu_seqlens_cpu=call.cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias,
                       **extra)


class ChunkDeltaRuleFunction:
    """Namespace of the autograd Function (built lazily so importing needs no torch)."""
    _fn = None

    @classmethod
    def apply(cls, call, q, k, v, beta, initial_state, g=None, A_log=None, dt_bias=None):
        """g, A_log, dt_bias: the scalar gate's inputs (call.spec gated)."""
        if cls._fn is None:
            cls._fn = _make_function()
        return cls._fn.apply(call, q, k, v, beta, initial_state, g, A_log, dt_bias)


def _make_function():
    import torch

    class _ChunkDeltaRule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, call, q, k, v, beta, initial_state, g, A_log, dt_bias):
            gate = (g, A_log, dt_bias) if call.gated else ()
            o, final, h = run_forward(call, q, k, v, beta, initial_state, *gate)
            ctx.call = call
            ctx.save_for_backward(q, k, v, beta, initial_state, g, A_log, dt_bias, h)
            ctx.set_materialize_grads(False)
            return o, final

        @staticmethod
        def backward(ctx, do, dht):
            q, k, v, beta, initial_state, g, A_log, dt_bias, h = ctx.saved_tensors
            if ctx.call.gated or ctx.call.keyed:
                grads = gated_backward(ctx.call, q, k, v, g, beta, initial_state, A_log,
                                       dt_bias, do, dht, h)
                grads = grads[:3] + (grads[4], grads[5], grads[3]) + grads[6:]
            else:
                grads = deltanet_backward(ctx.call, q, k, v, beta, initial_state, do, dht, h)
                grads = grads + (None, None, None)
            return (None, *(x if need else None
                            for x, need in zip(grads, ctx.needs_input_grad[1:])))

    return _ChunkDeltaRule


def check_trainable(q, k, v, beta, initial_state, options: Options, cu_seqlens, g=None,
                    spec=None):
    """Raise SpecError for what the backward does not support (never a wrong gradient).
    spec: a scalar-gate spec checks Gated DeltaNet's call (g [B, T, HV], GVA allowed), a
    per-key-gate spec KDA's (g [B, T, HV, K])."""
    import torch
    keyed = chunk_bwd.is_key(spec)
    gated = chunk_bwd.is_gated(spec) or keyed
    what = ("the KDA backward" if keyed else "the Gated DeltaNet backward" if gated
            else "the DeltaNet backward")
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
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
        raise SpecError(f"{what} is generated for K, V in {HEAD_DIMS}, got "
                        f"K={q.shape[-1]}, V={v.shape[-1]}")
    names = ("state_v_first",) if gated else ("beta_sigmoid", "allow_neg_eigval",
                                              "gate_in_kernel", "state_v_first")
    unsupported = [n for n in names if getattr(options, n)]
    if unsupported:
        raise SpecError(f"{what} does not support {unsupported} (yet)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise SpecError(f"cu_seqlens needs B == 1, got B={q.shape[0]}")


# -- layouts --------------------------------------------------------------------------------

class _Layout:
    """[B, T, H, (D)] <-> head-first [N, H, L, (D)]: a transpose for fixed length; for
    varlen (B == 1, host cu) the sequences ``seqs`` (one length group, :func:`_layouts`)
    are the rows of N, zero-padded to the group's longest; multiple: the head-first length
    is zero-padded to a multiple of it. The large tensors (q, k, v, do and their gradients)
    move by chunk_bwd's gather / scatter kernels through row_map; the per-token ones (beta,
    g and theirs) and the per-sequence states by torch here; the forward's per-chunk states
    stay where they are, read through state_rows' table."""

    def __init__(self, B, T, cu, device, multiple=1, seqs=None):
        import torch
        self.cu, self.T = cu, T
        self.pad = -T % multiple
        self.covered = cu is None or (cu[0] == 0 and cu[-1] == B * T)   # every token a row
        C = chunk_bwd.CHUNK
        if cu is None:          # (each sequence's chunks in the forward's h: first, count)
            self.nc = torch.full((B,), -(-T // C), dtype=torch.long)
            self.c0 = torch.arange(B, dtype=torch.long) * -(-T // C)
            self.N, self.L, self.seqs = B, T + self.pad, None
            pos = torch.arange(self.L, device=device, dtype=torch.int32)
            base = torch.arange(B, device=device, dtype=torch.int32)[:, None] * T
            self.row_map = torch.where(pos < T, base + pos, -1)
            return
        seqs = list(range(len(cu) - 1)) if seqs is None else list(seqs)
        nc_all = torch.tensor([-(-(b - a) // C) for a, b in zip(cu[:-1], cu[1:])],
                              dtype=torch.long)
        self.nc = nc_all[seqs]
        self.c0 = (torch.cumsum(nc_all, 0) - nc_all)[seqs]
        lens = torch.tensor([cu[i + 1] - cu[i] for i in seqs], dtype=torch.long)
        starts = torch.tensor([cu[i] for i in seqs], dtype=torch.long)
        self.N, self.L = len(seqs), int(lens.max()) if seqs else 0
        self.L += -self.L % multiple
        seq = torch.repeat_interleave(torch.arange(self.N), lens)
        pos = torch.arange(len(seq)) - (torch.cumsum(lens, 0) - lens)[seq]
        self.seqs = torch.tensor(seqs, dtype=torch.long, device=device)
        self.seq, self.pos, self.tok = (x.to(device) for x in (seq, pos, starts[seq] + pos))
        col = torch.arange(self.L, dtype=torch.long)
        rows = torch.where(col < lens[:, None], starts[:, None] + col, -1)
        self.row_map = rows.to(torch.int32).to(device)

    def to_head_first(self, x):
        if self.cu is None:
            if self.pad:
                x = torch_pad_time(x, self.pad)
            return x.transpose(1, 2).contiguous()
        out = x.new_zeros(self.N, self.L, *x.shape[2:])
        out[self.seq, self.pos] = x[0, self.tok]
        return out.transpose(1, 2).contiguous()

    def put(self, full, y):
        """The head-first y of this layout's rows into its tokens of the token-first full."""
        if self.cu is None:
            full.copy_(y.transpose(1, 2)[:, :self.T])
        else:
            full[0, self.tok] = y.transpose(1, 2)[self.seq, self.pos].to(full.dtype)

    def state_rows(self, h):
        """The forward's states h [NT, HV, K, V] as the backward stages read them: (rows
        [NT HV, K, V], srow [N, HV, ceil(L / 64)] int32): chunk c of this layout's
        sequence i enters with row (c0 + c) HV + hv, c0 its first chunk in h; chunks past
        its end (zero padding: their rows and gradients are dropped) read its last one."""
        import torch
        NT, HV = h.shape[:2]
        c = torch.arange(-(-self.L // chunk_bwd.CHUNK), dtype=torch.long)
        last = (self.nc - 1).clamp_min(0)[:, None]
        chunk = (self.c0[:, None] + torch.minimum(c[None, :], last)).clamp(0, max(NT - 1, 0))
        srow = chunk[:, None, :] * HV + torch.arange(HV, dtype=torch.long)[None, :, None]
        return h.reshape(NT * HV, *h.shape[2:]), srow.to(torch.int32).to(h.device)

    def rows(self, x):
        """This layout's rows of a per-sequence tensor [N_all, ...] (None stays None)."""
        return x if x is None or self.seqs is None else x[self.seqs]

    def put_rows(self, full, x):
        if self.seqs is None:
            full.copy_(x)
        else:
            full[self.seqs] = x.to(full.dtype)


def _layouts(B, T, cu, device, multiple) -> list:
    """The layouts a backward runs: one for fixed length; for varlen one per length group
    of the arch (varlen_groups: each group padded to its own longest sequence)."""
    if cu is None:
        return [_Layout(B, T, cu, device, multiple)]
    from ..codegen.arch import get_arch
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    groups = get_arch(chunk_bwd.ARCH).varlen_groups(lens, chunk_bwd.CHUNK) or [[]]
    return [_Layout(B, T, cu, device, multiple, seqs) for seqs in groups]


def _backward_by_layout(call, q, k, v, do, initial_state, dht, multiple, stages, per_token):
    """The layout loop of both backwards: per layout (_layouts) gather q, k, v, do, run
    ``stages(lay, heads, want_dh0, dht)`` -> (dqh, dkh, dvh, dh0 or None, [head-first
    gradients of the per_token tensors]), scatter dq, dk, dv and put the rest into f32
    zeros shaped like ``per_token``'s. Returns (dq, dk, dv, dh0 f32 or None, [per-token
    gradients])."""
    import torch
    B, T = q.shape[:2]
    chunk_bwd.announce_layout(q, v, call.l2norm_qk, spec=call.spec)
    lays = _layouts(B, T, call.cu, q.device, multiple)
    out = None          # the token-first gradients, allocated after the first stages
    full = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in per_token]
    want_dh0 = initial_state is not None
    dh0 = (torch.empty(initial_state.shape, dtype=torch.float32, device=q.device)
           if want_dh0 else None)
    dht = None if dht is None else dht.float().contiguous()
    qd, kd = q.detach(), k.detach()
    for lay in lays:
        heads = chunk_bwd.gather_inputs(qd, kd, v.detach(), do, lay.row_map, call.scale,
                                        call.l2norm_qk, spec=call.spec)
        dqh, dkh, dvh, dh0_rows, grads = stages(lay, heads, want_dh0, lay.rows(dht))
        del heads
        out = out or chunk_bwd.grad_buffers(q, v, lays[0].covered)
        chunk_bwd.scatter_grads(dqh, dkh, dvh, qd, kd, lay.row_map, out, call.l2norm_qk,
                                spec=call.spec)
        for dst, y in zip(full, grads):
            lay.put(dst, y)
        if dh0 is not None:
            lay.put_rows(dh0, dh0_rows)
    return (*out, dh0, full)


def torch_pad_time(x, n):
    """x [B, T, ...] with n zero rows appended along T."""
    import torch
    return torch.cat([x, x.new_zeros(x.shape[0], n, *x.shape[2:])], 1)


def deltanet_backward(call: DeltaRuleCall, q, k, v, beta, initial_state, do, dht, h):
    """Gradients of chunk_delta_rule under sum(o * do) + sum(final_state * dht).

    q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] (f16 / bf16; beta any float dtype);
    initial_state [N, H, K, V] or None; do like v or None (0); dht [N, H, K, V] or None
    (0); h [NT, H, K, V]: the forward's per-chunk states (run_forward). Returns (dq, dk,
    dv, dbeta, dh0) in the inputs' shapes and dtypes (dh0 None without an initial state).
    """
    dq, dk, dv, dbeta, _, dh0 = packed_backward(call, q, k, v, beta.float(), None,
                                                initial_state, do, dht, h)
    return (dq, dk, dv, dbeta.to(beta.dtype),
            None if dh0 is None else dh0.to(initial_state.dtype))


def packed_backward(call: DeltaRuleCall, q, k, v, b_in, g_in, initial_state, do, dht, h):
    """The none / scalar gate's backward on the call's own token-first tensors (packed
    varlen as it comes, no padding): the recompute of A, w, u by the forward's prepare
    (with q, k's l2norm), the four stages (q scaled: o = f(scale q)), then dq, dk summed
    over each key head's value heads through the l2norm's backward. b_in, g_in: the
    effective beta, log gate (f32, g_in None: no gate). Returns (dq, dk, dv (input
    dtype), dbeta, dg [B, T, HV] (or None), dh0 [N, HV, K, V] f32 (or None))."""
    import torch
    from . import chunk, runtime
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    Ttot, dt, dev = B * T, q.dtype, q.device
    cu = call.cu if call.cu is not None else tuple(T * b for b in range(B + 1))
    N, gated, n = len(cu) - 1, g_in is not None, cu[-1]   # tokens past cu[-1]: in no sequence
    if n == 0:              # no token: the final state is the initial one
        dh0 = None if initial_state is None else (
            torch.zeros(initial_state.shape, dtype=torch.float32, device=dev)
            if dht is None else dht.float().clone())
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                b_in.new_zeros(B, T, HV), b_in.new_zeros(B, T, HV) if gated else None, dh0)
    flat = lambda x: x.reshape(Ttot, *x.shape[2:])[:n].contiguous()  # noqa: E731
    f32 = lambda *s: torch.zeros(*s, dtype=torch.float32, device=dev)  # noqa: E731
    params = chunk_bwd.train_params(H=H, HV=HV, K=K, V=V, dtype=str(dt).replace("torch.", ""),
                                    chains=N * HV, l2norm=call.l2norm_qk,
                                    use_dht=dht is not None,
                                    store_dh0=initial_state is not None, gated=gated,
                                    spec=call.spec)
    runtime.announce(call.spec, chunk_bwd.ARCH, params)      # recording(): all at once
    tables = chunk._tables(cu, chunk_bwd.CHUNK, dev, 0)
    qf, kf, vf, bf = flat(q.detach()), flat(k.detach()), flat(v.detach()), flat(b_in.to(dt))
    x = chunk_bwd.recompute(qf, kf, vf, bf,
                            flat(g_in) if gated else None, tables, params, call.spec)
    x.update(tables, q=(x["q"] * call.scale).to(dt), v=vf,
             beta=bf, do=flat(torch.zeros_like(v) if do is None else do),
             S=h, state_row=torch.arange(tables["chunk_bos"].numel(), dtype=torch.int32,
                                         device=dev),
             dht=f32(1, HV, K, V) if dht is None else dht.float().contiguous(),
             dh0=f32(N, HV, K, V) if initial_state is not None else f32(1, HV, K, V))
    chunk_bwd.run_stages(call.spec, params, x)
    dq, dk = chunk_bwd.key_grads(x, qf, kf, call.scale, params, call.spec)
    shape = lambda y: _tokens(y, B, T)  # noqa: E731
    return (shape(dq), shape(dk), shape(x["dv"]), shape(x["dbeta"]),
            shape(x["dg"]) if gated else None,
            x["dh0"] if initial_state is not None else None)


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
    l2norm is the gather / scatter kernels'.)"""
    import torch
    from ..dsl.torch_reference import softplus_fla
    g_in = g.float()
    if call.gate_in_kernel:
        # per key channel: A_log [HV] -> [HV, 1], dt_bias [HV * K] -> [HV, K]
        shape = (g.shape[2], -1) if call.keyed else (-1,)
        x = g_in if dt_bias is None else g_in + dt_bias.float().reshape(shape)
        a = None if A_log is None else torch.exp(A_log.float().reshape(g.shape[2], -1)
                                                 if call.keyed else A_log.float().reshape(-1))
        if call.lower_bound is not None:          # KDA's lower-bounded gate
            g_in = float(call.lower_bound) * torch.sigmoid(x if a is None else a * x)
        else:
            g_in = -a * softplus_fla(x)
    b_in = beta.float()
    if call.beta_sigmoid:
        b_in = torch.sigmoid(b_in) * (2.0 if call.allow_neg_eigval else 1.0)
    return g_in, b_in


def gated_backward(call: DeltaRuleCall, q, k, v, g, beta, initial_state, A_log, dt_bias, do,
                   dht, h):
    """Gradients of chunk_gated_delta_rule (scalar gate g [B, T, HV]; A_log, dt_bias [HV])
    or chunk_kda (per-key gate g [B, T, HV, K]; dt_bias HV * K elements) under
    sum(o * do) + sum(final_state * dht).

    q, k [B, T, H, K], v [B, T, HV, V] (f16 / bf16; HV a multiple of H); beta [B, T, HV]
    (any float dtype); A_log, dt_bias with gate_in_kernel, else None; initial_state
    [N, HV, K, V] or None; do like v or None (0); dht [N, HV, K, V] or None (0); h
    [NT, HV, K, V]: the forward's per-chunk states (run_forward). Returns
    (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) in the inputs' shapes and dtypes (None
    for an input not given). The scalar gate runs :func:`packed_backward` on the call's
    tensors; the per-key gate the head-first path (_backward_by_layout, _key_stages: q, k,
    v, do moved by the gather / scatter kernels). The gate's and beta's activations are
    differentiated by torch around the stages.
    """
    import torch
    raw = [None if x is None else x.detach().requires_grad_()
           for x in (g, beta, A_log, dt_bias)]
    with torch.enable_grad():
        g_in, b_in = _gated_inputs(call, *raw)
    g_d, b_d = g_in.detach(), b_in.detach().to(q.dtype)

    if call.keyed:
        def stages(lay, heads, want_dh0, dht_rows):
            dqh, dkh, dvh, dbh, dh0, dgh = _key_stages(call, lay, heads, g_d, b_d, want_dh0,
                                                       dht_rows, lay.state_rows(h))
            return dqh, dkh, dvh, dh0, [dgh, dbh]

        dq, dk, dv, dh0, (dg, dbeta) = _backward_by_layout(
            call, q, k, v, do, initial_state, dht, chunk_bwd.CHUNK, stages, [g_in, b_in])
    else:
        dq, dk, dv, dbeta, dg, dh0 = packed_backward(call, q, k, v, b_in.detach(), g_d,
                                                     initial_state, do, dht, h)
    leaves = [x for x in raw if x is not None]
    grads = iter(torch.autograd.grad((g_in, b_in), leaves, (dg, dbeta.float()),
                                     allow_unused=True))
    dg, dbeta, dA_log, ddt_bias = [None if x is None else _cast(next(grads), x) for x in raw]
    return (dq, dk, dv, dg, dbeta,
            None if dh0 is None else dh0.to(initial_state.dtype), dA_log, ddt_bias)


def _cast(d, x):
    return None if d is None else d.to(x.dtype)


def _key_stages(call, lay, heads, g_in, b_in, want_dh0, dht, states):
    """The per-key gate's recompute and backward stages on the gathered head-first heads
    (qh, kh, vh, doh), the activated g, beta and the forward's states (rows, srow:
    _Layout.state_rows); the in-chunk cumulative gate per key channel is a torch cumsum
    (f32). Returns head-first (dq, dk, dv, dbeta, dh0, dg)."""
    qh, kh, vh, doh = heads
    bh, gh = lay.to_head_first(b_in), lay.to_head_first(g_in.float())
    N, HV, L = gh.shape[:3]
    C = chunk_bwd.CHUNK
    g_cum = gh.view(N, HV, L // C, C, *gh.shape[3:]).cumsum(3).view(gh.shape)
    S, srow = states
    rec = dict(chunk_bwd.key_recompute(qh, kh, vh, bh, gh, spec=call.spec), S=S, srow=srow)
    return chunk_bwd.key_backward_stages(doh, qh, kh, vh, bh, g_cum, rec, dht=dht,
                                         want_dh0=want_dh0, spec=call.spec)


def train(spec, opts: Options, q, k, v, g, beta, scale, initial_state, output_final_state,
          cu_seqlens, cu_seqlens_cpu, A_log=None, dt_bias=None, lower_bound=None):
    """A differentiable call of a gated delta-rule spec (chunk_gated_delta_rule: the
    scalar gate; chunk_kda: the per-key gate, lower_bound its lower-bounded gate):
    checked, then the autograd Function. Returns (o, final_state or None)."""
    check_trainable(q, k, v, beta, initial_state, opts, cu_seqlens, g=g, spec=spec)
    if opts.gate_in_kernel and A_log is None and lower_bound is None:
        raise SpecError("use_gate_in_kernel=True needs A_log")
    cu = None
    if cu_seqlens is not None:
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        cu = tuple(int(x) for x in host.tolist())
    call = DeltaRuleCall(
        spec=spec, scale=spec.scale_for(q.shape[-1], scale), l2norm_qk=opts.l2norm_qk,
        output_final_state=bool(output_final_state), gate_in_kernel=opts.gate_in_kernel,
        beta_sigmoid=opts.beta_sigmoid, allow_neg_eigval=opts.allow_neg_eigval,
        lower_bound=(None if lower_bound is None or not opts.gate_in_kernel
                     else float(lower_bound)), cu=cu,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return ChunkDeltaRuleFunction.apply(call, q, k, v, beta, initial_state, g, A_log,
                                        dt_bias)
