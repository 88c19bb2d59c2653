"""The additive rule's backward as its kernels compute it (dsl/additive_bwd.py: the
reverse state-gradient pass, then per chunk the sub-block-factored pair terms and dg from
the reverse cumulative sum plus <h_out, dh>) against torch.autograd of the fp64
token-by-token recurrence (dsl/torch_reference.py), for the per-key gate (GLA), the
scalar gate (simple GLA), no gate (linear attention) and every additive spec of
all_rule_gate_specs (GVA): odd lengths, varlen with empty and one-token sequences, h0
and dht, both state layouts, fast decays (e^-1000 over a chunk: no exponential of a
positive number may be taken); the value gate (fla's gv) through its key-gated twin
(dsl.spec.key_twin: the transposed call) the same way. Then the kernels' rounding of GEMM operands to bf16 / f16
(emulated) on benchmark-like inputs stays well inside the GPU tolerances."""
import numpy as np
import pytest
import torch

from linattn.dsl import Options, all_rule_gate_specs, value_gate_spec
from linattn.dsl import torch_reference as tref
from linattn.dsl.additive_bwd import additive_backward, rounding
from linattn.ops import gla, linear_attn, simple_gla

F64 = torch.float64
ADDITIVE = {s.name: s for s in all_rule_gate_specs() if s.rule.value == "additive"}
ADDITIVE["additive_value"] = value_gate_spec()
FAMILIES = {"gla": gla.SPEC, "simple_gla": simple_gla.SPEC, "linear_attn": linear_attn.SPEC,
            "gla_gv": gla.SPEC_GV}
NAMES = dict(q="dq", k="dk", v="dv", g="dg", initial_state="dh0")


def _inputs(spec, rng, B, T, H, HV, K, V, N, decay, v_first):
    r = lambda *s: torch.from_numpy(rng.standard_normal(s))  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V),
             initial_state=0.1 * (r(N, HV, V, K) if v_first else r(N, HV, K, V)))
    if spec.has_gate:
        shape = spec.gate_shape(B, T, HV, K, V)
        x["g"] = torch.nn.functional.logsigmoid(r(*shape) + 2) * decay
    st = (N, HV, V, K) if v_first else (N, HV, K, V)
    return x, r(B, T, HV, V), 0.1 * r(*st)


def _autograd(spec, x, do, dht, opts, scale, cu):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = tref.recurrent_forward(spec, options=opts, scale=scale, cu_seqlens=cu, **leaves)
    ((o * do).sum() + (ht * dht).sum()).backward()
    return {NAMES[n]: t.grad.numpy() for n, t in leaves.items()}


CASES = [   # spec, B, T, H, HV, K, V, cu, decay, state_v_first
    pytest.param("gla", 1, 64, 1, 1, 16, 8, None, 1, False, id="gla-T64"),
    pytest.param("gla", 2, 130, 2, 2, 16, 8, None, 1, False, id="gla-B2-T130"),
    pytest.param("gla", 1, 200, 1, 1, 16, 16, [0, 1, 1, 70, 200], 1, False,
                 id="gla-varlen-1-0-69-130"),
    pytest.param("gla", 1, 130, 1, 1, 16, 8, None, 16, False, id="gla-fast-decay"),
    pytest.param("gla", 1, 70, 1, 1, 16, 8, None, 1, True, id="gla-v-first"),
    pytest.param("simple_gla", 2, 130, 2, 2, 16, 8, None, 1, False, id="sgla-B2-T130"),
    pytest.param("simple_gla", 1, 150, 1, 1, 8, 16, [0, 63, 64, 150], 8, False,
                 id="sgla-varlen-fast"),
    pytest.param("linear_attn", 2, 100, 2, 2, 16, 8, None, 1, False, id="la-B2-T100"),
    pytest.param("linear_attn", 1, 129, 1, 1, 8, 16, [0, 64, 65, 129], 1, True,
                 id="la-varlen-v-first"),
    pytest.param("additive_key", 1, 100, 1, 2, 16, 8, None, 1, False, id="key-GVA2"),
    pytest.param("additive_scalar", 1, 100, 2, 4, 8, 8, None, 1, False, id="scalar-GVA2"),
    pytest.param("additive_none", 1, 100, 1, 2, 8, 8, [0, 30, 100], 1, False,
                 id="none-GVA2-varlen"),
    pytest.param("gla_gv", 1, 63, 1, 1, 16, 8, None, 1, False, id="gv-T63"),
    pytest.param("gla_gv", 2, 130, 2, 2, 8, 16, None, 1, False, id="gv-B2-T130"),
    pytest.param("gla_gv", 1, 200, 1, 1, 16, 16, [0, 1, 1, 70, 200], 1, False,
                 id="gv-varlen-1-0-69-130"),
    pytest.param("gla_gv", 1, 130, 1, 1, 16, 8, None, 16, False, id="gv-fast-decay"),
    pytest.param("gla_gv", 1, 70, 1, 1, 8, 16, None, 1, True, id="gv-v-first"),
    pytest.param("additive_value", 1, 100, 1, 2, 16, 8, [0, 37, 100], 1, False,
                 id="value-GVA2-varlen"),
]


