"""The value gate (fla's gv) past the references, on CPU: what the generator plans and
renders for it, and the public path (fused_recurrent_gla(..., gv=...)) up to the kernel.
The kernel itself compiles in tests/test_compile.py (-k "additive_value or value_gate")
and runs on a GPU in tests/test_decode_gpu.py (-k additive_value) and, through
fused_recurrent_gla, in test_fused_recurrent_gla_gv_gpu below."""
import pytest
import torch
import torch.nn.functional as F

import _cpu_ops
import linattn
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)
from linattn.codegen import plan, render_stage
from linattn.dsl import Options, SpecError, value_gate_spec
from linattn.dsl import torch_reference as tr
from linattn.ops import gla

SPEC = value_gate_spec()


def test_plan_has_the_three_stage_forward_and_decode():
    """The value gate's stages: the additive rule's three-stage chunked forward (and the
    split's summary) and the recurrent kernel; no fused pass (training: the key-gated
    twin's backward stages, test_additive_bwd)."""
    assert [s.name for s in plan(SPEC, None, "sm90")] == [
        "chunk_prepare", "chunk_state_summary", "chunk_state", "chunk_output", "recurrent"]
    assert plan(SPEC, "bwd", "sm90") == []


def test_recurrent_renders_the_column_decay():
    (stage,) = plan(SPEC, "decode", "sm90")
    text = render_stage(SPEC, stage, "sm90")
    assert "g_shape = (B, Tlen, HV, V)" in text
    assert "dt_bias_shape = (HV * V,)" in text
    assert "S[i, j] = S[i, j] * decay_v[j]" in text
    assert "decay_k" not in text


# -- the public path: fused_recurrent_gla(..., gv=...) on CPU, the kernel replaced by the
#    fp64 reference (tests/_cpu_ops.py; gla_gv is not a registered op, so library.run
#    takes library._impl, swapped here for the reference)

@pytest.fixture
def gv_cpu(cpu_ops, monkeypatch):
    from linattn.ops import library

    def impl(spec, path):
        def kernel(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, scale, final, opts,
                   *pool):
            return _cpu_ops._reference(spec, path, q, k, v, g, beta, A_log, dt_bias, h0,
                                       cu, scale, final, opts, *pool)
        return kernel
    monkeypatch.setattr(library, "_impl", impl)
    return cpu_ops


