"""The op families shipped with linattn, by command-line name, and specs of your own.

Each family module in ops/ defines ``SPEC`` (its :class:`~linattn.dsl.OpSpec`) and its
fla-named functions; ``FAMILY_MODULES`` lists them, and their kernels are checked in under
generated/ (``linattn-gen --op NAME``).

A new variant needs no edit of the package: write an ``OpSpec`` in a file or module of
your own and

* call it: ``ops = linattn.build(spec)`` (ops/build.py) gives its ``chunk`` and
  ``fused_recurrent`` functions; its kernels are rendered on first use into
  ``ops.runtime.gen_dir()`` and compiled there;
* generate, check, list or compile it: ``linattn-gen --spec FILE.py:NAME`` (or
  ``module:NAME``; :func:`load_spec` resolves the reference), into ``gen_dir()`` unless
  ``--out`` says otherwise.

Listing a family here is for variants the package ships (checked-in kernels, fla-named
wrappers, benchmark contracts).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from ..dsl import OpSpec, SpecError

FAMILY_MODULES = ("deltanet", "gdn", "kda", "gla", "simple_gla", "linear_attn", "retention",
                  "mamba2", "lightning", "comba", "gdn2", "dplr", "iplr")


def specs() -> dict[str, OpSpec]:
    out = {}
    for mod in FAMILY_MODULES:
        spec = importlib.import_module(f"linattn.ops.{mod}").SPEC
        out[spec.name] = spec
    return out


def get_spec(name: str) -> OpSpec:
    table = specs()
    if name not in table:
        raise SpecError(f"unknown op {name!r}; valid ops: {', '.join(sorted(table))}")
    return table[name]


def is_registered(spec: OpSpec) -> bool:
    """Whether ``spec`` is one of the package's families (same name and content hash)."""
    known = specs().get(spec.name)
    return known is not None and known.hash == spec.hash


def load_spec(ref: str) -> OpSpec:
    """The OpSpec named by ``ref``: ``path/to/file.py:NAME`` or ``package.module:NAME``.

    A file is run as a module (its folder on sys.path meanwhile, as for a script); a
    module is imported with the current folder on sys.path (as ``python -m`` would).
    Raises SpecError with one line saying what is wrong: the form of ``ref``, a missing
    file or module, a file that fails to load (an invalid spec raises there), a missing
    name (listing the file's OpSpecs), or a name that is not an OpSpec.
    """
    where, sep, name = str(ref).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise SpecError(f"give FILE.py:NAME or module:NAME, got {ref!r}")
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    module = _load_file(where) if is_file else _import(where)
    if not hasattr(module, name):
        found = sorted(n for n, x in vars(module).items() if isinstance(x, OpSpec))
        raise SpecError(f"{where} has no {name!r}; its OpSpecs: {', '.join(found) or 'none'}")
    spec = getattr(module, name)
    if not isinstance(spec, OpSpec):
        raise SpecError(f"{where}:{name} is a {type(spec).__name__}, not an OpSpec")
    return spec


def _load_file(where: str):
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise SpecError(f"no spec file {where!r} (looked for {path})")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    mod_name = f"linattn_user_spec_{path.stem}_{digest}"
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module          # dataclasses and pickling look modules up here
    with _on_path(path.parent):
        try:
            mspec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise SpecError(_load_error(where, e)) from e
    return module


def _import(where: str):
    with _on_path(Path.cwd()):
        try:
            return importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and (where == e.name or where.startswith(e.name + ".")):
                raise SpecError(f"no module {where!r} (no {e.name!r} on sys.path or in "
                                f"{Path.cwd()})") from e
            raise SpecError(_load_error(where, e)) from e
        except Exception as e:
            raise SpecError(_load_error(where, e)) from e


def _load_error(where: str, e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, SpecError):
        return f"{where}: invalid spec: {first}"
    return f"{where} failed to load: {type(e).__name__}: {first}"


@contextlib.contextmanager
def _on_path(folder: Path):
    """Put a folder first on sys.path for the block (unless it is there already)."""
    folder = str(folder)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
