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
    """Mamba-2's layer (GVA, a scalar gate, a 128 x 64 tile): A_qk per key head and two
    warpgroups by default (run s37-1's fastest form); one warpgroup without GVA (A_qk per
    value head) or on request; an unknown count refused in one line."""
    plan_of = lambda **kw: {la.stage: la.kwargs for la in _plan(**kw).launches}  # noqa: E731
    plan = plan_of()
    assert plan["chunk_state_output"]["threads"] == 256
    assert plan["chunk_state_output"]["aqk_per_key_head"] and plan["chunk_qk"]["per_key_head"]
    no_gva = chunk.forward_plan(mamba2.SPEC, mamba2._OPTS, H=8, HV=8, K=128, V=64,
                                dtype="bfloat16", seq_chunks=(64,), Ttot=4096,
                                output_final_state=True, terms=ALL, config={"fused": True})
    state = next(la for la in no_gva.launches if la.stage == "chunk_state_output").kwargs
    assert state.get("threads", 128) == 128 and not state.get("aqk_per_key_head")
    one = plan_of(config={"state_threads": 128})["chunk_state_output"]
    assert one.get("threads", 128) == 128 and one["aqk_per_key_head"]
    assert plan_of(config={"aqk_per_key_head": False})["chunk_state_output"].get(
        "threads", 128) == 128
    with pytest.raises(Exception, match="state_threads=96"):
        _plan(config={"state_threads": 96})


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("HV, T", [(32, 1500), (32, 1865), (128, 4096)])
def test_two_warpgroups_take_value_blocks_of_32_or_more(fused, HV, T):
    """At state_threads=256 the state pass splits its GEMMs' columns between the two
    warpgroups: a value block of 16 (wgmma N = 8 each, no canonical GMMA layout; the GPU
    test's shape, HV = 32, V = 64, planned it) is never chosen, and refused when forced."""
    cfg = {"state_threads": 256, "fused": fused}
    state = next(la for la in _plan(config=cfg, HV=HV, T=T).launches
                 if la.stage in ("chunk_state_output", "chunk_state")).kwargs
    assert state["threads"] == 256 and state["block_v"] >= 32, state
    with pytest.raises(Exception, match="block_v=16"):
        _plan(config=dict(cfg, block_v=16), HV=HV, T=T)


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
            assert "skip_D[hv, iv * BV + j]" in ours and "skip_D[hv] *" in ours
            assert "gate_z[t0:t0 + BT" in ours
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
        D = t["skip_D"].double()
        if f["skip_per_head"]:
            assert D.shape == (v.shape[2],)
            D = D[:, None]
        assert D.shape[0] == v.shape[2] and D.shape[-1] in (1, v.shape[3])
        o = o + D * v.double()
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
                                 skip_per_head=terms, output_gate=terms)
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
    dec = mamba2.kernel_terms(A, D, None, bias, True)
    assert not dec["flags"]["step_clamp"] and "step_limit" not in dec["tensors"]
    assert dec["tensors"]["skip_D"].shape == (4,) and not dec["flags"]["output_gate"]
    assert dec["flags"]["skip_per_head"]       # D [nheads]: one value a head, no copy
    tied = mamba2.kernel_terms(A, D.view(4, 1).expand(4, 8), None, bias, True)
    assert tied["flags"]["skip_per_head"] and tied["tensors"]["skip_D"].shape == (4,)
    per_channel = mamba2.kernel_terms(A, torch.rand(4, 8), None, bias, True)
    assert not per_channel["flags"]["skip_per_head"]
    assert per_channel["tensors"]["skip_D"].shape == (4, 8)
    pre = mamba2.kernel_terms(A, None, torch.zeros(6, 4, 8), None, False, (0.0, math.inf))
    assert pre["tensors"]["step_limit"].tolist() == [0.0, math.inf]
    assert pre["flags"]["output_gate"] and not pre["flags"]["skip"]


GVA_SPECS = {"mamba2": mamba2.SPEC, "gla": registry.specs()["gla"],
             "plain_gva": OpSpec(name="plain_gva", rule="additive", gate="none")}


@pytest.mark.parametrize("spec_name, H, HV, per_key", [
    ("mamba2", 8, 128, True), ("mamba2", 4, 4, False), ("plain_gva", 2, 8, True),
    ("gla", 2, 8, False)])
