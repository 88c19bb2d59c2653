"""GPU correctness of the chunked forward (ops.chunk.chunk_forward) against the fp64
references: dsl.chunked.chunked_forward (NumPy; its torch twin dsl.torch_reference on the
GPU for the largest cases) and dsl.recurrent.recurrent_forward as well for short ones. Inputs are rounded to the kernel's dtype first, so the comparison
measures the kernel's error only. Outputs are NaN-poisoned by conftest; inputs must come
back unchanged.

Run: python3 -m pytest -q tests/test_chunk_fwd_gpu.py   (skips without a GPU)
"""
import os

import numpy as np
import pytest

from linattn.dsl import Options
from linattn.dsl.chunked import chunked_forward as np_chunked_forward
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 5e-3}
BIG_CASE = 3000      # B * T * HV above which the reference runs in torch fp64 on the GPU


def case(op, B, T, H, HV, K, V, dtype="bfloat16", opts=(), init=True, final=True,
         lens=None, scale=None, config=None, gate_scale=1.0, key_scale=None):
    parts = [op, f"B{B}", f"T{T}" if lens is None else f"varlen{len(lens)}", f"H{H}",
             f"HV{HV}", f"K{K}", f"V{V}", dtype[:4]] + list(opts)
    parts += [] if init else ["noh0"]
    parts += [] if final else ["noht"]
    parts += [f"{k}{v}" for k, v in sorted((config or {}).items())]
    parts += [] if gate_scale == 1.0 else [f"g{gate_scale:g}"]
    parts += [] if key_scale is None else [f"k{key_scale:g}"]
    return pytest.param(dict(op=op, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype,
                             opts=tuple(opts), init=init, final=final, lens=lens, scale=scale,
                             config=config or {}, gate_scale=gate_scale, key_scale=key_scale),
                        id="-".join(parts))


