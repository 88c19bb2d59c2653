"""Load generated stages, compile them with TileLang on first use, memoise the kernels.

    arch = device_arch(q.device)                       # its compute capability's
    kernel = get_kernel(spec, "recurrent", arch, H=4, HV=8, K=128, ...)
    kernel(*tensors)

* Modules come from ``linattn.generated.<arch>.<op>`` when the spec is one of the
  registered op families (and its SPEC_HASH must match: a stale tree is an error that
  says to run ``linattn-gen``); any other spec (the six rule x gate combinations of the
  tests, a user's new variant) is rendered on the fly into a per-user folder
  (``$LINATTN_GEN_DIR`` or ``~/.cache/linattn/generated``), one file a rendering named
  by its text's hash: a file never changes once written (TileLang reads the source when
  it builds), whatever other processes or linattn versions share the folder.
* Compiles go through ``tilelang.compile`` with the arch's target for the device at hand
  (:func:`compile_target`), so TileLang's on-disk cache applies (``TILELANG_CACHE_DIR``
  honoured by TileLang); in-process, kernels are memoised per (arch, spec hash, stage,
  parameters).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import threading
from pathlib import Path
from typing import NamedTuple

from ..codegen import arch as arches
from ..codegen.arch import DEFAULT_ARCH, arch_for_capability, describe, get_arch
from ..dsl import OpSpec, SpecError

_KERNELS: dict = {}
_MODULES: dict = {}
_PLACEHOLDERS: dict = {}
_ARCH_BY_DEVICE: dict = {}
_DEVICES: dict = {}
_LOCK = threading.Lock()


class StaleGeneratedError(RuntimeError):
    """generated/ does not match the spec: regenerate with linattn-gen."""


def device_error(name: str, device, q_device=None) -> SpecError:
    """The one wording of the device error (ops/validate.py raises it too)."""
    where = f" (q is on {q_device})" if q_device is not None else ""
    return SpecError(f"{name} is on {device}{where}; linattn runs on one CUDA device "
                     f"({describe()}): put every input on it")


class DeviceFacts(NamedTuple):
    """What the runtime reads of a CUDA device: its name, compute capability (major,
    minor) and the shared memory a CTA may opt in to (bytes)."""
    name: str
    capability: tuple
    smem_per_block: int


def device_facts(index: int) -> DeviceFacts:
    """The facts of CUDA device ``index``, read once (a test may set its entry of
    _DEVICES to fake a device)."""
    if index not in _DEVICES:
        import torch
        p = torch.cuda.get_device_properties(index)
        _DEVICES[index] = DeviceFacts(p.name, (p.major, p.minor),
                                      p.shared_memory_per_block_optin)
    return _DEVICES[index]


def _index(device) -> int:
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        raise device_error("q", device)
    return device.index if device.index is not None else torch.cuda.current_device()


def device_arch(device) -> str:
    """Arch name for a CUDA device (codegen.arch.arch_for_capability, once per device);
    clear error otherwise. A test may force a device's arch by setting its entry of
    _ARCH_BY_DEVICE (tests/conftest.py force_arch)."""
    index = _index(device)
    if index not in _ARCH_BY_DEVICE:
        _ARCH_BY_DEVICE[index] = arch_for_capability(*device_facts(index).capability)
    return _ARCH_BY_DEVICE[index]


def compile_target(arch: str) -> dict:
    """The TileLang target ``arch``'s kernels compile for in this process: for its current
    CUDA device (codegen.arch.compile_target: sm80's plans on an H100, as tests force them,
    compile for sm_90), the arch's own TARGET where there is no GPU (compiling ahead)."""
    import torch
    if not torch.cuda.is_available():
        return arches.compile_target(arch)
    return arches.compile_target(arch, device_facts(torch.cuda.current_device()).capability)


