"""Per-arch packages: the compile target, the chunked forward's plans and the tuning
(tile sizes, threads) per stage.

Each arch package defines ``NAME``, ``TARGET`` (TileLang target dict; compile_target
adapts it to a device), ``CAPABILITIES``
(CUDA compute capabilities it serves, as (major, minor) prefixes), ``FEATURES`` (what it has beyond mma.sync / cp.async: "wgmma",
"tma", "setmaxnreg", "warpgroups"), a ``hardware`` module (SMs, grid and shared-memory
limits), ``forward_plan(problem, config)`` (a
codegen.pipeline.Plan) with the ``CONFIG_KEYS`` a config may set, and
``tuning(stage, problem) -> dict`` (tuning knobs for a stage's build(); ``{}`` means the
template's defaults).
"""
from __future__ import annotations

import importlib

from ...dsl import SpecError  # noqa: F401  (re-exported for callers)

#: the arches, the default first: where no device is known (CPU-side planning, the CLI,
#: rendering) the arch is DEFAULT_ARCH; a call on a GPU takes its device's
#: (arch_for_capability)
ARCHES = ("sm90", "sm80")
DEFAULT_ARCH = ARCHES[0]
_LOADED: dict = {}      # name -> module (a dict lookup once loaded: torch.compile traces it)


def get_arch(name: str):
    """The arch module for ``name`` ("sm90", "sm80"), with a clear error for unknown names."""
    if name not in ARCHES:
        raise SpecError(f"unknown arch {name!r}; valid arches: {', '.join(ARCHES)}")
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(f"{__name__}.{name}")
    return _LOADED[name]


def describe() -> str:
    """The arches as an error message names them: "Hopper, sm90; Ampere / Ada, sm80"."""
    return "; ".join(f"{get_arch(n).hardware.LABEL}, {n}" for n in ARCHES)


def arch_for_capability(major: int, minor: int) -> str:
    """The arch name serving a CUDA device of compute capability (major, minor)."""
    for name in ARCHES:
        if _serves(get_arch(name), major, minor):
            return name
    raise SpecError(f"no linattn kernels for compute capability {major}.{minor}; "
                    f"supported arches: {describe()} (capabilities 9.x, 8.x)")


def compile_target(name: str, capability: tuple | None = None) -> dict:
    """The TileLang target of arch ``name``'s kernels for a device of compute capability
    ``capability`` ((major, minor); None: no device, the arch's TARGET). Its own devices
    (CAPABILITIES) take TARGET. A later device takes TARGET's code (TileLang lowers for
    TARGET's arch: sm80's mma.sync, cp.async) compiled to its own SM, where the arch uses
    no FEATURES beyond mma.sync / cp.async: an sm_80 cubin does not load on a 9.x device
    (sm80's plans on an H100: ``-gencode arch=compute_80,code=sm_90``); sm90's wgmma and
    TMA are sm_90a's alone."""
    arch = get_arch(name)
    if capability is None or _serves(arch, *capability):
        return arch.TARGET
    major, minor = capability
    if arch.FEATURES or tuple(capability) < min(arch.CAPABILITIES):
        raise SpecError(f"{name}'s kernels do not run on compute capability {major}.{minor} "
                        f"(they serve {_capabilities(arch)}"
                        f"{', with ' + ', '.join(sorted(arch.FEATURES)) if arch.FEATURES else ''})")
    return {**arch.TARGET, "code": [f"sm_{major}{minor}"]}


def _serves(arch, major: int, minor: int) -> bool:
    return (major,) in arch.CAPABILITIES or (major, minor) in arch.CAPABILITIES


def _capabilities(arch) -> str:
    return " / ".join(".".join(map(str, c)) + (".x" if len(c) == 1 else "")
                      for c in arch.CAPABILITIES)
