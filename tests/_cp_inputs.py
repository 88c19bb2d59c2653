"""Shared pieces of the context-parallel tests (tests/test_distributed.py): inputs, the
fp64 reference as an fla-style chunk function, simulated ranks, and the spawned worker
(a module of its own so torch.multiprocessing's spawn children can import it)."""
import threading
from datetime import timedelta

import torch
import torch.nn.functional as F

from linattn.dsl import Options
from linattn.dsl import torch_reference as tr
from linattn.ops import deltanet, gdn, gla, kda

SPECS = {s.name: s for s in (gdn.SPEC, deltanet.SPEC, kda.SPEC, gla.SPEC)}
#: the family's chunk function by spec name (the GPU test)
KERNELS = {"gdn": "chunk_gated_delta_rule", "deltanet": "chunk_delta_rule",
           "kda": "chunk_kda", "gla": "chunk_gla"}


def reference_fn(spec):
    """The fp64 chunked reference with the fla chunk signature of ``spec``'s family:
    fn(q, k, v, [g,] [beta,] initial_state=, output_final_state=, cu_seqlens=, scale=,
    state_v_first=)."""
    def fn(q, k, v, *gates, initial_state=None, output_final_state=False, cu_seqlens=None,
           scale=None, state_v_first=False):
        g = gates[0] if spec.has_gate else None
        beta = gates[-1] if spec.has_beta else None
        o, ht = tr.chunked_forward(spec, q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens,
                                   options=Options(state_v_first=state_v_first),
                                   initial_state=initial_state, piece_tokens=0)
        return o, (ht if output_final_state else None)
    return fn


def make_inputs(spec, T, N, seed, H=2, K=16, V=32, B=1, dtype=torch.float64, h0=True):
    """Global inputs (fresh for each seed): q, k, v [B, T, H, *] (k l2-normalised), the
    gate args (g: logsigmoid-like log decays, per key for a key gate; beta in (0, 1)),
    and the initial states [N, H, K, V] (or None)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(B, T, H, K), F.normalize(rand(B, T, H, K), dim=-1), rand(B, T, H, V)
    gates = []
    if spec.has_gate:
        width = (K,) if spec.gate.value == "key" else ()
        gates.append(F.logsigmoid(2.0 + rand(B, T, H, *width)) * 0.5)
    if spec.has_beta:
        gates.append(torch.sigmoid(rand(B, T, H)))
    state = rand(N, H, K, V) * 0.5 if h0 else None
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), [cast(x) for x in gates], state


def shard(x, lengths, rank):
    """Rank ``rank``'s tokens of a [B, T, ...] tensor split by ``lengths``."""
    t0 = sum(lengths[:rank])
    return x[:, t0:t0 + lengths[rank]]


class ThreadGroup:
    """Simulated ranks in one process (one thread each): the collectives cp_forward
    takes in place of a ProcessGroup."""

    def __init__(self, size):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def view(self, rank):
        return _RankView(self, rank)


class _RankView:
    def __init__(self, g, rank):
        self.g, self.rank, self.size = g, rank, g.size

    def all_gather(self, t):
        self.g.slots[self.rank] = t.clone()
        self.g.barrier.wait()
        out = list(self.g.slots)
        self.g.barrier.wait()
        return out

    def all_reduce_sum(self, t):
        return torch.stack(self.all_gather(t)).sum(0)


def run_threads(size, body):
    """[body(rank, group) for each rank], each in its own thread; re-raises the first
    error (the barrier is aborted so no thread waits forever)."""
    group = ThreadGroup(size)
    out, errors = [None] * size, []

    def one(r):
        try:
            out[r] = body(r, group.view(r))
        except BaseException as e:       # noqa: BLE001 (re-raised below)
            errors.append(e)
            group.barrier.abort()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    return out


def worker(rank, world, port, case, out_dir):
    """One spawned rank: gloo (or NCCL with ``case['nccl']``) over tcp://127.0.0.1:port,
    cp_forward of the case's inputs, (o, ht) saved to out_dir/rank.pt."""
    import torch.distributed as dist

    from linattn.distributed import cp_forward
    backend = "nccl" if case.get("nccl") else "gloo"
    if case.get("nccl"):
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        lengths = case["lengths"]
        q, k, v, gates, h0, cu, fn = case_inputs(case, rank)
        mine = [shard(x, lengths, rank) for x in (q, k, v, *gates)]
        if case.get("grad"):            # the gradients of sum(o * do) + [rank 0] sum(ht * dht)
            mine = [x.clone().requires_grad_() for x in mine]
            h0 = h0.clone().requires_grad_()
        o, ht = cp_forward(fn, *mine, cu_seqlens=cu, initial_state=h0, output_final_state=True)
        if case.get("grad"):
            do, dht = grad_seeds(case, o.shape[0], sum(lengths), ht)
            loss = (o * shard(do, lengths, rank)).sum() + (ht * dht).sum() * (rank == 0)
            grads = torch.autograd.grad(loss, mine + [h0])
            torch.save([x.detach().cpu() for x in grads], f"{out_dir}/{rank}.pt")
        else:
            torch.save((o.cpu(), ht.cpu()), f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def grad_seeds(case, B, T, ht):
    """The fixed output gradients of a case: do [B, T, HV, V], dht like ht (fp64)."""
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    HV, V = ht.shape[1], ht.shape[-1]
    do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    return do.to(ht.device), torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.device)


def case_inputs(case, rank=0):
    """(q, k, v, gates, h0, cu_seqlens, fn) of a spawned case, on the rank's device:
    fp64 with the reference, or bf16 (gates f32) with the family's kernel on CUDA."""
    spec = SPECS[case["spec"]]
    cu = case.get("cu")
    N = len(cu) - 1 if cu else 1
    q, k, v, gates, h0 = make_inputs(spec, sum(case["lengths"]), N, case["seed"],
                                     **case.get("dims", {}))
    if not case.get("gpu"):
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        return q, k, v, gates, h0, cu_t, reference_fn(spec)
    import linattn
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    q, k, v = (x.to(dev, torch.bfloat16) for x in (q, k, v))
    gates = [x.to(dev, torch.float32) for x in gates]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    return q, k, v, gates, h0.to(dev, torch.float32), cu_t, getattr(linattn, KERNELS[spec.name])
