"""The placement model every arch's cost rules share: CTAs of one kernel, one per SM,
each starting as an SM frees up (an arch's hardware.makespan binds its SM count)."""
from __future__ import annotations

import functools
import heapq


@functools.lru_cache(maxsize=1024)
def makespan(durations: tuple, sms: int) -> float:
    """Finish time of CTAs (durations, in launch order) placed one per SM as SMs free up."""
    free = [0.0] * sms
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        heapq.heappush(free, t)
        end = max(end, t)
    return end
