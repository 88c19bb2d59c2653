"""Probe of the additive rule's backward on the GPU: GLAChunkBwd device time, ours vs fla,
with the per-kernel split, a few plan variants of the state-gradient scan, and one GLA
training step (forward + backward through autograd).

ours: linattn.ops.contracts.gla_chunk_bwd on the benchmark row's inputs (cli/bench:
      inputs.build_inputs, the same call linattn-bench makes); variants through
      ops.additive_bwd.gla_chunk_bwd(config=...) (codegen/arch/sm90/backward.py keys)
fla:  the benchmark's fla call of the row (fp32 upcasts, autograd of chunk_gla, forward
      untimed)
train: linattn-bench's training step (cli/bench/train.py: forward, then autograd.grad of
      q, k, v, g, h0 under fixed do, dht) of chunk_gla, ours (forward, recompute of the
      states, the three stages) and fla's, [2, T, 4, K] bf16 (K = V = 64, or --train-kv:
      e.g. 256 512, GLA-1.3B's heads, the backward in key blocks), each timed as forward +
      backward per call, with its peak memory
Device time as bench/probe_lib.py's device_times: union of the call's kernels, L2 flushed
before each call, median over calls.

    python3 bench/gla_bwd_probe.py [--rows train-16k train-2k] [--dtypes bf16 f16]
        [--iters 20] [--no-sweep] [--no-train] [--train-kv K V] [--train-t T] [--budget-s 50]
        [--shape B T H K V ...] [--shape16 B T H K V ...]
    (order: every row ours vs fla, then the variants on the first row, then the training
    step, then each --shape's variants (SHAPE_SWEEP); JSON to $OUT_DIR or $OUT /gla_bwd_probe.json; one line per measurement)
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

from linattn.cli.bench import impls, inputs, run, train, workloads  # noqa: E402
from linattn.ops import additive_bwd, runtime  # noqa: E402

#: scan variants timed on the first row (the default plan's choice is the baseline)
SWEEP = [{"scan_stages": 2}, {"scan_stages": 8}, {"scan_block_k": 16, "scan_block_v": 32},
         {"scan_block_k": 16, "scan_block_v": 16}, {"dqkvg_min_blocks": 1}]
#: variants timed on --shape (a GLAChunkBwd call of any head dims): the reverse pass
#: forced to the walk, dqkvg's key block at 128 and at 64
SHAPE_SWEEP = [{"dstate_pass": "walk"}, {"dqkvg_block_k": 128}, {"dqkvg_block_k": 64},
               {"dqkvg_state_stages": 2}]
#: variants timed on --shape16 (the backward's three stages as a training step runs them:
#: the states in the input dtype): dqkvg's copies straight into its GEMM tiles
SHAPE16_SWEEP = [{"dqkvg_direct_states": True}]


def _short(per):
    return " ".join(f"{k.replace('_kernel', '').replace('chunk_', '')[:24]}={v:.4f}"
                    for k, v in sorted(per.items(), key=lambda kv: -kv[1]))


def _row(workload, dtype):
    rows = workloads.select(workloads.load_rows(), ops=["GLAChunkBwd"], workload=workload,
                            dtypes=[dtype])
    if not rows:
        raise SystemExit(f"no GLAChunkBwd row {workload} {dtype}")
    return rows[0]


def _ours(x, s, config=None):
    args = [x[n] for n in ("q", "k", "v", "g", "h", "do", "dht")]
    return lambda: additive_bwd.gla_chunk_bwd(*args, scale=s, config=config)


def _precompile(calls):
    """Compile what the calls would (recorded, one round) in parallel processes."""
    with runtime.recording() as jobs:
        for fn in calls:
            try:
                fn()
            except Exception:       # KernelRequested (noted), or reported when timed
                pass
    return runtime.precompile(jobs) if jobs else []


def probe_row(workload, dtype, iters, sweep):
    """ours and fla on the row; sweep: the plan variants (SWEEP) instead of fla."""
    row = _row(workload, dtype)
    x = inputs.build_inputs(row, "cuda", 0)
    s = row.options.get("scale")
    res = {"workload": workload + ("-sweep" if sweep else ""), "dtype": dtype,
           "fla_seed_ms": row.seed.get("alternatives", {}).get("fla")}
    ours = _ours(x, s)
    configs = SWEEP if sweep else []
    errs = _precompile([ours] + [_ours(x, s, c) for c in configs])
    if errs:
        res["compile_errors"] = errs[:3]
    ref = ours()
    ms, per, n = device_times(ours, iters=iters)
    res.update(ours_ms=ms, ours_kernels_ms=per, ours_n_kernels=n)
    for c in configs:
        key = ",".join(f"{k}={v}" for k, v in c.items())
        try:
            got = _ours(x, s, c)()
            diff = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))
            vms, vper, _ = device_times(_ours(x, s, c), iters=iters)
            res.setdefault("sweep", {})[key] = dict(ms=vms, kernels_ms=vper, diff=diff)
        except Exception as e:
            res.setdefault("sweep", {})[key] = f"{type(e).__name__}: {e}"[:200]
    if sweep:
        return res
    try:
        fla_fn, _ = impls.make("fla", row, x)
        fms, fper, _ = device_times(fla_fn, iters=iters)
        res.update(fla_ms=fms, fla_kernels_ms=fper, ratio=fms / ms)
    except Exception as e:
        res["fla_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def shape_inputs(B, T, H, K, V):
    """GLAChunkBwd arguments [B, T, H, K / V] bf16 of the benchmark's distributions (q, k,
    v, do N(0, 1), g = logsigmoid(N(2, 1)), h and dht 0.1 N(0, 1): timing only)."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    bf = torch.bfloat16
    NT = -(-T // 64)
    return dict(q=r(B, T, H, K).to(bf), k=r(B, T, H, K).to(bf), v=r(B, T, H, V).to(bf),
                g=torch.nn.functional.logsigmoid(r(B, T, H, K) + 2).to(bf),
                h=0.1 * r(B, NT + 1, H, K, V), do=r(B, T, H, V).to(bf), dht=0.1 * r(B, H, K, V))


def _ours16(x, s, config=None):
    """The backward's three stages (additive_bwd.run_backward) as a GLA training step runs
    them: x's states rounded to the input dtype, bf16 gradients."""
    from linattn.ops.registry import get_spec
    B, T, H, K = x["q"].shape
    flat = lambda t: t.reshape(B * T, *t.shape[2:]).contiguous()  # noqa: E731
    q, k, v, g, do = (flat(x[n]) for n in ("q", "k", "v", "g", "do"))
    h = x["h"].to(q.dtype).reshape(-1, *x["h"].shape[2:]).contiguous()
    cu = tuple(range(0, (B + 1) * T, T))
    spec = get_spec("gla")
    return lambda: additive_bwd.run_backward(spec, q, k, v, g, h, do, x["dht"], scale=s,
                                             cu=cu, want_dh0=False, grad_dtype=q.dtype,
                                             config=config)[:4]


def probe_shape(shape, iters, states16=False):
    """The default plan and SHAPE_SWEEP's variants on one call of shape (B, T, H, K, V);
    states16: the training step's form (_ours16) and SHAPE16_SWEEP."""
    x, s = shape_inputs(*shape), shape[3] ** -0.5
    res = {"workload": ("shape16-" if states16 else "shape-") + "x".join(map(str, shape)),
           "dtype": "bf16"}
    make, sweep = (_ours16, SHAPE16_SWEEP) if states16 else (_ours, SHAPE_SWEEP)
    calls = [make(x, s)] + [make(x, s, c) for c in sweep]
    errs = _precompile(calls)
    if errs:
        res["compile_errors"] = errs[:3]
    ref = calls[0]()
    res["ours_ms"], res["ours_kernels_ms"], _ = device_times(calls[0], iters=iters)
    for c, fn in zip(sweep, calls[1:]):
        key = ",".join(f"{k}={v}" for k, v in c.items())
        try:
            diff = max(float((a - b).norm() / b.norm()) for a, b in zip(fn(), ref))
            vms, vper, _ = device_times(fn, iters=iters)
            res.setdefault("sweep", {})[key] = dict(ms=vms, kernels_ms=vper, diff=diff)
        except Exception as e:
            res.setdefault("sweep", {})[key] = f"{type(e).__name__}: {e}"[:200]
    return res


def train_step(T, iters, K=64, V=64):
    """One chunk_gla training step, ours and fla's: linattn-bench's step (cli/bench/train.py)
    on a GLATrain row [2, T, 4, K] bf16 with h0 and dht, and each one's peak memory."""
    name = f"train-step-{T // 1024}k" + (f"-K{K}-V{V}" if (K, V) != (64, 64) else "")
    row = workloads.train_row("GLATrain", name, 2, T, 4, 4, K, V, h0=True)
    x = inputs.build_inputs(row, "cuda", 1)
    res = {"workload": f"{row.workload}-bf16"}
    run.precompile_rows([row])   # rounds: the forward, the backward's recompute and stages
    ours, _ = train.make("linattn", row, x)
    res["ours_ms"], res["ours_kernels_ms"], _ = device_times(ours, iters=iters)
    res["ours_peak_mib"] = train.peak_memory(ours)["peak_mib"]
    try:
        fla, _ = train.make("fla", row, x)
        res["fla_ms"], res["fla_kernels_ms"], _ = device_times(fla, iters=iters)
        res["fla_peak_mib"] = train.peak_memory(fla)["peak_mib"]
        res["ratio"] = res["fla_ms"] / res["ours_ms"]
    except Exception as e:
        res["fla_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def line(r):
    if "error" in r:
        return f"{r['workload']:22s} ERROR {r['error'][:160]}"
    g = lambda k: r.get(k, float("nan"))  # noqa: E731
    text = (f"{r['workload']:22s} {r.get('dtype', ''):5s} ours {g('ours_ms'):.4f} ms  fla "
            f"{g('fla_ms'):.4f} ms  x{g('ratio'):.2f}\n   ours: {_short(r['ours_kernels_ms'])}")
    if "fla_kernels_ms" in r:
        text += f"\n   fla:  {_short(r['fla_kernels_ms'])}"
    for key, x in r.get("sweep", {}).items():
        text += f"\n   {key:36s} " + (x if isinstance(x, str) else
                                       f"{x['ms']:.4f} ms (diff {x['diff']:.1e}) "
                                       f"{_short(x['kernels_ms'])}")
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=["train-16k", "train-2k"])
    ap.add_argument("--dtypes", nargs="*", default=["bf16", "f16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--train-kv", nargs=2, type=int, default=[64, 64], metavar=("K", "V"))
    ap.add_argument("--train-t", type=int, default=16384)
    ap.add_argument("--shape", nargs=5, type=int, action="append", default=[],
                    metavar=("B", "T", "H", "K", "V"),
                    help="also time SHAPE_SWEEP on a GLAChunkBwd call of this shape (repeatable)")
    ap.add_argument("--shape16", nargs=5, type=int, action="append", default=[],
                    metavar=("B", "T", "H", "K", "V"),
                    help="also time SHAPE16_SWEEP on the training form at this shape")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new measurement after this many seconds (0: no limit)")
    args = ap.parse_args()
    t0, results = time.time(), []
    out = os.environ.get("OUT_DIR") or os.environ.get("OUT")
    # the rows first (ours vs fla), then the plan variants on the first row, then training
    todo = [("row", w, d, False) for w in args.rows for d in args.dtypes]
    todo += [] if args.no_sweep else [("row", args.rows[0], args.dtypes[0], True)]
    todo += [] if args.no_train else [("train", args.train_t, None, False)]
    todo += [("shape", tuple(sh), None, False) for sh in args.shape]
    todo += [("shape16", tuple(sh), None, False) for sh in args.shape16]
    for kind, a, b, sweep in todo:
        if args.budget_s and time.time() - t0 > args.budget_s:
            print(f"{kind} {a} {b or ''}: skipped (--budget-s)", flush=True)
            continue
        try:
            r = (probe_row(a, b, args.iters, sweep) if kind == "row"
                 else probe_shape(a, args.iters, kind == "shape16") if kind.startswith("shape")
                 else train_step(a, args.iters, *args.train_kv))
        except Exception as e:
            traceback.print_exc()
            r = {"workload": f"{a}", "dtype": b, "error": f"{type(e).__name__}: {e}"[:500]}
        r["t_s"] = round(time.time() - t0, 1)
        print(line(r), flush=True)
        results.append(r)
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "gla_bwd_probe.json"), "w") as f:
                json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()
