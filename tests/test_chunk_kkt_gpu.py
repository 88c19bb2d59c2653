"""GPU correctness of chunk_kkt_inverse alone against fp64: A_b = (I + strict_tril(beta_i
k_i . k_j exp(g_i - g_j)))^-1 diag(beta) per chunk (columns past the chunk's rows 0),
g_cum (chunk-padded), chunk_norm, and the l2-normalised qn / kn, on awkward cases: odd
lengths, varlen with one-token and chunk-edge sequences, strong / weak / in-kernel gates,
expanding keys, GVA, K in {32, 48, 64, 128, 256}, f16 and bf16, both grid orders, A
itself (a_beta=False, the contract), chunk sizes 32 and 16. Inputs are rounded to the
kernel's dtype first (the reference sees what the kernel sees); outputs are NaN-poisoned
by conftest, so a row never written fails.

Run: python3 -m pytest -q tests/test_chunk_kkt_gpu.py   (skips without a GPU)
"""
import numpy as np
import pytest

from linattn.dsl import Options
from linattn.dsl.recurrent import random_inputs
from linattn.ops import chunk, runtime
from linattn.ops.registry import get_spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 5e-3}
ARCH = "sm90"


def case(op, T, H, HV, K, dtype="bfloat16", opts=(), B=1, lens=None, gate_scale=1.0,
         key_scale=None, heads_fastest=True, a_beta=True, chunk_size=64):
    parts = [op, f"B{B}", f"T{T}" if lens is None else f"varlen{len(lens)}", f"H{H}",
             f"HV{HV}", f"K{K}", dtype[:4]] + list(opts)
    parts += [] if gate_scale == 1.0 else [f"g{gate_scale:g}"]
    parts += [] if key_scale is None else [f"k{key_scale:g}"]
    parts += [] if heads_fastest else ["chunks-fastest"]
    parts += [] if a_beta else ["A"]
    parts += [] if chunk_size == 64 else [f"c{chunk_size}"]
    return pytest.param(dict(op=op, B=B, T=T, H=H, HV=HV, K=K, dtype=dtype, opts=tuple(opts),
                             lens=lens, gate_scale=gate_scale, key_scale=key_scale,
                             heads_fastest=heads_fastest, a_beta=a_beta,
                             chunk_size=chunk_size), id="-".join(parts))


CASES = [
    # the DeltaNet rows' layout [2, T, 4, 64], an odd length, and the 16k row itself
    case("deltanet", 300, 4, 4, 64, B=2),
    case("deltanet", 16384, 4, 4, 64, B=2),
    case("deltanet", None, 2, 2, 128, "float16", ("l2norm_qk",), lens=[1, 63, 64, 65, 130, 7]),
    case("deltanet", 200, 2, 2, 64, key_scale=1.5),            # beta |k|^2 > 2 in places
    case("deltanet", 100, 2, 2, 32),
    case("deltanet", 70, 1, 1, 48, "float16"),
    case("deltanet", 256, 1, 1, 64, "float16", a_beta=False),    # the contract's A
    # gates: real, strong, weak, in kernel; GVA
    case("gdn", 130, 2, 4, 128, B=2),
    case("gdn", 200, 2, 2, 64, gate_scale=20.0),
    case("gdn", None, 2, 4, 128, lens=[1, 130, 64, 700, 3], gate_scale=1e-3),
    case("gdn", 300, 2, 8, 64, "float16",
         ("l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel")),
    case("gdn", None, 2, 8, 128, opts=("gate_in_kernel", "l2norm_qk"),
         lens=list(np.random.default_rng(7).integers(1, 150, 32))),
    case("gdn", 130, 1, 2, 256, opts=("l2norm_qk",)),
    case("gdn", 200, 2, 4, 128, heads_fastest=False),
    # chunk sizes the template takes beyond 64
    case("gdn", None, 2, 2, 64, opts=("l2norm_qk",), lens=[1, 31, 32, 33, 100],
         chunk_size=32),
    case("deltanet", 50, 2, 2, 64, "float16", chunk_size=16),
]


def _spec(p):
    spec = get_spec(p["op"])
    if p["chunk_size"] != spec.chunk_size:
        spec = spec.replace(chunk_size=p["chunk_size"], name=f"{spec.name}_c{p['chunk_size']}")
    return spec


