"""Compile generated stages ahead of time and report their resources.

``compile_stage`` lowers and compiles one (module, params) with TileLang for the arch's
target (no GPU needed: nvcc on the PATH is enough) and reads registers, shared memory
and spills from ptxas. ``compile_tree`` does every stage of some ops for each of the
module's ``EXAMPLES`` (``linattn-gen --compile``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import subprocess
import tempfile
import time
from pathlib import Path

from .arch import DEFAULT_ARCH, get_arch
from .plan import plan

_PTXAS = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?", re.S)


def load_module(path: Path | str, name: str | None = None):
    """Import a generated module from a file (TileLang needs the source on disk)."""
    path = Path(path)
    name = name or f"linattn_gen_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def full_params(module, problem: dict, arch: str) -> dict:
    """Problem params plus the arch table's tuning for this stage."""
    return {**get_arch(arch).tuning(module.STAGE, problem), **problem}


def named_barrier_mismatch(src: str) -> list:
    """Named barrier ids a kernel's CUDA syncs on with more than one thread count (two
    groups on one id: a template's fixed id that TileLang also allocated; it hangs or
    races)."""
    counts = {}
    for i, n in re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", src):
        counts.setdefault(int(i), set()).add(int(n))
    return sorted(i for i, c in counts.items() if len(c) > 1)


def barriers_in_branches(src: str) -> list:
    """Lines of a kernel's CUDA source where __syncthreads() sits inside an `if` whose
    condition reads threadIdx: a CTA barrier only some threads reach hangs the CTA (TileLang
    placed one after a fragment-row condition in run s8-1)."""
    stack, found = [], []
    for n, line in enumerate(src.split("\n"), 1):
        s = line.strip()
        if "__syncthreads()" in s and any(stack):
            found.append(n)
        popped = False
        for _ in range(s.count("}")):
            if stack:
                popped = stack.pop()
        # a branch on threadIdx, or the else of one
        branch = bool(re.match(r"(\} )?(else )?if \(.*threadIdx", s)) or \
            (popped and s.startswith("} else {"))
        for i in range(s.count("{")):
            stack.append(branch and i == 0)
    return found


#: a bulk tensor copy (TMA) needs its shared-memory destination 128-byte aligned
TMA_SMEM_ALIGN = 128
_ELEM_BYTES = {"float": 4, "half_t": 2, "bfloat16_t": 2, "half": 2, "__nv_bfloat16": 2,
               "int": 4, "uint": 4, "signed char": 1, "char": 1, "uchar": 1, "double": 8}


def tma_misaligned(src: str, values=range(8)) -> list:
    """CUDA lines where a TMA load's shared destination is not 128-byte aligned for some
    value (0..7) of the loop variables in its offset (the s9-1 fault: pipeline stages of
    8 floats). Reads TileLang's `buf = buf_dyn_shmem + B` bases and `tma_load(desc, bar,
    &((T*)buf)[offset], ...)` destinations; an offset it cannot evaluate is reported."""
    import itertools
    bases = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src)}
    found = []
    for n, line in enumerate(src.split("\n"), 1):
        m = re.search(r"tl::tma_load\([^,]+, [^,]+, \(&\(\(\(([\w ]+)\*\)(\w+)\)\[(.*?)\]\)\)", line)
        if not m or m.group(2) not in bases:
            continue
        size, base = _ELEM_BYTES.get(m.group(1).strip()), bases[m.group(2)]
        expr = re.sub(r"\((int|int64_t|uint)\)", "", m.group(3)).replace("/", "//")
        names = sorted(set(re.findall(r"[A-Za-z_][\w.]*", expr)))
        expr = re.sub(r"[A-Za-z_][\w.]*", lambda v: f"_v{names.index(v.group(0))}", expr)
        try:
            offsets = {eval(expr, {"__builtins__": {}},  # noqa: S307 (arithmetic only)
                            {f"_v{i}": x for i, x in enumerate(vals)})
                       for vals in itertools.product(values, repeat=len(names))}
        except Exception:
            found.append(n)
            continue
        if size is None or any((base + o * size) % TMA_SMEM_ALIGN for o in offsets):
            found.append(n)
    return found


