"""A decay fixed by the spec (OpSpec.decay): RetNet's retention as fla's chunk_retention /
fused_recurrent_retention, on CPU with the kernel replaced by the fp64 reference
(tests/_cpu_ops.py: retention is a registered op, whose torch.library ops get CPU
kernels there). The kernels are simple GLA's scalar-gate kernels (g formed from the
spec), GPU-checked there."""
import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)
from linattn.dsl import OpSpec, SpecError
from linattn.dsl import torch_reference as tr
from linattn.ops import build as build_mod
from linattn.ops import retention


def _inputs(B=2, T=37, H=3, K=32, V=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = r(B, T, H, K).bfloat16(), F.normalize(r(B, T, H, K), dim=-1).bfloat16()
    return q, k, r(B, T, H, V).bfloat16(), 0.1 * r(B, H, K, V)


def _retnet_g(B, T, H):
    gamma = torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(H)])
    return gamma.view(1, 1, H).expand(B, T, H).contiguous()


def test_spec_decay_values_and_hash():
    assert retention.SPEC.head_decay(3) == pytest.approx(
        [math.log(1 - 2.0 ** (-5 - h)) for h in range(3)])
    plain = OpSpec(name="retention", rule="additive", gate="scalar",
                   supports={"state_v_first"}, gva=False)
    assert plain.hash != retention.SPEC.hash and "decay" not in plain.as_dict()
    assert "g" not in build_mod.signature(retention.SPEC, False).parameters


@pytest.mark.parametrize("kw, msg", [
    (dict(gate="none", decay="-1"), "needs gate 'scalar'"),
    (dict(gate="scalar", decay="log(1 - x)"), "h and H only"),
    (dict(gate="scalar", decay="1 +"), "not an expression"),
    (dict(gate="scalar", decay=3), "expression string"),
])
def test_bad_decay_is_one_line_spec_error(kw, msg):
    with pytest.raises(SpecError, match=msg) as e:
        OpSpec(name="bad", rule="additive", **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("decay, where, msg", [
    ("0.5", "h=0, H=1", "got 0.5"),                # exp(0.5) > 1: the state grows
    ("0.1 * h", "h=1, H=2", "got 0.1"),            # decays at head 0, grows from head 1
    ("log(1 - h / 4)", "h=4, H=5", "undefined"),   # log of 0 past four heads
])
def test_growing_decay_refused_when_the_spec_is_made(decay, where, msg):
    """A fixed decay must be a log decay <= 0 (factor exp(decay) <= 1) at every head:
    refused by OpSpec itself, before any file is generated or a call is made."""
    with pytest.raises(SpecError, match=msg) as e:
        OpSpec(name="grow", rule="additive", gate="scalar", decay=decay)
    text = str(e.value)
    assert "\n" not in text and where in text and repr(decay) in text


def test_fixed_decay_at_every_head():
    spec = OpSpec(name="slow", rule="additive", gate="scalar", decay="-1 / (h + 2)")
    assert spec.head_decay(3) == pytest.approx([-1 / 2, -1 / 3, -1 / 4])


@pytest.mark.parametrize("fn", ["chunk_retention", "fused_recurrent_retention"])
def test_retention_matches_reference(cpu_ops, fn):
    q, k, v, h0 = _inputs()
    o, ht = getattr(linattn, fn)(q, k, v, initial_state=h0, output_final_state=True)
    path = cpu_ops[-1]
    assert path[0] == "retention"
    want_o, want_ht = tr.recurrent_forward(retention.SPEC, q, k, v, _retnet_g(2, 37, 3),
                                           initial_state=h0)
    assert o.shape == v.shape and o.dtype == q.dtype and ht.dtype == torch.float32
    assert torch.allclose(o.double(), want_o.to(q.dtype).double())
    assert torch.allclose(ht.double(), want_ht, atol=1e-6)


def test_retention_varlen_and_gate_refused(cpu_ops):
    q, k, v, _ = _inputs(B=1, T=9)
    cu = torch.tensor([0, 4, 9])
    o, ht = linattn.chunk_retention(q, k, v, output_final_state=True, cu_seqlens=cu)
    want_o, want_ht = tr.recurrent_forward(retention.SPEC, q, k, v, _retnet_g(1, 9, 3),
                                           cu_seqlens=cu)
    assert torch.allclose(o.double(), want_o.to(q.dtype).double())
    assert torch.allclose(ht.double(), want_ht, atol=1e-6)
    with pytest.raises(SpecError, match="takes no g"):
        linattn.chunk_retention(q, k, v, g=torch.zeros(1, 9, 3))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("fn,T", [("chunk_retention", 1000), ("chunk_retention", 1),
                                  ("fused_recurrent_retention", 37)])
def test_retention_gpu(fn, T):
    """The generated kernels behind chunk_retention / fused_recurrent_retention against
    the fp64 reference with RetNet's decay."""
    q, k, v, h0 = (x.cuda() for x in _inputs(B=2, T=T, H=4, K=128, V=128))
    o, ht = getattr(linattn, fn)(q, k, v, initial_state=h0, output_final_state=True)
    want_o, want_ht = tr.recurrent_forward(retention.SPEC, q, k, v,
                                           _retnet_g(2, T, 4).cuda(), initial_state=h0)
    # the chunked kernel forms the state from 16-bit operands of its GEMMs (k scaled by the
    # decay, rounded to bf16): ~2e-3 of it at T = 1000 on the H200 (run s11-2), as the
    # other families' chunked states
    err_o, err_ht = _rel(o, want_o), _rel(ht, want_ht)
    assert err_o < 1e-2, f"o: relative error {err_o:.2e}"
    assert err_ht < 5e-3, f"ht: relative error {err_ht:.2e}"


@pytest.mark.gpu
def test_retention_trains_gpu():
    """chunk_retention's gradients (the additive backward's kernels) against torch
    autograd of the fp64 chunked reference."""
    q, k, v, h0 = (x.cuda() for x in _inputs(B=2, T=300, H=4, K=64, V=64))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, h0)]
    o, ht = linattn.chunk_retention(*leaves[:3], initial_state=leaves[3],
                                    output_final_state=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(o.shape, generator=gen, device="cuda")
    dht = torch.randn(ht.shape, generator=gen, device="cuda")
    got = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves)
    refs = [x.detach().double().requires_grad_() for x in leaves]
    ro, rht = tr.chunked_forward(retention.SPEC, *refs[:3], _retnet_g(2, 300, 4).cuda().double(),
                                 initial_state=refs[3])
    want = torch.autograd.grad((ro * do.double()).sum() + (rht * dht.double()).sum(), refs)
    for name, a, b in zip(("dq", "dk", "dv", "dh0"), got, want):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))