def _params(p, options):
    """build() keywords as the plans pass them (codegen/arch/sm90/forward.py kkt_launch; the
    contract's a_beta=False as ops/chunk_bwd.py wy_params), so the compiles are shared."""
    params = dict(H=p["H"], HV=p["HV"], K=p["K"], dtype=p["dtype"],
                  g_dtype="float32", beta_dtype=p["dtype"], l2norm_qk=options.l2norm_qk,
                  beta_sigmoid=options.beta_sigmoid, allow_neg_eigval=options.allow_neg_eigval,
                  gate_in_kernel=options.gate_in_kernel, heads_fastest=p["heads_fastest"])
    return params if p["a_beta"] else dict(params, a_beta=False)


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Every case's kernel compiled in parallel processes first (TileLang's disk cache)."""
    jobs = []
    for c in CASES:
        p = c.values[0]
        options = Options(**{n: True for n in p["opts"]})
        jobs.append((_spec(p), "chunk_kkt_inverse", ARCH, _params(p, options)))
    errors = runtime.precompile(jobs)
    for e in errors:
        print("  compile error:", e)
    yield


def _inputs(p, spec, options, rng):
    B, T = p["B"], p["T"]
    cu = None
    if p["lens"] is not None:
        cu = np.concatenate([[0], np.cumsum(p["lens"])]).astype(np.int64)
        T = int(cu[-1])
    x = random_inputs(spec, options, B, T, p["H"], p["HV"], p["K"], 16, rng, cu_seqlens=cu,
                      initial_state=False)
    if x["g"] is not None and not options.gate_in_kernel:
        x["g"] = x["g"] * p["gate_scale"]
    if p["key_scale"] is not None:
        x["k"] = x["k"] * p["key_scale"]
    dev, dt = torch.device("cuda"), getattr(torch, p["dtype"])
    Ttot = B * T

    def t(a, d, *shape):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev, d).reshape(Ttot, *shape)
    HV, K = p["HV"], p["K"]
    f32 = torch.float32
    out = dict(q=t(x["q"], dt, p["H"], K), k=t(x["k"], dt, p["H"], K),
               beta=t(x["beta"], dt, HV),
               g=(t(x["g"], f32, HV) if spec.has_gate else torch.zeros(Ttot, HV, device=dev)),
               A_log=(torch.from_numpy(x["A_log"]).to(dev, f32) if options.gate_in_kernel
                      else torch.zeros(HV, device=dev)),
               dt_bias=(torch.from_numpy(x["dt_bias"]).to(dev, f32) if options.gate_in_kernel
                        else torch.zeros(HV, device=dev)))
    cu = cu if cu is not None else np.arange(B + 1) * T
    return out, cu, Ttot


def _reference(p, spec, options, x, bos, length):
    """fp64 A_b [NT, HV, C, C], g_cum [NT, C, HV], chunk_norm [NT, HV], qn, kn."""
    C, HV, H, K = spec.chunk_size, p["HV"], p["H"], p["K"]
    f64 = torch.float64
    dev = x["k"].device
    q, k, beta, g = (x[n].to(f64) for n in ("q", "k", "beta", "g"))
    if options.l2norm_qk:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if options.beta_sigmoid:
        beta = torch.sigmoid(beta) * (2.0 if options.allow_neg_eigval else 1.0)
    if spec.has_gate and options.gate_in_kernel:
        xg = g + x["dt_bias"].to(f64)
        sp = torch.where(xg > 20, xg, torch.log1p(torch.exp(torch.clamp(xg, max=20.0))))
        g = -torch.exp(x["A_log"].to(f64)) * sp
    if not spec.has_gate:
        g = torch.zeros_like(g)
    bos_t = torch.from_numpy(bos.astype(np.int64)).to(dev)
    len_t = torch.from_numpy(length.astype(np.int64)).to(dev)
    i = torch.arange(C, device=dev)
    valid = i[None, :] < len_t[:, None]                                  # [NT, C]
    idx = bos_t[:, None] + torch.minimum(i[None, :], len_t[:, None] - 1)
    kc = k[idx].repeat_interleave(HV // H, dim=2)                        # [NT, C, HV, K]
    kc = torch.where(valid[..., None, None], kc, torch.zeros_like(kc))
    bc = torch.where(valid[..., None], beta[idx], torch.zeros_like(beta[idx]))   # [NT, C, HV]
    gc = torch.cumsum(torch.where(valid[..., None], g[idx], torch.zeros_like(g[idx])), dim=1)
    kk = torch.einsum("nihk,njhk->nhij", kc, kc)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1)
    gam = gc.permute(0, 2, 1)                                            # [NT, HV, C]
    zero = torch.zeros((), dtype=f64, device=dev)
    diff = torch.where(strict, gam[..., :, None] - gam[..., None, :], zero)
    L = torch.where(strict, bc.permute(0, 2, 1)[..., :, None] * kk * torch.exp(diff), zero)
    X = torch.linalg.inv(torch.eye(C, dtype=f64, device=dev) + L)
    A = X * bc.permute(0, 2, 1)[..., None, :] if p["a_beta"] else X
    nrm2 = (kc * kc).sum(-1)                                             # [NT, C, HV]
    logs = torch.log(torch.clamp(bc * nrm2 - 1, min=1.0))
    norm = gc[:, -1, :] + logs.sum(1)
    return A, gc, norm, q, k


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("p", CASES)
def test_kkt_matches_fp64(p, rng):
    spec = _spec(p)
    options = Options(**{n: True for n in p["opts"]})
    x, cu, Ttot = _inputs(p, spec, options, rng)
    C, HV, H, K = spec.chunk_size, p["HV"], p["H"], p["K"]
    bos, length, _ = chunk.build_chunk_tables(cu, C)
    NT = len(bos)
    dev = x["k"].device
    dt = getattr(torch, p["dtype"])
    x.update(chunk_bos=torch.from_numpy(bos).to(dev), chunk_len=torch.from_numpy(length).to(dev),
             g_cum=(torch.empty(HV, NT * C, device=dev) if spec.has_gate
                    else torch.empty(Ttot, HV, device=dev)),
             qn=torch.empty(Ttot, H, K, device=dev, dtype=dt),
             kn=torch.empty(Ttot, H, K, device=dev, dtype=dt),
             A=torch.empty(Ttot, HV, C, device=dev, dtype=dt),
             chunk_norm=torch.empty(HV, NT, device=dev))
    before = {n: x[n].clone() for n in ("q", "k", "g", "beta")}
    runtime.launch_kernel(spec, ARCH, "chunk_kkt_inverse", _params(p, options), x)
    torch.cuda.synchronize()
    for n, v in before.items():
        assert torch.equal(v, x[n]), f"input {n} was modified"
    A_ref, gc, norm, qn_ref, kn_ref = _reference(p, spec, options, x, bos, length)
    assert torch.isfinite(x["A"]).all(), "A has rows never written (NaN) or not finite"
    # A's rows: the chunks tile the tokens in order (chunk c: rows bos[c] .. bos[c] + len[c])
    chunk_of = torch.from_numpy(np.repeat(np.arange(NT), length)).to(dev)
    bos_t = torch.from_numpy(bos.astype(np.int64)).to(dev)
    local = torch.arange(Ttot, device=dev) - bos_t[chunk_of]
    want = A_ref[chunk_of, :, local, :]                                  # [Ttot, HV, C]
    got = x["A"].double()
    errs = {"A": _rel(got, want)}
    sq = lambda a: torch.zeros(NT, device=dev, dtype=torch.float64).index_add_(  # noqa: E731
        0, chunk_of, (a * a).sum((1, 2)))
    per_chunk = (sq(got - want) / sq(want).clamp_min(1e-30)).sqrt()
    errs["A_worst_chunk"], worst = float(per_chunk.max()), int(per_chunk.argmax())
    # columns past each chunk's rows are exactly 0
    len_t = torch.from_numpy(length).to(dev)
    past = torch.arange(C, device=dev)[None, :] >= len_t[chunk_of][:, None]
    assert not got.masked_select(past[:, None, :].expand_as(got)).any(), "A columns past the rows"
    if spec.has_gate:
        g_want = gc.permute(2, 0, 1).reshape(HV, NT * C)
        errs["g_cum"] = _rel(x["g_cum"], g_want)
    scale = 1.0 + norm.abs()
    errs["chunk_norm"] = float(((x["chunk_norm"].double().T - norm).abs() / scale).max())
    if options.l2norm_qk:
        errs["qn"] = _rel(x["qn"], qn_ref)
        errs["kn"] = _rel(x["kn"], kn_ref)
    print(errs, "worst chunk", worst, "of", NT)
    tol = TOL[p["dtype"]]
    # (A's rounding to bf16 alone is ~5e-4 here, f16 ~7e-5; a wrong 16 x 16 block moves its
    # chunk by far more than tol)
    assert errs["A"] < tol / 2 and errs["A_worst_chunk"] < tol, errs
    assert errs.get("g_cum", 0) < 1e-5 and errs["chunk_norm"] < 1e-4, errs
    assert errs.get("qn", 0) < tol / 2 and errs.get("kn", 0) < tol / 2, errs
