"""GPU correctness of training through the generated backward of the generalized delta
rules: linattn.chunk_comba (the delta rule's stages with the erase key p) and
linattn.chunk_gdn2 (KDA's per-key stages with the erase vector b . k and the written value
w . v; ops/autograd.py), against torch autograd of the fp64 chunked reference
(dsl.torch_reference, on the GPU) and, where fla is installed, fla's chunk_comba /
chunk_gdn2 gradients on the same inputs.

Loss = sum(o * do) + sum(final_state * dht); gradients of every tensor input (Comba: q, k,
v, p, g, beta; GDN-2: q, k, v, g, b, w; h0) and of o, final_state themselves; ||x - ref|| /
||ref|| < 1e-2 bf16, 5e-3 f16 (conftest GRAD_TOL). q, k (, p) normal (l2-normalised unless
the case normalises in the kernel), g = logsigmoid(x) / 8 (per key channel for GDN-2),
beta, b, w = sigmoid(x). The call must take the kernels: the exact torch path
(ops/exact_train.py) raises here. Against fla: our error no more than max(the limit,
1.5 x fla's) on every gradient (H == HV, fla's heads). JSON summary to $OUT_DIR (else
$OUT)/rule_bwd_gpu.json when set. The kernels: precompile_jobs (bench/cpu_cache.py builds
them on a machine without a GPU).

Run: python3 -m pytest -q -m gpu tests/test_rule_bwd_gpu.py      (skips without a GPU)
"""

import pytest

from conftest import GRAD_TOL, record_errors, rel_err, write_summary

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

F64 = torch.float64
SHORT = {"float16": "f16", "bfloat16": "bf16"}
RESULTS = []


def case(B, T, H, HV, K, V, dtype, cu=None, h0=False, dht=False, l2norm=False, name=None):
    p = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, cu=cu, h0=h0, dht=dht,
             l2norm=l2norm)
    flags = "".join(f"-{n}" for n in ("h0", "dht", "l2norm") if p[n])
    return pytest.param(p, id=name or f"B{B}-T{T}-H{H}-HV{HV}-K{K}-V{V}-{SHORT[dtype]}{flags}")


CASES = [
    case(2, 2048, 4, 4, 128, 128, "bfloat16", dht=True, name="train-2k-K128-bf16-dht"),
    case(2, 2048, 2, 4, 64, 64, "float16", h0=True, dht=True, l2norm=True,
         name="train-2k-GVA2-f16-h0-dht-l2norm"),
    case(1, 300, 2, 4, 100, 60, "bfloat16", cu=(0, 77, 300), h0=True, dht=True, l2norm=True,
         name="K100-V60-padded-varlen-GVA2-bf16-h0-dht-l2norm"),
    case(2, 63, 4, 4, 64, 64, "bfloat16", h0=True, dht=True),
    case(2, 65, 2, 4, 64, 64, "float16", l2norm=True),
    case(1, 1 + 129 + 1 + 64 + 300 + 1, 2, 4, 64, 64, "bfloat16",
         cu=(0, 1, 130, 131, 195, 495, 496), h0=True, dht=True, l2norm=True,
         name="varlen-1tok-GVA2-bf16-h0-dht-l2norm"),
    case(1, 1 + 2047 + 1 + 1000, 4, 4, 128, 128, "float16", cu=(0, 1, 2048, 2049, 3049),
         h0=True, dht=True, name="varlen-long-K128-f16-h0-dht"),
]


#: family -> (its module under linattn.ops, the backward's train_params function name)
FAMILIES = {"comba": ("comba", "train_params"), "gdn2": ("gdn2", "key_train_params")}


def _spec(family):
    import importlib
    return importlib.import_module(f"linattn.ops.{FAMILIES[family][0]}").SPEC


