"""GPU check of the value gate's chunked forward (chunk_prepare -> chunk_state ->
chunk_output; the split's chunk_state_summary) against the fp64 references, on fresh
random inputs with every output NaN-poisoned (conftest): awkward lengths (T = 63,
1000), varlen with empty and one-token sequences, initial states and final states,
GVA, l2norm / gate_in_kernel / state_v_first, f16 and bf16, strong gates (a chunk's
decay far below exp(-88): the bisection's factors never overflow), forced splits and
tiles; and the public chunk_gla(gv=...). Reuses tests/test_chunk_fwd_gpu.py's cases and
checker (inputs checked unchanged; T <= 65 also against the recurrent reference).

Run: python3 -m pytest -q -m gpu tests/test_value_gate_gpu.py
"""
import pytest

from test_chunk_fwd_gpu import _jobs, assert_within_tolerance, case, run_case

import linattn

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

OP = "additive_value"
CASES = [
    case(OP, 2, 63, 4, 4, 64, 64),
    case(OP, 2, 1000, 4, 4, 128, 128, final=False),
    case(OP, 1, 1000, 2, 4, 128, 64, dtype="float16", opts=("l2norm_qk",)),      # GVA
    case(OP, 1, None, 4, 4, 64, 128, lens=[1, 63, 0, 65, 700, 1, 200],
         opts=("state_v_first",)),
    case(OP, 1, None, 2, 2, 128, 128, lens=[300, 1, 900], init=False,
         opts=("gate_in_kernel",), config={"segments": 4}),
    case(OP, 1, 2000, 2, 2, 128, 128, config={"segments": 3, "block_k": 64, "block_v": 32}),
    case(OP, 1, 700, 2, 2, 256, 512, dtype="float16"),
    case(OP, 2, 500, 4, 4, 64, 64, gate_scale=8.0),          # ~ -20 a token: e^-1000 a chunk
    case(OP, 1, 1000, 4, 4, 96, 80),                         # K padded to 128, V = 80
]


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every kernel of these cases first (parallel processes, disk cache)."""
    from linattn.ops import runtime
    errors = runtime.precompile([j for c in CASES for j in _jobs(c.values[0])])
    for e in errors:
        print("  compile error:", e)
    yield


@pytest.mark.parametrize("p", CASES)
def test_value_gate_chunk_forward(p, rng):
    """o and the final state against the fp64 reference, under the model's plan or the
    forced one; the plan is the value gate's three-stage pipeline."""
    from linattn.ops import runtime
    seen = []
    real = runtime.run_plan
    runtime.run_plan = lambda spec, plan, x: (seen.append(plan.name), real(spec, plan, x))[1]
    try:
        errs = run_case(p, rng)
    finally:
        runtime.run_plan = real
    print(seen, errs)
    assert seen and all(n.startswith("three-stage") for n in seen), seen
    assert_within_tolerance(errs, p["dtype"])


def test_chunk_gla_gv_gpu():
    """The public chunk_gla(q, k, v, gv=...) (gla_gv: no GVA) against the fp64 reference,
    T = 1000 with an initial state, then a varlen batch."""
    from linattn.dsl import torch_reference as tr
    from linattn.ops import gla
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q = r(2, 1000, 4, 128).bfloat16()
    k = torch.nn.functional.normalize(r(2, 1000, 4, 128), dim=-1).bfloat16()
    v = r(2, 1000, 4, 64).bfloat16()
    gv = torch.nn.functional.logsigmoid(r(2, 1000, 4, 64) + 3)
    h0 = 0.1 * r(2, 4, 128, 64)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    o, ht = linattn.chunk_gla(q, k, v, gv=gv, initial_state=h0, output_final_state=True)
    want_o, want_ht = tr.chunked_forward(gla.SPEC_GV, q.double(), k.double(), v.double(),
                                         gv.double(), initial_state=h0.double())
    assert rel(o, want_o) < 1e-2 and rel(ht, want_ht) < 1e-2
    cu = torch.tensor([0, 1, 500, 500, 2000], device="cuda")
    x = [t.reshape(1, 2000, *t.shape[2:]) for t in (q, k, v, gv)]
    o, ht = linattn.chunk_gla(*x[:3], gv=x[3], cu_seqlens=cu, output_final_state=True)
    want_o, want_ht = tr.chunked_forward(gla.SPEC_GV, *(t.double() for t in x),
                                         cu_seqlens=cu)
    assert rel(o, want_o) < 1e-2 and rel(ht, want_ht) < 1e-2

