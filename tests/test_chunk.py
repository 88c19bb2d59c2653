"""CPU tests of the chunked forward: the stages of every plan render and compile for
sm_90a, the host-side chunk tables match a direct walk over the sequences, the arch's
block and pipeline rules, and every plan's launches through chunk_forward against the
traced kernel signatures (fake kernels, tests/_kernel_check.py)."""
import ast
import collections
import re
import types
from pathlib import Path

import numpy as np
import pytest

from _kernel_check import fake_compiles

from linattn.codegen.arch import get_arch
from linattn.codegen.compile import barriers_in_branches, ptxas_usage
from linattn.codegen.arch.sm90 import additive as sm90_additive
from linattn.codegen.arch.sm90 import forward as sm90_forward
from linattn.codegen.arch.sm90 import hardware as sm90_hardware
from linattn.codegen.arch.sm90 import stages as sm90_stages
from linattn.codegen.plan import plan as stage_plan
from linattn.dsl import Gate, Options, SpecError, all_rule_gate_specs
from linattn.ops import chunk, runtime
from linattn.ops.registry import get_spec

SIX = {s.name: s for s in all_rule_gate_specs()}
SUPPORTED = [n for n, s in SIX.items() if s.gate in chunk.SUPPORTED_GATES]
ROOT = Path(chunk.__file__).resolve().parents[1]     # the package root (linattn/)


def _spec(name):
    return SIX[name] if name in SIX else get_spec(name)


def _fwd_stages(name):
    return [s.name for s in stage_plan(_spec(name), "fwd")]


# -- rendering ---------------------------------------------------------------------------

RENDER_CASES = [pytest.param(n, s, id=f"{n}-{s}")
                for n in ["deltanet", "gdn", "kda", "gla"] + SUPPORTED for s in _fwd_stages(n)]


@pytest.mark.parametrize("name,stage", RENDER_CASES)
def test_stage_renders(name, stage):
    spec = _spec(name)
    mod = chunk.stage_module(spec, stage)
    assert isinstance(mod, types.ModuleType)
    assert mod.STAGE == stage and mod.SPEC_HASH == spec.hash and mod.SPEC_KEY == spec.key
    assert mod.out_idx(**mod.EXAMPLES[0]) == []
    # the spec's structure reaches the text: the gate's cumsum only in the first stage
    # (and only with a gate), no exponential without a gate (but the kkt's beta / norm
    # bound), the WY inverse inlined; a prepare's x_lp (the WY operand) only with beta
    text = _rendered_text(spec, stage)
    kkt = ("chunk_kkt_inverse", "chunk_kkt_inverse_save", "chunk_walk_fused")  # (beta's sigmoid)
    first = stage in ("chunk_prepare", "chunk_prepare_save", "chunk_prepare_states") + kkt
    cumsum = ("T.cumsum" in text or "run = run + G_s[" in text     # (the per-key / value scan,
              or "gsum = gsum + " in text)                        # the fused walk's)
    assert cumsum == (first and spec.has_gate)
    if not spec.has_gate and stage not in kkt:
        assert "T.exp" not in text and "exp2" not in text
    assert "_chunk_inverse" not in text
    if stage in ("chunk_prepare", "chunk_prepare_save"):
        assert ("x_lp = T.alloc_shared" in text) == spec.has_beta
    assert ("A_out" in text) == (stage in ("chunk_prepare_save", "chunk_kkt_inverse_save"))


def _rendered_text(spec, stage):
    from linattn.codegen.render import render_stage
    return render_stage(spec, {s.name: s for s in stage_plan(spec, "fwd")}[stage], "sm90")


@pytest.mark.parametrize("name", ["kda", "gla", "delta_key", "additive_key"])
def test_key_gate_has_its_own_prepare(name):
    text = chunk.stage_module(_spec(name), "chunk_prepare").__doc__
    assert "per-key-channel gate" in text
    assert "diag(exp(g_last))" in chunk.stage_module(_spec(name), "chunk_state").__doc__


def test_rendering_is_deterministic():
    spec = get_spec("gdn")
    assert all(_rendered_text(spec, s) == _rendered_text(spec, s) for s in _fwd_stages("gdn"))


def test_generated_stages_are_what_the_plans_launch():
    """Every stage generated for a spec is launched by some plan of it, and every plan
    launches only generated stages (plan.py's rules / gates / skip agree with the arch)."""
    for name in SUPPORTED:
        spec, used = _spec(name), set()
        for opts in (Options(), Options(l2norm_qk=True)):
            for config in ({}, {"fused": True}, {"fused": False}, {"segments": 2},
                           {"inverse_in_walk": 1}):
                for states in ({}, {"return_states": True}, {"save_states": True},
                               {"return_states": True, "states_only": True}):
                    try:
                        p = chunk.forward_plan(spec, opts, H=2, HV=2, K=64, V=64,
                                               dtype="bfloat16", seq_chunks=(5, 1), Ttot=320,
                                               config=config, **states)
                    except SpecError:       # (a config that form does not take)
                        continue
                    used |= set(p.stages())
        assert used == set(_fwd_stages(name)), (name, used ^ set(_fwd_stages(name)))


# -- compiling (sm_90a, no GPU needed) ----------------------------------------------------

COMPILE_CASES = [   # (the other specs' kernels are traced in the launch tests below)
    ("gdn", 0), ("gdn", 1), ("deltanet", 1), ("kda", 0), ("gla", 1),
]
#: stages whose GEMMs are mma.sync (tf32 / small tiles) rather than wgmma (chunk_kkt_inverse
#: has both: its Gram by wgmma, the inverse's blocks by one warp's tf32 mma.sync)
MMA_ONLY = ("chunk_segment_combine",)


