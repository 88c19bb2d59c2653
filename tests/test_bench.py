"""linattn-bench on CPU: the table, inputs, FLOP/byte formulas, timer interval logic,
reference check, report/JSON/merge, and the loop end to end (check-only, torch impls)."""
import dataclasses
import json
import math

import pytest
import torch

from linattn.cli.bench import impls, report, roofline, run as run_mod, timer
from linattn.cli.bench.inputs import build_inputs
from linattn.cli.bench.reference import check, reference_outputs
from linattn.cli.bench.workloads import OPS, Row, load_rows, select

ROWS = load_rows()


def small_row(op, dtype="bf16", options=None, **shapes):
    t = {n: {"shape": list(s), "dtype": ("f32" if n in ("initial_state", "A_log", "dt_bias", "S", "h", "dht")
                                         else "i64" if n.startswith("cu_") else None)}
         for n, s in shapes.items()}
    return Row(op, "tiny", dtype, t, options or {}, {"ours_ms": 0.01, "alternatives": {"fla": 0.02}})


def tiny_rows():
    B, T, H, K, V = 1, 70, 2, 16, 8
    qk = dict(q=(B, T, H, K), k=(B, T, H, K))
    return [
        small_row("DeltaNetChunkFwd", q=(B, H, T, K), k=(B, H, T, K), v=(B, H, T, V), beta=(B, H, T)),
        small_row("DeltaNetChunkBwd", do=(B, H, T, V), q=(B, H, T, K), k=(B, H, T, K), v=(B, H, T, V),
                  beta=(B, H, T), S=(B, H, 3, K, V), Aw=(B, H, T, 64), Au=(B, H, T, 64), w=(B, H, T, K),
                  u=(B, H, T, V)),
        small_row("DeltaNetRecurrentFwd", q=(3, H, K), k=(3, H, K), v=(3, H, V), beta=(3, H), state=(3, H, K, V)),
        small_row("GLARecurrentFwd", options={"scale": 0.25}, q=(3, H, K), k=(3, H, K), v=(3, H, V), gk=(3, H, K),
                  state=(3, H, K, V)),
        small_row("DeltaNetFwd", options={"use_qk_l2norm_in_kernel": True, "seq_lens": [1, 30, 39]},
                  v=(B, T, H, V), beta=(B, T, H), cu_seqlens=(4,), cu_seqlens_cpu=(4,),
                  initial_state=(3, H, K, V), **qk),
        small_row("GDNFwd", options={"use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
                                     "allow_neg_eigval": True, "state_v_first": True},
                  v=(B, T, 2 * H, V), g=(B, T, 2 * H), beta=(B, T, 2 * H), initial_state=(B, 2 * H, V, K),
                  A_log=(2 * H,), dt_bias=(2 * H,), **qk),
        small_row("KDAFwd", dtype="f16", v=(B, T, H, V), g=(B, T, H, K), beta=(B, T, H), **qk),
        small_row("GLAChunkFwd", options={"scale": 0.125}, v=(B, T, H, V), g=(B, T, H, K),
                  initial_state=(B, H, K, V), **qk),
        small_row("GLAChunkBwd", options={"scale": 0.125}, v=(B, T, H, V), g=(B, T, H, K), do=(B, T, H, V),
                  h=(B, 3, H, K, V), dht=(B, H, K, V), **qk),
        small_row("GLAFwd", q=(2, 1, H, K), k=(2, 1, H, K), v=(2, 1, H, V), g=(2, 1, H, K),
                  initial_state=(2, H, K, V)),
    ]


def test_table_loads_and_filters():
    assert len(ROWS) == 385 and {r.op for r in ROWS} == set(OPS)
    assert all(r.seed.get("ours_ms") for r in ROWS)
    gdn = select(ROWS, ops=["gdnfwd"], dtypes=["bf16"])
    assert gdn and all(r.op == "GDNFwd" and r.dtype == "bf16" for r in gdn)
    pre = select(ROWS, workload="prefill-4k,decode-b8")
    assert {r.workload for r in pre} == {"prefill-4k", "decode-b8"}
    assert len(select(ROWS, limit=7)) == 7
    for r in ROWS:   # every varlen row's lengths add up to the packed T
        if "seq_lens" in r.options:
            assert sum(r.options["seq_lens"]) == r.shape("q")[1] and r.shape("q")[0] == 1


