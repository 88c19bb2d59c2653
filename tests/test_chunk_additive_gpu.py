"""GPU check of the additive rule's state pass (codegen/arch/sm90/additive.py: the
sequence split with exact segment summaries, key and value blocks, fused or three-stage)
against the fp64 references: GLA on the benchmark table's shapes (GLAFwd, and GLAChunkFwd
through its contract with the per-chunk states), awkward ones (odd lengths, varlen with
empty and one-token sequences, initial states, K = V = 128, K = 256 / V = 512), simple
GLA and linear attention, f16 and bf16, the model's choice and forced plans. Reuses
tests/test_chunk_fwd_gpu.py's cases and checker (outputs NaN-poisoned by conftest,
inputs checked unchanged).

Run: python3 -m pytest -q -m gpu tests/test_chunk_additive_gpu.py
"""
import pytest

from test_chunk_fwd_gpu import TOL, _jobs, assert_within_tolerance, case, run_case

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

RAGGED = [1, 63, 1000, 3032]
CASES = [
    # the table's GLAFwd rows (the model's plan)
    case("gla", 2, 2048, 4, 4, 64, 64),
    case("gla", 2, 16384, 4, 4, 64, 64),
    case("gla", 1, 257, 16, 16, 128, 128),
    case("gla", 1, None, 4, 4, 64, 64, init=False, lens=[1024] * 4),
    case("gla", 1, None, 16, 16, 128, 128, dtype="float16", lens=RAGGED),
    # forced splits, tiles and forms; awkward lengths, empty / one-token sequences
    case("gla", 1, 1000, 4, 4, 64, 64, dtype="float16",
         config={"segments": 3, "fused": False, "block_k": 32, "block_v": 16}),
    case("gla", 1, None, 4, 4, 128, 128, opts=("state_v_first",),
         lens=[1, 64, 0, 65, 700, 1, 200], config={"segments": 1}),
    case("gla", 2, 63, 4, 4, 64, 64, config={"fused": False}),
    case("gla", 1, None, 2, 2, 128, 512, lens=[300, 1, 900], config={"segments": 4}),
    case("gla", 1, 700, 2, 2, 128, 512, dtype="float16", final=False),
    case("gla", 1, 1000, 4, 4, 256, 512),               # GLA-1.3B's heads
    # simple GLA (scalar gate) and linear attention (no gate), K = 256 / V = 512
    case("simple_gla", 1, 2000, 4, 4, 128, 128, config={"segments": 4}),
    case("simple_gla", 1, None, 2, 2, 256, 512, dtype="float16", lens=[1, 500, 130],
         config={"segments": 2, "block_k": 64, "block_v": 64, "fused": False}),
    case("linear_attn", 1, 1000, 4, 4, 64, 64, init=False, config={"segments": 2}),
    case("linear_attn", 1, None, 2, 2, 256, 512, lens=[700, 1, 64],
         config={"segments": 2, "fused": True}),
]