@pytest.mark.compile
@pytest.mark.parametrize("name,example,stage", [
    pytest.param(n, e, s, id=f"{n}-ex{e}-{s}") for n, e in COMPILE_CASES for s in _fwd_stages(n)])
def test_stage_compiles(name, example, stage):
    spec = _spec(name)
    mod = chunk.stage_module(spec, stage)
    params = dict(mod.EXAMPLES[example])
    if stage == "chunk_state":
        params["num_stages"] = sm90_stages.STATE_STAGES
    kern = chunk.compiled_stage(spec, stage, **params)
    src = kern.get_kernel_source()
    assert "__global__" in src
    # (the states-only prepare of the additive rule writes kg / g_last: no pair GEMM)
    uses_gemm = stage != "chunk_prepare_states" and (
        stage != "chunk_prepare" or spec.has_beta or spec.gate is Gate.KEY)
    assert ("mma" in src) == uses_gemm
    if uses_gemm:
        assert ("wgmma" in src) == (stage not in MMA_ONLY)
    assert ("mbarrier" in src) == (stage in ("chunk_state", "chunk_state_output",
                                             "chunk_state_summary",
                                             "chunk_segment_combine"))    # (TMA loads)


@pytest.mark.compile
@pytest.mark.parametrize("num_stages", [0, 1])
def test_state_pass_compiles_unpipelined_and_shallow(num_stages):
    spec = get_spec("gdn")
    params = dict(chunk.stage_module(spec, "chunk_state").EXAMPLES[1], num_stages=num_stages)
    src = chunk.compiled_stage(spec, "chunk_state", **params).get_kernel_source()
    assert ("mbarrier" in src) == (num_stages > 0)     # > 0: warp-specialised TMA pipeline


@pytest.mark.compile
@pytest.mark.parametrize("op,params", [
    ("kda", dict(diag=8)), ("kda", dict(block_k=32)), ("gla", dict(diag=8)),
    ("kda", dict(H=2, HV=2, K=96, V=48, dtype="float16", l2norm_qk=True)),
    ("kda", dict(threads=256, min_ctas=2)), ("gla", dict(threads=256, block_k=16)),
    ("kda", dict(H=2, HV=2, K=256, V=256, threads=256, min_ctas=2)),
])
def test_key_prepare_tunings_compile(op, params):
    """The per-key prepare at the other diagonal block, a narrower panel, a K that is not
    a multiple of 64 (three panels of 32), and two warpgroups (registers capped for two
    CTAs a SM) lower to tensor-core GEMMs, no barrier inside a thread-dependent branch,
    no spill."""
    spec = get_spec(op)
    params = dict(chunk.stage_module(spec, "chunk_prepare").EXAMPLES[0], **params)
    kernel = chunk.compiled_stage(spec, "chunk_prepare", **params)
    src = kernel.get_kernel_source()
    assert "wgmma" in src
    assert not barriers_in_branches(src)
    usage = ptxas_usage(src)
    assert usage["spill_store_bytes"] == 0, usage
    if params.get("min_ctas", 1) > 1:
        assert usage["registers"] <= 65536 // (params["min_ctas"] * params["threads"]), usage


# -- host chunk tables --------------------------------------------------------------------

def _tables_by_walking(lens, C):
    bos, length, offsets = [], [], [0]
    start = 0
    for L in lens:
        t = 0
        while t < L:
            bos.append(start + t)
            length.append(min(C, L - t))
            t += C
        offsets.append(len(bos))
        start += L
    return np.array(bos), np.array(length), np.array(offsets)


@pytest.mark.parametrize("C", [16, 64])
def test_chunk_tables_match_walk(rng, C):
    for _ in range(20):
        n = int(rng.integers(1, 33))
        lens = rng.integers(0, 300, n)
        lens[rng.integers(0, n)] = 1
        cu = np.concatenate([[0], np.cumsum(lens)])
        bos, length, offsets = chunk.build_chunk_tables(cu, C)
        want = _tables_by_walking(lens, C)
        for got, ref in zip((bos, length, offsets), want):
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, ref)
        assert np.all((length >= 1) & (length <= C))


def test_chunk_tables_fixed_length():
    bos, length, offsets = chunk.build_chunk_tables([0, 65, 130], 64)
    assert bos.tolist() == [0, 64, 65, 129]
    assert length.tolist() == [64, 1, 64, 1]
    assert offsets.tolist() == [0, 2, 4]


@pytest.mark.parametrize("cu", [[1, 4], [0, 5, 3], [0]])
def test_chunk_tables_reject_bad_cu(cu):
    with pytest.raises(SpecError):
        chunk.build_chunk_tables(cu, 64)


def test_device_tables_hold_the_host_tables():
    """The plan's tables (ops.chunk._tables, int32 views of one tensor) are the NumPy ones;
    final_row numbers the sequences."""
    cu = (0, 1, 71, 71, 200)
    t = chunk._tables(cu, 64, "cpu", 0)
    bos, length, offsets = chunk.build_chunk_tables(cu, 64)
    assert t["cu_seqlens"].tolist() == list(cu)
    assert t["chunk_bos"].tolist() == bos.tolist() and t["chunk_len"].tolist() == length.tolist()
    assert t["chunk_offsets"].tolist() == offsets.tolist()
    assert t["final_row"].tolist() == [0, 1, 2, 3]
    assert all(str(x.dtype) == "torch.int32" for x in t.values())
    assert "seg_cu" not in t and chunk._tables(cu, 64, "cpu", 0) is t      # cached


# -- the arch's block and pipeline rules ----------------------------------------------------

