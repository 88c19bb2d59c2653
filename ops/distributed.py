"""Context parallelism for the chunked forward: one sequence (or a packed varlen batch)
sharded along T over the ranks of a torch.distributed process group.

    from linattn.distributed import cp_forward
    o, ht = cp_forward(linattn.chunk_gated_delta_rule, q, k, v, g, beta,
                       cu_seqlens=cu, initial_state=h0, output_final_state=True)

Every rank passes its own tokens [t_r, t_{r+1}) of the global sequence in rank order:
q, k [B, T_r, H, K], v [B, T_r, HV, V] and the per-token gate arguments (``*gate_args``:
g, beta, ... as the family's function takes them positionally after v, each [B, T_r,
...] or None). ``cu_seqlens`` [N + 1] is the *global* one (B == 1, the same on every
rank, strictly increasing); without it each of the B rows is one sequence sharded over
the ranks. ``initial_state`` [N, HV, K, V] (global, the same on every rank, or None) and
``**kw`` (scale, flags, A_log, dt_bias, g_gamma, state_v_first, ...) go to ``fn``
unchanged. Returns (o [B, T_r, HV, V]: this rank's exact outputs, final_state [N, HV,
K, V] of every sequence on every rank, or None).

Exact for every family (no decay threshold): the state recurrence is affine in the
state entering a span, S_end = M S_start + B. Each rank

1. runs ``fn`` on its shard from a zero state for the piece continued from the rank
   before (and the given initial states for sequences that start on it): B_r, the
   final state of its last piece;
2. only when the shard lies wholly inside one sequence that started earlier (it
   continues to the shard's end), runs ``fn`` again with v = 0 of width K and the
   identity as initial state: S_end = M I + 0 = M (the delta rule with any gate; the
   additive rule, where M is the diagonal decay);
3. all_gathers the small (M_r, B_r, through_r) and scans them in rank order into the
   state entering its first piece: X_r = M_r X_{r-1} + B_r if through_r else B_r;
4. reruns only its first piece with that state (the other pieces start on the rank
   and are exact from step 1), then all_reduces the final states (each sequence's row
   is nonzero on the one rank holding its end; the sum adds zeros only).

Collectives: one all_gather of the shard lengths (varlen), one of the carries, one
all_reduce of the final states (output_final_state). ``group``: a ProcessGroup, None
(the default group), or an object with ``rank``, ``size``, ``all_gather(t) -> list``
and ``all_reduce_sum(t) -> tensor`` (tests/test_distributed.py simulates ranks with
threads so). With gloo the carries travel through the CPU. ``fn`` is any function with
the fla chunk signature (the injectable local pass: the tests give the fp64 reference).
Differentiable when ``fn`` is (the families' chunk functions train): the local passes
are ordinary autograd graphs, and the two exchanges are autograd Functions whose backward
is the adjoint exchange (the carries' gradients summed over the ranks and handed back to
the rank each came from; the final states' gradients summed over the ranks). Those
backwards are collectives: every rank backpropagates from its outputs o, and from the
final state if any rank does.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import validate


@dataclass(frozen=True)
class Shard:
    """Where one rank's tokens lie: global tokens [start, stop); its pieces are the
    global sequences first..last (varlen; 0..0 for rows), cut at ``local_cu``."""
    start: int
    stop: int
    first: int = 0
    last: int = 0
    local_cu: tuple | None = None      # None: no cu_seqlens, one piece per batch row
    continues: bool = False            # the first piece's sequence started on a rank before
    open_end: bool = False             # the last piece's sequence goes on past this rank

    @property
    def through(self) -> bool:
        """The shard lies wholly inside one sequence that started earlier."""
        return self.continues and self.first == self.last

    @property
    def first_len(self) -> int:
        return self.stop - self.start if self.local_cu is None else self.local_cu[1]


def shard_of(lengths: list, rank: int, cu: list | None) -> Shard:
    """The Shard of ``rank`` given every rank's token count and the global cu_seqlens."""
    start = sum(lengths[:rank])
    stop = start + lengths[rank]
    total = sum(lengths)
    if cu is None:
        return Shard(start, stop, continues=start > 0, open_end=stop < total)
    first = max(n for n in range(len(cu) - 1) if cu[n] <= start)
    last = min(n for n in range(len(cu) - 1) if cu[n + 1] >= stop)
    local = tuple(max(cu[n], start) - start for n in range(first, last + 1)) + (stop - start,)
    return Shard(start, stop, first, last, local, cu[first] < start, cu[last + 1] > stop)


