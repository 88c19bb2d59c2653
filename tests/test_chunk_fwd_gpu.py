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
from linattn.ops.chunk import PREPARE_VARIANTS
from linattn.ops.registry import get_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 5e-3}
BIG_CASE = 3000      # B * T * HV above which the reference runs in torch fp64 on the GPU


def case(op, B, T, H, HV, K, V, dtype="bfloat16", opts=(), init=True, final=True,
         lens=None, scale=None):
    parts = [op, f"B{B}", f"T{T}" if lens is None else f"varlen{len(lens)}", f"H{H}",
             f"HV{HV}", f"K{K}", f"V{V}", dtype[:4]] + list(opts)
    parts += [] if init else ["noh0"]
    parts += [] if final else ["noht"]
    return pytest.param(dict(op=op, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype,
                             opts=tuple(opts), init=init, final=final, lens=lens, scale=scale),
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
    case("delta_key", 1, None, 1, 4, 64, 128, opts=("gate_in_kernel",), lens=[70, 1, 20]),
]


FUSED_CASES = [
    case("gdn", 2, 256, 4, 4, 128, 128),
    case("gdn", 1, None, 2, 4, 128, 128, opts=("l2norm_qk", "gate_in_kernel"),
         lens=[1, 64, 1, 65, 130, 1, 7]),
    case("deltanet", 2, 65, 2, 2, 64, 64, dtype="float16", opts=("state_v_first",)),
    case("kda", 1, None, 2, 2, 128, 128, opts=("l2norm_qk",), lens=[1, 64, 65, 130, 1]),
    case("gla", 2, 130, 2, 2, 64, 64),
    case("additive_scalar", 1, 200, 2, 2, 64, 64, init=False),
]


def case_jobs(p, **knobs):
    """(spec, stage, params) compile jobs of one case under the chunk module's knobs."""
    from linattn.ops import chunk
    with chunk.using(**knobs):
        spec = _spec(p["op"])
        options = Options(**{n: True for n in p["opts"]})
        N = p["B"] if p["lens"] is None else len(p["lens"])
        params = chunk.stage_params(spec, options, H=p["H"], HV=p["HV"], K=p["K"], V=p["V"],
                                    dtype=p["dtype"], g_dtype="float32", beta_dtype=p["dtype"],
                                    N=N, has_initial_state=p["init"],
                                    output_final_state=p["final"],
                                    fused=chunk.fuse_output(N * p["HV"], p["dtype"], p["K"]))
        return [(spec, stage, pr) for stage, pr in params.items()]


def all_jobs():
    jobs = default_and_grid_jobs()
    for c in STATE_VARIANT_CASES:
        for stages in (0, 1, 2):
            for bv in (16, 64):
                jobs += case_jobs(c.values[0], STATE_NUM_STAGES=stages,
                                  STATE_BLOCK_V_OVERRIDE=bv)
    for c in INVERSE_CASES:
        for how in ("column", "blocked", "tc"):
            jobs += case_jobs(c.values[0], PREPARE_INVERSE=how)
    for c in FUSED_CASES:
        for fused_q in ("raw", "gated"):
            jobs += case_jobs(c.values[0], FUSE_OUTPUT=True, FUSED_Q=fused_q)
    jobs += prepare_variant_jobs()
    for c in STATE_VARIANT_CASES:
        for on in (True, False):
            jobs += case_jobs(c.values[0], STATE_V_NEW_FROM_FRAGMENT=on)
            jobs += case_jobs(c.values[0], STATE_H_FROM_FRAGMENT=on)
        jobs += case_jobs(c.values[0], OUTPUT_BLOCK_V_OVERRIDE=32)
        jobs += case_jobs(c.values[0], OUTPUT_TILE_LOADS=True)
    for c in FUSED_CASES:
        jobs += case_jobs(c.values[0], OUTPUT_TILE_LOADS=True)
    return jobs


