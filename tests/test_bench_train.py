"""linattn-bench's training rows on CPU: the row table, the inputs, the fp64 reference
gradients (the chunked reference's autograd against the recurrence's), the step through
the benchmark loop with fp64 fakes of the chunk functions (a correct one passes, a wrong
gradient fails, a refusal is a gap), peak-memory / table / merge plumbing, and the
precompile rounds."""
import json
import types

import pytest
import torch

from linattn.cli.bench import cli, report, roofline, run as run_mod, train
from linattn.cli.bench.inputs import build_inputs
from linattn.cli.bench.reference import check, reference_outputs, row_options
from linattn.cli.bench.workloads import (MODELS, TRAIN_OPS, VARLEN_LENS, load_rows,
                                         train_row, train_rows)
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tr
from linattn.ops.registry import get_spec

F64 = torch.float64


def tiny_train_rows():
    """Each family at awkward sizes: GVA for GDN, varlen with a one-token sequence, an
    initial state, T off the chunk size, the real rows' options."""
    return [
        train_row("GDNTrain", "tiny-gva", 2, 70, 2, 4, 16, 8, MODELS["GDNTrain"][5]),
        train_row("KDATrain", "tiny-varlen", 1, 70, 2, 2, 16, 16, MODELS["KDATrain"][5],
                  seq_lens=(1, 30, 39)),
        train_row("GLATrain", "tiny-h0", 2, 67, 2, 2, 32, 16, h0=True),
        train_row("DeltaNetTrain", "tiny-varlen-h0", 1, 70, 2, 2, 16, 8,
                  MODELS["DeltaNetTrain"][5], seq_lens=(64, 6), h0=True),
    ]


def test_train_rows_cover_the_issue_and_the_check():
    rows = train_rows()
    assert len(rows) == 12 and len({r.key for r in rows}) == 12
    assert all(r.dtype == "bf16" and r.is_train and not r.is_decode for r in rows)
    shapes = {"GDNTrain": (16, 32, 128, 128), "KDATrain": (32, 32, 128, 128),
              "GLATrain": (4, 4, 256, 512), "DeltaNetTrain": (16, 16, 128, 128)}
    for r in rows:
        B, T, H, K = r.shape("q")
        assert (H, r.shape("v")[2], K, r.shape("v")[3]) == shapes[r.op]
        assert B * T == 16384 and r.options["scale"] == K ** -0.5
        kind = r.workload.rsplit("-", 1)[1]
        assert (B, T) == {"4k": (4, 4096), "16k": (1, 16384), "varlen": (1, 16384)}[kind]
        assert ("seq_lens" in r.options) == (kind == "varlen")
        fl, by = roofline.counts(r)
        assert fl > 0 and by > 0
    assert sum(VARLEN_LENS) == 16384 and any(n % 64 for n in VARLEN_LENS)
    # the check's family rule: GDN ops but not GDNF..., KDA, GLA, DeltaNet
    for fam in ("GDN", "KDA", "GLA", "DeltaNet"):
        assert [o for o in TRAIN_OPS if o.startswith(fam) and not o.startswith("GDNF")]


def test_train_rows_are_selected_only_by_name():
    args = lambda *a: cli.parse_args(list(a))  # noqa: E731
    assert not [r for r in cli.select_rows(args()) if r.is_train]
    assert len(cli.select_rows(args())) == len(load_rows())
    assert len(cli.select_rows(args("--op", "train"))) == 12
    got = cli.select_rows(args("--op", "GDNTrain,GDNFwd", "--workload", "qwen3-next-16k"))
    assert [r.key for r in got] == [("GDNTrain", "qwen3-next-16k", "bf16")]
    assert cli.main(["--op", "KDATrain", "--list"]) == 0


def test_train_counts():
    r = train_rows()[0]                                 # GDN 4k x 4
    fwd = 7 * 4 * 4096 * 32 * 128 * 128
    ins = 2 * (2 * 16384 * 16 * 128 + 16384 * 32 * 128 + 16384 * 32) + 4 * 16384 * 32
    assert roofline.counts(r) == (3 * fwd, 3 * ins + 2 * 2 * 16384 * 32 * 128 + 2 * 4 * 32 * 128 * 128 * 4)


