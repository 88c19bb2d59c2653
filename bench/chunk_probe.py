"""Probe of the chunked forward on the GPU: correctness at full size, per-stage device time.

For each workload: compile (timed), check o / final state against the fp64 torch
reference (dsl.torch_reference.chunked_forward, on the GPU), then time device work per
call (torch.profiler CUDA activity, L2 flushed before every call, median over calls):
the union of all kernels of one call, and each stage kernel's median time. fla's
chunk_gated_delta_rule / chunk_delta_rule run side by side when fla is importable.

    python3 bench/chunk_probe.py [--iters 30] [--only prefill-4k] [--sweep] [--budget-s 80]
        [--prepare split split-warp split-wuloop split-warp-wuloop ...]
        [--no-alt]
        [--path model model-fused L4 3stage fused-qraw fused-qgated ...]
    (JSON to $OUT_DIR, else $OUT, as chunk_probe.json, rewritten after every workload)

One workload failing does not stop the others; a compact summary prints at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

from linattn.cli.bench.timer import flush_l2, union_length
from linattn.dsl import Options
from linattn.dsl import torch_reference as tref
from linattn.ops import chunk
from linattn.ops.chunk import PREPARE_VARIANTS
from linattn.ops.registry import get_spec


# name -> (op, B, T, H, HV, K, V, option names, lens for varlen or None)
WORKLOADS = {   # in priority order (a --budget-s cut keeps the first ones)
    "prefill-4k": ("gdn", 1, 4096, 16, 16, 128, 128, (), None),
    "q35-397b-tp8-8192": ("gdn", 1, 8192, 2, 8, 128, 128, (), None),
    "prefill-4k-deltanet": ("deltanet", 1, 4096, 16, 16, 128, 128, (), None),
    "kda-tp2-4096": ("kda", 1, 4096, 16, 16, 128, 128, ("l2norm_qk",), None),
    "gla-prefill-4k": ("gla", 2, 4096, 4, 4, 64, 64, (), None),
    "varlen-8x1k": ("gdn", 1, None, 16, 16, 128, 128, (), [1024] * 8),
    "prefill-4k-k64": ("gdn", 1, 4096, 16, 16, 64, 64, (), None),
    "q35-397b-tp8-8192-inkernel": ("gdn", 1, 8192, 2, 8, 128, 128,
                                   ("l2norm_qk", "beta_sigmoid", "gate_in_kernel"), None),
    "kda-tp8-16384": ("kda", 1, 16384, 4, 4, 128, 128, ("l2norm_qk",), None),
    "q35-397b-tp1-65536": ("gdn", 1, 65536, 16, 64, 128, 128, (), None),
    "q35-2b-16384": ("gdn", 1, 16384, 16, 16, 128, 128, (), None),
    "q35-397b-tp4-8x1024": ("gdn", 1, None, 4, 16, 128, 128, (), [1024] * 8),
    "q35-27b-16384": ("gdn", 1, 16384, 16, 48, 128, 128, (), None),
    "q35-symmetric-1024-7168": ("gdn", 1, None, 32, 32, 128, 128, (), [1024, 7168]),
    # GLAFwd's K = 128 rows (0.40-0.53x fla in run s4-4): varlen-ragged f16's shape, bf16
    "gla-k128-ragged": ("gla", 1, None, 16, 16, 128, 128, (), [1, 63, 1000, 3032]),
    # GLAFwd varlen-4x1k's shape (K = 64, 16 chains: the 3-stage path since b2aac9a)
    "gla-varlen-4x1k": ("gla", 1, None, 4, 4, 64, 64, (), [1024] * 4),
}


#: --sweep: the state pass's (pipeline depth, value block) pairs timed
SWEEP_STATE = [(st, bv) for st in (0, 2, 3) for bv in (16, 32, 64)]   # 4 stages: > 227 KB fused

#: kernels that make up the prepare step (the split path has two)
PREPARE_KERNELS = ("chunk_prepare_kernel", "chunk_kkt_inverse_kernel", "chunk_wu_kernel")

#: --path: other forward paths under these knobs: the split state pass
#: (ops/chunk_split.py) and the fused path's q operand modes
DTYPES = {"bf16": "bfloat16", "f16": "float16"}
PATH_VARIANTS = {
    "model": dict(SPLIT=True),                     # the cost model's segment length
    "model-fused": dict(SPLIT=True, FUSE_OUTPUT=True),
    "L4": dict(SPLIT=True, SPLIT_SEGMENT_CHUNKS=4),
    "L8": dict(SPLIT=True, SPLIT_SEGMENT_CHUNKS=8),
    "L16": dict(SPLIT=True, SPLIT_SEGMENT_CHUNKS=16),
    "L32": dict(SPLIT=True, SPLIT_SEGMENT_CHUNKS=32),
    "3stage": dict(FUSE_OUTPUT=False),
    "fused-qraw": dict(FUSE_OUTPUT=True, FUSED_Q="raw"),
    "fused-qgated": dict(FUSE_OUTPUT=True, FUSED_Q="gated"),
    "out-tiles": dict(FUSE_OUTPUT=False, OUTPUT_TILE_LOADS=True),
    # per-(chunk, head) grids with the value head fastest (q / k shared through L2)
    "3stage-heads": dict(FUSE_OUTPUT=False, HEADS_FASTEST=True),
    "fused-heads": dict(FUSE_OUTPUT=True, HEADS_FASTEST=True),
    # chunk_qk once per (chunk, key head), looping over the group's value heads (GVA)
    "fused-qk-group": dict(FUSE_OUTPUT=True, QK_GROUP_LOOP=True),
    # chunk_output's o through shared memory (whole-row stores)
    "3stage-stageo": dict(FUSE_OUTPUT=False, OUTPUT_STAGE_O=True),
    "3stage-heads-stageo": dict(FUSE_OUTPUT=False, HEADS_FASTEST=True, OUTPUT_STAGE_O=True),
    # the state pass's value block forced (the arch table's makespan rule picks it)
    "bv16": dict(STATE_BLOCK_V_OVERRIDE=16),
    "bv32": dict(STATE_BLOCK_V_OVERRIDE=32),
    "bv64": dict(STATE_BLOCK_V_OVERRIDE=64),
    # two consumer warpgroups in the state pass (each half of the state), either path
    # (only where the block is >= 32; "-bv32" forces the block)
    "state-t256": dict(STATE_THREADS=256),
    "state-t256-bv32": dict(STATE_THREADS=256, STATE_BLOCK_V_OVERRIDE=32),
    "state-t256-3stage": dict(STATE_THREADS=256, FUSE_OUTPUT=False),
    "state-t256-fused": dict(STATE_THREADS=256, FUSE_OUTPUT=True),
    # the per-key gate's one-kernel chunk_prepare (KDA, GLA): 128 threads (the default
    # before run s5-3: 256), the blocked inverse
    "key-t128": dict(PREPARE_KEY_THREADS=128),
    "key-blocked": dict(PREPARE_KEY_INVERSE="blocked"),
    "key-t128-blocked": dict(PREPARE_KEY_THREADS=128, PREPARE_KEY_INVERSE="blocked"),
    # ... its diagonal blocks' channel loop skewed per lane (no bank conflicts)
    "key-skew": dict(PREPARE_KEY_SKEW=True),
    "key-skew-t128": dict(PREPARE_KEY_SKEW=True, PREPARE_KEY_THREADS=128),
    # two state-pass CTAs per SM (registers capped, one pipeline stage for the shared
    # memory), alone and with the sequence split into segments of 8 / 16 / 32 chunks
    "occ2": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1),
    "occ2-3stage": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1, FUSE_OUTPUT=False),
    "occ2-L8": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1, SPLIT=True, SPLIT_SEGMENT_CHUNKS=8),
    "occ2-L16": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1, SPLIT=True, SPLIT_SEGMENT_CHUNKS=16),
    "occ2-L32": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1, SPLIT=True, SPLIT_SEGMENT_CHUNKS=32),
    "s1": dict(STATE_NUM_STAGES=1),
}



def device_times(fn, iters=30, warmup=5):
    """Median device ms per call (union of kernels) and per kernel name."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    evs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    calls, cur = [], None
    for s, e, name in evs:
        if "bitwise_not" in name.lower():
            if cur is not None:
                calls.append(cur)
            cur = []
        elif cur is not None and not name.lower().startswith(("memcpy", "memset")):
            cur.append((s, e, name))
    if cur is not None:
        calls.append(cur)
    calls = [c for c in calls if c]
    if not calls:
        raise RuntimeError("profiler recorded no kernels")
    total = statistics.median(union_length([(s, e) for s, e, _ in c]) for c in calls) / 1e3
    per = {}
    for c in calls:
        seen = {}
        for s, e, name in c:
            short = name.split("(")[0][:60]
            seen[short] = seen.get(short, 0.0) + (e - s)
        for k, v in seen.items():
            per.setdefault(k, []).append(v)
    return total, {k: statistics.median(v) / 1e3 for k, v in per.items()}, max(map(len, calls))


