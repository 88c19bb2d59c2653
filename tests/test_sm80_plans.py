"""The sm80 arch's plans on the CPU (issue 50): which kernels they launch (only those
generated for sm80: no walk, whose warpgroup roles sm80 lacks), the arch a call resolves,
and the delta rule's sm80 forward and training backward run end to end with every
kernel replaced by a fake checked against the sm80 module's traced signature and running
the stage's fp64 formula (tests/test_chunk_bwd.py install_fakes). The kernels themselves
run on the GPU: tests/test_sm80_gpu.py."""
import os
import shutil

import pytest
import torch

import linattn

import test_additive_bwd
import test_autograd
import test_chunk_bwd
import test_sm80_gpu
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)
from conftest import rel_err
from linattn.codegen import plan as stage_plan
from linattn.codegen.arch import DEFAULT_ARCH, arch_for_capability, compile_target, get_arch
from linattn.codegen.pipeline import AdditiveBackwardProblem
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tref
from linattn.ops import additive_bwd, chunk, chunk_bwd, runtime, validate
from linattn.ops.api import has_chunked_forward
from linattn.ops.registry import get_spec, specs

ARCH = "sm80"
F64 = torch.float64
KB = 1024
H100 = runtime.DeviceFacts("NVIDIA H100 80GB HBM3", (9, 0), 227 * KB)
A100 = runtime.DeviceFacts("NVIDIA A100-SXM4-80GB", (8, 0), 163 * KB)
RTX_4090 = runtime.DeviceFacts("NVIDIA GeForce RTX 4090", (8, 9), 99 * KB)
A6000 = runtime.DeviceFacts("NVIDIA RTX A6000", (8, 6), 99 * KB)


def test_capabilities_and_default():
    assert DEFAULT_ARCH == "sm90"
    assert arch_for_capability(9, 0) == "sm90"
    assert [arch_for_capability(8, m) for m in (0, 6, 7, 9)] == ["sm80"] * 4
    assert runtime.arch_of("cpu") == DEFAULT_ARCH
    hw = get_arch(ARCH).hardware
    assert (hw.NAME, hw.TARGET["arch"], hw.FEATURES) == ("sm80", "sm_80", frozenset())
    assert get_arch("sm90").hardware.FEATURES >= {"wgmma", "tma", "setmaxnreg", "warpgroups"}


def test_compile_target_follows_the_device():
    """sm80's kernels: sm_80 code (mma.sync, cp.async), compiled to the device's own SM past
    8.x (an sm_80 cubin does not load on an H100: CUDA_ERROR_NO_BINARY_FOR_GPU); sm90's
    (wgmma, TMA: sm_90a) run on 9.x alone."""
    sm_80 = {"kind": "cuda", "arch": "sm_80"}
    assert compile_target(ARCH) == compile_target(ARCH, (8, 0)) == sm_80
    assert compile_target(ARCH, (8, 6)) == compile_target(ARCH, (8, 9)) == sm_80
    assert compile_target(ARCH, (9, 0)) == dict(sm_80, code=["sm_90"])
    assert compile_target(ARCH, (12, 0)) == dict(sm_80, code=["sm_120"])
    assert compile_target("sm90", (9, 0)) == compile_target("sm90") == \
        {"kind": "cuda", "arch": "sm_90a"}
    for arch, cap, serves in (("sm90", (8, 0), "9.x"), ("sm90", (10, 0), "9.x"),
                              ("sm80", (7, 5), "8.x")):
        with pytest.raises(SpecError, match=rf"^{arch}'s kernels do not run on compute "
                                            rf"capability {cap[0]}\.{cap[1]} \(they serve "
                                            rf"{serves}"):
            compile_target(arch, cap)


