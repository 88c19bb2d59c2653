"""A user's own spec end to end: the README's "Add a variant" example, run as written.

The code blocks are read from README.md (so this breaks when the README changes): the
spec file is written to a temp folder, its `linattn-gen` lines run through click's
CliRunner there (generate, --check, --list; the --compile line under the ``compile``
marker), and the Python block runs on the GPU (``gpu``) against the fp64 references it
computes itself. Also: the errors of ``--spec``, ``--out``, the generated header, and
``linattn.build``'s signatures, option errors, dispatch and training path on the CPU.
"""
import inspect
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import linattn
from linattn.cli.gen import cli
from linattn.codegen import plan, render_stage
from linattn.codegen.render import DEFAULT_OUT
from linattn.dsl import OpSpec, Options, SpecError, value_gate_spec
from linattn.ops import api, registry

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Add a variant"
DEVICE = "cuda"    # of the gpu tests
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def readme_example() -> dict:
    """The section's blocks: spec file (name, text), linattn-gen argv lists, Python code."""
    text = README.read_text()
    assert SECTION in text, f"README.md lost its {SECTION!r} section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", body, re.S | re.M)
    (spec_file,) = [b for lang, b in blocks if lang == "python" and b.startswith("# ")
                    and b.split("\n", 1)[0].endswith(".py")]
    (shell,) = [b for lang, b in blocks if lang == "sh"]
    (call,) = [b for lang, b in blocks if lang == "python" and b is not spec_file]
    commands = [shlex.split(line) for line in shell.splitlines() if line.strip()]
    assert all(c[0] == "linattn-gen" for c in commands), commands
    return dict(file=spec_file.split("\n", 1)[0][2:].strip(), spec=spec_file,
                commands=[c[1:] for c in commands], python=call)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The README's spec file in a fresh folder (the cwd), a per-test LINATTN_GEN_DIR."""
    ex = readme_example()
    (tmp_path / ex["file"]).write_text(ex["spec"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LINATTN_GEN_DIR", str(tmp_path / "gen"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, Path(ex["file"]).stem, raising=False)
    return tmp_path, ex


def _run(argv):
    res = CliRunner().invoke(cli, argv)
    assert res.exit_code == 0, f"linattn-gen {' '.join(argv)}:\n{res.output}"
    return res.output


def _user_spec(ex):
    ref = next(a for c in ex["commands"] for a in c if a.startswith(ex["file"] + ":"))
    return registry.load_spec(ref)


def test_readme_generate_check_list(workdir):
    tmp, ex = workdir
    spec = _user_spec(ex)
    before = sorted(p.name for p in (DEFAULT_OUT / "sm90").iterdir())
    commands = [c for c in ex["commands"] if "--compile" not in c]
    assert any("--check" in c for c in commands) and any("--list" in c for c in commands)
    outputs = [_run(c) for c in commands]
    folder = tmp / "gen" / "sm90" / spec.name
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted(
        ["__init__"] + [s.name for s in plan(spec)])
    assert "--spec FILE.py:NAME" in (folder / "recurrent.py").read_text().splitlines()[3]
    assert any(o.startswith("ok: ") for o in outputs)
    assert any(f"{spec.name}  ({spec.key}, hash {spec.hash})" in o for o in outputs)
    assert sorted(p.name for p in (DEFAULT_OUT / "sm90").iterdir()) == before  # untouched
    # the spec changes: --check fails, naming the stale files and the command to run
    edited = ex["spec"].replace("chunk_size=64", "chunk_size=32")
    assert edited != ex["spec"], "the README's spec no longer says chunk_size=64"
    (tmp / ex["file"]).write_text(edited)
    check = next(c for c in commands if "--check" in c)
    res = CliRunner().invoke(cli, check)
    assert res.exit_code == 1 and f"stale   sm90/{spec.name}/recurrent.py" in res.output
    assert f"run linattn-gen --spec {check[1]}" in res.output


@pytest.mark.compile
@needs_nvcc
def test_readme_compile(workdir):
    _, ex = workdir
    commands = [c for c in ex["commands"] if "--compile" in c]
    assert commands
    for argv in commands:
        out = _run(argv)
        assert "recurrent" in out and "regs=" in out and "ERROR" not in out, out


def test_spec_module_form_and_out(workdir):
    tmp, ex = workdir
    ref = next(a for c in ex["commands"] for a in c if a.startswith(ex["file"] + ":"))
    module_ref = ref.replace(".py:", ":")                   # my_variants:SIMPLE_GLA
    out = _run(["--spec", module_ref, "--variant", "decode", "--out", str(tmp / "mine")])
    name = _user_spec(ex).name
    assert f"wrote sm90/{name}/recurrent.py" in out
    assert (tmp / "mine" / "sm90" / name / "recurrent.py").is_file()
    assert not (tmp / "gen").exists()                       # --out given: nothing else
    assert "gdn  (gdn_delta_scalar_c64" in _run(["--spec", "linattn.ops.gdn:SPEC", "--list"])


BAD_SPECS = {
    "bad_form": ("my_variants.py", "give FILE.py:NAME or module:NAME"),
    "missing_file": ("nope.py:X", "no spec file 'nope.py'"),
    "missing_module": ("no_such_module:X", "no module 'no_such_module'"),
    "missing_name": ("my_variants.py:NOPE", "my_variants.py has no 'NOPE'; its OpSpecs: "
                     "SIMPLE_GLA"),
    "not_an_opspec": ("my_variants.py:OpSpec", "my_variants.py:OpSpec is a type, not an "
                      "OpSpec"),
    "invalid_spec": ("bad.py:X", "bad.py: invalid spec: chunk_size must be 16, 32 or 64"),
    "broken_file": ("broken.py:X", "broken.py failed to load: NameError"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_spec_errors_are_one_line(workdir, case):
    tmp, _ = workdir
    (tmp / "bad.py").write_text("from linattn import OpSpec\n"
                                "X = OpSpec(name='x', rule='delta', gate='none', "
                                "chunk_size=128)\n")
    (tmp / "broken.py").write_text("X = undefined_name\n")
    ref, message = BAD_SPECS[case]
    res = CliRunner().invoke(cli, ["--spec", ref, "--check"])
    assert res.exit_code == 2, res.output
    err = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(err) == 1 and "'--spec'" in err[0] and message in err[0], res.output


def test_op_and_spec_together_or_unknown_op(workdir):
    res = CliRunner().invoke(cli, ["--op", "gdn", "--spec", "my_variants.py:SIMPLE_GLA"])
    assert res.exit_code == 2 and "not both" in res.output
    res = CliRunner().invoke(cli, ["--op", "my_variants.py:SIMPLE_GLA"])
    assert res.exit_code == 2 and "--spec FILE.py:NAME" in res.output


def test_registered_header_names_op():
    spec = registry.get_spec("gdn")
    text = render_stage(spec, plan(spec, "decode")[0])
    assert text.splitlines()[3] == "# regenerate: linattn-gen --op gdn --arch sm90"


# -- linattn.build on the CPU ---------------------------------------------------------------

SIMPLE = OpSpec(name="simple_gla_test", rule="additive", gate="scalar",
                supports={"l2norm_qk"}, default_scale=0.5)
DELTA_KEY = OpSpec(name="delta_key_test", rule="delta", gate="key", chunk_size=32,
                   supports={"beta_sigmoid", "gate_in_kernel", "state_v_first"})
MY_DELTANET = OpSpec(name="my_deltanet", rule="delta", gate="none", default_scale=0.25,
                     supports={"l2norm_qk"}, gva=False)


def test_build_signatures_hold_only_what_the_spec_has():
    ops = linattn.build(SIMPLE)
    assert list(inspect.signature(ops.chunk).parameters) == [
        "q", "k", "v", "g", "scale", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "cu_seqlens", "cu_seqlens_cpu", "kwargs"]
    rec = inspect.signature(linattn.build(DELTA_KEY).fused_recurrent).parameters
    assert list(rec)[:5] == ["q", "k", "v", "g", "beta"] and rec["beta"].default is None
    assert {"use_beta_sigmoid_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias",
            "state_v_first"} <= set(rec) and "use_qk_l2norm_in_kernel" not in rec
    assert "g" not in inspect.signature(linattn.build(MY_DELTANET).chunk).parameters
    assert "[B, T, HV]" in ops.chunk.__doc__ and SIMPLE.name in ops.chunk.__name__
    assert ops.spec is SIMPLE and ops.has_backward          # (the additive rule trains)
    assert not linattn.build(DELTA_KEY).has_backward
    assert linattn.build(value_gate_spec()).has_backward     # (through its key-gated twin)
    assert linattn.build(MY_DELTANET).has_backward
    assert not linattn.build(MY_DELTANET.replace(chunk_size=32)).has_backward
    with pytest.raises(SpecError, match="build\\(\\) takes an OpSpec"):
        linattn.build("gdn")


def _tensors(B=1, T=8, H=2, K=16, V=16, gate_k=False, requires_grad=False):
    import torch
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V, requires_grad=requires_grad)
    g = torch.randn(B, T, H, K) if gate_k else torch.randn(B, T, H)
    return q, k, v, g


@pytest.mark.parametrize("kwargs, message", [
    (dict(use_beta_sigmoid_in_kernel=True), "takes no use_beta_sigmoid_in_kernel"),
    (dict(beta=None), "takes no beta"),
    (dict(A_log=None), "takes no A_log"),
    (dict(transpose_state_layout=True), "does not support \\['state_v_first'\\]"),
    (dict(chunk_size=32), "built for chunk_size 64"),
    (dict(head_first=True), "linattn does not support head_first=True"),
])
def test_build_rejects_what_the_spec_lacks(kwargs, message):
    ops = linattn.build(SIMPLE)
    for fn in (ops.chunk, ops.fused_recurrent):
        with pytest.raises(SpecError, match=message):
            fn(*_tensors(), **kwargs)
    with pytest.raises(TypeError, match="'g'"):
        ops.chunk(*_tensors()[:3])


def test_build_dispatch(monkeypatch):
    """chunk -> api.forward, fused_recurrent -> api.recurrent, with the options, every
    keyword, and beta_ones when fused_recurrent gets no beta (ones, as in fla)."""
    import torch
    seen = {}
    monkeypatch.setattr(api, "forward", lambda *a, **kw: seen.setdefault("chunk", (a, kw)))
    monkeypatch.setattr(api, "recurrent",
                        lambda *a, **kw: seen.setdefault("recurrent", (a, kw)))
    ops = linattn.build(DELTA_KEY)
    q, k, v, g = _tensors(gate_k=True)
    beta = torch.rand(1, 8, 2)
    ops.chunk(q, k, v, g, beta, 0.3, use_beta_sigmoid_in_kernel=True, state_v_first=True,
              chunk_size=32)
    ops.fused_recurrent(q, k, v, g, output_final_state=True, use_gate_in_kernel=True,
                        A_log=torch.zeros(2), dt_bias=torch.zeros(2 * 16))
    a, kw = seen["chunk"]
    assert a[0] is DELTA_KEY and a[4] is g and a[5] is beta and kw["scale"] == 0.3
    assert kw["options"] == Options(beta_sigmoid=True, state_v_first=True)
    a, kw = seen["recurrent"]
    assert kw["options"] == Options(gate_in_kernel=True) and kw["output_final_state"]
    assert a[5] is None and kw["beta_ones"] and kw["A_log"] is not None


def test_build_without_backward_trains_exactly():
    """A spec with no generated backward (a chunk size of 32) trains exactly in torch
    (ops/exact_train.py), as float32 calls of every spec do: checked first, these CPU
    tensors then fail the device check."""
    ops = linattn.build(DELTA_KEY)
    q, k, v, g = _tensors(gate_k=True, requires_grad=True)
    with pytest.raises(SpecError, match="q is on cpu"):
        ops.chunk(q, k, v, g, torch_rand_like(g[..., 0]))
    for fn in (linattn.build(SIMPLE).chunk, linattn.build(SIMPLE).fused_recurrent):
        with pytest.raises(SpecError, match="q is on cpu"):
            fn(*_tensors(requires_grad=True))


def torch_rand_like(x):
    import torch
    return torch.rand_like(x)


from test_autograd import fake_kernels  # noqa: E402,F401 (the emulated kernels fixture)


def test_build_trains_a_deltanet_like_spec(fake_kernels, rng):
    """A user spec with DeltaNet's maths trains through DeltaNet's backward at its own
    default scale; gradients match fp64 autograd of the reference of that spec."""
    import torch
    from linattn.dsl import torch_reference as tref
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, T, H, K, V = 1, 70, 2, 64, 64
    xs = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), torch.sigmoid(r(B, T, H))]
    xs = [x.to(torch.float16) for x in xs]
    do = r(B, T, H, V).to(torch.float16)
    leaves = [x.clone().requires_grad_() for x in xs]
    o, _ = linattn.build(MY_DELTANET).chunk(*leaves, use_qk_l2norm_in_kernel=True)
    (o.float() * do.float()).sum().backward()
    assert "chunk_bwd_fold_tail" in fake_kernels
    refs = [x.to(torch.float64).requires_grad_() for x in xs]
    o_r, _ = tref.chunked_forward(MY_DELTANET, *refs[:3], beta=refs[3],
                                  options=Options(l2norm_qk=True))
    (o_r * do.to(torch.float64)).sum().backward()
    for x, ref in zip(leaves, refs):
        err = float((x.grad.double() - ref.grad).norm() / ref.grad.norm())
        assert err < 5e-3, err


MY_GDN = OpSpec(name="my_gdn_user", rule="delta", gate="scalar", chunk_size=64,
                supports={"l2norm_qk", "beta_sigmoid", "gate_in_kernel"})


def test_build_trains_a_gdn_like_spec(fake_kernels, rng):
    """A user spec with Gated DeltaNet's maths trains through the gated backward (its own
    stages, beta's sigmoid and the gate's activation by torch); GVA. A_log <= 0: a chunk's
    log decay stays within the fp64 chunked reference's range (A_log 3.6 took it to -2349
    and every gradient, the reference's too, to NaN)."""
    import torch
    from linattn.dsl import torch_reference as tref
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, T, H, HV, K, V = 1, 70, 1, 2, 64, 64
    xs = dict(q=r(B, T, H, K).half(), k=r(B, T, H, K).half(), v=r(B, T, HV, V).half(),
              g=r(B, T, HV).float(), beta=r(B, T, HV).half(), A_log=-r(HV).abs().float(),
              dt_bias=r(HV).float())
    do = r(B, T, HV, V).to(torch.float16)
    leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 use_gate_in_kernel=True)
    ops = linattn.build(MY_GDN)
    assert ops.has_backward
    o, _ = ops.chunk(**leaves, **flags)
    (o.float() * do.float()).sum().backward()
    assert "chunk_bwd_wy" in fake_kernels
    refs = {n: x.to(torch.float64).requires_grad_() for n, x in xs.items()}
    o_r, _ = tref.chunked_forward(MY_GDN, **refs, options=Options(
        l2norm_qk=True, beta_sigmoid=True, gate_in_kernel=True))
    (o_r * do.to(torch.float64)).sum().backward()
    for n, x in leaves.items():
        err = float((x.grad.double() - refs[n].grad).norm() / refs[n].grad.norm())
        assert err < (3e-2 if n in ("A_log", "dt_bias") else 5e-3), (n, err)