@pytest.mark.parametrize("row", tiny_rows(), ids=lambda r: r.op)
def test_inputs_realistic(row):
    x = build_inputs(row, "cpu", seed=123)
    for name, t in row.tensors.items():
        assert tuple(x[name].shape) == tuple(t["shape"]), name
        if x[name].is_floating_point() and name not in ("S", "Aw", "Au"):   # zeros by contract
            assert torch.isfinite(x[name]).all() and float((x[name] == 0).float().mean()) < 0.01, name
    o = row.options
    if "q" in x and row.op not in ("GLAChunkFwd", "GLAChunkBwd", "GLARecurrentFwd", "GLAFwd"):
        n = x["k"].float().norm(dim=-1)
        if o.get("use_qk_l2norm_in_kernel"):
            assert (n - 1).abs().max() > 0.5          # raw: the kernel normalises
        else:
            assert (n - 1).abs().max() < 1e-2
    if "beta" in x:
        b = x["beta"].float()
        assert (b.min() < 0) if o.get("use_beta_sigmoid_in_kernel") else (b.min() > 0 and b.max() < 1)
    for g in ("g", "gk"):
        if g in x:
            gv = x[g].float()
            assert (gv.max() > 0) if o.get("use_gate_in_kernel") else (gv.max() < 0)
    if "cu_seqlens" in x:
        assert x["cu_seqlens"].tolist() == [0] + list(torch.tensor(o["seq_lens"]).cumsum(0).tolist())
        assert x["cu_seqlens_cpu"].device.type == "cpu"
    if row.op == "GLAChunkBwd":
        assert float(x["h"][:, 0].abs().max()) > 0
    for name in ("S", "Aw", "Au", "w", "u", "h"):      # as a contract's forward returns them
        assert name not in x or x[name].is_contiguous(), name
    assert torch.equal(build_inputs(row, "cpu", seed=123)["q"], x["q"])      # reproducible per seed


def test_deltanet_fwd_seed_test_value():
    # the seed's assertion: (7*2*(6*8*6+2*8)+2*7*2*(3*8+2), 2396) implies B=1, T=7, H=2,
    # K=8, V=6, two sequences with a seeded f32 state, l2norm on, bf16
    row = small_row("DeltaNetFwd", options={"use_qk_l2norm_in_kernel": True, "seq_lens": [3, 4]},
                    q=(1, 7, 2, 8), k=(1, 7, 2, 8), v=(1, 7, 2, 6), beta=(1, 7, 2),
                    initial_state=(2, 2, 8, 6), cu_seqlens=(3,), cu_seqlens_cpu=(3,))
    assert roofline.counts(row) == (7 * 2 * (6 * 8 * 6 + 2 * 8) + 2 * 7 * 2 * (3 * 8 + 2), 2396)


@pytest.mark.parametrize("op", ["GDNFwd", "DeltaNetFwd", "DeltaNetRecurrentFwd"])
def test_flops_match_seed_figures(op):
    # where DESIGN's count is the seed page's count: tflops * ms reproduces it
    for r in select(ROWS, ops=[op]):
        implied = r.seed["tflops"] * 1e12 * r.seed["ours_ms"] * 1e-3
        assert abs(roofline.counts(r)[0] / implied - 1) < 0.02, r.workload


def test_sol_and_bound():
    r = select(ROWS, ops=["GDNFwd"], workload="prefill-4k", dtypes=["bf16"])[0]
    fl, by = roofline.counts(r)
    s = roofline.sol(r, 0.1)
    assert s["bound"] == "mem" and math.isclose(s["sol_pct"], 100 * by / 4.5e12 / 1e-4)
    assert math.isclose(s["tflops"], fl / 1e-4 / 1e12)
    tiny = select(ROWS, ops=["GDNFwd"], workload="decode-b1", dtypes=["bf16"])[0]
    assert roofline.sol(tiny, 0.003)["bound"] == "lat"


