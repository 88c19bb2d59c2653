"""Probe of the DeltaNet chunk contracts on the GPU: device time of deltanet_chunk_fwd and
deltanet_chunk_bwd vs fla, on the benchmark table's nine rows of each op.

ours: contracts.deltanet_chunk_fwd(q, k, v, beta) (head-first; layout conversions inside
the call) and contracts.deltanet_chunk_bwd on its outputs.
fla:  chunk_delta_rule(q, k, v, beta, scale=1.0) on [B, T, H, D] copies made outside the
timing; its backward timed through the autograd node of one untimed forward
(grad_fn(do, None), as the seed timed it; torch.autograd.grad if that fails).
Device time as bench/probe_lib.py's device_times takes it: union of the call's kernels,
L2 flushed before each call, median over calls; each kernel's median too.

    python3 bench/chunk_bwd_probe.py [--iters 20] [--only train-4k-bf16 ...]
        [--sweep-on train-16k-f16 ...] [--budget-s 0] [--precompile]
        [--configs default] [--no-fla]
    (--sweep-on: also time our backward there at each dh-pass variant (pipeline depth x
    value block); '' for none. --precompile: compile in parallel processes first; by
    default kernels compile on first use, cheap when the GPU tests ran before with the
    same TILELANG_CACHE_DIR. One line per workload is printed as soon as it is measured.
    --configs: our backward timed at each named config, "default" (the plan's; an
    experiment adds its name to CONFIGS), each with its kernels and its largest relative
    difference from the first config's gradients; the first config's figures are the
    ours_bwd ones. Only "default" is passed to an older package (an A/B baseline tree).
    The folded forms "split" / "fused" were configs here until run s34-1 (bench/LOG.md).
    --no-fla: ours only.)
    (JSON to $OUT_DIR or $OUT /chunk_bwd_probe.json when set)
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
from probe_lib import device_times  # noqa: E402

from linattn.ops import chunk, chunk_bwd, contracts  # noqa: E402
from linattn.ops.deltanet import SPEC  # noqa: E402

# name -> (B, H, L, D, dtype): the seed table's DeltaNetChunkFwd / DeltaNetChunkBwd rows,
# the most telling first (a time limit keeps those)
WORKLOADS = {"train-16k-f16": (2, 4, 16384, 64, "f16"), "train-4k-bf16": (2, 4, 4096, 64, "bf16"),
             "deltanet-1.3b-train-bf16": (1, 16, 256, 128, "bf16")}
WORKLOADS.update({f"train-{L // 1024}k-{dt}": (2, 4, L, 64, dt)
                  for L in (2048, 4096, 8192, 16384) for dt in ("f16", "bf16")})
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def inputs(B, H, L, D, dt, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q = torch.nn.functional.normalize(rnd(B, H, L, D), dim=-1).to(dt)
    k = torch.nn.functional.normalize(rnd(B, H, L, D), dim=-1).to(dt)
    v = rnd(B, H, L, D).to(dt)
    beta = torch.sigmoid(rnd(B, H, L)).to(dt)
    do = rnd(B, H, L, D).to(dt)
    return q, k, v, beta, do


def fla_calls(q, k, v, beta, do):
    from fla.ops.delta_rule import chunk_delta_rule
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  [B, H, L, D] -> [B, L, H, D]
    qf, kf, vf, bf, dof = t(q), t(k), t(v), beta.transpose(1, 2).contiguous(), t(do)
    fwd = lambda: chunk_delta_rule(qf, kf, vf, bf, scale=1.0)  # noqa: E731
    xs = [x.detach().clone().requires_grad_(True) for x in (qf, kf, vf, bf)]
    o = chunk_delta_rule(*xs, scale=1.0)[0]
    node = o.grad_fn
    try:
        node(dof, None)
        bwd = lambda: node(dof, None)  # noqa: E731
        how = "grad_fn"
    except Exception:
        bwd = lambda: torch.autograd.grad(o, xs, dof, retain_graph=True)  # noqa: E731
        how = "autograd.grad"
    return fwd, bwd, how


#: reverse-pass variants (num_stages, block_v) timed on --sweep-on: the walk's pipeline
#: depth and value block (run s34-3 also timed dh^T in registers feeding the product:
#: slower, deleted)
SWEEP = [(3, 16), (2, 16), (4, 16), (3, 32), (4, 32)]


def _dh(ns, bv) -> dict:
    """The reverse pass's variant as chunk_bwd's explicit config."""
    return {"num_stages": ns, "block_v": bv}


def _short(per):
    """{kernel name: ms} -> 'name=0.0123 ...' with the kernel names shortened."""
    return " ".join(f"{k.replace('_kernel', '').replace('chunk_', '')[:22]}={v:.4f}"
                    for k, v in sorted(per.items(), key=lambda kv: -kv[1]))


def line(r):
    if "error" in r:
        return f"{r['workload']:26s} ERROR {r['error'][:100]}"
    g = lambda k: r.get(k, float("nan"))  # noqa: E731
    text = (f"{r['workload']:26s} fwd {g('ours_fwd_ms'):.4f} (fla {g('fla_fwd_ms'):.4f}, "
            f"x{g('ratio_fwd'):.2f}) | bwd {g('ours_bwd_ms'):.4f} (fla {g('fla_bwd_ms'):.4f}, "
            f"x{g('ratio_bwd'):.2f})\n   ours fwd: {_short(r['ours_fwd_kernels_ms'])}"
            f"\n   ours bwd: {_short(r['ours_bwd_kernels_ms'])}")
    for op in ("fwd", "bwd"):
        if f"fla_{op}_kernels_ms" in r:
            text += f"\n   fla {op}: {_short(r[f'fla_{op}_kernels_ms'])}"
    for cfg, x in r.get("configs", {}).items():
        text += (f"\n   bwd {cfg:8s} ERROR {x['error']}" if "error" in x else
                 f"\n   bwd {cfg:8s} {x['ms']:.4f} ms, {x['n_kernels']} kernels, diff "
                 f"{x['diff']:.1e}: {_short(x['kernels_ms'])}")
    for var, x in r.get("dh_sweep", {}).items():
        text += f"\n   dh {var:12s} " + (x if isinstance(x, str) else
                                          f"bwd {x['ms']:.4f} ms, dh {x['dh_ms']:.4f} ms, "
                                          f"diff {x['diff']:.1e}")
    return text


#: --configs name -> chunk_backward's keywords (an experiment's config goes here)
CONFIGS = {"default": {}}


def _config(name) -> dict:
    """chunk_backward's keywords for a --configs name."""
    if name not in CONFIGS:
        raise SystemExit(f"unknown config {name!r}: one of {sorted(CONFIGS)}")
    return CONFIGS[name]


