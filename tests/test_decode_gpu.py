"""GPU correctness of the fused recurrent / decode kernel (ops.recurrent.fused_recurrent)
against the fp64 NumPy reference dsl.recurrent.recurrent_forward.

Covers the six rule x gate specs and the value gate (rendered on the fly; cases
``-k additive_value``) and the four registered families
(the checked-in generated modules): decode (T = 1) and short sequences, varlen with
one-token and empty sequences, every option, both state layouts, GVA, f16 / bf16 inputs,
f32 / input-dtype states, K != V, K up to 256. Inputs are rounded to the kernel dtypes
first, so the comparison measures the kernel's error only: ||out - ref|| / ||ref|| must be
below 1e-2 (bf16) / 5e-3 (f16) for o and the final state. Outputs are NaN-poisoned by
conftest; inputs must come back unchanged.

One run gives the whole picture: every case runs, and with $OUT_DIR (or $OUT) set a
summary of every case's errors lands in decode_gpu.json there (decode_gpu_<worker>.json
per pytest-xdist worker, so parallel workers do not overwrite each other). Bandwidth
lines are also emitted as DecodeBandwidth warnings, which pytest (and xdist) print in
the warnings summary. Timings taken next to other xdist workers are indicative only;
bench/decode_probe.py times alone.

    python3 -m pytest -q tests/test_decode_gpu.py          (skips without a GPU)
"""
import os
import time
import warnings

import numpy as np
import pytest
from conftest import write_summary

from linattn.dsl import Options, all_rule_gate_specs, value_gate_spec
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 5e-3}
DEVICE = "cuda"
SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
SIX = {s.name: s for s in all_rule_gate_specs()}
VALUE_GATE = value_gate_spec()
RESULTS = []


def _spec(name):
    if name == VALUE_GATE.name:
        return VALUE_GATE
    return SIX[name] if name in SIX else get_spec(name)


def case(op, B=1, T=1, H=2, HV=4, K=128, V=128, dtype="bfloat16", opts=(), init=True,
         final=True, lens=None, state="float32", f32_gb=True, scale=None, index="int32",
         tuning=None):
    if opts == "all":
        opts = tuple(sorted(_spec(op).supports))
    parts = [op, f"B{B}", f"T{T}" if lens is None else "varlen" + "_".join(map(str, lens)),
             f"H{H}", f"HV{HV}", f"K{K}", f"V{V}", SHORT[dtype], f"state_{SHORT[state]}"] + list(opts)
    parts += ([] if init else ["noh0"]) + ([] if final else ["noht"])
    parts += [] if f32_gb else ["gb_in_dtype"]
    parts += [f"{k}{v}" for k, v in (tuning or {}).items()]
    return pytest.param(dict(op=op, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, opts=tuple(opts),
                             init=init, final=final, lens=lens, state=state, f32_gb=f32_gb,
                             scale=scale, index=index, tuning=tuning), id="-".join(parts))


CASES = []
for _name in SIX:  # every rule x gate: decode, all options + varlen, layout/GVA, low-precision state
    CASES += [
        case(_name, B=5, T=1),
        case(_name, H=1, HV=2, K=64, V=64, dtype="float16", opts="all", lens=[3, 0, 1, 12],
             index="int64"),
        case(_name, B=2, T=9, H=2, HV=8, K=128, V=64, opts=("state_v_first",), init=False),
        case(_name, B=3, T=1, H=4, HV=4, K=64, V=64, dtype="float16", state="float16",
             f32_gb=False, scale=1.0),
    ]
CASES += [  # the value gate (g [B, T, HV, V]): K != V, value blocks, every option, varlen
    case(VALUE_GATE.name, B=5, T=1),
    case(VALUE_GATE.name, B=2, T=33, H=2, HV=4, K=128, V=64),
    case(VALUE_GATE.name, B=3, T=5, H=2, HV=2, K=64, V=256, opts=("state_v_first",)),
    case(VALUE_GATE.name, H=1, HV=2, K=64, V=96, dtype="float16", opts="all",
         lens=[3, 0, 1, 12], index="int64"),
]
CASES += [  # the registered families through the checked-in generated modules
    case("gdn", B=32, T=1, H=16, HV=32, opts=("l2norm_qk", "beta_sigmoid", "gate_in_kernel")),
    case("gdn", B=2, T=63, H=2, HV=4, opts=("l2norm_qk",)),
    case("gdn", B=1, T=1, H=4, HV=4, K=256, V=128, dtype="float16"),
    case("gdn", B=4, T=1, H=2, HV=4, opts="all", f32_gb=False),
    case("gdn", lens=[1, 1, 1, 1, 1, 1, 1], H=2, HV=8, opts=("l2norm_qk", "state_v_first")),
    case("kda", B=16, T=1, H=8, HV=8, opts=("l2norm_qk", "beta_sigmoid", "gate_in_kernel")),
    case("kda", B=2, T=17, H=2, HV=4, K=64, V=128, dtype="float16", opts="all"),
    case("kda", B=4, T=1, H=2, HV=4, opts="all", f32_gb=False),   # bf16 A_log / dt_bias
    case("deltanet", B=8, T=1, H=4, HV=4, K=256, V=256, opts=("l2norm_qk",)),
    case("deltanet", B=1, T=40, H=2, HV=2, K=64, V=32, init=False, final=False),
    case("deltanet", B=4, T=1, H=8, HV=8, state="bfloat16", f32_gb=False, scale=1.0),
    case("gla", B=8, T=1, H=4, HV=4),
    case("gla", lens=[5, 1, 30], H=2, HV=2, K=64, V=64, dtype="float16", opts=("state_v_first",)),
    case("gla", B=4, T=1, H=4, HV=4, state="bfloat16", f32_gb=False),
]
#: the resident-CTA cap (ctas_per_sm) of codegen/arch/sm90's DECODE_FULL_GRID: the
#: block-64 tile, a block-32 one over several tokens
_S32 = dict(block_v=32, threads=128, vec=4, warps_k=4)
_S64 = dict(block_v=64, threads=128, vec=4, warps_k=1)
CASES += [
    case("kda", B=7, T=1, H=8, HV=8, opts=("l2norm_qk", "gate_in_kernel"),
         tuning=dict(_S64, ctas_per_sm=3)),
    case("gla", B=5, T=3, H=4, HV=4, tuning=dict(_S32, ctas_per_sm=3)),
]


