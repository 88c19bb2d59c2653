"""The op families linattn knows, by command-line name.

Each family module in ops/ defines ``SPEC`` (its :class:`~linattn.dsl.OpSpec`); a new
variant is a new module with a SPEC, listed in ``FAMILY_MODULES``.
"""
from __future__ import annotations

import importlib

from ..dsl import OpSpec, SpecError

FAMILY_MODULES = ("deltanet", "gdn", "kda", "gla", "simple_gla", "linear_attn")


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