def precompile_jobs(items=None, device="cuda"):
    """The (spec, stage, arch, params) jobs of every case (items unused), recorded from
    dry calls on ``device`` (tests/_cpu_plan.py: "cpu" lists them without a GPU)."""
    return [j for c in CASES for j in _jobs(c.values[0], device)] + contract_jobs(device)


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every kernel of these cases first (parallel processes, disk cache)."""
    from linattn.ops import runtime
    errors = runtime.precompile(precompile_jobs())
    for e in errors:
        print("  compile error:", e)
    yield


@pytest.mark.parametrize("p", CASES)
def test_additive_forward(p, rng, monkeypatch):
    """o and the final state against the fp64 reference under the plan named."""
    from linattn.ops import runtime
    plans, real = [], runtime.run_plan

    def run_plan(spec, plan, tensors):
        plans.append(plan)
        return real(spec, plan, tensors)
    monkeypatch.setattr(runtime, "run_plan", run_plan)
    errs = run_case(p, rng)
    print(errs, plans[0] if plans else None)
    L = p["config"].get("segments")
    if L and max(p["lens"] or [p["T"]]) > 64 * L:          # (a sequence to cut)
        assert plans and plans[0].name.endswith("-split"), plans[0]
    assert_within_tolerance(errs, p["dtype"])


#: GLAChunkFwd (the contract: return_states) on the table's [2, T, 4, 64] rows and others
CONTRACT = [(2, 2048, 4, 64, 64, False, "float16", {}),
            (2, 2048, 4, 64, 64, False, "bfloat16", {}),
            (2, 16384, 4, 64, 64, True, "float16", {}),
            (2, 16384, 4, 64, 64, True, "bfloat16", {}),
            (1, 1000, 2, 128, 128, True, "bfloat16", {}),
            (2, 129, 2, 128, 512, True, "float16", {}),
            (1, 1000, 4, 256, 512, False, "bfloat16", {}),
            (2, 1000, 4, 64, 64, True, "bfloat16", {"segments": 2, "fused": False}),
            (1, 700, 2, 128, 128, False, "float16", {"segments": 3, "block_k": 64,
                                                     "block_v": 32, "fused": False})]


def _contract_inputs(B, T, H, K, V, init, dtype, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, dtype)
    rn = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    q, k = rn(B, T, H, K).to(dt), rn(B, T, H, K).to(dt)
    v = rn(B, T, H, V).to(dt)
    gk = torch.nn.functional.logsigmoid(rn(B, T, H, K) + 3.0).to(dt)
    h0 = 0.5 * rn(B, H, K, V) if init else None
    return q, k, v, gk, h0


def gla_states(q, k, v, gk, h0, config):
    """GLAChunkFwd: the contract itself ({}), or its call of the chunked forward under a
    forced plan config (o, final state, h [B, NC+1, H, K, V])."""
    from linattn.ops import chunk, gla
    from linattn.ops.contracts import gla_chunk_fwd
    if not config:
        return gla_chunk_fwd(q, k, v, gk, scale=0.125, initial_state=h0)
    o, final, states = chunk.chunk_forward(gla.SPEC, q, k, v, gk, None, scale=0.125,
                                           initial_state=h0, output_final_state=True,
                                           return_states=True, config=config)
    B, T, H, V = v.shape
    return o, final, states.view(B, -(-T // 64) + 1, H, q.shape[-1], V)


def contract_jobs(device="cuda"):
    from linattn.ops import runtime
    jobs = []
    for B, T, H, K, V, init, dtype, config in CONTRACT:
        with runtime.recording() as j:
            try:
                gla_states(*_contract_inputs(B, T, H, K, V, init, dtype, 0, device), config)
            except runtime.KernelRequested:
                pass
        jobs += j
    return jobs


@pytest.mark.parametrize("B,T,H,K,V,init,dtype,config", CONTRACT,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-{'h0-' if c[5] else ''}"
                              f"{c[6][:4]}" + "".join(f"-{a}{b}" for a, b in c[7].items())
                              for c in CONTRACT])
def test_gla_chunk_fwd_split(B, T, H, K, V, init, dtype, config, rng):
    """GLAChunkFwd: o, the final state and every chunk's state h [B, NC+1, H, K, V] f32
    against the fp64 reference, through the plan the model picks (the split at the
    table's few long chains, the fused pass writing the states) and forced ones."""
    from linattn.dsl import torch_reference as tref
    q, k, v, gk, h0 = _contract_inputs(B, T, H, K, V, init, dtype, int(rng.integers(2**31)))
    o, final, h = gla_states(q, k, v, gk, h0, config)
    torch.cuda.synchronize()
    ro, rfinal, rh = tref.gla_chunk_fwd(q.double(), k.double(), v.double(), gk.double(),
                                        scale=0.125,
                                        initial_state=None if h0 is None else h0.double())
    rel = lambda a, b: float((a.double() - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    errs = {"o": rel(o, ro), "final": rel(final, rfinal), "h": rel(h, rh)}
    print(errs)
    assert h.shape == rh.shape and final.dtype == h.dtype == torch.float32
    assert all(e < TOL[dtype] for e in errs.values()), errs
