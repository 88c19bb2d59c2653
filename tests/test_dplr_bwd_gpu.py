"""GPU correctness of the dplr rule's chunked backward kernels (ops/dplr_bwd.py's
dplr_backward: the six stages of codegen/arch/sm90/dplr.py's dplr_bwd_plan), called
directly, through its autograd Function and through the public chunk_* calls.

Four checks:
- each stage against its fp64 fake (tests/test_dplr_bwd.py) fed with the kernels' own
  upstream buffers, so a wrong stage is named: ||kernel - fake|| / ||fake|| < STAGE_TOL
  on the rows the fake writes;
- the gradients (q, k, v, a, b, gk, h0) against torch autograd of the fp64 chunked
  reference (dsl.torch_reference, on the GPU) under loss = sum(o * do) + sum(ht * dht):
  ||x - ref|| / ||ref|| < conftest GRAD_TOL (1e-2 bf16, 5e-3 f16); DPLR (gk), IPLR (no
  gate), RWKV-7's a = -kk, b = kk * sigmoid(x), scale 1; varlen, GVA, h0 / dht;
- where fla is installed, fla's chunk_dplr_delta_rule gradients on the same inputs (H ==
  HV): our error within max(the limit, 1.5 x fla's);
- DplrChunkFunction and the public chunk_dplr_delta_rule / chunk_iplr_delta_rule /
  chunk_rwkv7 (wired to it: the exact torch path refused) against fp64 autograd.

JSON summary to $OUT_DIR (else $OUT)/dplr_bwd_gpu.json when set. The kernels:
precompile_jobs (bench/cpu_cache.py builds them on a machine without a GPU).

Run: python3 -m pytest -q -m gpu tests/test_dplr_bwd_gpu.py      (skips without a GPU)
"""
import dataclasses

import pytest

from conftest import GRAD_TOL, record_errors, rel_err, write_summary

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

F64 = torch.float64
SHORT = {"float16": "f16", "bfloat16": "bf16"}
RESULTS = []
STAGE_TOL = 2e-2


def case(B, T, H, HV, K, V, dtype, cu=None, h0=False, dht=False, family="dplr",
         decay=8.0, name=None):
    p = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, cu=cu, h0=h0, dht=dht,
             family=family, decay=decay)
    flags = "".join(f"-{n}" for n in ("h0", "dht") if p[n])
    return pytest.param(p, id=name or f"{family}-B{B}-T{T}-H{H}-HV{HV}-K{K}-V{V}-"
                                      f"{SHORT[dtype]}{flags}")


CASES = [
    case(2, 2048, 4, 4, 128, 128, "bfloat16", dht=True, name="dplr-2k-K128-bf16-dht"),
    case(2, 2048, 2, 4, 64, 64, "float16", h0=True, dht=True, name="dplr-2k-GVA2-f16-h0-dht"),
    case(1, 1 + 129 + 1 + 64 + 300 + 1, 2, 4, 64, 64, "bfloat16",
         cu=(0, 1, 130, 131, 195, 495, 496), h0=True, dht=True,
         name="dplr-varlen-1tok-GVA2-bf16-h0-dht"),
    case(2, 63, 4, 4, 64, 128, "bfloat16", h0=True, dht=True, decay=1.0,
         name="dplr-T63-strong-decay-bf16"),
    case(1, 1000, 4, 4, 128, 64, "bfloat16", cu=(0, 500, 1000), h0=True, dht=True,
         family="iplr", name="iplr-varlen-K128-bf16-h0-dht"),
    case(2, 1024, 8, 8, 64, 64, "bfloat16", h0=True, dht=True, family="rwkv7",
         name="rwkv7-1k-hd64-bf16-h0-dht"),
]
FLA_CASES = [case(2, 1024, 4, 4, 128, 128, "bfloat16", h0=True, dht=True, name="fla-bf16"),
             case(1, 500, 4, 4, 64, 64, "bfloat16", cu=(0, 100, 500), h0=True, dht=True,
                  name="fla-varlen-bf16")]


