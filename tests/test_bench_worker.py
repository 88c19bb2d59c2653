"""The benchmark's child-process implementations (cli/bench/remote.py + worker.py) on the
CPU, with a fake backend module: the protocol (tensors there and back, options), a
refusal before and at the call, an error, a crash (the child exits; the next call gets a
new child), a hung child, and the loop recording each as a note without stopping."""
import os
import types

import pytest
import torch

from linattn.cli.bench import impls, remote
from linattn.cli.bench import run as run_mod
from linattn.cli.bench.gaps import NotImplementedImpl

FAKE = '''
import os, time, torch
REFUSALS = (KeyError,)

def describe():
    return {"fake": torch.__version__}

def _late():
    raise KeyError("the call is outside what this backend serves")

def make(op, options, decode, x):
    if op == "Refuse":
        raise NotImplementedError("no such op here")
    if op == "Crash":
        return (lambda: os._exit(7)), None
    if op == "Hang":
        return (lambda: time.sleep(60)), None
    if op == "RefuseLate":
        return _late, None
    if op == "Error":
        return (lambda: 1 / 0), None
    return (lambda: (x["a"] * 2 + options["c"], x["a"].sum())), (lambda r: {"o": r[0], "s": r[1]})
'''


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake_calls.py"
    path.write_text(FAKE)
    r = remote.Remote("fake", str(path), pythonpath=str(tmp_path), answer_s=20)
    yield r
    r.close()


def row(op, **options):
    return types.SimpleNamespace(op=op, options={"c": 1.5, **options}, is_decode=False)


def test_round_trip_and_restart_after_crash(fake):
    a = torch.randn(5, 3)
    call = remote.RemoteCall(fake, row("Ok"), {"a": a})
    out = call()
    assert torch.equal(out["o"], a * 2 + 1.5) and torch.allclose(out["s"], a.sum())
    assert fake.hello["backend"]["fake"] == torch.__version__
    call.close()
    with pytest.raises(remote.WorkerCrashed, match="exit status 7"):
        remote.RemoteCall(fake, row("Crash"), {"a": a})()
    assert fake.proc is None
    again = remote.RemoteCall(fake, row("Ok"), {"a": a + 1})()       # a new child
    assert torch.equal(again["o"], (a + 1) * 2 + 1.5)


def test_refusals_errors_and_hang(fake):
    a = torch.ones(2)
    with pytest.raises(NotImplementedImpl, match="fake refused: NotImplementedError: no such op"):
        remote.RemoteCall(fake, row("Refuse"), {"a": a})
    with pytest.raises(NotImplementedImpl, match="fake refused: KeyError"):
        remote.RemoteCall(fake, row("RefuseLate"), {"a": a})()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        remote.RemoteCall(fake, row("Error"), {"a": a})()
    with pytest.raises(RuntimeError, match="time before prepare|device|CUDA|cuda"):
        remote.RemoteCall(fake, row("Ok"), {"a": a}).device_time(10)
    fake.answer_s = 2
    with pytest.raises(remote.WorkerCrashed, match="no answer in 2 s"):
        remote.RemoteCall(fake, row("Hang"), {"a": a})()
    assert fake.proc is None


def test_bad_backend_file_is_reported(tmp_path):
    bad = tmp_path / "bad_calls.py"
    bad.write_text("import not_a_module_anywhere\n")
    r = remote.Remote("bad", str(bad), pythonpath=str(tmp_path), answer_s=20)
    with pytest.raises(NotImplementedImpl, match="backend import failed: ModuleNotFoundError"):
        r.request({"cmd": "release"})


def test_loop_records_refusal_and_crash(fake, monkeypatch):
    """run_row: a refusal is a gap (ok false, 'not implemented: ...'), a crash a note; the
    row's other implementations still run."""
    from linattn.cli.bench.workloads import Row
    r = Row("DeltaNetRecurrentFwd", "tiny", "bf16",
            {n: {"shape": s, "dtype": None} for n, s in
             dict(q=[2, 2, 8], k=[2, 2, 8], v=[2, 2, 4], beta=[2, 2], state=[2, 2, 8, 4]).items()})
    real = impls.make

    def make(name, row_, x):
        if name == "refuser":
            return remote.RemoteCall(fake, row("Refuse"), {"a": x["q"]}), (lambda res: res)
        if name == "crasher":
            return remote.RemoteCall(fake, row("Crash"), {"a": x["q"]}), (lambda res: res)
        return real(name, row_, x)
    monkeypatch.setattr(impls, "make", make)
    rec = run_mod.run_row(r, ["refuser", "crasher", "torch"], device="cpu", time_it=False,
                          stamp={"run": "r9", "commit": "abc", "gpu": None})
    assert rec["impls"]["refuser"]["ok"] is False
    assert rec["impls"]["refuser"]["note"].startswith("not implemented: fake refused")
    assert "exit status 7" in rec["impls"]["crasher"]["note"] and not rec["impls"]["crasher"].get("fatal")
    assert rec["impls"]["torch"]["ok"] and rec["impls"]["torch"]["run"] == "r9"


def test_remote_impls_need_a_package_path(monkeypatch):
    for impl, (_, names) in remote.BACKENDS.items():
        for n in names:
            monkeypatch.delenv(n, raising=False)
    remote.close_all()
    with pytest.raises(NotImplementedImpl, match="no package path for seed: pass --seed-path"):
        remote.remote_for("seed")
    monkeypatch.setenv("LINATTN_FLASHINFER_PATH", os.getcwd())
    assert remote.remote_for("flashinfer").pythonpath == os.getcwd()
    remote.close_all()