@pytest.fixture
def fake_device(monkeypatch):
    """``fake_device(facts)``: CUDA device 0 (the current one) is ``facts`` to ops.runtime
    (its arch, compile target, shared memory), on this machine without a GPU."""
    def install(facts, arch=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setitem(runtime._DEVICES, 0, facts)
        if arch:
            monkeypatch.setitem(runtime._ARCH_BY_DEVICE, 0, arch)
        else:
            monkeypatch.delitem(runtime._ARCH_BY_DEVICE, 0, raising=False)
    return install


@pytest.mark.parametrize("facts, arch, target", [
    (H100, ARCH, {"kind": "cuda", "arch": "sm_80", "code": ["sm_90"]}),
    (A100, None, {"kind": "cuda", "arch": "sm_80"}),
    (H100, None, {"kind": "cuda", "arch": "sm_90a"})], ids=["forced-on-h100", "a100", "h100"])
def test_kernels_compile_for_the_device(monkeypatch, fake_device, facts, arch, target):
    """A call's kernels compile with the target of its arch on the device at hand (the sm80
    arch forced on an H100, as tests/test_sm80_gpu.py does: sm_80 code for sm_90), and
    precompile hands its workers this process's target."""
    import tilelang
    fake_device(facts, arch)
    arch = runtime.device_arch("cuda:0")
    assert arch == (ARCH if facts is not H100 or target.get("code") else "sm90")
    targets = []
    monkeypatch.setattr(tilelang, "compile", lambda func, target, **kw: targets.append(target))
    monkeypatch.setattr(runtime, "_KERNELS", {})
    spec = get_spec("gdn")
    module = runtime.stage_module(spec, "chunk_kkt_inverse", arch)
    params = dict(get_arch(arch).tuning("chunk_kkt_inverse", module.EXAMPLES[0]),
                  **module.EXAMPLES[0])
    runtime.compile_stage(spec, "chunk_kkt_inverse", arch, params)
    assert targets == [target]
    jobs = []

    class Pool:                           # (no processes: the jobs and targets it is given)
        def __init__(self, *a, **kw): pass
        def __enter__(self): return self
        def __exit__(self, *exc): pass
        def map(self, fn, *its): return [jobs.append(a) or (None, 0.0) for a in zip(*its)]
    import concurrent.futures
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    assert runtime.precompile([(spec, "chunk_kkt_inverse", arch, dict(params, BT=32))]) == []
    assert [t for _, t in jobs] == [target]


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sm80_stage_compiles_for_sm90():
    """An sm80 stage compiled for an H100 (compile_target(sm80, 9.0)): TileLang lowers it for
    sm_80 (mma.sync, no wgmma or TMA: the sm80 kernel), nvcc builds its SASS for sm_90."""
    spec = get_spec("gdn")
    module = runtime.stage_module(spec, "chunk_kkt_inverse", ARCH)
    params = dict(get_arch(ARCH).tuning("chunk_kkt_inverse", module.EXAMPLES[0]),
                  **module.EXAMPLES[0])
    kernel = runtime.compile_stage(spec, "chunk_kkt_inverse", ARCH, params,
                                   target=compile_target(ARCH, (9, 0)))
    src = kernel.get_kernel_source()
    assert (kernel.target.attrs["arch"], list(kernel.target.attrs["code"])) == ("sm_80",
                                                                                ["sm_90"])
    assert "mma" in src and not any(w in src for w in ("wgmma", "tma_load", "cp.async.bulk"))


DELTA_TRAINING = {  # fn: (what, its gate's inputs' shapes and dtypes)
    "chunk_delta_rule": ("the DeltaNet backward", "none"),
    "chunk_gated_delta_rule": ("the Gated DeltaNet backward", "scalar"),
    "chunk_kda": ("the KDA backward", "key")}


@pytest.mark.parametrize("fn, facts", [
    *((fn, facts) for fn in sorted(DELTA_TRAINING) for facts in (RTX_4090, A6000)),
    ("chunk_kda", A100)], ids=lambda x: x if isinstance(x, str) else ".".join(map(str, x[1])))
def test_training_refused_where_the_backward_does_not_fit(monkeypatch, fake_device, fn,
                                                          facts):
    """The delta rule's training on an 8.6 / 8.9 card (99 KB of shared memory a block; its
    sm80 backward takes 104-177 KB) and KDA's on the A100 (163 KB): refused in one line,
    before any kernel is compiled or launched (the inputs are fake CUDA tensors)."""
    import linattn
    from torch._subclasses.fake_tensor import FakeTensorMode
    what, gate = DELTA_TRAINING[fn]
    need = get_arch(ARCH).hardware.BACKWARD_SMEM_BYTES[("delta", gate)]
    fake_device(facts)
    monkeypatch.setattr(runtime, "_compiled", lambda *a, **kw: pytest.fail("a kernel compiled"))
    B, T, H, K = 1, 128, 2, 64
    with FakeTensorMode():
        x = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt, device="cuda",  # noqa: E731
                                                     requires_grad=True)
        q, k, v, beta = x(B, T, H, K), x(B, T, H, K), x(B, T, H, K), x(B, T, H)
        g = {"none": (), "scalar": (x(B, T, H, dt=torch.float32),),
             "key": (x(B, T, H, K, dt=torch.float32),)}[gate]
    cap = ".".join(map(str, facts.capability))
    with pytest.raises(SpecError, match=rf"^{what} does not run on {facts.name} \(compute "
                                        rf"capability {cap}, {facts.smem_per_block // KB} KB "
                                        rf"of shared memory a block\): sm80's backward "
                                        rf"kernels for it take {need / KB:.1f} KB; inference "
                                        r"runs there$"):
        getattr(linattn, fn)(q, k, v, *g, beta)