def test_chunk_sizes_the_chunked_kernels_do_not_run_take_the_recurrent_kernel():
    """A spec at chunk 16 / 32 is computed by the recurrent kernel (exact for any chunk
    size): sm90's chunked kernels are GPU-checked at chunk 64 only (CHUNK_SIZES)."""
    import torch
    from linattn.codegen.arch import get_arch
    from linattn.ops import validate
    dims = validate.Dims(B=1, T=300, H=2, HV=4, K=128, V=128)
    for C in (16, 32, 64):
        spec = OpSpec(name=f"gated_delta_c{C}_route", rule="delta", gate="scalar", chunk_size=C)
        want = "chunk" if C in get_arch("sm90").CHUNK_SIZES else "recurrent"
        assert api.choose_path(spec, dims, torch.bfloat16, varlen=False) == want, C
    assert get_arch("sm90").CHUNK_SIZES == (64,)


def test_build_training_checks_first():
    import torch
    ops = linattn.build(MY_DELTANET.replace(supports=frozenset({"l2norm_qk",
                                                                 "state_v_first"})))
    q, k, v, _ = _tensors(K=64, V=64)
    q, k, v = (x.half().requires_grad_() for x in (q, k, v))
    beta = torch.rand(1, 8, 2).half()
    with pytest.raises(SpecError, match="on cpu"):      # (state_v_first trains: accepted)
        ops.chunk(q, k, v, beta, state_v_first=True)
    q, k = (torch.zeros(1, 8, 2, 160, dtype=torch.half, requires_grad=True) for _ in "qk")
    with pytest.raises(SpecError, match="on cpu"):      # (K past 128: exact_train)
        ops.chunk(q, k, v, beta, state_v_first=True)


