"""GPU correctness of the additive rule's chunked backward (ops/additive_bwd.py) against
the fp64 torch reference (dsl.torch_reference, autograd, on the GPU).

  test_contract   GLAChunkBwd (contracts.gla_chunk_bwd) on the 8 rows of the benchmark
                  table ([2, T, 4, 64], T = 2k .. 16k, f16 / bf16, scale 1/8, h from the
                  fp64 forward from h0 = 0.1 N(0, 1), dht) and awkward shapes (odd T,
                  K = V = 128, K != V, dh0, no dht; K = 256 / V = 512 (GLA-1.3B's heads)
                  and K = 192: key blocks): dq, dk, dv, dg (and dh0), f32
  test_training   loss.backward() through chunk_gla / chunk_simple_gla (g, g_gamma) /
                  chunk_linear_attn (normalize on and off): varlen with empty and
                  one-token sequences, h0, dht, state_v_first, K = V = 128, K = 256 /
                  V = 512 and K = 144 (key blocks), f16 / bf16; every input's gradient;
                  the value gate (chunk_gla(gv=...), linattn.build(value_gate_spec())
                  with GVA) through its key-gated twin (dsl.spec.key_twin)

The plan picks the state gradient's reverse pass by the call's chains x tiles: the
K = 256 / V = 512 cases run the walk (chunk_bwd_dstate_gate + chunk_bwd_dstate_walk: the
gated, scalar-gated and ungated specs, varlen, h0, v-first), the others local + scan.

Inputs as the benchmark's: q, k, v, do ~ N(0, 1) (q, k through elu + 1 with normalize, so
the normaliser q.z stays away from 0), g = logsigmoid(N(2, 1)) (per key channel or per
head), states 0.1 N(0, 1). ||x - ref|| / ||ref|| < 1e-2 bf16, 5e-3 f16; NaN never
passes (outputs NaN-poisoned by conftest); inputs must come back unchanged. Every kernel
is compiled first, in parallel processes, in rounds (a round runs every case until its
first kernel not yet compiled: forward, then the backward's recompute, then its stages).
JSON summary to $OUT_DIR (else $OUT)/additive_bwd_gpu.json.

Run: python3 -m pytest -q -m gpu tests/test_additive_bwd_gpu.py   (about 150 s with
compiles on a 16-core host; -k contract: the GLAChunkBwd cases only; -k "K256 or K192
or K144": the key-block cases)
"""
import time

import pytest

from conftest import (assert_token_sum_of, record_errors, rel_err, token_sum_err,
                      write_summary)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

F64 = torch.float64
SHORT = {"float16": "f16", "bfloat16": "bf16"}
RESULTS = []


def ccase(B, T, H, K, V, dtype, h0=False, dht=True, name=None):
    p = dict(B=B, T=T, H=H, K=K, V=V, dtype=dtype, h0=h0, dht=dht)
    flags = "".join(f"-{n}" for n in ("h0", "dht") if p[n])
    return pytest.param(p, id=name or f"B{B}-T{T}-H{H}-K{K}-V{V}-{SHORT[dtype]}{flags}")


CONTRACT = [ccase(2, L, 4, 64, 64, dt, name=f"train-{L // 1024}k-{SHORT[dt]}")
            for L in (2048, 4096, 8192, 16384) for dt in ("float16", "bfloat16")]
CONTRACT += [
    ccase(1, 63, 3, 64, 64, "bfloat16", h0=True, dht=False),
    ccase(2, 130, 4, 64, 64, "bfloat16", h0=True),
    ccase(3, 1000, 2, 128, 128, "float16", h0=True),
    ccase(1, 200, 2, 64, 128, "bfloat16"),
    # above K = 128 (key blocks): GLA-1.3B's heads (4 x K = 256, V = 512), K = 192 (3 x 64)
    ccase(2, 2048, 4, 256, 512, "bfloat16", name="gla13b-K256-V512-2k-bf16"),
    ccase(1, 1000, 4, 256, 512, "float16", h0=True, name="K256-V512-T1000-f16-h0"),
    ccase(1, 300, 2, 192, 320, "bfloat16", h0=True, dht=False, name="K192-V320-bf16-h0"),
]