@pytest.mark.parametrize("facts, arch", [(RTX_4090, None), (A100, None), (H100, None),
                                         (H100, ARCH)], ids=["8.9", "8.0", "9.0", "9.0-sm80"])
def test_training_allowed_where_the_backward_fits(fake_device, facts, arch):
    """Where every stage fits: each (rule, gate) on the A100 but KDA, the additive rule's
    on 8.6 / 8.9 too (GLA's backward 96 KB), everything on an H100 (sm90, or the sm80 arch
    forced there: 227 KB, as tests/test_sm80_gpu.py trains)."""
    fake_device(facts, arch)
    table = get_arch(runtime.device_arch("cuda:0")).hardware.BACKWARD_SMEM_BYTES
    allowed = [k for k in get_arch(ARCH).hardware.BACKWARD_SMEM_BYTES
               if table.get(k, 0) <= facts.smem_per_block]
    assert allowed == ([k for k in table if k[0] == "additive"] if facts is RTX_4090 else
                       [k for k in table if k != ("delta", "key")] if facts is A100 else
                       list(get_arch(ARCH).hardware.BACKWARD_SMEM_BYTES))
    for rule, gate in allowed:
        runtime.check_training(torch.device("cuda", 0), rule, gate, "training")


def test_sm80_modules_are_its_own():
    """sm90's plan modules loaded as sm80's: the same code, sm80's numbers."""
    from linattn.codegen.arch.sm80 import forward as f80, stages as s80
    from linattn.codegen.arch.sm90 import forward as f90
    assert f80 is not f90 and os.path.samefile(f80.__file__, f90.__file__)
    assert (f80.hw.NUM_SMS, f90.hw.NUM_SMS) == (108, 132) and s80.NAME == "sm80"


#: (the dplr rule's chunked stages are sm90's: plan.DPLR_FEATURES; it has none here)
@pytest.mark.parametrize("name", sorted(n for n, s in specs().items() if has_chunked_forward(s)
                                        and stage_plan(s, "fwd", ARCH)))
