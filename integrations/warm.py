"""Compile the linattn kernels a model step needs before running it."""
from __future__ import annotations

import time


def precompile(*steps, rounds: int = 6, workers: int | None = None) -> dict:
    """Run each of ``steps`` (callables: a training step, a generate call) under
    ``ops.runtime.recording()`` until no kernel is missing, compiling what each round
    requests in parallel processes (ops.runtime.precompile, one pool for all rounds): a
    step stops at its first kernel not yet compiled, so a forward comes first, then the
    backward's stages. The steps' side effects (gradients, caches) happen only on the
    rounds that get through. Give the steps the shapes the model will run: a kernel's
    plan depends on them (sequences, chunks, heads), and a kernel not compiled here is
    compiled when first called, one at a time. Returns {"requests": kernels compiled,
    "rounds": rounds run, "errors": [...], "steps_s": [seconds running the steps, per
    round], "compile_s": [seconds compiling and loading its requests, per round]}."""
    from linattn.ops import runtime
    res = {"requests": 0, "rounds": 0, "errors": [], "steps_s": [], "compile_s": []}
    with runtime.compile_pool(workers) as pool:
        for _ in range(rounds):
            res["rounds"] += 1
            t0 = time.monotonic()
            jobs = []
            for step in steps:
                with runtime.recording() as req:
                    try:
                        step()
                    except runtime.KernelRequested:
                        pass
                jobs += req
            res["steps_s"].append(round(time.monotonic() - t0, 1))
            if not jobs:
                break
            t0 = time.monotonic()
            res["requests"] += len(jobs)
            res["errors"] += runtime.precompile(jobs, load=True, pool=pool)
            res["compile_s"].append(round(time.monotonic() - t0, 1))
    return res
