"""Probe of the decode (fused recurrent, T == 1) kernel on the GPU over the workload
table's decode rows: ours at the arch table's tuning and, with --sweep, at other tuning
knobs (block_v, threads, vec, warps_k); fla side by side when importable.

Each (row, config) is checked against the fp64 reference of the benchmark (wrong
configs are reported, not timed), then timed with linattn-bench's timer (CUPTI kernel
union per call, L2 flushed before each call, median). Every kernel the run needs is
compiled first in parallel processes (runtime.recording / runtime.precompile). One
failing row or config never stops the rest; the JSON is rewritten after every row.

The floor of a row with a state: an elementwise f32 copy moving the row's state bytes
(read + written), timed by the same timer in the same run; each time prints as the
fraction of that copy's bandwidth (copy_ms / ms).

    python3 bench/decode_probe.py [--sweep] [--rows GLOB] [--budget-s 240]
        [--configs "block_v=16,threads=128,vec=4,warps_k=4" "ctas_per_sm=3" ...]
    (JSON to --out, default $OUT_DIR or $OUT /decode_probe.json)
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
import traceback

import torch

from linattn.cli.bench import impls as impl_mod
from linattn.cli.bench.inputs import build_inputs
from linattn.cli.bench.reference import check, reference_outputs
from linattn.cli.bench.timer import device_time
from linattn.cli.bench.workloads import load_rows
from linattn.codegen.arch.sm90 import recurrent_layout_ok
from linattn.ops import runtime
from linattn.ops.recurrent import tuning_override
from probe_lib import parse_knobs

# rows swept over the tuning knobs (globs on "op/workload/dtype"): small, mid, large
SWEEP_ROWS = ("DeltaNetRecurrentFwd/serving-b1-h8/*", "DeltaNetRecurrentFwd/serving-b8-h64/*",
              "GLARecurrentFwd/serving-b8-h64/*", "GDNFwd/decode-b1/bf16", "GDNFwd/decode-b8/bf16",
              "GDNFwd/q35-gva-decode-b32/bf16", "GDNFwd/q35-gva-decode-b256/bf16",
              "GDNFwd/decode-vfirst-b17/*", "KDAFwd/kda-tp1-decode-b64/*",
              "KDAFwd/kda-tp8-decode-b256/*", "GLAFwd/decode-b8-d128/*",
              "DeltaNetFwd/decode-narrow-b17/*")
# candidate knobs in order of interest (v1's layout first); invalid ones for a row skipped
CANDIDATES = [dict(block_v=bv, threads=th, vec=vec, warps_k=wk) for bv, th, vec, wk in (
    (32, 128, 4, 1), (32, 128, 4, 4), (32, 128, 8, 4), (32, 128, 4, 2), (16, 64, 4, 2),
    (16, 64, 8, 2), (64, 256, 4, 4), (64, 256, 8, 8), (64, 128, 8, 4), (32, 64, 4, 2),
    (8, 32, 4, 1), (8, 32, 8, 1), (32, 128, 8, 1), (16, 64, 8, 1), (32, 64, 8, 1),
    (64, 256, 8, 1), (64, 128, 4, 1),
    # one warp, 16 value columns, 64 state values a thread (TileOPs' raw decode kernel's map)
    (16, 32, 4, 1), (16, 32, 2, 1), (16, 32, 1, 1),
    # 16 state values a thread, K-first (Mamba-2's value-first decode won at 16: run s40-6)
    (16, 128, 4, 4), (8, 64, 4, 2), (32, 256, 4, 8))]


def key(row):
    return f"{row.op}/{row.workload}/{row.dtype}"


def row_dims(row):
    """(K, V, state_v_first) of a decode row."""
    q, v = row.shape("q"), row.shape("v")
    return q[-1], v[-1], bool(row.options.get("state_v_first"))


_CONFIGS = []        # --configs's knob dicts (main sets them)


def configs_for(row, sweep: bool, limit: int):
    """[None (the arch table)] + up to `limit` valid candidate knob dicts (CANDIDATES, or
    --configs's: a dict without the four tile knobs keeps the table's tile)."""
    out = [None]
    if not sweep:
        return out
    K, V, vf = row_dims(row)
    tile = ("block_v", "threads", "vec", "warps_k")
    for c in _CONFIGS or CANDIDATES:
        if not all(t in c for t in tile):
            out.append(c)
            continue
        if vf and c["warps_k"] != 1:
            continue
        if recurrent_layout_ok(K, V, c["block_v"], c["threads"], c["vec"], c["warps_k"], vf):
            out.append(c)
    return out[:limit + 1]


def call_with(fn, cfg):
    if cfg is None:
        return fn()
    with tuning_override(**cfg):
        return fn()


def state_bytes(row):
    n = 0
    for name in ("state", "initial_state"):
        t = row.tensors.get(name)
        if t:
            numel = 1
            for d in t["shape"]:
                numel *= d
            n += numel * (4 if t["dtype"] == "f32" else 2)
    return 2 * n       # read + written


_COPY_MS = {}


def copy_ms(nbytes, budget_ms):
    """Device time of an elementwise f32 copy moving nbytes (half read, half written)."""
    n = nbytes // 8
    if n not in _COPY_MS:
        src = torch.randn(n, device="cuda")
        dst = torch.empty_like(src)
        # (an elementwise kernel: a same-dtype copy_ is a memcpy, which the timer skips)
        _COPY_MS[n] = device_time(lambda: torch.mul(src, 1.0, out=dst), budget_ms=budget_ms)["ms"]
        del src, dst
    return _COPY_MS[n]


def precompile_all(rows, sweep, limit):
    jobs = []
    for row in rows:
        try:
            x = build_inputs(row, "cuda", 0)
            fn, _ = impl_mod.make("linattn", row, x)
        except Exception:
            continue
        for cfg in configs_for(row, sweep, limit):
            with runtime.recording() as req:
                try:
                    call_with(fn, cfg)
                except runtime.KernelRequested:
                    pass
                except Exception:
                    pass
            jobs += req
    t0 = time.time()
    try:
        errs = runtime.precompile(jobs)
    except Exception as e:       # compile in-process on first use instead
        errs = [f"precompile failed: {type(e).__name__}: {e}"]
    print(f"precompiled {len(jobs)} requests in {time.time() - t0:.0f} s, {len(errs)} errors",
          flush=True)
    for e in errs[:10]:
        print("  compile error:", e)
    return errs


def probe_row(row, sweep, limit, budget_ms, with_fla):
    rec = {"key": key(row), "state_bytes": state_bytes(row), "seed_ms": row.seed.get("ours_ms"),
           "seed_alternatives": row.seed.get("alternatives"), "configs": []}
    if rec["state_bytes"]:
        rec["copy_ms"] = copy_ms(rec["state_bytes"], budget_ms)
    x = build_inputs(row, "cuda", 0)
    ref = reference_outputs(row, x)
    fn, outputs = impl_mod.make("linattn", row, x)
    for cfg in configs_for(row, sweep, limit):
        c = {"tuning": cfg or "table"}
        try:
            ok, errs, msg = check(outputs(call_with(fn, cfg)), ref, row.dtype)
            c.update(ok=ok, errors=errs, msg=msg)
            if ok:
                t = device_time(lambda: call_with(fn, cfg), budget_ms=budget_ms)
                c.update(ms=t["ms"], p10=t["p10"], p90=t["p90"], kernels=t["kernels"])
                if rec["state_bytes"]:
                    c["frac_copy_bw"] = rec["copy_ms"] / t["ms"]
        except Exception as e:
            c["error"] = f"{type(e).__name__}: {e}"[:400]
            if any(f in str(e) for f in ("illegal memory", "launch failure", "misaligned")):
                rec["configs"].append(c)
                raise
        rec["configs"].append(c)
    if with_fla:
        try:
            ffn, fout = impl_mod.make("fla", row, x)
            ok, errs, msg = check(fout(ffn()), ref, row.dtype)
            rec["fla"] = {"ok": ok, "ms": device_time(ffn, budget_ms=budget_ms)["ms"]}
            if rec["state_bytes"]:
                rec["fla"]["frac_copy_bw"] = rec["copy_ms"] / rec["fla"]["ms"]
        except Exception as e:
            rec["fla"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return rec


def summary_line(rec):
    table = rec["configs"][0]
    timed = [c for c in rec["configs"] if "ms" in c]
    best = min(timed, key=lambda c: c["ms"]) if timed else None
    fla = rec.get("fla", {}).get("ms")
    seed = rec.get("seed_ms")
    alts = rec.get("seed_alternatives") or {}
    target = min([v for v in [seed, *alts.values()] if v] or [float("nan")])
    fmt = lambda v: f"{v * 1e3:7.2f}" if isinstance(v, (int, float)) else "      -"  # noqa: E731
    pct = lambda c: f" ({c['frac_copy_bw']:4.0%} copy)" if c.get("frac_copy_bw") else " " * 12  # noqa: E731
    line = f"{rec['key']:52s} table {fmt(table.get('ms'))} us" + pct(table)
    line += f" best {fmt(best['ms'] if best else None)} us" + (pct(best) if best else " " * 12)
    line += f" fla {fmt(fla)} target {fmt(target)}"
    if rec.get("copy_ms"):
        line += f" copy {fmt(rec['copy_ms'])}"
    if best and best["tuning"] != "table":
        t = best["tuning"]
        line += "  [" + " ".join(f"{k}={v}" for k, v in t.items()) + "]"
    for c in rec["configs"][1:]:        # every config: its time and share of the copy's bandwidth
        if "ms" in c and isinstance(c["tuning"], dict):
            knobs = ",".join(f"{k}={v}" for k, v in c["tuning"].items())
            line += f"\n    {knobs:60s} {fmt(c['ms'])} us{pct(c)}"
    bad = [c for c in rec["configs"] if not c.get("ok", True) or "error" in c]
    if bad:
        line += f"  {len(bad)} FAILED: {(bad[0].get('error') or bad[0].get('msg'))[:120]}"
    return line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also sweep tuning knobs on SWEEP_ROWS")
    ap.add_argument("--rows", default=None, help="glob(s) on op/workload/dtype, comma separated")
    ap.add_argument("--limit", type=int, default=10, help="sweep configs per row")
    ap.add_argument("--budget-ms", type=float, default=40.0, help="timer budget per config")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting rows after")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--configs", nargs="*", default=None,
                    help='sweep every selected row over these knobs instead, e.g. '
                         '"block_v=16,threads=32,vec=4,warps_k=1"')
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.configs:
        _CONFIGS[:] = [parse_knobs(c) for c in a.configs]
    out = a.out or os.path.join(os.environ.get("OUT_DIR") or os.environ.get("OUT") or ".",
                                "decode_probe.json")
    t_start = time.time()
    rows = [r for r in load_rows() if r.is_decode]
    if a.rows:
        globs = a.rows.split(",")
        rows = [r for r in rows if any(fnmatch.fnmatchcase(key(r), g) for g in globs)]
    sweep_of = {key(r): bool(a.configs) or (a.sweep and any(fnmatch.fnmatchcase(key(r), g)
                                                             for g in SWEEP_ROWS))
                for r in rows}
    with_fla = not a.no_fla
    if with_fla:
        try:
            import fla  # noqa: F401
        except Exception as e:
            print(f"fla not importable ({e}); ours only")
            with_fla = False
    precompile_all([r for r in rows if not sweep_of[key(r)]], False, a.limit)
    precompile_all([r for r in rows if sweep_of[key(r)]], True, a.limit)
    doc = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("LINATTN_COMMIT"),
           "rows": []}
    for row in rows:
        if time.time() - t_start > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: {key(row)} and later rows left out")
            break
        try:
            rec = probe_row(row, sweep_of[key(row)], a.limit, a.budget_ms, with_fla)
        except Exception as e:
            rec = {"key": key(row), "configs": [{"tuning": "table", "error": f"{type(e).__name__}: {e}"[:400]}],
                   "trace": traceback.format_exc()[-1500:]}
            if any(f in str(e) for f in ("illegal memory", "launch failure", "misaligned")):
                doc["rows"].append(rec)
                print(summary_line(rec), flush=True)
                print("fatal CUDA error: the context is lost, stopping")
                break
        doc["rows"].append(rec)
        print(summary_line(rec), flush=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    wins = [r for r in doc["rows"] if r["configs"] and "ms" in r["configs"][0]]
    print(f"{len(wins)}/{len(doc['rows'])} rows timed; JSON: {out} "
          f"({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
