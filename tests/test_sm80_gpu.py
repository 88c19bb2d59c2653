"""GPU: every family's chunked forward, gradients and decode through the sm80 plans (the
Ampere / Ada kernels: mma.sync, cp.async, no TMA, wgmma or warpgroup roles; DeltaNet and
GDN without the walk) on the GPU at hand, against the fp64 torch reference
(dsl.torch_reference) with GRAD_TOL. The sm80 kernels' CUDA (mma.sync, cp.async, lowered
for sm_80) is compiled for the device's own SM (codegen.arch.compile_target: on an H100
``-gencode arch=compute_80,code=sm_90``; an sm_80 cubin does not load there), so the very
same code runs on an H100 / H200 (issue 50). The arch is forced per test (conftest
force_arch); each test also checks that every kernel it compiled or launched is an sm80
one. Their speed on Hopper says nothing about Ampere.

Run (one command, the H100 / H200):
    python3 -m pytest -q -m gpu tests/test_sm80_gpu.py
The rest of the GPU suite through the sm80 plans as well (the walk's own tests do not
apply: sm80 plans no walk):
    python3 -m pytest -q -m gpu --arch sm80 tests/ -k "not walk and not split"
JSON summary to $OUT_DIR (else $OUT)/sm80_gpu.json when set.
"""
import pytest

from conftest import GRAD_TOL, record_errors, rel_err, write_summary

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

F64 = torch.float64
ARCH = "sm80"
FAMILIES = ("deltanet", "gdn", "kda", "gla", "simple_gla", "linear_attn", "retention")
RESULTS = []
#: (B, T, H, K, V, dtype): a ragged length (chunks past the end masked), K = V = 128
SHAPES = [pytest.param((2, 300, 4, 64, 64, "bfloat16"), id="B2-T300-K64-bf16"),
          pytest.param((1, 1000, 2, 128, 128, "float16"), id="B1-T1000-K128-f16")]


@pytest.fixture(autouse=True)
def sm80(force_arch, monkeypatch):
    """Every call planned for sm80; the arches of the kernels compiled / launched noted."""
    from linattn.ops import runtime
    force_arch(ARCH)
    seen = []
    compiled = runtime._compiled

    def spy(spec, stage, arch, params, target=None):
        seen.append(arch)
        return compiled(spec, stage, arch, params, target)
    monkeypatch.setattr(runtime, "_compiled", spy)
    yield seen
    assert seen and set(seen) == {ARCH}, f"kernels of arches {sorted(set(seen))}"


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    write_summary("sm80_gpu", {"arch": ARCH, "gpu": torch.cuda.get_device_name(),
                               "results": RESULTS})


def _spec(name):
    from linattn.ops.registry import get_spec
    return get_spec(name)


def _inputs(spec, B, T, H, K, V, dtype, seed, device="cuda"):
    """q, k (l2-normalised), v, the gate where the call takes one (logsigmoid / 8: [B, T,
    H] or per key channel; none for retention, whose decay the spec fixes), beta
    (sigmoid), an initial state; the loss weights do, dht. (device "cpu": the CPU check
    of these inputs and the reference, tests/test_sm80_plans.py.)"""
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device, dtype=F64)  # noqa: E731
    dt = getattr(torch, dtype)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1).to(dt)  # noqa: E731
    xs = dict(q=unit(rnd(B, T, H, K)), k=unit(rnd(B, T, H, K)), v=rnd(B, T, H, V).to(dt))
    if spec.gate_is_input:
        shape = (B, T, H, K) if spec.gate.channels == "K" else (B, T, H)
        xs["g"] = (torch.nn.functional.logsigmoid(rnd(*shape)) / 8).float()
    if spec.has_beta:
        xs["beta"] = torch.sigmoid(rnd(B, T, H)).to(dt)
    xs["initial_state"] = (rnd(B, H, K, V) * 0.1).float()
    return xs, rnd(B, T, H, V).to(dt), rnd(B, H, K, V).float()


