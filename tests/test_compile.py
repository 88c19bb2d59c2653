"""Every generated stage lowers and compiles for sm_90a (nvcc, no GPU needed).

For each checked-in module: each of its EXAMPLES configurations. For the six rule x gate
specs and the value gate (rendered into a temp dir): all options off at K = V = 128, all
on at K = V = 64.
Registers, shared memory and spills (ptxas -v) are printed (run with -s to see them);
``linattn-gen --compile --report FILE`` writes the same records as JSON.
"""
import shutil

import pytest

from linattn.codegen import plan, render_stage
from linattn.codegen.compile import compile_stage, format_record, load_module
from linattn.codegen.render import DEFAULT_OUT
from linattn.dsl import all_rule_gate_specs, value_gate_spec
from linattn.ops.registry import specs

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]

ARCH = "sm90"


def _kernel_text(path) -> str:
    """A generated module less its comments and spec identity (SPEC_KEY, SPEC_HASH): two
    families whose stage differs only there build the same kernels (retention's and
    lightning's fixed decays, simple_gla's and Mamba-2's scalar gate in the backward)."""
    return "\n".join(line for line in path.read_text().splitlines()
                     if not line.startswith(("#", "SPEC_KEY =", "SPEC_HASH =")))


def _generated_cases():
    cases, seen = [], {}
    for name, spec in sorted(specs().items()):
        for stage in plan(spec, None, ARCH):
            path = DEFAULT_OUT / ARCH / name / f"{stage.name}.py"
            first = seen.setdefault(_kernel_text(path), f"{name}-{stage.name}")
            for i, _ in enumerate(load_module(path).EXAMPLES):
                # the default (fast) run keeps one compile a family: its decode kernel's
                # first example; --exhaustive compiles every stage and example, once for
                # the families whose modules build the same kernels
                rep = (pytest.mark.representative,) if (stage.name, i) == ("recurrent", 0) else ()
                if rep or first == f"{name}-{stage.name}":
                    cases.append(pytest.param(path, i, id=f"{name}-{stage.name}-ex{i}",
                                              marks=rep))
    return cases


def _check(rec):
    print(format_record(rec))
    assert "error" not in rec, rec["error"]
    assert "ptxas_error" not in rec, rec["ptxas_error"]
    assert rec["registers"] and rec["registers"] <= 255
    # a TMA load into shared memory not 128-byte aligned (run s9-1: misaligned address)
    assert not rec.get("tma_misaligned"), f"TMA shared destinations not 128-byte aligned, " \
        f"CUDA lines {rec['tma_misaligned']}"
    # a CTA barrier inside a branch on threadIdx (some threads never reach it: a hang)
    assert not rec.get("named_barrier_mismatch"), \
        f"named barriers synced with two thread counts: {rec['named_barrier_mismatch']}"
    assert not rec["barriers_in_branches"], f"__syncthreads in a thread-dependent branch, " \
        f"CUDA lines {rec['barriers_in_branches']}"
    # ptxas's "Potential Performance Loss" (e.g. its tensor-core products serialized)
    assert not rec.get("perf_loss"), f"ptxas: {rec['perf_loss']}"
    if rec["stage"] == "recurrent":     # state in registers: a spill would be a perf bug
        assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec


@pytest.mark.parametrize("path, index", _generated_cases())
def test_generated_stage_compiles(path, index):
    module = load_module(path)
    _check(compile_stage(module, module.EXAMPLES[index], ARCH))


SIX = all_rule_gate_specs()
RECURRENT_SPECS = SIX + [value_gate_spec()]


@pytest.mark.parametrize("spec", RECURRENT_SPECS, ids=[s.name for s in RECURRENT_SPECS])
@pytest.mark.parametrize("all_on", [False, True], ids=["flags_off", "flags_on"])
def test_rule_gate_recurrent_compiles(tmp_path, spec, all_on):
    (stage,) = plan(spec, "decode", ARCH)
    path = tmp_path / f"{spec.name}_{stage.name}.py"
    path.write_text(render_stage(spec, stage, ARCH))
    module = load_module(path, f"six_{spec.name}_{int(all_on)}")
    H, HV = (2, 4) if all_on else (4, 4)
    K = V = 64 if all_on else 128
    problem = dict(H=H, HV=HV, K=K, V=V, dtype="float16" if all_on else "bfloat16",
                   state_dtype="float32")
    if all_on:
        problem.update({n: True for n in spec.supports}, has_initial_state=True,
                       output_final_state=True, varlen=True)
    _check(compile_stage(module, problem, ARCH))