# -- the README's Python call on the GPU -------------------------------------------------------

@pytest.mark.gpu
def test_readme_python_call_matches_fp64(workdir):
    from conftest import rel_err
    _, ex = workdir
    ns = {"__name__": "readme_example"}
    exec(compile(ex["python"], "README.md (Add a variant)", "exec"), ns)
    errs = {"o": rel_err(ns["o"], ns["ref_o"]), "ht": rel_err(ns["ht"], ns["ref_ht"]),
            "o1": rel_err(ns["o1"], ns["ref_o1"]), "ht1": rel_err(ns["ht1"], ns["ref_ht1"])}
    print(errs)
    assert all(e < 1e-2 for e in errs.values()), errs       # bf16 inputs (NaN fails too)


GPU_SPECS = [   # spec, B, T, H, HV, K, V, options, varlen lengths
    # (chunk 32: the chunked call takes the recurrent kernel, sm90's CHUNK_SIZES; run s7-4
    # found the chunk-32 kernels wrong before that routing)
    pytest.param(OpSpec(name="gated_delta_c32_user", rule="delta", gate="scalar", chunk_size=32,
                        supports={"l2norm_qk", "beta_sigmoid", "gate_in_kernel"}),
                 1, None, 2, 4, 128, 128, ("l2norm_qk", "beta_sigmoid", "gate_in_kernel"),
                 (1, 63, 200, 33), id="delta-scalar-c32-gva-varlen-all"),
    pytest.param(OpSpec(name="gla_vfirst_user", rule="additive", gate="key", gva=False,
                        supports={"state_v_first"}, default_scale=1.0),
                 2, 130, 2, 2, 64, 128, ("state_v_first",), None, id="additive-key-vfirst"),
    pytest.param(MY_DELTANET, 2, 100, 2, 2, 64, 64, ("l2norm_qk",), None,
                 id="my-deltanet-l2norm"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec, B, T, H, HV, K, V, opts, lens", GPU_SPECS)
def test_build_forward_and_decode_match_fp64(spec, B, T, H, HV, K, V, opts, lens):
    """linattn.build(spec).chunk / .fused_recurrent of specs outside the registry
    (rendered on the fly) against the fp64 chunked / recurrent references of the spec."""
    import torch
    from conftest import rel_err
    from linattn.dsl import torch_reference as tref
    dev, dt = DEVICE, torch.bfloat16
    T = sum(lens) if lens else T
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                                dtype=torch.int32, device=dev)
    N = B if cu is None else len(lens)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1)
            .to(dt) for _ in "qk")
    v = torch.randn(B, T, HV, V, device=dev, dtype=dt)
    gshape = (B, T, HV) if spec.gate.value == "scalar" else (B, T, HV, K)
    g = torch.nn.functional.logsigmoid(torch.randn(*gshape, device=dev)) if spec.has_gate \
        else None
    beta = torch.randn(B, T, HV, device=dev) if spec.has_beta else None
    if spec.has_beta and "beta_sigmoid" not in opts:
        beta = beta.sigmoid()
    extra = {}
    if "gate_in_kernel" in opts:
        extra = dict(A_log=torch.randn(HV, device=dev) * 0.5, dt_bias=torch.randn(HV, device=dev))
    h0_shape = (N, HV, V, K) if "state_v_first" in opts else (N, HV, K, V)
    h0 = torch.randn(*h0_shape, device=dev) * 0.1
    flags = {build_flag(n): True for n in opts}
    args = [x for x in (q, k, v, g, beta) if x is not None]
    ops = linattn.build(spec)
    options = Options(**{n: True for n in opts})
    ref = dict(options=options, initial_state=h0, cu_seqlens=cu, **extra)
    gb = {"g": g, "beta": beta}
    for fn, reference in ((ops.chunk, tref.chunked_forward),
                          (ops.fused_recurrent, tref.recurrent_forward)):
        o, ht = fn(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                   **flags, **extra)
        ro, rht = reference(spec, q, k, v, **gb, **ref)
        errs = {"o": rel_err(o, ro), "ht": rel_err(ht, rht)}
        print(spec.name, fn.__name__, errs)
        assert all(e < 1e-2 for e in errs.values()), (fn.__name__, errs)