def test_state_block_fills_gpu():
    sbv = sm90_stages.state_block_v
    assert sbv(128, 512) == 64       # several waves whatever the block
    assert sbv(128, 64) == 64        # 128 CTAs: one wave (32: two)
    assert sbv(128, 32) == 32        # 128 CTAs
    assert sbv(128, 16) == 16        # 128 CTAs
    assert sbv(128, 8) == 16         # 64 CTAs, the smallest block
    assert sbv(48, 1) == 16
    # varlen: unequal sequences (1024 + 7168 tokens, 32 heads): the short ones' CTAs free
    # their SMs early and the long ones' steps are cheaper at block 32
    assert sbv(128, 64, (16, 112)) == 32
    assert sbv(128, 64, (96, 32)) == 32     # 6144 + 2048 tokens
    assert sbv(128, 64, (16, 16)) == 64     # equal: the one-wave rule
    assert sbv(128, 64, (1,) * 64) == 64
    with pytest.raises(ValueError):
        sbv(40, 1)
    ob = sm90_stages.output_block_v
    assert ob(128) == 128 and ob(192) == 64 and ob(256) == 128 and ob(48) == 16
    with pytest.raises(ValueError):
        ob(40)


def test_fuse_output_rule():
    """The fused path from FUSE_MIN_CHAINS (sequences x value heads) on, by dtype and K."""
    fo, st = sm90_stages.fuse_output, sm90_stages
    m = st.FUSE_MIN_CHAINS_DEFAULT
    assert not fo(m - 1, "bfloat16", 128) and fo(m, "bfloat16", 128)
    for dtype in ("bfloat16", "float16"):
        m = st.FUSE_MIN_CHAINS.get(dtype, st.FUSE_MIN_CHAINS_DEFAULT)
        assert not fo(m - 1, dtype, 128) and fo(m, dtype, 128)
    assert not fo(8, "bfloat16", 128) and fo(16, "bfloat16", 128)    # tp8-8192, prefill-4k
    assert fo(8, "float16", 128)         # tp8 f16: the 3-stage state pass is slower
    small = st.FUSE_MIN_CHAINS_SMALL_K["bfloat16"]
    assert not fo(16, "bfloat16", 64)    # prefill-narrow-state
    assert not fo(small - 1, "bfloat16", 64)
    assert fo(small, "bfloat16", 64) and fo(16, "bfloat16", 128)
    assert fo(8, "float16", 64)


def _plan(name, options=Options(), config=None, **kw):
    sizes = dict(H=2, HV=2, K=64, V=64, dtype="bfloat16", seq_chunks=(4,), Ttot=256)
    sizes.update(kw)
    return chunk.forward_plan(_spec(name), options, config=config, **sizes)


def test_pipeline_rules():
    """Which pipeline each rule x gate takes, and what config forces."""
    for name in ("gdn", "deltanet"):
        assert _plan(name).name in ("walk", "walk-split")
        assert _plan(name, config={"fused": True}).name == "three-stage"  # the walk is fused
        assert _plan(name, config={"fused": False}).name == "three-stage"
        assert _plan(name, return_states=True).name == "three-stage"
        assert _plan(name, config={"segments": 2}).name == "walk-split"
        assert _plan(name, config={"segments": 4}).name == "walk"       # no segment to cut
    for name in ("kda", "gla", "additive_none", "additive_scalar"):
        assert _plan(name, config={"fused": True}).name == "fused"
        assert _plan(name, config={"fused": False}).name == "three-stage"
    assert _plan("kda", HV=32, H=32, return_states=True,
                 config={"fused": True}).name == "three-stage"        # states need h
    assert _plan("kda", HV=2).name == "three-stage"                    # 2 chains: 3-stage
    assert _plan("kda", HV=32, H=32).name == "fused"                   # 32 chains: fused
    for name in ("gla", "additive_none", "additive_scalar"):          # (additive.choose)
        long = dict(seq_chunks=(256, 256), Ttot=512 * 64)
        assert _plan(name, **long).name == "fused-split"              # 4 chains, 256 chunks
        assert _plan(name, return_states=True, **long).name.endswith("-split")
        assert _plan(name, HV=32, H=32, return_states=True,       # (its fused pass writes
                     config={"fused": True}).name == "fused"      # the states too)
        assert _plan(name, config={"segments": 0}, **long).name == "three-stage"  # (critical
        assert _plan(name, config={"segments": 0, "fused": True}, **long).name == "fused"  # path)
        assert _plan(name, config={"segments": 2}).name == "fused-split"
        assert _plan(name, config={"segments": 4}).name == "fused"    # no segment to cut
        assert _plan(name, HV=64, H=64, seq_chunks=(64,) * 8, Ttot=512 * 64).name == "fused"
    with pytest.raises(SpecError, match="unknown plan config"):
        _plan("gdn", config={"FUSE": 1})


def test_save_states_plans():
    """save_states (training): the walk stores every chunk's state into h [NT, HV, K, V]
    (input dtype), the split walk too, and its kkt (chunk_kkt_inverse_save) the WY
    inverse itself into A_inv (saved with h); the three-stage delta plan keeps the same;
    the per-key gate's plans (three-stage: its chunk_state writes h) keep h, A, aqk
    (KDA's fused pass writes no states). No other plan saves anything."""
    from linattn.codegen.pipeline import Buffer
    for name, config in (("gdn", {}), ("gdn", {"segments": 2}), ("deltanet", {}),
                         ("deltanet", {"fused": False})):
        plan = _plan(name, config=config, seq_chunks=(4, 3), Ttot=7 * 64, save_states=True)
        assert plan.saved == ("h", "A_inv")
        kkt = plan.launches[0]
        assert kkt.stage == "chunk_kkt_inverse_save" and kkt.tensor("A_out") == "A_inv"
        assert Buffer("A_inv", (7 * 64, 2, 64), "input") in plan.buffers
        assert Buffer("h", (7, 2, 64, 64), "input") in plan.buffers
        plain = _plan(name, config=config, seq_chunks=(4, 3), Ttot=7 * 64)
        assert plain.saved == () and plain.launches[0].stage == "chunk_kkt_inverse"
        if config.get("fused") is False:
            assert plan.name == "three-stage" and "chunk_state" in plan.stages()
            continue
        walk = plan.launches[-1]
        assert plan.name.startswith("walk") and walk.stage == "chunk_walk"
        assert walk.kwargs["states_out"] and walk.tensor("h") == "h"
        assert "states_out" not in plain.launches[-1].kwargs
        assert plain.launches[-1].tensor("h") == "h_none"
    for name in ("kda", "delta_key"):
        plan = _plan(name, HV=32, H=32, save_states=True)
        assert plan.name == "three-stage" and "chunk_state" in plan.stages()
        assert Buffer("h", (4, 32, 64, 64), "input") in plan.buffers
        assert plan.saved == ("h", "A", "aqk")
    assert _plan("gla", save_states=True).saved == ("h",)


