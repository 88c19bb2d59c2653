"""GPU correctness of training through linattn.chunk_delta_rule (ops/autograd.py): the
chunked forward, then loss.backward() through the generated backward stages, against
torch autograd of the fp64 chunked reference (dsl.torch_reference, on the GPU) and, on
the small cases, dsl.chunked_bwd (the NumPy fp64 chunked backward).

Loss = sum(o * do) + sum(final_state * dht); gradients dq, dk, dv, dbeta, dh0 (and o,
final_state themselves); ||x - ref|| / ||ref|| < 1e-2 bf16, 5e-3 f16. Fresh random inputs
(q, k normal, l2-normalised unless the case normalises in kernel; beta = sigmoid).
Kernels are compiled first in parallel processes. JSON summary to
$OUT_DIR (else $OUT)/autograd_gpu.json when set.

Gated DeltaNet (the ``gdn`` tests): chunk_gated_delta_rule the same way, gradients of q,
k, v, g, beta, h0 (and A_log, dt_bias with the gate in the kernel: sums over tokens of
dg's terms, whose cancellation loosens them to 5x the limit), GVA, varlen, l2norm;
g = logsigmoid(x) / 8 (or raw x with use_gate_in_kernel). Only the selected tests'
kernels are precompiled.

KDA (the ``kda`` tests): chunk_kda the same way with the per-key gate g [B, T, HV, K]
(logsigmoid(x) / 8 per channel, or raw x with use_gate_in_kernel: A_log [HV], dt_bias
[HV * K]), also against dsl/delta_key_bwd.py (the kernels' algorithm) on the small cases.

Run: python3 -m pytest -q -m gpu tests/test_autograd_gpu.py   (skips without a GPU)
     python3 -m pytest -q -m gpu tests/test_autograd_gpu.py -k gdn   (Gated DeltaNet only)
     python3 -m pytest -q -m gpu tests/test_autograd_gpu.py -k kda   (KDA only)
"""
import time

import pytest

from conftest import GRAD_TOL, record_errors, rel_err, write_summary

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

F64 = torch.float64
SHORT = {"float16": "f16", "bfloat16": "bf16"}
RESULTS = []


def case(B, T, H, K, V, dtype, cu=None, h0=False, dht=False, l2norm=False, scale=None,
         name=None):
    p = dict(B=B, T=T, H=H, K=K, V=V, dtype=dtype, cu=cu, h0=h0, dht=dht, l2norm=l2norm,
             scale=scale)
    flags = "".join(f"-{n}" for n in ("h0", "dht", "l2norm") if p[n])
    return pytest.param(p, id=name or f"B{B}-T{T}-H{H}-K{K}-V{V}-{SHORT[dtype]}{flags}")


CASES = [
    case(2, 2048, 4, 64, 64, "bfloat16", name="train-2k-bf16"),
    case(1, 300, 2, 48, 100, "bfloat16", h0=True, dht=True, l2norm=True,
         name="K48-V100-padded-bf16-h0-dht-l2norm"),
    case(2, 2048, 4, 64, 64, "float16", h0=True, dht=True, name="train-2k-f16-h0-dht"),
    case(2, 2048, 4, 64, 64, "bfloat16", h0=True, dht=True, l2norm=True,
         name="train-2k-bf16-h0-dht-l2norm"),
    case(1, 4096, 4, 128, 128, "bfloat16", dht=True, name="train-4k-K128-bf16-dht"),
    case(2, 63, 4, 64, 64, "bfloat16", h0=True, dht=True),
    case(2, 65, 4, 64, 64, "float16", l2norm=True),
    case(1, 130, 2, 64, 128, "bfloat16", h0=True, scale=0.3),
    case(1, 130, 3, 128, 64, "float16", h0=True, dht=True, l2norm=True),
    case(2, 1, 2, 64, 64, "bfloat16", h0=True, dht=True),
    case(1, 1 + 129 + 1 + 64 + 300 + 1, 4, 64, 64, "bfloat16",
         cu=(0, 1, 130, 131, 195, 495, 496), h0=True, dht=True, name="varlen-1tok-bf16"),
    case(1, 1 + 2047 + 1 + 1000, 4, 64, 64, "float16", cu=(0, 1, 2048, 2049, 3049),
         h0=True, dht=True, l2norm=True, name="varlen-1tok-long-f16-l2norm"),
]
SMALL_CASES = [c for c in CASES if c.values[0]["B"] * c.values[0]["T"] <= 600]