def build_flag(option: str) -> str:
    from linattn.ops.build import FLA_OPTION
    return FLA_OPTION[option]


@pytest.mark.gpu
def test_build_trains_deltanet_like_spec_on_gpu():
    """MY_DELTANET (DeltaNet's maths, its own default scale) through the generated
    backward: gradients of q, k, v, beta, h0 against fp64 autograd of the reference."""
    import torch
    from conftest import GRAD_TOL, rel_err
    from linattn.dsl import torch_reference as tref
    dev, dt = DEVICE, torch.bfloat16
    B, T, H, K, V = 2, 130, 2, 128, 64
    xs = [torch.randn(B, T, H, K, device=dev), torch.randn(B, T, H, K, device=dev),
          torch.randn(B, T, H, V, device=dev), torch.rand(B, T, H, device=dev)]
    xs = [x.to(dt) for x in xs] + [torch.randn(B, H, K, V, device=dev) * 0.1]
    do = torch.randn(B, T, H, V, device=dev, dtype=dt)
    dht = torch.randn(B, H, K, V, device=dev)
    leaves = [x.clone().requires_grad_() for x in xs]
    o, ht = linattn.build(MY_DELTANET).chunk(*leaves[:4], initial_state=leaves[4],
                                             output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    refs = [x.double().requires_grad_() for x in xs]
    ro, rht = tref.chunked_forward(MY_DELTANET, *refs[:3], beta=refs[3], initial_state=refs[4],
                                   options=Options(l2norm_qk=True))
    ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
    errs = {"o": rel_err(o, ro), **{n: rel_err(x.grad, r.grad) for n, x, r in
                                    zip(("dq", "dk", "dv", "dbeta", "dh0"), leaves, refs)}}
    print(errs)
    assert all(e < GRAD_TOL["bfloat16"] for e in errs.values()), errs