def test_plans_are_printable_and_frozen():
    import dataclasses
    for name in ("gdn", "kda", "additive_scalar"):
        for config in ({}, {"fused": False}, {"fused": True}):
            p = _plan(name, config=config)
            text = str(p)
            assert text.startswith(f"plan {p.name} (sm90)") and "because" in text
            assert all(s in text for s in p.stages())
            with pytest.raises(dataclasses.FrozenInstanceError):
                p.name = "other"
            assert chunk.plan_params(p) == {la.stage: la.kwargs for la in p.launches}


def test_state_pass_takes_k_in_64s():
    """The state pass (per-key gate, additive rule) takes K a multiple of 64: the plan
    refuses other K with one line, the arch rounds them up (the op pads; the pipeline test
    test_chunk_fused.test_padded_k checks it) and the API keeps them chunked; the delta
    rule's walk takes K in 64s too (its state GEMMs: K = 96 did not compile), so the arch
    rounds the walk's K up as well and a plan at K = 96 is refused there too."""
    from linattn.ops import api, validate
    arch = get_arch("sm90")
    for name in ("kda", "gla", "gdn"):
        with pytest.raises(SpecError, match="multiple of 64"):
            _plan(name, K=96)
    for name in ("kda", "gla"):
        assert _plan(name, K=192).name in ("fused", "three-stage")
        assert [arch.chunk_k("delta" if name == "kda" else "additive", "key", K)
                for K in (16, 96, 128, 208)] == [64, 128, 128, 256]
        assert api.chunk_supports(_spec(name), validate.Dims(1, 256, 2, 2, 96, 64), "bfloat16")
    assert [arch.chunk_k("delta", g, 96) for g in ("none", "scalar")] == [128, 128]


def test_key_gate_prepare_tuning():
    """The per-key gate's chunk_prepare takes KEY_PREPARE's tuning by rule (the additive
    rule's KEY_PREPARE_WIDE where its chunks x heads are below the SMs or K > 128) and a probe's
    key_diag / key_block_k; the scalar-gate stages take no such knobs; the params build."""
    few, many = dict(seq_chunks=(3,), Ttot=192), dict(seq_chunks=(40,), Ttot=2560)
    kw = dict(H=4, HV=4, K=64, V=64, dtype="bfloat16")
    for op, rule in (("kda", "delta"), ("gla", "additive")):
        for size in (few, many):
            prep = chunk.plan_params(_plan(op, **kw, **size))["chunk_prepare"]
            want = (sm90_stages.KEY_PREPARE_WIDE if rule == "additive" and size is few
                    else sm90_stages.KEY_PREPARE[rule])
            assert {k: prep[k] for k in want} == want and "block_k" not in prep
        wide = chunk.plan_params(_plan(op, **dict(kw, K=256), **many))["chunk_prepare"]
        assert wide["threads"] == 256
        forced = chunk.plan_params(_plan(op, config={"key_diag": 8, "key_block_k": 32},
                                         **kw, **few))["chunk_prepare"]
        assert forced["diag"] == 8 and forced["block_k"] == 32
        chunk.stage_module(get_spec(op), "chunk_prepare").build(**forced)
    for config in ({}, {"fused": False}):
        for p in chunk.plan_params(_plan("gdn", config=config, **kw, **few)).values():
            assert "diag" not in p and "block_k" not in p


def test_options_checked_before_launch():
    with pytest.raises(SpecError):
        chunk.chunk_forward(get_spec("deltanet"), None, None, None,
                            options=Options(gate_in_kernel=True))


# -- launch arguments against the traced kernel signatures (no GPU: fake kernels) --------

LAUNCH_CASES = [
    ("gdn", dict(B=2, T=65, H=2, HV=4, K=64, V=64), Options(), True, True, None),
    ("gdn", dict(B=1, T=0, H=2, HV=4, K=64, V=64), Options(), False, True, [0]),
    ("gdn", dict(B=1, T=0, H=2, HV=2, K=128, V=128),
     Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True, gate_in_kernel=True,
             state_v_first=True), True, False, [1, 64, 1, 200]),
    ("deltanet", dict(B=3, T=1, H=4, HV=4, K=128, V=64), Options(l2norm_qk=True), False, False,
     None),
    ("additive_none", dict(B=1, T=100, H=2, HV=2, K=64, V=64), Options(), True, True, None),
    ("additive_scalar", dict(B=1, T=100, H=1, HV=2, K=64, V=64), Options(l2norm_qk=True),
     False, True, None),
    ("kda", dict(B=2, T=70, H=2, HV=4, K=128, V=128), Options(l2norm_qk=True), True, True,
     None),
    ("kda", dict(B=1, T=0, H=1, HV=2, K=64, V=64),
     Options(gate_in_kernel=True, beta_sigmoid=True, state_v_first=True), True, True,
     [5, 64, 1]),
    ("gla", dict(B=2, T=65, H=2, HV=2, K=64, V=64), Options(), False, True, None),
    ("additive_key", dict(B=1, T=0, H=1, HV=2, K=64, V=64), Options(gate_in_kernel=True),
     True, False, [3, 100]),
    ("delta_scalar", dict(B=1, T=0, H=1, HV=2, K=64, V=64), Options(), True, True,
     [130, 0, 300]),
    # K = V = 128 without l2norm_qk
    ("gdn", dict(B=2, T=65, H=2, HV=4, K=128, V=128),
     Options(beta_sigmoid=True, gate_in_kernel=True, state_v_first=True), True, True, None),
    ("deltanet", dict(B=1, T=0, H=2, HV=2, K=128, V=128), Options(), False, True,
     [1, 64, 130]),
]
def _walks(spec) -> bool:
    return spec.rule.value == "delta" and spec.gate is not Gate.KEY