def _run(fn, xs, do, dht, grads=True, **kw):
    """o, final state and (grads) each input's gradient of sum(o do) + sum(ht dht)."""
    leaves = {n: x.clone().requires_grad_(grads) for n, x in xs.items()}
    o, ht = fn(**leaves, output_final_state=True, **kw)
    if grads:
        ((o * do.to(o.dtype)).sum() + (ht * dht).sum()).backward()
    if o.is_cuda:
        torch.cuda.synchronize()
    return o.detach(), ht.detach(), {n: x.grad for n, x in leaves.items() if grads}


def _fixed_gate(spec, v):
    """{"g": the gate [B, T, HV] fp64} of a spec whose decay is fixed (``decay``:
    retention, whose call takes no g and builds it from the spec), from the spec's
    head_decay; {} for the others (their g, if any, is among the inputs)."""
    if not spec.decay:
        return {}
    B, T, HV = v.shape[:3]
    gamma = torch.tensor(spec.head_decay(HV), dtype=F64, device=v.device)
    return {"g": gamma.view(1, 1, HV).expand(B, T, HV)}


def _reference(spec, xs, do, dht, recurrent=False, grads=True):
    """The fp64 reference of the call's inputs xs; a fixed decay (retention) given as g,
    which the reference needs (without it: TypeError in torch_reference.prepare)."""
    from linattn.dsl import torch_reference as tref
    ref = tref.recurrent_forward if recurrent else tref.chunked_forward
    f64 = {n: x.to(F64) for n, x in xs.items()}
    fixed = _fixed_gate(spec, xs["v"])
    return _run(lambda output_final_state, **a: ref(spec, **a, **fixed), f64, do, dht, grads,
                scale=xs["q"].shape[-1] ** -0.5)


def _check(test, name, shape, errs, seed):
    p = dict(family=name, B=shape[0], T=shape[1], H=shape[2], K=shape[3], V=shape[4],
             dtype=shape[5], arch=ARCH)
    record_errors(RESULTS, test, p, errs, seed)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_sm80_forward_and_gradients(name, shape, rng):
    """The chunked forward (o, final state) and the gradients of every input through the
    training forward and backward, both on the sm80 plans."""
    from linattn import build
    spec, seed = _spec(name), int(rng.integers(1 << 31))
    xs, do, dht = _inputs(spec, *shape, seed)
    fn = build(spec).chunk
    o0, ht0, _ = _run(fn, xs, do, dht, grads=False, scale=shape[3] ** -0.5)   # inference
    o, ht, gr = _run(fn, xs, do, dht, scale=shape[3] ** -0.5)                  # training
    ro, rht, rgr = _reference(spec, xs, do, dht)
    errs = {"o_inference": rel_err(o0, ro), "final_inference": rel_err(ht0, rht),
            "o": rel_err(o, ro), "final_state": rel_err(ht, rht)}
    errs.update((f"d{n}", rel_err(gr[n], rgr[n])) for n in rgr)
    _check("forward_and_gradients", name, shape, errs, seed)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_sm80_decode(name, dtype, rng):
    """One token per sequence (the recurrent kernel, 8 sequences) and a few tokens through
    fused_recurrent, from an initial state."""
    from linattn import build
    spec, seed = _spec(name), int(rng.integers(1 << 31))
    ops = build(spec)
    errs = {}
    for what, T, fn in (("step", 1, ops.chunk), ("fused_recurrent", 5, ops.fused_recurrent)):
        shape = (8, T, 4, 128, 128, dtype)
        xs, do, dht = _inputs(spec, *shape, seed)
        o, ht, _ = _run(fn, xs, do, dht, grads=False, scale=128 ** -0.5)
        ro, rht, _ = _reference(spec, xs, do, dht, recurrent=True, grads=False)
        errs.update({f"{what}_o": rel_err(o, ro), f"{what}_final": rel_err(ht, rht)})
    _check("decode", name, (8, 5, 4, 128, 128, dtype), errs, seed)
