"""Probe of the additive rule's state pass on the GPU (codegen/arch/sm90/additive.py: the
sequence split, key / value blocks, fused or three-stage): per workload and plan config,
correctness against the fp64 torch reference (o, final state and, for the GLAChunkFwd
rows, every chunk's state) and device time per call and per kernel (probe_lib's
device_times: union of the call's kernels, L2 flushed, median), next to fla's time in
the committed table (bench/results/h200.json) and the model's time for the state pass.

    python3 bench/additive_probe.py [--only NAME ...] [--configs default segments=0 ...]
        [--sweep-on NAME ...] [--iters 20] [--budget-s 150] [--out additive_probe.json]

--configs: plan configs for every workload ("default" = the model's choice; segments=0:
unsplit, the structure before the split); --sweep-on: workloads also run at SWEEP's
configs (to calibrate the model's step times). Kernels compile first, in parallel.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_lib import device_times, make_inputs  # noqa: E402
from walk_probe import parse_config  # noqa: E402

from linattn.dsl import torch_reference as tref  # noqa: E402
from linattn.ops import chunk, runtime  # noqa: E402

RAGGED = [1, 63, 1000, 3032]
# name -> (table op, table workload, dtype, B, T, H, K, V, lens, initial state, states)
WORKLOADS = {
    "chunk-train-16k-bf16": ("GLAChunkFwd", "train-16k", "bf16", 2, 16384, 4, 64, 64, None,
                             True, True),
    "fwd-prefill-16k-bf16": ("GLAFwd", "prefill-16k", "bf16", 2, 16384, 4, 64, 64, None, True,
                             False),
    "chunk-train-2k-f16": ("GLAChunkFwd", "train-2k", "f16", 2, 2048, 4, 64, 64, None, False,
                           True),
    "fwd-varlen-ragged-f16": ("GLAFwd", "varlen-ragged", "f16", 1, None, 16, 128, 128, RAGGED,
                              True, False),
}
#: more rows of the table, run with --only
EXTRA = {
    "chunk-train-16k-f16": ("GLAChunkFwd", "train-16k", "f16", 2, 16384, 4, 64, 64, None,
                            True, True),
    "chunk-train-2k-bf16": ("GLAChunkFwd", "train-2k", "bf16", 2, 2048, 4, 64, 64, None,
                            False, True),
    "fwd-prefill-2k-bf16": ("GLAFwd", "prefill-2k", "bf16", 2, 2048, 4, 64, 64, None, False,
                            False),
    "fwd-continue-b4-bf16": ("GLAFwd", "gla-continue-b4", "bf16", 4, 257, 16, 128, 128, None,
                             True, False),
    "fwd-short-continuation-bf16": ("GLAFwd", "gla-short-continuation", "bf16", 1, 257, 16,
                                    128, 128, None, True, False),
}
SWEEP = ["segments=8", "segments=32", "segments=16,fused=false",
         "segments=16,block_k=32,fused=false"]
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def fla_table_ms(op: str, workload: str, dtype: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200.json")
    try:
        rows = json.load(open(path))["rows"]
    except (OSError, KeyError, ValueError):
        return None
    for r in rows:
        if (r["op"], r["workload"], r["dtype"]) == (op, workload, dtype):
            return (r.get("impls", {}).get("fla") or {}).get("ms")
    return None


def prepare(name: str, text: str):
    """(closure running the call, plan, reference maker) of one workload and config."""
    op, wl, dt, B, T, H, K, V, lens, init, states = {**WORKLOADS, **EXTRA}[name]
    spec, options, x, cu = make_inputs("gla", B, T, H, H, K, V, (), lens, dtype=DTYPES[dt])
    if not init:
        x["initial_state"] = None
    cu_dev = None if cu is None else cu.cuda()
    config = parse_config(text)

    def run():
        return chunk.chunk_forward(spec, x["q"], x["k"], x["v"], x["g"], None, scale=0.125,
                                   initial_state=x["initial_state"], output_final_state=True,
                                   options=options, cu_seqlens=cu_dev, cu_seqlens_cpu=cu,
                                   return_states=states, config=config)

    def reference():
        h0 = None if x["initial_state"] is None else x["initial_state"].double()
        return tref.chunked_forward(spec, *(x[n].double() for n in ("q", "k", "v", "g")),
                                    scale=0.125, initial_state=h0, cu_seqlens=cu_dev,
                                    intermediates=states)
    Tt = x["q"].shape[0] * x["q"].shape[1]
    seq = [T] * B if lens is None else lens
    plan = chunk.forward_plan(spec, options, config=config, H=H, HV=H, K=K, V=V,
                              dtype=str(DTYPES[dt]).replace("torch.", ""),
                              seq_chunks=tuple(-(-n // 64) for n in seq), Ttot=Tt,
                              has_initial_state=init, output_final_state=True,
                              return_states=states)
    return run, plan, reference, (op, wl, dt, lens, states)


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def check(run, ref, lens, states):
    """Relative errors of o, the final states and (states) every chunk's state."""
    out = run()
    torch.cuda.synchronize()
    errs = {"err_o": _rel(out[0], ref["o"] if states else ref[0]),
            "err_ht": _rel(out[1], ref["final_state"] if states else ref[1])}
    if states:
        h, fin = ref["h"], ref["final_state"]        # h [B, NC, H, K, V]; rows per sequence
        want = torch.cat([torch.cat([h[b], fin[b:b + 1]], 0) for b in range(h.shape[0])], 0)
        errs["err_h"] = _rel(out[2], want)
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--configs", nargs="*", default=["default", "segments=0"])
    ap.add_argument("--sweep-on", nargs="*", default=["chunk-train-16k-bf16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT_DIR", os.environ.get(
        "OUT", ".")), "additive_probe.json"))
    args = ap.parse_args()
    t_start = time.time()
    names = args.only or list(WORKLOADS)
    todo = [(n, c) for n in names for c in args.configs]          # the sweeps after these
    todo += [(n, c) for n in names if n in args.sweep_on for c in SWEEP]
    prepared, jobs = [], []
    for name, text in todo:
        try:
            run, plan, reference, meta = prepare(name, text)
        except Exception as e:         # a config the plan refuses: reported, not fatal
            print(json.dumps({"case": name, "config": text, "error": str(e)[:300]}), flush=True)
            continue
        with runtime.recording() as j:
            try:
                run()
            except runtime.KernelRequested:
                pass
        jobs += j
        prepared.append((name, text, run, plan, reference, meta))
    errors = runtime.precompile(jobs)
    print(f"precompiled {len(jobs)} jobs in {time.time() - t_start:.0f} s; errors: {errors}",
          flush=True)
    results, refs = [], {}
    for name, text, run, plan, reference, (op, wl, dt, lens, states) in prepared:
        if args.budget_s and time.time() - t_start > args.budget_s:
            print(f"budget: {name} {text} not run", flush=True)
            continue
        rec = {"case": name, "config": text, "plan": plan.name, "segments": plan.segments,
               "launches": {la.stage: la.kwargs for la in plan.launches},
               "reason": plan.reasons[0] if plan.reasons else "",
               "fla_table_ms": fla_table_ms(op, wl, dt)}
        try:
            if name not in refs:                # (one workload's reference at a time)
                refs = {name: reference()}
            rec.update(check(run, refs[name], lens, states))
            ms, per, nk = device_times(run, iters=args.iters)
            rec.update(ms=ms, stages_ms=per, kernels=nk)
            if rec["fla_table_ms"]:
                rec["vs_fla"] = rec["fla_table_ms"] / ms
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        print(json.dumps(rec), flush=True)
        results.append(rec)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'case':24s} {'config':24s} {'plan':18s} {'ms':>8s} {'fla':>7s} {'x':>5s} "
          f"{'err_o':>8s} {'err_h':>8s}  kernels (ms)")
    for r in results:
        per = " ".join(f"{k.replace('_kernel', '')}={v:.3f}"
                       for k, v in (r.get("stages_ms") or {}).items())
        print(f"{r['case']:24s} {r['config']:24s} {r['plan']:18s} {r.get('ms', float('nan')):8.4f} "
              f"{r.get('fla_table_ms') or float('nan'):7.4f} {r.get('vs_fla', float('nan')):5.2f} "
              f"{r.get('err_o', float('nan')):8.1e} {r.get('err_h', float('nan')):8.1e}  "
              f"{per} {r.get('error', '')[:80]}")


if __name__ == "__main__":
    main()