def test_sm80_plans_launch_only_its_stages(name):
    """Forward plans at few and many chains, training's, the backward's: every stage is one
    generated for sm80, no walk."""
    spec = get_spec(name)
    have = {s.name for s in stage_plan(spec, None, ARCH)}
    assert not any(s.startswith("chunk_walk") for s in have)
    launched = set()
    for seqs, H in (((4,), 1), ((64,) * 8, 32), ((300, 2, 17), 4)):
        for save in (False, True) if spec.rule.value == "delta" else (False,):
            p = chunk.forward_plan(spec, Options(), ARCH, H=H, HV=H, K=128, V=128,
                                   dtype="bfloat16", g_dtype="float32",
                                   beta_dtype="bfloat16", Ttot=64 * sum(seqs),
                                   seq_chunks=seqs, output_final_state=True, save_states=save)
            assert p.arch == ARCH and not p.name.startswith("walk"), p.name
            launched |= {la.stage for la in p.launches}
        if spec.rule.value == "delta":
            train = (chunk_bwd.key_train_params if spec.gate.value == "key"
                     else chunk_bwd.train_params)
            launched |= set(train(H=H, HV=H, K=128, V=128, dtype="bfloat16",
                                  chains=len(seqs) * H, l2norm=True, spec=spec, arch=ARCH))
        elif spec.rule.value == "additive":   # (Comba's and GDN-2's: forward only)
            bp = additive_bwd.backward_plan(AdditiveBackwardProblem(
                gate=spec.gate.value, H=H, HV=H, K=128, V=128, dtype="bfloat16",
                g_dtype="float32", grad_dtype="bfloat16", seq_chunks=seqs), None, ARCH)
            launched |= {la.stage for la in bp.launches}
    assert launched <= have, launched - have


def _delta_inputs(name, B, T, H, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(B, T, H, K), dim=-1).half() for _ in range(2))
    gate = (torch.nn.functional.logsigmoid(r(B, T, H)) / 8).float() if name == "gdn" else None
    return q, k, r(B, T, H, V).half(), gate, torch.sigmoid(r(B, T, H)).half(), \
        r(B, H, K, V).float()