CONFIGS = [{}, {"fused": True}, {"fused": False}, {"segments": 2}, {"inverse_in_walk": 1},
           {"inverse_in_walk": 1, "inverse_stub": 1}]


def _config_applies(c, cfg) -> bool:
    spec = _spec(c[0])
    if "segments" in cfg:
        return not (spec.has_beta and spec.gate is Gate.KEY)
    if "inverse_in_walk" in cfg:            # (the walk's, without l2norm_qk)
        return _walks(spec) and not c[2].l2norm_qk
    return True


LAUNCH_PARAMS = [
    pytest.param(*c, cfg, id=f"{c[0]}-{i}-" + ("-".join(f"{k}{v}" for k, v in cfg.items())
                                            or "default"))
    for i, c in enumerate(LAUNCH_CASES) for cfg in CONFIGS if _config_applies(c, cfg)]


def expected_stages(spec, options, plan_name):
    """The stages a plan of that name runs for spec, in order."""
    if plan_name == "walk":
        return ["chunk_kkt_inverse", "chunk_walk"]
    if plan_name == "walk-fused":
        return ["chunk_walk_fused"]
    if plan_name == "walk-split":
        return ["chunk_kkt_inverse", "chunk_walk_map", "chunk_segment_combine", "chunk_walk"]
    if plan_name.endswith("-split"):        # the additive rule's: summaries first
        stages = expected_stages(spec, options, plan_name[:-len("-split")])
        at = stages.index("chunk_qk" if "chunk_qk" in stages else
                          "chunk_state_output" if "chunk_state_output" in stages else
                          "chunk_state")
        return stages[:at] + ["chunk_state_summary"] + stages[at:]
    key = spec.gate is Gate.KEY
    if key:
        prep = ["chunk_prepare"]
    elif spec.has_beta:
        prep = ["chunk_kkt_inverse", "chunk_wu"]
    else:
        prep = ["chunk_prepare"] if spec.has_gate or options.l2norm_qk else []
    if plan_name == "fused":
        return prep + ([] if key else ["chunk_qk"]) + ["chunk_state_output"]
    assert plan_name == "three-stage", plan_name
    return prep + ["chunk_state", "chunk_output"]


def expected_plan(spec, problem, config):
    """The plan name the arch must pick (codegen/arch/sm90: forward.py and stages.py)."""
    if _walks(spec) and "fused" not in config and not problem.return_states:
        if config.get("inverse_in_walk"):
            return "walk-fused"
        _, L, _ = sm90_forward.walk_choice(problem, config)
        return "walk-split" if L and max(problem.seq_chunks) > L else "walk"
    if _walks(spec) or problem.return_states and spec.rule.value == "delta":
        return "three-stage"
    if spec.rule.value == "additive":
        forms = [config["fused"]] if "fused" in config else [True, False]
        c = sm90_additive.choose(problem, config, sm90_stages.output_block_v(problem.V), forms)
        return ("fused" if c.fused else "three-stage") + ("-split" if c.segments else "")
    fused = config.get("fused", sm90_stages.fuse_output(problem.N * problem.HV, problem.dtype,
                                                        problem.K))
    return "fused" if fused else "three-stage"


def record_plans(monkeypatch):
    """The plans runtime.run_plan is given (in call order)."""
    plans, real = [], runtime.run_plan

    def run_plan(spec, plan, tensors):
        plans.append(plan)
        return real(spec, plan, tensors)
    monkeypatch.setattr(runtime, "run_plan", run_plan)
    return plans


def launch_counts(fakes) -> collections.Counter:
    """stage -> launches, over fake_compiles' kernels."""
    out = collections.Counter()
    for (_, stage, _), (call, _) in fakes.items():
        out[stage] += call.checker.calls
    return +out


def _random_call(spec, dims, options, init, lens):
    import torch
    B, T, H, HV, K, V = (dims[k] for k in ("B", "T", "H", "HV", "K", "V"))
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + np.cumsum(lens).tolist())
        T = int(cu[-1])
    N = B if cu is None else len(lens)
    bf = torch.bfloat16
    q, k = torch.randn(B, T, H, K, dtype=bf), torch.randn(B, T, H, K, dtype=bf)
    v = torch.randn(B, T, HV, V, dtype=bf)
    g = -torch.rand(*spec.gate_shape(B, T, HV, K)) if spec.has_gate else None
    beta = torch.rand(B, T, HV, dtype=bf) if spec.has_beta else None
    shape = (N, HV, V, K) if options.state_v_first else (N, HV, K, V)
    h0 = torch.randn(shape) if init else None
    A_log = torch.rand(HV) if options.gate_in_kernel else None
    dt_bias = (torch.rand(HV * (K if spec.gate is Gate.KEY else 1)) if options.gate_in_kernel
               else None)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu,
                cu_seqlens_cpu=cu, A_log=A_log, dt_bias=dt_bias), (B, T, N, HV, V, shape)