def default_and_grid_jobs():
    jobs = [j for c in CASES for j in case_jobs(c.values[0])]
    for c in STATE_VARIANT_CASES + FUSED_CASES:
        for knobs in GRID_VARIANTS.values():
            jobs += case_jobs(c.values[0], **knobs)
    for c in KEY_PREPARE_CASES:
        for knobs in KEY_PREPARE_VARIANTS.values():
            jobs += case_jobs(c.values[0], **knobs)
    return jobs


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every kernel these tests need in parallel processes first (disk cache)."""
    import time
    from linattn.ops import chunk
    t0 = time.time()
    # LINATTN_TEST_PRECOMPILE=prepare: only the chunk_prepare variant tests' kernels (a
    # short GPU run with `-k prepare_variant`)
    # LINATTN_TEST_PRECOMPILE=split: only the split prepare's variants (`-k "variant and split"`)
    # LINATTN_TEST_PRECOMPILE=default: only the default-knob cases' kernels, grid_order's
    # and key_prepare's (`-k "matches_reference or grid_order or key_prepare"`)
    only = os.environ.get("LINATTN_TEST_PRECOMPILE")
    jobs = (prepare_variant_jobs() if only == "prepare"
            else prepare_variant_jobs([n for n in PREPARE_VARIANTS if n.startswith("split")])
            if only == "split" else default_and_grid_jobs() if only == "default"
            else all_jobs())
    errors = chunk.precompile(jobs)
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  compile error:", e)
    yield


def _spec(op):
    from linattn.dsl import all_rule_gate_specs
    six = {s.name: s for s in all_rule_gate_specs()}
    return six[op] if op in six else get_spec(op)


def _to_torch(x, dtype, dev):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x)).to(dev, dtype)


def _rel(got, want):
    got = got.detach().double().cpu().numpy()
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run_case(p, rng):
    from linattn.ops.chunk import chunk_forward
    spec = _spec(p["op"])
    options = Options(**{n: True for n in p["opts"]})
    cu = None
    B, T = p["B"], p["T"]
    if p["lens"] is not None:
        cu = np.concatenate([[0], np.cumsum(p["lens"])]).astype(np.int64)
        T = int(cu[-1])
    x = random_inputs(spec, options, B, T, p["H"], p["HV"], p["K"], p["V"], rng,
                      cu_seqlens=cu, initial_state=p["init"])
    dev = torch.device("cuda")
    dt = getattr(torch, p["dtype"])
    # kernel inputs: q, k, v, beta in the input dtype; g, states, A_log, dt_bias in f32
    t = dict(q=_to_torch(x["q"], dt, dev), k=_to_torch(x["k"], dt, dev),
             v=_to_torch(x["v"], dt, dev), beta=_to_torch(x["beta"], dt, dev),
             g=_to_torch(x["g"], torch.float32, dev),
             A_log=_to_torch(x["A_log"], torch.float32, dev),
             dt_bias=_to_torch(x["dt_bias"], torch.float32, dev),
             initial_state=_to_torch(x["initial_state"], torch.float32, dev))
    cu_t = None if cu is None else torch.from_numpy(cu).to(dev)
    # the reference sees exactly the rounded values the kernel sees
    r = {n: (None if v is None else v.double().cpu().numpy()) for n, v in t.items()}
    if B * T * p["HV"] <= BIG_CASE:
        ref = np_chunked_forward(spec, r["q"], r["k"], r["v"], r["g"], r["beta"],
                                 options=options, scale=p["scale"],
                                 initial_state=r["initial_state"], cu_seqlens=cu,
                                 A_log=r["A_log"], dt_bias=r["dt_bias"])
    else:   # the same fp64 chunked reference in torch, on the GPU (fast at large sizes)
        from linattn.dsl import torch_reference as tref
        o_ref, ht_ref = tref.chunked_forward(
            spec, *(None if t[n] is None else t[n].double() for n in ("q", "k", "v", "g", "beta")),
            options=options, scale=p["scale"],
            initial_state=None if t["initial_state"] is None else t["initial_state"].double(),
            cu_seqlens=cu_t, A_log=t["A_log"], dt_bias=t["dt_bias"])
        ref = {"o": o_ref.cpu().numpy(), "final_state": ht_ref.cpu().numpy()}
    before = {n: v.clone() for n, v in t.items() if v is not None}
    o, ht = chunk_forward(spec, t["q"], t["k"], t["v"], t["g"], t["beta"], scale=p["scale"],
                          initial_state=t["initial_state"], output_final_state=p["final"],
                          options=options, cu_seqlens=cu_t,
                          cu_seqlens_cpu=None if cu is None else torch.from_numpy(cu),
                          A_log=t["A_log"], dt_bias=t["dt_bias"])
    torch.cuda.synchronize()
    for n, v in before.items():
        assert torch.equal(v, t[n]), f"input {n} was modified"
    assert o.dtype == dt and tuple(o.shape) == ref["o"].shape
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


def check_with_knobs(p, knobs, rng, monkeypatch):
    """One case under the chunk module's knobs (set for this test only), within tolerance."""
    from linattn.ops import chunk
    for knob, value in knobs.items():
        monkeypatch.setattr(chunk, knob, value)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


@pytest.mark.parametrize("p", CASES)
def test_chunk_forward_matches_reference(p, rng):
    errs = run_case(p, rng)
    print(errs)
    assert_within_tolerance(errs, p["dtype"])


