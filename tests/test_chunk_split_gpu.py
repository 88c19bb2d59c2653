"""GPU check of the split state pass (LINATTN_CHUNK_SPLIT=1, ops/chunk_split.py): output
and final state vs the fp64 reference with the segment length forced small (so short
test sequences split into many segments, varlen segments end at sequence boundaries) and
with the cost model's choice on the tensor-parallel shape it is for. Reuses the chunked
forward GPU test's cases and checker (tests/test_chunk_fwd_gpu.py)."""
import pytest

from test_chunk_fwd_gpu import assert_within_tolerance, case, run_case

pytestmark = pytest.mark.gpu

def split_case(param, L):
    """One case of the chunked forward test (a pytest.param) with a segment length."""
    return pytest.param(param.values[0], L, id=f"{param.id}-L{L}")


SPLIT_CASES = [split_case(c, L) for c, L in [   # segment length in chunks: None = the model's
    (case("gdn", 1, 1000, 2, 8, 128, 128), 2),
    (case("gdn", 1, 1000, 2, 8, 128, 128, init=False), 4),
    (case("gdn", 1, None, 2, 4, 128, 128, opts=("state_v_first",),
          lens=[1, 64, 65, 300, 1, 200]), 1),
    (case("gdn", 1, 300, 2, 4, 64, 64, dtype="float16",
          opts=("l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel")), 2),
    (case("deltanet", 2, 300, 4, 4, 64, 64, init=False), 2),
    (case("kda", 1, None, 2, 2, 128, 128, opts=("l2norm_qk",), lens=[1, 64, 65, 330, 1]), 2),
    (case("additive_scalar", 1, 400, 2, 2, 64, 64), 3),
    (case("gdn", 1, 8192, 2, 8, 128, 128), None),            # q35-397b-tp8-8192
]]


@pytest.mark.parametrize("fused", [False, True], ids=["3stage", "fused"])
@pytest.mark.parametrize("p,L", SPLIT_CASES)
def test_split_state_pass(p, L, fused, rng, monkeypatch):
    from linattn.ops import chunk, chunk_split
    monkeypatch.setattr(chunk, "SPLIT", True)
    monkeypatch.setattr(chunk, "SPLIT_SEGMENT_CHUNKS", L)
    monkeypatch.setattr(chunk, "FUSE_OUTPUT", fused)
    splits = []
    real = chunk_split.run_segment_maps

    def counting(*a, **kw):
        out = real(*a, **kw)
        splits.append(out is not None)
        return out
    monkeypatch.setattr(chunk_split, "run_segment_maps", counting)
    errs = run_case(p, rng)
    assert splits and all(splits), "the split path did not run"
    assert_within_tolerance(errs, p["dtype"])
