"""GPU check of the walk's sequence split (the walk-split plan: chunk_walk_map ->
chunk_segment_combine -> chunk_walk): output and final state vs the fp64 reference with
the segment length forced small (short test sequences split into many segments, varlen
segments end at sequence boundaries, empty and one-token sequences among them) and with
the cost model's choice on the tensor-parallel shape it is for. Reuses the chunked
forward GPU test's cases and checker (tests/test_chunk_fwd_gpu.py); every case must run
the walk-split plan."""
import pytest

from test_chunk_fwd_gpu import _jobs, assert_within_tolerance, case, run_case

pytestmark = pytest.mark.gpu

SPLIT_CASES = [   # config {"segments": L}; {} = the cost model's choice
    case("gdn", 1, 1000, 2, 8, 128, 128, config={"segments": 2}),
    case("gdn", 1, 1000, 2, 8, 128, 128, init=False, config={"segments": 4}),
    case("gdn", 1, None, 2, 4, 128, 128, opts=("state_v_first",),
         lens=[1, 64, 65, 300, 0, 1, 200], config={"segments": 1}),
    case("gdn", 1, 300, 2, 4, 64, 64, dtype="float16",
         opts=("l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel"),
         config={"segments": 2}),
    case("deltanet", 2, 300, 4, 4, 64, 64, init=False, config={"segments": 2}),
    case("deltanet", 1, None, 2, 2, 128, 128, opts=("l2norm_qk",),
         lens=[1, 64, 65, 330, 1], config={"segments": 2, "block_v": 64}),
    case("gdn", 1, 400, 2, 2, 64, 64, final=False, config={"segments": 3}),
    case("gdn", 1, 8192, 2, 8, 128, 128),                # q35-397b-tp8-8192: the model's
]


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every kernel of these cases first (parallel processes, disk cache)."""
    from linattn.ops import runtime
    errors = runtime.precompile([j for c in SPLIT_CASES for j in _jobs(c.values[0])])
    for e in errors:
        print("  compile error:", e)
    yield


@pytest.mark.parametrize("p", SPLIT_CASES)
def test_split_walk(p, rng, monkeypatch):
    from linattn.ops import runtime
    plans, real = [], runtime.run_plan

    def run_plan(spec, plan, tensors):
        plans.append(plan)
        return real(spec, plan, tensors)
    monkeypatch.setattr(runtime, "run_plan", run_plan)
    errs = run_case(p, rng)
    print(errs, plans[0] if plans else None)
    assert plans and all(pl.name == "walk-split" for pl in plans), "the split did not run"
    assert_within_tolerance(errs, p["dtype"])
