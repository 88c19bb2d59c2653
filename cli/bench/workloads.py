"""The benchmark's workload table (the seed page's 385 rows) and filters over it.

Each row: op (one of the ten operators), workload (label), dtype ("bf16" | "f16"),
tensors {name: {"shape": [...], "dtype": None (= the row's dtype) | "f32" | "i64"}},
options (flags, "scale", "seq_lens" for varlen), seed (the seed page's figures:
ours_ms, ratio, alternatives {impl: ms}, tflops, sol_pct, bound).

Training rows (TRAIN_OPS, :func:`train_rows`; not in the seed table, selected by naming
their op): one whole step, forward + backward, of a model's linear-attention layer, bf16,
16384 tokens a step, in three packings: ``<model>-4k`` (B = 4, T = 4096), ``<model>-16k``
(B = 1, T = 16384) and ``<model>-varlen`` (B = 1, the sequences VARLEN_LENS packed with
cu_seqlens). Models (MODELS): Qwen3-Next's Gated DeltaNet (16 key / 32 value heads,
K = V = 128), Kimi Linear's KDA (32 heads, K = V = 128), GLA-1.3B (4 heads, K = 256,
V = 512), DeltaNet-1.3B (16 heads, K = V = 128); the delta rules with q, k normalised in
the kernel (use_qk_l2norm_in_kernel), beta = sigmoid(.) given; gates f32 log decays; no
initial state; do and dht (the final state's gradient) fixed random tensors.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from importlib import resources

OPS = ("DeltaNetChunkFwd", "DeltaNetChunkBwd", "DeltaNetRecurrentFwd", "DeltaNetFwd", "GDNFwd",
       "KDAFwd", "GLAChunkFwd", "GLAChunkBwd", "GLARecurrentFwd", "GLAFwd")
TRAIN_OPS = ("GDNTrain", "KDATrain", "GLATrain", "DeltaNetTrain")
ALL_OPS = OPS + TRAIN_OPS
#: training op -> (model label, H, HV, K, V, options)
MODELS = {
    "GDNTrain": ("qwen3-next", 16, 32, 128, 128, {"use_qk_l2norm_in_kernel": True}),
    "KDATrain": ("kimi-linear", 32, 32, 128, 128, {"use_qk_l2norm_in_kernel": True}),
    "GLATrain": ("gla-1.3b", 4, 4, 256, 512, {}),
    "DeltaNetTrain": ("deltanet-1.3b", 16, 16, 128, 128, {"use_qk_l2norm_in_kernel": True}),
}
#: the varlen rows' packed sequences (16384 tokens; lengths off the chunk size too)
VARLEN_LENS = (4096, 1024, 3000, 517, 2048, 5699)


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
    def is_train(self) -> bool:
        return self.op in TRAIN_OPS

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


def train_row(op, workload, B, T, H, HV, K, V, options=None, seq_lens=None, h0=False,
              dtype="bf16") -> Row:
    """One training row: q, k [B, T, H, K], v and do [B, T, HV, V], the family's gate
    (f32: [B, T, HV] for GDN, [B, T, HV, K] for KDA and GLA) and beta [B, T, HV] (the delta
    rules), dht [N, HV, K, V] (f32), an initial state with h0, cu_seqlens with seq_lens
    (B == 1, T their sum); options["scale"] = K ** -0.5 (fla's default) unless given."""
    N = len(seq_lens) if seq_lens else B
    t = {"q": ([B, T, H, K], None), "k": ([B, T, H, K], None), "v": ([B, T, HV, V], None)}
    if op in ("GDNTrain", "KDATrain", "GLATrain"):
        t["g"] = ([B, T, HV] if op == "GDNTrain" else [B, T, HV, K], "f32")
    if op != "GLATrain":
        t["beta"] = ([B, T, HV], None)
    if h0:
        t["initial_state"] = ([N, HV, K, V], "f32")
    t.update(do=([B, T, HV, V], None), dht=([N, HV, K, V], "f32"))
    opts = {"scale": K ** -0.5, **(options or {})}
    if seq_lens:
        t.update(cu_seqlens=([N + 1], "i64"), cu_seqlens_cpu=([N + 1], "i64"))
        opts["seq_lens"] = list(seq_lens)
    return Row(op, workload, dtype, {n: {"shape": s, "dtype": d} for n, (s, d) in t.items()},
               opts)


def train_rows() -> list[Row]:
    """The training rows: every model of MODELS at 4k x 4, 16k x 1 and the varlen pack."""
    out = []
    for op, (model, H, HV, K, V, opts) in MODELS.items():
        out += [train_row(op, f"{model}-4k", 4, 4096, H, HV, K, V, opts),
                train_row(op, f"{model}-16k", 1, 16384, H, HV, K, V, opts),
                train_row(op, f"{model}-varlen", 1, sum(VARLEN_LENS), H, HV, K, V, opts,
                          seq_lens=VARLEN_LENS)]
    return out
