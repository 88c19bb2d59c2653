"""The sm80 arch (Ampere / Ada) on the CPU: the default plans' kernels of every family lower
and compile for sm_80, and the same CUDA through ptxas for sm_86 and sm_89, with no
spills (hardware.COMPILE_TARGETS).

The default plans: a prefill forward (2 sequences of 4096 tokens, 16 heads, K = V = 128,
bf16), the training forward keeping its states, the training backward (the delta rule's
rebuild, four stages and key gradients; the additive rule's plan at a training call's
dtypes) and decode (8 sequences). Registers, shared memory and spills are printed (-s);
every configuration is in the exhaustive suite (marker compile), one in the default run.
"""
import shutil

import pytest

from linattn.codegen.arch import get_arch
from linattn.codegen.compile import compile_stage, format_record
from linattn.codegen.pipeline import AdditiveBackwardProblem
from linattn.dsl import Options
from linattn.ops import additive_bwd, chunk, chunk_bwd, runtime
from linattn.ops.registry import specs

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]

ARCH = "sm80"
SIZES = dict(H=16, HV=16, K=128, V=128, dtype="bfloat16")
SEQS = (64, 64)                 # chunks of each sequence: 2 x 4096 tokens
#: issue 50's families (the generalized delta rules have decode kernels only so far; Mamba-2
#: and lightning attention run the additive rule's stages, compiled here for GLA's gates)
FAMILIES = ("deltanet", "gdn", "kda", "gla", "simple_gla", "linear_attn", "retention")
#: known: KDA's per-key backward stages at K = V = 128 take more shared memory than an
#: A100 CTA may (163 KB; Hopper's 227 KB take them, so the GPU tests run them there): their
#: sm80 tiles are not written yet
OVER_SMEM = {"chunk_bwd_dqkw": "176.5 KB of shared memory > 163 KB (A100)",
             "chunk_bwd_wy": "168.2 KB of shared memory > 163 KB (A100)"}


def _forward(spec) -> dict:
    out = {}
    for save in (False, True) if spec.rule.value == "delta" else (False,):
        plan = chunk.forward_plan(spec, Options(), ARCH, **SIZES, Ttot=64 * sum(SEQS),
                                  seq_chunks=SEQS, g_dtype="float32", beta_dtype="bfloat16",
                                  output_final_state=True, save_states=save)
        out.update((la.stage, la.kwargs) for la in plan.launches)
    return out


def _backward(spec) -> dict:
    H, K, V, dt = SIZES["H"], SIZES["K"], SIZES["V"], SIZES["dtype"]
    if spec.rule.value == "delta":
        train = (chunk_bwd.key_train_params if spec.gate.value == "key"
                 else chunk_bwd.train_params)
        return train(H=H, HV=H, K=K, V=V, dtype=dt, chains=len(SEQS) * H, l2norm=True,
                     spec=spec, arch=ARCH)
    recompute = chunk.forward_plan(spec, Options(), ARCH, **SIZES, Ttot=64 * sum(SEQS),
                                   seq_chunks=SEQS, g_dtype="float32", beta_dtype=dt,
                                   output_final_state=True, return_states=True,
                                   states_only=True, config={"fused": False})
    p = AdditiveBackwardProblem(gate=spec.gate.value, H=H, HV=H, K=K, V=V, dtype=dt,
                                g_dtype="float32", grad_dtype=dt, seq_chunks=SEQS,
                                state_dtype=dt)
    return {la.stage: la.kwargs for plan in (recompute, additive_bwd.backward_plan(p, None, ARCH))
            for la in plan.launches}


def _decode(spec) -> dict:
    problem = dict(H=SIZES["H"], HV=SIZES["HV"], K=SIZES["K"], V=SIZES["V"],
                   dtype=SIZES["dtype"], state_dtype="float32", output_final_state=True,
                   has_initial_state=True)
    if spec.gate.value != "none":
        problem["g_dtype"] = "float32"
    if spec.rule.value == "delta":
        problem["beta_dtype"] = SIZES["dtype"]
    return {"recurrent": {**get_arch(ARCH).tuning("recurrent", problem, {"N": 8}), **problem}}


def _cases():
    cases = []
    for name in FAMILIES:
        spec = specs()[name]
        for part, fn in (("fwd", _forward), ("bwd", _backward), ("decode", _decode)):
            for stage, params in fn(spec).items():
                rep = (pytest.mark.representative,) if (name, stage) == ("gdn", "chunk_wu") else ()
                if (name, part) == ("kda", "bwd") and stage in OVER_SMEM:
                    rep += (pytest.mark.xfail(strict=True, reason=OVER_SMEM[stage]),)
                cases.append(pytest.param(name, stage, params, id=f"{name}-{part}-{stage}",
                                          marks=rep))
    return cases


@pytest.mark.parametrize("name, stage, params", _cases())
def test_sm80_default_plan_compiles(name, stage, params):
    spec = specs()[name]
    module = runtime.stage_module(spec, stage, ARCH)
    targets = get_arch(ARCH).hardware.COMPILE_TARGETS
    rec = compile_stage(module, dict(params), ARCH, sms=targets)
    print(format_record(rec))
    assert "error" not in rec, rec["error"]
    for sm, use in rec["by_sm"].items():
        print(f"    {sm}: regs={use.get('registers')} spills={use.get('spill_store_bytes')}"
              f"/{use.get('spill_load_bytes')}")
        assert "ptxas_error" not in use, (sm, use["ptxas_error"])
        assert use["registers"] and use["registers"] <= 255
        assert use["spill_store_bytes"] == 0 and use["spill_load_bytes"] == 0, (sm, use)
        assert not use["barriers_in_branches"], (sm, use["barriers_in_branches"])
    smem = rec.get("static_smem_bytes", 0) + rec.get("dynamic_smem_bytes", 0)
    assert smem <= get_arch(ARCH).hardware.SMEM_BYTES, smem