def check_training(device, rule: str, gate: str, what: str) -> None:
    """Refuse a training call of a (rule, gate) spec (``what``: "the KDA backward") on a
    device that gives a CTA less shared memory than its arch's backward kernels take
    (hardware.BACKWARD_SMEM_BYTES: sm80's delta rule on an 8.6 / 8.9 card, 99 KB), before
    any kernel runs; CPU tensors pass."""
    if not str(device).startswith("cuda"):
        return
    facts, hw = device_facts(_index(device)), get_arch(device_arch(device)).hardware
    need = hw.BACKWARD_SMEM_BYTES.get((rule, gate), hw.SMEM_BYTES)
    if facts.smem_per_block < need:
        raise SpecError(
            f"{what} does not run on {facts.name} (compute capability "
            f"{'.'.join(map(str, facts.capability))}, {facts.smem_per_block / 1024:g} KB of "
            f"shared memory a block): {hw.NAME}'s backward kernels for it take "
            f"{need / 1024:.1f} KB; inference runs there")


def arch_of(device) -> str:
    """The arch a call plans for: its CUDA device's (device_arch), else (CPU-side planning)
    codegen.arch.DEFAULT_ARCH."""
    return device_arch(device) if str(device).startswith("cuda") else DEFAULT_ARCH


def gen_dir() -> Path:
    """Where specs outside the registry are rendered (per user, created on demand)."""
    root = os.environ.get("LINATTN_GEN_DIR")
    return Path(root) if root else Path.home() / ".cache" / "linattn" / "generated"


def stage_module(spec: OpSpec, stage: str, arch: str):
    """The generated module for (spec, stage, arch), imported once per process."""
    key = (arch, spec.hash, spec.name, stage)
    with _LOCK:
        if key in _MODULES:
            return _MODULES[key]
    from .registry import is_registered
    if is_registered(spec):
        name = f"linattn.generated.{arch}.{spec.name}.{stage}"
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            raise StaleGeneratedError(f"{name} is missing: run `linattn-gen --op {spec.name} "
                                      f"--arch {arch}`") from e
        if mod.SPEC_HASH != spec.hash or not _matches_rendering(mod, spec, stage, arch):
            raise StaleGeneratedError(
                f"{name} is stale (generated for spec hash {mod.SPEC_HASH}, spec "
                f"{spec.hash}, or its template changed since): run "
                f"`linattn-gen --op {spec.name} --arch {arch}`")
    else:
        mod = _render_and_load(spec, stage, arch)
    with _LOCK:
        _MODULES[key] = mod
    return mod


def _matches_rendering(mod, spec: OpSpec, stage_name: str, arch: str) -> bool:
    """Whether a checked-in module's text is what the templates render now."""
    from pathlib import Path
    from ..codegen.plan import plan
    from ..codegen.render import render_stage
    stages = {s.name: s for s in plan(spec, None, arch)}
    return (stage_name in stages and
            Path(mod.__file__).read_text() == render_stage(spec, stages[stage_name], arch))


def _render_and_load(spec: OpSpec, stage_name: str, arch: str):
    from ..codegen.compile import load_module
    from ..codegen.plan import plan
    from ..codegen.render import render_stage, write
    stages = {s.name: s for s in plan(spec, None, arch)}
    if stage_name not in stages:
        raise SpecError(f"{spec.name} has no stage {stage_name!r}; it has {sorted(stages)}")
    text = render_stage(spec, stages[stage_name], arch, shipped=False)
    # named by its text: TileLang reads a kernel's source from the file when it builds, so
    # the file must never change under a process that loaded it (two linattn versions, or
    # a template edit, sharing the folder)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    rel = f"{arch}/{spec.name}_{spec.hash}/{stage_name}_{digest}.py"
    write({rel: text}, gen_dir())
    return load_module(gen_dir() / rel, f"linattn_rendered_{spec.name}_{spec.hash}_{stage_name}")


def get_kernel(spec: OpSpec, stage: str, arch: str, sizes: dict | None = None, **problem):
    """Compiled TileLang kernel for a stage at one static problem (memoised).

    problem: the build() keywords that describe the problem (sizes, dtypes, flags);
    the arch table adds the tuning (given the call's dynamic ``sizes``, e.g. {"N": 4},
    for stages whose tiles depend on them). Returns (kernel, module, params).
    """
    tuning = get_arch(arch).tuning(stage, problem, sizes)
    params = {**tuning, **problem}
    return compile_stage(spec, stage, arch, params), stage_module(spec, stage, arch), params


