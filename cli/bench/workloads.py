"""The benchmark's workload table (the seed page's 385 rows) and filters over it.

Each row: op (one of the ten operators), workload (label), dtype ("bf16" | "f16"),
tensors {name: {"shape": [...], "dtype": None (= the row's dtype) | "f32" | "i64"}},
options (flags, "scale", "seq_lens" for varlen), seed (the seed page's figures:
ours_ms, ratio, alternatives {impl: ms}, tflops, sol_pct, bound).
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from importlib import resources

OPS = ("DeltaNetChunkFwd", "DeltaNetChunkBwd", "DeltaNetRecurrentFwd", "DeltaNetFwd", "GDNFwd",
       "KDAFwd", "GLAChunkFwd", "GLAChunkBwd", "GLARecurrentFwd", "GLAFwd")


@dataclass(frozen=True)
class Row:
    op: str
    workload: str
    dtype: str
    tensors: dict
    options: dict = field(default_factory=dict)
    seed: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.op, self.workload, self.dtype)

    def shape(self, name: str):
        t = self.tensors.get(name)
        return None if t is None else tuple(t["shape"])

    @property
    def is_decode(self) -> bool:
        """One token per sequence: the recurrent ops, or a T == 1 inference call."""
        if self.op.endswith("RecurrentFwd"):
            return True
        q = self.shape("q")
        return self.op in ("DeltaNetFwd", "GDNFwd", "KDAFwd", "GLAFwd") and q[1] == 1


def load_rows(path: str | None = None) -> list[Row]:
    """The table shipped as package data (or a JSON file at path)."""
    if path:
        with open(path) as f:
            raw = json.load(f)
    else:
        raw = json.loads(resources.files("linattn.cli.bench").joinpath(
            "data/seed_workloads.json").read_text())
    return [Row(r["op"], r["workload"], r["dtype"], r["tensors"], r.get("options", {}),
                r.get("seed", {})) for r in raw]


def select(rows, ops=None, workload=None, dtypes=None, limit=None):
    """Rows whose op is in ops (names, case-insensitive), whose workload matches the glob
    (comma-separated globs allowed), and whose dtype is in dtypes; the first `limit`."""
    ops_l = {o.lower() for o in ops} if ops else None
    globs = workload.split(",") if workload else None
    out = []
    for r in rows:
        if ops_l and r.op.lower() not in ops_l:
            continue
        if globs and not any(fnmatch.fnmatchcase(r.workload, g) for g in globs):
            continue
        if dtypes and r.dtype not in dtypes:
            continue
        out.append(r)
    return out[:limit] if limit else out