def test_aqk_is_formed_once_per_key_head_under_gva(spec_name, H, HV, per_key):
    """Where GVA has no or a scalar gate, chunk_qk writes each key head's undecayed pairs
    [Ttot, H, 64] and the fused pass decays them per value head (the default, run s37-1;
    config aqk_per_key_head=False per value head); otherwise (no GVA, a per-key gate: its
    prepare forms A_qk) per value head, and the config is refused where it cannot apply."""
    spec = GVA_SPECS[spec_name]
    opts = mamba2._OPTS if spec_name == "mamba2" else linattn.dsl.Options()
    kw = dict(H=H, HV=HV, K=128, V=64, dtype="bfloat16", seq_chunks=(64,), Ttot=4096,
              output_final_state=True, config={"fused": True})
    default = chunk.forward_plan(spec, opts, **kw)
    assert next(b for b in default.buffers if b.name == "aqk").shape == (
        4096, H if per_key else HV, 64)
    if per_key:
        kw["config"] = {"fused": True, "aqk_per_key_head": True}
    plan = chunk.forward_plan(spec, opts, **kw)
    params = {la.stage: la.kwargs for la in plan.launches}
    aqk = next(b for b in plan.buffers if b.name == "aqk")
    assert aqk.shape == (4096, H if per_key else HV, 64)
    assert params["chunk_state_output"].get("aqk_per_key_head", False) == per_key
    assert params.get("chunk_qk", {}).get("per_key_head", False) == per_key
    if per_key:
        off = chunk.forward_plan(spec, opts, **dict(kw, config={"fused": True,
                                                                "aqk_per_key_head": False}))
        assert next(b for b in off.buffers if b.name == "aqk").shape == (4096, HV, 64)
    elif spec_name == "gla":
        with pytest.raises(Exception, match="aqk_per_key_head"):
            chunk.forward_plan(spec, opts, **dict(kw, config={"aqk_per_key_head": True}))


def test_the_fused_pass_decays_the_key_head_pairs_by_its_gate():
    """The scalar gate's pairs decay exp(g_i - g_j) on the lower triangle only (a masked
    pair's e^(g_i - g_j) may overflow: 0 x inf is never formed); no gate: none."""
    ours = render_stage(mamba2.SPEC, _stage(mamba2.SPEC, "chunk_state_output"), "sm90")
    block = ours[ours.index("if aqk_per_key_head:"):]
    block = block[:block.index("T.cast(0, dtype))")]
    assert "i >= j" in block and "T.exp(g_s[i] - g_s[j])" in block
    plain = registry.specs()["linear_attn"]
    theirs = render_stage(plain, _stage(plain, "chunk_state_output"), "sm90")
    assert "if aqk_per_key_head:" not in theirs and "hv // a_div" in theirs


# ------------------------------------------------------------------ the stages' maths
@pytest.mark.parametrize("config", [None, {"fused": False}, {"segments": 2},
                                    {"fused": False, "segments": 3},
                                    {"aqk_per_key_head": True}, {"state_threads": 256}])
@pytest.mark.parametrize("terms", [ALL, ("step_clamp", "step_dt", "value_scale")])
def test_pipeline_with_terms_matches_the_recurrence(monkeypatch, config, terms):
    """Every plan form with the call terms in its stages, run by fp64 fakes of the stages
    (tests/test_chunk_fused.py PipelineMath: each launch checked against the traced
    kernel's signature, each stage's formula on the plan's real buffers; chunk_prepare's
    step and dt_c, the value scale in the state passes and chunk_output, the skip term and
    the gate where o is written, A_qk per key head), against Mamba-2's recurrence written
    out step by step; ragged sequences with an empty and a one-token one."""
    from _kernel_check import fake_compiles
    from test_chunk_fused import PipelineMath
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    HV, G, K, V, lens = 8, 2, 64, 32, [1, 150, 0, 70]
    math_ = PipelineMath(mamba2.SPEC, G, HV, K, V)
    calls = []
    fake_compiles(monkeypatch, math_.body, calls)
    p = _inputs(Bn=1, T=sum(lens), HV=HV, G=G, K=K, V=V)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    on = set(terms)
    lim = (0.01, 2.0)
    kt = mamba2.kernel_terms(p["A"].float(), p["D"] if "skip" in on else None,
                             p["z"].flatten(0, 1) if "output_gate" in on else None,
                             p["dt_bias"].float() if "step_bias_on" in on else None,
                             "step_softplus" in on, lim)
    h0 = torch.cat([p["h0"][:1], torch.zeros(len(lens) - 1, HV, V, K, dtype=p["h0"].dtype)])
    cu_t = torch.tensor(cu, dtype=torch.int32)
    y, ht = chunk.run_chunk_forward(mamba2.SPEC, p["C"], p["B"], p["x"], p["dt"].float(),
                                    None, 1.0, h0.float(), True, mamba2._OPTS, cu_t, cu_t,
                                    config=config, terms=kt)
    stages = {s for s, _ in calls}
    assert "chunk_prepare" in stages and ("chunk_state_output" in stages
                                          or "chunk_output" in stages)
    kw = dict(dt_bias=p["dt_bias"] if "step_bias_on" in on else None,
              dt_softplus="step_softplus" in on, dt_limit=lim,
              D=p["D"] if "skip" in on else None, z=p["z"] if "output_gate" in on else None)
    for i in range(len(lens)):
        sl = slice(cu[i], cu[i + 1])
        if not lens[i]:         # (an empty sequence: its final state is its initial one)
            torch.testing.assert_close(ht[i:i + 1].double(), h0[i:i + 1].double())
            continue
        want, hw = call_terms.naive_reference(
            mamba2.SPEC, p["C"][:, sl], p["B"][:, sl], p["x"][:, sl], dt=p["dt"][:, sl],
            A=p["A"], initial_state=h0[i:i + 1], **dict(kw, z=None if kw["z"] is None
                                                        else kw["z"][:, sl]))
        assert _rel(y[:, sl], want) < 5e-3, (i, _rel(y[:, sl], want))    # (bf16 o: in norm)
        assert _rel(ht[i:i + 1], hw) < 5e-3, (i, _rel(ht[i:i + 1], hw))


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())
