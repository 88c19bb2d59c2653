"""Context-parallel scaling benchmark (issue 17): one long sequence sharded over 1 and 2
ranks (NCCL, one GPU each), GDN and KDA, forward through linattn.distributed.cp_forward.

    python3 bench/cp_bench.py [--worlds 1 2] [--tokens 131072 524288 1048576]
        [--ops gdn kda] [--iters 5] [--out bench/results/cp_h200x2.json]
    python3 bench/cp_bench.py --cpu-smoke      (gloo on the CPU, the fp64 reference as the
                                                local pass, tiny shapes: the script's logic)

Per (op, tokens, world): every rank times its whole cp_forward call with CUDA events
between barriers (median of --iters after a warm-up call), and separately the two
exchanges alone at the same sizes (the carry all_gather, the final states' all_reduce);
end to end = the slowest rank, comm share = exchange time / end to end. Shapes: Qwen3-Next's
GDN (16 key / 32 value heads, K = V = 128, l2norm) and Kimi Linear's KDA (32 heads,
K = V = 128, l2norm), bf16, B = 1; the world-1 row is the same call on one GPU (no
exchange). Every row is also checked: rank outputs concatenated against the world-1
output (relative error, bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch

MODELS = {"gdn": ("chunk_gated_delta_rule", 16, 32), "kda": ("chunk_kda", 32, 32)}


def inputs(op, T, seed, device, dtype=torch.bfloat16, K=128, V=128):
    name, H, HV = MODELS[op]
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V)
    gate = (torch.nn.functional.logsigmoid(rnd(1, T, HV) + 3) if op == "gdn"
            else torch.nn.functional.logsigmoid(rnd(1, T, HV, K) + 3))
    beta = torch.sigmoid(rnd(1, T, HV))
    xs = [q.to(dtype), k.to(dtype), v.to(dtype), gate.float(), beta.to(dtype)]
    return [x.to(device) for x in xs], name


def _time(fn, iters, sync):
    fn()
    sync()
    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def rank_main(rank, world, port, args, out_dir):
    import torch.distributed as dist

    import linattn
    from linattn.distributed import cp_forward
    smoke = args["cpu_smoke"]
    if not smoke:
        torch.cuda.set_device(rank)
    dev = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if world > 1:
        dist.init_process_group("gloo" if smoke else "nccl", rank=rank, world_size=world,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=timedelta(seconds=300))

    def sync():
        if not smoke:
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()
    rows = []
    for op in args["ops"]:
        for T in args["tokens"]:
            kw = dict(K=16, V=16, dtype=torch.float64) if smoke else {}
            xs, name = inputs(op, T, 0, dev, **kw)
            fn = _smoke_fn(op) if smoke else getattr(linattn, name)
            flags = {} if smoke else {"use_qk_l2norm_in_kernel": True}
            Tr = T // world
            mine = [x[:, rank * Tr:(rank + 1) * Tr] for x in xs]
            call = (lambda: cp_forward(fn, *mine, output_final_state=True, **flags)) \
                if world > 1 else (lambda: fn(*mine, output_final_state=True, **flags))
            with torch.no_grad():
                ms = _time(call, args["iters"], sync)
                o, ht = call()
                comm = _comm_ms(op, xs, world, dev, args["iters"], sync) if world > 1 else 0.0
            torch.save(o.cpu(), f"{out_dir}/o-{op}-{T}-{world}-{rank}.pt")
            rows.append(dict(op=op, tokens=T, world=world, rank=rank, ms=ms, comm_ms=comm))
            del xs, mine, o, ht
            if not smoke:
                torch.cuda.empty_cache()
    with open(f"{out_dir}/rows-{world}-{rank}.json", "w") as f:
        json.dump(rows, f)
    if world > 1:
        dist.destroy_process_group()


def _comm_ms(op, xs, world, dev, iters, sync):
    """The two exchanges alone at cp_forward's sizes: the carry ([M (K x K), B (K x V),
    flag] per value head) all_gather and the final states' all_reduce."""
    import torch.distributed as dist
    HV, K, V = xs[2].shape[2], xs[0].shape[3], xs[2].shape[3]
    dt = torch.float64 if dev.type == "cpu" else torch.float32
    carry = torch.zeros(HV * K * (K + V) + 1, dtype=dt, device=dev)
    finals = torch.zeros(1, HV, K, V, dtype=dt, device=dev)
    outs = [torch.empty_like(carry) for _ in range(world)]
    return _time(lambda: (dist.all_gather(outs, carry), dist.all_reduce(finals)), iters, sync)


def _smoke_fn(op):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from _cp_inputs import reference_fn

    from linattn.ops.registry import get_spec
    ref = reference_fn(get_spec(op))
    return lambda q, k, v, g, beta, **kw: ref(q, k, v, g, beta, **kw)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--tokens", nargs="*", type=int, default=[131072, 524288, 1048576])
    ap.add_argument("--ops", nargs="*", default=["gdn", "kda"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT_DIR", "."), "cp.json"))
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.tokens, a.iters = [256], 2
    import tempfile

    import torch.multiprocessing as mp
    tmp = tempfile.mkdtemp()
    args = dict(ops=a.ops, tokens=a.tokens, iters=a.iters, cpu_smoke=a.cpu_smoke)
    for world in a.worlds:
        mp.start_processes(rank_main, args=(world, _port(), args, tmp), nprocs=world,
                           start_method="spawn")
    rows = []
    for op in a.ops:
        for T in a.tokens:
            ref = torch.load(f"{tmp}/o-{op}-{T}-1-0.pt") if 1 in a.worlds else None
            for world in a.worlds:
                per = [r for rk in range(world)
                       for r in json.load(open(f"{tmp}/rows-{world}-{rk}.json"))
                       if r["op"] == op and r["tokens"] == T]
                end = max(r["ms"] for r in per)
                comm = max(r["comm_ms"] for r in per)
                o = torch.cat([torch.load(f"{tmp}/o-{op}-{T}-{world}-{rk}.pt")
                               for rk in range(world)], 1)
                err = (None if ref is None else
                       float((o.double() - ref.double()).norm() / ref.double().norm()))
                rows.append(dict(op=op, tokens=T, world=world, ms=end,
                                 ms_per_rank=[r["ms"] for r in per], comm_ms=comm,
                                 comm_share=comm / end if end else None, rel_err_vs_1=err))
                ranks = ", ".join(f"{r['ms']:.3f}" for r in per)
                print(f"{op:4s} T={T:8d} world={world}: {end:9.3f} ms (ranks {ranks}), "
                      f"comm {comm:.3f} ms, err vs 1 GPU {err}", flush=True)
    doc = dict(gpu=None if a.cpu_smoke else torch.cuda.get_device_name(0),
               commit=os.environ.get("LINATTN_COMMIT"), rows=rows)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