CASES = [
    # fla-like shapes
    case("gdn", 2, 256, 4, 4, 128, 128),
    case("gdn", 1, 1000, 2, 8, 128, 128),
    case("deltanet", 2, 300, 4, 4, 128, 128),
    # awkward lengths
    case("gdn", 1, 1, 2, 2, 128, 128),
    case("gdn", 2, 63, 2, 2, 64, 64),
    case("gdn", 2, 65, 2, 4, 64, 64, dtype="float16"),
    case("deltanet", 1, 1, 4, 4, 64, 64, init=False),
    case("deltanet", 3, 65, 2, 2, 128, 128, dtype="float16"),
    # GVA ratios
    case("gdn", 1, 200, 4, 4, 64, 64),
    case("gdn", 1, 200, 2, 4, 128, 128),
    case("gdn", 1, 200, 1, 4, 64, 64),
    case("gdn", 1, 200, 1, 8, 128, 128, dtype="float16"),
    # each option
    case("gdn", 2, 130, 2, 4, 128, 128, opts=("l2norm_qk",)),
    case("gdn", 2, 130, 2, 4, 128, 128, opts=("beta_sigmoid",)),
    case("gdn", 2, 130, 2, 4, 64, 64, opts=("beta_sigmoid", "allow_neg_eigval")),
    case("gdn", 2, 130, 2, 4, 128, 128, opts=("gate_in_kernel",)),
    case("gdn", 2, 130, 2, 4, 128, 128, opts=("state_v_first",)),
    case("gdn", 1, 300, 2, 4, 128, 128, dtype="float16",
         opts=("l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
               "state_v_first")),
    case("deltanet", 2, 130, 2, 2, 64, 64, opts=("l2norm_qk", "state_v_first")),
    case("gdn", 1, 129, 2, 2, 128, 128, init=False, final=False),
    case("gdn", 1, 129, 2, 2, 128, 128, init=False, final=True, scale=0.3),
    # varlen: one-token sequences, ragged, up to 32 sequences
    case("gdn", 1, None, 2, 4, 128, 128, lens=[1, 64, 1, 65, 130, 1, 7]),
    case("gdn", 1, None, 2, 2, 64, 64, dtype="float16", opts=("state_v_first",),
         lens=[1, 1, 1, 200]),
    case("deltanet", 1, None, 4, 4, 128, 128, opts=("l2norm_qk",), lens=[63, 1, 64, 100]),
    case("gdn", 1, None, 2, 8, 128, 128, opts=("gate_in_kernel", "l2norm_qk"),
         lens=list(np.random.default_rng(7).integers(1, 150, 32))),
    # the additive rule with the same templates (no gate / scalar gate)
    case("additive_scalar", 1, 200, 2, 2, 64, 64),
    case("additive_none", 2, 70, 2, 2, 128, 128),
    # per-key gate: KDA (delta) and GLA (additive)
    case("kda", 1, 200, 2, 4, 128, 128, opts=("l2norm_qk",)),
    case("kda", 2, 65, 2, 2, 64, 64, dtype="float16",
         opts=("gate_in_kernel", "beta_sigmoid", "allow_neg_eigval")),
    case("kda", 1, None, 2, 2, 128, 128, opts=("l2norm_qk", "state_v_first"),
         lens=[1, 64, 65, 130, 1]),
    case("kda", 1, 1, 2, 2, 128, 128, init=False),
    case("gla", 2, 130, 2, 2, 64, 64),
    case("gla", 1, None, 4, 4, 128, 128, dtype="float16", lens=[100, 1, 64, 3]),
    case("gla", 1, 63, 2, 2, 128, 64, opts=("state_v_first",), scale=0.2),
    case("additive_key", 1, 100, 1, 2, 64, 64, opts=("gate_in_kernel", "l2norm_qk")),
    # the per-key prepare: strong gates (per-token log decays to -40: no exponent may
    # overflow), K = 256 and K = 192 (three 64-channel panels), ragged varlen in f16
    case("kda", 1, 300, 2, 2, 128, 128, opts=("l2norm_qk",), gate_scale=40.0),
    case("gla", 2, 100, 2, 2, 64, 64, gate_scale=40.0),
    case("kda", 1, 200, 2, 2, 256, 256, opts=("l2norm_qk",)),
    case("gla", 1, 200, 2, 2, 256, 128),
    case("kda", 1, 150, 1, 2, 192, 64, dtype="float16", opts=("l2norm_qk", "beta_sigmoid")),
    case("kda", 1, None, 2, 4, 128, 128, dtype="float16", opts=("l2norm_qk",),
         lens=[1, 63, 200, 1, 64, 129], gate_scale=5.0),
    case("delta_key", 1, None, 1, 4, 64, 128, opts=("gate_in_kernel",), lens=[70, 1, 20]),
    # K not a multiple of the state pass's 64: the op pads q, k, the gate (dt_bias) and
    # the states with zero channels (arch chunk_k)
    case("kda", 1, 150, 2, 2, 96, 64, opts=("l2norm_qk", "gate_in_kernel")),
    case("gla", 1, None, 2, 2, 48, 80, lens=[70, 1, 100]),
    # head dims the walk takes beyond 64 / 128
    case("gdn", 1, 300, 2, 4, 256, 128),
    case("gdn", 1, 200, 2, 2, 128, 256),
    case("deltanet", 1, 100, 2, 2, 32, 48),
]

