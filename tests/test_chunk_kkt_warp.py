"""CPU tests of chunk_kkt_inverse (one warp per 16-row diagonal block, the blocks below
the diagonal by level, each warp its own tf32 MMAs): the plans' params build it, it
traces at 32 x chunk / 16 threads with its barriers its own (TileLang's automatic ones
off) and MIN_CTAS_PER_SM asked for, it takes no inverse / threads knobs, and it compiles
for sm_90a within that budget (registers and shared memory for 4 CTAs of 128 threads per
SM; 5 by shared memory up to K = 128; no spills). An fp64 emulation of its block
algorithm (the same operands, transposes and level order) checks the mathematics on CPU.
Its numbers are checked on the GPU by tests/test_chunk_kkt_gpu.py (the kernel's outputs
against fp64) and tests/test_chunk_fwd_gpu.py (every walk and three-stage case of the
delta rule runs it)."""
import re
import shutil

import numpy as np
import pytest

from linattn.dsl import Options
from linattn.ops import chunk
from linattn.ops.registry import get_spec

SIZES = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", seq_chunks=(3, 5), Ttot=512,
             beta_dtype="bfloat16")
THREADS = 128
SMEM_PER_SM = 228 * 1024
REGS_PER_SM = 64 * 1024


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
def test_kernel_traces_at_a_warp_per_block(op, options):
    kkt = _kkt_params(op, options)
    mod = chunk.stage_module(get_spec(op), "chunk_kkt_inverse")
    script = mod.build(**kkt).script()
    assert re.search(r'"tl.launch_threads": \[(\d+), 1, 1\]', script).group(1) == str(THREADS)
    assert f'"tl.min_blocks_per_sm", {mod.MIN_CTAS_PER_SM}' in script
    # the kernel places its barriers itself
    assert mod.pass_configs(**kkt) == {"tl.disable_thread_storage_sync": True}


def test_kernel_refuses_the_old_knobs():
    mod = chunk.stage_module(get_spec("gdn"), "chunk_kkt_inverse")
    for knob in (dict(threads=64), dict(inverse="tc")):
        with pytest.raises(TypeError):
            mod.build(**dict(mod.EXAMPLES[2], **knob))


@pytest.mark.parametrize("K,lanes", [(16, 2), (48, 2), (64, 8), (128, 16), (256, 32)])
def test_row_lanes(K, lanes):
    mod = chunk.stage_module(get_spec("gdn"), "chunk_kkt_inverse")
    assert mod.row_lanes(K) == lanes


def _emulated_inverse(L, beta, SUB=16):
    """The kernel's A_b in fp64 from L = strict_tril(beta_i k_i . k_j Gamma_ij): the diagonal
    blocks by column forward substitution, then level d = 1.. blocks (b, b - d) from
    xt (X's column blocks transposed) and L's row blocks, as the kernel's two MMAs."""
    BT = L.shape[0]
    NB = BT // SUB
    a_s = L.copy()
    xt = np.zeros((max(NB - 1, 1), SUB, BT))
    o = np.zeros((BT, BT))
    for b in range(NB):
        wb = b * SUB
        for n in range(SUB):
            x = np.zeros(SUB)
            for ii in range(SUB):
                acc = sum(L[wb + ii, wb + jj] * x[jj] for jj in range(ii))
                x[ii] = 1.0 if ii == n else (0.0 if ii < n else -acc)
            a_s[wb:wb + SUB, wb + n] = x
            o[wb:wb + SUB, wb + n] = x * beta[wb + n]
            if b < NB - 1:
                xt[b, n, :SUB] = x
    for d in range(1, NB):
        for b in range(d, NB):
            r = b - d
            yt = xt[r, :, :SUB * d] @ a_s[SUB * b:SUB * b + SUB, SUB * r:SUB * b].T
            xb = a_s[SUB * b:SUB * b + SUB, SUB * b:SUB * b + SUB] @ yt.T
            o[SUB * b:SUB * b + SUB, SUB * r:SUB * r + SUB] = -xb * beta[SUB * r:SUB * r + SUB]
            if d < NB - 1:
                xt[r, :, SUB * d:SUB * d + SUB] = -xb.T
    return o


@pytest.mark.parametrize("BT", [16, 32, 64])
@pytest.mark.parametrize("rows", [1, 15, 17, 33, 64])
def test_block_algorithm_is_the_inverse(BT, rows):
    rows = min(rows, BT)
    rng = np.random.default_rng(BT * 100 + rows)
    k = rng.standard_normal((BT, 32)) * 0.4
    beta = rng.random(BT) * 2
    g = np.cumsum(-rng.random(BT))
    k[rows:], beta[rows:] = 0, 0
    L = np.tril(beta[:, None] * (k @ k.T) * np.exp(g[:, None] - g[None, :]), -1)
    want = np.linalg.inv(np.eye(BT) + L) * beta[None, :]
    got = _emulated_inverse(L, beta)
    assert np.abs(got - want).max() <= 1e-12 * max(1.0, np.abs(want).max())
    assert not got[:, rows:].any()          # columns past the chunk's rows are 0


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("op,example", [("gdn", 0), ("gdn", 2), ("deltanet", 1)])
def test_kernel_fits_its_ctas_per_sm(op, example):
    from linattn.codegen.compile import compile_stage, format_record
    mod = chunk.stage_module(get_spec(op), "chunk_kkt_inverse")
    rec = compile_stage(mod, mod.EXAMPLES[example], "sm90")
    print(format_record(rec))
    assert "error" not in rec and "ptxas_error" not in rec, rec
    assert rec["threads"] == THREADS
    assert rec["registers"] * THREADS * mod.MIN_CTAS_PER_SM <= REGS_PER_SM
    assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0
    smem = rec["static_smem_bytes"] + rec["dynamic_smem_bytes"]
    assert 5 * (smem + 1024) <= SMEM_PER_SM, smem      # (+ 1 KB reserved per CTA)
