"""CPU checks of the additive rule's state pass (codegen/arch/sm90/additive.py): the
sequence split (chunk_state_summary, then the state pass from the chained segment
starts), the key / value blocks and the output forms, through chunk_forward with fp64
fakes of every stage (tests/test_chunk_fused.py's PipelineMath: each launch checked
against the traced kernel, the additive state walked tile by tile as its CTAs do) and
every fresh allocation NaN-filled, against the torch fp64 reference: o, the final
states, the contract's per-chunk states (return_states) and the segment summaries.
Also the model's rules and the sm_90a compiles of the stages at the new tiles. The GPU
half: tests/test_chunk_additive_gpu.py."""
import shutil

import numpy as np
import pytest
import torch

from _kernel_check import fake_compiles
from test_chunk import record_plans
from test_chunk_fused import PipelineMath, _spec, make_inputs

from linattn.codegen.arch.sm90 import additive as am
from linattn.codegen.arch.sm90 import hardware as hw
from linattn.codegen.pipeline import ForwardProblem
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tr
from linattn.ops import chunk, chunk_split

F64 = torch.float64
C = 64


@pytest.fixture
def poisoned(monkeypatch):
    """NaN in every fresh float allocation (as conftest does for the GPU tests): an output
    element no fake writes cannot pass."""
    from conftest import _poisoned
    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, _poisoned(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))


def run(monkeypatch, name, options, lens, config, H=2, HV=2, K=64, V=64, states=False,
        final=True):
    """chunk_forward through the fp64 fakes: (result, fp64 reference dict, fakes' notes,
    plan)."""
    spec = _spec(name)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    math = PipelineMath(spec, H, HV, K, V)
    fake_compiles(monkeypatch, math.body)
    plans = record_plans(monkeypatch)
    x = make_inputs(spec, options, lens, H, HV, K, V)
    res = chunk.chunk_forward(spec, **{n: x[n] for n in ("q", "k", "v", "g", "beta")},
                              initial_state=x["initial_state"], output_final_state=final,
                              options=options, cu_seqlens=x["cu_seqlens"],
                              cu_seqlens_cpu=x["cu_seqlens_cpu"], A_log=x["A_log"],
                              dt_bias=x["dt_bias"], return_states=states, config=config)
    ref = tr.chunked_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"], options=options,
                             initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                             A_log=x["A_log"], dt_bias=x["dt_bias"], intermediates=True)
    return res, ref, math.seen, plans[0]