STATE_VARIANT_CASES = [
    case("gdn", 1, None, 2, 4, 128, 128, lens=[1, 64, 1, 65, 130, 1, 7]),
    case("deltanet", 2, 129, 2, 2, 64, 64, dtype="float16", opts=("state_v_first",)),
]


@pytest.mark.parametrize("block_v", [16, 64])
@pytest.mark.parametrize("num_stages", [0, 1, 2])
@pytest.mark.parametrize("p", STATE_VARIANT_CASES)
def test_state_pass_variants(p, num_stages, block_v, rng, monkeypatch):
    """The state pass's tuning knobs (pipeline depth, value block) keep it correct."""
    from linattn.ops import chunk
    monkeypatch.setattr(chunk, "STATE_NUM_STAGES", num_stages)
    monkeypatch.setattr(chunk, "STATE_BLOCK_V_OVERRIDE", block_v)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("p", STATE_VARIANT_CASES)
def test_state_pass_v_new_from_fragment(p, on, rng, monkeypatch):
    from linattn.ops import chunk
    monkeypatch.setattr(chunk, "STATE_V_NEW_FROM_FRAGMENT", on)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("p", STATE_VARIANT_CASES)
def test_state_pass_h_from_fragment(p, on, rng, monkeypatch):
    from linattn.ops import chunk
    monkeypatch.setattr(chunk, "STATE_H_FROM_FRAGMENT", on)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


@pytest.mark.parametrize("fused_q", ["raw", "gated"])
@pytest.mark.parametrize("p", FUSED_CASES)
def test_fused_output_path(p, fused_q, rng, monkeypatch):
    """chunk_qk + chunk_state_output: o formed inside the state pass (no h written); q
    read and gated by the state pass (raw) or through chunk_qk's qg (gated)."""
    from linattn.ops import chunk
    monkeypatch.setattr(chunk, "FUSE_OUTPUT", True)
    monkeypatch.setattr(chunk, "FUSED_Q", fused_q)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


@pytest.mark.parametrize("p", STATE_VARIANT_CASES + FUSED_CASES)
def test_output_tile_loads(p, rng, monkeypatch):
    """chunk_output with whole-tile loads (rows past a chunk's end read, then masked)."""
    from linattn.ops import chunk
    monkeypatch.setattr(chunk, "OUTPUT_TILE_LOADS", True)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


#: the per-(chunk, head) grids with the value head fastest, on both paths and with the
#: fused chunk_prepare; chunk_output's o staged through shared memory; the state pass with
#: two consumer warpgroups (STATE_THREADS=256) on both paths; chunk_qk per key head
GRID_VARIANTS = {
    "heads-3stage": dict(HEADS_FASTEST=True, FUSE_OUTPUT=False),
    "heads-fused": dict(HEADS_FASTEST=True, FUSE_OUTPUT=True),
    "heads-fused-prepare": dict(HEADS_FASTEST=True, FUSE_OUTPUT=False, PREPARE_SPLIT=False),
    "stage-o": dict(OUTPUT_STAGE_O=True, FUSE_OUTPUT=False),
    "heads-stage-o": dict(HEADS_FASTEST=True, OUTPUT_STAGE_O=True, FUSE_OUTPUT=False),
    "state-t256-3stage": dict(STATE_THREADS=256, STATE_BLOCK_V_OVERRIDE=32, FUSE_OUTPUT=False),
    "state-t256-fused": dict(STATE_THREADS=256, STATE_BLOCK_V_OVERRIDE=32, FUSE_OUTPUT=True),
    "qk-group-fused": dict(QK_GROUP_LOOP=True, FUSE_OUTPUT=True),
    # two state-pass CTAs per SM by registers (and shared memory: one stage), alone and
    # with the sequence split into segments
    "occ2-fused": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1, FUSE_OUTPUT=True),
    "occ2-3stage": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1, FUSE_OUTPUT=False),
    "occ2-split": dict(STATE_MIN_BLOCKS=2, STATE_NUM_STAGES=1, SPLIT=True,
                       SPLIT_SEGMENT_CHUNKS=2),
}


@pytest.mark.parametrize("variant", sorted(GRID_VARIANTS))
@pytest.mark.parametrize("p", STATE_VARIANT_CASES + FUSED_CASES)
def test_grid_order_and_staged_output(p, variant, rng, monkeypatch):
    check_with_knobs(p, GRID_VARIANTS[variant], rng, monkeypatch)


