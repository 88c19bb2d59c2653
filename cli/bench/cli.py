"""Command line of linattn-bench (argparse; see the package docstring)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import remote, report
from .impls import IMPLS, applies
from .run import precompile_rows, run, warm_rows
from .workloads import TRAIN_OPS, load_rows, select, train_rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="linattn-bench", description=__doc__)
    p.add_argument("--op", help="comma-separated ops (e.g. GDNFwd,KDAFwd); the training rows "
                   "(GDNTrain, KDATrain, GLATrain, DeltaNetTrain; 'train': all four) run only "
                   "when named here")
    p.add_argument("--workload", help="glob(s) on the workload label, comma-separated")
    p.add_argument("--dtype", help="comma-separated: bf16,f16")
    p.add_argument("--limit", type=int)
    p.add_argument("--impl", default="linattn,fla,seed,flashinfer,torch,torch-compile",
                   help=f"comma-separated, from {','.join(IMPLS)}")
    p.add_argument("--seed-path", help="package path (PYTHONPATH) holding tileops 0.1.0 and its "
                   "TileLang 0.1.12 for --impl seed (default: $LINATTN_SEED_PATH or $SEED_PATH)")
    p.add_argument("--flashinfer-path", help="package path holding flashinfer for --impl "
                   "flashinfer (default: $LINATTN_FLASHINFER_PATH)")
    p.add_argument("--run-id", help="the run every entry names (default: date, host, process); "
                   "pass one id to several invocations on one machine at one commit")
    p.add_argument("--out", help="results JSON (rewritten after every row)")
    p.add_argument("--merge", metavar="INTO", help="merge rows by (op, workload, dtype) into this JSON")
    p.add_argument("--plot", metavar="PNG", help="the picture: per op, other / linattn time per "
                   "row (needs matplotlib: the 'bench' extra); with --summary: of that results JSON")
    p.add_argument("--table-md", metavar="MD", help="also write the markdown table here")
    p.add_argument("--budget-s", type=float, default=None, help="total time budget; rows left are skipped")
    p.add_argument("--row-budget-ms", type=float, default=100.0, help="timer budget per implementation")
    p.add_argument("--device", default="cuda")
    p.add_argument("--check-only", action="store_true", help="verify outputs, do not time")
    p.add_argument("--verify-timer", action="store_true", help="run the timer's self-check first")
    p.add_argument("--list", action="store_true", help="list the selected rows and exit")
    p.add_argument("--summary", metavar="JSON",
                   help="print the summary of a results JSON (per op: geomean of each "
                        "alternative's time / linattn's, the rows where linattn is behind, "
                        "entries from other runs or stale kernels) and exit; no GPU needed")
    p.add_argument("--skip-timed", metavar="JSON",
                   help="skip rows whose every --impl already has a time in this results JSON "
                        "(resume a run cut by its budget)")
    p.add_argument("--warm", type=int, default=0, metavar="P",
                   help="first compile the other implementations' kernels (fla's autotuning "
                        "configs, torch.compile) for all rows in P parallel processes; the "
                        "timed run then finds them compiled")
    p.add_argument("--warm-only", action="store_true",
                   help="with --warm: compile (linattn's kernels too) and exit (no reference, no "
                        "check, no timing); a later run on the same machine finds them compiled")
    p.add_argument("--workloads-json", help="another workload table (default: the packaged one)")
    p.add_argument("--shard", metavar="I/N", help="run every N-th selected row from the I-th "
                   "(0 <= I < N): one process a GPU of a multi-GPU machine (bench/table_run.sh)")
    return p.parse_args(argv)


def timed_rows(doc: dict, impls) -> set:
    """Keys (op, workload, dtype) of the results rows where every one of ``impls`` has a
    time, is reported not implemented, or does not apply to the op."""
    def settled(rec, impl):
        row = report.table_rows().get((rec["op"], rec["workload"], rec["dtype"]))
        if row is not None and not applies(impl, row):
            return True
        res = rec.get("impls", {}).get(impl) or {}
        return res.get("ms") is not None or "not implemented" in (res.get("note") or "")
    return {(r["op"], r["workload"], r["dtype"]) for r in doc.get("rows", [])
            if all(settled(r, i) for i in impls)}


def select_rows(a) -> list:
    """The rows the filters select: the seed table (or --workloads-json), plus the
    training rows where --op names a training op ('train': all of them)."""
    ops = [o.strip() for o in a.op.split(",") if o.strip()] if a.op else None
    if ops and "train" in {o.lower() for o in ops}:
        ops = [o for o in ops if o.lower() != "train"] + list(TRAIN_OPS)
    table = load_rows(a.workloads_json)
    if ops and {o.lower() for o in ops} & {o.lower() for o in TRAIN_OPS}:
        table += train_rows()
    return select(table, ops=ops, workload=a.workload,
                  dtypes=a.dtype.split(",") if a.dtype else None, limit=a.limit)


def shard(rows: list, spec: str) -> list:
    """Every N-th row from the I-th, for --shard I/N (interleaved: each shard gets a share
    of every op and size)."""
    try:
        i, n = (int(x) for x in spec.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise SystemExit(f"--shard takes I/N with 0 <= I < N, got {spec!r}") from None
    return rows[i::n]


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.summary:
        with open(a.summary) as f:
            doc = json.load(f)
        print(report.summary(doc["rows"]), end="")
        return draw(doc, a.plot) if a.plot else 0
    rows = select_rows(a)
    if a.skip_timed:
        with open(a.skip_timed) as f:
            done = timed_rows(json.load(f), [s.strip() for s in a.impl.split(",") if s.strip()])
        rows = [r for r in rows if tuple(r.key) not in done]
    if a.shard:
        rows = shard(rows, a.shard)
    if a.list:
        for r in rows:
            print(r.op, r.workload, r.dtype)
        print(f"{len(rows)} rows")
        return 0
    impls = [s.strip() for s in a.impl.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        print(f"unknown --impl {bad}; valid: {', '.join(IMPLS)}", file=sys.stderr)
        return 2
    for impl, path in (("seed", a.seed_path), ("flashinfer", a.flashinfer_path)):
        if path:    # the child processes (and warm processes) read it from the environment
            os.environ[remote.BACKENDS[impl][1][0]] = path
    if a.warm_only:     # linattn's compiles, then the others' within what is left, and exit
        t0 = time.monotonic()
        pre = precompile_rows(rows, a.device) if "linattn" in impls and a.device.startswith("cuda") else None
        left = a.budget_s - (time.monotonic() - t0) if a.budget_s else None
        res = {**warm_rows(rows, impls, a.warm or 1, a.device, budget_s=left), "precompile": pre}
        remote.close_all()
        print(json.dumps(res, indent=1))
        return 1 if res["errors"] else 0
    doc = run(rows, impls, out_path=a.out, device=a.device, time_it=not a.check_only,
              timer_budget_ms=a.row_budget_ms, budget_s=a.budget_s, verify_timer=a.verify_timer,
              warm_processes=a.warm, run_id=a.run_id)
    remote.close_all()
    text = report.table(doc["rows"])
    print(text)
    if doc.get("skipped_for_budget"):
        print(f"skipped for budget: {len(doc['skipped_for_budget'])} rows")
    if a.table_md:
        with open(a.table_md, "w") as f:
            f.write(text)
    if a.merge:
        report.merge_into(a.merge, doc, load_rows(a.workloads_json) if a.workloads_json else None)
    if doc.get("timer_check"):
        print("timer check:", json.dumps(doc["timer_check"]))
    return draw(doc, a.plot) if a.plot else 0


def draw(doc: dict, path: str) -> int:
    """--plot: the picture of a results document (cli/bench/plot.py); 0, or 1 with one
    line on stderr saying why there is none (matplotlib missing, nothing timed)."""
    from . import plot
    try:
        drawn = plot.write(doc["rows"], path, gpu=doc.get("gpu"))
    except plot.PlotUnavailable as e:
        print(f"linattn-bench: no picture: {e}", file=sys.stderr)
        return 1
    print(f"picture: {path} ({len(drawn)} ops)")
    return 0