@pytest.fixture(scope="session", autouse=True)
def _session(tmp_path_factory):
    os.environ.setdefault("LINATTN_GEN_DIR", str(tmp_path_factory.mktemp("linattn_gen")))
    yield
    if RESULTS:
        write_summary("decode_gpu", RESULTS)
    checks = [r for r in RESULTS if r["tol"] is not None]
    worst = sorted(checks, key=lambda r: -max(r.get("o_ratio", 99), r.get("ht_ratio", 0)))
    print(f"\ndecode GPU: {sum(r['passed'] for r in checks)}/{len(checks)} passed; worst:")
    for r in worst[:8]:
        print(f"  {r['id']}: o {r.get('o_err')} ht {r.get('ht_err')} tol {r['tol']} "
              f"{r.get('error', '')[:200]}")


def _rel(got, want):
    want = np.asarray(want, dtype=np.float64)
    got = got.double().cpu().numpy()
    assert got.shape == want.shape, (got.shape, want.shape)
    norm = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (norm if norm > 0 else 1.0))


@pytest.mark.parametrize("c", CASES)
def test_decode_matches_reference(c, rng, request):
    rec = {"id": request.node.callspec.id, "tol": TOL[c["dtype"]], "passed": False}
    RESULTS.append(rec)
    spec = _spec(c["op"])
    opts = Options(**{n: True for n in c["opts"]})
    dt = getattr(torch, c["dtype"])
    sdt = getattr(torch, c["state"])
    cu = None
    B, T = c["B"], c["T"]
    if c["lens"] is not None:
        B, T = 1, sum(c["lens"])
        cu = np.concatenate([[0], np.cumsum(c["lens"])])
    x = random_inputs(spec, opts, B, T, c["H"], c["HV"], c["K"], c["V"], rng,
                      cu_seqlens=cu, initial_state=c["init"])

    dev = DEVICE
    dtypes = {"q": dt, "k": dt, "v": dt, "initial_state": sdt,
              "g": torch.float32 if c["f32_gb"] else dt,
              "beta": torch.float32 if c["f32_gb"] else dt,
              "A_log": torch.float32 if c["f32_gb"] else dt,    # (the kernel reads them as
              "dt_bias": torch.float32 if c["f32_gb"] else dt,  # they are: no cast a step)
              "cu_seqlens": getattr(torch, c["index"])}
    t = {n: None if a is None else torch.tensor(a, device=dev).to(dtypes[n]).contiguous()
         for n, a in x.items()}
    ref_in = {n: None if a is None else (a.double().cpu().numpy() if n != "cu_seqlens"
                                         else a.cpu().numpy()) for n, a in t.items()}
    before = {n: a.clone() for n, a in t.items() if a is not None}

    o_ref, ht_ref = recurrent_forward(spec, ref_in["q"], ref_in["k"], ref_in["v"], ref_in["g"],
                                      ref_in["beta"], options=opts, scale=c["scale"],
                                      initial_state=ref_in["initial_state"],
                                      cu_seqlens=ref_in["cu_seqlens"], A_log=ref_in["A_log"],
                                      dt_bias=ref_in["dt_bias"])
    from linattn.ops.recurrent import fused_recurrent
    t0 = time.time()
    try:
        o, ht = fused_recurrent(spec, t["q"], t["k"], t["v"], t["g"], t["beta"], scale=c["scale"],
                                initial_state=t["initial_state"], output_final_state=c["final"],
                                options=opts, cu_seqlens=t["cu_seqlens"], A_log=t["A_log"],
                                dt_bias=t["dt_bias"], state_dtype=sdt, tuning=c["tuning"])
        torch.cuda.synchronize()
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        raise
    rec["first_call_s"] = round(time.time() - t0, 2)

    assert o.dtype == dt and o.shape == o_ref.shape
    rec["o_err"] = _rel(o, o_ref)
    rec["o_ratio"] = rec["o_err"] / rec["tol"]
    if c["final"]:
        assert ht.dtype == sdt
        rec["ht_err"] = _rel(ht, ht_ref)
        rec["ht_ratio"] = rec["ht_err"] / rec["tol"]
    else:
        assert ht is None
    unchanged = all(torch.equal(before[n], t[n]) for n in before)
    rec["inputs_unchanged"] = unchanged
    rec["passed"] = bool(unchanged and rec["o_err"] < rec["tol"]
                         and rec.get("ht_err", 0.0) < rec["tol"])
    assert unchanged, "fused_recurrent modified an input"
    assert rec["o_err"] < rec["tol"], f"o rel err {rec['o_err']:.3e}"
    if c["final"]:
        assert rec["ht_err"] < rec["tol"], f"final state rel err {rec['ht_err']:.3e}"


