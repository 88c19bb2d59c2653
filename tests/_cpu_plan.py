"""GPU tests' compile jobs listed on a machine without a GPU (bench/cpu_cache.py).

Each GPU test module that precompiles has ``precompile_jobs(items, device="cuda")``: the
(spec, stage, arch, params) jobs its module fixture hands runtime.precompile for the
selected tests ``items``, recorded from dry calls (runtime.recording()) on ``device``'s
tensors or computed from the plans. With ``device="cpu"`` inside :func:`planning_on_cpu`
the dry calls take CPU tensors: the device checks are switched off (as the CPU tests do:
tests/_cpu_ops.py, test_chunk.py's ``_check_device`` patches) and a CPU tensor's call
plans for codegen.arch.DEFAULT_ARCH (runtime.arch_of), sm90, the arch an H100 / H200
plans for. The plans read the arch's static hardware facts (codegen/arch/sm90/hardware.py:
NUM_SMS = 132, an H100 SXM's and an H200's), never the device, so the jobs equal the
GPU's; recording() stops every call before a kernel runs.
"""
import contextlib

import pytest


@contextlib.contextmanager
def planning_on_cpu():
    """Dry calls on CPU tensors plan as on an H100 / H200 (the device checks off)."""
    from linattn.ops import additive_bwd, chunk, chunk_bwd, runtime, validate
    from linattn.codegen.arch import DEFAULT_ARCH
    assert runtime.arch_of("cpu") == DEFAULT_ARCH == "sm90", DEFAULT_ARCH
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validate, "check_cuda", lambda name, x: None)
        mp.setattr(validate, "check_devices", lambda q, **tensors: None)
        for mod in (chunk, chunk_bwd, additive_bwd):
            mp.setattr(mod, "_check_device", lambda name, t: None)
        yield


def module_items(request) -> list:
    """The session's selected test items of the requesting module (a module fixture's)."""
    return [it for it in request.session.items
            if getattr(it, "module", None) is request.module]


def dry_jobs(calls) -> list:
    """The compile jobs of public calls run dry under runtime.recording(): ``calls`` are
    (fn name, args, kwargs) of linattn's functions; a call that fails other than by
    requesting a kernel is printed (its test reports it too)."""
    import linattn
    from linattn.ops import runtime
    with runtime.recording() as jobs:
        for fn, args, kw in calls:
            try:
                getattr(linattn, fn)(*args, **kw)
            except runtime.KernelRequested:
                pass
            except Exception as e:   # noqa: BLE001
                print(f"dry call {fn} failed: {type(e).__name__}: {e}"[:300])
    return list(jobs)