def probe(name, iters, sweep=False, configs=("default",), fla=True):
    B, H, L, D, dtn = WORKLOADS[name]
    dt = DTYPES[dtn]
    q, k, v, beta, do = inputs(B, H, L, D, dt)
    res = {"workload": name, "B": B, "H": H, "L": L, "D": D, "dtype": dtn}
    fwd_flops, bwd_flops = 2 * B * H * L * D * D, 4 * B * H * L * D * D
    outs = contracts.deltanet_chunk_fwd(q, k, v, beta)
    ours_fwd = lambda: contracts.deltanet_chunk_fwd(q, k, v, beta)  # noqa: E731
    kw0 = _config(configs[0])
    ours_bwd = lambda dh=None, kw=kw0: chunk_bwd.chunk_backward(  # noqa: E731
        do, q, k, v, beta, *outs[1:], dh=dh, **kw)
    ref = ours_bwd()
    for op, fn, flops in (("fwd", ours_fwd, fwd_flops), ("bwd", ours_bwd, bwd_flops)):
        ms, per, n = device_times(fn, iters=iters)
        res[f"ours_{op}_ms"], res[f"ours_{op}_kernels_ms"], res[f"ours_{op}_n_kernels"] = ms, per, n
        res[f"ours_{op}_tflops"] = flops / ms * 1e-9
    res["configs"] = {}
    for cfg in configs:
        kw = _config(cfg)
        try:
            got = ours_bwd(kw=kw)
            err = max(float((a.float() - b.float()).norm() / b.float().norm())
                      for a, b in zip(got, ref))
            ms, per, n = device_times(lambda: ours_bwd(kw=kw), iters=iters)
            res["configs"][cfg] = dict(ms=ms, kernels_ms=per, n_kernels=n, diff=err)
        except Exception as e:  # one config failing: report, time the others
            res["configs"][cfg] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if sweep:
        ref = ours_bwd()
        res["dh_sweep"] = {}
        for var in SWEEP:
            name = f"stages{var[0]}-bv{var[1]}"
            try:
                got = ours_bwd(_dh(*var))
                err = max(float((a.float() - b.float()).norm() / b.float().norm())
                          for a, b in zip(got, ref))
                ms, per, _ = device_times(lambda: ours_bwd(_dh(*var)), iters=iters)
                dh_ms = sum(v for k_, v in per.items() if "chunk_bwd_dh" in k_ or "walk" in k_)
                res["dh_sweep"][name] = dict(ms=ms, dh_ms=dh_ms, diff=err)
            except Exception as e:
                res["dh_sweep"][name] = f"{type(e).__name__}: {e}"[:200]
    if not fla:
        return res
    try:
        f_fwd, f_bwd, how = fla_calls(q, k, v, beta, do)
        res["fla_bwd_via"] = how
        for op, fn in (("fwd", f_fwd), ("bwd", f_bwd)):
            ms, per, _ = device_times(fn, iters=iters)
            res[f"fla_{op}_ms"], res[f"fla_{op}_kernels_ms"] = ms, per
            res[f"ratio_{op}"] = ms / res[f"ours_{op}_ms"]     # > 1: we are faster
    except Exception as e:  # fla missing or failing: report, continue
        res["fla_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--sweep-on", nargs="*", default=["train-16k-f16"])
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new workload after this many seconds (0: no limit)")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--configs", nargs="*", default=["default"])
    ap.add_argument("--no-fla", action="store_true")
    args = ap.parse_args()
    names = args.only or list(WORKLOADS)
    t0 = time.time()
    if args.precompile:
        fwd, bwd = [], []
        for n in names:
            B, H, L, D, dtn = WORKLOADS[n]
            dims = dict(H=H, K=D, V=D, dtype={"f16": "float16", "bf16": "bfloat16"}[dtn], B=B)
            fwd += [(SPEC, s, p) for s, p in chunk_bwd.forward_params(**dims, L=L).items()]
            bwd += [chunk_bwd.backward_params(**dims, **_config(c)) for c in args.configs]
            if n in args.sweep_on:
                bwd += [chunk_bwd.backward_params(**dims, dh=_dh(*var)) for var in SWEEP]
        errors = chunk.precompile(fwd) + chunk_bwd.precompile(bwd)
        print(f"precompiled in {time.time() - t0:.1f} s; errors: {errors or 'none'}", flush=True)
    out = os.environ.get("OUT_DIR") or os.environ.get("OUT")
    results = []
    for name in names:
        if args.budget_s and time.time() - t0 > args.budget_s:
            print(f"{name}: skipped (--budget-s)", flush=True)
            continue
        try:
            r = probe(name, args.iters, name in args.sweep_on, tuple(args.configs),
                      not args.no_fla)
        except Exception as e:
            traceback.print_exc()
            r = {"workload": name, "error": f"{type(e).__name__}: {e}"[:500]}
        r["t_s"] = round(time.time() - t0, 1)
        print(line(r), flush=True)
        results.append(r)
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "chunk_bwd_probe.json"), "w") as f:
                json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()