def make_inputs(op, B, T, H, HV, K, V, opts, lens, dtype=torch.bfloat16, seed=0):
    spec = get_spec(op)
    options = Options(**{n: True for n in opts})
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64)
        T = int(cu[-1])
    N = B if cu is None else len(lens)
    rn = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    q, k = rn(B, T, H, K), rn(B, T, H, K)
    if not options.l2norm_qk:
        q, k = tref.l2norm(q), tref.l2norm(k)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=rn(B, T, HV, V).to(dtype), g=None, beta=None,
             A_log=None, dt_bias=None, initial_state=0.1 * rn(N, HV, K, V))
    if spec.has_beta:
        b = rn(B, T, HV)
        x["beta"] = (b if options.beta_sigmoid else torch.sigmoid(b)).to(dtype)
    if spec.has_gate:
        gshape = spec.gate_shape(B, T, HV, K)
        if options.gate_in_kernel:
            x["g"] = rn(*gshape)
            x["A_log"] = torch.log(torch.rand(HV, device=dev, generator=g) * 15 + 1)
            n_dt = HV * K if len(gshape) == 4 else HV
            dt = torch.exp(torch.rand(n_dt, device=dev, generator=g) * 4.6 - 6.9)
            x["dt_bias"] = dt + torch.log(-torch.expm1(-dt))
        else:
            x["g"] = torch.nn.functional.logsigmoid(rn(*gshape) + 2.0)
    return spec, options, x, cu