#: the delta rule's walk under explicit plans: value blocks, the sequence split (the
#: warm-up with real gates, the maps with weak gates, no gate and expanding keys)
WALK_LENS = [1, 130, 0, 64, 700, 1000]
FUSED = {"inverse_in_walk": 1}
WALK_CASES = [
    case("gdn", 1, None, 2, 4, 128, 128, lens=WALK_LENS, config=cfg)
    for cfg in ({"block_v": 32}, {"block_v": 64}, {"block_v": 128}, {"segments": 2},
                {"segments": 4, "block_v": 64}, {"segments": 1, "block_v": 128})
] + [
    case("gdn", 1, None, 2, 4, 128, 128, lens=WALK_LENS, config={"segments": 4},
         gate_scale=1e-2),
    case("gdn", 1, None, 2, 4, 128, 128, lens=WALK_LENS, config={"segments": 4},
         key_scale=1.5),
    case("deltanet", 1, None, 2, 2, 64, 64, lens=WALK_LENS, config={"segments": 3}),
    case("deltanet", 2, 700, 2, 2, 128, 128, config={"segments": 2}, opts=("l2norm_qk",)),
    case("gdn", 1, None, 2, 8, 128, 128, dtype="float16", lens=WALK_LENS,
         opts=("l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
               "state_v_first"), config={"segments": 2, "block_v": 64}),
    case("gdn", 1, None, 2, 4, 64, 64, lens=WALK_LENS, init=False, config={"segments": 8}),
    case("gdn", 2, 1000, 2, 4, 128, 128, final=False, config={"segments": 4}),
    # the other pipelines forced where the walk would run
    case("gdn", 1, None, 2, 4, 128, 128, lens=WALK_LENS, config={"fused": False}),
] + [
    # the WY inverse inside the walk (chunk_walk_fused): value blocks, weak gates, no
    # gate, every option it takes (l2norm_qk stays on chunk_kkt_inverse), awkward
    # lengths, GVA, no initial / final state
    case("gdn", 1, None, 2, 4, 128, 128, lens=WALK_LENS, config=dict(FUSED, block_v=bv))
    for bv in (128, 32)
] + [
    case("gdn", 1, None, 2, 4, 128, 128, lens=WALK_LENS, config=FUSED, gate_scale=1e-2),
    case("deltanet", 1, None, 2, 2, 64, 64, lens=WALK_LENS, config=FUSED),
    case("deltanet", 3, 65, 2, 2, 128, 128, dtype="float16", config=FUSED),
    case("gdn", 1, None, 2, 8, 128, 128, dtype="float16", lens=WALK_LENS,
         opts=("beta_sigmoid", "allow_neg_eigval", "gate_in_kernel", "state_v_first"),
         config=dict(FUSED, block_v=64)),
    case("gdn", 1, None, 1, 8, 64, 64, lens=WALK_LENS, init=False, config=FUSED),
    case("gdn", 2, 1000, 2, 4, 128, 128, final=False, config=FUSED),
]


def _jobs(p, device="cuda"):
    """The kernels one case compiles (recorded from a dry call on ``device``)."""
    from linattn.ops import runtime
    with runtime.recording() as jobs:
        try:
            run_case(p, np.random.default_rng(0), dry=True, device=device)
        except runtime.KernelRequested:
            pass
    return list(jobs)


def precompile_jobs(items, device="cuda"):
    """The (spec, stage, arch, params) jobs of the selected cases (``items``: this
    module's selected tests), recorded from dry calls on ``device`` (tests/_cpu_plan.py:
    "cpu" lists them without a GPU)."""
    chosen = [it.callspec.params["p"] for it in items
              if hasattr(it, "callspec") and "p" in it.callspec.params]
    return [j for p in chosen for j in _jobs(p, device)]


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    """Compile the kernels of the selected cases in parallel processes first (disk cache)."""
    import time
    from _cpu_plan import module_items
    from linattn.ops import runtime
    t0 = time.time()
    jobs = precompile_jobs(module_items(request))
    errors = runtime.precompile(jobs)
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  compile error:", e)
    yield


def _spec(op):
    from linattn.dsl import all_rule_gate_specs, value_gate_spec
    six = {s.name: s for s in all_rule_gate_specs() + [value_gate_spec()]}
    return six[op] if op in six else get_spec(op)


def _to_torch(x, dtype, dev):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x)).to(dev, dtype)


