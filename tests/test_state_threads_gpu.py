"""GPU check of the additive rule's fused state pass at two consumer warpgroups
(config state_threads=256, a probe's until measured: codegen/arch/sm90/stages.py
FUSED_STATE_THREADS) for the per-key gate (GLA),
the scalar gate (simple GLA) and no gate, ragged sequences included, against the fp64
reference (tests/test_chunk_fwd_gpu.py's cases and checker; outputs NaN-poisoned).
Mamba-2's (GVA, the call terms) are in tests/test_mamba2_gpu.py.

Run: python3 -m pytest -q -m gpu tests/test_state_threads_gpu.py
"""
import pytest

from test_chunk_fwd_gpu import assert_within_tolerance, case, run_case

pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

WIDE = {"fused": True, "block_v": 64, "state_threads": 256}
CASES = [
    case("gla", 8, 300, 16, 16, 128, 128, config=WIDE),
    case("gla", 1, None, 16, 16, 128, 128, lens=[1, 200, 0, 65, 700], config=WIDE,
         dtype="float16"),
    case("simple_gla", 8, 257, 16, 16, 128, 128, config=WIDE),
    case("simple_gla", 1, None, 16, 16, 128, 64, lens=[64, 1, 300],
         config=dict(WIDE, segments=2)),
    case("linear_attn", 4, 200, 16, 16, 128, 128, config=WIDE),
]


@pytest.mark.parametrize("p", CASES)
def test_fused_state_pass_at_two_warpgroups(p, rng):
    from linattn.ops import chunk
    chunk._plan.cache_clear()
    errs = run_case(p, rng)
    assert_within_tolerance(errs, p["dtype"])
