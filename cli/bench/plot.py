"""The benchmark picture (``linattn-bench --plot P.png``, with ``--summary R.json``: of a
results file): one panel per op; in each, per other implementation timed in the op's
rows (fla, seed = TileOPs' release, flashinfer, torch, ... whichever the JSON holds), one
dot per workload row at other's time / linattn's time on a log axis (above 1: linattn
faster), its geomean as a bar with its value, and how many rows linattn is behind.

Reads the results JSON's ``rows[]``: ``op``, ``impls: {name: {"ms": float|null, "ok":
bool}}``; a pair counts where both implementations passed their check and were timed.
Needs matplotlib (``pip install 'linattn[bench]'``); without it :func:`write` raises
:class:`PlotUnavailable`.
"""
from __future__ import annotations

import math

from .report import OURS, geomean
from .workloads import ALL_OPS

#: the picture's width in pixels (readable at 1600 px; at most 2000)
WIDTH_PX, DPI = 1600, 100
COLUMNS = 5
#: implementation -> colour (others cycle through the rest)
COLORS = {"fla": "tab:blue", "seed": "tab:orange", "flashinfer": "tab:green",
          "torch": "tab:gray", "torch-compile": "tab:purple"}
SPARE = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan")
#: implementation -> its name in the picture ("seed" is TileOPs' release)
SHOWN = {"seed": "TileOPs", "torch-compile": "torch.compile"}
TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200,
         500, 1000)


class PlotUnavailable(RuntimeError):
    """The picture cannot be drawn (matplotlib missing, or nothing to draw)."""


def timed_ms(rec: dict, name: str):
    """An implementation's time in a row, where it passed its check; else None."""
    res = rec.get("impls", {}).get(name) or {}
    return res["ms"] if res.get("ok") and res.get("ms") else None


def ratios(records) -> dict:
    """op -> {other implementation -> [other's ms / linattn's ms per row]}, in the order
    of the benchmark's ops (unknown ops after them) and of the implementations' first
    appearance; rows without a linattn time add nothing."""
    out = {}
    for rec in records:
        ours = timed_ms(rec, OURS)
        per_op = out.setdefault(rec["op"], {})
        for name in rec.get("impls", {}):
            other = timed_ms(rec, name)
            if name != OURS and ours and other:
                per_op.setdefault(name, []).append(other / ours)
    order = {op: i for i, op in enumerate(ALL_OPS)}
    first = {n: i for i, n in enumerate(COLORS)}       # the same order in every panel
    return {op: {n: out[op][n] for n in sorted(out[op], key=lambda n: (first.get(n, 99), n))}
            for op in sorted(out, key=lambda o: order.get(o, len(order))) if out[op]}


def write(records, path: str, gpu: str | None = None) -> dict:
    """Draw the picture of ``records`` into ``path`` (PNG, WIDTH_PX wide); returns what it
    drew (:func:`ratios`). Raises PlotUnavailable without matplotlib or with no row where
    linattn and another implementation were both timed."""
    plt = _pyplot()
    data = ratios(records)
    if not data:
        raise PlotUnavailable("no row has linattn and another implementation both timed")
    rows = {op: sum(1 for r in records if r["op"] == op) for op in data}
    ncols = min(COLUMNS, len(data))
    nrows = math.ceil(len(data) / ncols)
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, layout="constrained",
                             figsize=(WIDTH_PX / DPI, 0.9 + 3.3 * nrows))
    colors = _colors(data)
    for i, (ax, op) in enumerate(zip(axes.flat, data)):
        _panel(ax, op, data[op], rows[op], colors, first_column=i % ncols == 0)
    for ax in axes.flat[len(data):]:
        ax.set_visible(False)
    fig.suptitle(f"linattn against the implementations timed beside it{' on ' + gpu if gpu else ''}"
                 ": time ratio other / linattn, one dot per workload row, log scale\n"
                 "above 1: linattn faster; black bar: geomean (its value above it)",
                 fontsize=12)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return data


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'linattn[bench]' "
                              "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _colors(data) -> dict:
    names = list(dict.fromkeys(n for per_op in data.values() for n in per_op))
    spare = iter(SPARE * len(names))
    return {n: COLORS.get(n) or next(spare) for n in names}


def _panel(ax, op: str, per_impl: dict, n_rows: int, colors: dict, first_column: bool):
    """One op: a strip of ratios per implementation, geomean bars, the 1x line."""
    import numpy as np
    rng = np.random.default_rng(0)          # the same jitter every time: stable pictures
    lo = min(min(xs) for xs in per_impl.values())
    hi = max(max(xs) for xs in per_impl.values())
    ax.axhspan(1e-6, 1.0, color="tab:red", alpha=0.06, lw=0)
    ax.axhline(1.0, color="k", lw=0.8)
    labels = []
    for j, (name, xs) in enumerate(per_impl.items()):
        x = j + rng.uniform(-0.28, 0.28, len(xs))
        ax.scatter(x, xs, s=12, alpha=0.55, color=colors[name], lw=0)
        g = geomean(xs)
        ax.hlines(g, j - 0.36, j + 0.36, color="k", lw=2.2)
        ax.annotate(f"{g:.2f}x", (j, g), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9, fontweight="bold",
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
        behind = sum(1 for v in xs if v < 1)
        shown = SHOWN.get(name, name)
        if len(per_impl) > 3 and len(shown) > 8:        # two lines where slots are narrow
            shown = shown.replace(".", ".\n", 1).replace("-", "-\n", 1)
        labels.append(f"{shown}\n{len(xs)} rows\n{behind} behind")
    ax.set_yscale("log")
    ax.set_ylim(min(0.5, lo / 1.4), max(2.0, hi * 1.4))
    ticks = [t for t in TICKS if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xlim(-0.6, len(per_impl) - 0.4)
    ax.set_xticks(range(len(per_impl)), labels, fontsize=9 if len(per_impl) < 4 else 7.5)
    ax.text(0.02, 0.02, "linattn slower", transform=ax.transAxes, fontsize=8,
            color="tab:red", va="bottom")
    ax.set_title(f"{op} ({n_rows} rows)", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    if first_column:
        ax.set_ylabel("other's time / linattn's time")
