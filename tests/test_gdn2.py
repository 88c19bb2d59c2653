"""GDN-2's public functions (chunk_gdn2, fused_recurrent_gdn2: fla's signatures) on CPU
tensors through the ops' plumbing (the cpu_ops fixture: the op's CPU kernel is the fp64
torch reference), against the NumPy fp64 recurrence of the gdn2 rule; their checks; the
generated decode kernel (CPU). GPU: tests/test_gdn2_gpu.py."""
import numpy as np
import pytest
import torch
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)

import linattn
from linattn.dsl import Options, SpecError
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops import gates
from linattn.ops.registry import get_spec

SPEC = get_spec("gdn2")


def _inputs(opts=Options(), B=1, T=23, H=2, HV=4, K=32, V=16, cu=None, seed=0):
    x = random_inputs(SPEC, opts, B, T, H, HV, K, V, np.random.default_rng(seed),
                      cu_seqlens=cu)
    return x, {n: None if a is None else torch.tensor(a, dtype=torch.float32)
               for n, a in x.items()}


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, atol=tol, rtol=tol)


@pytest.mark.parametrize("fn", ["chunk_gdn2", "fused_recurrent_gdn2"])
@pytest.mark.parametrize("opts", [Options(), Options(l2norm_qk=True, gate_in_kernel=True,
                                                     state_v_first=True)])