@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_value_gate_recurrent_compiles_k_ne_v(tmp_path, v_first):
    """The value gate indexes g and dt_bias by value channel: K != V, several value blocks,
    gate_in_kernel, a per-token state pool written in place."""
    spec = value_gate_spec()
    (stage,) = plan(spec, "decode", ARCH)
    path = tmp_path / f"{spec.name}_{stage.name}.py"
    path.write_text(render_stage(spec, stage, ARCH))
    module = load_module(path, f"value_gate_{int(v_first)}")
    problem = dict(H=2, HV=4, K=128, V=96, dtype="bfloat16", state_dtype="float32",
                   gate_in_kernel=True, state_v_first=v_first, has_initial_state=True,
                   output_final_state=True, varlen=True, state_pool=True,
                   slots_per_token=True, accepted_tokens=True, inplace=True)
    _check(compile_stage(module, problem, ARCH))


def test_recording_notes_every_announced_stage_and_compiles_nothing():
    """runtime.recording(): a multi-stage call announces all its kernels at once; a lone
    compile_stage is noted too; nothing is compiled (the memo stays empty for them)."""
    from linattn.ops import gdn, runtime
    p1 = dict(H=2, HV=4, K=64, V=64, dtype="bfloat16")
    p2 = dict(p1, block_v=32)
    with runtime.recording() as req:
        with pytest.raises(runtime.KernelRequested):
            runtime.announce(gdn.SPEC, "sm90", {"chunk_output": p1, "chunk_state": p2})
    assert [(j[1], j[3]) for j in req] == [("chunk_output", p1), ("chunk_state", p2)]
    with runtime.recording() as req:
        with pytest.raises(runtime.KernelRequested):
            runtime.compile_stage(gdn.SPEC, "chunk_output", "sm90", p1)
    assert len(req) == 1 and req[0][0] is gdn.SPEC
    assert runtime._key(gdn.SPEC, "chunk_output", "sm90", p1) not in runtime._KERNELS
    runtime.announce(gdn.SPEC, "sm90", {"chunk_output": p1})    # outside recording: no-op


#: representative calls (op, options, sizes, config) whose plans' launches must compile
PLAN_CASES = [
    ("gdn", dict(H=16, HV=16, K=128, V=128, seq_chunks=(64,)), {}),          # prefill-4k
    ("gdn", dict(H=2, HV=8, K=128, V=128, seq_chunks=(128,)), {}),           # tp8: split
    ("deltanet", dict(H=4, HV=4, K=64, V=64, seq_chunks=(32, 32)), {"fused": False}),
    ("kda", dict(H=16, HV=16, K=128, V=128, seq_chunks=(64,)), {}),          # fused
    ("gla", dict(H=2, HV=2, K=64, V=64, seq_chunks=(16,)), {}),              # three-stage
    # a training backward's recompute of the states (GLA-1.3B's heads, 4 x 4k)
    ("gla", dict(H=4, HV=4, K=256, V=512, seq_chunks=(64,) * 4, return_states=True,
                 states_only=True), {}),
    # V not a multiple of 32: the per-key prepare's u panels (16 wide failed on sm_90a)
    ("kda", dict(H=8, HV=8, K=128, V=48, seq_chunks=(16,)), {}),
    ("kda", dict(H=4, HV=4, K=64, V=208, seq_chunks=(8,), save_states=True), {}),
    # the WY inverse inside the walk (q35-2b-8x8192's chains; DeltaNet's at block 32)
    ("gdn", dict(H=16, HV=16, K=128, V=128, seq_chunks=(4,) * 8), {"inverse_in_walk": 1}),
    ("deltanet", dict(H=4, HV=4, K=64, V=64, seq_chunks=(8, 8)), {"inverse_in_walk": 1}),
]


@pytest.mark.parametrize("name,sizes,config", PLAN_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(PLAN_CASES)])
def test_plan_launches_compile(name, sizes, config):
    """The arch's plans ask for params the templates compile (not only their EXAMPLES):
    every launch of a few representative plans, no ptxas error, no more than 255
    registers."""
    from linattn.codegen.compile import compile_stage
    from linattn.dsl import Options
    from linattn.ops import chunk
    from linattn.ops.registry import get_spec
    spec = get_spec(name)
    p = chunk.forward_plan(spec, Options(), dtype="bfloat16", beta_dtype="bfloat16",
                           Ttot=64 * sum(sizes["seq_chunks"]), output_final_state=True,
                           config=config, **sizes)
    print(p)
    assert p.name in ("walk", "walk-split", "walk-fused", "fused", "three-stage",
                      "fused-split", "three-stage-split")
    for la in p.launches:
        rec = compile_stage(chunk.stage_module(spec, la.stage), la.kwargs, ARCH)
        _check(rec)