def test_interval_union_and_call_split():
    assert timer.union_length([]) == 0
    assert timer.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert timer.union_length([(3, 4), (0, 1)]) == 2
    evs = [(0, 1, "bitwise_not_kernel"), (2, 3, "gemm"), (2.5, 4, "gemm2"), (3.5, 3.6, "Memcpy DtoD"),
           (10, 11, "void bitwise_not"), (12, 13, "gemm"), (20, 21, "gemm")]
    calls = timer.split_calls(evs, timer._is_flush, timer._counted(False))
    assert calls == [[(2, 3), (2.5, 4)], [(12, 13), (20, 21)]]
    assert [timer.union_length(c) for c in calls] == [2, 2]       # a host-side gap adds nothing
    with_copies = timer.split_calls(evs, timer._is_flush, timer._counted(True))
    assert (3.5, 3.6) in with_copies[0]


def test_check_tolerances_and_nan():
    ref = {"o": torch.randn(100, dtype=torch.float64)}
    ok, errs, _ = check({"o": (ref["o"] * (1 + 1e-3)).to(torch.bfloat16)}, ref, "bf16")
    assert ok and errs["o"] < 1e-2
    assert not check({"o": ref["o"] * 1.02}, ref, "bf16")[0]
    assert not check({"o": ref["o"] * 1.007}, ref, "f16")[0]
    bad = ref["o"].clone()
    bad[3] = float("nan")
    assert not check({"o": bad}, ref, "bf16")[0]
    assert not check({"o": ref["o"][:50]}, ref, "bf16")[0]


@pytest.mark.parametrize("row", tiny_rows(), ids=lambda r: r.op)
def test_reference_outputs_shapes(row):
    x = build_inputs(row, "cpu", seed=1)
    ref = reference_outputs(row, x)
    for name, t in ref.items():
        assert t.dtype == torch.float64 and torch.isfinite(t).all(), name
    if row.op in ("DeltaNetChunkBwd", "GLAChunkBwd"):
        assert ref["dq"].shape == x["q"].shape
    else:
        assert ref["o"].shape[:-1] == x["v"].shape[:-1] or row.op.endswith("RecurrentFwd")


def test_loop_end_to_end_check_only(tmp_path, monkeypatch):
    rows = tiny_rows()
    out = tmp_path / "r.json"
    doc = run_mod.run(rows, ["linattn", "torch", "fla"], out_path=str(out), device="cpu", time_it=False)
    saved = json.loads(out.read_text())
    assert {"gpu", "commit", "date", "clocks", "rows"} <= set(saved)
    assert len(saved["rows"]) == len(rows)
    for rec in saved["rows"]:
        assert {"op", "workload", "dtype", "seed", "impls", "flops", "bytes"} <= set(rec)
        for name, i in rec["impls"].items():
            assert set(i) >= {"ms", "ok", "note"} and i["ms"] is None
        if rec["op"].endswith("RecurrentFwd"):
            assert rec["impls"]["torch"]["ok"], rec["impls"]["torch"]
    # a wrong implementation is reported ok=false, not timed
    real = impls.make

    def wrong(name, row, x):
        fn, outs = real("torch", row, x)
        return (lambda: tuple(t * 1.1 for t in fn())), outs
    monkeypatch.setattr(impls, "make", wrong)
    rec = run_mod.run_row(rows[2], ["linattn"], device="cpu", time_it=True)
    assert rec["impls"]["linattn"]["ok"] is False and rec["impls"]["linattn"]["ms"] is None
    assert "rel err" in rec["impls"]["linattn"]["note"]
    assert doc["geomeans"]["DeltaNetRecurrentFwd"]["gaps"] == 1


def fake_record(row, ours, fla, ok=True):
    rec = {"op": row.op, "workload": row.workload, "dtype": row.dtype, "seed": row.seed,
           "impls": {"linattn": {"ms": ours, "ok": ok, "note": ""}, "fla": {"ms": fla, "ok": True, "note": ""}}}
    return report.summarize(rec, row)