def ptxas_usage(src: str, arch: str = DEFAULT_ARCH, sm: str | None = None) -> dict:
    """Registers, static shared memory and spill bytes of a kernel's CUDA source (nvcc
    -cubin with TileLang's default options, ptxas -v);
    sm: the ptxas target (default the arch's TARGET; an arch's code serving several,
    hardware.COMPILE_TARGETS, is checked for each)."""
    from tilelang.contrib import nvcc as tl_nvcc
    sm = sm or get_arch(arch).TARGET["arch"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cu"
        path.write_text(src)
        cmd = [tl_nvcc.get_nvcc_compiler(), "-cubin", "-O3", f"-arch={sm}", "-Xptxas", "-v",
               *tl_nvcc.default_compile_options(None), "-o",
               str(Path(tmp) / "kernel.cubin"), str(path)]
        out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        return {"ptxas_error": text[-2000:]}
    usage = {}
    m = re.search(r"Used (\d+) registers", text)
    usage["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes smem", text)
    usage["static_smem_bytes"] = int(m.group(1)) if m else 0
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    usage["spill_store_bytes"] = int(m.group(1)) if m else 0
    usage["spill_load_bytes"] = int(m.group(2)) if m else 0
    # ptxas's "Potential Performance Loss" notes (e.g. wgmma serialized for a reason it names)
    usage["perf_loss"] = re.findall(r"Potential Performance Loss: ([^\n]*)", text)
    usage["barriers_in_branches"] = barriers_in_branches(src)
    usage["named_barrier_mismatch"] = named_barrier_mismatch(src)
    usage["tma_misaligned"] = tma_misaligned(src)
    usage["dynamic_smem"] = "extern __shared__" in src     # (buf_dyn_shmem, or a lone buffer)
    usage["dynamic_smem_bytes"] = 0
    m = re.search(r"__launch_bounds__\((\d+)", src)
    usage["threads"] = int(m.group(1)) if m else None
    return usage


def compile_stage(module, problem: dict, arch: str = DEFAULT_ARCH, sms: tuple = ()) -> dict:
    """Compile one configuration; a dict with timing, resources or the error. sms: more
    ptxas targets for the same CUDA source (their resources under rec["by_sm"]).

    Lowers once (TileLang to CUDA, host code included) and compiles the device code with
    nvcc -cubin under ptxas -v: the same device compile tilelang.compile runs, without its
    host library (generic, exercised by every GPU test) and without a second lowering for
    the shared-memory size."""
    params = full_params(module, problem, arch)
    rec = {"op_key": module.SPEC_KEY, "spec_hash": module.SPEC_HASH, "stage": module.STAGE,
           "arch": arch, "params": params}
    t0 = time.time()
    try:
        art = lower_stage(module, params, arch)
    except Exception as e:  # report and go on: one bad config must not hide the rest
        rec["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
        return rec
    own = ptxas_usage(art.kernel_source, arch)
    rec.update(own)
    if rec.get("dynamic_smem"):
        rec["dynamic_smem_bytes"] = dynamic_smem_bytes(art)
    if sms:
        first = get_arch(arch).TARGET["arch"]
        rec["by_sm"] = {sm: own if sm == first else ptxas_usage(art.kernel_source, arch, sm)
                        for sm in sms}
    rec["compile_s"] = round(time.time() - t0, 2)
    return rec


def lower_stage(module, params: dict, arch: str = DEFAULT_ARCH):
    """TileLang's lowering of module.build(**params) for the arch's target, under the
    module's pass configs: its CompiledArtifact (kernel_source, device_mod, host_mod)."""
    import tilelang
    from tilelang import tvm
    target = tvm.target.Target(get_arch(arch).TARGET)
    with target, tvm.transform.PassContext(config=module.pass_configs(**params) or {}):
        return tilelang.lower(module.build(**params), target=target, enable_host_codegen=True)


def dynamic_smem_bytes(art) -> int:
    """Dynamic shared memory of a lowered stage's kernel (its device module's attribute)."""
    sizes = [int(fn.attrs["dyn_shared_memory_buf"]) for _, fn in art.device_mod.functions.items()
             if fn.attrs is not None and "dyn_shared_memory_buf" in fn.attrs]
    return max(sizes) if sizes else 0


def compile_tree(specs, arch: str, variant: str | None, out_dir: Path, echo=print) -> list[dict]:
    """Compile every stage of ``specs`` under ``out_dir`` for each module's EXAMPLES."""
    results = []
    with quiet_tilelang():
        for spec in specs:
            for stage in plan(spec, variant, arch):
                path = Path(out_dir) / arch / spec.name / f"{stage.name}.py"
                module = load_module(path)
                for problem in module.EXAMPLES:
                    rec = compile_stage(module, problem, arch)
                    rec["op"] = spec.name
                    results.append(rec)
                    echo(format_record(rec))
    return results


@contextlib.contextmanager
def quiet_tilelang(level=logging.WARNING):
    """TileLang's logger (INFO since its import: two lines a compile) at ``level`` for a
    while, so that a report's lines are not interleaved with its chatter."""
    import tilelang  # noqa: F401  (its import sets its logger's level; set ours after it)
    logger = logging.getLogger("tilelang")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def format_record(rec: dict) -> str:
    p = rec["params"]
    flags = ",".join(k for k, v in sorted(p.items()) if v is True) or "plain"
    head = (f"{rec.get('op', rec['op_key']):9s} {rec['stage']:14s} K={p.get('K')} V={p.get('V')} "
            f"{p.get('dtype', '')} [{flags}]")
    if "error" in rec:
        return f"{head}  ERROR {rec['error'].splitlines()[-1] if rec['error'] else ''}"
    return (f"{head}  {rec['compile_s']:.1f}s regs={rec.get('registers')} "
            f"smem={rec.get('static_smem_bytes')}+{rec.get('dynamic_smem_bytes', 0)}dyn "
            f"spills={rec.get('spill_store_bytes', 0)}/{rec.get('spill_load_bytes', 0)}"
            + "".join(f"  PERF LOSS: {n}" for n in rec.get("perf_loss", ())))
