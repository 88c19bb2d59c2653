"""Decode on a state pool, linattn against fla (H200): KDA, where fla 0.6 takes a pool
(fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd with ssm_state_indices,
num_accepted_tokens and inplace_final_state; fla's gated delta rule takes none).

Per case: a pool of P f32 slots [P, HV, K, V] (random, never zeros), N sequences at
random distinct slots, T tokens each (T > 1: speculative decoding, one slot per draft
token, num_accepted_tokens random in 1..T); both implementations update the pool in
place. Checked: o and the written slots of ours against fla's on the same inputs (fresh
copies of the pool), relative error; timed: device time per call (probe_lib).

    python3 bench/pool_probe.py [--sweep] [--only kimi-b8 ...] [--out pool_probe.json]

--sweep: ours also at decode_probe's candidate tunings (block_v, threads, vec, warps_k),
each checked against fla before it is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_lib import device_times, parse_knobs  # noqa: E402
from decode_probe import CANDIDATES  # noqa: E402

import linattn  # noqa: E402
from linattn.codegen.arch.sm90 import recurrent_layout_ok  # noqa: E402
from linattn.ops import runtime  # noqa: E402
from linattn.ops.recurrent import tuning_override  # noqa: E402

#: (name, pool slots P, sequences N, tokens T, heads HV, K = V)
CASES = [
    ("kimi-b1", 512, 1, 1, 32, 128),
    ("kimi-b8", 512, 8, 1, 32, 128),
    ("kimi-b64", 512, 64, 1, 32, 128),
    ("kimi-b256", 1024, 256, 1, 32, 128),
    ("kimi-spec4-b64", 1024, 64, 4, 32, 128),
    ("kimi-b512", 1024, 512, 1, 32, 128),
    ("tp4-b1", 64, 1, 1, 8, 128),
    ("tp4-b128", 1024, 128, 1, 8, 128),
    ("tp4-b512", 1024, 512, 1, 8, 128),
]


def make(P, N, T, HV, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x = dict(q=F.normalize(r(N, T, HV, D), dim=-1).bfloat16(),
             k=F.normalize(r(N, T, HV, D), dim=-1).bfloat16(),
             v=r(N, T, HV, D).bfloat16(), g=F.logsigmoid(r(N, T, HV, D)),
             beta=torch.rand(N, T, HV, device="cuda", generator=g).bfloat16())
    perm = torch.randperm(P, device="cuda", generator=g)[:N * T]
    idx = (perm if T == 1 else perm.view(N, T)).to(torch.int32)
    acc = (torch.randint(1, T + 1, (N,), device="cuda", generator=g).to(torch.int32)
           if T > 1 else None)
    pool = r(P, HV, D, D) * 0.1
    return x, idx, acc, pool


def ours(x, idx, acc, pool):
    return linattn.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                       initial_state=pool, ssm_state_indices=idx,
                                       num_accepted_tokens=acc, inplace_final_state=True,
                                       output_final_state=True)


def fla(x, idx, acc, pool):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    return fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   initial_state=pool, output_final_state=True,
                                   inplace_final_state=True, ssm_state_indices=idx,
                                   num_accepted_tokens=acc)


def copy_floor(numel):
    """Device time of copying ``numel`` random f32 values (read once, written once: the
    state bytes a decode step moves), the bandwidth floor the kernels are measured by."""
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    # (an elementwise kernel: a same-dtype copy_ is a memcpy, which device_times skips)
    return device_times(lambda: torch.mul(src, 1.0, out=dst))[0]


def sweep(x, idx, acc, pool, p_fla, o_fla, D, rel, candidates=CANDIDATES, check_layout=True):
    """[(knobs, ms or error)] of ours at the valid candidate tunings (knobs not given
    keep the arch table's)."""
    out = []
    slots = idx.flatten().long()
    for c in candidates:
        if check_layout and not recurrent_layout_ok(D, D, c["block_v"], c["threads"], c["vec"],
                                                    c["warps_k"], False):
            continue
        try:
            with tuning_override(**c):
                p = pool.clone()
                o, _ = ours(x, idx, acc, p)
                err = max(rel(o, o_fla), rel(p[slots], p_fla[slots]))
                ms = device_times(lambda: ours(x, idx, acc, p))[0] if err < 1e-3 else None
            out.append(dict(c, err=err, ms=ms))
        except Exception as e:          # a config the template refuses
            out.append(dict(c, error=f"{type(e).__name__}: {e}"[:200]))
    return out


def precompile(cases, knobs):
    """Every kernel the cases need (ours at the table and at each knob dict) compiled first
    in parallel processes (runtime.precompile), so no case waits on a compile."""
    jobs = []
    for name, P, N, T, HV, D in cases:
        x, idx, acc, pool = make(P, N, T, HV, D)
        for c in [None] + list(knobs):
            with runtime.recording() as req, tuning_override(**(c or {})):
                try:
                    ours(x, idx, acc, pool.clone())
                except Exception:       # KernelRequested (noted), or a refused config
                    pass
            jobs += req
    errs = runtime.precompile(jobs)
    print(f"precompiled {len(jobs)} requests, {len(errs)} errors", flush=True)
    for e in errs[:10]:
        print("  compile error:", e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--knobs", nargs="*", default=None,
                    help='ours also with these tuning knobs, e.g. "block_v=16,threads=64"')
    ap.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pool_probe.json"))
    args = ap.parse_args()
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    results = []
    cases = [c for c in CASES if not args.only or c[0] in args.only]
    precompile(cases, [parse_knobs(k) for k in args.knobs or ()])
    for name, P, N, T, HV, D in cases:
        x, idx, acc, pool = make(P, N, T, HV, D)
        p_ours, p_fla = pool.clone(), pool.clone()
        o1, _ = ours(x, idx, acc, p_ours)
        o2, _ = fla(x, idx, acc, p_fla)
        torch.cuda.synchronize()
        fla_once = p_fla.clone()            # (the timing below updates the pools again)
        slots = idx.flatten().long()
        rec = dict(case=name, P=P, N=N, T=T, HV=HV, K=D, V=D,
                   err_o_vs_fla=rel(o1, o2), err_pool_vs_fla=rel(p_ours[slots], p_fla[slots]),
                   untouched_equal=bool(torch.equal(
                       p_ours[~torch.isin(torch.arange(P, device="cuda"), slots)],
                       pool[~torch.isin(torch.arange(P, device="cuda"), slots)])))
        rec["ours_ms"], rec["ours_kernels"], _ = device_times(lambda: ours(x, idx, acc, p_ours))
        rec["fla_ms"], rec["fla_kernels"], _ = device_times(lambda: fla(x, idx, acc, p_fla))
        rec["speedup"] = rec["fla_ms"] / rec["ours_ms"]
        rec["copy_ms"] = copy_floor(pool[:N].numel() * (1 + T) // 2)   # N read, N * T written
        if args.sweep:
            rec["sweep"] = sweep(x, idx, acc, pool, fla_once, o2, D, rel)
        if args.knobs:
            rec["variants"] = sweep(x, idx, acc, pool, fla_once, o2, D, rel,
                                    [parse_knobs(k) for k in args.knobs], check_layout=False)
        print(json.dumps(rec), flush=True)
        results.append(rec)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("\ncase              ours_ms   fla_ms  x fla  copy_ms  ours/fla % of copy  err_o    "
          "err_pool")
    for r in results:
        print(f"{r['case']:16s} {r['ours_ms']:8.4f} {r['fla_ms']:8.4f} {r['speedup']:5.2f} "
              f"{r['copy_ms']:8.4f}  {r['copy_ms'] / r['ours_ms']:4.0%} / "
              f"{r['copy_ms'] / r['fla_ms']:4.0%}  "
              f"{r['err_o_vs_fla']:9.2e} {r['err_pool_vs_fla']:9.2e}")
        for who in ("ours", "fla"):
            print(f"   {who} kernels: " + ", ".join(f"{k} {v * 1e3:.1f} us"
                                                  for k, v in r[f"{who}_kernels"].items()))
        for c in sorted((c for c in r.get("sweep", []) if c.get("ms")), key=lambda c: c["ms"])[:4]:
            print(f"   {c['block_v']:3d} {c['threads']:4d} {c['vec']} {c['warps_k']}  {c['ms']:.4f}")
        for c in r.get("variants", []):
            knobs = {k: v for k, v in c.items() if k not in ("err", "ms", "error")}
            share = f" ({r['copy_ms'] / c['ms']:4.0%} of copy)" if c.get("ms") else ""
            print(f"   {knobs}  {c.get('ms') or c.get('error')}{share}  err {c.get('err')}")


if __name__ == "__main__":
    main()
