"""The sm80 arch's plans on the CPU (issue 50): which kernels they launch (only those
generated for sm80: no walk, whose warpgroup roles sm80 lacks), the arch a call resolves,
and the delta rule's sm80 forward and training backward run end to end with every
kernel replaced by a fake checked against the sm80 module's traced signature and running
the stage's fp64 formula (tests/test_chunk_bwd.py install_fakes). The kernels themselves
run on the GPU: tests/test_sm80_gpu.py."""
import os

import pytest
import torch

import test_autograd
import test_chunk_bwd
from linattn.codegen import plan as stage_plan
from linattn.codegen.arch import DEFAULT_ARCH, arch_for_capability, get_arch
from linattn.codegen.pipeline import AdditiveBackwardProblem
from linattn.dsl import Options
from linattn.dsl import torch_reference as tref
from linattn.ops import additive_bwd, chunk, chunk_bwd, runtime
from linattn.ops.api import has_chunked_forward
from linattn.ops.registry import get_spec, specs

ARCH = "sm80"
F64 = torch.float64


def test_capabilities_and_default():
    assert DEFAULT_ARCH == "sm90"
    assert arch_for_capability(9, 0) == "sm90"
    assert [arch_for_capability(8, m) for m in (0, 6, 7, 9)] == ["sm80"] * 4
    assert runtime.arch_of("cpu") == DEFAULT_ARCH
    hw = get_arch(ARCH).hardware
    assert (hw.NAME, hw.TARGET["arch"], hw.FEATURES) == ("sm80", "sm_80", frozenset())
    assert get_arch("sm90").hardware.FEATURES >= {"wgmma", "tma", "setmaxnreg", "warpgroups"}


def test_sm80_modules_are_its_own():
    """sm90's plan modules loaded as sm80's: the same code, sm80's numbers."""
    from linattn.codegen.arch.sm80 import forward as f80, stages as s80
    from linattn.codegen.arch.sm90 import forward as f90
    assert f80 is not f90 and os.path.samefile(f80.__file__, f90.__file__)
    assert (f80.hw.NUM_SMS, f90.hw.NUM_SMS) == (108, 132) and s80.NAME == "sm80"


@pytest.mark.parametrize("name", sorted(n for n, s in specs().items() if has_chunked_forward(s)))
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

    def spy(spec, stage, arch, params):
        seen.append(arch)
        return inner(spec, stage, arch, params)
    monkeypatch.setattr(runtime, "_compiled", spy)
    test_autograd.test_gradients_match_fp64_autograd(fakes, rng, *case)
    assert seen and set(seen) == {ARCH}, set(seen)