#: the per-key gate's one-kernel prepare (KDA, GLA): threads (128: the default before run
#: s5-3), inverse, the skewed channel loop of the diagonal blocks
KEY_PREPARE_VARIANTS = {
    "t128": dict(PREPARE_KEY_THREADS=128),
    "blocked": dict(PREPARE_KEY_INVERSE="blocked"),
    "t128-blocked": dict(PREPARE_KEY_THREADS=128, PREPARE_KEY_INVERSE="blocked"),
    "skew": dict(PREPARE_KEY_SKEW=True),
    "skew-t128": dict(PREPARE_KEY_SKEW=True, PREPARE_KEY_THREADS=128),
}
KEY_PREPARE_CASES = [
    case("kda", 1, 200, 2, 4, 128, 128, opts=("l2norm_qk",)),
    case("kda", 2, 65, 2, 2, 64, 64, dtype="float16",
         opts=("gate_in_kernel", "beta_sigmoid", "allow_neg_eigval")),
    case("kda", 1, None, 2, 2, 128, 128, opts=("l2norm_qk",), lens=[1, 64, 65, 130, 1]),
    case("gla", 2, 130, 2, 2, 128, 128, dtype="float16"),
    case("gla", 1, None, 2, 2, 64, 64, lens=[63, 1, 200]),
]


@pytest.mark.parametrize("variant", sorted(KEY_PREPARE_VARIANTS))
@pytest.mark.parametrize("p", KEY_PREPARE_CASES)
def test_key_prepare_variant(p, variant, rng, monkeypatch):
    """The per-key gate's prepare knobs keep the forward correct (output and state)."""
    check_with_knobs(p, KEY_PREPARE_VARIANTS[variant], rng, monkeypatch)


@pytest.mark.parametrize("p", STATE_VARIANT_CASES)
def test_output_smaller_value_block(p, rng, monkeypatch):
    from linattn.ops import chunk
    monkeypatch.setattr(chunk, "OUTPUT_BLOCK_V_OVERRIDE", 32)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


INVERSE_CASES = [
    case("gdn", 2, 130, 2, 4, 128, 128, opts=("beta_sigmoid", "allow_neg_eigval")),
    case("deltanet", 1, None, 2, 2, 64, 64, dtype="float16", lens=[1, 63, 64, 65, 3]),
    case("kda", 1, 200, 2, 2, 128, 128, opts=("l2norm_qk",)),
]


@pytest.mark.parametrize("inverse", ["column", "blocked", "tc"])
@pytest.mark.parametrize("p", INVERSE_CASES)
def test_prepare_inverse_variants(p, inverse, rng, monkeypatch):
    from linattn.ops import chunk
    monkeypatch.setattr(chunk, "PREPARE_INVERSE", inverse)
    assert_within_tolerance(run_case(p, rng), p["dtype"])


# chunk_prepare's performance variants (ops.chunk.PREPARE_VARIANTS), each against the fp64
# reference; the split ones replace chunk_prepare for the delta rule without a key gate only
PREPARE_VARIANT_CASES = [
    case("gdn", 2, 256, 4, 4, 128, 128),
    case("deltanet", 2, 130, 2, 2, 64, 64, dtype="float16"),
    case("gdn", 1, None, 2, 4, 128, 128, opts=("l2norm_qk", "beta_sigmoid", "allow_neg_eigval",
                                                "gate_in_kernel", "state_v_first"),
         lens=[1, 64, 1, 65, 130, 1, 7]),
    case("deltanet", 1, None, 2, 4, 128, 128, dtype="float16", opts=("l2norm_qk",),
         lens=[1, 63, 64, 1, 100]),
    case("gdn", 1, None, 1, 2, 64, 64, dtype="float16",
         opts=("l2norm_qk", "beta_sigmoid", "gate_in_kernel"), lens=[1, 1, 70, 3]),
    case("gdn", 1, None, 2, 4, 128, 64, opts=("l2norm_qk",), lens=[5, 64, 129]),    # K != V
]


def prepare_variant_jobs(names=None):
    return [j for c in PREPARE_VARIANT_CASES for name, knobs in PREPARE_VARIANTS.items()
            if names is None or name in names for j in case_jobs(c.values[0], **knobs)]


@pytest.mark.parametrize("variant", sorted(PREPARE_VARIANTS))
@pytest.mark.parametrize("p", PREPARE_VARIANT_CASES)
def test_prepare_variant(p, variant, rng, monkeypatch):
    check_with_knobs(p, PREPARE_VARIANTS[variant], rng, monkeypatch)


def test_key_gate_refuses_wide_keys():
    """The per-key gate's first stage keeps [64, K] f32 decays on chip: K <= 128."""
    from linattn.dsl import SpecError
    from linattn.ops.chunk import chunk_forward
    q = torch.zeros(1, 4, 1, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(SpecError, match="K <= 128"):
        chunk_forward(get_spec("kda"), q, q, q, g=torch.zeros(1, 4, 1, 256, device="cuda"),
                      beta=torch.zeros(1, 4, 1, device="cuda"))


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