@pytest.mark.parametrize("row", tiny_train_rows(), ids=lambda r: r.op)
def test_train_inputs(row):
    x = build_inputs(row, "cpu", seed=5)
    for name, t in row.tensors.items():
        assert tuple(x[name].shape) == tuple(t["shape"]), name
    assert x["q"].dtype == torch.bfloat16 and x["dht"].dtype == torch.float32
    if "g" in x:
        assert x["g"].dtype == torch.float32 and (x["g"] < 0).all()
    if "beta" in x:
        assert ((x["beta"].float() > 0) & (x["beta"].float() < 1)).all()
    n = x["k"].float().norm(dim=-1)
    assert (n - 1).abs().max() > 0.5          # raw: the kernel (or no one) normalises
    assert train.grad_inputs(row)[:3] == ["q", "k", "v"]
    assert ("initial_state" in train.grad_inputs(row)) == ("initial_state" in row.tensors)


def _recurrent_grads(row, x):
    names = train.grad_inputs(row)
    leaves = {n: x[n].detach().to(F64).requires_grad_() for n in names}
    o, ht = tr.recurrent_forward(get_spec(train.FAMILY[row.op]), leaves["q"], leaves["k"],
                                 leaves["v"], leaves.get("g"), leaves.get("beta"),
                                 options=row_options(row), scale=row.options["scale"],
                                 initial_state=leaves.get("initial_state"),
                                 cu_seqlens=x.get("cu_seqlens"))
    grads = torch.autograd.grad((o, ht), [leaves[n] for n in names],
                                (x["do"].to(F64), x["dht"].to(F64)))
    return {"o": o.detach(), "final_state": ht.detach(), **{train.GRAD_OF[n]: g for n, g in zip(names, grads)}}


@pytest.mark.parametrize("row", tiny_train_rows(), ids=lambda r: r.op)
def test_reference_gradients_match_the_recurrence(row):
    x = build_inputs(row, "cpu", seed=7)
    ref = reference_outputs(row, x)
    assert list(ref) == train.output_names(row)
    rec = _recurrent_grads(row, x)
    for name, r in ref.items():
        assert r.dtype == F64 and torch.isfinite(r).all() and r.norm() > 0, name
        assert float((r - rec[name]).norm() / rec[name].norm()) < 1e-10, name


def fake_chunk(op, grad_scale=None, refuse=False):
    """fla's signature over the fp64 recurrence (differentiable), o in the input dtype;
    grad_scale: scale k's gradient (a wrong backward); refuse: raise like linattn does."""
    spec = get_spec(train.FAMILY[op])

    def f(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
          use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
        if refuse:
            raise SpecError(f"{spec.name}: no backward is generated for this call")
        if grad_scale is not None:
            k = _ScaleGrad.apply(k, grad_scale)
        o, ht = tr.recurrent_forward(spec, q, k, v, g, beta,
                                     options=Options(l2norm_qk=use_qk_l2norm_in_kernel),
                                     scale=scale, initial_state=initial_state,
                                     cu_seqlens=cu_seqlens)
        return o.to(q.dtype), ht.float()
    return f


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


@pytest.mark.parametrize("row", tiny_train_rows(), ids=lambda r: r.op)
def test_train_step_through_the_loop(row, monkeypatch):
    fakes = {"linattn": fake_chunk(row.op), "fla": fake_chunk(row.op, grad_scale=1.05)}
    real = train.function
    monkeypatch.setattr(train, "function",
                        lambda impl, op: fakes[impl] if impl in fakes else real(impl, op))
    rec = run_mod.run_row(row, ["linattn", "fla", "torch"], device="cpu", time_it=False)
    ours, fla = rec["impls"]["linattn"], rec["impls"]["fla"]
    assert "torch" not in rec["impls"] and "error" not in rec, rec
    assert ours["ok"], ours["note"]
    assert set(ours["rel_err"]) == set(train.output_names(row))
    assert max(ours["rel_err"].values()) < 1e-2 and ours["ms"] is None
    assert not fla["ok"] and "dk: rel err" in fla["note"] and fla["rel_err"]["dq"] < 1e-2


def test_refusal_is_a_gap(monkeypatch):
    row = tiny_train_rows()[1]
    monkeypatch.setattr(train, "function", lambda impl, op: fake_chunk(op, refuse=True))
    rec = run_mod.run_row(row, ["linattn", "fla"], device="cpu", time_it=True)
    assert rec["impls"]["linattn"]["note"].startswith("not implemented: SpecError: kda")
    assert rec["impls"]["linattn"]["ms"] is None and not rec["impls"]["linattn"]["ok"]
    assert not rec["impls"]["fla"]["ok"] and "not implemented" not in rec["impls"]["fla"]["note"]
    assert rec["impls"]["fla"]["note"].startswith("SpecError")


def test_run_writes_training_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "function", lambda impl, op: fake_chunk(op))
    rows = tiny_train_rows()[::3]
    out = tmp_path / "train.json"
    doc = run_mod.run(rows, ["linattn", "fla"], out_path=str(out), device="cpu", time_it=False)
    saved = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in saved] == ["GDNTrain", "DeltaNetTrain"]
    assert all(r["impls"][n]["ok"] and r["flops"] > 0 for r in saved for n in ("linattn", "fla"))
    assert "### DeltaNetTrain" in report.table(doc["rows"])


