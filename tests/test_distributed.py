"""Context parallelism (ops/distributed.py, ``linattn.distributed.cp_forward``).

* simulated ranks (threads in one process, the fp64 reference as the local pass) against
  the single-pass fp64 reference: 2, 3, 4 ranks, uneven shards, varlen sequences crossing
  0, 1 and several rank boundaries, with and without initial states: ~1e-10;
* real torch.distributed runs, gloo on the CPU, 2 and 3 spawned processes;
* ``gpu``: the family's kernels in 2 and 3 processes on the GPU(s) against one call
  (bf16 tolerance).
"""
import socket
import time

import pytest
import torch

from linattn.distributed import cp_forward, shard_of
from linattn.dsl import SpecError

from _cp_inputs import (KERNELS, SPECS, case_inputs, make_inputs, reference_fn, run_threads,
                        shard)

#: (lengths per rank, global cu_seqlens or None: 2 batch rows, each one sharded sequence)
LAYOUTS = [
    pytest.param([100, 157], None, id="rows-2"),
    pytest.param([64, 1, 99, 136], None, id="rows-4-one-token-rank"),
    pytest.param([90, 60, 150], [0, 40, 90, 150, 220, 300], id="varlen-3-cross-none"),
    pytest.param([100, 130, 170], [0, 40, 250, 260, 400], id="varlen-3-cross-two"),
    pytest.param([120, 80, 100], [0, 50, 130, 170, 210, 300], id="varlen-3-cross-one-each"),
    pytest.param([70, 50, 33, 147], [0, 10, 280, 300], id="varlen-4-cross-three"),
    pytest.param([77, 64, 129], [0, 270], id="varlen-3-one-sequence"),
]
TOL = 1e-10


def _seed():
    return time.time_ns() % (2 ** 31)


def _close(got, want, what):
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= TOL * scale, f"{what}: max error {err:.3e} (scale {scale:.2e})"


def _simulated(spec, lengths, cu, seed, h0=True, **kw):
    """(cp outputs concatenated, each rank's final states) and the single-pass reference."""
    B, N = (1, len(cu) - 1) if cu else (2, 2)
    q, k, v, gates, state = make_inputs(spec, sum(lengths), N, seed, B=B, h0=h0)
    if state is not None and kw.get("state_v_first"):
        state = state.transpose(-1, -2).contiguous()
    fn, cu_t = reference_fn(spec), None if cu is None else torch.tensor(cu)
    want = fn(q, k, v, *gates, initial_state=state, output_final_state=True, cu_seqlens=cu_t,
              **kw)

    def rank(r, group):
        xs = [shard(x, lengths, r) for x in (q, k, v, *gates)]
        return cp_forward(fn, *xs, group=group, cu_seqlens=cu_t, initial_state=state,
                          output_final_state=True, **kw)
    outs = run_threads(len(lengths), rank)
    return torch.cat([o for o, _ in outs], 1), [ht for _, ht in outs], want


@pytest.mark.parametrize("name", ["gdn", "deltanet", "kda", "gla"])
@pytest.mark.parametrize("lengths,cu", LAYOUTS)
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_simulated_ranks_match_single_pass(name, lengths, cu, h0):
    o, finals, (o_ref, ht_ref) = _simulated(SPECS[name], lengths, cu, _seed(), h0=h0)
    _close(o, o_ref, "o")
    for r, ht in enumerate(finals):
        _close(ht, ht_ref, f"final_state on rank {r}")


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_simulated_state_v_first(name):
    o, finals, (o_ref, ht_ref) = _simulated(SPECS[name], [100, 130, 170], [0, 40, 250, 260, 400],
                                            _seed(), state_v_first=True)
    _close(o, o_ref, "o")
    _close(finals[0], ht_ref, "final_state")


def test_shard_of_pieces():
    s = shard_of([100, 130, 170], 1, [0, 40, 250, 260, 400])
    assert (s.start, s.stop, s.first, s.last, s.local_cu) == (100, 230, 1, 1, (0, 130))
    assert s.continues and s.open_end and s.through
    s = shard_of([100, 130, 170], 2, [0, 40, 250, 260, 400])
    assert (s.first, s.last, s.local_cu, s.first_len) == (1, 3, (0, 20, 30, 170), 20)
    assert s.continues and not s.open_end and not s.through
    s = shard_of([90, 60, 150], 1, [0, 40, 90, 150, 220, 300])
    assert (s.first, s.last, s.continues, s.open_end) == (2, 2, False, False)