def tcase(fn, B, T, H, K, V, dtype, lens=None, h0=True, dht=True, v_first=False,
          normalize=None, gamma=False, name=None, HV=None):
    p = dict(fn=fn, B=B, T=T, H=H, K=K, V=V, dtype=dtype, lens=lens, h0=h0, dht=dht,
             v_first=v_first, normalize=normalize, gamma=gamma, HV=HV or H)
    return pytest.param(p, id=name)


TRAINING = [
    tcase("gla", 1, 758, 4, 64, 64, "bfloat16", lens=[1, 63, 64, 500, 0, 130],
          name="gla-varlen-bf16"),
    tcase("gla", 2, 2048, 4, 64, 64, "float16", name="gla-train-2k-f16"),
    tcase("gla", 2, 300, 2, 128, 128, "bfloat16", v_first=True, name="gla-K128-v-first-bf16"),
    tcase("simple_gla", 2, 257, 4, 64, 64, "bfloat16", name="sgla-bf16"),
    tcase("simple_gla", 1, 400, 4, 64, 64, "bfloat16", lens=[1, 200, 0, 199], gamma=True,
          h0=False, name="sgla-varlen-gamma-bf16"),
    tcase("linear_attn", 2, 200, 4, 64, 64, "bfloat16", normalize=False, name="la-bf16"),
    tcase("linear_attn", 1, 129, 4, 64, 64, "float16", normalize=True, h0=False, dht=False,
          name="la-normalize-f16"),
    # above K = 128 (key blocks; the states recomputed): GLA-1.3B's heads, K = 144 (padded
    # to 192: 3 x 64)
    tcase("gla", 2, 1024, 4, 256, 512, "bfloat16", name="gla13b-K256-V512-1k-bf16"),
    tcase("gla", 1, 700, 4, 256, 512, "float16", lens=[1, 300, 0, 399], v_first=True,
          name="gla-K256-V512-varlen-v-first-f16"),
    tcase("simple_gla", 2, 300, 4, 256, 512, "bfloat16", gamma=True,
          name="sgla-K256-V512-gamma-bf16"),
    tcase("linear_attn", 1, 200, 4, 256, 512, "bfloat16", normalize=False,
          name="la-K256-V512-bf16"),
    tcase("gla", 1, 300, 2, 144, 96, "bfloat16", name="gla-K144-V96-bf16"),
    # the value gate: its twin runs at K' = V, V' = K
    tcase("gla_gv", 2, 63, 4, 64, 64, "bfloat16", name="gv-T63-bf16"),
    tcase("gla_gv", 2, 1000, 4, 128, 128, "bfloat16", name="gv-T1000-K128-bf16"),
    tcase("gla_gv", 1, 958, 4, 64, 128, "float16", lens=[1, 63, 64, 700, 0, 130],
          v_first=True, name="gv-varlen-v-first-f16"),
    tcase("gla_gv", 1, 1000, 2, 256, 96, "bfloat16", h0=False, name="gv-K256-V96-bf16"),
    tcase("additive_value", 1, 500, 2, 128, 64, "bfloat16", lens=[200, 1, 299],
          name="value-GVA2-varlen-bf16", HV=4),
]


# -- inputs -----------------------------------------------------------------------------------

def _randn(gen, *s):
    return torch.randn(*s, generator=gen, device="cuda", dtype=F64)


def _contract_inputs(p, seed):
    from linattn.dsl import torch_reference as tref
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, K, V = (p[n] for n in "BTHKV")
    dt = getattr(torch, p["dtype"])
    q, k = _randn(gen, B, T, H, K).to(dt), _randn(gen, B, T, H, K).to(dt)
    v, do = _randn(gen, B, T, H, V).to(dt), _randn(gen, B, T, H, V).to(dt)
    g = torch.nn.functional.logsigmoid(_randn(gen, B, T, H, K) + 2).to(dt)
    h0 = 0.1 * _randn(gen, B, H, K, V)
    _, _, h = tref.gla_chunk_fwd(q, k, v, g, scale=0.125, initial_state=h0)
    dht = (0.1 * _randn(gen, B, H, K, V)).float() if p["dht"] else None
    return q, k, v, g, h.float().contiguous(), do, dht, h0.float()


