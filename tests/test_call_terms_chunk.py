"""The call terms (dsl/call_terms.py) formed inside the chunked forward's kernels, on the
CPU: which stage of each plan forms which term (the arch's plan, codegen/arch/sm90), the
rendered stages' hooks (templates/terms/*.py.jinja), and mamba_chunk_scan_combined's
route into the kernels with the flags and tensors they read (a model of the kernels
replaces them: the terms formed from exactly what the call hands over, then the fp64
chunked recurrence), against Mamba-2's recurrence written out step by step."""
import math

import pytest
import torch

import linattn
from linattn.codegen.render import render_stage
from linattn.codegen.pipeline import ForwardProblem
from linattn.codegen.arch import get_arch
from linattn.codegen.plan import plan as stages_for
from linattn.dsl import OpSpec, call_terms
from linattn.dsl import torch_reference as tr
from linattn.dsl.torch_reference import softplus_fla
from linattn.ops import chunk, mamba2, registry, validate

BF = torch.bfloat16
ALL = ("output_gate", "skip", "step_bias_on", "step_clamp", "step_dt", "step_softplus",
       "value_scale")
STEP = {"step_dt", "step_bias_on", "step_softplus", "step_clamp"}


def _plan(terms=ALL, config=None, HV=128, T=4096, **kw):
    return chunk.forward_plan(mamba2.SPEC, mamba2._OPTS, H=8, HV=HV, K=128, V=64,
                              dtype="bfloat16", seq_chunks=(-(-T // 64),), Ttot=T,
                              output_final_state=True, terms=terms, config=config, **kw)


@pytest.mark.parametrize("config", [None, {"fused": False}, {"segments": 4},
                                    {"fused": False, "segments": 8}])
@pytest.mark.parametrize("HV, T", [(128, 4096), (4, 3000)])
def test_each_call_term_is_formed_by_one_stage_of_the_plan(config, HV, T):
    """The step in the prepare (and dt per token for the value scale), the value scale
    wherever values enter the state or the output, the skip term and the output gate in
    the stage that writes o (never twice), the raw dt passed where g goes."""
    plan = _plan(config=config, HV=HV, T=T)
    flags = {la.stage: {t for t in ALL if la.kwargs.get(t)} for la in plan.launches}
    assert flags.pop("chunk_prepare") == STEP | {"value_scale"}
    writes_o = [s for s in flags if s in ("chunk_state_output", "chunk_output")]
    assert len(writes_o) == 1
    assert flags.pop(writes_o[0]) == {"value_scale", "skip", "output_gate"}
    for stage, on in flags.items():
        assert on == ({"value_scale"} if stage in ("chunk_state", "chunk_state_summary")
                      else set()), stage
    assert any(b.name == "dt_c" and b.shape == (HV, plan_nt(T) * 64) for b in plan.buffers)


def plan_nt(T):
    return -(-T // 64)


def test_a_call_without_terms_plans_no_term_and_no_buffer():
    plan = _plan(terms=())
    assert not any(la.kwargs.get(t) for la in plan.launches for t in ALL)
    assert "dt_c" not in {b.name for b in plan.buffers}


def test_only_the_terms_a_call_turns_on_reach_the_kernels():
    plan = _plan(terms=("step_dt", "step_clamp", "value_scale"))
    prep = next(la for la in plan.launches if la.stage == "chunk_prepare").kwargs
    out = next(la for la in plan.launches if la.stage == "chunk_state_output").kwargs
    assert prep.get("step_dt") and not prep.get("step_softplus") and not prep.get("step_bias_on")
    assert out.get("value_scale") and not out.get("skip") and not out.get("output_gate")


@pytest.mark.parametrize("kw, match", [
    (dict(save_states=True), "additive rule's forward alone"),
    (dict(rule="delta"), "additive rule's forward alone"),
])
def test_terms_are_refused_where_no_stage_forms_them(kw, match):
    p = ForwardProblem(**dict(dict(rule="additive", gate="scalar", H=2, HV=4, K=64, V=64,
                                   dtype="bfloat16", g_dtype="float32",
                                   beta_dtype="float32", Ttot=256, seq_chunks=(4,),
                                   terms=("value_scale",)), **kw))
    with pytest.raises(ValueError, match=match):
        get_arch("sm90").forward_plan(p, (("fused", False),) if kw.get("rule") else ())


def test_state_threads_rule_and_config():
    """Two warpgroups for the fused pass's 128 x 64 tile (the rule), 128 threads on
    request, and an unknown count refused in one line."""
    state = lambda plan: next(la for la in plan.launches  # noqa: E731
                              if la.stage == "chunk_state_output").kwargs
    assert state(_plan()).get("threads") == 256
    assert state(_plan(config={"state_threads": 128})).get("threads", 128) == 128
    with pytest.raises(Exception, match="state_threads=96"):
        _plan(config={"state_threads": 96})


def _stage(spec, name):
    return next(s for s in stages_for(spec, "fwd", "sm90") if s.name == name)


def test_rendered_stages_have_the_hooks_of_a_spec_with_terms_only():
    """mamba2's stages take the terms' tensors and form them by trace-time flags; GLA's
    (no terms) render none of it and store o * scale as before."""
    gla = registry.specs()["simple_gla"]
    for name in ("chunk_state_output", "chunk_output", "chunk_state", "chunk_prepare"):
        ours = render_stage(mamba2.SPEC, _stage(mamba2.SPEC, name), "sm90")
        theirs = render_stage(gla, _stage(gla, name), "sm90")
        assert "dt_c" in ours and "dt_c" not in theirs and "step_A" not in theirs, name
        if name in ("chunk_state_output", "chunk_output"):
            assert "skip_D[hv, iv * BV + j]" in ours and "gate_z[t0 + i" in ours
            assert "o_f[i, j] * scale" in theirs
    prep = render_stage(mamba2.SPEC, _stage(mamba2.SPEC, "chunk_prepare"), "sm90")
    assert prep.index("step_A[hv] * d") < prep.index("T.cumsum(g_s")


# ------------------------------------------------------------------ the ops' route
def _chunk_model(spec, q, k, v, g, beta, scale, h0, final, options, cu, cu_cpu, *, terms):
    """The chunked kernels with their terms, as chunk_prepare / the state pass / the
    output stage form them from what run_chunk_forward gets (flags, tensors)."""
    f, t = terms["flags"], terms["tensors"]
    assert beta is None and scale == 1.0 and final and g.dtype == torch.float32
    assert set(t) <= set(call_terms.terms_of(spec).kernel_params), set(t)
    dt = g.double()
    if f["step_bias_on"]:
        dt = dt + t["step_bias"].double()
    if f["step_softplus"]:
        dt = softplus_fla(dt)
    if f["step_clamp"]:
        dt = dt.clamp(float(t["step_limit"][0]), float(t["step_limit"][1]))
    vv = v.double() * dt.unsqueeze(-1) if f["value_scale"] else v.double()
    plain = OpSpec(name="plain", rule="additive", gate="scalar", supports={"state_v_first"})
    o, ht = tr.chunked_forward(plain, q.double(), k.double(), vv, dt * t["step_A"].double(),
                               options=options, scale=1.0, cu_seqlens=cu,
                               initial_state=None if h0 is None else h0.double())
    if f["skip"]:
        assert t["skip_D"].shape == (v.shape[2], v.shape[3])
        o = o + t["skip_D"].double() * v.double()
    if f["output_gate"]:
        z = t["gate_z"]
        assert z.dtype == v.dtype and z.shape == (v.shape[0] * v.shape[1],) + v.shape[2:]
        o = o * torch.nn.functional.silu(z.double().view(v.shape))
    return o.to(v.dtype), ht.float()


def _inputs(Bn=2, T=150, HV=4, G=2, K=16, V=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(x=r(Bn, T, HV, V).to(BF), dt=r(Bn, T, HV) - 1.0,
                A=-torch.rand(HV, generator=gen, dtype=torch.float64) * 2 - 0.1,
                B=(r(Bn, T, G, K) * 0.5).to(BF), C=(r(Bn, T, G, K) * 0.5).to(BF),
                D=r(HV), z=r(Bn, T, HV, V).to(BF), dt_bias=r(HV) * 0.5,
                h0=r(Bn, HV, V, K) * 0.3)


@pytest.fixture
def kernels(monkeypatch):
    """The chunked kernels replaced by _chunk_model on the CPU; yields the terms of each
    call that reached them."""
    seen = []

    def model(*a, terms):
        seen.append(terms)
        return _chunk_model(*a, terms=terms)
    monkeypatch.setattr(mamba2, "_chunk_kernel", model)
    monkeypatch.setattr(validate, "check_devices", lambda q, **t: None)
    yield seen


@pytest.mark.parametrize("terms", [False, True])
def test_chunk_scan_combined_forms_its_terms_in_the_kernels(kernels, terms):
    p = _inputs()
    kw = dict(D=p["D"], z=p["z"], dt_bias=p["dt_bias"], dt_softplus=True,
              dt_limit=(0.01, 2.0)) if terms else {}
    y, hT = linattn.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"], 256,
                                              initial_states=p["h0"],
                                              return_final_states=True, **kw)
    (seen,) = kernels
    assert seen["flags"] == dict(step_dt=True, step_bias_on=terms, step_softplus=terms,
                                 step_clamp=True, value_scale=True, skip=terms,
                                 output_gate=terms)
    want, hw = call_terms.naive_reference(mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"],
                                          A=p["A"], initial_state=p["h0"],
                                          **dict(dict(dt_limit=(0.0, math.inf)), **kw))
    assert y.dtype == BF and y.shape == p["x"].shape
    torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(hT.double(), hw, rtol=1e-2, atol=1e-2)


def test_kernels_are_not_asked_for_a_training_call_or_f32(kernels):
    """Autograd's calls form the terms in torch (the backward reads them there); f32 x
    takes the recurrent kernel; V the chunked kernels do not take (8) falls back too."""
    p = _inputs()
    x = p["x"].clone().requires_grad_(True)
    for args in ((x,), (p["x"].float(),)):
        with pytest.raises(Exception):      # (the CPU has no kernels: the route is enough)
            linattn.mamba_chunk_scan_combined(args[0], p["dt"], p["A"], p["B"], p["C"], 64)
    assert kernels == []


def test_kernel_terms_of_the_decode_and_the_prefill():
    A, D, bias = torch.full((4,), -1.0), torch.ones(4), torch.zeros(4)
    dec = mamba2.kernel_terms(A, D, None, bias, True, V=8)
    assert not dec["flags"]["step_clamp"] and "step_limit" not in dec["tensors"]
    assert dec["tensors"]["skip_D"].shape == (4, 8) and not dec["flags"]["output_gate"]
    pre = mamba2.kernel_terms(A, None, torch.zeros(6, 4, 8), None, False, (0.0, math.inf), V=8)
    assert pre["tensors"]["step_limit"].tolist() == [0.0, math.inf]
    assert pre["flags"]["output_gate"] and not pre["flags"]["skip"]