def _n_seqs(p):
    return p["B"] if p["cu"] is None else len(p["cu"]) - 1


def _lens(p):
    return [p["T"]] * p["B"] if p["cu"] is None else [b - a for a, b in zip(p["cu"], p["cu"][1:])]


def _jobs(p):
    """(ops.chunk jobs, chunk_bwd train_params) one case runs: the training forward's plan
    (save_states: its per-chunk states for the backward), the backward's recompute and
    stages on the call's token-first tensors."""
    from linattn.dsl import Options
    from linattn.ops import autograd, chunk, chunk_bwd
    from linattn.ops.deltanet import SPEC
    N, dt, lens = _n_seqs(p), p["dtype"], _lens(p)
    K, V = autograd.kernel_dims(p["K"], p["V"])   # (smaller dims run padded)
    plan = chunk.forward_plan(SPEC, Options(l2norm_qk=p["l2norm"]), H=p["H"], HV=p["H"],
                              K=K, V=V, dtype=dt, beta_dtype=dt,
                              seq_chunks=tuple(-(-n // 64) for n in lens),
                              Ttot=p["B"] * p["T"], has_initial_state=p["h0"],
                              output_final_state=True, save_states=True)
    jobs = [(SPEC, s, pr) for s, pr in chunk.plan_params(plan).items()]
    return jobs, chunk_bwd.train_params(H=p["H"], HV=p["H"], K=K, V=V, dtype=dt,
                                        chains=N * p["H"], l2norm=p["l2norm"], use_dht=True,
                                        store_dh0=p["h0"])


def _family(name):
    return "gdn" if "gdn" in name else "kda" if "kda" in name else "deltanet"


def precompile_jobs(items, device="cuda"):
    """The (spec, stage, arch, params) jobs of every case of each family ("deltanet",
    "gdn", "kda": by the test's name) with a selected test among ``items`` (this
    module's), from the plans (no tensors: ``device`` unused)."""
    from linattn.ops import chunk, chunk_bwd
    from linattn.ops.gdn import SPEC as GDN
    from linattn.ops.kda import SPEC as KDA
    families = {_family(item.name) for item in items}
    fwd, bwd, gated, keyed = [], [], [], []
    if "deltanet" in families:
        for c in CASES:
            jobs, params = _jobs(c.values[0])
            fwd += jobs
            bwd.append(params)
    if "gdn" in families:
        for c in GDN_CASES:
            jobs, params = _gdn_jobs(c.values[0])
            fwd += jobs
            gated.append(params)
    if "kda" in families:
        for c in KDA_CASES:
            jobs, params = _kda_jobs(c.values[0])
            fwd += jobs
            keyed += params
    return (chunk.stage_jobs(fwd) + chunk_bwd.stage_jobs(bwd)
            + chunk_bwd.stage_jobs(gated, spec=GDN) + chunk_bwd.stage_jobs(keyed, spec=KDA))


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    from _cpu_plan import module_items
    from linattn.ops import runtime
    t0 = time.time()
    errors = runtime.precompile(precompile_jobs(module_items(request)))
    print(f"precompiled in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  compile error:", e)
    yield
    write_summary("autograd_gpu", {"compile_errors": errors, "results": RESULTS})


def _inputs(p, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, K, V = (p[n] for n in ("B", "T", "H", "K", "V"))
    N, dt = _n_seqs(p), getattr(torch, p["dtype"])
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=F64)  # noqa: E731
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not p["l2norm"]:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    xs = [q.to(dt), k.to(dt), rnd(B, T, H, V).to(dt), torch.sigmoid(rnd(B, T, H)).to(dt),
          rnd(N, H, K, V).float() if p["h0"] else None]
    return xs, rnd(B, T, H, V).to(dt), rnd(N, H, K, V).float()


def _ours(p, xs, do, dht):
    """o, final_state and the gradients of the leaves (None for a missing h0)."""
    import linattn
    leaves = [None if x is None else x.clone().requires_grad_() for x in xs]
    cu = None if p["cu"] is None else torch.tensor(p["cu"], dtype=torch.int32, device="cuda")
    cu_cpu = None if p["cu"] is None else torch.tensor(p["cu"], dtype=torch.int32)
    o, ht = linattn.chunk_delta_rule(*leaves[:4], scale=p["scale"], initial_state=leaves[4],
                                     output_final_state=True,
                                     use_qk_l2norm_in_kernel=p["l2norm"], cu_seqlens=cu,
                                     cu_seqlens_cpu=cu_cpu)
    loss = (o.float() * do.float()).sum() + ((ht * dht).sum() if p["dht"] else 0)
    loss.backward()
    torch.cuda.synchronize()
    return o.detach(), ht.detach(), [None if x is None else x.grad for x in leaves]


def _torch_reference(p, xs, do, dht):
    from linattn.dsl import Options
    from linattn.dsl import torch_reference as tref
    from linattn.ops.deltanet import SPEC
    refs = [None if x is None else x.to(F64).requires_grad_() for x in xs]
    cu = None if p["cu"] is None else torch.tensor(p["cu"], device="cuda")
    o, ht = tref.chunked_forward(SPEC, *refs[:3], beta=refs[3],
                                 options=Options(l2norm_qk=p["l2norm"]), scale=p["scale"],
                                 initial_state=refs[4], cu_seqlens=cu)
    loss = (o * do.to(F64)).sum() + ((ht * dht.to(F64)).sum() if p["dht"] else 0)
    loss.backward()
    return o.detach(), ht.detach(), [None if x is None else x.grad for x in refs]


NAMES = ("dq", "dk", "dv", "dbeta", "dh0")


def _grad_errors(grads, ref_grads, xs):
    errs = {}
    for name, g, r, x in zip(NAMES, grads, ref_grads, xs):
        if x is None:
            continue
        assert g is not None and g.shape == x.shape and g.dtype == x.dtype, name
        errs[name] = rel_err(g, r)
    return errs


def _check(p, rng, **extra):
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(p, seed)
    saved = [None if x is None else x.clone() for x in xs]
    o, ht, grads = _ours(p, xs, do, dht)
    assert all(x is None or torch.equal(x, s) for x, s in zip(xs, saved)), "inputs modified"
    ro, rht, rgrads = _torch_reference(p, xs, do, dht)
    errs = dict(o=rel_err(o, ro), ht=rel_err(ht, rht), **_grad_errors(grads, rgrads, xs))
    record_errors(RESULTS, "autograd", p, errs, seed, **extra)
    return xs, do, dht, grads


@pytest.mark.parametrize("p", CASES)
def test_gradients_vs_torch_fp64(p, rng):
    _check(p, rng)


@pytest.mark.parametrize("p", SMALL_CASES)
def test_gradients_vs_chunked_bwd(p, rng):
    """The same run against the NumPy fp64 chunked backward (the kernels' algorithm)."""
    from linattn.dsl import Options
    from linattn.dsl.chunked_bwd import chunked_backward
    from linattn.ops.deltanet import SPEC
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(p, seed)
    _, _, grads = _ours(p, xs, do, dht)
    npy = lambda x: None if x is None else x.detach().to(F64).cpu().numpy()  # noqa: E731
    ref = chunked_backward(SPEC, *map(npy, xs[:3]), beta=npy(xs[3]), do=npy(do),
                           dht=npy(dht) if p["dht"] else None,
                           options=Options(l2norm_qk=p["l2norm"]), scale=p["scale"],
                           initial_state=npy(xs[4]),
                           cu_seqlens=None if p["cu"] is None else list(p["cu"]))
    rgrads = [None if ref[n] is None else torch.from_numpy(ref[n]).cuda() for n in NAMES]
    record_errors(RESULTS, "vs_chunked_bwd", p, _grad_errors(grads, rgrads, xs), seed)


# -- Gated DeltaNet ---------------------------------------------------------------------------

def gdn_case(B, T, H, HV, K, V, dtype, cu=None, h0=False, dht=False, l2norm=False, gik=False,
             name=None):
    p = dict(family="gdn", B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, cu=cu, h0=h0,
             dht=dht, l2norm=l2norm, gik=gik)
    flags = "".join(f"-{n}" for n in ("h0", "dht", "l2norm", "gik") if p[n])
    return pytest.param(p, id=name or f"gdn-B{B}-T{T}-H{H}-HV{HV}-K{K}-V{V}-{SHORT[dtype]}"
                                      f"{flags}")


GDN_CASES = [
    gdn_case(1, 300, 2, 4, 100, 60, "bfloat16", cu=(0, 77, 300), h0=True, dht=True, l2norm=True,
             gik=True, name="gdn-K100-V60-padded-varlen-GVA2-bf16-h0-dht-l2norm-gik"),
    gdn_case(2, 2048, 4, 4, 128, 128, "bfloat16", dht=True, name="gdn-train-2k-K128-bf16-dht"),
    gdn_case(2, 2048, 2, 4, 64, 64, "float16", h0=True, dht=True, l2norm=True,
             name="gdn-train-2k-GVA2-f16-h0-dht-l2norm"),
    gdn_case(1, 1000, 4, 8, 128, 128, "bfloat16", h0=True, dht=True, l2norm=True, gik=True,
             name="gdn-T1000-GVA2-K128-bf16-h0-dht-l2norm-gik"),
    gdn_case(2, 63, 4, 4, 64, 64, "bfloat16", h0=True, dht=True),
    gdn_case(2, 65, 2, 4, 64, 64, "float16", l2norm=True),
    gdn_case(1, 130, 2, 2, 64, 128, "bfloat16", h0=True, gik=True),
    gdn_case(1, 130, 1, 3, 128, 64, "float16", h0=True, dht=True, l2norm=True),
    gdn_case(2, 1, 2, 2, 64, 64, "bfloat16", h0=True, dht=True),
    gdn_case(1, 1 + 129 + 1 + 64 + 300 + 1, 2, 4, 64, 64, "bfloat16",
             cu=(0, 1, 130, 131, 195, 495, 496), h0=True, dht=True, l2norm=True, gik=True,
             name="gdn-varlen-1tok-GVA2-bf16-h0-dht-l2norm-gik"),
    gdn_case(1, 1 + 2047 + 1 + 1000, 4, 4, 128, 128, "float16", cu=(0, 1, 2048, 2049, 3049),
             h0=True, dht=True, name="gdn-varlen-long-K128-f16-h0-dht"),
]
GDN_SMALL_CASES = [c for c in GDN_CASES if c.values[0]["B"] * c.values[0]["T"] <= 600]


def _gdn_jobs(p):
    """(forward and recompute jobs, backward stage_params) of one GDN case, as _jobs (best
    effort: a kernel missed here compiles on its first call)."""
    from linattn.dsl import Options
    from linattn.ops import autograd, chunk, chunk_bwd
    from linattn.ops.gdn import SPEC
    N, dt, lens = _n_seqs(p), p["dtype"], _lens(p)
    K, V = autograd.kernel_dims(p["K"], p["V"])   # (smaller dims run padded)
    opts = Options(l2norm_qk=p["l2norm"], gate_in_kernel=p["gik"])
    plan = chunk.forward_plan(SPEC, opts, H=p["H"], HV=p["HV"], K=K, V=V,
                              dtype=dt, beta_dtype=dt, seq_chunks=tuple(-(-n // 64) for n in lens),
                              Ttot=p["B"] * p["T"], has_initial_state=p["h0"],
                              output_final_state=True, save_states=True)
    jobs = [(SPEC, s, pr) for s, pr in chunk.plan_params(plan).items()]
    return jobs, chunk_bwd.train_params(H=p["H"], HV=p["HV"], K=K, V=V, dtype=dt,
                                        chains=N * p["HV"], l2norm=p["l2norm"],
                                        use_dht=p["dht"], store_dh0=p["h0"],
                                        spec=SPEC)


def _gdn_inputs(p, seed):
    """GDN's inputs; KDA's (p["family"] == "kda") with the gate per key channel."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = (p[n] for n in ("B", "T", "H", "HV", "K", "V"))
    N, dt = _n_seqs(p), getattr(torch, p["dtype"])
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=F64)  # noqa: E731
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not p["l2norm"]:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    xs = dict(q=q.to(dt), k=k.to(dt), v=rnd(B, T, HV, V).to(dt),
              beta=torch.sigmoid(rnd(B, T, HV)).to(dt))
    gk = (K,) if p["family"] == "kda" else ()
    if p["gik"]:
        xs.update(g=rnd(B, T, HV, *gk).float(),
                  A_log=torch.log(torch.rand(HV, generator=g, device="cuda") * 4 + 0.5),
                  dt_bias=(rnd(HV * (K if gk else 1)) * 0.5).float())
    else:
        xs["g"] = (torch.nn.functional.logsigmoid(rnd(B, T, HV, *gk)) / 8).float()
    if p["h0"]:
        xs["initial_state"] = rnd(N, HV, K, V).float()
    return xs, rnd(B, T, HV, V).to(dt), rnd(N, HV, K, V).float()


def _gdn_run(p, xs, do, dht, fn, **kw):
    """o, final_state and each leaf's gradient of fn(**leaves, ...) under the loss."""
    leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
    o, ht = fn(**leaves, output_final_state=True, **kw)
    loss = (o * do.to(o.dtype)).sum() + ((ht * dht.to(ht.dtype)).sum() if p["dht"] else 0)
    loss.backward()
    torch.cuda.synchronize()
    return o.detach(), ht.detach(), {n: x.grad for n, x in leaves.items()}


def _gdn_ours(p, xs, do, dht):
    import linattn
    cu = None if p["cu"] is None else torch.tensor(p["cu"], dtype=torch.int32)
    return _gdn_run(p, xs, do, dht, linattn.chunk_gated_delta_rule,
                    use_qk_l2norm_in_kernel=p["l2norm"], use_gate_in_kernel=p["gik"],
                    cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu)


def _gdn_reference(p, xs, do, dht):
    from linattn.dsl import Options
    from linattn.dsl import torch_reference as tref
    from linattn.ops.gdn import SPEC
    cu = None if p["cu"] is None else torch.tensor(p["cu"], device="cuda")
    return _gdn_run(p, {n: x.to(F64) for n, x in xs.items()}, do, dht,
                    lambda output_final_state, **a: tref.chunked_forward(SPEC, **a),
                    options=Options(l2norm_qk=p["l2norm"], gate_in_kernel=p["gik"]),
                    cu_seqlens=cu)


#: gradients that are sums over tokens (cancelling terms): 5x the limit
GDN_SUMS = ("A_log", "dt_bias")


def _gdn_record(test, p, grads, rgrads, xs, seed, extra_errs=None, **extra):
    errs = dict(extra_errs or {})
    for n, x in xs.items():
        assert grads[n] is not None and grads[n].shape == x.shape and \
            grads[n].dtype == x.dtype, n
        errs["d" + n] = rel_err(grads[n], rgrads[n])
    sums = {n: errs.pop("d" + n) for n in GDN_SUMS if "d" + n in errs}
    record_errors(RESULTS, test, p, errs, seed, **extra)
    tol = 5 * GRAD_TOL[p["dtype"]]
    RESULTS.append(dict(test=test + "_sums", **p, seed=seed, tol=tol, errors=sums,
                        passed=all(e < tol for e in sums.values())))
    assert all(e < tol for e in sums.values()), f"{test}: sums over {tol}: {sums}"


def _gdn_check(p, rng, **extra):
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _gdn_inputs(p, seed)
    saved = {n: x.clone() for n, x in xs.items()}
    o, ht, grads = _gdn_ours(p, xs, do, dht)
    assert all(torch.equal(xs[n], saved[n]) for n in xs), "inputs modified"
    ro, rht, rgrads = _gdn_reference(p, xs, do, dht)
    _gdn_record("gdn_autograd", p, grads, rgrads, xs, seed,
                dict(o=rel_err(o, ro), ht=rel_err(ht, rht)), **extra)


@pytest.mark.parametrize("p", GDN_CASES)
def test_gdn_gradients_vs_torch_fp64(p, rng):
    _gdn_check(p, rng)


@pytest.mark.parametrize("p", GDN_SMALL_CASES)
def test_gdn_gradients_vs_chunked_bwd(p, rng):
    """The same run against the NumPy fp64 chunked backward (the kernels' algorithm)."""
    from linattn.dsl import Options
    from linattn.dsl.chunked_bwd import chunked_backward
    from linattn.ops.gdn import SPEC
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _gdn_inputs(p, seed)
    _, _, grads = _gdn_ours(p, xs, do, dht)
    npy = lambda x: x.detach().to(F64).cpu().numpy()  # noqa: E731
    ref = chunked_backward(SPEC, **{n: npy(x) for n, x in xs.items()}, do=npy(do),
                           dht=npy(dht) if p["dht"] else None,
                           options=Options(l2norm_qk=p["l2norm"], gate_in_kernel=p["gik"]),
                           cu_seqlens=None if p["cu"] is None else list(p["cu"]))
    names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0",
                 A_log="dA_log", dt_bias="ddt_bias")
    rgrads = {n: torch.from_numpy(ref[names[n]]).cuda() for n in xs}
    _gdn_record("gdn_vs_chunked_bwd", p, grads, rgrads, xs, seed)


# -- KDA (the per-key gate) ------------------------------------------------------------------

def kda_case(B, T, H, HV, K, V, dtype, cu=None, h0=False, dht=False, l2norm=False, gik=False,
             name=None):
    p = dict(family="kda", B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, cu=cu, h0=h0,
             dht=dht, l2norm=l2norm, gik=gik)
    flags = "".join(f"-{n}" for n in ("h0", "dht", "l2norm", "gik") if p[n])
    return pytest.param(p, id=name or f"kda-B{B}-T{T}-H{H}-HV{HV}-K{K}-V{V}-{SHORT[dtype]}"
                                      f"{flags}")


KDA_CASES = [
    kda_case(1, 300, 2, 4, 80, 48, "bfloat16", cu=(0, 77, 300), h0=True, dht=True, l2norm=True,
             gik=True, name="kda-K80-V48-padded-varlen-GVA2-bf16-h0-dht-l2norm-gik"),
    kda_case(2, 2048, 4, 4, 128, 128, "bfloat16", dht=True, name="kda-train-2k-K128-bf16-dht"),
    kda_case(2, 2048, 2, 4, 64, 64, "float16", h0=True, dht=True, l2norm=True,
             name="kda-train-2k-GVA2-f16-h0-dht-l2norm"),
    kda_case(1, 1000, 4, 8, 128, 128, "bfloat16", h0=True, dht=True, l2norm=True, gik=True,
             name="kda-T1000-GVA2-K128-bf16-h0-dht-l2norm-gik"),
    kda_case(2, 63, 4, 4, 64, 64, "bfloat16", h0=True, dht=True),
    kda_case(2, 65, 2, 4, 64, 64, "float16", l2norm=True),
    kda_case(1, 130, 2, 2, 64, 128, "bfloat16", h0=True, gik=True),
    kda_case(1, 130, 1, 3, 128, 64, "float16", h0=True, dht=True, l2norm=True),
    kda_case(1, 200, 2, 2, 128, 128, "float16", h0=True, dht=True, gik=True),
    kda_case(2, 1, 2, 2, 64, 64, "bfloat16", h0=True, dht=True),
    kda_case(1, 1 + 129 + 1 + 64 + 300 + 1, 2, 4, 64, 64, "bfloat16",
             cu=(0, 1, 130, 131, 195, 495, 496), h0=True, dht=True, l2norm=True, gik=True,
             name="kda-varlen-1tok-GVA2-bf16-h0-dht-l2norm-gik"),
    kda_case(1, 1 + 2047 + 1 + 1000, 4, 4, 128, 128, "float16", cu=(0, 1, 2048, 2049, 3049),
             h0=True, dht=True, name="kda-varlen-long-K128-f16-h0-dht"),
]
KDA_SMALL_CASES = [c for c in KDA_CASES if c.values[0]["B"] * c.values[0]["T"] <= 600]


def _kda_jobs(p):
    """(forward jobs, [backward param dicts]) of one KDA case: the training forward's
    plan (save_states) and the token-first backward's kernels (key_train_params)."""
    from linattn.dsl import Options
    from linattn.ops import autograd, chunk, chunk_bwd
    from linattn.ops.kda import SPEC
    N, dt, lens = _n_seqs(p), p["dtype"], _lens(p)
    K, V = autograd.kernel_dims(p["K"], p["V"])   # (smaller dims run padded)
    opts = Options(l2norm_qk=p["l2norm"], gate_in_kernel=p["gik"])
    plan = chunk.forward_plan(SPEC, opts, H=p["H"], HV=p["HV"], K=K, V=V,
                              dtype=dt, beta_dtype=dt, seq_chunks=tuple(-(-n // 64) for n in lens),
                              Ttot=p["B"] * p["T"], has_initial_state=p["h0"],
                              output_final_state=True, save_states=True)
    jobs = [(SPEC, s, pr) for s, pr in chunk.plan_params(plan).items()]
    return jobs, [chunk_bwd.key_train_params(H=p["H"], HV=p["HV"], K=K, V=V,
                                             dtype=dt, chains=N * p["HV"], l2norm=p["l2norm"],
                                             use_dht=p["dht"], store_dh0=p["h0"], spec=SPEC)]


def _kda_ours(p, xs, do, dht):
    import linattn
    cu = None if p["cu"] is None else torch.tensor(p["cu"], dtype=torch.int32)
    return _gdn_run(p, xs, do, dht, linattn.chunk_kda,
                    use_qk_l2norm_in_kernel=p["l2norm"], use_gate_in_kernel=p["gik"],
                    cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu)


def _kda_reference(p, xs, do, dht):
    from linattn.dsl import Options
    from linattn.dsl import torch_reference as tref
    from linattn.ops.kda import SPEC
    cu = None if p["cu"] is None else torch.tensor(p["cu"], device="cuda")
    return _gdn_run(p, {n: x.to(F64) for n, x in xs.items()}, do, dht,
                    lambda output_final_state, **a: tref.chunked_forward(SPEC, **a),
                    options=Options(l2norm_qk=p["l2norm"], gate_in_kernel=p["gik"]),
                    cu_seqlens=cu)


@pytest.mark.parametrize("p", KDA_CASES)
def test_kda_gradients_vs_torch_fp64(p, rng):
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _gdn_inputs(p, seed)
    saved = {n: x.clone() for n, x in xs.items()}
    o, ht, grads = _kda_ours(p, xs, do, dht)
    assert all(torch.equal(xs[n], saved[n]) for n in xs), "inputs modified"
    ro, rht, rgrads = _kda_reference(p, xs, do, dht)
    _gdn_record("kda_autograd", p, grads, rgrads, xs, seed,
                dict(o=rel_err(o, ro), ht=rel_err(ht, rht)))


@pytest.mark.parametrize("p", KDA_SMALL_CASES)
def test_kda_gradients_vs_delta_key_bwd(p, rng):
    """The same run against dsl/delta_key_bwd.py (the kernels' algorithm, fp64)."""
    from linattn.dsl import Options
    from linattn.dsl.delta_key_bwd import delta_key_backward
    from linattn.ops.kda import SPEC
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _gdn_inputs(p, seed)
    _, _, grads = _kda_ours(p, xs, do, dht)
    npy = lambda x: x.detach().to(F64).cpu().numpy()  # noqa: E731
    ref = delta_key_backward(SPEC, **{n: npy(x) for n, x in xs.items()}, do=npy(do),
                             dht=npy(dht) if p["dht"] else None,
                             options=Options(l2norm_qk=p["l2norm"], gate_in_kernel=p["gik"]),
                             cu_seqlens=None if p["cu"] is None else list(p["cu"]))
    names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0",
                 A_log="dA_log", dt_bias="ddt_bias")
    rgrads = {n: torch.from_numpy(ref[names[n]]).cuda() for n in xs}
    _gdn_record("kda_vs_delta_key_bwd", p, grads, rgrads, xs, seed)