VALUE_FWD = [s.name for s in plan(value_gate_spec(), "fwd", ARCH)]


@pytest.mark.parametrize("stage_name", VALUE_FWD)
def test_value_gate_chunked_stages_compile(tmp_path, stage_name):
    """The value gate's chunked forward stages (rendered into a temp dir: no registered
    family has the gate): every EXAMPLES configuration."""
    spec = value_gate_spec()
    (stage,) = [s for s in plan(spec, "fwd", ARCH) if s.name == stage_name]
    path = tmp_path / f"{spec.name}_{stage.name}.py"
    path.write_text(render_stage(spec, stage, ARCH))
    module = load_module(path, f"value_gate_{stage.name}")
    for example in module.EXAMPLES:
        _check(compile_stage(module, example, ARCH))


def test_value_gate_plan_launches_compile():
    """A value-gate call's plan (split, GVA, l2norm) asks for params the templates compile."""
    from linattn.dsl import Options
    from linattn.ops import chunk
    spec = value_gate_spec()
    p = chunk.forward_plan(spec, Options(l2norm_qk=True), H=2, HV=4, K=128, V=128,
                           dtype="bfloat16", seq_chunks=(64,), Ttot=64 * 64,
                           output_final_state=True, config={"segments": 16})
    print(p)
    assert p.name == "three-stage-split"
    for la in p.launches:
        _check(compile_stage(chunk.stage_module(spec, la.stage), la.kwargs, ARCH))


@pytest.mark.parametrize("K, V, HV, N, state_dtype", [(96, 96, 8, 16, "float32"),
                                                      (192, 192, 16, 4, "float32"),
                                                      (160, 128, 8, 64, "bfloat16")])
def test_recurrent_tuning_compiles_at_head_dims_off_powers_of_two(K, V, HV, N, state_dtype):
    """The arch's recurrent tile for K = 96, 160, 192 (a K-reduction over 3 / 5 / 6 warps
    failed TileLang's power-of-two all-reduce) compiles."""
    from linattn.codegen.arch import get_arch
    from linattn.ops import runtime
    from linattn.ops.registry import get_spec
    problem = dict(H=HV, HV=HV, K=K, V=V, dtype="bfloat16", state_dtype=state_dtype)
    params = dict(problem, **get_arch(ARCH).tuning("recurrent", problem, {"N": N}))
    print(params)
    _check(compile_stage(runtime.stage_module(get_spec("gdn"), "recurrent", ARCH), params,
                         ARCH))


#: the recurrent kernel's resident-CTA cap (ctas_per_sm, codegen/arch/sm90
#: DECODE_FULL_GRID): the full grid's block-64 tile, a pool with its h0 in another dtype
_F32 = dict(has_initial_state=True, output_final_state=True)
CTA_CAP_CASES = [
    ("gla", dict(H=4, HV=4, K=128, V=128, h0_dtype="bfloat16", state_pool=True, **_F32),
     dict(block_v=32, threads=128, vec=4, warps_k=4, ctas_per_sm=3)),
    ("gdn", dict(H=16, HV=32, K=128, V=128, **_F32),
     dict(block_v=64, threads=128, vec=4, warps_k=1, ctas_per_sm=3)),
]


@pytest.mark.parametrize("op, problem, knobs", CTA_CAP_CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[2].items())}"
                              for c in CTA_CAP_CASES])
def test_recurrent_cta_cap_compiles(op, problem, knobs):
    from linattn.codegen.arch import get_arch
    from linattn.ops import runtime
    from linattn.ops.registry import get_spec
    module = runtime.stage_module(get_spec(op), "recurrent", ARCH)
    rec = compile_stage(module, dict(problem, **knobs), ARCH)
    _check(rec)
    # the claim admits n CTAs an SM (1 KB each reserved by the system), not n + 1
    n, smem, per_sm = knobs["ctas_per_sm"], rec["dynamic_smem_bytes"], get_arch(ARCH).SMEM_PER_SM
    assert (n + 1) * (smem + 1024) > per_sm >= n * (smem + 1024), (smem, n)


def test_named_barrier_mismatch_names_an_id_shared_by_two_thread_counts():
    from linattn.codegen.compile import named_barrier_mismatch
    src = ("tl::__sync_thread_partial(3, 128);\n  tl::__sync_thread_partial(8, 128);\n"
           "tl::__sync_thread_partial(3, 128);\n tl::__sync_thread_partial(8, 64);")
    assert named_barrier_mismatch(src) == [8]
    assert named_barrier_mismatch(src.replace("(8, 64)", "(8, 128)")) == []
