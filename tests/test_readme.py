"""README.md for users: its CPU example runs as written (the fp64 references), its GPU
example is valid Python, its commands are the ones the package and CI have, and it
carries no lab provenance (run ids, session numbers)."""
import re
from pathlib import Path

import pytest

from _cpu_ops import cpu_ops  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    assert f"\n## {title}\n" in README, f"README.md lost its {title!r} section"
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def python_blocks(text: str) -> list:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_cpu_example_runs_and_its_two_references_agree(capsys):
    (code,) = python_blocks(section("On the CPU: the fp64 references"))
    ns = {"__name__": "readme_cpu_example"}
    exec(compile(code, "README.md (On the CPU)", "exec"), ns)
    o, o2, ht, ht2 = ns["o"], ns["o2"], ns["ht"], ns["ht2"]
    B, T, H, K, V = (ns[n] for n in "BTHKV")
    assert tuple(o.shape) == (B, T, H, V) and tuple(ht.shape) == (B, H, K, V)
    assert str(o.dtype) == "torch.float64"
    assert float((o - o2).abs().max()) < 1e-10 and float((ht - ht2).abs().max()) < 1e-10
    assert float(o.abs().max()) > 1e-3                       # not a trivial zero answer
    printed = capsys.readouterr().out
    assert f"[{B}, {T}, {H}, {V}]" in printed.replace("torch.Size(", "").replace(")", "")


def test_gpu_example_is_python_calling_public_functions():
    import linattn
    (code,) = python_blocks(section("Use it on a GPU"))
    compile(code, "README.md (Use it on a GPU)", "exec")
    for name in re.findall(r"linattn\.(\w+)\(", code):
        assert callable(getattr(linattn, name)), name
    assert len(code.strip().splitlines()) <= 12


def test_gpu_example_calls_are_accepted(cpu_ops):
    """The GPU example as written, on the CPU at small sizes: the public functions with
    their kernels replaced by the fp64 references (tests/_cpu_ops.py), so what is checked
    is the calls' form (positional order, keywords) and the shapes they return."""
    (code,) = python_blocks(section("Use it on a GPU"))
    sizes = "B, T, H, K, V = 2, 4096, 16, 128, 128"
    assert sizes in code and code.count('device="cuda"') >= 3
    code = code.replace(sizes, "B, T, H, K, V = 2, 70, 2, 32, 16").replace('"cuda"', '"cpu"')
    ns = {"__name__": "readme_gpu_example"}
    exec(compile(code, "README.md (Use it on a GPU)", "exec"), ns)
    assert [r[0] for r in cpu_ops] == ["gdn", "gdn"]            # the prefill, the decode
    assert tuple(ns["o"].shape) == (2, 70, 2, 16) and tuple(ns["o1"].shape) == (2, 1, 2, 16)
    assert tuple(ns["ht"].shape) == tuple(ns["ht1"].shape) == (2, 2, 32, 16)
    assert not ns["ht1"].equal(ns["ht"])                         # one more token went in


def test_api_table_names_exist():
    import linattn
    names = re.findall(r"`(\w+)`", section("API").split("| linattn | fla |", 1)[1])
    public = [n for n in names if n.startswith(("chunk_", "fused_", "parallel_"))]
    assert len(public) >= 20
    for name in public:
        assert callable(getattr(linattn, name)), name


def test_commands_are_the_installed_ones_and_ci_runs_the_test_command():
    setup = section("Install and run")
    assert "python3 -m pip install torch==2.13.0 -e . && linattn-gen --op all --arch sm90" in setup
    test_cmd = "python3 -m pip install torch==2.13.0 -e '.[test]' && python3 -m pytest -q"
    assert test_cmd in setup and "--exhaustive" in setup
    assert "linattn-gen --op kda --arch sm90" in README
    ci = (ROOT / ".ci" / "run").read_text()
    # CI runs the README's command (the fast suite), then the rest of the exhaustive one:
    # the tests the default run deselects (conftest.EXHAUSTIVE, less representatives)
    from conftest import EXHAUSTIVE
    assert "python3 -m pytest -q" in ci and "\nsuite fast\n" in ci
    rest = f'-m "({" or ".join(EXHAUSTIVE)}) and not representative"'
    assert f"suite exhaustive-rest -n 2 {rest}" in ci      # (both cores: pytest-xdist)
    assert '"pytest-xdist"' in (ROOT / "pyproject.toml").read_text()
    scripts = (ROOT / "pyproject.toml").read_text()
    assert 'linattn-gen = "linattn.cli.gen:main"' in scripts
    assert 'bench = ["matplotlib"]' in scripts


def test_no_lab_provenance_and_short():
    assert len(README.splitlines()) <= 200
    assert not re.search(r"\bs[0-9]{1,2}-[0-9]\b|[Ss]ession [0-9]+|\brun s[0-9]", README)
    assert "seed" not in README.lower()          # the reference system is named: TileOPs
    speed = README[README.index("## Speed"):]
    speed = speed[:speed.index("\n## ", 1)]
    assert "| vs fla | vs TileOPs' release | vs flashinfer |" in speed   # measured side by side


@pytest.mark.parametrize("doc", ["docs/api.md", "docs/design.md", "bench/RESULTS.md",
                                 "bench/LOG.md", "cli/bench/README.md"])
def test_the_places_it_points_to_exist(doc):
    assert doc in README and (ROOT / doc).is_file()