def _rel(got, want):
    got = got.detach().double().cpu().numpy()
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _inputs(p, rng, spec, options, cu, B, T, device="cuda"):
    x = random_inputs(spec, options, B, T, p["H"], p["HV"], p["K"], p["V"], rng,
                      cu_seqlens=cu, initial_state=p["init"])
    if x["g"] is not None and not options.gate_in_kernel:
        x["g"] = x["g"] * p["gate_scale"]
    if p["key_scale"] is not None:
        x["k"] = x["k"] * p["key_scale"]
    dev = torch.device(device)
    dt = getattr(torch, p["dtype"])
    # kernel inputs: q, k, v, beta in the input dtype; g, states, A_log, dt_bias in f32
    return dict(q=_to_torch(x["q"], dt, dev), k=_to_torch(x["k"], dt, dev),
                v=_to_torch(x["v"], dt, dev), beta=_to_torch(x["beta"], dt, dev),
                g=_to_torch(x["g"], torch.float32, dev),
                A_log=_to_torch(x["A_log"], torch.float32, dev),
                dt_bias=_to_torch(x["dt_bias"], torch.float32, dev),
                initial_state=_to_torch(x["initial_state"], torch.float32, dev))


def _reference(p, spec, options, t, cu, cu_t, B, T):
    # the reference sees exactly the rounded values the kernel sees
    r = {n: (None if v is None else v.double().cpu().numpy()) for n, v in t.items()}
    if B * T * p["HV"] <= BIG_CASE:
        return np_chunked_forward(spec, r["q"], r["k"], r["v"], r["g"], r["beta"],
                                  options=options, scale=p["scale"],
                                  initial_state=r["initial_state"], cu_seqlens=cu,
                                  A_log=r["A_log"], dt_bias=r["dt_bias"]), r
    from linattn.dsl import torch_reference as tref   # fp64 on the GPU (fast at large sizes)
    o_ref, ht_ref = tref.chunked_forward(
        spec, *(None if t[n] is None else t[n].double() for n in ("q", "k", "v", "g", "beta")),
        options=options, scale=p["scale"],
        initial_state=None if t["initial_state"] is None else t["initial_state"].double(),
        cu_seqlens=cu_t, A_log=t["A_log"], dt_bias=t["dt_bias"])
    return {"o": o_ref.cpu().numpy(), "final_state": ht_ref.cpu().numpy()}, r


def run_case(p, rng, dry=False, device="cuda"):
    from linattn.ops.chunk import chunk_forward
    spec = _spec(p["op"])
    options = Options(**{n: True for n in p["opts"]})
    cu, B, T = None, p["B"], p["T"]
    if p["lens"] is not None:
        cu = np.concatenate([[0], np.cumsum(p["lens"])]).astype(np.int64)
        T = int(cu[-1])
    t = _inputs(p, rng, spec, options, cu, B, T, device)
    cu_t = None if cu is None else torch.from_numpy(cu).to(device)
    call = lambda: chunk_forward(  # noqa: E731
        spec, t["q"], t["k"], t["v"], t["g"], t["beta"], scale=p["scale"],
        initial_state=t["initial_state"], output_final_state=p["final"], options=options,
        cu_seqlens=cu_t, cu_seqlens_cpu=None if cu is None else torch.from_numpy(cu),
        A_log=t["A_log"], dt_bias=t["dt_bias"], config=p["config"])
    if dry:
        return call()
    ref, r = _reference(p, spec, options, t, cu, cu_t, B, T)
    before = {n: v.clone() for n, v in t.items() if v is not None}
    o, ht = call()
    torch.cuda.synchronize()
    for n, v in before.items():
        assert torch.equal(v, t[n]), f"input {n} was modified"
    assert o.dtype == t["q"].dtype and tuple(o.shape) == ref["o"].shape
    errs = {"o": _rel(o, ref["o"])}
    if p["final"]:
        assert ht.dtype == torch.float32
        errs["final_state"] = _rel(ht, ref["final_state"])
    else:
        assert ht is None
    if T <= 65 and (cu is None or len(cu) <= 8):
        o_rec, ht_rec = recurrent_forward(
            spec, r["q"], r["k"], r["v"], r["g"], r["beta"], options=options, scale=p["scale"],
            initial_state=r["initial_state"], cu_seqlens=cu, A_log=r["A_log"],
            dt_bias=r["dt_bias"])
        errs["o_vs_recurrent"] = _rel(o, o_rec)
    return errs