def _jobs(family, p):
    """The (spec, stage, params) jobs of one case's training forward and backward (best
    effort: a kernel missed here compiles on its first call)."""
    from linattn.dsl import Options
    from linattn.ops import autograd, chunk, chunk_bwd
    SPEC = _spec(family)
    lens = [p["T"]] * p["B"] if p["cu"] is None else \
        [b - a for a, b in zip(p["cu"], p["cu"][1:])]
    K, V = autograd.kernel_dims(p["K"], p["V"])
    plan = chunk.forward_plan(SPEC, Options(l2norm_qk=p["l2norm"]), H=p["H"], HV=p["HV"],
                              K=K, V=V, dtype=p["dtype"], beta_dtype=p["dtype"],
                              seq_chunks=tuple(-(-n // 64) for n in lens),
                              Ttot=p["B"] * p["T"], has_initial_state=p["h0"],
                              output_final_state=True, save_states=True)
    bwd = getattr(chunk_bwd, FAMILIES[family][1])(
        H=p["H"], HV=p["HV"], K=K, V=V, dtype=p["dtype"], chains=len(lens) * p["HV"],
        l2norm=p["l2norm"], use_dht=p["dht"], store_dh0=p["h0"], spec=SPEC)
    return (chunk.stage_jobs([(SPEC, s, pr) for s, pr in chunk.plan_params(plan).items()])
            + chunk_bwd.stage_jobs([bwd], spec=SPEC))


def precompile_jobs(items=None, device="cuda"):
    """Every case's compile jobs (planned from shapes alone: ``device`` unused; items
    unused: every family and case)."""
    return [j for f in FAMILIES for c in CASES + FLA_CASES for j in _jobs(f, c.values[0])]


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Every case's kernels compiled in parallel processes first (TileLang's disk cache)."""
    import time
    from linattn.ops import runtime
    t0 = time.time()
    errors = runtime.precompile(precompile_jobs())
    print(f"precompiled in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  compile error:", e)
    yield
    write_summary("rule_bwd_gpu", {"compile_errors": errors, "results": RESULTS})


def _inputs(family, p, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = (p[n] for n in ("B", "T", "H", "HV", "K", "V"))
    N = B if p["cu"] is None else len(p["cu"]) - 1
    dt = getattr(torch, p["dtype"])
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=F64)  # noqa: E731
    names = "qkp" if family == "comba" else "qk"
    keys = [rnd(B, T, H, K) for _ in names]
    if not p["l2norm"]:
        keys = [torch.nn.functional.normalize(x, dim=-1) for x in keys]
    xs = dict(zip(names, (x.to(dt) for x in keys)), v=rnd(B, T, HV, V).to(dt))
    sig = torch.nn.functional.logsigmoid
    if family == "comba":
        xs.update(g=(sig(rnd(B, T, HV)) / 8).float(), beta=torch.sigmoid(rnd(B, T, HV)).to(dt))
    else:
        xs.update(g=(sig(rnd(B, T, HV, K)) / 8).float(),
                  b=torch.sigmoid(rnd(B, T, HV, K)).float(),
                  w=torch.sigmoid(rnd(B, T, HV, V)).float())
    if p["h0"]:
        xs["initial_state"] = rnd(N, HV, K, V).float()
    return xs, rnd(B, T, HV, V).to(dt), rnd(N, HV, K, V).float()


def _run(p, xs, do, dht, fn, **kw):
    """o, final_state and each leaf's gradient of fn(**leaves, ...) under the loss."""
    leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
    o, ht = fn(**leaves, output_final_state=True, **kw)
    loss = (o * do.to(o.dtype)).sum() + ((ht * dht.to(ht.dtype)).sum() if p["dht"] else 0)
    loss.backward()
    torch.cuda.synchronize()
    return o.detach(), ht.detach(), {n: x.grad for n, x in leaves.items()}


def _cu(p):
    cu = None if p["cu"] is None else torch.tensor(p["cu"], dtype=torch.int32)
    return dict(cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu)


def _ours(family, p, xs, do, dht, monkeypatch):
    import linattn
    from linattn.ops import exact_train

    def refuse(*a, **kw):
        raise AssertionError(f"chunk_{family} took the exact torch path, not the kernels")
    monkeypatch.setattr(exact_train, "train", refuse)
    return _run(p, xs, do, dht, getattr(linattn, f"chunk_{family}"),
                use_qk_l2norm_in_kernel=p["l2norm"], **_cu(p))


def _reference(family, p, xs, do, dht):
    from linattn.dsl import Options
    from linattn.dsl import torch_reference as tref
    SPEC = _spec(family)
    cu = None if p["cu"] is None else torch.tensor(p["cu"], device="cuda")
    return _run(p, {n: x.to(F64) for n, x in xs.items()}, do, dht,
                lambda output_final_state, **a: tref.chunked_forward(SPEC, **a),
                options=Options(l2norm_qk=p["l2norm"]), cu_seqlens=cu)


def _errors(xs, grads, rgrads, o, ht, ro, rht):
    errs = dict(o=rel_err(o, ro), ht=rel_err(ht, rht))
    for n, x in xs.items():
        assert grads[n] is not None and grads[n].shape == x.shape and \
            grads[n].dtype == x.dtype, n
        errs["d" + n] = rel_err(grads[n], rgrads[n])
    return errs


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("p", CASES)
def test_gradients_vs_torch_fp64(family, p, rng, monkeypatch):
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(family, p, seed)
    saved = {n: x.clone() for n, x in xs.items()}
    o, ht, grads = _ours(family, p, xs, do, dht, monkeypatch)
    assert all(torch.equal(xs[n], saved[n]) for n in xs), "inputs modified"
    ro, rht, rgrads = _reference(family, p, xs, do, dht)
    record_errors(RESULTS, f"{family}_autograd", p,
                  _errors(xs, grads, rgrads, o, ht, ro, rht), seed)


FLA_CASES = [case(2, 1024, 4, 4, 128, 128, "bfloat16", h0=True, dht=True, name="fla-bf16"),
             case(1, 500, 4, 4, 64, 64, "bfloat16", cu=(0, 100, 500), h0=True, dht=True,
                  l2norm=True, name="fla-varlen-l2norm-bf16")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("p", FLA_CASES)
def test_gradients_vs_fla(family, p, rng, monkeypatch):
    """fla's chunk_comba / chunk_gdn2 (its own backward) on the same inputs: our error
    against the fp64 reference within max(the limit, 1.5 x fla's) on every output and
    gradient."""
    fla = pytest.importorskip(f"fla.ops.{family}")
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(family, p, seed)
    o, ht, grads = _ours(family, p, xs, do, dht, monkeypatch)
    ro, rht, rgrads = _reference(family, p, xs, do, dht)
    fo, fht, fgrads = _run(p, xs, do, dht, getattr(fla, f"chunk_{family}"),
                           use_qk_l2norm_in_kernel=p["l2norm"], **_cu(p))
    ours = _errors(xs, grads, rgrads, o, ht, ro, rht)
    theirs = _errors(xs, fgrads, rgrads, fo, fht, ro, rht)
    tol = GRAD_TOL[p["dtype"]]
    RESULTS.append(dict(test=f"{family}_vs_fla", **p, seed=seed, errors=ours, fla=theirs))
    print("ours", ours, "\nfla ", theirs)
    bad = {n: (e, theirs[n]) for n, e in ours.items() if not e <= max(tol, 1.5 * theirs[n])}
    assert not bad, f"over max({tol}, 1.5 x fla's): {bad}"