def test_summary_table_and_merge(tmp_path):
    r1, r2 = select(ROWS, ops=["GDNFwd"], workload="prefill-4k")[:2]
    a = fake_record(r1, 0.1, 0.2)
    assert a["ratio"] == pytest.approx(2.0) and a["vs_seed"] == pytest.approx(r1.seed["ours_ms"] / 0.1)
    # flashinfer not timed here: the seed's column is the fallback
    assert a["ratio_with_seed_columns"] == pytest.approx(min(0.2, r1.seed["alternatives"]["flashinfer"]) / 0.1)
    b = fake_record(r2, None, 0.3, ok=False)
    assert b["ratio"] is None and b["figures_of"] == "fla"
    text = report.table([a, b])
    assert "| Workload | dtype | Ratio | ours ms | fla ms |" in text and "| prefill-4k |" in text
    assert "FAIL" in text and "### Geomeans" in text
    g = report.geomeans([a, b])["GDNFwd"]
    assert g["rows"] == 2 and g["ratio"] == pytest.approx(2.0)
    path = str(tmp_path / "h200.json")
    report.merge_into(path, {"gpu": "x", "commit": "c1", "rows": [a, b]})
    a2 = fake_record(r1, 0.05, 0.2)
    r3 = select(ROWS, ops=["KDAFwd"])[0]
    merged = report.merge_into(path, {"gpu": "x", "commit": "c2", "rows": [a2, fake_record(r3, 1.0, 1.1)]})
    keys = [(r["op"], r["workload"], r["dtype"]) for r in merged["rows"]]
    assert len(keys) == len(set(keys)) == 3
    # a doc re-timing part of the file: its header under "runs", the file's kept (its GPU,
    # copy bandwidth belong to the rows it timed)
    assert merged["commit"] == "c1" and merged["runs"][-1]["commit"] == "c2"
    again = json.load(open(path))
    assert [r["ours_ms"] for r in again["rows"] if r["workload"] == r1.workload and r["dtype"] == r1.dtype] == [0.05]
    # each row keeps the commit it was measured at
    stamps = {(r["workload"], r["dtype"]): r["commit"] for r in again["rows"]}
    assert stamps[(r1.workload, r1.dtype)] == "c2" and stamps[(r2.workload, r2.dtype)] == "c1"
    # a run of one implementation replaces that entry only; the ratio is computed again
    only = {k: v for k, v in fake_record(r1, 0.04, 0.2).items()}
    only["impls"] = {"linattn": only["impls"]["linattn"]}
    merged = report.merge_into(path, {"gpu": "x", "commit": "c3", "rows": [only]})
    row = [r for r in merged["rows"] if (r["workload"], r["dtype"]) == (r1.workload, r1.dtype)][0]
    assert row["impls"]["linattn"]["ms"] == 0.04 and row["impls"]["linattn"]["commit"] == "c3"
    assert row["impls"]["fla"]["ms"] == 0.2 and row["impls"]["fla"]["commit"] == "c2"
    assert row["ratio"] == pytest.approx(0.2 / 0.04) and row["ours_ms"] == 0.04
    # the header describes the merged table, not the last run
    assert merged["geomeans"]["GDNFwd"]["rows"] == 2 and merged["geomeans"]["KDAFwd"]["rows"] == 1
    assert "skipped_for_budget" not in report.merge_into(
        path, {"gpu": "x", "commit": "c4", "impls": ["fla"], "skipped_for_budget": ["r"],
               "rows": []})
    assert json.load(open(path))["impls"] == ["fla"]
    whole = report.merge_into(str(tmp_path / "w.json"), {"gpu": "x", "commit": "w1", "rows": [a, b]})
    whole = report.merge_into(str(tmp_path / "w.json"), {"gpu": "y", "commit": "w2", "rows": [a2, b]})
    assert whole["commit"] == "w2" and whole["gpu"] == "y" and "runs" not in whole
    # a row outside the packaged tables (--workloads-json) gets its figures from the rows given
    out = dataclasses.replace(r1, workload="outside-row", seed={})
    report.merge_into(path, {"gpu": "x", "commit": "c5", "rows": [fake_record(out, 0.1, 0.3)]}, [out])
    only = fake_record(out, 0.05, None)
    only["impls"] = {"linattn": only["impls"]["linattn"]}
    merged = report.merge_into(path, {"gpu": "x", "commit": "c6", "rows": [only]}, [out])
    row = [r for r in merged["rows"] if r["workload"] == "outside-row"][0]
    assert row["ratio"] == pytest.approx(0.3 / 0.05) and row["impls"]["fla"]["commit"] == "c5"