def _rel(a, b):
    return ((a.to(F64) - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ref_states(ref, lens, v_first):
    """The contract's rows: per sequence its chunks' entering states, then its final."""
    h, fin, rows, c = ref["h"][0], ref["final_state"], [], 0
    for n, length in enumerate(lens):
        nc = -(-length // C)
        rows += [h[c + j].transpose(-1, -2) if v_first else h[c + j] for j in range(nc)]
        rows.append(fin[n])
        c += max(nc, 1)          # (the reference gives an empty sequence one state row)
    return torch.stack(rows)


LENS = [1, 70, 0, 5, 400, 129]      # empty, one-token, ragged, a 7-chunk sequence
SPLIT_CASES = [
    ("gla", Options(), {"segments": 2}),
    ("gla", Options(state_v_first=True), {"segments": 1, "block_k": 32, "block_v": 16}),
    ("gla", Options(), {"segments": 3, "fused": True}),
    ("gla", Options(), {"segments": 2, "fused": False, "block_k": 32, "block_v": 32}),
    ("additive_scalar", Options(), {"segments": 2}),
    ("additive_scalar", Options(l2norm_qk=True, gate_in_kernel=True, state_v_first=True),
     {"segments": 3, "fused": False, "block_k": 32}),
    ("additive_none", Options(), {"segments": 2, "fused": True}),
    ("additive_none", Options(l2norm_qk=True), {"segments": 4, "fused": False,
                                                "block_k": 32, "block_v": 16}),
    ("additive_key", Options(gate_in_kernel=True), {"segments": 2}),
    ("gla", Options(), {}),                 # the model's own choice
]


def _id(case):
    name, o, cfg = case
    flags = [f for f in ("l2norm_qk", "gate_in_kernel", "state_v_first") if getattr(o, f)]
    return "-".join([name] + flags + [f"{k}{v}" for k, v in cfg.items()] or ["model"])


@pytest.mark.parametrize("name,options,config", SPLIT_CASES, ids=[_id(c) for c in SPLIT_CASES])
def test_split_matches_reference(monkeypatch, poisoned, name, options, config):
    """The split and tiled state pass: o and final states within f16 storage of the fp64
    reference; each segment's summary and each chained start exact (f32 storage)."""
    (o, ht), ref, seen, plan = run(monkeypatch, name, options, LENS, config)
    split = bool(config.get("segments"))
    assert plan.name.endswith("-split") == split, str(plan)
    assert ("chunk_state_summary" in plan.stages()) == split
    if "fused" in config:
        assert plan.name.startswith("fused" if config["fused"] else "three-stage")
    assert _rel(o, ref["o"]) < 5e-3
    assert _rel(ht, ref["final_state"]) < 5e-3
    if "block_k" in config:                 # (the summary's tile and the pass's)
        assert seen["block_k"] == {config["block_k"]}


@pytest.mark.parametrize("name,config", [("gla", {"segments": 2, "fused": False}),
                                         ("gla", {"segments": 2, "fused": True}),
                                         ("gla", {"segments": 1, "block_k": 32}),
                                         ("additive_scalar", {"segments": 3, "fused": True}),
                                         ("additive_none", {"segments": 2, "block_v": 16}),
                                         ("gla", {})])
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vfirst"])
def test_split_states_match_reference(monkeypatch, poisoned, name, config, v_first):
    """return_states (GLAChunkFwd's h): every chunk's entering state and each sequence's
    final state at the contract's rows, written by the segments' walks from their chained
    starts, with h for chunk_output or with o inside (f32: within the f16 inputs' rounding
    of the fp64 states)."""
    (o, fin, states), ref, seen, plan = run(monkeypatch, name, Options(state_v_first=v_first),
                                            LENS, config, states=True)
    if "fused" in config:
        assert plan.name.startswith("fused" if config["fused"] else "three-stage")
    assert plan.launches[-2 if plan.name.startswith("three") else -1].kwargs["states_out"]
    want = _ref_states(ref, LENS, v_first)
    assert states.shape == want.shape and states.dtype == torch.float32
    assert _rel(states, want) < 5e-3
    assert _rel(fin, ref["final_state"]) < 5e-3 and _rel(o, ref["o"]) < 5e-3


@pytest.mark.parametrize("name", ["gla", "additive_scalar", "additive_none"])
@pytest.mark.parametrize("L,tile", [(1, {"block_k": 32, "block_v": 16}), (2, {"fused": True}),
                                    (3, {"block_k": 32, "fused": False})])
def test_split_is_exact(monkeypatch, poisoned, name, L, tile):
    """The split changes nothing but f32 rounding: through the same fakes (so the same
    prepared, rounded operands), every per-chunk state and final state of the split plan
    equals the unsplit plan's within the f32 storage of the segment summaries (1e-6), at
    any segment length, key block, value block and output form."""
    got = run(monkeypatch, name, Options(), LENS, dict(tile, segments=L), states=True)
    want = run(monkeypatch, name, Options(), LENS, {"segments": 0, "fused": False},
               states=True)
    assert got[3].name.endswith("-split") and want[3].name == "three-stage"
    (_, fin, states), (_, fin0, states0) = got[0], want[0]
    assert _rel(states, states0.double()) < 1e-6 and _rel(fin, fin0.double()) < 1e-6


def test_gpu_step_cases_bind(monkeypatch):
    """Every case of the GPU step (tests/test_chunk_additive_gpu.py) plans and binds on the
    CPU: each launch's arguments checked against the traced kernel (no arithmetic), the
    forced configs taken, GLAChunkFwd's h shaped [B, NC+1, H, K, V]."""
    import test_chunk_additive_gpu as gpu
    from linattn.ops.registry import get_spec
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    fake_compiles(monkeypatch)
    plans = record_plans(monkeypatch)
    for c in gpu.CASES:
        p = c.values[0]
        spec, opts = get_spec(p["op"]), Options(**{n: True for n in p["opts"]})
        B, T, cu = p["B"], p["T"], None
        if p["lens"]:
            cu = torch.tensor([0] + np.cumsum(p["lens"]).tolist())
            T = int(cu[-1])
        N, dt = len(p["lens"] or [0] * B), getattr(torch, p["dtype"])
        q, v = torch.randn(B, T, p["H"], p["K"]).to(dt), torch.randn(B, T, p["HV"], p["V"]).to(dt)
        g = -torch.rand(*spec.gate_shape(B, T, p["HV"], p["K"])) if spec.has_gate else None
        shape = (N, p["HV"]) + ((p["V"], p["K"]) if opts.state_v_first else (p["K"], p["V"]))
        chunk.chunk_forward(spec, q, q, v, g, None, options=opts, cu_seqlens=cu,
                            cu_seqlens_cpu=cu, initial_state=torch.randn(shape) if p["init"]
                            else None, output_final_state=p["final"], config=p["config"])
        if "segments" in p["config"]:
            L = p["config"]["segments"]
            assert plans[-1].segments == (L if max(p["lens"] or [T]) > C * L else 0), c.id
    for B, T, H, K, V, init, dtype, config in gpu.CONTRACT:
        dt = getattr(torch, dtype)
        q, v = torch.randn(B, T, H, K).to(dt), torch.randn(B, T, H, V).to(dt)
        _, _, h = gpu.gla_states(q, q, v, -torch.rand(B, T, H, K).to(dt),
                                 torch.randn(B, H, K, V) if init else None, config)
        assert h.shape == (B, -(-T // C) + 1, H, K, V)


# -- the model ------------------------------------------------------------------------

def _problem(seq_chunks, HV=4, K=64, V=64, gate="key", return_states=False, **kw):
    return ForwardProblem(rule="additive", gate=gate, H=HV, HV=HV, K=K, V=V,
                          dtype="bfloat16", g_dtype="float32", beta_dtype="float32",
                          Ttot=64 * sum(seq_chunks), seq_chunks=tuple(seq_chunks),
                          return_states=return_states, **kw)


def test_model_splits_few_long_chains_only():
    # the table's [2, 16384, 4, 64]: 8 chains of 256 chunks: split
    for states in (False, True):
        c = am.choose(_problem((256, 256), return_states=states), {}, 64,
                      [False] if states else [True, False])
        assert 2 <= c.segments < 256 and c.us < am.choose(
            _problem((256, 256), return_states=states), {"segments": 0}, 64,
            [False] if states else [True, False]).us
    # 64 heads x 32 sequences of 16 chunks: the GPU is full, no split
    assert am.choose(_problem((16,) * 32, HV=64), {}, 64).segments == 0
    assert am.choose(_problem((1, 1)), {}, 64).segments == 0          # nothing to cut
    # forced choices are taken; impossible ones refused in one line
    c = am.choose(_problem((40,)), {"segments": 4, "block_k": 32, "block_v": 16}, 64, [False])
    assert (c.segments, c.block_k, c.block_v, c.fused) == (4, 32, 16, False)
    with pytest.raises(ValueError, match="block_k=48"):
        am.choose(_problem((40,)), {"block_k": 48}, 64)
    with pytest.raises(ValueError, match="segments=-1"):
        am.choose(_problem((40,)), {"segments": -1}, 64)


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (256, 512), (128, 512), (16, 48)])
def test_model_tiles_fit(K, V):
    """Every tile tried divides K and V and keeps the f32 state within 64 registers a
    thread; the fused output takes all of K."""
    for fused in (False, True):
        tl = am.tiles(K, V, fused)
        assert tl
        for bk, bv in tl:
            assert K % bk == 0 and V % bv == 0 and bk * bv <= am.MAX_TILE
            assert bk == K or not fused
    c = am.choose(_problem((300,), K=K, V=V), {}, 64 if V % 64 == 0 else 16)
    assert K % c.block_k == 0 and V % c.block_v == 0 and (c.block_k == K or not c.fused)


def test_model_span():
    assert am.span((1.0,), hw.NUM_SMS) == 1.0
    assert am.span((1.0,), hw.NUM_SMS + 1) == 2.0
    assert am.span((3.0, 1.0), 1) == 3.0
    big = am.EXACT_WAVES * hw.NUM_SMS + 1
    assert am.span((1.0,), big) == pytest.approx(big / hw.NUM_SMS)
    assert am.pieces((5, 0, 2), 2) == [[2, 2, 1], [0], [2]]
    assert am.pieces((5, 0), 0) == [[5], [0]]
    # more chunks or heads: never faster; a summary step cheaper than a walk step
    p = _problem((64,))
    assert am.walk_us(_problem((65,)), 0, 64, 64, False) >= am.walk_us(p, 0, 64, 64, False)
    assert am.summary_us(p, 8, 64, 64) < am.walk_us(p, 8, 64, 64, False)


def test_split_never_exceeds_the_grid(monkeypatch, fresh_plans):
    """Segments x value heads on gridDim.y: lengths whose pieces overflow it are skipped."""
    monkeypatch.setattr(hw, "MAX_GRID_YZ", 8)
    c = am.choose(_problem((256,), HV=4), {}, 64)
    assert sum(map(len, am.pieces((256,), c.segments))) * 4 <= 8
    with pytest.raises(ValueError, match="no state pass"):
        am.choose(_problem((256,), HV=4), {"segments": 2}, 64)


def test_wide_heads_plan(monkeypatch):
    """K = 256, V = 512 (GLA-1.3B's heads): the chunked forward's plan at tiles within the
    register budget, two TMA stages for the fused pass (no w: they fit at K = 256)."""
    for name, K in (("gla", 256), ("additive_scalar", 256), ("additive_none", 256)):
        p = chunk.forward_plan(_spec(name), Options(), H=2, HV=2, K=K, V=512,
                               dtype="bfloat16", seq_chunks=(64, 3), Ttot=67 * 64,
                               output_final_state=True)
        for la in p.launches:
            kw = la.kwargs
            if la.stage.startswith("chunk_state"):
                assert (kw.get("block_k") or K) * kw["block_v"] <= am.MAX_TILE, str(p)
            if la.stage == "chunk_state_output":
                assert kw["num_stages"] == 2, str(p)


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("seq_chunks", [(256,), (64, 64)])
def test_wide_heads_fused_pass_fits(seq_chunks):
    """The plan's fused state pass at GLA-1.3B's heads (K = 256, V = 512: two TMA stages)
    compiles without spills within the shared memory."""
    from linattn.codegen.compile import compile_stage, format_record
    spec = _spec("gla")
    p = chunk.forward_plan(spec, Options(), H=4, HV=4, K=256, V=512, dtype="bfloat16",
                           seq_chunks=seq_chunks, Ttot=64 * sum(seq_chunks))
    la = [la for la in p.launches if la.stage == "chunk_state_output"][0]
    rec = compile_stage(chunk.stage_module(spec, la.stage), la.kwargs, "sm90")
    print(format_record(rec))
    assert "error" not in rec and "ptxas_error" not in rec, rec
    assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
    assert rec["static_smem_bytes"] + rec["dynamic_smem_bytes"] <= hw.SMEM_BYTES


@pytest.mark.parametrize("name,K,V,path", [
    ("gla", 128, 512, "chunk"), ("simple_gla", 256, 512, "chunk"),
    ("linear_attn", 64, 512, "chunk"),
    ("gla", 256, 512, "chunk"),              # GLA-1.3B's heads
    ("gla", 128, 640, "recurrent"), ("gdn", 128, 512, "recurrent")])
def test_public_calls_take_the_chunked_kernels_up_to_512(name, K, V, path):
    """fla's chunk_gla / chunk_simple_gla / chunk_linear_attn with V = 512 (GLA-1.3B's
    value heads) take the chunked forward, not the sequential recurrent kernel."""
    from linattn.ops import api, validate
    from linattn.ops.registry import get_spec
    dims = validate.Dims(1, 64, 2, 2, K, V)
    assert api.choose_path(get_spec(name), dims, torch.bfloat16, False) == path


def test_refusals_name_the_limits(monkeypatch):
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    fake_compiles(monkeypatch)
    q = torch.zeros(1, 5, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(SpecError, match="V"):           # past 512
        chunk.chunk_forward(_spec("gla"), q, q, torch.zeros(1, 5, 1, 640, dtype=torch.bfloat16),
                            -torch.ones(1, 5, 1, 64))
    with pytest.raises(SpecError, match="V"):           # the delta rule keeps 256
        chunk.chunk_forward(_spec("gdn"), q, q, torch.zeros(1, 5, 1, 512, dtype=torch.bfloat16),
                            -torch.ones(1, 5, 1), torch.ones(1, 5, 1))


# -- compiling ------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["gla", "simple_gla", "linear_attn"])
@pytest.mark.parametrize("stage", ["chunk_state_summary", "chunk_state", "chunk_state_output"])
def test_split_stages_compile(name, stage):
    """The EXAMPLES of the additive state pass (key blocks, segment starts, K = 256 with
    V = 512) compile for sm_90a without spills within the shared memory."""
    from linattn.codegen.compile import compile_stage, format_record
    from linattn.ops.registry import get_spec
    mod = chunk.stage_module(get_spec(name), stage)
    for ex in mod.EXAMPLES:
        if stage != "chunk_state_summary" and not ex.get("segment_starts"):
            continue                  # (the unsplit examples: tests/test_chunk.py)
        rec = compile_stage(mod, dict(ex, num_stages=2), "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
        assert rec["static_smem_bytes"] + rec["dynamic_smem_bytes"] <= hw.SMEM_BYTES
