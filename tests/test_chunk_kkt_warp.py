"""CPU tests of chunk_kkt_inverse's one-warp-pair inverse (the only inverse it has now):
the plans' params build it, it traces at 64 threads with 8 CTAs per SM asked for, it
takes no inverse / threads knobs, and it compiles for sm_90a within the budget that
gives 8 CTAs per SM (shared memory <= 26 KB; registers <= 128 at 64 threads; no spills).
Its numbers are checked on the GPU by tests/test_chunk_fwd_gpu.py (every walk and
three-stage case of the delta rule runs it)."""
import re
import shutil

import pytest

from linattn.dsl import Options
from linattn.ops import chunk
from linattn.ops.registry import get_spec

SIZES = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", seq_chunks=(3, 5), Ttot=512,
             beta_dtype="bfloat16")
THREADS = 64


def _kkt_params(op, options=Options(), config=None):
    plan = chunk.forward_plan(get_spec(op), options, config=config, **SIZES)
    return chunk.plan_params(plan)["chunk_kkt_inverse"]


@pytest.mark.parametrize("op", ["gdn", "deltanet"])
@pytest.mark.parametrize("config", [None, {"fused": False}, {"segments": 2}])
def test_plans_pass_no_inverse_knobs(op, config):
    kkt = _kkt_params(op, Options(l2norm_qk=True), config)
    assert not {"inverse", "threads", "a_dtype"} & set(kkt), kkt
    assert kkt["l2norm_qk"] is True


@pytest.mark.parametrize("op", ["gdn", "deltanet"])
@pytest.mark.parametrize("options", [Options(), Options(l2norm_qk=True, beta_sigmoid=True)],
                         ids=["plain", "l2norm-sigmoid"])
def test_kernel_traces_at_one_warp_pair(op, options):
    kkt = _kkt_params(op, options)
    script = chunk.stage_module(get_spec(op), "chunk_kkt_inverse").build(**kkt).script()
    assert re.search(r'"tl.launch_threads": \[(\d+), 1, 1\]', script).group(1) == str(THREADS)
    assert '"tl.min_blocks_per_sm", 8' in script


def test_kernel_refuses_the_old_knobs():
    mod = chunk.stage_module(get_spec("gdn"), "chunk_kkt_inverse")
    for knob in (dict(threads=128), dict(inverse="tc")):
        with pytest.raises(TypeError):
            mod.build(**dict(mod.EXAMPLES[2], **knob))


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("op,example", [("gdn", 0), ("gdn", 2), ("deltanet", 1)])
def test_kernel_fits_eight_ctas_per_sm(op, example):
    from linattn.codegen.compile import compile_stage, format_record
    mod = chunk.stage_module(get_spec(op), "chunk_kkt_inverse")
    rec = compile_stage(mod, mod.EXAMPLES[example], "sm90")
    print(format_record(rec))
    assert "error" not in rec and "ptxas_error" not in rec, rec
    assert rec["threads"] == THREADS
    assert rec["registers"] <= 128             # 8 CTAs x 64 threads x 128 = the SM's 64 K
    assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0
    smem = rec["static_smem_bytes"] + rec["dynamic_smem_bytes"]
    assert smem <= 26 * 1024, smem         # 8 CTAs: 8 x (smem + 1 KB reserved) <= 228 KB
