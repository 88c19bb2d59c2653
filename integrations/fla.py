"""linattn under fla's layers and models: ``apply_linattn_to_fla()``.

fla's layers (fla.layers.GatedDeltaNet, KimiDeltaAttention, GatedLinearAttention, ...)
import fla's functions into their modules (``from fla.ops.gated_delta_rule import
chunk_gated_delta_rule``) and fla's models build on those layers. As liger-kernel's
``apply_liger_kernel_to_*`` does for transformers' modules, the call rebinds those names
in every fla.layers module to linattn's function of the same name and arguments, so every
layer and model built from them, before or after the call, runs on linattn.
"""
from __future__ import annotations

import sys

from linattn.integrations.deps import require

#: fla's functions linattn implements with fla's name and arguments
FLA_FUNCTIONS = (
    "chunk_delta_rule", "fused_recurrent_delta_rule",
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
    "chunk_kda", "fused_recurrent_kda",
    "chunk_gla", "fused_recurrent_gla",
    "chunk_simple_gla", "fused_chunk_simple_gla", "fused_recurrent_simple_gla",
    "parallel_simple_gla",
    "chunk_linear_attn", "fused_chunk_linear_attn", "fused_recurrent_linear_attn",
    "chunk_retention", "fused_chunk_retention", "fused_recurrent_retention",
    "parallel_retention",
)


class Patch:
    """What :func:`apply_linattn_to_fla` rebound: ``replaced`` is a list of
    (module, name, fla's function). ``undo()`` (or leaving a ``with`` block) restores
    fla's functions."""

    def __init__(self, replaced: list):
        self.replaced = replaced

    @property
    def names(self) -> list:
        """"module.function" for each rebinding, e.g. "fla.layers.kda.chunk_kda"."""
        return [f"{m.__name__}.{n}" for m, n, _ in self.replaced]

    def undo(self) -> None:
        for module, name, original in reversed(self.replaced):
            setattr(module, name, original)
        self.replaced = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def __repr__(self):
        return f"Patch({len(self.replaced)} fla functions -> linattn)"


def apply_linattn_to_fla(functions=None) -> Patch:
    """Route fla's layers (and so fla's models) to linattn.

    functions: names from :data:`FLA_FUNCTIONS` (default: all of them). In every
    fla.layers module, each such name still bound to fla's function (fla.ops) is rebound
    to linattn's. Returns a :class:`Patch` (``.undo()`` or ``with`` restores); calling
    again is harmless. Needs flash-linear-attention (fla.layers), imported here.
    """
    import linattn
    names = FLA_FUNCTIONS if functions is None else tuple(functions)
    unknown = [n for n in names if n not in FLA_FUNCTIONS]
    if unknown:
        raise ValueError(f"functions={unknown}: linattn implements fla's "
                         f"{', '.join(FLA_FUNCTIONS)}")
    require("fla.layers", "flash-linear-attention", "linattn.integrations.apply_linattn_to_fla")
    replaced = []
    for mod_name, module in sorted(sys.modules.items()):
        if not mod_name.startswith("fla.layers.") or module is None:
            continue
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None and getattr(fn, "__module__", "").startswith("fla.ops"):
                replaced.append((module, name, fn))
                setattr(module, name, getattr(linattn, name))
    return Patch(replaced)