def test_decode_repeated_calls_reuse_kernel():
    """Lengths never recompile; a new batch size compiles again only when the arch table
    picks another tuning for it (block_v etc. depend on the number of sequences)."""
    from linattn.codegen.arch import get_arch
    from linattn.ops import runtime
    from linattn.ops.recurrent import fused_recurrent
    spec = get_spec("gdn")
    problem = dict(H=2, HV=4, K=128, V=128, state_dtype="float32")
    tuning_of = lambda B: get_arch("sm90").tuning("recurrent", problem, {"N": B})  # noqa: E731
    seen = []
    for B, T in ((3, 1), (3, 7), (7, 1), (2, 5), (2, 1), (64, 1), (64, 3), (40, 1)):
        n0 = len(runtime._KERNELS)
        q = torch.randn(B, T, 2, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn_like(q).float(), dim=-1).to(q.dtype)
        v = torch.randn(B, T, 4, 128, device="cuda", dtype=torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, 4, device="cuda"))
        beta = torch.rand(B, T, 4, device="cuda", dtype=torch.bfloat16)
        o, _ = fused_recurrent(spec, q, k, v, g, beta)
        assert torch.isfinite(o).all()
        tuning = tuning_of(B)
        new = len(runtime._KERNELS) - n0
        if tuning in seen:
            assert new == 0, f"B={B} T={T}: recompiled although tuning {tuning} was compiled"
        else:
            assert new <= 1, f"B={B} T={T}: {new} new kernels"
            seen.append(tuning)


DECODE_SHAPES = [  # (op, B, H, HV, K, V): state bytes dominate, read + written once
    ("gdn", 1, 16, 32, 128, 128),
    ("gdn", 32, 16, 32, 128, 128),
    ("gdn", 256, 16, 32, 128, 128),
    ("gdn", 256, 32, 64, 128, 128),
    ("kda", 64, 32, 32, 128, 128),
    ("gla", 64, 16, 16, 128, 128),
]


class DecodeBandwidth(UserWarning):
    """One decode bandwidth measurement (shown in pytest's warnings summary)."""


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_decode_bandwidth(shape):
    """Device time of one decode step (CUPTI kernel time, L2 flushed before each call:
    linattn.cli.bench.timer); recorded, not judged beyond a loose floor: fraction of a
    4.27 TB/s copy for the state read + write."""
    from linattn.cli.bench.timer import device_time
    from linattn.ops.recurrent import fused_recurrent
    op, B, H, HV, K, V = shape
    spec = get_spec(op)
    dev, bf = "cuda", torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).to(bf)
    v = torch.randn(B, 1, HV, V, device=dev, dtype=bf)
    g = (torch.nn.functional.logsigmoid(torch.randn(spec.gate_shape(B, 1, HV, K), device=dev))
         if spec.has_gate else None)
    beta = torch.rand(B, 1, HV, device=dev, dtype=bf) if spec.has_beta else None
    h0 = torch.randn(B, HV, K, V, device=dev) * 0.1
    call = lambda: fused_recurrent(spec, q, k, v, g, beta, initial_state=h0,  # noqa: E731
                                   output_final_state=True)
    call()
    t = device_time(call, budget_ms=60.0)["ms"] * 1e-3
    moved = 2 * h0.numel() * 4 + sum(x.numel() * x.element_size() for x in (q, k, v))
    frac = moved / t / 4.27e12
    RESULTS.append({"id": f"bandwidth-{'-'.join(map(str, shape))}", "tol": None, "passed": True,
                    "seconds": t, "bytes": moved, "fraction_of_copy_bw": frac})
    line = f"decode {shape}: {t * 1e6:.1f} us, {moved / t / 1e12:.2f} TB/s ({frac:.0%} of copy)"
    print(line)
    warnings.warn(line, DecodeBandwidth)
    if h0.numel() * 4 >= 64 << 20:        # big enough to be bandwidth bound
        assert frac > 0.3, f"only {frac:.0%} of copy bandwidth"