@pytest.mark.parametrize("name, B, T, H, HV, K, V, cu, decay, v_first", CASES)
def test_matches_autograd_of_recurrence(name, B, T, H, HV, K, V, cu, decay, v_first, rng):
    spec = FAMILIES.get(name) or ADDITIVE[name]
    N = B if cu is None else len(cu) - 1
    x, do, dht = _inputs(spec, rng, B, T, H, HV, K, V, N, decay, v_first)
    opts = Options(state_v_first=v_first)
    cu_t = None if cu is None else torch.tensor(cu)
    want = _autograd(spec, x, do, dht, opts, 0.3, cu_t)
    got = additive_backward(spec, **{n: t.numpy() for n, t in x.items()}, do=do.numpy(),
                            dht=dht.numpy(), options=opts, scale=0.3,
                            cu_seqlens=None if cu is None else np.array(cu))
    for n, w in want.items():
        assert got[n].shape == w.shape, n
        err = np.linalg.norm(got[n] - w) / np.linalg.norm(w)
        assert err < 1e-10, (n, err)


def test_without_initial_state_or_dht(rng):
    spec = gla.SPEC
    x, do, _ = _inputs(spec, rng, 1, 90, 1, 1, 16, 8, 1, 1, False)
    h0 = x.pop("initial_state")
    want = _autograd(spec, x, do, torch.zeros(1, 1, 16, 8, dtype=F64), Options(), None, None)
    got = additive_backward(spec, **{n: t.numpy() for n, t in x.items()}, do=do.numpy())
    assert got["dh0"] is None and h0 is not None
    for n, w in want.items():
        assert np.linalg.norm(got[n] - w) / np.linalg.norm(w) < 1e-10, n


def test_states_layout(rng):
    """states / dstates: per sequence the state entering each chunk then the final one
    (row offset_n + n + t), as the contract's h and the kernels' buffers."""
    spec = gla.SPEC
    x, do, dht = _inputs(spec, rng, 1, 150, 1, 1, 16, 8, 2, 1, False)
    cu = np.array([0, 100, 150])
    arr = {n: t.numpy() for n, t in x.items()}
    got = additive_backward(spec, **arr, do=do.numpy(), dht=dht.numpy(), cu_seqlens=cu)
    ref = tref.chunked_forward(spec, *(x[n] for n in "qkvg"),
                               initial_state=x["initial_state"],
                               cu_seqlens=torch.tensor(cu), intermediates=True)
    h = ref["h"][0].numpy()                   # [3 chunks, HV, K, V]
    final = ref["final_state"].numpy()
    want = np.stack([h[0], h[1], final[0], h[2], final[1]])
    assert got["states"].shape == want.shape
    assert np.abs(got["states"] - want).max() < 1e-10
    assert np.abs(got["dstates"][2] - dht.numpy()[0]).max() == 0      # leaving the last
    assert np.abs(got["dstates"][4] - dht.numpy()[1]).max() == 0


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 1e-2), ("float16", 5e-3)])
@pytest.mark.parametrize("name", ["gla", "simple_gla", "linear_attn", "gla_gv"])
def test_rounding_stays_inside_gpu_tolerance(name, dtype, tol, rng):
    """Benchmark-like inputs (GLAChunkBwd's: q, k, v, do ~ N(0, 1), g = logsigmoid(N(2, 1)),
    scale 1/8, h0 and dht 0.1 N(0, 1)) rounded to the dtype, then every GEMM operand the
    kernels round: the gradients' error against the exact fp64 backward of the same
    rounded inputs must stay under half the GPU test's tolerance."""
    spec = FAMILIES[name]
    rnd = rounding(dtype)
    x, do, dht = _inputs(spec, rng, 1, 256, 2, 2, 64, 64, 1, 1, False)
    arr = {n: rnd(t.numpy()) if n != "initial_state" else t.numpy() for n, t in x.items()}
    kw = dict(do=rnd(do.numpy()), dht=dht.numpy(), scale=0.125)
    exact = additive_backward(spec, **arr, **kw)
    emul = additive_backward(spec, **arr, **kw, round_to=dtype)
    errs = {n: np.linalg.norm(emul[n] - exact[n]) / np.linalg.norm(exact[n])
            for n in ("dq", "dk", "dv", "dg", "dh0") if exact[n] is not None}
    print(name, dtype, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e < tol / 2 for e in errs.values()), errs