class _NoComm:
    rank, size = 0, 2

    def all_gather(self, t):
        raise AssertionError("communicated before validating")

    all_reduce_sum = all_gather


def _bad_calls():
    spec = SPECS["gdn"]
    q, k, v, (g, beta), h0 = make_inputs(spec, 50, 2, 0)
    cu = torch.tensor([0, 20, 50])
    fn = reference_fn(spec)
    return [
        (dict(fn=None, args=(q, k, v, g, beta)), "fn must be"),
        (dict(fn=fn, args=(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0])), "at least one"),
        (dict(fn=fn, args=(q, k[:, :10], v, g, beta)), "k has shape"),
        (dict(fn=fn, args=(q, k, v, g[:, :3], beta)), "gate_args[0]"),
        (dict(fn=fn, args=(q, k, v, g, beta), cu_seqlens=torch.tensor([0, 20, 20, 50])),
         "strictly increasing"),
        (dict(fn=fn, args=(q, k, v, g, beta), cu_seqlens=cu, initial_state=h0[:1]),
         "initial_state must be"),
        (dict(fn=fn, args=(q, k, v, g, beta), cu_seqlens_cpu=cu), "without cu_seqlens"),
    ]


@pytest.mark.parametrize("i", range(7))
def test_bad_arguments_raise_one_line_before_communicating(i):
    call, message = _bad_calls()[i]
    fn, args = call.pop("fn"), call.pop("args")
    with pytest.raises(SpecError, match=message.replace("[", r"\[")) as e:
        cp_forward(fn, *args, group=_NoComm(), **call)
    assert "\n" not in str(e.value)