def probe(name, args):
    op, B, T, H, HV, K, V, opts, lens = WORKLOADS[name]
    spec, options, x, cu = make_inputs(op, B, T, H, HV, K, V, opts, lens,
                                       dtype=getattr(torch, DTYPES[args.dtype]))
    cu_dev = None if cu is None else cu.cuda()
    res = {"workload": name, "op": op, "dtype": args.dtype,
           "shape": dict(B=B, T=T, H=H, HV=HV, K=K, V=V),
           "options": list(opts)}

    def ours():
        return chunk.chunk_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   initial_state=x["initial_state"], output_final_state=True,
                                   options=options, cu_seqlens=cu_dev, cu_seqlens_cpu=cu,
                                   A_log=x["A_log"], dt_bias=x["dt_bias"])

    t0 = time.time()
    o, ht = ours()
    torch.cuda.synchronize()
    res["first_call_s"] = round(time.time() - t0, 2)
    ref_o, ref_ht = tref.chunked_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                         options=options, initial_state=x["initial_state"],
                                         cu_seqlens=cu_dev, A_log=x["A_log"],
                                         dt_bias=x["dt_bias"])
    rel = lambda a, b: float((a.double() - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    res["rel_err_o"] = rel(o, ref_o)
    res["rel_err_final"] = rel(ht, ref_ht)
    total, per, nk = device_times(ours, iters=args.iters)
    res.update(ms=total, kernels_per_call=nk, stages_ms=per)
    T_eff = x["q"].shape[1]
    flops = (B * T_eff * HV * (6 * K * V + 2 * K) if spec.name == "deltanet"
             else 7 * B * T_eff * HV * K * V)          # the seed's GDN / DeltaNetFwd counts
    res["tflops"] = flops / (total * 1e-3) / 1e12

    def measure(iters=args.iters, **knobs):
        """ours() under the knobs: device ms, per-kernel ms, errors (or the error)."""
        try:
            with chunk.using(**knobs):
                o2, ht2 = ours()
                t, per, _ = device_times(ours, iters=iters)
            return {"ms": t, "stages_ms": per, "err_o": rel(o2, ref_o),
                    "err_ht": rel(ht2, ref_ht)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:200]}

    def stage_ms(r, *kernels):      # the first of these kernels that ran, in ms
        return next((r["stages_ms"][k] for k in kernels if k in r.get("stages_ms", {})), None)

    res["prepare_variants"] = {}
    for pv in (args.prepare or []) if spec.has_beta and spec.gate.value != "key" else []:
        r = measure(**PREPARE_VARIANTS[pv])
        if "ms" in r:
            r["prepare_ms"] = sum(r["stages_ms"].get(kn, 0.0) for kn in PREPARE_KERNELS)
            r["prepare_split_ms"] = {kn: r["stages_ms"][kn] for kn in PREPARE_KERNELS[1:]
                                     if kn in r["stages_ms"]}
        res["prepare_variants"][pv] = r
        print(name, "prepare", pv, r, flush=True)
    # the other path, side by side
    fused = chunk.fuse_output((B if lens is None else len(lens)) * HV, DTYPES[args.dtype], K)
    res["default_path"] = "fused" if fused else "three_stage"
    key_f = "three_stage" if fused else "fused"
    res[key_f] = ({"error": "skipped (--no-alt)"} if args.no_alt
                  else measure(FUSE_OUTPUT=not fused))
    res["paths"] = {}
    for sv in args.path or []:
        res["paths"][sv] = measure(**PATH_VARIANTS[sv])
        print(name, "path", sv, res["paths"][sv], flush=True)
    if args.sweep:
        few = max(5, args.iters // 3)
        sweep = {}
        for stages, bv in SWEEP_STATE:
            r = sweep[f"bv{bv}-st{stages}"] = measure(few, STATE_BLOCK_V_OVERRIDE=bv,
                                                      STATE_NUM_STAGES=stages)
            r["state_ms"] = stage_ms(r, "chunk_state_kernel", "chunk_state_output_kernel")
            print(name, f"bv{bv}-st{stages}", r, flush=True)
        res["state_sweep"] = sweep
        if spec.has_beta:
            inv = {}
            for how in ("column", "blocked", "tc"):
                r = inv[how] = measure(few, PREPARE_INVERSE=how)
                r["prepare_ms"] = stage_ms(r, "chunk_prepare_kernel")
                print(name, how, r, flush=True)
            res["inverse_sweep"] = inv
        flips = [("STATE_H_FROM_FRAGMENT", "h_from_fragment", "state"),
                 ("OUTPUT_BLOCK_V_OVERRIDE", "output_block_v", "output")]
        if spec.gate.value == "scalar" and spec.has_beta:
            flips.append(("STATE_V_NEW_FROM_FRAGMENT", "v_new_from_fragment", "state"))
        for knob, label, stage in flips:
            value = 64 if knob == "OUTPUT_BLOCK_V_OVERRIDE" else not getattr(chunk, knob)
            key = f"{label}_{value}"
            r = res[key] = measure(few, **{knob: value})
            r[f"{stage}_ms"] = stage_ms(r, f"chunk_{stage}_kernel")
            print(name, key, r, flush=True)
    try:
        res["fla_ms"], res["fla_kernels_ms"] = fla_time(spec, options, x, cu_dev, args)
    except Exception as e:  # fla missing or failing: report, continue
        res["fla_error"] = f"{type(e).__name__}: {e}"[:200]
    return res


def fla_time(spec, options, x, cu, args):
    call = fla_call(spec, options, x, cu)
    call()
    total, per, _ = device_times(call, iters=args.iters)
    return total, per


def fla_call(spec, options, x, cu):
    """fla's chunked forward of the same call (a closure)."""
    if spec.name == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        kw = dict(g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=options.l2norm_qk)
        if options.beta_sigmoid:
            kw["use_beta_sigmoid_in_kernel"] = True
        if options.gate_in_kernel:
            kw.update(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    elif spec.name == "kda":
        from fla.ops.kda import chunk_kda as fn
        kw = dict(g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=options.l2norm_qk)
    elif spec.name == "gla":
        from fla.ops.gla import chunk_gla as fn
        kw = dict(g=x["g"])
    else:
        from fla.ops.delta_rule import chunk_delta_rule as fn
        kw = dict(beta=x["beta"], use_qk_l2norm_in_kernel=options.l2norm_qk)
    return lambda: fn(x["q"], x["k"], x["v"], initial_state=x["initial_state"],
                      output_final_state=True, cu_seqlens=cu, **kw)


def workload_jobs(name, sweep=False, prepare=(), alt=True, paths=(), dtype="bfloat16"):
    """(spec, stage, params) compile jobs of a workload (and of the sweep's variants, the
    chunk_prepare variants named in ``prepare``, the other fused / 3-stage path if alt, the
    PATH_VARIANTS named in ``paths``)."""
    op, B, T, H, HV, K, V, opts, lens = WORKLOADS[name]
    spec, options = get_spec(op), Options(**{n: True for n in opts})
    N = B if lens is None else len(lens)
    variants = [{}] + ([dict(FUSE_OUTPUT=not chunk.fuse_output(N * HV, dtype, K))] if alt else [])
    variants += [PREPARE_VARIANTS[pv] for pv in prepare or ()]
    variants += [PATH_VARIANTS[pv] for pv in paths or ()]
    if sweep:
        variants += [dict(STATE_BLOCK_V_OVERRIDE=bv, STATE_NUM_STAGES=st)
                     for st, bv in SWEEP_STATE]
        variants += [dict(PREPARE_INVERSE=how) for how in ("column", "blocked", "tc")]
        variants += [dict(STATE_V_NEW_FROM_FRAGMENT=not chunk.STATE_V_NEW_FROM_FRAGMENT),
                     dict(OUTPUT_BLOCK_V_OVERRIDE=64),
                     dict(STATE_H_FROM_FRAGMENT=not chunk.STATE_H_FROM_FRAGMENT)]
    jobs = []
    for knobs in variants:
        with chunk.using(**knobs):
            params = chunk.stage_params(spec, options, H=H, HV=HV, K=K, V=V, dtype=dtype,
                                        g_dtype="float32", beta_dtype=dtype, N=N,
                                        has_initial_state=True, output_final_state=True,
                                        fused=chunk.fuse_output(N * HV, dtype, K))
        jobs += [(spec, stage, pr) for stage, pr in params.items()]
    return jobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--only", nargs="*", default=None, choices=list(WORKLOADS))
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new workload after this many seconds (0: no limit)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the state pass at value blocks 16/32/64 x pipeline "
                         "depths 0 and 2, the three inverses of chunk_prepare (with errors)")
    ap.add_argument("--prepare", nargs="*", default=[], choices=sorted(PREPARE_VARIANTS),
                    help="also time these chunk_prepare variants (knobs) next to the default")
    ap.add_argument("--path", "--state-split", dest="path", nargs="*", default=[],
                    choices=sorted(PATH_VARIANTS),
                    help="also time these forward paths (knobs): the split state pass "
                         "(LINATTN_CHUNK_SPLIT), the 3-stage / fused paths, the fused "
                         "path's q operand modes (precompiled except the split stages)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                    help="q / k / v / beta dtype of every workload")
    ap.add_argument("--no-alt", action="store_true",
                    help="do not time (or compile) the other fused / 3-stage path")
    args = ap.parse_args()
    names = args.only or list(WORKLOADS)
    t0 = time.time()
    errors = chunk.precompile([j for n in names
                               for j in workload_jobs(n, args.sweep, args.prepare,
                                                      alt=not args.no_alt, paths=args.path,
                                                      dtype=DTYPES[args.dtype])])
    print(f"precompiled in {time.time() - t0:.1f} s; errors: {errors or 'none'}", flush=True)
    results = []
    out = os.environ.get("OUT_DIR") or os.environ.get("OUT")
    fname = (f"chunk_probe_sweep_{args.dtype}.json" if args.sweep
             else f"chunk_probe_{args.dtype}.json")
    for name in names:
        if args.budget_s and time.time() - t0 > args.budget_s:
            results.append({"workload": name, "error": "skipped: --budget-s reached"})
            continue
        try:
            r = probe(name, args)
        except Exception as e:
            traceback.print_exc()
            r = {"workload": name, "error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(r, default=float), flush=True)
        results.append(r)
        if out:        # written after every workload: a time-out keeps what was measured
            with open(os.path.join(out, fname), "w") as f:
                json.dump(results, f, indent=1, default=float)
    print("\n%-28s %9s %9s %7s %9s %9s  %s" % ("workload", "ours ms", "fla ms", "TFLOPs",
                                               "err o", "err ht", "stages (ms)"))
    for r in results:
        if "error" in r:
            print("%-28s ERROR %s" % (r["workload"], r["error"][:100]))
            continue
        st = " ".join(f"{k.replace('_kernel', '')}={v:.3f}" for k, v in r["stages_ms"].items())
        alt = r.get("fused") or r.get("three_stage") or {}
        alt_s = (f" | {'fused' if 'fused' in r else '3-stage'} {alt['ms']:.3f} ms "
                 f"err {alt['err_o']:.1e}" if "ms" in alt else "")
        print("%-28s %9.3f %9s %7.1f %9.2e %9.2e  %s%s" % (
            r["workload"], r["ms"], f"{r['fla_ms']:.3f}" if "fla_ms" in r else "-",
            r["tflops"], r["rel_err_o"], r["rel_err_final"], st, alt_s))
        for pv, pr in r.get("prepare_variants", {}).items():
            print("    prepare %-14s %s" % (pv, f"{pr['ms']:.3f} ms, prepare "
                  f"{pr['prepare_ms']:.4f} ms, err o {pr['err_o']:.1e} ht {pr['err_ht']:.1e}"
                  if "ms" in pr else pr.get("error")))
        for pv, pr in r.get("paths", {}).items():
            st = " ".join(f"{k.replace('_kernel', '').replace('chunk_', '')}={v:.3f}"
                          for k, v in pr.get("stages_ms", {}).items())
            print("    path %-20s %s" % (pv, f"{pr['ms']:.3f} ms, err o {pr['err_o']:.1e}  {st}"
                  if "ms" in pr else pr.get("error")))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
