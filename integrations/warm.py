"""Compile the linattn kernels a model step needs before running it."""
from __future__ import annotations


def precompile(*steps, rounds: int = 6, workers: int | None = None) -> dict:
    """Run each of ``steps`` (callables: a training step, a generate call) under
    ``ops.runtime.recording()`` until no kernel is missing, compiling what each round
    requests in parallel processes (ops.runtime.precompile): a step stops at its first
    kernel not yet compiled, so a forward comes first, then the backward's stages. The
    steps' side effects (gradients, caches) happen only on the rounds that get through.
    Returns {"requests": kernels compiled, "rounds": rounds run, "errors": [...]}."""
    from linattn.ops import runtime
    n, errors = 0, []
    for i in range(rounds):
        jobs = []
        for step in steps:
            with runtime.recording() as req:
                try:
                    step()
                except runtime.KernelRequested:
                    pass
            jobs += req
        if not jobs:
            return {"requests": n, "rounds": i + 1, "errors": errors}
        n += len(jobs)
        errors += runtime.precompile(jobs, workers=workers, load=True)
    return {"requests": n, "rounds": rounds, "errors": errors}
