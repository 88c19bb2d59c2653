"""The benchmark loop: per row, build inputs, compute the fp64 reference, check every
implementation against it, time the ones that pass. One failing row or implementation
never stops the run; the JSON is rewritten after every row; a total budget stops it early."""
from __future__ import annotations

import os
import gc
import subprocess
import time
import traceback
import zlib

from . import impls as impl_mod
from . import report, train
from .inputs import build_inputs
from .reference import check, reference_outputs

FATAL = ("illegal memory access", "unspecified launch failure", "device-side assert",
         "misaligned address", "illegal instruction")


def header(device: str, run_id: str | None = None) -> dict:
    """The run's stamp: GPU, clocks, commit, date, run id (every entry carries run, commit
    and gpu: calls on one machine at one commit share a run id when the caller passes it)."""
    import datetime
    import torch
    doc = {"gpu": None, "commit": None, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "clocks": None, "torch": torch.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        doc["gpu"] = torch.cuda.get_device_name()
        doc["clocks"] = _sh("nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw "
                            "--format=csv,noheader")
    # the GPU machine gets the working tree without .git: the caller passes the commit
    doc["commit"] = os.environ.get("LINATTN_COMMIT") or _sh("git rev-parse --short HEAD")
    doc["run"] = run_id or f"{doc['date'][:19]}-{os.uname().nodename}-{os.getpid()}"
    try:
        import fla
        doc["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        doc["fla"] = None
    return doc


def _sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


def run_row(row, impl_names, device="cuda", time_it=True, timer_budget_ms=100.0, seed=None,
            stamp=None) -> dict:
    """One row -> its record (never raises; errors land in notes). stamp (run, commit,
    gpu) goes into every implementation's entry."""
    import torch
    seed = zlib.crc32("/".join(row.key).encode()) if seed is None else seed
    rec = {"op": row.op, "workload": row.workload, "dtype": row.dtype, "seed": row.seed,
           "options": row.options, "impls": {}, "input_seed": seed}
    t0 = time.monotonic()
    try:
        x = build_inputs(row, device, seed)
        ref = reference_outputs(row, x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as e:
        rec["error"] = f"inputs/reference: {type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=4)
        return rec
    rec["reference_s"] = time.monotonic() - t0
    _slow_phase(row, "inputs and reference", rec["reference_s"])
    for name in impl_names:
        t1 = time.monotonic()
        for n, e in _run_impl(name, row, x, ref, device, time_it, timer_budget_ms).items():
            rec["impls"][n] = {**(stamp or {}), **e}
        _slow_phase(row, f"{name} (first call, check, timing)", time.monotonic() - t1)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    del x, ref
    gc.collect()
    rec["row_s"] = time.monotonic() - t0
    return rec


#: a row's phase that takes longer (s) is named in the log as it ends (where a run cut by
#: its time limit spent it: fla's first autotuning, the fp64 reference)
SLOW_PHASE_S = 10.0


def _slow_phase(row, what: str, seconds: float) -> None:
    if seconds > SLOW_PHASE_S:
        print(f"{row.op} {row.workload} {row.dtype}: {what} took {seconds:.0f} s", flush=True)


def _run_impl(name, row, x, ref, device, time_it, timer_budget_ms) -> dict:
    import torch
    try:
        fn, outputs = impl_mod.make(name, row, x)
    except impl_mod.NotApplicable:
        return {}
    except impl_mod.NotImplementedImpl as e:
        return {name: {"ms": None, "ok": False, "note": f"not implemented: {e}"}}
    except Exception as e:
        return {name: {"ms": None, "ok": False, "note": f"setup failed: {type(e).__name__}: {e}"[:500]}}
    res = {"ms": None, "ok": False, "note": ""}
    try:
        out = outputs(fn())
        ok, errs, msg = check(out, ref, row.dtype)
        res.update(ok=ok, rel_err=errs, note=msg)
        del out
        if ok and row.is_train and device.startswith("cuda"):
            res.update(train.peak_memory(fn))
        if ok and time_it:
            # an implementation in a child process times itself there (remote.RemoteCall)
            timed = getattr(fn, "device_time", None) or (lambda budget_ms: __import__(
                "linattn.cli.bench.timer", fromlist=["device_time"]).device_time(fn, budget_ms=budget_ms))
            t = timed(budget_ms=timer_budget_ms)
            res.update(ms=t["ms"], p10=t["p10"], p90=t["p90"], calls=t["calls"], kernels=t["kernels"])
    except impl_mod.NotImplementedImpl as e:     # refused when called (a training row's gap)
        res.update(ok=False, ms=None, note=f"not implemented: {e}"[:500])
    except Exception as e:
        res.update(ok=False, ms=None, note=f"{type(e).__name__}: {e}"[:500])
        if any(s in str(e) for s in FATAL) and not getattr(fn, "in_child", False):
            res["fatal"] = True     # this process's CUDA context is broken (a child's is not)
    finally:
        _close(fn, res)
        if device.startswith("cuda"):
            try:
                torch.cuda.synchronize()
            except Exception as e:
                res.update(ok=False, fatal=True, note=(res["note"] + f" | sync: {e}")[:500])
    return {name: res}


def _close(fn, res) -> None:
    """Free a child process's side of the call (remote.RemoteCall.close); a child that
    died there is noted, the next row starts a new one."""
    close = getattr(fn, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as e:
        res["note"] = (res.get("note", "") + f" | close: {type(e).__name__}: {e}")[:500]


def precompile_rows(rows, device="cuda", rounds=None) -> dict:
    """Compile the linattn kernels every row will run, in parallel processes, before the
    rows run one by one (each row's call is recorded, not run: ops.runtime.recording).
    A call records the kernels up to its first missing one: a training step's forward,
    then (once those are compiled, loaded here and run) its backward's layout kernels,
    recompute and stages, so rows with training ops take up to 5 rounds (default), others
    1; rounds stop when a round records nothing new."""
    from linattn.ops import runtime
    t0 = time.monotonic()
    rounds = rounds or (5 if any(r.is_train for r in rows) else 1)
    n_jobs, errors, seen = 0, [], set()
    for _ in range(rounds):
        jobs = _recorded_jobs(rows, device)
        key = repr(sorted(repr(j) for j in jobs))
        if not jobs or key in seen:
            break
        seen.add(key)
        n_jobs += len(jobs)
        errors += runtime.precompile(jobs, load=rounds > 1)    # (the next round runs past them)
    res = {"requests": n_jobs, "errors": errors[:20], "s": round(time.monotonic() - t0, 1)}
    print(f"precompiled {n_jobs} kernel requests in {res['s']} s, {len(errors)} errors",
          flush=True)
    return res


def _recorded_jobs(rows, device) -> list:
    """The kernel requests of one linattn call per row (ops.runtime.recording)."""
    import torch
    from linattn.ops import runtime
    jobs = []
    for row in rows:
        try:
            x = build_inputs(row, device, 0)
            fn, _ = impl_mod.make("linattn", row, x)
        except Exception:        # not implemented / not applicable: the row reports it
            continue
        with runtime.recording() as req:
            try:
                fn()
            except Exception:    # KernelRequested (noted), or an error the row's run reports
                pass
        jobs += req
        del x
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return jobs


def warm_groups(rows) -> list[list]:
    """Rows grouped so that rows likely to share a Triton autotuning key (same op, dtype,
    options and per-token shapes) land in one group: a group is warmed by one process, in
    order, so two processes never compile the same kernels at once."""
    groups = {}
    for row in rows:
        flags = tuple(sorted((k, str(v)) for k, v in row.options.items()
                             if k not in ("seq_lens", "scale")))
        shapes = tuple(_per_token_shape(row, n) for n in ("q", "v"))
        sig = (row.op, row.dtype, row.is_decode, "seq_lens" in row.options, flags, shapes)
        groups.setdefault(sig, []).append(row)
    return list(groups.values())


def _per_token_shape(row, name):
    """A tensor's shape without its batch and token dims (heads, head dim)."""
    shape = row.shape(name) or ()
    if len(shape) == 4:   # [B, H, T, D] for the head-first DeltaNet contracts, else [B, T, H, D]
        return (shape[1], shape[3]) if row.op.startswith("DeltaNetChunk") else shape[2:]
    return shape[1:]      # one token per sequence: [B, H, D]


def _warm_worker(args):
    """One job of warm_rows: call each implementation once per row of the job (no
    reference, no timing), so its kernels are compiled into the shared on-disk caches.
    Returns (row key, seconds, error) per row."""
    rows, names, device, deadline = args
    import torch
    out = []
    for row in rows:
        if time.time() > deadline:
            break
        t0 = time.monotonic()
        err = None
        try:
            x = build_inputs(row, device, 0)
            for name in names:
                _warm_call(name, row, x, device)
            del x
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:200]
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        out.append((list(row.key), round(time.monotonic() - t0, 1), err))
    return out


def _warm_call(name, row, x, device) -> None:
    """One implementation's first call on a row (refusals are the timed run's to report)."""
    import torch
    try:
        fn, _ = impl_mod.make(name, row, x)
    except (impl_mod.NotApplicable, impl_mod.NotImplementedImpl):
        return
    try:
        fn()
    except impl_mod.NotImplementedImpl:
        pass
    finally:
        _close(fn, {})
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def warm_jobs(rows, impl_names) -> list:
    """The warm step's jobs, (rows, implementation names), in the order the timed run
    reaches their first row, so a warm step cut at its deadline has compiled the rows the
    run starts with: fla / torch.compile rows grouped by their autotuning key (warm_groups:
    one job a group, so two processes never compile the same configs at once), the child
    processes' implementations (the seed release compiles every shape anew, ~15 s a row)
    one row a job."""
    local = [n for n in impl_names if n != "linattn" and n not in impl_mod.REMOTE]
    remote = [n for n in impl_names if n in impl_mod.REMOTE]
    jobs = [(g, local) for g in warm_groups(rows)] if local else []
    jobs += [([r], remote) for r in rows] if remote else []
    order = {r.key: i for i, r in enumerate(rows)}
    return sorted(jobs, key=lambda j: order[j[0][0].key])


def warm_rows(rows, impl_names, processes: int, device="cuda", budget_s=None) -> dict:
    """Compile the kernels of other implementations (fla's Triton autotuning configs,
    torch.compile's graphs, the seed release's per-shape kernels) for all rows in
    `processes` parallel processes before the timed run: compiling is CPU work, and one
    process compiles one config at a time. Jobs are handed out as processes free up, in
    the timed run's order; the rows finished by the deadline (budget_s) are reported and
    the processes are then stopped, whatever they are compiling. The autotuning picks are
    made again in the timed run, on an idle GPU (Triton finds the configs in its cache)."""
    import multiprocessing as mp
    t0 = time.monotonic()
    jobs = warm_jobs(rows, impl_names)
    deadline = time.time() + (budget_s if budget_s else 1e9)
    keep = os.environ.get("TRITON_CACHE_AUTOTUNING")
    # the workers inherit it when spawned: picks made on a shared GPU are not kept
    os.environ["TRITON_CACHE_AUTOTUNING"] = "0"
    done, cut, n = [], False, max(1, min(processes, len(jobs)))
    try:
        with mp.get_context("spawn").Pool(n) as pool:
            it = pool.imap_unordered(_warm_worker, [(rs, names, device, deadline) for rs, names in jobs])
            try:
                for _ in jobs:
                    done += it.next(timeout=max(1.0, deadline - time.time()))
            except mp.TimeoutError:
                cut = True
                pool.terminate()
    finally:
        if keep is None:
            os.environ.pop("TRITON_CACHE_AUTOTUNING")
        else:
            os.environ["TRITON_CACHE_AUTOTUNING"] = keep
    errors = [d for d in done if d[2]]
    res = {"rows": len(done), "of": sum(len(rs) for rs, _ in jobs), "processes": n, "cut_at_deadline": cut,
           "s": round(time.monotonic() - t0, 1), "slowest": sorted(done, key=lambda d: -d[1])[:8],
           "errors": errors[:20]}
    print(f"warmed {[n for n in impl_names if n != 'linattn']}: {len(done)} of {res['of']} row jobs in "
          f"{res['s']} s with {n} processes{' (cut at the deadline)' if cut else ''}, "
          f"{len(errors)} errors", flush=True)
    return res


def progress(items, desc):
    """Yield the rows, printing before each one line: rows done / total, time elapsed, the
    row it starts (plain lines: a GPU run's log is a file, not a terminal)."""
    t0 = time.monotonic()
    for i, it in enumerate(items):
        print(f"{desc}: {i}/{len(items)} rows done, {time.monotonic() - t0:.0f} s elapsed; "
              f"next {it.op} {it.workload} {it.dtype}", flush=True)
        yield it
    print(f"{desc}: {len(items)}/{len(items)} rows done, {time.monotonic() - t0:.0f} s elapsed",
          flush=True)


def row_estimate(spent: dict, op: str) -> float:
    """What the next row of op should take (s), from the rows run so far: the lower median
    of the op's rows (of all rows while the op has fewer than two), since a first row
    carries its compiles and autotuning and is no estimate of the next."""
    import statistics
    xs = spent.get(op, [])
    if len(xs) < 2:
        xs = [t for ts in spent.values() for t in ts]
    return statistics.median_low(xs) if len(xs) >= 2 else 0.0


def run(rows, impl_names, out_path=None, device="cuda", time_it=True, timer_budget_ms=100.0,
        budget_s=None, verify_timer=False, min_left_s=20.0, warm_processes=0, run_id=None) -> dict:
    """Run rows; returns the results document (also written to out_path after every row)."""
    t0 = time.monotonic()
    doc = header(device, run_id)
    stamp = {k: doc[k] for k in ("run", "commit", "gpu")}
    doc["impls"] = list(impl_names)
    if verify_timer:
        from .timer import verify_timer as vt
        try:
            doc["timer_check"] = vt()
        except Exception as e:
            doc["timer_check"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print("timer check:", doc["timer_check"], flush=True)
        doc["copy_tbps"] = doc["timer_check"].get("copy_tbps")
    if warm_processes and set(impl_names) - {"linattn"}:
        doc["warm"] = warm_rows(rows, impl_names, warm_processes, device,
                                budget_s=budget_s / 2 if budget_s else None)
    if "linattn" in impl_names and device.startswith("cuda"):
        doc["precompile"] = precompile_rows(rows, device)
    doc["rows"] = []
    skipped, spent = [], {}
    for row in progress(rows, "bench"):
        left = budget_s - (time.monotonic() - t0) if budget_s else None
        if left is not None and left < max(min_left_s, 1.5 * row_estimate(spent, row.op)):
            skipped.append(list(row.key))
            continue
        t1 = time.monotonic()
        rec = report.summarize(run_row(row, impl_names, device, time_it, timer_budget_ms,
                                             stamp=stamp), row)
        spent.setdefault(row.op, []).append(time.monotonic() - t1)
        doc["rows"].append(rec)
        doc["skipped_for_budget"] = skipped
        if out_path:
            report.write_json(doc, out_path)
        if any(i.get("fatal") for i in rec["impls"].values()):
            doc["aborted"] = f"CUDA context broken at {row.key}; rerun the rest without this row"
            print(doc["aborted"], flush=True)
            break
    doc["skipped_for_budget"] = skipped
    doc["geomeans"] = report.geomeans(doc["rows"])
    doc["wall_s"] = time.monotonic() - t0
    if out_path:
        report.write_json(doc, out_path)
    return doc