def test_bound_labels_match_seed_page():
    # the seed's own times through our formulas and ceilings give the seed's bound labels
    # (except ~30 GDN prefill rows that sit within 7% of the mem/comp balance point)
    agree = [roofline.sol(r, r.seed["ours_ms"])["bound"] == r.seed["bound"] for r in ROWS]
    assert sum(agree) / len(agree) > 0.9
    assert all(a for a, r in zip(agree, ROWS) if r.op != "GDNFwd")


def test_families_and_summary(tmp_path):
    """GDN rows fall in the issue's families; the summary prints the per-op geomeans
    against each alternative and the best, states the ratio's direction, lists the rows
    where linattn is behind and counts entries from other runs and stale commits, also
    through linattn-bench --summary."""
    from linattn.cli.bench.cli import main
    gdn = select(ROWS, ops=["GDNFwd"])
    fams = {report.family({"op": r.op, "workload": r.workload, "dtype": r.dtype}) for r in gdn}
    assert {"prefill", "varlen", "decode", "GVA tp1", "GVA tp8"} <= fams
    by_name = {r.workload: r for r in gdn}
    assert report.family({"op": "GDNFwd", "workload": "decode-b8", "dtype": "bf16"}) == "decode"
    assert report.family({"op": "GDNFwd", "workload": "q35-397b-tp1-65536",
                          "dtype": "bf16"}) == "GVA tp1"
    assert "cu_seqlens" in by_name["q35-397b-tp4-8x1024"].tensors
    assert report.family({"op": "GDNFwd", "workload": "q35-397b-tp4-8x1024",
                          "dtype": "bf16"}) == "varlen"
    r1, r2 = select(ROWS, ops=["GDNFwd"], workload="prefill-4k")[:2]
    a = fake_record(r1, 0.1, 0.2)
    b = fake_record(r2, 0.1, 0.05)
    a["impls"]["seed"] = {"ms": 0.08, "ok": True, "run": "r2"}
    b["impls"]["flashinfer"] = {"ms": 0.2, "ok": False, "run": "r1"}    # wrong: not counted
    for rec, row in ((a, r1), (b, r2)):
        rec["impls"]["linattn"].update(run="r1", commit="c-new" if rec is a else "c-old")
        rec["impls"]["fla"]["run"] = "r1"
        report.summarize(rec, row)
    f = report.families([a, b])["prefill"]
    assert f["rows"] == 2 and f["timed"] == 2 and f["vs_fla"] == pytest.approx(1.0)
    v = report.versus([a, b])["GDNFwd"]
    assert v["fla"] == (pytest.approx(1.0), 2) and v["seed"] == (pytest.approx(0.8), 1)
    assert v["flashinfer"] == (None, 0)
    assert v["best"][0] == pytest.approx((0.8 * 0.5) ** 0.5)
    assert [(w, d) for _, w, d, _ in v["behind"]] == [(r2.workload, r2.dtype), (r1.workload, r1.dtype)]
    p = report.provenance([a, b], generated_matches=lambda c: c == "c-new")
    assert p == {"other_run": 1, "stale": 1, "unknown": 0, "stale_commits": ["c-old"]}
    text = report.summary([a, b], generated_matches=lambda c: True)
    assert "other / linattn" in text and "> 1: linattn is faster" in text
    assert "| GDNFwd | 2 | 2 | 1.000 (2) | 0.800 (1) | - |" in text
    assert "Rows where linattn is behind the best alternative: 2" in text
    assert "| prefill | 2 | 2 |" in text and "1 entries from another run" in text
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [a, b]}))
    assert main(["--summary", str(path)]) == 0