def compile_stage(spec: OpSpec, stage: str, arch: str, params: dict, target=None):
    """The compiled kernel of ``stage`` for ``spec`` at exactly ``params`` (all build()
    keywords, tuning included), memoised per process; TileLang's disk cache makes a
    repeat across processes cheap. Every kernel of linattn is compiled here. target: the
    TileLang target (None: :func:`compile_target`'s, this process's device's)."""
    return _compiled(spec, stage, arch, params, target)[0]


def _compiled(spec: OpSpec, stage: str, arch: str, params: dict, target=None):
    """(kernel, its argument names in order), memoised (per arch: one target an arch in
    a process)."""
    key = _key(spec, stage, arch, params)
    hit = _KERNELS.get(key)
    if hit is not None:
        return hit
    if _RECORDING is not None:              # see recording(): note the request, compile nothing
        _RECORDING.append((spec, stage, arch, dict(params)))
        raise KernelRequested(f"{spec.name}/{stage}")
    import tilelang
    module = stage_module(spec, stage, arch)
    func = module.build(**params)
    kernel = tilelang.compile(func, out_idx=module.out_idx(**params),
                              target=target or compile_target(arch),
                              pass_configs=module.pass_configs(**params) or None)
    entry = (kernel, arg_names(func))
    with _LOCK:
        _KERNELS[key] = entry
    return entry


@contextlib.contextmanager
def overriding(table: dict, values: dict):
    """Within the block, ``table`` (a module's probe defaults: calls that pass no tuning of
    their own read it) holds ``values``; restored after. A probe's knob, not thread-safe."""
    prev = dict(table)
    table.clear()
    table.update(values)
    try:
        yield
    finally:
        table.clear()
        table.update(prev)


def arg_names(func) -> tuple:
    """A prim_func's argument names in order (buffers by their buffer name)."""
    return tuple(func.buffer_map[p].name if p in func.buffer_map else p.name
                 for p in func.params)


def launch_kernel(spec: OpSpec, arch: str, stage: str, params: dict, tensors: dict,
                  bind=lambda name: name) -> None:
    """Run ``stage`` at ``params`` with each kernel argument taken from ``tensors`` by name
    (``bind(arg)`` names the tensor an argument reads)."""
    kernel, names = _compiled(spec, stage, arch, params)
    missing = [n for n in names if bind(n) not in tensors]
    if missing:
        raise KeyError(f"{spec.name}/{stage}: no tensor for argument(s) "
                       f"{[(n, bind(n)) for n in missing]}")
    kernel(*[tensors[bind(n)] for n in names])


def run_plan(spec: OpSpec, plan, tensors: dict) -> dict:
    """Run a codegen.pipeline.Plan: allocate its buffers (dtype "input" = q's; each just
    before its stage ``at``, an output only where the caller bound none) next to the
    call's ``tensors`` (inputs, outputs, tables, by name), launch its stages in order,
    dropping what each launch releases. Returns the tensors, buffers included."""
    import torch
    q = tensors["q"]
    announce(spec, plan.arch, {la.stage: la.kwargs for la in plan.launches})

    def allocate(at: str):
        for b in plan.buffers:
            if b.at == at and not (b.output and b.name in tensors):
                dt = q.dtype if b.dtype == "input" else getattr(torch, b.dtype)
                tensors[b.name] = torch.empty(b.shape, dtype=dt, device=q.device)
    allocate("")
    for la in plan.launches:
        allocate(la.stage)
        launch_kernel(spec, plan.arch, la.stage, la.kwargs, tensors, la.tensor)
        for name in la.release:
            tensors.pop(name, None)
    return tensors


def _key(spec: OpSpec, stage: str, arch: str, params: dict) -> tuple:
    return (arch, spec.hash, spec.name, stage, tuple(sorted(params.items())))