def _fn(p):
    import linattn
    from linattn.dsl import value_gate_spec
    from linattn.ops import gla, linear_attn, simple_gla
    if p["fn"] == "additive_value":
        return linattn.build(value_gate_spec()).chunk, value_gate_spec()
    return {"gla": (gla.chunk_gla, gla.SPEC), "simple_gla": (simple_gla.chunk_simple_gla,
                                                             simple_gla.SPEC),
            "gla_gv": (gla.chunk_gla, gla.SPEC_GV),
            "linear_attn": (linear_attn.chunk_linear_attn, linear_attn.SPEC)}[p["fn"]]


def _training_inputs(p, seed):
    """(keyword arguments of the call (leaves), do, dht or None)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = (p[n] for n in ("B", "T", "H", "HV", "K", "V"))
    dt = getattr(torch, p["dtype"])
    N = B if p["lens"] is None else len(p["lens"])
    q, k = _randn(gen, B, T, H, K), _randn(gen, B, T, H, K)
    if p["normalize"]:      # a positive feature map (elu + 1, as fla's models): q.z > 0
        q, k = (torch.nn.functional.elu(x) + 1 for x in (q, k))
    x = dict(q=q.to(dt), k=k.to(dt), v=_randn(gen, B, T, HV, V).to(dt))
    spec = _fn(p)[1]
    if spec.has_gate:
        x["g"] = torch.nn.functional.logsigmoid(
            _randn(gen, *spec.gate_shape(B, T, HV, K, V)) + 2).float()
    if p["gamma"]:
        x["g_gamma"] = -torch.rand(H, generator=gen, device="cuda", dtype=F64).float() * 0.1
    st = (N, HV, V, K) if p["v_first"] else (N, HV, K, V)
    if p["h0"]:
        x["initial_state"] = (0.1 * _randn(gen, *st)).float()
    dht = (0.1 * _randn(gen, *st)).float() if p["dht"] else None
    return x, _randn(gen, B, T, HV, V).to(dt), dht


def _call(p, x):
    """The family function on the leaves x: (o, final_state or None)."""
    fn = _fn(p)[0]
    kw = dict(x, output_final_state=p["dht"])
    if p["lens"] is not None:
        cu = torch.tensor([0] + list(torch.tensor(p["lens"]).cumsum(0).tolist()))
        kw.update(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    if p["v_first"]:
        kw["state_v_first"] = True
    if p["normalize"] is not None:
        kw["normalize"] = p["normalize"]
    if p["fn"] == "gla_gv":
        kw["gv"] = kw.pop("g")
    o, ht = fn(**kw)
    if isinstance(ht, tuple):           # linear attention with normalize: (kv, z)
        ht = ht[0]
    return o, ht


def _reference(p, x, do, dht):
    """fp64 autograd of the torch reference forward: (o, ht, {leaf: grad})."""
    from linattn.dsl import Options
    from linattn.dsl import torch_reference as tref
    from linattn.ops import linear_attn
    spec = _fn(p)[1]
    xs = {n: t.detach().to(F64).requires_grad_() for n, t in x.items()}
    g = xs.get("g")
    if "g_gamma" in xs:
        gam = xs["g_gamma"].view(1, 1, -1)
        g = gam.expand(p["B"], p["T"], p["H"]) if g is None else g + gam
    cu = None
    if p["lens"] is not None:
        cu = torch.tensor([0] + list(torch.tensor(p["lens"]).cumsum(0).tolist()))
    o, ht = tref.chunked_forward(spec, xs["q"], xs["k"], xs["v"], g,
                                 options=Options(state_v_first=p["v_first"]),
                                 initial_state=xs.get("initial_state"), cu_seqlens=cu)
    if p["normalize"]:
        o, _ = linear_attn.normalize_output(o, xs["q"], xs["k"], p["K"] ** -0.5,
                                            cu_seqlens=None if cu is None else cu.cuda())
    loss = (o * do.to(F64)).sum() + ((ht * dht.to(F64)).sum() if dht is not None else 0)
    loss.backward()
    return o.detach(), ht.detach(), {n: t.grad for n, t in xs.items()}


def _run_training(p, x, do, dht):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = _call(p, leaves)
    loss = (o.float() * do.float()).sum()
    if dht is not None:
        loss = loss + (ht * dht).sum()
    loss.backward()
    return o, ht, {n: t.grad for n, t in leaves.items()}


# -- compile everything first ----------------------------------------------------------------

def _dry_runs(selected):
    runs = []
    for c in selected:
        p = c.values[0]
        if "fn" in p:
            x, do, dht = _training_inputs(p, 0)
            runs.append(lambda p=p, x=x, do=do, dht=dht: _run_training(p, x, do, dht))
        else:       # (the kernels do not depend on T: a short call compiles them all)
            from linattn.ops.contracts import gla_chunk_bwd
            q, k, v, g, h, do, dht, h0 = _contract_inputs(dict(p, T=min(p["T"], 130)), 0)
            runs.append(lambda a=(q, k, v, g, h, do, dht), h0=h0, p=p: gla_chunk_bwd(
                *a, scale=0.125, initial_state=h0 if p["h0"] else None))
    return runs


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    from linattn.ops import runtime
    t0 = time.time()
    ids = {item.callspec.id for item in request.session.items
           if getattr(item, "module", None) is request.module and hasattr(item, "callspec")}
    selected = [c for c in CONTRACT + TRAINING if c.id in ids]
    runs, errors = _dry_runs(selected), []
    for _ in range(4):                  # forward; the backward's recompute; its stages
        with runtime.recording() as jobs:
            for run in runs:
                try:
                    run()
                except Exception:   # KernelRequested (noted), or an error the test reports
                    pass
        if not jobs:
            break
        errors += runtime.precompile(jobs)
    torch.cuda.synchronize()
    print(f"precompiled in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  compile error:", e)
    yield
    write_summary("additive_bwd_gpu", {"compile_errors": errors, "results": RESULTS})


def _seed(rng):
    return int(rng.integers(1, 2 ** 31))


@pytest.mark.parametrize("p", CONTRACT)
def test_contract(p, rng):
    from linattn.dsl import torch_reference as tref
    from linattn.ops.contracts import gla_chunk_bwd
    seed = _seed(rng)
    q, k, v, g, h, do, dht, h0 = _contract_inputs(p, seed)
    args = [q, k, v, g, h, do, dht]
    saved = [None if a is None else a.clone() for a in args]
    out = gla_chunk_bwd(*args, scale=0.125, initial_state=h0 if p["h0"] else None)
    torch.cuda.synchronize()
    assert all(a is None or torch.equal(a, b) for a, b in zip(args, saved)), "inputs modified"
    ref = tref.gla_chunk_bwd(q, k, v, g, h, do, dht if dht is not None else torch.zeros_like(h0),
                             scale=0.125)
    names = ("dq", "dk", "dv", "dg") + (("dh0",) if p["h0"] else ())
    assert len(out) == len(names)
    for name, x, like in zip(names, out, (q, k, v, g, h0)):
        assert x.shape == like.shape and x.dtype == torch.float32, name
    record_errors(RESULTS, "contract", p, {n: rel_err(x, r) for n, x, r in zip(names, out, ref)},
                  seed)


@pytest.mark.parametrize("p", TRAINING)
def test_training(p, rng):
    seed = _seed(rng)
    x, do, dht = _training_inputs(p, seed)
    saved = {n: t.clone() for n, t in x.items()}
    o, ht, grads = _run_training(p, x, do, dht)
    torch.cuda.synchronize()
    assert all(torch.equal(x[n], saved[n]) for n in x), "inputs modified"
    ro, rht, rgrads = _reference(p, x, do, dht)
    errs = {"o": rel_err(o, ro)}
    if dht is not None:
        errs["ht"] = rel_err(ht, rht)
    for n, gr in grads.items():
        assert gr is not None and gr.shape == x[n].shape and gr.dtype == x[n].dtype, n
        errs[f"d{n}"] = rel_err(gr, rgrads[n])
    if "g_gamma" in grads and "g" in grads:
        # g_gamma's gradient is the token sum of g's: terms that cancel (seeds 11, 33 put
        # it 1.0-1.2e-2 off its own small norm in bf16, dg 2.8e-3 off)
        errs["dg_gamma"] = token_sum_err(grads["g_gamma"], rgrads["g_gamma"], rgrads["g"])
        assert_token_sum_of(grads["g_gamma"], grads["g"], rgrads["g"], "g_gamma")
    record_errors(RESULTS, "training", {k: v for k, v in p.items() if k != "lens"}, errs, seed,
                  lens=p["lens"])