def _gla_inputs(B=2, T=5, H=2, K=32, V=48, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = r(B, T, H, K).to(dtype), F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    v = r(B, T, H, V).to(dtype)
    gv = -0.1 * torch.rand(B, T, H, V, generator=gen)
    return q, k, v, gv, 0.1 * r(B, H, K, V)


@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_fused_recurrent_gla_gv_matches_reference(gv_cpu, v_first):
    q, k, v, gv, h0 = _gla_inputs()
    h0 = h0.transpose(-1, -2).contiguous() if v_first else h0
    o, ht = linattn.fused_recurrent_gla(q, k, v, gv=gv, initial_state=h0,
                                        output_final_state=True, state_v_first=v_first)
    assert gv_cpu == [("gla_gv", "recurrent")]
    opts = Options(state_v_first=v_first)
    want_o, want_ht = tr.recurrent_forward(gla.SPEC_GV, q, k, v, gv, options=opts,
                                           initial_state=h0)
    assert o.dtype == q.dtype and o.shape == v.shape and ht.dtype == torch.float32
    assert torch.allclose(o.double(), want_o.to(q.dtype).double())
    assert torch.allclose(ht.double(), want_ht, atol=1e-6)


def test_fused_recurrent_gla_gv_varlen_and_pool(gv_cpu):
    q, k, v, gv, _ = _gla_inputs(B=1, T=7)
    cu = torch.tensor([0, 3, 3, 7])
    o, ht = linattn.fused_recurrent_gla(q, k, v, gv=gv, cu_seqlens=cu, output_final_state=True)
    want_o, want_ht = tr.recurrent_forward(gla.SPEC_GV, q, k, v, gv, cu_seqlens=cu)
    assert torch.allclose(o.double(), want_o.to(q.dtype).double())
    assert torch.allclose(ht.double(), want_ht, atol=1e-6) and ht.shape == (3, 2, 32, 48)
    q, k, v, gv, _ = _gla_inputs(B=3, T=1, seed=1)
    pool = torch.randn(6, 2, 32, 48)
    want = pool.clone()
    o, ht = linattn.fused_recurrent_gla(q, k, v, gv=gv, initial_state=pool,
                                        ssm_state_indices=torch.tensor([4, 0, 2]),
                                        inplace_final_state=True)
    assert ht is pool and torch.equal(pool[[1, 3, 5]], want[[1, 3, 5]])
    assert not torch.equal(pool[4], want[4])


def test_fused_recurrent_gla_gv_refusals():
    q, k, v, gv, _ = _gla_inputs()
    gk = -torch.rand(2, 5, 2, 32)
    with pytest.raises(SpecError, match="takes gk or gv, not both") as e:
        linattn.fused_recurrent_gla(q, k, v, gk, gv)
    assert "\n" not in str(e.value)
    with pytest.raises(SpecError, match=r"g.*\[2, 5, 2, 48\]"):
        linattn.fused_recurrent_gla(q, k, v, gv=gk)           # K channels, not V
    with pytest.raises(SpecError, match="reverse"):
        linattn.fused_recurrent_gla(q, k, v, gv=gv, reverse=True)


def test_build_value_gate_spec_trains_and_runs_chunked(gv_cpu):
    """linattn.build of a value-gate spec: differentiable (the key-gated twin's backward,
    ops.additive_bwd.value_gate_backward); ops.chunk takes the chunked kernels (T > 1;
    K, V multiples of 16)."""
    ops = linattn.build(SPEC)
    assert ops.has_backward and "[B, T, HV, V]" in ops.chunk.__doc__
    q, k, v, gv, h0 = _gla_inputs(T=70)
    o, ht = ops.chunk(q, k, v, gv, initial_state=h0, output_final_state=True)
    assert gv_cpu == [("additive_value", "chunk")]
    want_o, want_ht = tr.chunked_forward(SPEC, q, k, v, gv, initial_state=h0)
    assert torch.allclose(o.double(), want_o.to(q.dtype).double())
    assert torch.allclose(ht.double(), want_ht, atol=1e-6)


def test_chunk_gla_gv_takes_the_chunked_path(gv_cpu):
    """chunk_gla(q, k, v, gv=...) runs gla_gv's chunked forward (T > 1), T == 1 the
    decode kernel, against the fp64 reference."""
    q, k, v, gv, h0 = _gla_inputs(T=70)
    o, ht = linattn.chunk_gla(q, k, v, gv=gv, initial_state=h0, output_final_state=True)
    want_o, want_ht = tr.chunked_forward(gla.SPEC_GV, q, k, v, gv, initial_state=h0)
    assert torch.allclose(o.double(), want_o.to(q.dtype).double())
    assert torch.allclose(ht.double(), want_ht, atol=1e-6)
    linattn.chunk_gla(*(x[:, :1] for x in (q, k, v)), gv=gv[:, :1])
    assert gv_cpu == [("gla_gv", "chunk"), ("gla_gv", "recurrent")]


@pytest.mark.gpu
@pytest.mark.parametrize("T, v_first", [(1, False), (37, True)], ids=["decode", "T37-v_first"])
def test_fused_recurrent_gla_gv_gpu(T, v_first):
    """The kernel behind fused_recurrent_gla(gv=...) against the fp64 torch reference."""
    q, k, v, gv, h0 = (x.cuda() for x in _gla_inputs(B=3, T=T, H=4, K=128, V=64))
    h0 = h0.transpose(-1, -2).contiguous() if v_first else h0
    o, ht = linattn.fused_recurrent_gla(q, k, v, gv=gv, initial_state=h0,
                                        output_final_state=True, state_v_first=v_first)
    want_o, want_ht = tr.recurrent_forward(gla.SPEC_GV, q, k, v, gv, initial_state=h0,
                                           options=Options(state_v_first=v_first))
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    assert rel(o, want_o) < 1e-2 and rel(ht, want_ht) < 1e-4