@pytest.mark.parametrize("save", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", ["deltanet", "gdn"])
def test_sm80_delta_forward_emulated(monkeypatch, name, save):
    """DeltaNet / GDN forward on sm80's three-stage plan (the walk's family without the
    walk), every stage faked (signature of the sm80 module, fp64 formula), vs fp64."""
    names = test_chunk_bwd.install_fakes(monkeypatch)
    monkeypatch.setattr(runtime, "arch_of", lambda device: ARCH)
    spec = get_spec(name)
    q, k, v, g, beta, h0 = _delta_inputs(name, 2, 130, 2, 64, 64)
    o, ht, *saved = chunk.run_chunk_forward(spec, q, k, v, g, beta, 0.125, h0, True,
                                            Options(), save_states=save)
    ro, rh = tref.chunked_forward(spec, q.double(), k.double(), v.double(),
                                  None if g is None else g.double(), beta.double(),
                                  scale=0.125, initial_state=h0.double())
    assert float((o.double() - ro).norm() / ro.norm()) < 2e-3
    assert float((ht.double() - rh).norm() / rh.norm()) < 2e-3
    assert names[0] == ("chunk_kkt_inverse_save" if save else "chunk_kkt_inverse")
    assert "chunk_wu" in names and "chunk_state" in names
    if save:
        assert set(saved[0]) >= {"h", "A_inv"}


@pytest.mark.parametrize("case", [pytest.param(c.values, id=c.id) for c in test_autograd.CASES[:2]])
def test_sm80_delta_training_backward_emulated(monkeypatch, rng, case):
    """DeltaNet's training backward on sm80's params (tests/test_autograd.py's check, its
    forward the fp64 reference), every backward stage faked on the sm80 modules."""
    monkeypatch.setattr(runtime, "arch_of", lambda device: ARCH)
    fakes = test_autograd.fake_kernels.__wrapped__(monkeypatch)
    seen = []
    inner = runtime._compiled

    def spy(spec, stage, arch, params, target=None):
        seen.append(arch)
        return inner(spec, stage, arch, params, target)
    monkeypatch.setattr(runtime, "_compiled", spy)
    test_autograd.test_gradients_match_fp64_autograd(fakes, rng, *case)
    assert seen and set(seen) == {ARCH}, set(seen)


@pytest.mark.parametrize("name", test_sm80_gpu.FAMILIES)
def test_sm80_gpu_reference_is_the_calls_function(cpu_ops, name):
    """tests/test_sm80_gpu.py's inputs and fp64 reference on the CPU, for every family it
    checks: the public call (its kernel the fp64 reference with the gate the call passes,
    tests/_cpu_ops.py) and the test's reference agree, chunked and token by token, and
    the reference's gradients exist for every input. So the GPU test compares the kernels
    against the same function of the same inputs: retention's call takes no g (the spec
    fixes its decay), and its reference, given no g, raises TypeError (torch_reference.prepare)."""
    spec = test_sm80_gpu._spec(name)
    ops = linattn.build(spec)
    shape = (2, 70, 2, 16, 16, "float16")
    xs, do, dht = test_sm80_gpu._inputs(spec, *shape, seed=1, device="cpu")
    for recurrent, fn in ((False, ops.chunk), (True, ops.fused_recurrent)):
        o, ht, _ = test_sm80_gpu._run(fn, xs, do, dht, grads=False, scale=0.25)
        ro, rht, _ = test_sm80_gpu._reference(spec, xs, do, dht, recurrent, grads=False)
        assert rel_err(o, ro) < 2e-3 and rel_err(ht, rht) < 1e-6, (recurrent, rel_err(o, ro),
                                                                    rel_err(ht, rht))
    _, _, grads = test_sm80_gpu._reference(spec, xs, do, dht)
    assert set(grads) == set(xs) and all(torch.isfinite(x).all() for x in grads.values())


@pytest.mark.parametrize("name", [n for n in test_sm80_gpu.FAMILIES
                                  if get_spec(n).rule.value == "additive"])
def test_sm80_gpu_additive_training_emulated(monkeypatch, name):
    """tests/test_sm80_gpu.py's forward-and-gradients check of the additive families (its
    inputs, call and reference) on the CPU: the sm80 plans' forward and backward stages
    faked (the sm80 modules' traced signatures, fp64 formulas, tests/test_additive_bwd.py
    install_fakes), so what the GPU test checks but the kernels' own arithmetic runs here,
    retention's fixed decay included."""
    spec, (B, T, H, K, V) = get_spec(name), (2, 150, 2, 32, 32)
    test_additive_bwd.install_fakes(monkeypatch, spec, H, H, K, V)
    monkeypatch.setattr(runtime, "arch_of", lambda device: ARCH)
    monkeypatch.setattr(chunk, "_check_device", lambda n, x: None)
    monkeypatch.setattr(validate, "check_devices", lambda q, **t: None)
    seen, inner = [], runtime._compiled
    monkeypatch.setattr(runtime, "_compiled", lambda s, stage, arch, p, target=None: (
        seen.append(arch), inner(s, stage, arch, p, target))[1])
    additive_bwd._plan.cache_clear()
    try:
        xs, do, dht = test_sm80_gpu._inputs(spec, B, T, H, K, V, "float16", 3, device="cpu")
        fn = linattn.build(spec).chunk
        o0, ht0, _ = test_sm80_gpu._run(fn, xs, do, dht, grads=False, scale=K ** -0.5)
        o, ht, grads = test_sm80_gpu._run(fn, xs, do, dht, scale=K ** -0.5)
    finally:
        additive_bwd._plan.cache_clear()
    ro, rht, rgrads = test_sm80_gpu._reference(spec, xs, do, dht)
    errs = {"o_inference": rel_err(o0, ro), "final_inference": rel_err(ht0, rht),
            "o": rel_err(o, ro), "final_state": rel_err(ht, rht),
            **{f"d{n}": rel_err(grads[n], rgrads[n]) for n in rgrads}}
    assert set(rgrads) == set(xs) and all(e < 2e-3 for e in errs.values()), errs
    assert seen and set(seen) == {ARCH}, set(seen)
