"""linattn-bench's picture (cli/bench/plot.py), the summary's ratio direction and the
progress line, on the CPU from a synthetic results JSON."""
import builtins
import json
import struct

import pytest

from linattn.cli.bench import plot
from linattn.cli.bench import run as run_mod
from linattn.cli.bench.cli import main


def _impl(ms, ok=True):
    return {"ms": ms, "ok": ok, "note": ""}


def synthetic_rows() -> list:
    """Three ops, each with its own mix of other implementations; a row where linattn
    failed, one where fla failed, one untimed seed entry."""
    rows = []
    for i in range(6):
        rows.append({"op": "GDNFwd", "workload": f"g{i}", "dtype": "bf16",
                     "impls": {"linattn": _impl(1.0), "fla": _impl(2.0 + i),
                               "seed": _impl(0.5 if i == 0 else 1.25),
                               "flashinfer": _impl(1.5)}})
    rows.append({"op": "GDNFwd", "workload": "broken", "dtype": "bf16",
                 "impls": {"linattn": _impl(None, ok=False), "fla": _impl(2.0)}})
    for i in range(3):
        rows.append({"op": "KDAFwd", "workload": f"k{i}", "dtype": "f16",
                     "impls": {"linattn": _impl(0.1), "fla": _impl(0.4, ok=i != 1),
                               "seed": _impl(None)}})
    rows.append({"op": "GLARecurrentFwd", "workload": "r0", "dtype": "bf16",
                 "impls": {"linattn": _impl(0.01), "torch": _impl(1.0),
                           "torch-compile": _impl(0.1)}})
    return rows


def test_ratios_read_other_over_linattn():
    data = plot.ratios(synthetic_rows())
    assert list(data) == ["GDNFwd", "KDAFwd", "GLARecurrentFwd"]
    assert list(data["GDNFwd"]) == ["fla", "seed", "flashinfer"]
    assert data["GDNFwd"]["fla"] == pytest.approx([2, 3, 4, 5, 6, 7])   # the failed row: none
    assert data["GDNFwd"]["seed"][0] == pytest.approx(0.5)               # linattn behind
    assert data["KDAFwd"] == {"fla": pytest.approx([4.0, 4.0])}          # failed fla, untimed seed
    assert data["GLARecurrentFwd"] == {"torch": pytest.approx([100.0]),
                                       "torch-compile": pytest.approx([10.0])}


def _png_size(path) -> tuple:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_picture_has_a_panel_per_op_and_fits_2000_px(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig) or real_close(fig))
    src, png = tmp_path / "r.json", tmp_path / "p.png"
    src.write_text(json.dumps({"gpu": "NVIDIA H200", "rows": synthetic_rows()}))
    assert main(["--summary", str(src), "--plot", str(png)]) == 0
    width, height = _png_size(png)
    assert 1200 <= width <= 2000 and height > 300
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["GDNFwd (7 rows)", "KDAFwd (3 rows)",
                                                 "GLARecurrentFwd (1 rows)"]
    assert all(ax.get_yscale() == "log" for ax in panels)
    ticks = [t.get_text() for t in panels[0].get_xticklabels()]
    assert ticks[1].startswith("TileOPs") and "1 behind" in ticks[1]     # seed, one row behind
    assert "H200" in fig.get_suptitle() and "other / linattn" in fig.get_suptitle()
    assert "picture: " in capsys.readouterr().out


def test_summary_states_the_ratio_direction(tmp_path, capsys):
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"rows": synthetic_rows()}))
    assert main(["--summary", str(src)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("Ratios read other / linattn") and "> 1: linattn is faster" in first


def test_plot_without_matplotlib_fails_clearly(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    src, png = tmp_path / "r.json", tmp_path / "p.png"
    src.write_text(json.dumps({"rows": synthetic_rows()}))
    assert main(["--summary", str(src), "--plot", str(png)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0] and "linattn[bench]" in err[0]
    assert not png.exists()


def test_plot_with_nothing_timed_fails_clearly(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"op": "GDNFwd", "workload": "x", "dtype": "bf16",
             "impls": {"linattn": _impl(None, ok=False), "fla": _impl(1.0)}}]
    src, png = tmp_path / "r.json", tmp_path / "p.png"
    src.write_text(json.dumps({"rows": rows}))
    assert main(["--summary", str(src), "--plot", str(png)]) == 1
    assert "no row has linattn and another implementation both timed" in capsys.readouterr().err


def test_progress_line_counts_rows_and_time(capsys):
    class R:
        def __init__(self, w):
            self.op, self.workload, self.dtype = "GDNFwd", w, "bf16"
    got = [r.workload for r in run_mod.progress([R("a"), R("b")], "bench")]
    lines = capsys.readouterr().out.splitlines()
    assert got == ["a", "b"]
    assert lines[0] == "bench: 0/2 rows done, 0 s elapsed; next GDNFwd a bf16"
    assert lines[1].startswith("bench: 1/2 rows done, ") and lines[1].endswith("next GDNFwd b bf16")
    assert lines[2].startswith("bench: 2/2 rows done, ") and "s elapsed" in lines[2]