def test_public_functions_match_the_recurrence(cpu_ops, fn, opts):
    """varlen, an initial state, GVA, K and V not multiples of 16 (zero-padded b, w),
    l2norm, the gate in the kernel, value-first states."""
    x, t = _inputs(opts, K=30, V=12, cu=[0, 9, 23])
    want_o, want_h = recurrent_forward(SPEC, options=opts, **x)
    h0 = t["initial_state"]
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor([0, 9, 23]),
              use_qk_l2norm_in_kernel=opts.l2norm_qk, state_v_first=opts.state_v_first)
    if opts.gate_in_kernel:
        kw.update(use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"])
    o, ht = getattr(linattn, fn)(t["q"], t["k"], t["v"], t["g"], t["b"], t["w"], **kw)
    _close(o, want_o)
    _close(ht, want_h)
    assert cpu_ops == [("gdn2", "recurrent")]


def test_lower_bound_gate(cpu_ops):
    """use_gate_in_kernel with lower_bound and no A_log: g <- lower_bound * sigmoid(g +
    dt_bias) (fla's GDN-2 and KDA), formed before the kernel."""
    x, t = _inputs(seed=1)
    raw, bias = t["g"], torch.randn(4 * 32)
    g = gates.activate(raw, None, bias, -5.0, per_channel=True).double().numpy()
    want_o, want_h = recurrent_forward(SPEC, **dict(x, g=g))
    o, ht = linattn.fused_recurrent_gdn2(t["q"], t["k"], t["v"], raw, t["b"], t["w"],
                                         dt_bias=bias, use_gate_in_kernel=True,
                                         lower_bound=-5.0, initial_state=t["initial_state"],
                                         output_final_state=True)
    _close(o, want_o)
    _close(ht, want_h)


@pytest.mark.parametrize("change, message", [
    (dict(b=torch.zeros(1, 23, 4, 16)), r"b has shape \[1, 23, 4, 16\]; expected "
                                        r"\[1, 23, 4, 32\]"),
    (dict(w=None), "w"),
    (dict(g=torch.zeros(1, 23, 4)), "g"),
    (dict(chunk_size=32), "chunk_size"),
    (dict(use_beta_sigmoid_in_kernel=True), "use_beta_sigmoid_in_kernel"),
    (dict(return_intermediate_states=True, b=torch.zeros(1, 23, 4, 16)),   # (checked first)
     r"b has shape \[1, 23, 4, 16\]"),
])
def test_bad_inputs_fail_in_one_line(cpu_ops, change, message):
    _, t = _inputs()
    kw = dict(q=t["q"], k=t["k"], v=t["v"], g=t["g"], b=t["b"], w=t["w"])
    kw.update(change)
    with pytest.raises((SpecError, TypeError), match=message) as e:
        linattn.chunk_gdn2(**kw)
    assert "\n" not in str(e.value) and len(str(e.value)) <= 300
    assert cpu_ops == []


def test_generated_decode_kernel_takes_b_and_w():
    from importlib import import_module
    mod = import_module("linattn.generated.sm90.gdn2.recurrent")
    assert mod.args()[:8] == ["q", "k", "v", "g", "b", "w", "A_log", "dt_bias"]


def test_gates_read_in_their_dtype():
    """b, w reach the kernel in f32 or q's dtype as given (no conversion pass), named in
    the problem as g and beta are."""
    from linattn.ops import inputs, recurrent, validate
    q = torch.zeros(1, 3, 2, 32, dtype=torch.bfloat16)
    v = torch.zeros(1, 3, 2, 16, dtype=torch.bfloat16)
    b, w = torch.zeros(1, 3, 2, 32, dtype=torch.bfloat16), torch.zeros(1, 3, 2, 16)
    dims = validate.Dims(1, 3, 2, 2, 32, 16)
    x, _ = inputs.kernel_inputs(SPEC, Options(), dims, q, q, v, torch.zeros(1, 3, 2, 32),
                                None, rule_inputs={"b": b, "w": w.double()})
    assert x["rule_inputs"]["b"] is b and x["rule_inputs"]["w"].dtype == torch.float32
    problem = recurrent._problem(SPEC, Options(), dims, q, x["g"], None, None, torch.float32,
                                 False, None, rule_inputs=x["rule_inputs"])
    assert (problem["b_dtype"], problem["w_dtype"]) == ("bfloat16", "float32")


def test_fake_impl_takes_the_rule_inputs():
    """The op's meta implementation with the rule's vector inputs (torch.compile's view):
    o [B, T, HV, V] in q's dtype, the final state f32."""
    from linattn.ops import library
    op = torch.ops.linattn.fused_recurrent_gdn2
    m = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    B, T, H, HV, K, V = 2, 3, 2, 4, 32, 16
    o, ht = op(m(B, T, H, K), m(B, T, H, K), m(B, T, HV, V), m(B, T, HV, K), None, None,
               None, None, None, None, 0.5, True, "plain", None, None,
               [m(B, T, HV, K), m(B, T, HV, V)])
    assert o.shape == (B, T, HV, V) and o.dtype == torch.bfloat16
    assert ht.shape == (B, HV, K, V) and ht.dtype == torch.float32
    assert library.rule_dict(SPEC, [1, 2]) == {"b": 1, "w": 2}


def test_chunk_plan_reads_the_erase_and_write_gates():
    """GDN-2's chunked forward is the per-key gate's pipeline: its prepare takes b and w
    (as b_in, w_in in their dtypes), the state and output stages are KDA's."""
    from linattn.ops import chunk
    plan = chunk.forward_plan(SPEC, Options(), "sm90", H=4, HV=8, K=128, V=128,
                              dtype="bfloat16", Ttot=4096, seq_chunks=(64,),
                              rule_dtypes=(("b_dtype", "float32"), ("w_dtype", "bfloat16")))
    assert plan.stages()[0] == "chunk_prepare"
    prep = plan.launches[0].kwargs
    assert (prep["b_dtype"], prep["w_dtype"]) == ("float32", "bfloat16")
    assert {b.name for b in plan.buffers} >= {"w", "u", "kg", "qg", "g_last"}
    mod = chunk.stage_module(SPEC, "chunk_prepare")
    src = open(mod.__file__).read()
    assert "b_in: T.Tensor((Ttot, HV, K), b_dtype)" in src
    assert "w_in: T.Tensor((Ttot, HV, V), w_dtype)" in src


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_chunk_path_plumbing(cpu_ops, gate_dtype):
    """bf16 inputs take the chunk op (its CPU kernel: the fp64 reference), b and w passed
    through it (K = 30 padded to the kernels' 64, V = 16), against the recurrence."""
    x, t = _inputs(T=70, K=30, V=16, cu=[0, 9, 70])
    t = {n: None if a is None else a.to(torch.bfloat16) for n, a in t.items()}
    for n in ("g", "b", "w"):
        t[n] = t[n].to(gate_dtype)
    x = {n: None if a is None else a.double().numpy() for n, a in t.items()}
    x["cu_seqlens"] = np.array([0, 9, 70])
    want_o, want_h = recurrent_forward(SPEC, **x)
    o, ht = linattn.chunk_gdn2(t["q"], t["k"], t["v"], t["g"], t["b"], t["w"],
                               initial_state=t["initial_state"].float(),
                               output_final_state=True, cu_seqlens=torch.tensor([0, 9, 70]))
    assert cpu_ops == [("gdn2", "chunk")]
    _close(o.double(), want_o, tol=2e-2)
    _close(ht, want_h, tol=1e-4)
