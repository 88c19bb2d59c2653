"""Nsight Compute view of the chunked forward: one call of ours and one of fla per
workload inside a profiler range, everything else (compiles, fla's autotuning, warm-up)
outside it, so `ncu --profile-from-start off` sees exactly those kernels.

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --csv --page details \\
        python3 bench/ncu_probe.py --only prefill-4k q35-397b-tp1-65536 > ncu.csv

Workloads and inputs are chunk_probe's (bench/chunk_probe.py)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chunk_probe import DTYPES, WORKLOADS, chunk, fla_call, get_spec, make_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=["prefill-4k"], choices=list(WORKLOADS))
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--dtype", nargs="*", default=["bf16"], choices=list(DTYPES),
                    help="each workload in each of these dtypes")
    ap.add_argument("--path", choices=("default", "3stage", "fused"), default="default",
                    help="our path (FUSE_OUTPUT forced), e.g. the 3-stage state pass in f16 / bf16")
    args = ap.parse_args()
    fuse = {"default": None, "3stage": False, "fused": True}[args.path]
    calls = []
    for name in args.only:
        for dt in args.dtype:
            op, B, T, H, HV, K, V, opts, lens = WORKLOADS[name]
            spec, options, x, cu = make_inputs(op, B, T, H, HV, K, V, opts, lens,
                                               dtype=getattr(torch, DTYPES[dt]))
            cu_dev = None if cu is None else cu.cuda()

            def ours(spec=spec, options=options, x=x, cu=cu, cu_dev=cu_dev):
                with chunk.using(FUSE_OUTPUT=fuse):
                    return chunk.chunk_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                               initial_state=x["initial_state"],
                                               output_final_state=True, options=options,
                                               cu_seqlens=cu_dev, cu_seqlens_cpu=cu,
                                               A_log=x["A_log"], dt_bias=x["dt_bias"])
            calls.append((f"{name} {dt}", "linattn", ours))
            if not args.no_fla:
                calls.append((f"{name} {dt}", "fla", fla_call(get_spec(op), options, x, cu_dev)))
    for name, who, fn in calls:           # compile / autotune / warm up outside the range
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for name, who, fn in calls:
        print(f"profiling {name} {who}", flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