@pytest.mark.parametrize("name,dims,options,init,final,lens,config", LAUNCH_PARAMS)
def test_launch_arguments_match_kernels(monkeypatch, name, dims, options, init, final, lens,
                                        config):
    """Every plan's launches, through chunk_forward: each kernel argument bound by name to
    a tensor whose dtype, shape and contiguity the traced kernel accepts; the stages the
    plan's name says, each launched once; o and the final state shaped as documented."""
    spec = _spec(name)
    fakes = fake_compiles(monkeypatch)
    plans = record_plans(monkeypatch)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    kw, (B, T, N, HV, V, shape) = _random_call(spec, dims, options, init, lens)
    o, ht = chunk.chunk_forward(spec, **kw, output_final_state=final, options=options,
                                config=config)
    import torch
    assert o.shape == (B, T, HV, V) and o.dtype == torch.bfloat16
    assert (ht is not None) == final and (ht is None or ht.shape == shape)
    if T == 0:
        assert plans == [] and not launch_counts(fakes)
        return
    (plan,) = plans
    lens = lens if lens is not None else [T] * B
    problem = chunk.forward_problem(
        spec, options, H=dims["H"], HV=HV, K=dims["K"], V=V, dtype="bfloat16", Ttot=B * T,
        seq_chunks=tuple(-(-n // 64) for n in lens), g_dtype="float32",
        beta_dtype="bfloat16" if spec.has_beta else "float32", has_initial_state=init,
        output_final_state=final)
    assert plan.name == expected_plan(spec, problem, config), str(plan)
    assert plan.stages() == expected_stages(spec, options, plan.name), str(plan)
    assert launch_counts(fakes) == collections.Counter(plan.stages())
    if "segments" in config:
        assert plan.segments == (config["segments"] if plan.name.endswith("-split") else 0)


@pytest.mark.parametrize("bad,match", [
    (dict(g_shape=(1, 5, 3)), "g has shape"),
    (dict(beta=None), "needs beta"),
    (dict(K=40), "K \\(key head dim\\)"),
    (dict(cu=[0, 3, 2, 5]), "nondecreasing"),
    (dict(cu=[0, 2, 4]), "end at T"),
    (dict(h0_rows=3), "N=2"),
])
def test_bad_inputs_are_refused(bad, match, monkeypatch):
    import torch
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    fake_compiles(monkeypatch)
    K = bad.get("K", 64)
    q = torch.zeros(1, 5, 2, K, dtype=torch.bfloat16)
    v = torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)
    g = torch.zeros(bad.get("g_shape", (1, 5, 2)))
    beta = bad.get("beta", torch.zeros(1, 5, 2))
    cu = torch.tensor(bad.get("cu", [0, 2, 5]))
    h0 = torch.zeros(bad.get("h0_rows", 2), 2, K, 64)
    with pytest.raises(SpecError, match=match):
        chunk.chunk_forward(get_spec("gdn"), q, q, v, g, beta, initial_state=h0,
                            cu_seqlens=cu, cu_seqlens_cpu=cu)


def test_unknown_config_is_refused(monkeypatch):
    import torch
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    fake_compiles(monkeypatch)
    q = torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(SpecError, match="unknown plan config"):
        chunk.chunk_forward(get_spec("gdn"), q, q, q, torch.zeros(1, 5, 2),
                            torch.zeros(1, 5, 2), config={"split": True})


def test_walk_probe_configs_are_checked():
    """inverse_stub takes the values the fused walk's template knows, named in one line."""
    kw = dict(H=16, HV=16, K=128, V=128, dtype="bfloat16", seq_chunks=(128,) * 8,
              Ttot=8 * 8192)
    plan = chunk.forward_plan(get_spec("gdn"), Options(), **kw,
                              config={"inverse_in_walk": 1, "inverse_stub": 1})
    (walk,) = plan.launches
    assert walk.kwargs["inverse_stub"] == 1
    with pytest.raises(ValueError, match="inverse_stub=3"):
        chunk.forward_plan(get_spec("gdn"), Options(), **kw,
                           config={"inverse_in_walk": 1, "inverse_stub": 3})


def by_name(bodies):
    """A fake_compiles body from {stage: fn(params, **kernel arguments by name)}."""
    def body(spec, stage, params):
        fn = bodies.get(stage)
        if fn is None:
            return None
        names = runtime.arg_names(runtime.stage_module(spec, stage, "sm90").build(**params))
        return lambda *args: fn(params, **dict(zip(names, args)))
    return body


def test_gla_chunk_fwd_contract_assembles_states(monkeypatch):
    """GLAChunkFwd through the chunked forward (fake kernels checked against the traced
    prim_funcs), at the plan the arch picks: the state pass (chunk_state or
    chunk_state_output, over whole sequences or segments) with states_out writing h
    [B, NC+1, H, K, V] f32 itself (chunk c of sequence n at row chunk_offsets[n] + n + c,
    the final state after them), final_state the view h[:, NC]; varlen: each sequence's
    final row gathered; a bad shape is refused before any launch."""
    import torch
    from linattn.ops import contracts
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    chunk._plan.cache_clear()

    def state(params, chunk_offsets, ht, final_row, seg_seq, **_):
        # states: chunk c of the call holds c; final: -1-n (piece p of sequence seg_seq[p])
        assert params["states_out"] and params["output_final_state"]
        offs = chunk_offsets.tolist()
        ht.fill_(float("nan"))
        for p in range(len(offs) - 1):
            m = int(seg_seq[p])
            for c in range(offs[p], offs[p + 1]):
                ht[c + m] = c
            if final_row[p] >= 0:
                ht[offs[p + 1] + int(final_row[p])] = -1.0 - m

    calls = []
    fake_compiles(monkeypatch, by_name({"chunk_state": state, "chunk_state_output": state}),
                  calls)
    plans = record_plans(monkeypatch)
    try:
        B, T, H, K, V = 2, 130, 2, 64, 64
        bf = torch.bfloat16
        q, k = torch.randn(B, T, H, K, dtype=bf), torch.randn(B, T, H, K, dtype=bf)
        v, g = torch.randn(B, T, H, V, dtype=bf), -torch.rand(B, T, H, K).to(bf)
        o, final, h = contracts.gla_chunk_fwd(q, k, v, g, scale=0.125)
        NC = 3
        assert [s for s, _ in calls] == plans[0].stages()
        assert o.shape == (B, T, H, V) and o.dtype == bf
        assert final.shape == (B, H, K, V) and final.dtype == torch.float32
        assert h.shape == (B, NC + 1, H, K, V) and h.dtype == torch.float32
        for b in range(B):
            for c in range(NC):
                assert torch.all(h[b, c] == b * NC + c)
            assert torch.all(final[b] == -1 - b)
        assert torch.equal(h[:, NC], final)
        lens = [70, 1, 0, 130]                              # varlen: 2 + 1 + 0 + 3 chunks
        cu = torch.tensor([0, 70, 71, 71, 201])
        qv, kv, vv = (torch.randn(1, 201, H, D, dtype=bf) for D in (K, K, V))
        gv = -torch.rand(1, 201, H, K).to(bf)
        _, fin, states = chunk.chunk_forward(get_spec("gla"), qv, kv, vv, gv, scale=0.125,
                                             cu_seqlens=cu, output_final_state=True,
                                             return_states=True)
        assert states.shape == (6 + len(lens), H, K, V)
        assert [float(fin[n, 0, 0, 0]) for n in range(4)] == [-1.0, -2.0, -3.0, -4.0]
        n_launch = len(plans)
        with pytest.raises(SpecError):
            contracts.gla_chunk_fwd(q, k, v, g[..., :32])
        assert len(plans) == n_launch
    finally:
        chunk._plan.cache_clear()


# -- many chunks: grids within CUDA's limits -------------------------------------------------

_GRID = re.compile(r'T\.thread_binding\((.*?), thread="blockIdx\.([xyz])"\)')


def _sizes(func, args) -> dict:
    """The dynamic sizes of a launch (solved from its arguments' shapes, as
    SignatureCheckingKernel does)."""
    binds, exprs = {}, []
    for p, a in zip(func.params, args):
        buf = func.buffer_map.get(p)
        if buf is None:
            continue
        for s, d in zip(buf.shape, a.shape):
            text = str(s)
            if text.isidentifier():
                binds.setdefault(text, d)
            elif not text.isdigit():
                exprs.append((text, d))
    for text, d in exprs:
        for op, solve in ((" + ", lambda d, c: d - c), (" * ", lambda d, c: d // c)):
            var, hit, const = text.partition(op)
            if hit and var.isidentifier() and const.isdigit() and var not in binds:
                binds[var] = solve(d, int(const))
    return binds


def grid_recorder(monkeypatch):
    """fake_compiles whose kernels also note each launch's grid {stage: (x, y, z)}."""
    grids = {}

    def body(spec, stage, params):
        func = runtime.stage_module(spec, stage, "sm90").build(**params)
        dims = dict((axis, ext) for ext, axis in _GRID.findall(func.script()))

        def run(*args):
            binds = _sizes(func, args)
            grids[stage] = tuple(eval(dims.get(a, "1"), {}, dict(binds)) for a in "xyz")
        return run
    fake_compiles(monkeypatch, body)
    return grids


def _many_chunks(monkeypatch, limit):
    monkeypatch.setattr(sm90_hardware, "MAX_GRID_YZ", limit)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)


def _gdn_inputs(name, T=130, H=1, K=64, V=64, B=1):
    import torch
    bf = torch.bfloat16
    q, k, v = (torch.randn(B, T, H, D, dtype=bf) for D in (K, K, V))
    key = _spec(name).gate is Gate.KEY
    g = -torch.rand(B, T, H, K) if key else -torch.rand(B, T, H)
    return q, k, v, g, torch.rand(B, T, H, dtype=bf)


@pytest.mark.parametrize("name,config,want", [
    ("gdn", {}, "walk"), ("gdn", {"segments": 2}, "walk-split"),
    ("kda", {}, "fused"), ("kda", {"fused": True}, "fused"),
    ("additive_scalar", {}, "fused"),
])
def test_many_chunks_take_grids_that_fit(monkeypatch, fresh_plans, name, config, want):
    """Past CUDA's gridDim.y / z limit (MAX_GRID_YZ, made 2 here) in chunks, the forward
    takes chunk-fastest grids (no heads_fastest) and a pipeline without chunk_output (whose
    grid has the chunk on y or z): every launch's grid fits (one sequence, one head: the
    (sequence x head) axes stay within the limit, see the next tests)."""
    _many_chunks(monkeypatch, 2)
    grids = grid_recorder(monkeypatch)
    plans = record_plans(monkeypatch)
    q, k, v, g, beta = _gdn_inputs(name)           # 3 chunks > 2
    spec = _spec(name)
    chunk.chunk_forward(spec, q, k, v, g, beta if spec.has_beta else None,
                        output_final_state=True, config=config)
    assert plans[0].name == want and "chunk_output" not in grids
    assert not any(la.kwargs.get("heads_fastest") for la in plans[0].launches)
    for stage, (x, y, z) in grids.items():
        assert y <= 2 and z <= 2, (stage, (x, y, z))


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_many_chunks_forced_three_stage_fits_or_is_refused(monkeypatch, fresh_plans, name):
    """The three-stage pipeline forced past the chunk limit: chunk_output's grid has the
    chunks on y (z heads-fastest), so the call is refused with a clear error (or, should
    the pipeline learn to split it, every grid fits); never a launch CUDA refuses."""
    _many_chunks(monkeypatch, 2)
    grids = grid_recorder(monkeypatch)
    q, k, v, g, beta = _gdn_inputs(name)
    try:
        chunk.chunk_forward(_spec(name), q, k, v, g, beta, output_final_state=True,
                            config={"fused": False})
    except SpecError:
        return
    for stage, (x, y, z) in grids.items():
        assert y <= 2 and z <= 2, (stage, (x, y, z))


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_many_sequences_take_grids_that_fit(monkeypatch, fresh_plans, name):
    """(sequences or segments) x value heads lie on gridDim.y in the walk and the state
    passes: past MAX_GRID_YZ such a call is refused with a clear error or its grids fit."""
    _many_chunks(monkeypatch, 2)
    grids = grid_recorder(monkeypatch)
    q, k, v, g, beta = _gdn_inputs(name, T=64, B=3)    # 3 sequences x 1 head > 2
    try:
        chunk.chunk_forward(_spec(name), q, k, v, g, beta, output_final_state=True)
    except SpecError:
        return
    for stage, (x, y, z) in grids.items():
        assert y <= 2 and z <= 2, (stage, (x, y, z))


def test_many_chunks_refuse_what_cannot_fit(monkeypatch, fresh_plans):
    """The per-chunk states (GLAChunkFwd) and the DeltaNet contract forward are refused
    with a clear error instead of a failed launch; within the limit the grids are the
    heads-fastest ones again."""
    import torch
    from linattn.ops import chunk_bwd, contracts
    _many_chunks(monkeypatch, 2)
    grids = grid_recorder(monkeypatch)
    bf = torch.bfloat16
    q, k, v, g, beta = _gdn_inputs("gdn")
    with pytest.raises(SpecError, match="per-chunk states"):
        contracts.gla_chunk_fwd(q, k, v, -torch.rand(1, 130, 1, 64).to(bf))
    hf = lambda *s: torch.randn(*s, dtype=bf)  # noqa: E731
    monkeypatch.setattr(chunk_bwd, "_check_device", lambda n, t: None)
    with pytest.raises(SpecError, match="chunks in all"):
        contracts.deltanet_chunk_fwd(hf(1, 2, 130, 64), hf(1, 2, 130, 64), hf(1, 2, 130, 64),
                                     torch.rand(1, 2, 130, dtype=bf))
    assert grids == {}
    _many_chunks(monkeypatch, 65535)                  # 3 chunks fit: as before
    chunk._plan.cache_clear()
    plans = record_plans(monkeypatch)
    chunk.chunk_forward(get_spec("gdn"), q, k, v, g, beta, output_final_state=True,
                        config={"fused": False})
    assert "chunk_output" in grids and grids["chunk_output"][2] == 3     # NT on z
    assert all(la.kwargs.get("heads_fastest", True) for la in plans[0].launches)


# -- source rules ----------------------------------------------------------------------------

def _sources(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_environment_knobs():
    """The engine reads no LINATTN_* variable but LINATTN_GEN_DIR (where specs outside the
    registry are rendered); tuning is the arch's plan, forced only through config."""
    names, dynamic = set(), []
    for path in list(_sources("dsl", "codegen", "ops")) + sorted(
            (ROOT / "codegen" / "templates").glob("*.jinja")):
        text = path.read_text()
        names |= set(re.findall(r"LINATTN_[A-Z0-9_]+", text))
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(text)):     # environ[...] / environ.get / getenv
            key = None
            if isinstance(node, ast.Subscript) and _is_environ(node.value):
                key = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    (node.func.attr in ("get", "setdefault", "pop") and _is_environ(node.func.value))
                    or node.func.attr == "getenv"):
                key = node.args[0] if node.args else None
            else:
                continue
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                dynamic.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            else:
                names.add(key.value) if key.value.startswith("LINATTN_") else None
    assert names <= {"LINATTN_GEN_DIR"}, sorted(names)
    assert not dynamic, dynamic          # a computed variable name could be any knob


def _is_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def test_rendered_files_never_change(monkeypatch, tmp_path):
    """A spec outside the registry renders into LINATTN_GEN_DIR one file a rendering,
    named by its text: another rendering of the same stage (a template edit, another
    linattn version sharing the folder) gets a file of its own, and the one a process
    loaded (TileLang reads it again when it builds) stays as it was."""
    from linattn.codegen import render
    monkeypatch.setenv("LINATTN_GEN_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_MODULES", {})
    spec = SIX["additive_key"]
    first = runtime.stage_module(spec, "chunk_state", "sm90")
    text = Path(first.__file__).read_text()
    assert Path(first.__file__).parent.parent == tmp_path / "sm90"
    assert text == render.render_stage(spec, {st.name: st for st in stage_plan(spec, "fwd")}[
        "chunk_state"], "sm90", shipped=False)
    real = render.render_stage
    monkeypatch.setattr(render, "render_stage", lambda *a, **k: real(*a, **k) + "# edited\n")
    monkeypatch.setattr(runtime, "_MODULES", {})
    second = runtime.stage_module(spec, "chunk_state", "sm90")
    assert second.__file__ != first.__file__ and second.STAGE == "chunk_state"
    assert Path(first.__file__).read_text() == text
    assert Path(second.__file__).read_text() == text + "# edited\n"
    assert not list(tmp_path.rglob("*.tmp"))


MAX_FUNCTION_LINES = 80


def test_ops_functions_are_short():
    """No function in ops/ longer than 80 lines (def to its last line, docstring
    included)."""
    long = {}
    for path in _sources("ops"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}::{node.name}"] = n
    assert not long, long
