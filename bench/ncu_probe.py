"""Nsight Compute view of the chunked forward: one call of ours (and of fla) per workload
inside a profiler range, everything else (compiles, fla's autotuning, warm-up) outside it,
so `ncu --profile-from-start off` sees exactly those kernels.

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --csv --page details \\
        python3 bench/ncu_probe.py --only prefill-4k q35-397b-tp1-65536 > ncu.csv

Workloads: bench/walk_probe.py's CASES; --config forces a plan choice as there.
--gla-bwd B T H K V: instead, one GLAChunkBwd call of that shape (bench/gla_bwd_probe.py's
inputs; the default backward plan).
--pool NAME ...: instead, pool decode (bench/pool_probe.py's cases), ours and fla's, each on
its own copy of the pool; --knobs "block_v=16,threads=64" ...: ours also with those tuning knobs."""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_lib import fla_call, make_inputs  # noqa: E402
from walk_probe import CASES, parse_config  # noqa: E402

from linattn.ops import chunk  # noqa: E402


def _pool_calls(names, knobs=()):
    """(name, who, fn) of pool decode, ours and fla's, for pool_probe's cases ``names``;
    ours also with each knob string of ``knobs`` (pool_probe --knobs's form)."""
    import pool_probe
    from linattn.ops.recurrent import tuning_override
    cases = {c[0]: c[1:] for c in pool_probe.CASES}

    def tuned(kn):
        def call(x, i, a, p):
            with tuning_override(**pool_probe.parse_knobs(kn)):
                return pool_probe.ours(x, i, a, p)
        return call
    calls = []
    for name in names:
        x, idx, acc, pool = pool_probe.make(*cases[name])
        fns = [("linattn", pool_probe.ours), ("fla", pool_probe.fla)]
        fns += [(f"linattn[{kn}]", tuned(kn)) for kn in knobs]
        for who, fn in fns:
            p = pool.clone()
            calls.append((name, who,
                          lambda fn=fn, p=p, x=x, i=idx, a=acc: fn(x, i, a, p)))
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=["prefill-4k"], choices=list(CASES))
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--config", default="default")
    ap.add_argument("--gla-bwd", nargs=5, type=int, default=None, metavar=("B", "T", "H", "K", "V"))
    ap.add_argument("--pool", nargs="*", default=None, help="pool_probe case names")
    ap.add_argument("--knobs", nargs="*", default=(),
                    help='with --pool: ours also with these knobs, e.g. "block_v=16,threads=64"')
    args = ap.parse_args()
    config = parse_config(args.config)
    calls = _pool_calls(args.pool, args.knobs) if args.pool else []
    if args.gla_bwd:
        from gla_bwd_probe import _ours, shape_inputs
        calls.append(("gla-bwd-" + "x".join(map(str, args.gla_bwd)), "linattn",
                      _ours(shape_inputs(*args.gla_bwd), args.gla_bwd[3] ** -0.5)))
    for name in ([] if args.gla_bwd or args.pool else args.only):
        op, B, T, H, HV, K, V, opts, lens, v_first = CASES[name]
        spec, options, x, cu = make_inputs(op, B, T, H, HV, K, V, opts, lens)
        options = dataclasses.replace(options, state_v_first=v_first)
        cu_dev = None if cu is None else cu.cuda()

        def ours(spec=spec, options=options, x=x, cu=cu, cu_dev=cu_dev):
            return chunk.chunk_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                       initial_state=x["initial_state"], output_final_state=True,
                                       options=options, cu_seqlens=cu_dev, cu_seqlens_cpu=cu,
                                       A_log=x["A_log"], dt_bias=x["dt_bias"], config=config)
        calls.append((name, "linattn", ours))
        if not args.no_fla:
            calls.append((name, "fla", fla_call(spec, options, x, cu_dev)))
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
