"""linattn-gen's user errors: one line naming the argument and what is accepted, a
non-zero exit, no traceback; --plan; --compile's report free of TileLang's INFO lines."""
import logging

import pytest
from click.testing import CliRunner

from linattn.cli import gen
from linattn.cli.gen import cli


def _error(argv) -> str:
    """The one line a failing linattn-gen prints (asserting it is one, and exit 2)."""
    res = CliRunner().invoke(cli, argv)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    return lines[0]


@pytest.mark.parametrize("text, named, absent", [
    ("B=1,T=4096", "missing H, K", "unknown"),           # T given: only H and K missing
    ("B=1,H=16,K=128", "missing T", "unknown"),
    ("lens=100:200,K=64", "missing H", "missing T"),     # lens stands for T
])
def test_plan_names_exactly_the_missing_sizes(text, named, absent):
    line = _error(["--op", "gdn", "--plan", text])
    assert "'--plan'" in line and named in line and absent not in line


@pytest.mark.parametrize("token, accepted", [
    ("bf16", "dtype=bf16"),            # a dtype given as a flag
    ("l2norm", "l2norm_qk"),           # a misspelt option flag
    ("Tokens=5", "lens"),              # an unknown key
])
def test_plan_unknown_token_is_named_with_what_is_accepted(token, accepted):
    line = _error(["--op", "gdn", "--plan", f"B=1,T=4096,H=16,K=128,{token}"])
    assert f"unknown {token.split('=')[0]!r}" in line and accepted in line
    assert "__init__" not in line and "keyword argument" not in line


@pytest.mark.parametrize("text, named", [
    ("T=4096,H=16,K=128,dtype=fp8", "dtype 'fp8'; accepted: bf16, f16"),
    ("T=4k,H=16,K=128", "'4k'"),
    ("T=4096,H=16,K=128,allow_neg_eigval", "use_beta_sigmoid_in_kernel"),
])
def test_plan_bad_values_are_one_line(text, named):
    assert named in _error(["--op", "gdn", "--plan", text])


def test_plan_prints_the_plan():
    res = CliRunner().invoke(cli, ["--op", "gdn", "--plan", "B=2,T=4096,H=16,K=128,dtype=f16,ht"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("gdn: plan ") and "dtype=float16" in res.output
    assert "output_final_state=True" in res.output


def test_other_user_errors_are_one_line():
    assert "unknown op 'nope'" in _error(["--op", "nope"])
    assert "--bogus" in _error(["--bogus"])


def test_compile_report_without_tilelang_info(monkeypatch, tmp_path):
    """--compile's report: TileLang's logger is at WARNING while stages compile (its INFO
    "begins / completes to compile" lines would interleave the report) and set back after."""
    from linattn.codegen import compile as comp
    seen = []

    def fake_stage(module, problem, arch):
        log = logging.getLogger("tilelang.jit.kernel")
        seen.append(log.isEnabledFor(logging.INFO))
        return {"op_key": "x", "stage": module.STAGE, "params": problem, "compile_s": 0.0}
    monkeypatch.setattr(comp, "compile_stage", fake_stage)
    import tilelang  # noqa: F401
    before = logging.getLogger("tilelang").level
    res = CliRunner().invoke(cli, ["--op", "gdn", "--variant", "decode", "--compile",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen and not any(seen)
    assert logging.getLogger("tilelang").level == before
    assert "recurrent" in res.output and "INFO" not in res.output


def test_main_exits_non_zero_on_user_error(capsys):
    with pytest.raises(SystemExit) as e:
        gen.main(["--op", "gdn", "--plan", "B=1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing T, H, K" in err[0]


def test_retention_is_a_listed_op():
    """chunk_retention's spec is a shipped family: listed, generated, checked in."""
    res = CliRunner().invoke(cli, ["--list"])
    assert res.exit_code == 0 and "retention  (retention_additive_scalar_c64" in res.output
    res = CliRunner().invoke(cli, ["--op", "retention", "--check"])
    assert res.exit_code == 0 and res.output.startswith("ok: "), res.output