class TorchGroup:
    """The collectives of a torch.distributed ProcessGroup (gloo: through the CPU)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.cpu = dist.get_backend(group) == "gloo"

    def all_gather(self, t):
        x = t.detach().cpu() if self.cpu else t.detach().contiguous()
        out = [x.new_empty(x.shape) for _ in range(self.size)]
        self.dist.all_gather(out, x, group=self.group)
        return [o.to(t.device) for o in out]

    def all_reduce_sum(self, t):
        x = t.detach().cpu() if self.cpu else t.detach().contiguous().clone()
        self.dist.all_reduce(x, group=self.group)
        return x.to(t.device)


def _collectives(group):
    if all(hasattr(group, n) for n in ("rank", "size", "all_gather", "all_reduce_sum")):
        return group
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise validate.error("group: torch.distributed is not initialised (call "
                             "init_process_group first, or pass a group)")
    return TorchGroup(group)


def check_args(fn, q, k, v, gate_args, cu_seqlens, initial_state, kw) -> list | None:
    """One-line SpecErrors before any communication; returns the host cu_seqlens."""
    import torch
    if not callable(fn):
        raise validate.error(f"fn must be a family's chunk function, got {validate.describe(fn)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise validate.error(f"{name} must be a 4-D tensor [B, T, heads, dim], got "
                                 f"{validate.describe(x)}")
        if x.shape[:2] != q.shape[:2]:
            raise validate.shape_error(name, x.shape, f"[{q.shape[0]}, {q.shape[1]}, ...] as q")
    if q.shape[1] < 1:
        raise validate.error("q: every rank must hold at least one token (T_r >= 1)")
    for i, x in enumerate(gate_args):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape[:2] != q.shape[:2]):
            raise validate.error(f"gate_args[{i}] must be None or a per-token tensor "
                                 f"[{q.shape[0]}, {q.shape[1]}, ...], got {validate.describe(x)}")
    bad = sorted(set(kw) & {"cu_seqlens", "initial_state", "output_final_state"})
    if bad:
        raise validate.error(f"{bad[0]} given twice")
    cu = None
    if cu_seqlens is not None:
        host = kw.pop("cu_seqlens_cpu", None)
        validate.check_cu_seqlens(cu_seqlens, q.shape[0], int(cu_seqlens.reshape(-1)[-1]),
                                  cu_seqlens_cpu=host)
        cu = [int(c) for c in (host if host is not None else cu_seqlens.cpu()).tolist()]
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise validate.error("cu_seqlens must be strictly increasing in cp_forward "
                                 "(no empty sequences)")
    elif "cu_seqlens_cpu" in kw:
        raise validate.error("cu_seqlens_cpu given without cu_seqlens")
    N = q.shape[0] if cu is None else len(cu) - 1
    kv = (v.shape[3], k.shape[3]) if kw.get("state_v_first") or kw.get(
        "transpose_state_layout") else (k.shape[3], v.shape[3])
    want = (N, v.shape[2], *kv)
    if initial_state is not None and (not isinstance(initial_state, torch.Tensor)
                                      or tuple(initial_state.shape) != want):
        raise validate.error(f"initial_state must be {list(want)} (global: every sequence), "
                             f"got {validate.describe(initial_state)}")
    return cu


def cp_forward(fn, q, k, v, *gate_args, group=None, cu_seqlens=None, initial_state=None,
               output_final_state=False, **kw):
    """(o [B, T_r, HV, V], final_state [N, HV, K, V] or None): this rank's part of ``fn``
    over the sequence sharded along T (see the module docstring)."""
    cu = check_args(fn, q, k, v, gate_args, cu_seqlens, initial_state, kw)
    comm = _collectives(group)
    lengths = [q.shape[1]] * comm.size
    if cu is not None:
        import torch
        got = comm.all_gather(torch.tensor([q.shape[1]], dtype=torch.int64, device=q.device))
        lengths = [int(x[0]) for x in got]
        if sum(lengths) != cu[-1]:
            raise validate.error(f"cu_seqlens ends at {cu[-1]}, but the ranks hold "
                                 f"{sum(lengths)} tokens ({lengths})")
    shard = shard_of(lengths, comm.rank, cu)
    local = Local(fn, q, k, v, gate_args, kw, shard, initial_state)
    o, ht, carry = local.first_pass()
    # every rank knows every shard: skip the gather when no piece continues across ranks
    if any(shard_of(lengths, r, cu).continues for r in range(comm.size)):
        carries, o = _exchange().Gather.apply(comm, carry, o)
        if shard.continues:
            o, ht = local.rerun_first(o, ht, local.entering(carries, comm.rank))
    if not output_final_state:
        return o, None
    rows = local.final_rows(ht, len(cu) - 1 if cu else q.shape[0])
    ht, o = _exchange().AllReduce.apply(comm, rows, o)
    return o, ht


_EXCHANGE = []


def _exchange():
    """The autograd Functions of the two exchanges (built on first use: torch imported
    lazily). Gather: (comm, carry, o) -> (every rank's carry stacked [size, n], o); its
    backward sums the stacked gradient over the ranks and returns this rank's row, o's
    gradient unchanged (o routes every rank's backward through it). AllReduce: (comm, x,
    o) -> (the sum of x over the ranks, o), its backward the sum of the gradients. Routing
    o through both orders the two backward collectives alike on every rank: AllReduce's
    (o's gradient passes it first), then Gather's."""
    if _EXCHANGE:
        return _EXCHANGE[0]
    import types

    import torch

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, comm, carry, o):
            ctx.comm, ctx.shape = comm, (comm.size, *carry.shape)
            ctx.like = dict(dtype=carry.dtype, device=carry.device)
            return torch.stack(comm.all_gather(carry.detach())), o.view_as(o)

        @staticmethod
        def backward(ctx, d_all, d_o):
            d_all = d_all if d_all is not None else torch.zeros(ctx.shape, **ctx.like)
            return None, ctx.comm.all_reduce_sum(d_all.contiguous())[ctx.comm.rank], d_o

    class AllReduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, comm, x, o):
            ctx.comm, ctx.like = comm, dict(size=x.shape, dtype=x.dtype, device=x.device)
            return comm.all_reduce_sum(x.detach()), o.view_as(o)

        @staticmethod
        def backward(ctx, d, d_o):
            d = d if d is not None else torch.zeros(**ctx.like)
            return None, ctx.comm.all_reduce_sum(d.contiguous()), d_o

    _EXCHANGE.append(types.SimpleNamespace(Gather=Gather, AllReduce=AllReduce))
    return _EXCHANGE[0]


class Local:
    """One rank's passes of ``fn`` over its shard (states kept K-first inside)."""

    def __init__(self, fn, q, k, v, gate_args, kw, shard: Shard, h0):
        import torch
        self.fn, self.q, self.k, self.v, self.gates, self.kw = fn, q, k, v, gate_args, kw
        self.shard, self.h0 = shard, h0
        self.v_first = bool(kw.get("state_v_first") or kw.get("transpose_state_layout"))
        self.sdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.b = q.shape[0] if shard.local_cu is None else 1      # rows of a carry
        self.HV, self.K, self.V = v.shape[2], k.shape[3], v.shape[3]

    def _layout(self, s):                 # K-first <-> the caller's layout (v-first)
        return s.transpose(-1, -2) if self.v_first else s

    def _call(self, v, h, t1=None, varlen=True):
        """fn on tokens [0, t1) with entering states h (K-first) -> (o, ht K-first)."""
        import torch
        cut = lambda x: x if x is None or t1 is None else x[:, :t1]  # noqa: E731
        cu = self.shard.local_cu
        cu = (torch.tensor(cu, dtype=torch.int32, device=self.q.device)
              if cu is not None and varlen else None)
        o, ht = self.fn(cut(self.q), cut(self.k), cut(v), *map(cut, self.gates),
                        initial_state=self._layout(h).contiguous(), output_final_state=True,
                        cu_seqlens=cu, **self.kw)
        return o, self._layout(ht).to(self.sdtype)

    def _entering_pieces(self):
        """States entering the local pieces, the continued one zero (K-first)."""
        import torch
        s = self.shard
        n = self.b if s.local_cu is None else s.last - s.first + 1
        h = torch.zeros(n, self.HV, self.K, self.V, dtype=self.sdtype, device=self.q.device)
        if self.h0 is not None:
            h0 = self._layout(self.h0).to(h)
            h.copy_(h0 if s.local_cu is None else h0[s.first:s.last + 1])
        if s.continues:                   # rows mode: every row continues
            h[:1 if s.local_cu is not None else n] = 0
        return h

    def first_pass(self):
        """(o, ht, carry): the pass from zero for the continued piece; the carry is
        flat [M (zeros unless through), B, through] for the all_gather."""
        import torch
        o, ht = self._call(self.v, self._entering_pieces())
        B = ht[-self.b:]
        M = torch.zeros(self.b, self.HV, self.K, self.K, dtype=self.sdtype, device=B.device)
        if self.shard.through:
            eye = torch.eye(self.K, dtype=self.sdtype, device=B.device)
            v0 = self.v.new_zeros(*self.v.shape[:3], self.K)
            M = self._call(v0, eye.expand_as(M).contiguous())[1]
        flag = B.new_full((1,), float(self.shard.through))
        return o, ht, torch.cat([M.flatten(), B.flatten(), flag])

    def entering(self, carries, rank):
        """The state entering this rank's first piece: the scan of the carries of the
        ranks before it, X_j = M_j X_{j-1} + B_j if through_j else B_j."""
        nm, nb = self.b * self.HV * self.K * self.K, self.b * self.HV * self.K * self.V
        X = None
        for c in carries[:rank]:
            M = c[:nm].view(self.b, self.HV, self.K, self.K)
            B = c[nm:nm + nb].view(self.b, self.HV, self.K, self.V)
            X = M @ X + B if bool(c[-1] > 0.5) and X is not None else B
        return X

    def rerun_first(self, o, ht, X):
        """o and ht with the first piece recomputed from its true entering state X."""
        import torch
        t1 = self.shard.first_len
        o1, ht1 = self._call(self.v, X, t1=t1, varlen=False)
        o = torch.cat([o1, o[:, t1:]], 1) if t1 < o.shape[1] else o1
        return o, torch.cat([ht1, ht[self.b:]], 0)

    def final_rows(self, ht, N):
        """[N, HV, K, V] (the caller's layout): the final states of the sequences that end
        on this rank, zeros elsewhere."""
        s = self.shard
        out = ht.new_zeros(N, *ht.shape[1:])
        if s.local_cu is None:
            out = out if s.open_end else ht
        else:
            stop = s.last if s.open_end else s.last + 1
            out[s.first:stop] = ht[:stop - s.first]
        return self._layout(out)
