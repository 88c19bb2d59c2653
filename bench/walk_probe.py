"""Probe of the delta rule's walk (chunk_walk: state, WY step and output in one kernel of
four warpgroups) on the GPU: correctness against the fp64 torch reference at full size and
device time, for several value blocks, next to the current chunked forward.

    python3 bench/walk_probe.py [--only NAME ...] [--block-v 32 64 128] [--iters 20]
        [--no-old] [--out walk_probe.json]

The walk here runs after chunk_kkt_inverse (A_b, g_cum, kn as the product path makes
them); q is l2-normalised in torch when the case asks (the probe's shortcut).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chunk_probe import device_times, make_inputs  # noqa: E402

from linattn.dsl import torch_reference as tref  # noqa: E402
from linattn.ops import chunk, runtime  # noqa: E402

ARCH = "sm90"
# name -> (op, B, T, H, HV, K, V, option names, lens or None, state_v_first)
CASES = {
    "tiny": ("gdn", 1, 200, 2, 4, 64, 64, (), None, False),
    "tiny-varlen": ("deltanet", 1, None, 2, 4, 128, 128, ("l2norm_qk",), [1, 63, 64, 130], True),
    "prefill-4k": ("gdn", 1, 4096, 16, 16, 128, 128, (), None, False),
    "deltanet-prefill-4k": ("deltanet", 1, 4096, 16, 16, 128, 128, (), None, False),
    "ragged-gva": ("gdn", 1, None, 4, 16, 128, 128, ("l2norm_qk", "beta_sigmoid", "gate_in_kernel"),
                   [1, 63, 1000, 3032], True),
    "narrow-k64": ("gdn", 1, 4096, 16, 16, 64, 64, (), None, False),
    "deltanet-16k-k64": ("deltanet", 2, 16384, 4, 4, 64, 64, (), None, False),
    "q35-2b-8x8192": ("gdn", 1, None, 16, 16, 128, 128, (), [8192] * 8, False),
    "q35-397b-tp1-65536": ("gdn", 1, 65536, 16, 64, 128, 128, (), None, False),
    "q35-2b-32x8192": ("gdn", 1, None, 16, 16, 128, 128, (), [8192] * 32, False),
}


def walk_setup(spec, options, x, cu, block_v, regs=None):
    """(jobs to compile, run()) for kkt_inverse + chunk_walk on the inputs x."""
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, dtype = q.device, runtime.dtype_name(q.dtype)
    cu_t = (tuple(int(a) for a in cu.tolist()) if cu is not None
            else tuple(range(0, (B + 1) * T, T)))
    N, Ttot = len(cu_t) - 1, B * T
    cu32, bos, lens, offsets = chunk._device_tables(cu_t, 64, dev)
    NT = bos.numel()
    f32 = dict(dtype=torch.float32, device=dev)
    gf = g.reshape(Ttot, HV).contiguous() if g is not None else None
    betaf = beta.reshape(Ttot, HV).contiguous()
    params = chunk.stage_params(spec, options, H=H, HV=HV, K=K, V=V, dtype=dtype,
                                g_dtype=runtime.dtype_name(gf.dtype) if gf is not None else "float32",
                                beta_dtype=runtime.dtype_name(betaf.dtype), N=N,
                                has_initial_state=True, output_final_state=True, n_chunks=NT)
    kkt = params["chunk_kkt_inverse"]
    walk = dict(H=H, HV=HV, K=K, V=V, dtype=dtype, state_v_first=options.state_v_first,
                has_initial_state=True, output_final_state=True, block_v=block_v,
                **({"regs": regs} if regs else {}))
    jobs = [(spec, "chunk_kkt_inverse", ARCH, kkt), (spec, "chunk_walk", ARCH, walk)]
    g_cum = torch.empty(HV, NT * 64, **f32) if spec.has_gate else torch.empty(Ttot, HV, **f32)
    gf = gf if gf is not None else g_cum
    qf = q.reshape(Ttot, H, K)
    qn = (tref.l2norm(qf.float()).to(q.dtype) if options.l2norm_qk else qf).contiguous()
    kf = k.reshape(Ttot, H, K).contiguous()
    kn = torch.empty_like(kf) if options.l2norm_qk else kf
    A = torch.empty(Ttot, HV, 64, dtype=q.dtype, device=dev)
    vf = v.reshape(Ttot, HV, V).contiguous()
    h0 = x["initial_state"].float().contiguous()
    if options.state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    ht = torch.empty_like(h0)
    o = torch.empty(Ttot, HV, V, dtype=q.dtype, device=dev)
    gw = g_cum if spec.has_gate else torch.empty(1, **f32)
    A_log = x["A_log"] if x["A_log"] is not None else torch.empty(HV, **f32)
    dt_bias = x["dt_bias"] if x["dt_bias"] is not None else torch.empty(HV, **f32)
    scale = K ** -0.5

    def run():
        runtime.compile_stage(spec, "chunk_kkt_inverse", ARCH, kkt)(
            kf, gf, betaf, A_log, dt_bias, bos, lens, g_cum, kn, A)
        runtime.compile_stage(spec, "chunk_walk", ARCH, walk)(
            qn, kn, vf, A, gw, cu32, offsets, h0, ht, o, scale)
        ht_k = ht.transpose(-1, -2) if options.state_v_first else ht
        return o.reshape(B, T, HV, V), ht_k
    return jobs, run


def old_jobs(fn):
    with runtime.recording() as jobs:
        try:
            fn()
        except runtime.KernelRequested:
            pass
    return list(jobs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--block-v", nargs="*", type=int, default=[32, 64, 128])
    ap.add_argument("--regs", nargs="*", default=[], help="extra register budgets a,b,c,d")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-old", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "walk_probe.json"))
    args = ap.parse_args()
    names = args.only or list(CASES)
    prepared, jobs = [], []
    for name in names:
        op, B, T, H, HV, K, V, opts, lens, v_first = CASES[name]
        spec, options, x, cu = make_inputs(op, B, T, H, HV, K, V, opts, lens)
        if v_first:
            options = dataclasses.replace(options, state_v_first=True)
        cu_dev = None if cu is None else cu.cuda()
        configs = [(bv, None) for bv in args.block_v if V % bv == 0]
        configs += [(max(b for b in args.block_v if V % b == 0), tuple(int(r) for r in s.split(",")))
                    for s in args.regs]
        runs = {}
        for bv, regs in configs:
            j, run = walk_setup(spec, options, x, cu, bv, regs)
            jobs += j
            runs[f"bv{bv}" + (f"-r{'-'.join(map(str, regs))}" if regs else "")] = run

        def old(spec=spec, options=options, x=x, cu=cu, cu_dev=cu_dev):
            h0 = x["initial_state"]
            if options.state_v_first:
                h0 = h0.transpose(-1, -2).contiguous()
            o, ht = chunk.chunk_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                        initial_state=h0, output_final_state=True,
                                        options=options, cu_seqlens=cu_dev, cu_seqlens_cpu=cu,
                                        A_log=x["A_log"], dt_bias=x["dt_bias"])
            return o, (ht.transpose(-1, -2) if options.state_v_first else ht)
        if not args.no_old:
            jobs += old_jobs(old)
            runs["old"] = old
        prepared.append((name, spec, options, x, cu_dev, runs))
    t0 = time.time()
    errors = runtime.precompile(jobs)
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.0f} s; errors: {errors}", flush=True)
    results = []
    for name, spec, options, x, cu_dev, runs in prepared:
        h0 = x["initial_state"]
        ref_o, ref_ht = tref.chunked_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                             options=dataclasses.replace(options, state_v_first=False),
                                             initial_state=h0, cu_seqlens=cu_dev,
                                             A_log=x["A_log"], dt_bias=x["dt_bias"])
        rel = lambda a, b: float((a.double() - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
        for label, run in runs.items():
            rec = {"case": name, "run": label}
            try:
                o, ht = run()
                torch.cuda.synchronize()
                rec.update(err_o=rel(o, ref_o), err_ht=rel(ht, ref_ht),
                           finite=bool(torch.isfinite(o).all()))
                ms, per, nk = device_times(run, iters=args.iters)
                rec.update(ms=ms, stages_ms=per, kernels=nk)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
            print(json.dumps(rec), flush=True)
            results.append(rec)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print("\ncase                  run          ms       err_o    err_ht")
    for r in results:
        print(f"{r['case']:21s} {r['run']:12s} {r.get('ms', float('nan')):8.4f} "
              f"{r.get('err_o', float('nan')):9.2e} {r.get('err_ht', float('nan')):9.2e} "
              f"{r.get('error', '')[:60]}")


if __name__ == "__main__":
    main()
