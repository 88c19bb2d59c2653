"""Probe of a training step on the GPU: where the device time of linattn-bench's training
step (cli/bench/train.py: forward, then autograd.grad of every input) goes, per kernel,
ours against fla's, and the forward alone.

    python3 bench/train_probe.py [--ops GDNTrain KDATrain GLATrain DeltaNetTrain]
        [--workload '*-4k'] [--iters 10] [--budget-s 200] [--impls linattn fla]

Device time as bench/probe_lib.py's device_times (union of the call's kernels, L2 flushed
before each call, median). One line per row and implementation, the kernels sorted by
time; JSON to $OUT_DIR (or $OUT) /train_probe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_lib import device_times  # noqa: E402

import torch  # noqa: E402

from linattn.cli.bench import inputs, run, train, workloads  # noqa: E402


def _forward_only(impl, row, x):
    """The same call without the gradients (no leaf requires grad)."""
    f = train.function(impl, row.op)
    kw = {"scale": row.options.get("scale"), "output_final_state": True}
    kw.update({n: True for n in train.FLAGS if row.options.get(n)})
    if "cu_seqlens" in x:
        kw["cu_seqlens"] = x["cu_seqlens"]
        if impl == "linattn":
            kw["cu_seqlens_cpu"] = x["cu_seqlens_cpu"]
    per_token = {n: x[n] for n in ("g", "beta") if n in x}
    return lambda: f(x["q"], x["k"], x["v"], **per_token, initial_state=x.get("initial_state"),
                     **kw)


def probe(row, iters, impls):
    x = inputs.build_inputs(row, "cuda", 1)
    run.precompile_rows([row])
    res = {"op": row.op, "workload": row.workload}
    for impl in impls:
        try:
            step, _ = train.make(impl, row, x)
            ms, per, n = device_times(step, iters=iters)
            with torch.no_grad():
                fms, fper, _ = device_times(_forward_only(impl, row, x), iters=iters)
            res[impl] = {"ms": ms, "kernels": n, "per": per, "fwd_ms": fms, "fwd_per": fper}
        except Exception as e:
            traceback.print_exc()
            res[impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(line(res, [impl]), flush=True)
    return res


def line(r, impls):
    out = [f"{r['op']} {r['workload']}"]
    for impl in impls:
        d = r.get(impl, {})
        if "error" in d:
            out.append(f"  {impl}: ERROR {d['error'][:200]}")
            continue
        top = sorted(d["per"].items(), key=lambda kv: -kv[1])
        out.append(f"  {impl}: step {d['ms']:.3f} ms ({d['kernels']} kernels), forward "
                   f"{d['fwd_ms']:.3f} ms; " + " ".join(f"{k[:34]}={v:.3f}" for k, v in top[:14]))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="*", default=list(workloads.TRAIN_OPS))
    ap.add_argument("--workload", default="*-4k")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=0)
    ap.add_argument("--impls", nargs="*", default=["linattn", "fla"])
    a = ap.parse_args()
    rows = workloads.select(workloads.train_rows(), ops=a.ops, workload=a.workload)
    t0, results = time.time(), []
    out = os.environ.get("OUT_DIR") or os.environ.get("OUT")
    for row in rows:
        if a.budget_s and time.time() - t0 > a.budget_s:
            print(f"{row.op} {row.workload}: skipped (--budget-s)", flush=True)
            continue
        r = probe(row, a.iters, a.impls)
        r["t_s"] = round(time.time() - t0, 1)
        results.append(r)
        if out:
            with open(os.path.join(out, "train_probe.json"), "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