def test_step_gradients_do_not_accumulate():
    row = tiny_train_rows()[0]
    x = build_inputs(row, "cpu", seed=3)
    fn = train.step(fake_chunk(row.op), row, x, {"scale": row.options["scale"],
                                                  "output_final_state": True,
                                                  "use_qk_l2norm_in_kernel": True})
    a, b = fn(), fn()
    assert len(a) == 2 + len(train.grad_inputs(row))
    assert all(torch.equal(u, w) for u, w in zip(a, b))
    assert check(dict(zip(train.output_names(row), a)), reference_outputs(row, x), "bf16")[0]


def _record(row, ours, fla, ok=True, note=""):
    imp = lambda ms, ok, note: {"ms": ms, "ok": ok, "note": note, "rel_err": {"dq": 3e-3},  # noqa: E731
                                "peak_mib": 1234.0, "held_mib": 10.0}
    rec = {"op": row.op, "workload": row.workload, "dtype": row.dtype, "seed": row.seed,
           "impls": {"linattn": imp(ours, ok, note), "fla": imp(fla, True, "")}}
    return report.summarize(rec, row)


def test_train_table_merge_and_the_checks_reading(tmp_path):
    rows = train_rows()
    a = _record(rows[0], 2.0, 3.0)
    b = _record(rows[3], None, 5.0, ok=False, note="not implemented: SpecError: kda: no backward")
    assert a["ratio"] == pytest.approx(1.5) and a["tflops"] > 0 and b["ratio"] is None
    text = report.table([a, b])
    assert "### GDNTrain" in text and "### KDATrain" in text
    assert "| qwen3-next-4k | bf16 | 1.50 | 2 | 3 | 1234 | 1234 | 3.0e-03 | 3.0e-03 |" in text
    assert "| kimi-linear-4k | bf16 | - | gap | 5 |" in text
    assert report.geomeans([a, b])["GDNTrain"]["ratio"] == pytest.approx(1.5)
    path = str(tmp_path / "train_h200.json")
    merged = report.merge_into(path, {"gpu": "x", "commit": "c", "rows": [a, b]})
    assert [r["op"] for r in merged["rows"]] == ["GDNTrain", "KDATrain"]
    saved = json.load(open(path))["rows"]
    ms = lambda r, n: (r["impls"][n]["ms"] if r["impls"][n]["ok"] else None)  # noqa: E731
    assert [ms(r, "linattn") for r in saved] == [2.0, None] and ms(saved[0], "fla") == 3.0


def test_peak_memory_needs_cuda_only_where_measured(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        synchronize=lambda: None, empty_cache=lambda: None, reset_peak_memory_stats=lambda: None,
        memory_allocated=lambda: 2 ** 20, max_memory_allocated=lambda: 5 * 2 ** 20)
    monkeypatch.setattr(torch, "cuda", fake)
    assert train.peak_memory(lambda: calls.append(1)) == {"peak_mib": 4.0, "held_mib": 1.0}
    assert calls == [1]


def test_precompile_rounds_until_nothing_new(monkeypatch):
    from linattn.ops import runtime
    rounds = iter([["fwd"], ["fwd", "bwd"], ["fwd", "bwd"], ["never"]])
    compiled = []
    monkeypatch.setattr(run_mod, "_recorded_jobs", lambda rows, device: next(rounds))
    monkeypatch.setattr(runtime, "precompile",
                        lambda jobs, load=False: compiled.append(list(jobs)) or [])
    res = run_mod.precompile_rows(tiny_train_rows()[:1], device="cpu")
    assert compiled == [["fwd"], ["fwd", "bwd"]] and res["requests"] == 3
    rounds = iter([["a"], ["b"]])
    compiled.clear()
    run_mod.precompile_rows(load_rows()[:1], device="cpu")     # inference rows: one round
    assert compiled == [["a"]]
