"""CPU tests of the walk's sequence split (codegen/arch/sm90/forward.py walk-split; ops/
chunk_split.py's tables): segment tables against a walk over the sequences (every
sequence owns at least one segment, an empty one too), the tables the plan reads, the
walk's cost model (value blocks that fit shared memory; few chains split, many do not),
and sm_90a compiles of the walk's kernels within the shared memory the model assumes.
The split's arithmetic (maps, warm-up, combine) is checked against the fp64 reference
in tests/test_chunk_walk.py, and on the GPU in tests/test_chunk_fwd_gpu.py /
tests/test_chunk_split_gpu.py."""
import shutil

import numpy as np
import pytest

from linattn.codegen.arch.sm90 import forward as fw
from linattn.codegen.arch.sm90 import hardware as hw
from linattn.dsl import Options, SpecError
from linattn.ops import chunk, chunk_split
from linattn.ops.registry import get_spec

C = 64


# -- tables ----------------------------------------------------------------------------------

def _segments_by_walking(lens, L, C):
    """(seg_cu, seg_c0, seq_seg): segments of L chunks; an empty sequence, one empty one."""
    seg_cu, seg_c0, seq_seg, chunk0, tok = [], [], [0], 0, 0
    for length in lens:
        nch = -(-length // C)
        for c in range(0, max(nch, 1), L):
            seg_cu.append(tok + c * C)
            seg_c0.append(chunk0 + c)
        seq_seg.append(len(seg_cu))
        chunk0 += nch
        tok += length
    return seg_cu + [tok], seg_c0 + [chunk0], seq_seg


@pytest.mark.parametrize("L", [1, 2, 3, 8])
def test_segment_tables_match_walk(rng, L):
    lens = [0, 1, 64, 65, 1000, 0] + rng.integers(0, 400, size=6).tolist()
    rng.shuffle(lens)
    cu = np.concatenate([[0], np.cumsum(lens)])
    got = chunk_split.build_segment_tables(cu, L, C)
    want = _segments_by_walking(lens, L, C)
    for g, w in zip(got, want):
        assert g.dtype == np.int32 and g.tolist() == list(w)
    seg_cu, seg_c0, seq_seg = got
    # every sequence owns >= 1 segment; segments hold 0..L chunks (0: an empty sequence's)
    assert np.all(np.diff(seq_seg) >= 1) and seq_seg[-1] == len(seg_cu) - 1
    assert np.all(np.diff(seg_cu) >= 0) and np.all((np.diff(seg_c0) >= 0) & (np.diff(seg_c0) <= L))
    counts = np.diff(seg_c0)
    for n, length in enumerate(lens):
        segs = counts[seq_seg[n]:seq_seg[n + 1]]
        assert segs.sum() == -(-length // C)
        assert np.all(segs[:-1] == L)            # only the last segment is short
        assert np.all(np.diff(seg_cu)[seq_seg[n]:seq_seg[n + 1]] <= L * C)


def test_segment_tables_of_equal_sequences():
    seg_cu, seg_c0, seq_seg = chunk_split.build_segment_tables([0, 300, 600], 2, C)
    assert seg_cu.tolist() == [0, 128, 256, 300, 428, 556, 600]
    assert seg_c0.tolist() == [0, 2, 4, 5, 7, 9, 10]
    assert seq_seg.tolist() == [0, 3, 6]


@pytest.mark.parametrize("cu,L", [([0, 5], 0), ([1, 4], 2), ([0, 5, 3], 2), ([0], 2)])
def test_segment_tables_reject_bad_input(cu, L):
    with pytest.raises(SpecError):
        chunk_split.build_segment_tables(cu, L, C)


@pytest.mark.parametrize("L", [1, 2, 5])
def test_plan_tables_name_each_sequences_last_segment(rng, L):
    """What the walk-split plan reads (ops.chunk._tables): seg_final_row gives each
    sequence's last segment its row of ht (-1 elsewhere), map_seg lists the other
    segments (whose maps are formed), the chunk tables are the unsplit ones."""
    lens = [0] + rng.integers(0, 500, size=7).tolist() + [1]
    cu = tuple(int(x) for x in np.concatenate([[0], np.cumsum(lens)]))
    t = {k: v.tolist() for k, v in chunk._tables(cu, C, "cpu", L).items()}
    seg_cu, seg_c0, seq_seg = (x.tolist() for x in chunk_split.build_segment_tables(cu, L, C))
    assert (t["seg_cu"], t["seg_c0"], t["seq_seg_offsets"]) == (seg_cu, seg_c0, seq_seg)
    last = [seq_seg[n + 1] - 1 for n in range(len(lens))]
    assert [t["seg_final_row"][s] for s in last] == list(range(len(lens)))
    assert sorted(set(range(len(seg_cu) - 1)) - set(last)) == t["map_seg"]
    assert all(t["seg_final_row"][s] == -1 for s in t["map_seg"])
    bos, length, offsets = chunk.build_chunk_tables(cu, C)
    assert t["chunk_bos"] == bos.tolist() and t["chunk_offsets"] == offsets.tolist()
    for s in t["map_seg"]:                  # mapped segments are whole: L full chunks
        assert seg_cu[s + 1] - seg_cu[s] == L * C and seg_c0[s + 1] - seg_c0[s] == L


# -- the walk's cost model ---------------------------------------------------------------------

def _problem(seq_chunks, H, HV, K=128, V=128, gate="scalar", **kw):
    return fw.ForwardProblem(rule="delta", gate=gate, H=H, HV=HV, K=K, V=V, dtype="bfloat16",
                             g_dtype="float32", beta_dtype="bfloat16",
                             Ttot=64 * sum(seq_chunks), seq_chunks=tuple(seq_chunks), **kw)


@pytest.mark.parametrize("K,V", [(128, 128), (64, 64), (256, 128), (128, 256), (256, 256),
                                 (64, 48), (64, 16)])
def test_walk_blocks_fit_shared_memory(K, V):
    blocks = fw.walk_blocks(_problem([4], 1, 1, K, V))
    assert blocks, (K, V)                              # the walk runs at every K, V checked
    assert list(blocks) == sorted(blocks, reverse=True)
    for bv in blocks:
        assert V % bv == 0 and fw.walk_smem(K, bv) <= hw.SMEM_BYTES
    assert fw.walk_smem(K, 128) > fw.walk_smem(K, 16)  # the model grows with the block


@pytest.mark.parametrize("K", [32, 48, 96, 112])
def test_walk_takes_k_in_64s(K):
    """The walk's state GEMMs (K rows over a warpgroup's 4 warps) compile only at K a
    multiple of 64 (K = 48, 96, 112 did not: run s17-1): no block at other K (the arch's
    chunk_k pads such calls)."""
    assert fw.walk_blocks(_problem([4], 1, 1, K, 64)) == ()


def test_walk_smem_model():
    # two stages of q, k, v, A_b plus the exchanged tiles, 4 KB spare (bf16)
    assert fw.walk_smem(128, 128) == 2 * 64 * (256 + 128 + 64) * 2 + (
        64 * 128 + 128 * 128 + 64 * 128 + 64 * 64 + 64 * 128) * 2 + 4096
    assert fw.walk_smem(128, 128) <= hw.SMEM_BYTES < fw.walk_smem(256, 256) + 1
    assert fw.walk_smem(64, 64, itemsize=4) > fw.walk_smem(64, 64)


def test_cost_model_splits_few_chains_only():
    # q35-397b-tp8-8192: one sequence, 128 chunks, 8 value heads: split
    bv, L, t = fw.walk_choice(_problem([128], 2, 8), {})
    assert L >= 2 and bv in fw.walk_blocks(_problem([128], 2, 8))
    assert t < fw.walk_time_us(_problem([128], 2, 8), bv, 0)
    # 64 value heads x 8 sequences fill the GPU already: no split
    assert fw.walk_choice(_problem([64] * 8, 64, 64), {})[1] == 0
    assert fw.walk_choice(_problem([1, 1], 2, 2, 64, 64), {})[1] == 0   # nothing to split
    # forced: the config's segment length and block
    bv, L, _ = fw.walk_choice(_problem([40], 2, 2, 64, 64), {"segments": 4})
    assert L == 4 and bv in fw.walk_blocks(_problem([40], 2, 2, 64, 64))
    assert fw.walk_choice(_problem([40], 2, 2, 64, 64), {"block_v": 16})[0] == 16


@pytest.mark.parametrize("config,match", [({"block_v": 48}, "block_v=48"),
                                          ({"block_v": 128}, "block_v=128"),
                                          ({"segments": -1}, "segments=-1"),
                                          ({"segments": 2.5}, "segments=2.5")])
def test_walk_config_outside_the_walk_is_refused(config, match):
    """A forced value block the walk cannot run at V = 64, or a segment length that is not
    a count of chunks, is one clear error (was a KeyError in the cost model)."""
    with pytest.raises(ValueError, match=match):
        fw.walk_choice(_problem([40], 2, 2, 64, 64), config)


def test_cost_model_basics():
    assert hw.makespan((1.0,) * hw.NUM_SMS) == 1.0
    assert hw.makespan((1.0,) * (hw.NUM_SMS + 1)) == 2.0
    assert hw.makespan((3.0, 1.0, 1.0), sms=2) == 3.0
    assert fw.segment_chunks((5, 0, 2), 2) == [[2, 2, 1], [0], [2]]
    assert fw.segment_chunks((5, 0), 0) == [[5], [0]]
    p = _problem([64], 1, 1)
    # more value heads or chunks, no faster; segments as long as the sequence: no split
    assert fw.walk_time_us(_problem([64], 1, 2), 128, 0) >= fw.walk_time_us(p, 128, 0)
    assert fw.walk_time_us(_problem([65], 1, 1), 128, 0) >= fw.walk_time_us(p, 128, 0)
    assert fw.walk_time_us(p, 128, 64) == fw.walk_time_us(p, 128, 0)
    # the scalar gate's warm-up makes the maps cheaper than without a gate
    assert fw.walk_time_us(_problem([64], 1, 1, gate="scalar"), 64, 8) <= fw.walk_time_us(
        _problem([64], 1, 1, gate="none"), 64, 8)


def test_split_plan_buffers():
    """The walk-split plan: its segment count in seg_map / starts / exact, the walk
    reading the segment tables and starting from the combine's starts."""
    plan = chunk.forward_plan(get_spec("gdn"), Options(), H=2, HV=4, K=64, V=64,
                              dtype="bfloat16", seq_chunks=(5, 0, 2), Ttot=7 * 64,
                              output_final_state=True, config={"segments": 2})
    assert plan.name == "walk-split" and plan.segments == 2
    bufs = {b.name: b for b in plan.buffers}
    assert bufs["seg_map"].shape == (5, 4, 64, 128) and bufs["starts"].shape == (5, 4, 64, 64)
    assert bufs["exact"].dtype == "int32"
    walk = plan.launches[-1]
    assert walk.stage == "chunk_walk" and walk.kwargs["has_initial_state"]
    assert [walk.tensor(a) for a in ("cu_seqlens", "chunk_offsets", "h0", "final_row")] == [
        "seg_cu", "seg_c0", "starts", "seg_final_row"]


# -- compiling --------------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["gdn", "deltanet"])
@pytest.mark.parametrize("stage", ["chunk_walk", "chunk_walk_map", "chunk_segment_combine"])
def test_walk_kernels_compile_within_the_model(name, stage):
    """Every example of the walk's kernels compiles without spills, in the shared memory
    walk_smem assumes (chunk_walk: at most the model; all: at most SMEM_BYTES)."""
    from linattn.codegen.compile import compile_stage, format_record
    mod = chunk.stage_module(get_spec(name), stage)
    for ex in mod.EXAMPLES:
        rec = compile_stage(mod, ex, "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
        smem = rec["static_smem_bytes"] + rec["dynamic_smem_bytes"]
        assert smem <= hw.SMEM_BYTES, smem
        if stage == "chunk_walk":
            assert rec["dynamic_smem_bytes"] <= fw.walk_smem(ex["K"], ex["block_v"])