#: DplrChunkFunction (the autograd Function the public calls will take): K = 96 runs
#: padded to the kernels' 128
FN_CASES = [case(2, 1000, 2, 4, 96, 64, "bfloat16", h0=True, dht=True,
                 name="fn-dplr-K96-GVA2-bf16-h0-dht"),
            case(1, 700, 4, 4, 64, 128, "float16", cu=(0, 1, 300, 700), h0=True, dht=True,
                 family="iplr", name="fn-iplr-varlen-f16-h0-dht"),
            case(2, 1024, 8, 8, 64, 64, "bfloat16", h0=True, dht=True, family="rwkv7",
                 name="fn-rwkv7-1k-hd64-bf16-h0-dht")]


def _spec(p):
    from linattn.ops.registry import specs
    return specs()["iplr" if p["family"] == "iplr" else "dplr"]


def _lens(p):
    return [p["T"]] * p["B"] if p["cu"] is None else [b - a for a, b in zip(p["cu"], p["cu"][1:])]


def precompile_jobs(items=None, device="cuda"):
    """Every case's backward kernels, and the Function cases' forward ones (planned from
    shapes alone; ``device`` unused)."""
    from linattn.codegen.arch.sm90.dplr import dplr_bwd_plan
    from linattn.codegen.pipeline import DplrBackwardProblem
    from linattn.dsl import Options
    from linattn.ops import chunk
    jobs = []
    for c in CASES + FLA_CASES + FN_CASES:
        p = c.values[0]
        spec, K = _spec(p), -(-p["K"] // 64) * 64
        seq_chunks = tuple(-(-n // 64) for n in _lens(p))
        prob = DplrBackwardProblem(
            gate=spec.gate.value, H=p["H"], HV=p["HV"], K=K, V=p["V"], dtype=p["dtype"],
            Ttot=p["B"] * p["T"], seq_chunks=seq_chunks, has_initial_state=p["h0"],
            use_dht=p["dht"], store_dh0=True)
        jobs += [(spec, la.stage, la.kwargs) for la in dplr_bwd_plan(prob, {}).launches]
        if c in FN_CASES:
            fwd = chunk.forward_plan(spec, Options(), H=p["H"], HV=p["HV"], K=K, V=p["V"],
                                     dtype=p["dtype"], Ttot=p["B"] * p["T"],
                                     seq_chunks=seq_chunks, has_initial_state=p["h0"],
                                     output_final_state=True)
            jobs += [(spec, st, pr) for st, pr in chunk.plan_params(fwd).items()]
    return chunk.stage_jobs(list({(s.name, st, tuple(sorted(pr.items()))): (s, st, pr)
                                  for s, st, pr in jobs}.values()))


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    import time
    from linattn.ops import runtime
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    t0 = time.time()
    errors = runtime.precompile(precompile_jobs())
    print(f"precompiled in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors:
        print("  compile error:", e)
    yield
    write_summary("dplr_bwd_gpu", {"compile_errors": errors, "results": RESULTS})


def _inputs(p, seed):
    """q, k, a, b [B, T, H, K] (l2-normalised keys; a = -kk, b = kk sigmoid(x) as RWKV-7's,
    IPLR's kk / 2), v, gk = logsigmoid(x) / decay [B, T, HV, K] f32 (none for IPLR), h0; do, dht."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = (p[n] for n in ("B", "T", "H", "HV", "K", "V"))
    N = B if p["cu"] is None else len(p["cu"]) - 1
    dt = getattr(torch, p["dtype"])
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=F64)  # noqa: E731
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    q, k, kk = unit(rnd(B, T, H, K)), unit(rnd(B, T, H, K)), unit(rnd(B, T, H, K))
    a = -kk                            # (I + b a^T: a contraction along kk)
    b = 0.5 * kk if p["family"] == "iplr" else kk * torch.sigmoid(rnd(B, T, H, K))
    xs = dict(q=q.to(dt), k=k.to(dt), a=a.to(dt), b=b.to(dt), v=rnd(B, T, HV, V).to(dt))
    if p["family"] != "iplr":
        xs["g"] = (torch.nn.functional.logsigmoid(rnd(B, T, HV, K)) / p["decay"]).float()
    if p["h0"]:
        xs["initial_state"] = rnd(N, HV, K, V).float()
    return xs, rnd(B, T, HV, V).to(dt), rnd(N, HV, K, V).float()


def _scale(p):
    return 1.0 if p["family"] == "rwkv7" else p["K"] ** -0.5


def _cu(p):
    cu = None if p["cu"] is None else torch.tensor(p["cu"], dtype=torch.int32)
    return dict(cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu)


def _ours(p, xs, do, dht):
    from linattn.ops.dplr_bwd import dplr_backward
    grads = dplr_backward(_spec(p), xs["q"], xs["k"], xs["v"], xs["a"], xs["b"], xs.get("g"),
                          do, scale=_scale(p), initial_state=xs.get("initial_state"),
                          dht=dht if p["dht"] else None, **_cu(p))
    torch.cuda.synchronize()
    return {n[1:]: z for n, z in grads.items()}


def _reference(p, xs, do, dht):
    from linattn.dsl import torch_reference as tref
    from linattn.dsl.spec import dplr_specs
    spec = {s.name: s for s in dplr_specs()}["dplr_none" if "g" not in xs else "dplr_key"]
    leaves = {n: x.to(F64).requires_grad_() for n, x in xs.items()}
    cu = None if p["cu"] is None else torch.tensor(p["cu"], device="cuda")
    o, ht = tref.chunked_forward(spec, leaves["q"], leaves["k"], leaves["v"], leaves.get("g"),
                                 scale=_scale(p), initial_state=leaves.get("initial_state"),
                                 cu_seqlens=cu, a=leaves["a"], b=leaves["b"])
    loss = (o * do.to(F64)).sum() + ((ht * dht.to(F64)).sum() if p["dht"] else 0)
    loss.backward()
    return {n: x.grad for n, x in leaves.items()}


@pytest.mark.parametrize("p", CASES[2:3] + CASES[4:5])
def test_stages_vs_fakes(p, rng, monkeypatch):
    """Each stage's outputs against its fp64 fake on the kernels' own inputs."""
    import numpy as np
    from linattn.ops import runtime
    from test_dplr_bwd import _fake_bwd_body
    kept, real = {}, runtime.run_plan

    def keep_all(spec, plan, tensors):
        plan = dataclasses.replace(plan, launches=tuple(
            dataclasses.replace(la, release=()) for la in plan.launches))
        kept.update(plan=plan, tensors=real(spec, plan, tensors))
        return kept["tensors"]
    monkeypatch.setattr(runtime, "run_plan", keep_all)
    xs, do, dht = _inputs(p, int(rng.integers(1, 2**31)))
    _ours(p, xs, do, dht)
    spec, t, errs = _spec(p), kept["tensors"], {}
    for la in kept["plan"].launches:
        names = runtime.arg_names(runtime.stage_module(spec, la.stage, "sm90").build(**la.kwargs))
        args = [t[la.tensor(n)] for n in names]
        clones = [a.cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]
        _fake_bwd_body(spec, la.stage, la.kwargs)(*clones)
        for n, a, c in zip(names, args, clones):
            if isinstance(a, torch.Tensor) and not torch.equal(a.cpu(), c):
                fake = c.double()
                live = torch.isfinite(fake)
                if live.any():
                    errs[f"{la.stage}.{n}"] = rel_err(a.cpu()[live], fake[live])
    print({n: f"{e:.2e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e < STAGE_TOL}
    assert errs and not bad, bad
    assert np.isfinite(list(errs.values())).all()


@pytest.mark.parametrize("p", CASES)
def test_gradients_vs_torch_fp64(p, rng):
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(p, seed)
    grads = _ours(p, xs, do, dht)
    ref = _reference(p, xs, do, dht)
    errs = {}
    for n, r in ref.items():
        assert grads[n].shape == r.shape, (n, grads[n].shape, r.shape)
        errs["d" + n] = rel_err(grads[n], r)
    record_errors(RESULTS, "dplr_bwd_autograd", p, errs, seed)


@pytest.mark.parametrize("p", FLA_CASES)
def test_gradients_vs_fla(p, rng):
    """fla's chunk_dplr_delta_rule (its own backward) on the same inputs: our error against
    the fp64 reference within max(the limit, 1.5 x fla's) on every gradient."""
    fla = pytest.importorskip("fla.ops.generalized_delta_rule")
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(p, seed)
    ref = _reference(p, xs, do, dht)
    ours = _ours(p, xs, do, dht)
    leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
    o, ht = fla.chunk_dplr_delta_rule(
        leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"], leaves["g"],
        scale=_scale(p), initial_state=leaves.get("initial_state"), output_final_state=True,
        cu_seqlens=_cu(p)["cu_seqlens"])
    ((o * do.to(o.dtype)).sum() + (ht * dht).sum()).backward()
    tol = GRAD_TOL[p["dtype"]]
    errs = {}
    for n, r in ref.items():
        theirs, mine = rel_err(leaves[n].grad, r), rel_err(ours[n], r)
        errs["d" + n] = mine
        errs["fla_d" + n] = theirs
        assert mine <= max(tol, 1.5 * theirs), (n, mine, theirs)
    RESULTS.append(dict(test="dplr_bwd_vs_fla", **p, seed=seed, errors=errs))
    print("vs fla", p, {n: f"{e:.2e}" for n, e in errs.items()})


@pytest.mark.parametrize("p", FN_CASES)
def test_function_vs_torch_fp64(p, rng):
    """ops/dplr_bwd.py's DplrChunkFunction: o, the final state and every gradient against
    fp64 autograd."""
    from linattn.ops.dplr_bwd import DplrChunkFunction
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(p, seed)
    leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
    cu = _cu(p)
    o, ht = DplrChunkFunction.apply(_spec(p), *(leaves[n] for n in "qkvab"), leaves.get("g"),
                                    _scale(p), leaves.get("initial_state"), True,
                                    cu["cu_seqlens"], cu["cu_seqlens_cpu"])
    ((o * do).sum() + (ht * dht).sum()).backward()
    ref = _reference(p, xs, do, dht)
    errs = {}
    for n, r in ref.items():
        g = leaves[n].grad
        assert g is not None and g.dtype == xs[n].dtype and g.shape == r.shape, n
        errs["d" + n] = rel_err(g, r)
    record_errors(RESULTS, "dplr_function_autograd", p, errs, seed)


@pytest.mark.parametrize("p", FN_CASES)
def test_public_call_vs_torch_fp64(p, rng, monkeypatch):
    """linattn.chunk_dplr_delta_rule / chunk_iplr_delta_rule / chunk_rwkv7 with gradients
    take the backward's kernels (the exact torch path refused) and match fp64 autograd."""
    import linattn
    from linattn.ops import exact_train

    def refuse(*a, **kw):
        raise AssertionError("took the exact torch path, not the kernels")
    monkeypatch.setattr(exact_train, "train", refuse)
    seed = int(rng.integers(1, 2**31))
    xs, do, dht = _inputs(p, seed)
    leaves = {n: x.clone().requires_grad_() for n, x in xs.items()}
    q, k, v, a, b = (leaves[n] for n in "qkvab")
    kw = dict(scale=_scale(p), initial_state=leaves.get("initial_state"),
              output_final_state=True, chunk_size=64, **_cu(p))
    if p["family"] == "iplr":
        o, ht = linattn.chunk_iplr_delta_rule(q, k, v, a, b, **kw)
    elif p["family"] == "rwkv7":
        o, ht = linattn.chunk_rwkv7(q, leaves["g"], k, v, a, b, **kw)
    else:
        o, ht = linattn.chunk_dplr_delta_rule(q, k, v, a, b, leaves["g"], **kw)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ref = _reference(p, xs, do, dht)
    errs = {"d" + n: rel_err(leaves[n].grad, r) for n, r in ref.items()}
    record_errors(RESULTS, "dplr_public_autograd", p, errs, seed)
