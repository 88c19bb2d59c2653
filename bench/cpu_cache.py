"""Build the GPU tests' TileLang compile cache on a machine without a GPU, packed for the
device machine's .gpu/prelude.sh (which unpacks .gpu/cache.tar.xz.* into /tmp and points
TILELANG_CACHE_DIR at /tmp/gpu-cache/tilelang).

1. Here (no GPU; nvcc and tilelang 0.1.15 as on the GPU machine), from the tree the GPU
   call will run (the cache hits only kernels whose TVM script is unchanged)::

    PYTHONPATH=<dir holding linattn> python3 bench/cpu_cache.py -m gpu \
        tests/test_comba_gpu.py tests/test_gdn2_gpu.py tests/test_autograd_gpu.py:gdn

2. On the device call, carry the parts with the prelude's packages (.gpu/ is
   git-ignored: carry names each part) and source the prelude first::

    carry: .gpu/site.tar.xz .gpu/prelude.sh .gpu/cache.tar.xz.00 [...]
    source .gpu/prelude.sh && python3 -m pytest -q -m gpu tests/test_comba_gpu.py ...

TileLang's cache key is sha256 of the kernel's TVM script, out_idx, the target
({"kind": "cuda", "arch": "sm_90a"} with host "c": compile_target's without a GPU and on
an H100 / H200 alike), backend (tvm_ffi), pass configs, tilelang's version and the
machine type: nothing of the GPU's, nor of the python version (checked: 3.11 and 3.12
give the same keys). Each test module's ``precompile_jobs(items, device)`` (its module
fixture's jobs for the selected tests) runs with device "cpu" inside
tests/_cpu_plan.py's planning_on_cpu(): the dry calls plan for sm90 as on an H100 / H200.
The jobs are compiled with runtime.precompile (``--workers`` processes) into a fresh
``--cache`` dir (default /tmp/gpu-cache/tilelang: the GPU side's path), then
``tar | xz -9 -T2 | split -b 15M -d`` (the cache stored as gpu-cache/tilelang) writes
``--out``/cache.tar.xz.NN (old parts removed first). A file may carry its own -k
expression (``PATH:KEXPR``; else ``-k``); ``-m`` is the GPU run's marker expression;
``--rows GLOBS`` adds linattn-bench rows (their first kernels: a training row's backward
needs its forward run; the whole table, 385 rows, plans in ~15 min here: 217 kernels);
``--list`` prints the jobs per file and stops; over ``--budget`` MiB (default 14: the
carry's 64 MiB less the ~47 MiB the rest takes) it says so: rerun with fewer files.
Every cache file stays (the loader needs the sources too: kernel_cache.py's complete
entry is executable.so, params.json, manifest.json and both .cu files, size-checked).
About 17 KiB packed a kernel; 4 to 7 s a compile on a busy 2-core machine.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collect(files: list, kexpr: str | None, markexpr: str | None = None) -> dict:
    """{test file: its selected pytest items} (pytest's collection and the project's
    conftest deselection, nothing run). files: paths, each optionally ``PATH:KEXPR`` (its
    own -k expression, else ``kexpr``)."""
    import pytest

    class Grab:
        items: list = []

        def pytest_collection_finish(self, session):
            Grab.items = list(session.items)

    out = collections.OrderedDict()
    for arg in files:
        path, _, own = arg.partition(":")
        expr = own or kexpr
        args = [path, "--collect-only", "-q", "-p", "no:cacheprovider"]
        args += ["-k", expr] if expr else []
        args += ["-m", markexpr] if markexpr else []
        rc = pytest.main(args, plugins=[Grab()])
        if rc not in (0, 5):
            sys.exit(f"pytest collection of {arg} failed (rc {rc})")
        out[arg] = [it for it in Grab.items
                    if Path(it.module.__file__).resolve() == Path(path).resolve()]
    return out


def job_lists(by_file: dict) -> dict:
    """{test file: its module's precompile_jobs(items, device="cpu")}, planned on the CPU."""
    from _cpu_plan import planning_on_cpu
    out = {}
    with planning_on_cpu():
        for f, items in by_file.items():
            if not items:
                out[f] = []
                continue
            out[f] = items[0].module.precompile_jobs(items, device="cpu")
    return out


def row_jobs(globs: str, path: str | None) -> tuple:
    """(the benchmark rows matching ``globs`` (comma-separated, on op/workload/dtype) of the
    table at ``path`` (None: the shipped one), their linattn kernels' jobs): each row's
    call recorded on CPU inputs (cli/bench/run.py _recorded_jobs, planned as on an H100 /
    H200). The first kernels only: a training row's backward needs its forward run."""
    import fnmatch
    from _cpu_plan import planning_on_cpu
    from linattn.cli.bench.run import _recorded_jobs
    from linattn.cli.bench.workloads import load_rows
    rows = [r for r in load_rows(path) if any(
        fnmatch.fnmatch(f"{r.op}/{r.workload}/{r.dtype}", g) for g in globs.split(","))]
    with planning_on_cpu():
        return rows, _recorded_jobs(rows, "cpu")


def unique(jobs: list) -> list:
    from linattn.ops import runtime
    return list({runtime._key(*j[:3], j[3]): j for j in jobs}.values())


#: where .gpu/prelude.sh's TILELANG_CACHE_DIR is, relative to the /tmp it unpacks into
PACKED_AS = "gpu-cache/tilelang"


def pack(out: Path, cache: Path) -> list:
    """tar | xz -9 | split into out/cache.tar.xz.NN, the cache dir stored as PACKED_AS
    whatever its name here (a --cache elsewhere once packed as its own path, which the GPU
    side never read); returns [(part, bytes)]."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("cache.tar.xz.*"):
        old.unlink()
    cmd = (f"tar -C {cache} --transform 's,^\\.,{PACKED_AS},' -cf - . | xz -9 -T2 | "
           f"split -b 15M -d - {out}/cache.tar.xz.")
    subprocess.run(cmd, shell=True, check=True)
    return [(p, p.stat().st_size) for p in sorted(out.glob("cache.tar.xz.*"))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*",
                    help="GPU test files (tests/test_*_gpu.py), each PATH or PATH:KEXPR")
    ap.add_argument("--rows", default=None,
                    help="also linattn-bench rows: globs on op/workload/dtype ('*': all)")
    ap.add_argument("--workloads-json", default=None, help="--rows' table (default: shipped)")
    ap.add_argument("-k", dest="kexpr", default=None,
                    help="pytest -k expression for the files without their own")
    ap.add_argument("-m", dest="markexpr", default=None,
                    help="pytest -m expression (the GPU run's: gpu)")
    ap.add_argument("--list", action="store_true", help="print the jobs, compile nothing")
    ap.add_argument("--cache", default="/tmp/gpu-cache/tilelang",
                    help="TILELANG_CACHE_DIR to build (its parent is what is packed)")
    ap.add_argument("--keep", action="store_true",
                    help="build on the cache dir's current contents (default: fresh)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / ".gpu"))
    ap.add_argument("--budget", type=float, default=14.0,
                    help="MiB the packed parts may take: whole files dropped from the end")
    a = ap.parse_args(argv)

    cache = Path(a.cache)
    os.environ["TILELANG_CACHE_DIR"] = str(cache)     # (before tilelang is imported)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT / "tests"))
    by_file = collect(a.files, a.kexpr, a.markexpr)
    t0 = time.time()
    lists = job_lists(by_file)
    if a.rows:
        label = f"rows {a.rows}"
        by_file[label], lists[label] = row_jobs(a.rows, a.workloads_json)
    print(f"\njob lists planned on the CPU in {time.time() - t0:.1f} s")
    for f, jobs in lists.items():
        print(f"  {f}: {len(by_file[f])} tests / rows, {len(jobs)} jobs, "
              f"{len(unique(jobs))} unique")
        if a.list:
            for spec, stage, arch, params in unique(jobs):
                print(f"    {arch} {spec.name}/{stage} {sorted(params.items())}")
    if a.list:
        return 0

    from linattn.ops import runtime
    if not a.keep and cache.parent.exists():
        shutil.rmtree(cache.parent)
    cache.mkdir(parents=True, exist_ok=True)
    done, errors, per_file = set(), [], {}
    t0 = time.time()
    for f, jobs in lists.items():         # file by file (a failed file keeps the others)
        todo = [j for j in unique(jobs) if runtime._key(*j[:3], j[3]) not in done]
        t1 = time.time()
        errs = runtime.precompile(todo, workers=a.workers)
        per_file[f] = (len(todo), round(time.time() - t1), len(errs))
        print(f"compiled {f}: {len(todo)} new jobs in {time.time() - t1:.0f} s, "
              f"{len(errs)} failed", flush=True)
        errors += errs
        done |= {runtime._key(*j[:3], j[3]) for j in todo}
    secs = time.time() - t0
    kernels = sorted((cache).glob("*/*/kernels/*"))
    print(f"\n{len(done)} jobs compiled in {secs:.0f} s with {a.workers} workers; "
          f"{len(kernels)} cache entries; {len(errors)} failed")
    for e in errors:
        print("  failed:", e)
    parts = pack(Path(a.out), cache)
    total = sum(n for _, n in parts)
    print(f"packed {len(parts)} part(s), {total / 2**20:.2f} MiB "
          f"({total / max(1, len(kernels)) / 1024:.0f} KiB a kernel): "
          + ", ".join(f"{p.name} {n / 2**20:.2f} MiB" for p, n in parts))
    if total > a.budget * 2**20:
        print(f"over the {a.budget} MiB budget: rerun with fewer files (the ones first "
              f"listed are kept); per file (new jobs, s, failed): {per_file}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
