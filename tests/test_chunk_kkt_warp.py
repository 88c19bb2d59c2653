"""CPU tests of chunk_kkt_inverse's one-warp inverse (ops.chunk PREPARE_SPLIT_INVERSE="warp",
PREPARE_VARIANTS "split-warp*"): the knobs reach build() and only the split path, the
kernel traces at the launch width asked for, and it compiles for sm_90a within the budget
that gives 8 CTAs per SM (shared memory <= 26 KB; registers <= 255 at 32 threads, <= 128
at 64; no spills). Its numbers are checked on the GPU by tests/test_chunk_fwd_gpu.py::
test_prepare_variant (the split-warp* variants against the fp64 reference)."""
import re
import shutil

import pytest

from linattn.dsl import Options
from linattn.ops import chunk
from linattn.ops.registry import get_spec

DIMS = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16")
WARP_VARIANTS = {"split-warp": 32, "split-warp64": 64, "split-warp-a32": 32}


def _kkt_params(monkeypatch, variant, op="gdn", options=Options()):
    for name, value in chunk.PREPARE_VARIANTS[variant].items():
        monkeypatch.setattr(chunk, name, value)
    return chunk.stage_params(get_spec(op), options, **DIMS)


def test_default_path_is_the_two_warp_inverse():
    for op in ("gdn", "deltanet"):
        params = chunk.stage_params(get_spec(op), Options(), **DIMS)
        assert params["chunk_kkt_inverse"]["inverse"] == "warp"
        assert params["chunk_kkt_inverse"]["threads"] == 64
        assert "chunk_prepare" not in params


@pytest.mark.parametrize("variant", sorted(WARP_VARIANTS))
def test_warp_knobs_reach_the_kkt_stage(monkeypatch, variant):
    params = _kkt_params(monkeypatch, variant, options=Options(l2norm_qk=True))
    kkt = params["chunk_kkt_inverse"]
    assert "chunk_prepare" not in params and kkt["inverse"] == "warp"
    assert kkt.get("threads", 32) == WARP_VARIANTS[variant]
    assert kkt["a_dtype"] == ("float32" if variant.endswith("a32") else None)
    assert "inverse" not in params["chunk_wu"] and "threads" not in params["chunk_wu"]
    # kda / gla have no split path: the warp knobs leave chunk_prepare alone
    for op in ("kda", "gla"):
        other = chunk.stage_params(get_spec(op), Options(), **DIMS)
        assert "chunk_prepare" in other and "chunk_kkt_inverse" not in other


@pytest.mark.parametrize("op", ["gdn", "deltanet"])
@pytest.mark.parametrize("variant", sorted(WARP_VARIANTS))
def test_warp_kernel_traces_at_its_width(monkeypatch, op, variant):
    kkt = _kkt_params(monkeypatch, variant, op, Options(l2norm_qk=True, beta_sigmoid=True))
    kkt = kkt["chunk_kkt_inverse"]
    script = chunk.stage_module(get_spec(op), "chunk_kkt_inverse").build(**kkt).script()
    assert re.search(r'"tl.launch_threads": \[(\d+), 1, 1\]', script).group(1) == str(
        WARP_VARIANTS[variant])
    assert '"tl.min_blocks_per_sm", 8' in script


def test_warp_inverse_refuses_other_widths():
    mod = chunk.stage_module(get_spec("gdn"), "chunk_kkt_inverse")
    with pytest.raises(AssertionError):
        mod.build(**dict(mod.EXAMPLES[2], threads=128))


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("op,example,max_regs", [("gdn", 2, 255), ("deltanet", 3, 128)])
def test_warp_kernel_fits_eight_ctas_per_sm(op, example, max_regs):
    from linattn.codegen.compile import compile_stage, format_record
    mod = chunk.stage_module(get_spec(op), "chunk_kkt_inverse")
    rec = compile_stage(mod, mod.EXAMPLES[example], "sm90")
    print(format_record(rec))
    assert "error" not in rec and "ptxas_error" not in rec, rec
    assert rec["registers"] <= max_regs
    assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0
    smem = rec["static_smem_bytes"] + rec["dynamic_smem_bytes"]
    assert smem <= 26 * 1024, smem         # 8 CTAs: 8 x (smem + 1 KB reserved) <= 228 KB
