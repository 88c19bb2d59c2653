"""Device time as the seed's page took it: per call, the union of the call's GPU kernel
busy intervals (CUPTI activity records through torch.profiler), host overhead excluded,
L2 flushed before every call, median over calls after warm-up, iterations from a budget.

Every call is preceded by a flush kernel with a distinctive name (bitwise_not over a
buffer twice the L2 size); the kernels between two flushes belong to one call. Memcpy
and memset activities are left out unless count_copies (the seed did the same);
elementwise copy kernels (.contiguous(), .float()) are kernels and are counted.
"""
from __future__ import annotations

import statistics
import time

FLUSH_BYTES = 256 * 1024 * 1024      # > 2 x the H200's 60 MiB L2
MIN_ITERS, MAX_ITERS = 10, 200
_flush_buf = None


def union_length(intervals) -> float:
    """Total length covered by a set of (start, end) intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def split_calls(events, is_flush, is_counted):
    """events: (start, end, name) in any order -> per call, the list of counted intervals
    between one flush kernel and the next (events before the first flush are dropped)."""
    calls, cur = [], None
    for s, e, name in sorted(events):
        if is_flush(name):
            if cur is not None:
                calls.append(cur)
            cur = []
        elif cur is not None and is_counted(name):
            cur.append((s, e))
    if cur is not None:
        calls.append(cur)
    return calls


def _is_flush(name: str) -> bool:
    n = name.lower()
    return "bitwise_not" in n or "bitwisenot" in n


def _counted(count_copies):
    def f(name: str) -> bool:
        n = name.lower()
        return count_copies or not (n.startswith("memcpy") or n.startswith("memset"))
    return f


def flush_l2():
    import torch
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.zeros(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    try:
        torch.cuda.cudart().cudaCtxResetPersistingL2Cache()
    except Exception:
        pass
    torch.bitwise_not(_flush_buf, out=_flush_buf)


def _event_ms(fn, n=3):
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def device_time(fn, budget_ms: float = 100.0, warmup_ms: float = 25.0, count_copies=False,
                iters: int | None = None) -> dict:
    """Median device time of fn() in ms (and p10, p90, calls, kernels per call).

    Iterations: budget_ms / (wall time of one call, flush included), clamped to
    [10, 200], unless `iters` is given.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    per_call = max(_event_ms(lambda: (flush_l2(), fn())), 1e-3)
    n_warm = int(min(MAX_ITERS, max(3, warmup_ms / per_call)))
    n = iters or int(min(MAX_ITERS, max(MIN_ITERS, budget_ms / per_call)))
    for _ in range(n_warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    evs = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    calls = [c for c in split_calls(evs, _is_flush, _counted(count_copies))]
    times = sorted(union_length(c) / 1000.0 for c in calls if c)  # us -> ms
    if not times:
        raise RuntimeError("the profiler recorded no kernels for the timed call")
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))]  # noqa: E731
    return {"ms": statistics.median(times), "p10": q(0.1), "p90": q(0.9), "calls": len(times),
            "empty_calls": len(calls) - len(times),
            "kernels": max(len(c) for c in calls), "wall_ms_per_call": per_call}


#: HBM peak (TB/s) by a GPU name's marker; a device copy runs at 75-100 % of it
HBM_PEAK_TBPS = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100 NVL": 3.9, "H100 PCIe": 2.0}


def copy_plausible(gpu_name: str, tbps: float):
    """Whether a measured copy bandwidth fits the named GPU (None: a GPU not in the table)."""
    peak = next((v for k, v in HBM_PEAK_TBPS.items() if k in gpu_name), None)
    return None if peak is None else 0.75 * peak < tbps < peak


def verify_timer(copy_gib: float = 1.0) -> dict:
    """Checks on the GPU: (1) an elementwise device copy of copy_gib GiB (read + write
    counted) should run at 75-100 % of the GPU's HBM peak (4.27 TB/s on an H200, 3.05 on
    an H100 SXM); (2) a host sleep inside the timed fn must add nothing: two kernels with
    a 5 ms sleep between them time like the two alone."""
    import torch
    n = int(copy_gib * 2 ** 30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = device_time(lambda: torch.neg(src, out=dst), budget_ms=200)
    bw = 2 * src.numel() * 2 / (copy["ms"] * 1e-3) / 1e12
    x = torch.randn(4096, 4096, device="cuda")
    two = device_time(lambda: (x @ x, x @ x), iters=20)
    sleepy = device_time(lambda: (x @ x, time.sleep(0.005), x @ x), iters=20)
    extra = sleepy["ms"] - two["ms"]
    res = {"copy_ms": copy["ms"], "copy_tbps": bw,
           "copy_ok": copy_plausible(torch.cuda.get_device_name(), bw),
           "two_kernels_ms": two["ms"], "with_sleep_ms": sleepy["ms"],
           "sleep_adds_ms": extra, "sleep_ok": abs(extra) < 0.05 * two["ms"] + 0.002}
    res["ok"] = res["copy_ok"] is not False and res["sleep_ok"]
    return res