def assert_within_tolerance(errs: dict, dtype: str):
    """Every relative error of a run_case result under the dtype's tolerance."""
    tol = TOL[dtype]
    for name, e in errs.items():
        assert e < tol, f"{name}: rel err {e:.3e} >= {tol} ({errs})"


@pytest.mark.parametrize("p", CASES)
def test_chunk_forward_matches_reference(p, rng):
    errs = run_case(p, rng)
    print(errs)
    assert_within_tolerance(errs, p["dtype"])


@pytest.mark.parametrize("p", WALK_CASES)
def test_walk_plans_match_reference(p, rng):
    """The walk at each value block, split into segments (warm-up or exact maps), and the
    three-stage pipeline forced: every plan within tolerance of the fp64 reference."""
    errs = run_case(p, rng)
    print(errs)
    assert_within_tolerance(errs, p["dtype"])


def test_one_compile_serves_every_length(rng):
    """Dynamic sizes: two lengths and a varlen call reuse the compiled kernels."""
    from linattn.ops import chunk, runtime
    spec = get_spec("gdn")
    dev = torch.device("cuda")
    counts = []
    for T, cu in ((64, None), (333, None), (333, [0, 1, 100, 333])):
        # l2-normalised keys: with raw randn keys the delta rule itself diverges
        q = torch.nn.functional.normalize(torch.randn(1, T, 2, 64, device=dev), dim=-1)
        q = q.to(torch.bfloat16)
        v = torch.randn(1, T, 2, 64, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(1, T, 2, device=dev)
        beta = torch.rand(1, T, 2, device=dev, dtype=torch.bfloat16)
        cu_t = None if cu is None else torch.tensor(cu, device=dev)
        o, _ = chunk.chunk_forward(spec, q, q, v, g, beta, cu_seqlens=cu_t)
        assert torch.isfinite(o).all()
        counts.append(len(runtime._KERNELS))
    assert counts[0] == counts[1] == counts[2], counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("B,T,H,K,V,init", [(2, 130, 4, 64, 64, True), (1, 64, 2, 128, 64, False),
                                             (2, 1, 2, 64, 128, True)])
def test_gla_chunk_fwd_contract(B, T, H, K, V, init, dtype, rng):
    """GLAChunkFwd (ops.contracts.gla_chunk_fwd): o, final state and the per-chunk states h
    [B, NC+1, H, K, V] against the fp64 torch reference (the contract allocates its
    outputs: torch.empty, never zero-filled)."""
    from linattn.dsl import torch_reference as tref
    from linattn.ops.contracts import gla_chunk_fwd
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    dt = getattr(torch, dtype)
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, k = rn(B, T, H, K).to(dt), rn(B, T, H, K).to(dt)
    v = rn(B, T, H, V).to(dt)
    gk = torch.nn.functional.logsigmoid(rn(B, T, H, K) + 3.0).to(dt)
    h0 = 0.5 * rn(B, H, K, V) if init else None
    o, final, h = gla_chunk_fwd(q, k, v, gk, scale=0.125, initial_state=h0)
    torch.cuda.synchronize()
    ro, rfinal, rh = tref.gla_chunk_fwd(q.double(), k.double(), v.double(), gk.double(),
                                        scale=0.125,
                                        initial_state=None if h0 is None else h0.double())
    rel = lambda a, b: float((a.double() - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    errs = {"o": rel(o, ro), "final": rel(final, rfinal), "h": rel(h, rh)}
    assert h.shape == rh.shape and final.dtype == h.dtype == torch.float32
    assert all(e < TOL[dtype] for e in errs.values()), errs