def test_skip_timed_keeps_rows_not_settled():
    """--skip-timed: a row is done when every asked implementation has a time or is not
    implemented; a failed or missing one keeps the row."""
    from linattn.cli.bench.cli import timed_rows
    rec = lambda w, **impls: {"op": "GDNFwd", "workload": w, "dtype": "bf16",  # noqa: E731
                              "impls": impls}
    doc = {"rows": [rec("a", linattn={"ms": 1.0}, fla={"ms": 2.0}),
                    rec("b", linattn={"ms": None, "note": "not implemented: x"}, fla={"ms": 1.0}),
                    rec("c", linattn={"ms": None, "ok": False, "note": "wrong"}, fla={"ms": 1.0}),
                    rec("d", linattn={"ms": 1.0})]}
    assert timed_rows(doc, ["linattn", "fla"]) == {("GDNFwd", "a", "bf16"), ("GDNFwd", "b", "bf16")}
    assert ("GDNFwd", "d", "bf16") in timed_rows(doc, ["linattn"])
    # an implementation that does not cover the op (torch on a GDN row) does not keep it
    doc = {"rows": [rec("prefill-4k", fla={"ms": 1.0}), rec("prefill-12k", fla={"ms": None})]}
    assert timed_rows(doc, ["fla", "torch-compile"]) == {("GDNFwd", "prefill-4k", "bf16")}


def test_warm_groups_share_autotune_keys():
    """Rows differing only in batch / token counts share a group (one process warms them);
    another dtype, head count, option set or the decode / varlen kind is another group."""
    rows = select(ROWS, ops=["GDNFwd"])
    groups = run_mod.warm_groups(rows)
    assert sum(len(g) for g in groups) == len(rows)
    tp8 = [r for r in rows if r.workload.startswith("q35-397b-tp8-") and r.dtype == "bf16"
           and "seq_lens" not in r.options]
    assert len(tp8) > 2 and len({id(g) for g in groups for r in g if r in tp8}) == 1
    sig = {r.key: i for i, g in enumerate(groups) for r in g}
    f16 = [r for r in rows if r.workload == tp8[0].workload and r.dtype == "f16"]
    assert f16 and sig[f16[0].key] != sig[tp8[0].key]
    assert len(groups) < len(rows) / 3
    # head-first contracts: T is dim 2, not a head dim
    dn = run_mod.warm_groups(select(ROWS, ops=["DeltaNetChunkFwd"], dtypes=["bf16"]))
    assert len(dn) <= 2


def test_warm_rows_calls_each_impl_once_per_row(tmp_path):
    """The warm step runs the implementations in worker processes and reports every row."""
    rows = [r for r in tiny_rows() if r.op.endswith("RecurrentFwd")]
    res = run_mod.warm_rows(rows, ["linattn", "torch"], processes=2, device="cpu")
    assert res["rows"] == len(rows) == res["of"] and res["errors"] == []
    assert res["processes"] == 2 and not res["cut_at_deadline"]


def test_warm_jobs_in_the_timed_runs_order():
    """fla's rows stay in their autotuning groups (one job a group); the seed release (a
    compile per shape) is one row a job; jobs come in the order the timed run reaches their
    first row, so a warm step cut at its deadline has compiled the rows timed first."""
    rows = select(ROWS, ops=["GDNFwd"], dtypes=["bf16"])
    jobs = run_mod.warm_jobs(rows, ["linattn", "fla", "seed", "flashinfer"])
    fla_jobs = [rs for rs, names in jobs if names == ["fla"]]
    seed_jobs = [rs for rs, names in jobs if names == ["seed", "flashinfer"]]
    assert len(fla_jobs) == len(run_mod.warm_groups(rows)) and all(len(rs) == 1 for rs in seed_jobs)
    assert [rs[0].key for rs in seed_jobs] == [r.key for r in rows]
    pos = {r.key: i for i, r in enumerate(rows)}
    firsts = [pos[rs[0].key] for rs, _ in jobs]
    assert firsts == sorted(firsts)
    assert all(names == ["fla"] for _, names in run_mod.warm_jobs(rows, ["linattn", "fla"]))


def test_shard_interleaves_and_rejects_bad_specs():
    from linattn.cli.bench.cli import shard
    rows = list(range(10))
    parts = [shard(rows, f"{i}/3") for i in range(3)]
    assert sorted(sum(parts, [])) == rows and parts[1] == [1, 4, 7]
    for bad in ("3/3", "x/2", "1", "-1/2"):
        with pytest.raises(SystemExit, match="--shard takes I/N"):
            shard(rows, bad)