def announce(spec: OpSpec, arch: str, stages: dict) -> None:
    """A multi-stage call names all its kernels ({stage: params}) before compiling any:
    inside recording() every one not yet compiled is noted at once (then KernelRequested
    stops the call); otherwise this does nothing."""
    if _RECORDING is None:
        return
    todo = [(spec, st, arch, dict(p)) for st, p in stages.items()
            if _key(spec, st, arch, p) not in _KERNELS]
    if todo:
        _RECORDING.extend(todo)
        raise KernelRequested(f"{spec.name}/{', '.join(t[1] for t in todo)}")


class KernelRequested(Exception):
    """Raised inside recording() where a kernel would be compiled: the request was noted."""


_RECORDING: list | None = None


@contextlib.contextmanager
def recording():
    """Collect the kernels some calls would compile, without compiling or running them::

        with runtime.recording() as jobs:
            try: fn()
            except runtime.KernelRequested: pass
        runtime.precompile(jobs)              # in parallel processes, then fn() is a cache hit

    Yields a list of (spec, stage, arch, params) jobs (params: every build() keyword, the
    arch's tuning included). A call stops at its first kernel not yet compiled, so calls
    that run several kernels announce() them all first. Not thread safe.
    """
    global _RECORDING
    _RECORDING, prev = [], _RECORDING
    try:
        yield _RECORDING
    finally:
        _RECORDING = prev


def _compile_job(job, target=None):
    import time
    spec, stage, arch, params = job
    t0 = time.time()
    try:
        compile_stage(spec, stage, arch, params, target)
        return None, time.time() - t0
    except Exception as e:  # reported, never raised: the caller decides
        return f"{spec.name}/{stage} {params}: {type(e).__name__}: {e}"[:500], time.time() - t0


def precompile(jobs, workers: int | None = None, load: bool = False, pool=None) -> list:
    """Compile (spec, stage, arch, params) jobs (recording()'s) in parallel processes so
    TileLang's disk cache holds them; later compiles of the same params in this process
    are cache hits. Duplicates are compiled once. load: also load each compiled one into
    this process (disk cache hits), so a later recording() runs past them (a training
    step's forward, then its backward). pool: a :func:`compile_pool` to reuse (rounds of
    requests: its processes start once); else one of ``workers`` for these jobs. Returns
    the error strings (empty when every job compiled). The one parallel compile of
    linattn: every precompile uses it."""
    todo = list({_key(*j[:3], j[3]): j for j in jobs}.values())
    if not todo:
        return []
    if pool is None:
        with compile_pool(workers or min(len(todo), os.cpu_count() or 2)) as own:
            return precompile(todo, load=load, pool=own)
    targets = [compile_target(j[2]) for j in todo]      # (this process's device's)
    errors = [err for err, _ in pool.map(_compile_job, todo, targets) if err]
    if load:
        errors += [err for err in (_compile_job(j)[0] for j in todo) if err]
    return errors


def compile_pool(workers: int | None = None):
    """The processes :func:`precompile` compiles in (spawned: a fresh interpreter each, no
    CUDA context inherited), ``workers`` of them (default: the CPUs); a context manager."""
    import concurrent.futures as cf
    import multiprocessing as mp
    return cf.ProcessPoolExecutor(max(1, workers or os.cpu_count() or 2),
                                  mp_context=mp.get_context("spawn"))


def placeholder(device, dtype):
    """A one-element tensor standing in for an argument a call does not use."""
    import torch
    key = (str(device), dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = torch.zeros(1, device=device, dtype=dtype)
        _PLACEHOLDERS[key] = t
    return t


def zeros(device, n: int):
    """A cached f32 tensor of n zeros (a missing dt_bias); never written."""
    import torch
    key = (str(device), "zeros", n)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = torch.zeros(n, device=device, dtype=torch.float32)
        _PLACEHOLDERS[key] = t
    return t


def dtype_name(dtype) -> str:
    """torch dtype -> TileLang dtype string ("bfloat16", "float16", "float32", ...)."""
    return str(dtype).replace("torch.", "")


def clear_caches() -> None:
    """Forget memoised modules and kernels (tests)."""
    with _LOCK:
        _KERNELS.clear()
        _MODULES.clear()