# -- real process groups -----------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(case, world, tmp_path, timeout=120):
    """Run _cp_inputs.worker in ``world`` spawned processes; their (o, ht) per rank."""
    import torch.multiprocessing as mp

    from _cp_inputs import worker
    ctx = mp.start_processes(worker, args=(world, _free_port(), case, str(tmp_path)),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish in {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return [torch.load(tmp_path / f"{r}.pt") for r in range(world)]


def _single(case):
    q, k, v, gates, h0, cu, fn = case_inputs(case)
    return fn(q, k, v, *gates, initial_state=h0, output_final_state=True, cu_seqlens=cu)


@pytest.mark.parametrize("case,world", [
    pytest.param(dict(spec="gdn", lengths=[100, 130, 170], cu=[0, 40, 250, 260, 400]), 3,
                 id="gdn-3-gloo"),
    pytest.param(dict(spec="kda", lengths=[150, 107], cu=[0, 30, 257]), 2, id="kda-2-gloo"),
])
def test_gloo_processes_match_single_process(case, world, tmp_path):
    case = dict(case, seed=_seed())
    o_ref, ht_ref = _single(case)
    outs = _spawn(case, world, tmp_path)
    _close(torch.cat([o for o, _ in outs], 1), o_ref, "o")
    for r, (_, ht) in enumerate(outs):
        _close(ht, ht_ref, f"final_state on rank {r}")


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("world", [2, 3])
def test_gpu_kernels_context_parallel(name, world, tmp_path):
    """The family's kernels over ``world`` processes (NCCL when there are as many GPUs,
    else gloo with every rank on GPU 0) against one call on the whole sequence."""
    # 3 ranks: rank 1 lies inside sequence 1 (the M pass); 2 ranks: sequence 1 crosses
    lengths, cu = ([300, 450, 250], [0, 100, 800, 1000]) if world == 3 else (
        [520, 480], [0, 100, 700, 1000])
    case = dict(spec=name, lengths=lengths, cu=cu, seed=_seed(), gpu=True,
                nccl=torch.cuda.device_count() >= world, dims=dict(H=4, K=128, V=128))
    o_ref, ht_ref = _single(case)          # first: the kernels compiled before the ranks start
    outs = _spawn(case, world, tmp_path, timeout=540)
    assert _rel(torch.cat([o for o, _ in outs], 1), o_ref.cpu()) < 1e-2
    for _, ht in outs:
        assert _rel(ht, ht_ref.cpu()) < 1e-2


# -- gradients across the ranks -------------------------------------------------------------

def _grads_simulated(spec, lengths, cu, seed, h0=True):
    """Every input's gradient of sum(o * do) + sum(final_state * dht): simulated ranks
    (each its shard's, the initial state's summed over the ranks) and one pass."""
    B, N = (1, len(cu) - 1) if cu else (2, 2)
    q, k, v, gates, state = make_inputs(spec, sum(lengths), N, seed, B=B, h0=h0)
    fn, cu_t = reference_fn(spec), None if cu is None else torch.tensor(cu)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(*v.shape, generator=gen, dtype=v.dtype)
    dht = torch.randn(N, *v.shape[2:3], q.shape[3], v.shape[3], generator=gen, dtype=v.dtype)
    xs = [q, k, v, *gates] + ([state] if state is not None else [])
    leaves = [x.clone().requires_grad_() for x in xs]
    o, ht = fn(*leaves[:3 + len(gates)], initial_state=leaves[-1] if h0 else None,
               output_final_state=True, cu_seqlens=cu_t)
    want = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)

    def rank(r, group):
        mine = [shard(x, lengths, r).clone().requires_grad_() for x in xs[:3 + len(gates)]]
        h = state.clone().requires_grad_() if h0 else None
        o_r, ht_r = cp_forward(fn, *mine, group=group, cu_seqlens=cu_t, initial_state=h,
                               output_final_state=True)
        # every rank backpropagates through the final state (the exchange is a collective);
        # only rank 0 counts it in the loss
        loss = (o_r * shard(do, lengths, r)).sum() + (ht_r * dht).sum() * (r == 0)
        return torch.autograd.grad(loss, mine + ([h] if h0 else []))
    per_rank = run_threads(len(lengths), rank)
    got = [torch.cat([g[i] for g in per_rank], 1) for i in range(3 + len(gates))]
    if h0:
        got.append(sum(g[-1] for g in per_rank))
    return got, want


@pytest.mark.parametrize("name", ["gdn", "deltanet", "kda", "gla"])
@pytest.mark.parametrize("lengths,cu", [LAYOUTS[0], LAYOUTS[3], LAYOUTS[5], LAYOUTS[6]])
def test_simulated_ranks_gradients_match_single_pass(name, lengths, cu):
    got, want = _grads_simulated(SPECS[name], lengths, cu, _seed())
    for i, (a, b) in enumerate(zip(got, want)):
        _close(a, b, f"gradient of input {i}")


@pytest.mark.parametrize("case,world", [
    pytest.param(dict(spec="gdn", lengths=[100, 130, 170], cu=[0, 40, 250, 260, 400]), 3,
                 id="gdn-3-gloo"),
    pytest.param(dict(spec="gla", lengths=[150, 107], cu=[0, 30, 257]), 2, id="gla-2-gloo"),
])
def test_gloo_processes_gradients_match_single_process(case, world, tmp_path):
    from _cp_inputs import grad_seeds
    case = dict(case, seed=_seed(), grad=True)
    q, k, v, gates, h0, cu, fn = case_inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *gates, h0)]
    o, ht = fn(*leaves[:-1], initial_state=leaves[-1], output_final_state=True, cu_seqlens=cu)
    do, dht = grad_seeds(case, o.shape[0], o.shape[1], ht)
    want = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    outs = _spawn(case, world, tmp_path)
    for i in range(len(leaves) - 1):
        _close(torch.cat([g[i] for g in outs], 1), want[i], f"gradient of input {i}")
    _close(sum(g[-1] for g in outs), want[-1], "gradient of initial_state")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_gpu_kernels_context_parallel_gradients(name, tmp_path):
    """Training through cp_forward with the family's kernels (their autograd) on 3 ranks
    (rank 1 inside sequence 1: the M pass) against one call's gradients."""
    from _cp_inputs import grad_seeds
    case = dict(spec=name, lengths=[300, 450, 250], cu=[0, 100, 800, 1000], seed=_seed(),
                gpu=True, grad=True, nccl=torch.cuda.device_count() >= 3,
                dims=dict(H=4, K=128, V=128))
    q, k, v, gates, h0, cu, fn = case_inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *gates, h0)]
    o, ht = fn(*leaves[:-1], initial_state=leaves[-1], output_final_state=True, cu_seqlens=cu)
    do, dht = grad_seeds(case, o.shape[0], o.shape[1], ht)
    want = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    outs = _spawn(case, 3, tmp_path, timeout=540)
    for i in range(len(leaves) - 1):
        assert _rel(torch.cat([g[i] for g in outs], 1), want[i].cpu()) < 1e-2, i
    assert _rel(sum(g[-1] for g in outs), want[-1].cpu()) < 1e-2