def test_row_estimate_ignores_a_first_row_of_compiles():
    est = run_mod.row_estimate
    assert est({}, "GDNFwd") == 0.0
    assert est({"GDNFwd": [45.0]}, "GDNFwd") == 0.0                     # one row: no estimate
    assert est({"GDNFwd": [45.0, 2.0]}, "GDNFwd") == 2.0
    assert est({"GDNFwd": [45.0, 2.0, 3.0, 2.5]}, "GDNFwd") == 2.5
    assert est({"GDNFwd": [45.0, 2.0, 3.0], "KDAFwd": [30.0]}, "KDAFwd") == 3.0   # all rows


def test_gate_distributions_of_the_gates_table():
    """bench/workloads/gates.json: trained-model decays (-exp(A_log) softplus(a + dt_bias):
    weak, many heads near -1e-2 a token), the same formed in the kernel, and no gate."""
    from linattn.cli.bench.inputs import _gate
    gen = torch.Generator().manual_seed(0)
    randn = lambda s: torch.randn(*s, generator=gen)   # noqa: E731
    rand = lambda s: torch.rand(*s, generator=gen)     # noqa: E731
    g = _gate({"gates": "trained"}, (2, 512, 8), randn, rand)
    assert g.shape == (2, 512, 8) and (g < 0).all()
    med = g.median(dim=1).values.abs()           # per (sequence, head)
    assert 1e-4 < float(med.min()) and float(med.max()) < 1.0 and float(med.median()) < 0.2
    gk = _gate({"gates": "trained"}, (1, 64, 4, 16), randn, rand)
    assert gk.shape == (1, 64, 4, 16) and (gk < 0).all()
    assert (_gate({"gates": "none"}, (1, 8, 2), randn, rand) == 0).all()
    synthetic = _gate({}, (1, 4096, 4), randn, rand)
    assert -0.2 < float(synthetic.mean()) < -0.08
    with pytest.raises(ValueError, match="gates"):
        _gate({"gates": "strong"}, (1, 8, 2), randn, rand)
    rows = load_rows("bench/workloads/gates.json")
    assert len(rows) == 24 and {r.op for r in rows} == {"GDNFwd", "KDAFwd"}
    for r in rows:
        x = build_inputs(dataclasses.replace(r, tensors={n: {**t, "shape": [1, 70] + t["shape"][2:]}
                                                          if n in ("q", "k", "v", "g", "beta") else t
                                                          for n, t in r.tensors.items()
                                                          if not n.startswith("cu_")},
                                             options={k: v for k, v in r.options.items() if k != "seq_lens"}),
                         "cpu", 1)
        if r.workload.endswith("-raw"):
            assert r.options["use_gate_in_kernel"] and x["dt_bias"].numel() in (x["v"].shape[2], x["g"].numel() // 70)


def test_times_on_different_gpus_are_not_compared():
    """A row merged from runs on two GPU models gets no ratio between them."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    rec = {"op": "GDNFwd", "workload": "w", "dtype": "bf16",
           "impls": {"linattn": {"ms": 1.0, "ok": True, "gpu": h200},
                     "seed": {"ms": 0.5, "ok": True, "gpu": h100},
                     "fla": {"ms": 2.0, "ok": True, "gpu": h200}}}
    v = report.versus([rec])["GDNFwd"]
    assert v["seed"] == (None, 0) and v["fla"] == (2.0, 1)
    assert report.comparable({"gpu": h100}, {}) and not report.comparable({"gpu": h100}, {"gpu": h200})


def test_the_copy_check_knows_the_gpu():
    assert timer.copy_plausible("NVIDIA H200", 4.27)
    assert timer.copy_plausible("NVIDIA H100 80GB HBM3", 3.05)          # run s33-1
    assert not timer.copy_plausible("NVIDIA H100 80GB HBM3", 4.27)      # faster than its HBM
    assert not timer.copy_plausible("NVIDIA H200", 3.05)
    assert timer.copy_plausible("NVIDIA A100", 1.5) is None             # not judged
