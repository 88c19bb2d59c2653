"""fla's (and mamba_ssm's) own call forms of every family, on the CPU.

Each family's fla test file (tests/ops/test_<family>.py of flash-linear-attention; for
Mamba-2 mamba_ssm's tests/ops/triton/test_selective_state_update.py and fla's
test_simple_gla_to_mamba2) calls the public functions in a handful of forms: keywords or
positions, inputs of mixed dtypes (gates in float32 while q is 16-bit, states in 16-bit,
raw beta logits, A_log of shape [1, 1, H, 1] ...), varlen offsets as int32 or int64,
GVA, state_v_first, the gate in the kernel, chunk_size, and the tuples they return.
Here every such form runs through linattn's public function on small inputs (the
kernels replaced by the fp64 reference: ``cpu_ops``) and is compared with fla's own
naive reference (imported from the installed fla) where fla has one that runs on the CPU,
else with linattn's fp64 recurrence. Training forms compare gradients too where the CPU
can run them: float32 calls (ops/exact_train.py), and 16-bit delta-rule calls through
the backward's stage emulators (tests/test_autograd.py's fakes). Forms fla accepts but
linattn refuses on purpose (a feature it lacks) must fail with one short line naming it.
"""
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.dsl import SpecError
from linattn.dsl import torch_reference as tr
from linattn.ops import validate
from linattn.ops.registry import get_spec

from _cpu_ops import cpu_ops  # noqa: F401 (fixture)

F16, BF, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


# ------------------------------------------------------------------ helpers
def fla_fn(module: str, name: str):
    """fla's reference ``name`` from the installed ``module`` (skips, saying why, where it
    does not import on this machine)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return getattr(importlib.import_module(module), name)
        except Exception as e:     # pragma: no cover (fla imports on the CPU here)
            pytest.skip(f"fla's {module}.{name} does not import here: {type(e).__name__}: {e}")


def rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def close(name, got, want, tol):
    """Relative error (norm) under ``tol``, or, as fla's assert_close allows, a largest
    absolute error of at most 1e-6 (gradients of gates that decay by e^-50 a token are
    rounding noise of the loss)."""
    assert got is not None, name
    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
    assert not torch.isnan(got).any(), name
    if float((got.detach().double() - want.detach().double()).abs().max()) <= 1e-6:
        return
    err = rel(got, want)
    assert err < tol, (name, err, tol)


def tol_of(dtype) -> float:
    """Relative error allowed for o / final states against fla's f32 naive references:
    f32 calls are exact here (fp64 inside), 16-bit ones round o once."""
    return {F32: 1e-4, F16: 5e-3, BF: 2e-2}[dtype]


def gen(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (lambda *s, dtype=F32: torch.randn(*s, generator=g).to(dtype),   # noqa: E731
            lambda *s, dtype=F32: torch.rand(*s, generator=g).to(dtype))


def one_line(call, match=None):
    """``call`` must raise SpecError / ValueError / TypeError in one short line."""
    with pytest.raises((SpecError, ValueError, TypeError)) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and len(msg) <= validate.MAX_MESSAGE and "tensor(" not in msg, msg
    if match is not None:
        assert match in msg, msg
    return msg


def leaves_of(x: dict, train: bool):
    return {n: (t.clone().requires_grad_() if train and isinstance(t, torch.Tensor)
                and t.is_floating_point() else t) for n, t in x.items()}


def grads_vs(leaves: dict, ref_leaves: dict, names, tol):
    for n in names:
        got, want = leaves[n].grad, ref_leaves[n].grad
        assert got is not None and got.dtype == leaves[n].dtype, n
        close("d" + n, got, want, tol)


def loss_of(o, ht, do, dht):
    loss = (o.float() * do.float()).sum()
    return loss if ht is None else loss + (ht.float() * dht.float()).sum()


def per_sequence(ref, cu, x: dict, h0, seq_keys):
    """fla's varlen references: the naive function on each sequence's tokens (batch 1),
    outputs concatenated along T and final states along N."""
    os_, hs = [], []
    for i in range(len(cu) - 1):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        part = {n: (t[:, sl] if n in seq_keys else t) for n, t in x.items()}
        o, h = ref(**part, initial_state=None if h0 is None else h0[i:i + 1])
        os_.append(o)
        hs.append(h)
    return torch.cat(os_, 1), torch.cat(hs, 0)


# ------------------------------------------------------------------ the delta rules
def _delta_inputs(f):
    """The inputs of one fla delta-rule form ``f`` (a dict, see DELTA_FORMS), as fla's
    test makes them: q, k uniform in [0, 1) (or normal), beta post-sigmoid (raw logits
    with use_beta_sigmoid_in_kernel), g a log decay (raw with the gate in the kernel)."""
    randn, rand = gen(f.get("seed", 0))
    fam, dt = f["fam"], f["dtype"]
    B, T, H, HV, K, V = (f.get(n, d) for n, d in
                         (("B", 2), ("T", 37), ("H", 2), ("HV", 2), ("K", 32), ("V", 32)))
    cu = f.get("cu")
    if cu is not None:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    qk = rand if f.get("qk", "rand") == "rand" else randn
    qdt = f.get("qk_dtype", dt)
    x = dict(q=qk(B, T, H, K, dtype=qdt), k=qk(B, T, H, K, dtype=qdt),
             v=randn(B, T, HV, V, dtype=f.get("v_dtype", dt)))
    if f.get("bsig"):
        x["beta"] = randn(B, T, HV, dtype=f.get("beta_dtype", F32))
    else:
        x["beta"] = rand(B, T, HV).sigmoid().to(f.get("beta_dtype", F32))
    gshape = (B, T, HV, K) if fam == "kda" else (B, T, HV)
    gik = f.get("gik")
    if gik is not None:
        x["g"] = randn(*gshape, dtype=f.get("g_dtype", F32))
        if gik.get("A_log", True):      # fla: log U(1, 16) (recurrent, varlen), N(0, 1) (chunk)
            A = torch.log(rand(HV) * 15 + 1) if f.get("A_init") == "log16" else randn(HV)
            x["A_log"] = A.reshape(gik.get("A_shape", (HV,)))
        if gik.get("dt_bias", True):
            x["dt_bias"] = randn(HV * K if fam == "kda" else HV)
    elif fam != "delta":
        g = F.logsigmoid(randn(*gshape) if fam == "kda" else rand(*gshape))
        g = g / f.get("norm", 1.0)
        if f.get("mask"):                 # fla's mask_p: some gates zeroed
            g = g * (rand(*gshape) > 0.5)
        if f.get("mask1000"):              # fla's KDA varlen: masked gates of -1000
            keep = rand(*gshape) > 0.5
            g = g * keep + (~keep) * -1000.0
        if f.get("clamp"):
            g = g.clamp(-5, 0)
        x["g"] = g.to(f.get("g_dtype", F32))
    if f.get("h0", F32) is not None:
        h0 = randn(N, HV, K, V, dtype=f.get("h0", F32))
        x["initial_state"] = h0.transpose(-1, -2).contiguous() if f.get("vfirst") else h0
    return x, N


def test_fused_recurrent_kda_fwd_in_place_form(cpu_ops):
    """fla's _run_fused_recurrent_kda_fwd: fused_recurrent_kda_fwd(q=, k=, v=, g=, beta=,
    initial_state=h0 [B, H, K, V], scale=1.0, output_final_state=False,
    inplace_final_state=True, use_qk_l2norm_in_kernel=True) without a pool: o, and h0
    updated in place to the final state, against fla's naive_recurrent_kda."""
    f = dict(fam="kda", dtype=F32, T=40)
    x, _ = _delta_inputs(f)
    h0 = x.pop("initial_state")
    before = h0.clone()
    o, ht = linattn.fused_recurrent_kda_fwd(**x, initial_state=h0, scale=1.0,
                                            output_final_state=False, inplace_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    naive = fla_fn("fla.ops.kda.naive", "naive_recurrent_kda")
    o_r, ht_r = naive(F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1), x["v"],
                      x["g"], x["beta"], scale=1.0, initial_state=before,
                      output_final_state=True)
    assert ht is h0
    close("o", o, o_r, 1e-4)
    close("h0 in place", h0, ht_r, 1e-4)


def _delta_call(f, x):
    """linattn's call in the form's argument form."""
    fam, fn = f["fam"], f["fn"]
    name = {("gdn", "chunk"): "chunk_gated_delta_rule",
            ("gdn", "fused"): "fused_recurrent_gated_delta_rule",
            ("delta", "chunk"): "chunk_delta_rule",
            ("delta", "fused"): "fused_recurrent_delta_rule",
            ("kda", "chunk"): "chunk_kda", ("kda", "fused"): "fused_recurrent_kda"}[fam, fn]
    kw = dict(f.get("kw", {}))
    if "scale" in f:
        kw["scale"] = f["scale"]
    if f.get("l2") == "kernel":
        kw["use_qk_l2norm_in_kernel"] = True
    q, k = x["q"], x["k"]
    if f.get("l2") == "outside":
        q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    if f.get("bsig"):
        kw.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=f["bsig"] == "neg")
    gik = f.get("gik")
    if gik is not None:
        kw.update(use_gate_in_kernel=True, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"))
        for n in ("safe_gate", "lower_bound"):
            if n in gik:
                kw[n] = gik[n]
    if f.get("vfirst"):
        kw["state_v_first"] = True
    if f.get("cu") is not None:
        cu = torch.tensor(f["cu"], dtype=f.get("cu_dtype", torch.int32))
        kw["cu_seqlens"] = cu
        if f.get("cu_cpu"):
            kw["cu_seqlens_cpu"] = cu.cpu()
    if "initial_state" in x:
        kw["initial_state"] = x["initial_state"]
    kw["output_final_state"] = f.get("final", True)
    rest = dict(v=x["v"], beta=x["beta"]) if fam == "delta" else dict(v=x["v"], g=x["g"],
                                                                       beta=x["beta"])
    if f.get("positional"):        # fla's test_gdn_kernels: (q, k, v, g, beta, scale, h0)
        args = (q, k, rest["v"], rest["g"], rest["beta"], kw.pop("scale"),
                kw.pop("initial_state", None))
        return getattr(linattn, name)(*args, **kw)
    return getattr(linattn, name)(q=q, k=k, **rest, **kw)


def _delta_reference(f, x, N):
    """fla's naive recurrence of the form (gdn, delta: naive_recurrent_gated_delta_rule,
    delta with g = 0; kda: naive_recurrent_kda), on fla's mapped inputs: GVA repeated,
    q, k l2-normalised, the gate / beta activated by fla's torch functions, per sequence
    with varlen."""
    fam = f["fam"]
    HV, H = x["v"].shape[2], x["q"].shape[2]
    q, k, beta, g = x["q"], x["k"], x["beta"], x.get("g")
    if f.get("l2"):
        q, k = F.normalize(q.float(), p=2, dim=-1), F.normalize(k.float(), p=2, dim=-1)
    if f.get("bsig"):
        beta = beta.float().sigmoid() * (2 if f["bsig"] == "neg" else 1)
    gik = f.get("gik")
    if gik is not None:
        if fam == "gdn":
            g = fla_fn("fla.ops.gated_delta_rule.gate", "naive_gdn_gate")(
                g, x["A_log"], x.get("dt_bias"))
        elif gik.get("lower_bound") is not None:
            g = fla_fn("fla.ops.kda.gate", "naive_kda_lowerbound_gate")(
                g, x.get("A_log"), x.get("dt_bias"), lower_bound=gik["lower_bound"])
        else:
            g = fla_fn("fla.ops.kda.gate", "naive_kda_gate")(g, x["A_log"], x.get("dt_bias"))
    h0 = x.get("initial_state")
    if h0 is not None and f.get("vfirst"):
        h0 = h0.transpose(-1, -2)
    scale = f.get("scale")
    if fam == "kda":
        naive = fla_fn("fla.ops.kda.naive", "naive_recurrent_kda")

        def ref(q, k, v, g, beta, initial_state):
            return naive(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                         initial_state=initial_state, output_final_state=True)
    else:
        naive = fla_fn("fla.ops.gated_delta_rule.naive", "naive_recurrent_gated_delta_rule")
        q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
        if g is None:
            g = torch.zeros(x["v"].shape[:3])

        def ref(q, k, v, g, beta, initial_state):
            return naive(q=q, k=k, v=v, beta=beta, g=g, scale=scale,
                         initial_state=initial_state, output_final_state=True)
    y = dict(q=q, k=k, v=x["v"], g=g, beta=beta)
    if f.get("cu") is None:
        o, ht = ref(**y, initial_state=h0)
    else:
        o, ht = per_sequence(ref, f["cu"], y, h0, ("q", "k", "v", "g", "beta"))
    return o, ht


G, D, K_ = "gdn", "delta", "kda"
GIK = dict()                              # A_log [HV], dt_bias [HV]
DELTA_FORMS = {
    # --- test_gdn.py
    "gdn-fused-qkf32-vf16-gva-l2k": dict(fam=G, fn="fused", dtype=F16, qk_dtype=F32, qk="randn",
                                         beta_dtype=F16, H=1, HV=2, scale=1.0, l2="kernel",
                                         grad_inputs=True),
    "gdn-fused-f32-gva-l2k": dict(fam=G, fn="fused", dtype=F32, qk="randn", H=1, HV=2, scale=0.1,
                                  l2="kernel", norm=10.0),
    "gdn-chunk-f16-l2out-mask": dict(fam=G, fn="chunk", dtype=F16, scale=0.1, l2="outside",
                                     mask=True, T=70, K=60, V=60),
    "gdn-chunk-f16-gva-l2k": dict(fam=G, fn="chunk", dtype=F16, H=1, HV=2, scale=1.0, l2="kernel"),
    "gdn-chunk-f32-train-cs16": dict(fam=G, fn="chunk", dtype=F32, H=1, HV=2, scale=0.1,
                                     l2="outside", kw=dict(chunk_size=16), train=True),
    "gdn-chunk-f32-train-cs32": dict(fam=G, fn="chunk", dtype=F32, H=1, HV=2, scale=0.1,
                                     l2="outside", kw=dict(chunk_size=32), train=True),
    "gdn-chunk-f16-bsig-neg": dict(fam=G, fn="chunk", dtype=F16, H=1, HV=2, scale=0.1, l2="kernel",
                                   bsig="neg"),
    "gdn-chunk-f16-vfirst": dict(fam=G, fn="chunk", dtype=F16, scale=0.5, l2="outside",
                                 beta_dtype=F16, vfirst=True),
    "gdn-fused-f32-vfirst": dict(fam=G, fn="fused", dtype=F32, qk="randn", H=1, HV=2, scale=1.0,
                                 l2="kernel", vfirst=True),
    "gdn-fused-f32-gik-nobias": dict(fam=G, fn="fused", dtype=F32, qk="randn", l2="kernel",
                                     scale=1.0, A_init="log16", gik=dict(dt_bias=False)),
    "gdn-fused-f16-gik-gva": dict(fam=G, fn="fused", dtype=F16, qk="randn", beta_dtype=F16, H=1,
                                  HV=4, l2="kernel", scale=0.1, A_init="log16", gik=GIK),
    "gdn-fused-f16-bsig-f16beta": dict(fam=G, fn="fused", dtype=F16, qk="randn", beta_dtype=F16,
                                       H=1, HV=2, l2="kernel", scale=0.1, bsig="neg"),
    "gdn-fused-f16-gik-varlen-i64": dict(fam=G, fn="fused", dtype=F16, qk="randn", beta_dtype=F16,
                                         H=2, HV=4, l2="kernel", A_init="log16", gik=GIK,
                                         cu=[0, 15, 40, 63], cu_dtype=torch.int64),
    "gdn-chunk-f16-varlen-i64-f16g-f16h0": dict(fam=G, fn="chunk", dtype=F16, qk="randn", H=1,
                                                HV=2, g_dtype=F16, h0=F16, l2="outside",
                                                cu=[0, 15, 40, 63], cu_dtype=torch.int64),
    "gdn-chunk-f16-prefill-allf16": dict(fam=G, fn="chunk", dtype=F16, qk="randn", g_dtype=F16,
                                         beta_dtype=F16, h0=F16, l2="outside", cu=[0, 15],
                                         cu_dtype=torch.int64, inference=True),
    "gdn-chunk-f16-gik-l2k": dict(fam=G, fn="chunk", dtype=F16, scale=1.0, l2="kernel",
                                  gik=GIK, h0=F32),
    "gdn-chunk-f16-gik-nobias-gqa": dict(fam=G, fn="chunk", dtype=F16, H=1, HV=4, scale=0.1,
                                         l2="kernel", gik=dict(dt_bias=False)),
    "gdn-chunk-f16-gik-varlen": dict(fam=G, fn="chunk", dtype=F16, qk="randn", l2="kernel",
                                     gik=GIK, cu=[0, 15, 50, 70], cu_dtype=torch.int64),
    "gdn-chunk-bf16-positional": dict(fam=G, fn="chunk", dtype=BF, qk="randn", beta_dtype=BF,
                                      H=2, HV=4, l2="outside", scale=32 ** -0.5,
                                      positional=True),
    "gdn-chunk-f16-positional-noh0": dict(fam=G, fn="chunk", dtype=F16, qk="randn", beta_dtype=F16,
                                          H=1, HV=2, K=32, l2="outside", scale=32 ** -0.5,
                                          positional=True, h0=None),
    "gdn-chunk-f32-train-gik": dict(fam=G, fn="chunk", dtype=F32, l2="kernel", gik=GIK,
                                    scale=0.1, train=True),
    "gdn-fused-mixed-train": dict(fam=G, fn="fused", dtype=F16, qk_dtype=F32, qk="randn",
                                  beta_dtype=F16, H=1, HV=2, scale=1.0, l2="kernel", train=True),
    "gdn-fused-f32-train": dict(fam=G, fn="fused", dtype=F32, qk="randn", H=1, HV=2,
                                l2="kernel", scale=1.0, train=True),
    # --- test_delta.py
    "delta-chunk-f16-l2out": dict(fam=D, fn="chunk", dtype=F16, qk="randn", beta_dtype=F16,
                                  scale=0.1, l2="outside", K=60, V=60, T=40),
    "delta-chunk-f16-l2k": dict(fam=D, fn="chunk", dtype=F16, qk="randn", beta_dtype=F16,
                                scale=1.0, l2="kernel"),
    "delta-fused-f16-l2k": dict(fam=D, fn="fused", dtype=F16, qk="randn", beta_dtype=F16,
                                scale=1.0, l2="kernel"),
    "delta-chunk-bf16-cs16": dict(fam=D, fn="chunk", dtype=BF, qk="randn", beta_dtype=BF,
                                  scale=0.1, l2="outside", kw=dict(chunk_size=16)),
    "delta-chunk-f16-varlen-f16h0": dict(fam=D, fn="chunk", dtype=F16, qk="randn",
                                         beta_dtype=F16, h0=F16, l2="outside",
                                         cu=[0, 15, 40, 63]),
    "delta-fused-f16-varlen-f16h0": dict(fam=D, fn="fused", dtype=F16, qk="randn",
                                         beta_dtype=F16, h0=F16, l2="outside",
                                         cu=[0, 15, 40, 63]),
    "delta-chunk-f32-train": dict(fam=D, fn="chunk", dtype=F32, qk="randn", scale=0.1,
                                  l2="kernel", train=True),
    "delta-fused-f32-train-varlen": dict(fam=D, fn="fused", dtype=F32, qk="randn", l2="outside",
                                         cu=[0, 15, 40, 63], train=True),
    # --- test_kda.py
    "kda-fused-f32-l2k": dict(fam=K_, fn="fused", dtype=F32, scale=1.0, l2="kernel", K=60, V=60,
                              grad_inputs=True),
    "kda-fused-f32-gva-l2out": dict(fam=K_, fn="fused", dtype=F32, H=1, HV=2, scale=0.1,
                                    l2="outside"),
    "kda-fused-f32-bsig": dict(fam=K_, fn="fused", dtype=F32, l2="outside", bsig="neg",
                               scale=1.0),
    "kda-fused-f32-vfirst": dict(fam=K_, fn="fused", dtype=F32, l2="kernel", vfirst=True,
                                 scale=1.0),
    "kda-fused-f16-gik-lb": dict(fam=K_, fn="fused", dtype=F16, beta_dtype=F16, H=1, HV=2,
                                 l2="kernel", scale=0.1, A_init="log16",
                                 gik=dict(lower_bound=-5.0)),
    "kda-fused-f32-gik-noA-lb": dict(fam=K_, fn="fused", dtype=F32, H=1, HV=2, l2="kernel",
                                     gik=dict(A_log=False, lower_bound=-5.0)),
    "kda-fused-f32-gik-nobias": dict(fam=K_, fn="fused", dtype=F32, l2="kernel",
                                     A_init="log16", gik=dict(dt_bias=False)),
    "kda-chunk-f16-safe-clamped": dict(fam=K_, fn="chunk", dtype=F16, beta_dtype=F16, scale=1.0,
                                       l2="outside", clamp=True,
                                       kw=dict(safe_gate=True, lower_bound=-5.0)),
    "kda-chunk-f16-gik-f16g-cs32": dict(fam=K_, fn="chunk", dtype=F16, beta_dtype=F16, H=1,
                                        HV=2, l2="outside", g_dtype=F16, gik=GIK,
                                        kw=dict(disable_recompute=True, chunk_size=32)),
    "kda-chunk-bf16-gik-safe-l2k": dict(fam=K_, fn="chunk", dtype=BF, beta_dtype=BF, H=1, HV=2,
                                        l2="kernel", g_dtype=BF,
                                        gik=dict(safe_gate=True, lower_bound=-5.0)),
    "kda-chunk-f16-vfirst": dict(fam=K_, fn="chunk", dtype=F16, beta_dtype=F16, l2="outside",
                                 scale=0.5, vfirst=True),
    "kda-chunk-f16-bsig": dict(fam=K_, fn="chunk", dtype=F16, beta_dtype=F16, l2="outside",
                               bsig="neg"),
    "kda-chunk-f16-varlen-gik-A1H1": dict(fam=K_, fn="chunk", dtype=F16, qk="randn", g_dtype=F16,
                                          beta_dtype=F16, l2="outside", cu_cpu=True,
                                          A_init="log16", gik=dict(A_shape=(1, 1, 2, 1)),
                                          cu=[0, 15, 40, 63],
                                          cu_dtype=torch.int64),
    "kda-chunk-f16-varlen-safe": dict(fam=K_, fn="chunk", dtype=F16, qk="randn", beta_dtype=F16,
                                      l2="outside", clamp=True, cu=[0, 31, 50, 64],
                                      cu_dtype=torch.int64, cu_cpu=True,
                                      kw=dict(safe_gate=True, disable_recompute=True)),
    "kda-chunk-f32-train-mask1000-varlen": dict(fam=K_, fn="chunk", dtype=F32, qk="randn",
                                                l2="outside", mask1000=True, train=True,
                                                cu=[0, 15, 80, 100], cu_dtype=torch.int64),
    "gdn-chunk-f32-train-norm0.01": dict(fam=G, fn="chunk", dtype=F32, H=1, HV=2, T=80,
                                         l2="kernel", norm=0.01, train=True),   # (fla's 0.01)
    "kda-chunk-f32-train-gik-safe": dict(fam=K_, fn="chunk", dtype=F32, l2="kernel", scale=1.0,
                                         gik=dict(safe_gate=True, lower_bound=-5.0), train=True,
                                         kw=dict(disable_recompute=False, chunk_size=64)),
}


@pytest.mark.parametrize("fid", list(DELTA_FORMS))
def test_delta_rule_forms(cpu_ops, fid):
    """Gated DeltaNet, DeltaNet, KDA: o and the final state of each fla form against fla's
    naive recurrence (float32 training forms: every gradient too)."""
    f = DELTA_FORMS[fid]
    x, N = _delta_inputs(f)
    train = f.get("train", False)
    leaves = leaves_of(x, train or f.get("grad_inputs", False))
    ctx = torch.inference_mode() if f.get("inference") else torch.enable_grad()
    with ctx:
        o, ht = _delta_call(f, leaves)
    dt = f["dtype"]
    assert o.dtype == (f.get("qk_dtype", dt)) and ht.dtype == F32
    ref_leaves = leaves_of(x, train)
    o_r, ht_r = _delta_reference(f, ref_leaves, N)
    close("o", o, o_r, tol_of(dt))
    close("ht", ht.transpose(-1, -2) if f.get("vfirst") else ht, ht_r, tol_of(dt))
    if train:
        randn, _ = gen(7)
        do, dht = randn(*o.shape), randn(*ht_r.shape)
        loss_of(o, ht.transpose(-1, -2) if f.get("vfirst") else ht, do, dht).backward()
        loss_of(o_r, ht_r, do, dht).backward()
        grads_vs(leaves, ref_leaves, [n for n in x if n != "cu"], 1e-4)


@pytest.fixture
def stage_fakes(monkeypatch):
    """16-bit delta-rule training on the CPU: the backward's stages run by their fp64
    emulators and the training forward is the fp64 reference rounded as the kernels store
    it (tests/test_autograd.py's fakes; KDA's from tests/test_kda_bwd.py), so everything a
    public call does around the kernels (argument forms, padding, dtypes, the gate's and
    beta's torch parts) is what runs."""
    from linattn.ops import autograd

    def install(fam):
        if fam == "kda":
            import test_kda_bwd as m
            names = m.install_key_fakes(monkeypatch)
        else:
            import test_autograd as m
            from test_chunk_bwd import install_fakes
            names = install_fakes(monkeypatch)
        def forward(call, q, k, v, beta, h0, g=None, A_log=None, dt_bias=None):
            if call.gate_in_kernel and dt_bias is None:     # (the kernels' zeros)
                dt_bias = torch.zeros(v.shape[2] * (q.shape[-1] if call.keyed else 1))
            return m._reference_forward(call, q, k, v, beta, h0, g, A_log, dt_bias)
        monkeypatch.setattr(autograd, "run_forward", forward)
        return names
    return install


TRAIN16 = ["gdn-chunk-f16-l2out-mask", "gdn-chunk-f16-gva-l2k", "gdn-chunk-f16-bsig-neg",
           "gdn-chunk-f16-vfirst", "gdn-chunk-f16-varlen-i64-f16g-f16h0", "gdn-chunk-f16-gik-l2k",
           "gdn-chunk-f16-gik-nobias-gqa", "gdn-chunk-f16-gik-varlen", "gdn-chunk-bf16-positional",
           "gdn-chunk-f16-positional-noh0",
           "gdn-fused-f16-bsig-f16beta", "delta-chunk-f16-l2out", "delta-chunk-bf16-cs16",
           "delta-chunk-f16-varlen-f16h0", "delta-fused-f16-varlen-f16h0",
           "kda-chunk-f16-safe-clamped", "kda-chunk-f16-gik-f16g-cs32",
           "kda-chunk-bf16-gik-safe-l2k", "kda-chunk-f16-vfirst", "kda-chunk-f16-bsig",
           "kda-chunk-f16-varlen-gik-A1H1", "kda-chunk-f16-varlen-safe"]


@pytest.mark.parametrize("fid", TRAIN16)
def test_delta_rule_16bit_training_forms(stage_fakes, fid):
    """fla's 16-bit training forms (requires_grad on every input, a loss on o and the
    final state): o, the final state and every input's gradient (in the input's dtype)
    against torch autograd of fla's naive recurrence."""
    f = dict(DELTA_FORMS[fid], A_init="randn")   # (fla's chunk tests' A_log: the fp64
    stage_fakes(f["fam"])                          # chunked reference's exp range)
    x, N = _delta_inputs(f)
    leaves, ref_leaves = leaves_of(x, True), leaves_of(x, True)
    o, ht = _delta_call(f, leaves)
    o_r, ht_r = _delta_reference(f, ref_leaves, N)
    ht = ht.transpose(-1, -2) if f.get("vfirst") else ht
    tol = 2 * tol_of(f["dtype"])
    close("o", o, o_r, tol)
    close("ht", ht, ht_r, tol)
    randn, _ = gen(7)
    do, dht = randn(*o.shape), randn(*ht_r.shape)
    loss_of(o, ht, do, dht).backward()
    loss_of(o_r, ht_r, do, dht).backward()
    for n in x:
        scale_tol = 3 if n in ("A_log", "dt_bias", "g") else 1
        grads_vs(leaves, ref_leaves, [n], 4 * tol * scale_tol)


# ------------------------------------------------------------------ the additive rule
def _additive_inputs(f):
    """One fla additive-rule form's inputs as its test makes them (GLA: q, k, v uniform,
    g = logsigmoid(uniform) per key channel; simple GLA, retention, linear attention,
    lightning: normal, simple GLA's g per head)."""
    randn, rand = gen(f.get("seed", 1))
    fam, dt = f["fam"], f["dtype"]
    B, T, H, K = (f.get(n, d) for n, d in (("B", 2), ("T", 37), ("H", 2), ("K", 32)))
    V = f.get("V", K)
    cu = f.get("cu")
    if cu is not None:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    r = rand if fam == "gla" else randn
    x = dict(q=r(B, T, H, K, dtype=dt), k=r(B, T, H, K, dtype=dt), v=r(B, T, H, V, dtype=dt))
    if f.get("positive"):                      # normalize=True: positive feature maps
        x["q"], x["k"] = ((t.float().abs() + 0.01).to(dt) for t in (x["q"], x["k"]))
    if fam == "gla":
        x["g"] = (F.logsigmoid(rand(B, T, H, K)) / f.get("norm", 1.0)).to(f.get("g_dtype", dt))
    elif fam == "sgla" and not f.get("no_g"):
        x["g"] = (F.logsigmoid(randn(B, T, H)) / f.get("norm", 1.0)).to(f.get("g_dtype", dt))
    if f.get("h0", F32) is not None:
        h0 = (rand if f.get("h0_rand") else randn)(N, H, K, V, dtype=f.get("h0", F32))
        x["initial_state"] = h0.transpose(-1, -2).contiguous() if f.get("vfirst") else h0
    return x, N


def _fixed_gate(fam, B, T, H, layer=1, layers=4):
    """fla's decays of retention (log(1 - 2^(-5 - h))) and lightning attention
    (-(8 / H) (1 - layer / layers) h, chunk_lightning_attn's g_gamma) per token."""
    h = torch.arange(H, dtype=F32)
    g = torch.log(1 - 2 ** (-5 - h)) if fam == "ret" else -(8 / H * (1 - layer / layers)) * h
    return g.view(1, 1, H).expand(B, T, H)


def _additive_call(f, x):
    name, fam = f["fn"], f["fam"]
    kw = dict(f.get("kw", {}))
    if "scale" in f:
        kw["scale"] = f["scale"]
    if fam == "light":
        kw.update(layer_idx=1, num_layers=4)
    if f.get("vfirst"):
        kw["state_v_first"] = True
    if f.get("cu") is not None:
        kw["cu_seqlens"] = torch.tensor(f["cu"], dtype=f.get("cu_dtype", torch.int32))
    if "initial_state" in x:
        kw["initial_state"] = x["initial_state"]
    if f.get("final", True):
        kw["output_final_state"] = True
    g = {} if "g" not in x else {"gk" if name == "fused_recurrent_gla" else "g": x["g"]}
    fn = getattr(linattn, name)
    if f.get("positional"):        # fla's (q, k, v) or (q, k, v, g) positionally
        return fn(x["q"], x["k"], x["v"], *g.values(), **kw)
    return fn(q=x["q"], k=x["k"], v=x["v"], **g, **kw)


def _additive_reference(f, x, N):
    fam = f["fam"]
    h0 = x.get("initial_state")
    if h0 is not None and f.get("vfirst"):
        h0 = h0.transpose(-1, -2)
    scale, normalize = f.get("scale"), f.get("kw", {}).get("normalize", fam == "la"
                                                            and "chunk" in f["fn"])
    B, T, H = x["q"].shape[:3]
    if fam == "gla":
        naive = fla_fn("fla.ops.gla.naive", "naive_recurrent_gla")

        def ref(q, k, v, g, initial_state):
            return naive(q, k, v, g, initial_state=initial_state, output_final_state=True)
    elif fam == "la":
        naive = fla_fn("fla.ops.linear_attn.naive", "naive_recurrent_linear_attn")

        def ref(q, k, v, initial_state):
            return naive(q, k, v, scale=scale, initial_state=initial_state,
                         output_final_state=True, normalize=normalize)
    else:
        naive = fla_fn("fla.ops.simple_gla.naive", "naive_recurrent_simple_gla")

        def ref(q, k, v, g, initial_state):
            return naive(q, k, v, g, scale=scale, initial_state=initial_state,
                         output_final_state=True)
    y = dict(q=x["q"], k=x["k"], v=x["v"])
    if fam in ("ret", "light"):
        y["g"] = _fixed_gate(fam, B, T, H)
    elif fam != "la":
        y["g"] = x["g"] if "g" in x else torch.zeros(B, T, H)
    if f.get("cu") is None:
        return ref(**y, initial_state=h0)
    return per_sequence(ref, f["cu"], y, h0, ("q", "k", "v", "g"))


A_ = "gla"
ADDITIVE_FORMS = {
    # --- test_gla.py
    "gla-fused-f32-train": dict(fam=A_, fn="fused_recurrent_gla", dtype=F32, h0_rand=True,
                                norm=10.0, train=True),
    "gla-fused-f16": dict(fam=A_, fn="fused_recurrent_gla", dtype=F16, h0_rand=True, norm=0.1),
    "gla-fused-f32-vfirst-train": dict(fam=A_, fn="fused_recurrent_gla", dtype=F32, h0_rand=True,
                                       vfirst=True, train=True),
    "gla-fused-f32-varlen-train": dict(fam=A_, fn="fused_recurrent_gla", dtype=F32, h0_rand=True,
                                       cu=[0, 1, 20, 47], train=True),
    "gla-fused-f16-varlen": dict(fam=A_, fn="fused_recurrent_gla", dtype=F16, h0_rand=True,
                                 cu=[0, 15, 40], K=60),
    "gla-chunk-f16": dict(fam=A_, fn="chunk_gla", dtype=F16, h0_rand=True, K=60),
    "gla-chunk-f16-K320": dict(fam=A_, fn="chunk_gla", dtype=F16, h0_rand=True, B=1, K=320, T=20),
    "gla-chunk-bf16-K512": dict(fam=A_, fn="chunk_gla", dtype=BF, h0_rand=True, B=1, K=512, T=20,
                                H=1),
    "gla-chunk-f32-vfirst-train": dict(fam=A_, fn="chunk_gla", dtype=F32, h0_rand=True,
                                       vfirst=True, train=True),
    "gla-chunk-f16-vfirst": dict(fam=A_, fn="chunk_gla", dtype=F16, h0_rand=True, vfirst=True),
    "gla-chunk-f16-varlen-empty": dict(fam=A_, fn="chunk_gla", dtype=F16, h0_rand=True,
                                       cu=[0, 0, 16]),
    "gla-chunk-f16-varlen": dict(fam=A_, fn="chunk_gla", dtype=F16, h0_rand=True,
                                 cu=[0, 15, 30, 70], K=60),
    # --- test_simple_gla.py
    "sgla-fused-f32-train": dict(fam="sgla", fn="fused_recurrent_simple_gla", dtype=F32,
                                 scale=0.1, norm=0.1, train=True),
    "sgla-fused-f16": dict(fam="sgla", fn="fused_recurrent_simple_gla", dtype=F16, scale=1.0,
                           norm=10.0),
    "sgla-fused-f32-vfirst-train": dict(fam="sgla", fn="fused_recurrent_simple_gla", dtype=F32,
                                        vfirst=True, train=True),
    "sgla-fused-f32-varlen-train": dict(fam="sgla", fn="fused_recurrent_simple_gla", dtype=F32,
                                        scale=0.1, cu=[0, 15, 40, 63], K=60, train=True),
    "sgla-chunk-f16-f32g": dict(fam="sgla", fn="chunk_simple_gla", dtype=F16, g_dtype=F32,
                                h0_rand=True, scale=0.1, K=60),
    "sgla-chunk-f16-cs16": dict(fam="sgla", fn="chunk_simple_gla", dtype=F16, g_dtype=F32,
                                scale=0.1, kw=dict(chunk_size=16)),
    "sgla-chunk-f16-cs32": dict(fam="sgla", fn="chunk_simple_gla", dtype=F16, g_dtype=F32,
                                scale=0.1, kw=dict(chunk_size=32)),
    "sgla-chunk-f16-vfirst": dict(fam="sgla", fn="chunk_simple_gla", dtype=F16, h0_rand=True,
                                  vfirst=True),
    "sgla-chunk-f16-varlen": dict(fam="sgla", fn="chunk_simple_gla", dtype=F16,
                                  cu=[0, 15, 40, 63]),
    "sgla-fusedchunk-f16": dict(fam="sgla", fn="fused_chunk_simple_gla", dtype=F16, g_dtype=F32,
                                h0_rand=True, scale=0.1),
    "sgla-fusedchunk-f16-varlen": dict(fam="sgla", fn="fused_chunk_simple_gla", dtype=F16,
                                       cu=[0, 15, 40, 63]),
    "sgla-chunk-mamba-positional-f32": dict(fam="sgla", fn="chunk_simple_gla", dtype=F32,
                                            positional=True, scale=1.0, h0=None, K=64, V=16),
    "sgla-chunk-mamba-positional-f16": dict(fam="sgla", fn="chunk_simple_gla", dtype=F16,
                                            positional=True, scale=1.0, h0=None, K=64, V=16),
    # --- test_retention.py (states in q's dtype, V = 2 K)
    "ret-chunk-f16-f16h0": dict(fam="ret", fn="chunk_retention", dtype=F16, h0=F16, V=64,
                                positional=True, K=60),
    "ret-chunk-f16-cs16": dict(fam="ret", fn="chunk_retention", dtype=F16, h0=F16,
                               positional=True, kw=dict(chunk_size=16)),
    "ret-fused-f16": dict(fam="ret", fn="fused_recurrent_retention", dtype=F16, h0=F16, V=64,
                          positional=True),
    "ret-chunk-f16-varlen-i64": dict(fam="ret", fn="chunk_retention", dtype=F16, h0=F16, V=64,
                                     cu=[0, 15, 40, 63], cu_dtype=torch.int64),
    "ret-fusedchunk-f16-varlen-i64": dict(fam="ret", fn="fused_chunk_retention", dtype=F16,
                                          h0=F16, cu=[0, 15, 40, 63], cu_dtype=torch.int64),
    "ret-fused-f16-vfirst": dict(fam="ret", fn="fused_recurrent_retention", dtype=F16, h0=F16,
                                 V=64, vfirst=True, positional=True),
    # --- test_linear_attn.py
    "la-fused-f32-train": dict(fam="la", fn="fused_recurrent_linear_attn", dtype=F32, scale=0.1,
                               positional=True, kw=dict(normalize=False), train=True),
    "la-fused-f16-K256": dict(fam="la", fn="fused_recurrent_linear_attn", dtype=F16, K=256,
                              positional=True, B=1, T=20, kw=dict(normalize=False)),
    "la-chunk-f16": dict(fam="la", fn="chunk_linear_attn", dtype=F16, K=60,
                         kw=dict(normalize=False)),
    "la-fusedchunk-f16-K256": dict(fam="la", fn="fused_chunk_linear_attn", dtype=F16, K=256,
                                   B=1, T=20, kw=dict(normalize=False)),
    # --- test_lightning_attn.py (states in q's dtype)
    "light-fused-f16": dict(fam="light", fn="fused_recurrent_lightning_attn", dtype=F16, h0=F16),
    "light-chunk-f16-cs32": dict(fam="light", fn="chunk_lightning_attn", dtype=F16, h0=F16,
                                 kw=dict(chunk_size=32)),
}


@pytest.mark.parametrize("fid", list(ADDITIVE_FORMS))
def test_additive_forms(cpu_ops, fid):
    """GLA, simple GLA, retention, linear attention, lightning attention: o and the final
    state of each fla form against fla's naive recurrence (simple GLA's for retention and
    lightning, with fla's decays); float32 training forms: every gradient too."""
    f = ADDITIVE_FORMS[fid]
    x, N = _additive_inputs(f)
    train = f.get("train", False)
    leaves, ref_leaves = leaves_of(x, train), leaves_of(x, train)
    o, ht = _additive_call(f, leaves)
    o_r, ht_r = _additive_reference(f, ref_leaves, N)
    dt = f["dtype"]
    assert o.dtype == dt and (ht is None or ht.dtype == F32), (o.dtype, ht.dtype)
    close("o", o, o_r, tol_of(dt))
    if f.get("vfirst"):
        ht = ht.transpose(-1, -2)
    close("ht", ht, ht_r, tol_of(dt))
    if train:
        randn, _ = gen(7)
        do, dht = randn(*o.shape), randn(*ht_r.shape)
        loss_of(o, ht, do, dht).backward()
        loss_of(o_r, ht_r, do, dht).backward()
        grads_vs(leaves, ref_leaves, list(x), 1e-4)


@pytest.fixture
def additive_fakes(monkeypatch):
    """16-bit training of the additive rule on the CPU: the backward's stages by their fp64
    math and the training forward by the fp64 reference rounded as the kernels store it
    (tests/test_additive_bwd.py's fakes)."""
    import test_additive_bwd as m
    from linattn.ops import additive_bwd

    def install(spec, H, K, V):
        m.install_fakes(monkeypatch, spec, H, H, K, V)
        monkeypatch.setattr(additive_bwd, "run_forward", m._reference_forward)
    return install


ADD_SPEC = {"gla": "gla", "sgla": "simple_gla", "ret": "retention", "la": "linear_attn",
            "light": "lightning"}
TRAIN16_ADD = ["gla-fused-f16", "gla-chunk-f16-vfirst", "gla-chunk-f16-varlen-empty",
               "sgla-fused-f16", "sgla-chunk-f16-cs16", "sgla-fusedchunk-f16-varlen",
               "ret-chunk-f16-cs16", "ret-fused-f16-vfirst", "ret-chunk-f16-varlen-i64",
               "la-chunk-f16-K32", "light-fused-f16", "light-chunk-f16-cs32"]
ADDITIVE_FORMS["la-chunk-f16-K32"] = dict(fam="la", fn="chunk_linear_attn", dtype=F16,
                                          kw=dict(normalize=False))


@pytest.mark.parametrize("fid", TRAIN16_ADD)
def test_additive_16bit_training_forms(additive_fakes, fid):
    """fla's 16-bit training forms of the additive families (16-bit initial states that
    need gradients included): o, the final state and every gradient, in its input's
    dtype, against torch autograd of fla's naive recurrence."""
    from linattn.ops import lightning, retention
    f = ADDITIVE_FORMS[fid]
    x, N = _additive_inputs(f)
    spec = {"ret": retention.SPEC, "light": lightning.SPEC}.get(f["fam"]) or get_spec(
        ADD_SPEC[f["fam"]])
    additive_fakes(spec, x["q"].shape[2], x["q"].shape[3], x["v"].shape[3])
    leaves, ref_leaves = leaves_of(x, True), leaves_of(x, True)
    o, ht = _additive_call(f, leaves)
    o_r, ht_r = _additive_reference(f, ref_leaves, N)
    ht = ht.transpose(-1, -2) if f.get("vfirst") else ht
    tol = 2 * tol_of(f["dtype"])
    close("o", o, o_r, tol)
    close("ht", ht, ht_r, tol)
    randn, _ = gen(7)
    do, dht = randn(*o.shape), randn(*ht_r.shape)
    loss_of(o, ht, do, dht).backward()
    loss_of(o_r, ht_r, do, dht).backward()
    grads_vs(leaves, ref_leaves, list(x), 4 * tol)


# ------------------------------------------------------------------ parallel_*, normalize
@pytest.mark.parametrize("dtype, train", [(F16, False), (F32, True)])
def test_parallel_simple_gla_form(cpu_ops, dtype, train):
    """fla's test_parallel: parallel_simple_gla(q=, k=, v=, g=, scale=, output_attentions=True)
    -> (o, A) against naive_parallel_simple_gla's (o, A [B, H, T, T]); o trains."""
    naive = fla_fn("fla.ops.simple_gla.naive", "naive_parallel_simple_gla")
    f = dict(fam="sgla", dtype=dtype, K=64, T=40)
    x, _ = _additive_inputs(dict(f, h0=None))
    leaves, ref_leaves = leaves_of(x, train), leaves_of(x, train)
    o, A = linattn.parallel_simple_gla(**leaves, scale=0.1, output_attentions=True)
    o_r, A_r = naive(**ref_leaves, scale=0.1)
    assert o.dtype == dtype and A.dtype == F32 and A.shape == A_r.shape
    close("o", o, o_r, tol_of(dtype))
    close("A", A, A_r, 1e-5)
    if train:
        do = gen(3)[0](*o.shape)
        (o * do).sum().backward()
        (o_r * do).sum().backward()
        grads_vs(leaves, ref_leaves, list(x), 1e-4)


def test_parallel_varlen_and_retention_forms(cpu_ops):
    """fla's test_parallel_varlen (parallel_simple_gla(q=, k=, v=, g=, cu_seqlens=) -> (o,
    None)) and test_parallel of retention (parallel_retention(q, k, v) -> (o, None)), against
    fla's naive_recurrent_simple_gla per sequence and naive_retention."""
    f = dict(fam="sgla", dtype=F16, cu=[0, 15, 40, 63], h0=None)
    x, N = _additive_inputs(f)
    o, none = linattn.parallel_simple_gla(**x, cu_seqlens=torch.tensor(f["cu"], dtype=torch.int32))
    assert none is None
    close("o", o, _additive_reference(f, x, N)[0], tol_of(F16))
    naive = fla_fn("fla.ops.retention.naive", "naive_retention")
    x, _ = _additive_inputs(dict(fam="ret", dtype=F16, V=64, h0=None))
    o, none = linattn.parallel_retention(x["q"], x["k"], x["v"])
    want = naive(*(t.transpose(1, 2) for t in (x["q"], x["k"], x["v"]))).transpose(1, 2)
    assert none is None
    close("o", o, want, tol_of(F16))


LA_FNS = ["fused_recurrent_linear_attn", "fused_chunk_linear_attn", "chunk_linear_attn"]


@pytest.mark.parametrize("fn", LA_FNS)
def test_linear_attn_normalize_forms(cpu_ops, fn):
    """fla's test_normalize_split_resume / test_normalize_grad / test_normalize_zinit_grad
    (float32): fn(q=, k=, v=, normalize=True[, output_final_state=True]) and resuming from
    the returned (kv_state, z_state) with initial_state=; o and q, k, v's gradients against
    fla's naive_recurrent_linear_attn(normalize=True)."""
    naive = fla_fn("fla.ops.linear_attn.naive", "naive_recurrent_linear_attn")
    x, _ = _additive_inputs(dict(fam="la", dtype=F32, positive=True, h0=None, T=40))
    call = getattr(linattn, fn)
    leaves, ref_leaves, split_leaves = (leaves_of(x, True) for _ in range(3))
    o, _ = call(**leaves, normalize=True)
    o_r, _ = naive(**ref_leaves, normalize=True)
    close("o", o, o_r, 1e-4)
    s = 17
    o_a, state_a = call(**{n: t[:, :s] for n, t in split_leaves.items()},
                        output_final_state=True, normalize=True)
    assert isinstance(state_a, tuple) and len(state_a) == 2
    o_b, state_b = call(**{n: t[:, s:] for n, t in split_leaves.items()}, initial_state=state_a,
                        output_final_state=True, normalize=True)
    o_split = torch.cat([o_a, o_b], 1)
    close("o_split", o_split, o_r, 1e-4)
    do = gen(3)[0](*o.shape)
    for out in (o, o_split):
        (out * do).sum().backward()
    (o_r * do).sum().backward()
    grads_vs(leaves, ref_leaves, list(x), 1e-4)
    grads_vs(split_leaves, ref_leaves, list(x), 1e-4)


# ------------------------------------------------------------------ Comba, GDN-2, DPLR, IPLR
def _trains(leaves, *outs):
    """fla's tests of these families train (16-bit through the generated backward, here its
    emulators; float32 exactly in torch, ops/exact_train.py): every input that needs one
    gets a finite gradient of its dtype."""
    sum(o.float().sum() for o in outs if o is not None).backward()
    for n, t in leaves.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            assert t.grad is not None and t.grad.dtype == t.dtype, n
            assert bool(torch.isfinite(t.grad).all()), n


COMBA_FORMS = {
    "fused-f32-grad-inputs": dict(fn="fused_recurrent_comba", dtype=F32, scale=0.1, norm=10.0),
    "fused-f16-grad-inputs": dict(fn="fused_recurrent_comba", dtype=F16, scale=1.0, norm=0.1),
    "chunk-f16-l2k-train": dict(fn="chunk_comba", dtype=F16, scale=0.1, l2=True, train=True,
                                mask=True, h0_zeros=True),
    "chunk-f16-l2out-train": dict(fn="chunk_comba", dtype=F16, scale=1.0, train=True, K=60,
                                  h0_zeros=True),
    "chunk-f16-varlen-f16h0": dict(fn="chunk_comba", dtype=F16, cu=[0, 15, 40, 63], h0=F16,
                                   g_dtype=F16, train=True),
}


@pytest.mark.parametrize("fid", list(COMBA_FORMS))
def test_comba_forms(cpu_ops, monkeypatch, fid):
    """fla's test_comba: fused_recurrent_comba / chunk_comba with keywords (q, k, v, p, beta,
    g), inputs that require grad; o and the final state against fla's naive_chunk_comba
    (per sequence with varlen), the reference fla's tests use for both functions (its
    naive_recurrent_comba reads the state after the token's decay, which fla's kernels
    do not)."""
    f = COMBA_FORMS[fid]
    if f["dtype"] != F32:   # (16-bit inputs that need gradients: the generated backward's emulators)
        import test_comba_bwd
        test_comba_bwd.install_comba_fakes(monkeypatch)
    naive = fla_fn("fla.ops.comba.naive", "naive_chunk_comba")
    randn, rand = gen(2)
    dt, K, cu = f["dtype"], f.get("K", 32), f.get("cu")
    B, T, H = (1, cu[-1], 2) if cu else (2, 37, 2)
    N = B if cu is None else len(cu) - 1
    unit = lambda *s: F.normalize(randn(*s), p=2, dim=-1).to(dt)  # noqa: E731
    x = dict(q=unit(B, T, H, K), k=unit(B, T, H, K), v=randn(B, T, H, K, dtype=dt),
             p=unit(B, T, H, K), beta=rand(B, T, H).sigmoid().to(dt))
    if f.get("l2"):
        x.update(q=randn(B, T, H, K, dtype=dt), k=randn(B, T, H, K, dtype=dt),
                 p=randn(B, T, H, K, dtype=dt))
    g = F.logsigmoid(rand(B, T, H)) / f.get("norm", 1.0)
    x["g"] = (g * (rand(B, T, H) > 0.5) if f.get("mask") else g).to(f.get("g_dtype", F32))
    h0 = torch.zeros(N, H, K, K) if f.get("h0_zeros") else randn(N, H, K, K, dtype=f.get("h0", F32))
    leaves = leaves_of(dict(x, initial_state=h0), True)
    kw = dict(output_final_state=True)
    if "scale" in f:
        kw["scale"] = f["scale"]
    if f.get("l2"):
        kw["use_qk_l2norm_in_kernel"] = True
    if cu:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    o, ht = getattr(linattn, f["fn"])(**leaves, **kw)
    assert o.dtype == dt and ht.dtype == F32
    y = {n: t.detach() for n, t in leaves.items() if n != "initial_state"}
    if f.get("l2"):
        y.update({n: F.normalize(y[n].float(), p=2, dim=-1) for n in "qkp"})

    def ref(q, k, v, p, beta, g, initial_state):
        return naive(q=q, k=k, v=v, p=p, beta=beta, g=g, scale=f.get("scale"),
                     initial_state=initial_state, output_final_state=True)
    o_r, ht_r = (ref(**y, initial_state=h0) if cu is None else
                 per_sequence(ref, cu, y, h0, tuple(y)))
    close("o", o, o_r, tol_of(dt))
    close("ht", ht, ht_r, tol_of(dt))
    if f.get("train"):
        _trains(leaves, o, ht)


def _gdn2_inputs(B, T, H, K, V, dtype, gik=False, seed=3, mild=False):
    """fla's test_gdn2 _rand_inputs: g a contracting log decay U(-5, -0.1) (raw N(0, 1)
    with the gate in the kernel, A_log log U(1, 16), dt_bias [H * K]); mild: A_log log
    U(0.01, 0.06) (the 16-bit training forms' emulators run the chunked fp64 reference,
    whose in-chunk factors pass e^709 at fla's strength)."""
    randn, rand = gen(seed)
    x = dict(q=randn(B, T, H, K, dtype=dtype), k=randn(B, T, H, K, dtype=dtype),
             v=(randn(B, T, H, V) * 0.5).to(dtype), b=rand(B, T, H, K, dtype=dtype),
             w=rand(B, T, H, V, dtype=dtype))
    if gik:
        A = rand(H) * 0.05 + 0.01 if mild else rand(H) * 15 + 1
        x.update(g=randn(B, T, H, K, dtype=dtype), A_log=torch.log(A), dt_bias=randn(H * K))
    else:
        x["g"] = (rand(B, T, H, K) * -4.9 - 0.1).to(dtype)
    return x


GDN2_FORMS = {
    "fused-f32": dict(fn="fused_recurrent_gdn2", dtype=F32, scale=0.5),
    "fused-f32-l2k": dict(fn="fused_recurrent_gdn2", dtype=F32, scale=1.0, l2=True),
    "fused-f16-l2k-V64": dict(fn="fused_recurrent_gdn2", dtype=F16, scale=1.0, l2=True, V=64),
    "fused-gik-nobias": dict(fn="fused_recurrent_gdn2", dtype=F32, l2=True,
                             gik=dict(dt_bias=False)),
    "fused-gik-lb-noA-nobias": dict(fn="fused_recurrent_gdn2", dtype=F32, l2=True,
                                    gik=dict(A_log=False, dt_bias=False, lower_bound=-5.0)),
    "fused-vfirst": dict(fn="fused_recurrent_gdn2", dtype=F32, vfirst=True, h0=False),
    "fused-h0-l2k": dict(fn="fused_recurrent_gdn2", dtype=F32, l2=True, h0=True),
    "fused-varlen-i64": dict(fn="fused_recurrent_gdn2", dtype=F32, l2=True, h0=True,
                             cu=[0, 15, 40, 64]),
    "chunk-f32-train": dict(fn="chunk_gdn2", dtype=F32, scale=0.5, l2=True, h0=True, train=True),
    "chunk-f16-train": dict(fn="chunk_gdn2", dtype=F16, l2=True, h0=True, train=True),
    "chunk-gik-safe-train": dict(fn="chunk_gdn2", dtype=F32, l2=True, h0=True, train=True,
                                 gik=dict(safe_gate=True, lower_bound=-5.0)),
    "chunk-vfirst-h0": dict(fn="chunk_gdn2", dtype=F32, l2=True, h0=True, vfirst=True),
    "chunk-f16-varlen-gik-cpu": dict(fn="chunk_gdn2", dtype=F16, l2=True, h0=True, train=True,
                                     gik={}, cu=[0, 15, 40, 64], cu_cpu=True),
}


@pytest.mark.parametrize("fid", list(GDN2_FORMS))
def test_gdn2_forms(cpu_ops, monkeypatch, fid):
    """fla's test_gdn2: fused_recurrent_gdn2 / chunk_gdn2 with keywords (q, k, v, g, b, w),
    the gate in the kernel (A_log / dt_bias optional with lower_bound), state_v_first,
    varlen (int64 offsets, cu_seqlens_cpu): o and the final state against fla's
    naive_recurrent_gdn2 (gates by naive_kda_gate / naive_kda_lowerbound_gate)."""
    f = GDN2_FORMS[fid]
    if f.get("train") and f["dtype"] != F32:   # (the generated backward's emulators)
        import test_gdn2_bwd
        test_gdn2_bwd.install_gdn2_fakes(monkeypatch)
    naive = fla_fn("fla.ops.gdn2.naive", "naive_recurrent_gdn2")
    dt, cu, gik = f["dtype"], f.get("cu"), f.get("gik")
    B, T, H, K, V = 2, 37, 2, 32, f.get("V", 32)
    if cu:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    fakes = f.get("train") and dt != F32
    x = _gdn2_inputs(B, T, H, K, V, dt, gik is not None, mild=fakes)
    if gik is not None:
        for n in ("A_log", "dt_bias"):
            if gik.get(n, True) is False:
                x.pop(n)
    if f.get("h0"):
        x["initial_state"] = gen(4)[0](N, H, K, V)
    if f.get("vfirst") and "initial_state" in x:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    leaves = leaves_of(x, f.get("train", False))
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=bool(f.get("l2")))
    for n in ("scale",):
        if n in f:
            kw[n] = f[n]
    if gik is not None:
        kw.update(use_gate_in_kernel=True, **{n: gik[n] for n in ("safe_gate", "lower_bound")
                                             if n in gik})
    if f.get("vfirst"):
        kw["state_v_first"] = True
    if cu:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
        if f.get("cu_cpu"):
            kw["cu_seqlens_cpu"] = torch.tensor(cu, dtype=torch.int64)
    o, ht = getattr(linattn, f["fn"])(**leaves, **kw)
    assert o.dtype == dt and ht.dtype == F32
    y = {n: t for n, t in x.items() if n not in ("A_log", "dt_bias", "initial_state")}
    if gik is not None:
        lb = gik.get("lower_bound")
        y["g"] = (fla_fn("fla.ops.kda.gate", "naive_kda_lowerbound_gate")(
            y["g"].float(), x.get("A_log"), x.get("dt_bias"), lower_bound=lb) if lb is not None
            else fla_fn("fla.ops.kda.gate", "naive_kda_gate")(y["g"].float(), x["A_log"],
                                                               x.get("dt_bias")))
    if f.get("l2"):
        y.update(q=F.normalize(y["q"].float(), p=2, dim=-1), k=F.normalize(y["k"].float(), p=2,
                                                                           dim=-1))
    h0 = x.get("initial_state")
    if h0 is not None and f.get("vfirst"):
        h0 = h0.transpose(-1, -2)

    def ref(q, k, v, g, b, w, initial_state):
        return naive(q=q, k=k, v=v, g=g, b=b, w=w, scale=f.get("scale"),
                     initial_state=initial_state, output_final_state=True)
    o_r, ht_r = ref(**y, initial_state=h0) if cu is None else per_sequence(ref, cu, y, h0, tuple(y))
    close("o", o, o_r, tol_of(dt))
    close("ht", ht.transpose(-1, -2) if f.get("vfirst") else ht, ht_r, tol_of(dt))
    if f.get("train"):
        _trains(leaves, o, ht)


def _dplr_reference(q, k, v, a, b, gk, scale=None, initial_state=None, cu=None):
    """fla's dplr_recurrence / iplr_recurrence (gk None), head-first, scale K^-0.5 (other
    scales by q's), per sequence with varlen."""
    K = q.shape[-1]
    dplr = fla_fn("fla.ops.generalized_delta_rule.dplr.naive", "dplr_recurrence")
    iplr = fla_fn("fla.ops.generalized_delta_rule.iplr.naive", "iplr_recurrence")
    q = q.float() * ((K ** -0.5 if scale is None else scale) / K ** -0.5)

    def ref(q, k, v, a, b, gk, initial_state):
        hf = [t.transpose(1, 2).float() for t in (q, k, v, a, b)]
        if gk is None:
            o, S = iplr(*hf, initial_state=initial_state, output_final_state=True)
        else:
            o, S = dplr(*hf, gk.transpose(1, 2).float(), initial_state=initial_state,
                        output_final_state=True)
        return o.transpose(1, 2), S
    y = dict(q=q, k=k, v=v, a=a, b=b, gk=gk)
    if cu is None:
        return ref(**y, initial_state=initial_state)
    seq = tuple(n for n in y if y[n] is not None)
    return per_sequence(ref, cu, y, initial_state, seq)


DPLR_FORMS = {
    "dplr-fused-f32": dict(fn="fused_recurrent_dplr_delta_rule", dtype=F32, scale=1.0, norm=4.0),
    "dplr-fused-f32-K60": dict(fn="fused_recurrent_dplr_delta_rule", dtype=F32, scale=0.1, K=60,
                               norm=4.0),
    "dplr-chunk-f16-safe-cs16-train": dict(fn="chunk_dplr_delta_rule", dtype=F16, scale=1.0,
                                           train=True, clamp=-5.0,
                                           kw=dict(safe_gate=True, chunk_size=16,
                                                   disable_recompute=False)),
    "dplr-chunk-f16-cs64-recompute": dict(fn="chunk_dplr_delta_rule", dtype=F16, scale=0.1,
                                          train=True, norm=0.1, mask=True,
                                          kw=dict(safe_gate=False, chunk_size=64,
                                                  disable_recompute=True)),
    "dplr-chunk-f16-positional": dict(fn="chunk_dplr_delta_rule", dtype=F16, scale=1.0,
                                      positional=True, train=True,
                                      kw=dict(safe_gate=True, chunk_size=16)),
    "dplr-chunk-f16-varlen": dict(fn="chunk_dplr_delta_rule", dtype=F16, cu=[0, 15, 40, 63],
                                  train=True, clamp=-5.0, kw=dict(safe_gate=True, chunk_size=32)),
    "iplr-fused-f32-train": dict(fn="fused_recurrent_iplr_delta_rule", dtype=F32, scale=0.1,
                                 train=True, h0_zeros=True),
    "iplr-chunk-f16-grad-inputs": dict(fn="chunk_iplr_delta_rule", dtype=F16, scale=1.0,
                                       grad_inputs=True, h0_zeros=True),
    "iplr-chunk-f32-cs16": dict(fn="chunk_iplr_delta_rule", dtype=F32, scale=0.1,
                                h0_zeros=True, kw=dict(chunk_size=16)),
}


@pytest.mark.parametrize("fid", list(DPLR_FORMS))
def test_dplr_iplr_forms(cpu_ops, fid):
    """fla's test_dplr_delta / test_iplr_delta: keywords (q, k, v, a, b[, gk]), a normalised
    and b = -a, safe_gate / chunk_size / disable_recompute, varlen, positional: o and the
    final state against fla's dplr_recurrence / iplr_recurrence."""
    f = DPLR_FORMS[fid]
    randn, rand = gen(5)
    dt, cu, K = f["dtype"], f.get("cu"), f.get("K", 32)
    B, T, H = (1, cu[-1], 2) if cu else (2, 37, 2)
    N = B if cu is None else len(cu) - 1
    a = F.normalize(rand(B, T, H, K, dtype=dt), p=2, dim=-1)
    x = dict(q=randn(B, T, H, K, dtype=dt), k=randn(B, T, H, K, dtype=dt),
             v=randn(B, T, H, K, dtype=dt), a=a, b=-a)
    if f["fn"].startswith(("chunk_dplr", "fused_recurrent_dplr")):
        gk = F.logsigmoid(randn(B, T, H, K)) / f.get("norm", 1.0)
        if f.get("mask"):
            gk = gk * (rand(B, T, H, K) > 0.5)
        x["gk"] = gk.clamp(f["clamp"], 0) if "clamp" in f else gk
    x["initial_state"] = torch.zeros(N, H, K, K) if f.get("h0_zeros") else randn(N, H, K, K)
    leaves = leaves_of(x, f.get("train", False) or f.get("grad_inputs", False))
    kw = dict(f.get("kw", {}), output_final_state=True)
    if cu:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    fn = getattr(linattn, f["fn"])
    if f.get("positional"):
        o, ht = fn(*(leaves[n] for n in ("q", "k", "v", "a", "b", "gk")), scale=f["scale"],
                   initial_state=leaves["initial_state"], **kw)
    else:
        o, ht = fn(**leaves, scale=f.get("scale"), **kw)
    assert o.dtype == dt and ht.dtype == F32
    o_r, ht_r = _dplr_reference(x["q"], x["k"], x["v"], x["a"], x["b"], x.get("gk"),
                                f.get("scale"), x["initial_state"], cu)
    close("o", o, o_r, tol_of(dt))
    close("ht", ht, ht_r, tol_of(dt))
    if f.get("train"):
        _trains(leaves, o, ht)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_rwkv7_forms(cpu_ops, chunk_size):
    """fla's test_rwkv7: chunk_rwkv7(r=, w=, k=, v=, a=, b=, output_final_state=True,
    chunk_size=) equals chunk_dplr_delta_rule(q=r, ..., gk=w, scale=1.0); and
    fused_mul_recurrent_rwkv7(r=, w=, k=, v=, kk=, a=, scale=, initial_state=,
    output_final_state=True) equals fused_recurrent_dplr_delta_rule with a = -kk,
    b = kk * a (fla's test_fused_mul_recurrent_fwd); both against fla's dplr_recurrence."""
    randn, rand = gen(6)
    B, T, H, D = 1, 40, 2, 32
    u = lambda lo, hi: rand(B, T, H, D) * (hi - lo) + lo  # noqa: E731
    r, k, v, w = u(-8, -6), u(-8, -6), u(-8, -6), u(-8, -6)
    kk = F.normalize(u(-1, 1), dim=-1)
    a, b = -kk, kk * u(0, 0.1)
    o, ht = linattn.chunk_rwkv7(r=r, w=w, k=k, v=v, a=a, b=b, output_final_state=True,
                                chunk_size=chunk_size)
    o2, ht2 = linattn.chunk_dplr_delta_rule(q=r, k=k, v=v, a=a, b=b, gk=w, scale=1.0,
                                            output_final_state=True, chunk_size=chunk_size)
    o_r, ht_r = _dplr_reference(r, k, v, a, b, w, 1.0)
    for got, ght in ((o, ht), (o2, ht2)):
        close("o", got, o_r, 1e-4)
        close("ht", ght, ht_r, 1e-4)
    a_scale = u(0, 0.1)
    h0 = randn(B, H, D, D)
    for scale in (None, 1.0):
        o, ht = linattn.fused_mul_recurrent_rwkv7(r=r, w=w, k=k, v=v, kk=kk, a=a_scale,
                                                  scale=scale, initial_state=h0,
                                                  output_final_state=True)
        o_r, ht_r = _dplr_reference(r, k, v, -kk, kk * a_scale, w, scale, h0)
        close("o", o, o_r, 1e-4)
        close("ht", ht, ht_r, 1e-4)


# ------------------------------------------------------------------ KDA's intermediate states
def test_kda_return_intermediate_states_form(cpu_ops, monkeypatch):
    """fla's test_chunk_return_intermediate_states (bf16, under inference_mode,
    initial_state=None, disable_recompute=False; equal lengths and varlen with int64
    offsets): (o, final_state, h), h [B, NT, H, K, V] in q's dtype ([1, NT_total, ...]
    with cu_seqlens), h[:, c] the state entering chunk c: against fla's naive_recurrent_kda
    on the first 64 c tokens. (The training forward that keeps h is replaced by the fp64
    chunked reference on the CPU.)"""
    from linattn.ops import autograd

    def train_forward(spec, q, k, v, g, beta, *, options, scale, initial_state,
                      output_final_state, cu_seqlens, **kw):
        r = tr.chunked_forward(spec, q, k, v, g, beta, options=options,
                               scale=spec.scale_for(q.shape[-1], scale),
                               initial_state=initial_state, cu_seqlens=cu_seqlens,
                               intermediates=True)
        h = r["h"].transpose(-1, -2) if options.state_v_first else r["h"]
        return (r["o"].to(q.dtype), r["final_state"].float() if output_final_state else None,
                {"h": h.flatten(0, 1).to(q.dtype)})
    monkeypatch.setattr(autograd, "train_forward", train_forward)
    naive = fla_fn("fla.ops.kda.naive", "naive_recurrent_kda")
    randn, rand = gen(8)
    B, T, H, D = 2, 150, 2, 32
    x = dict(q=randn(B, T, H, D, dtype=BF), k=randn(B, T, H, D, dtype=BF),
             v=randn(B, T, H, D, dtype=BF), g=F.logsigmoid(randn(B, T, H, D)).to(BF) / 4,
             beta=rand(B, T, H, dtype=BF))
    with torch.inference_mode():
        o, ht, h = linattn.chunk_kda(**x, initial_state=None, output_final_state=True,
                                     return_intermediate_states=True, disable_recompute=False)
        assert o.shape == (B, T, H, D) and ht.shape == (B, H, D, D) and ht.dtype == F32
        assert h.shape == (B, 3, H, D, D) and h.dtype == BF
        assert not h[:, 0].float().abs().max() > 0          # (no initial state)
        for c in (1, 2):
            want = naive(**{n: t[:, :64 * c] for n, t in x.items()}, output_final_state=True)[1]
            close(f"h{c}", h[:, c], want, 1e-2)
        cu = torch.tensor([0, 75, 150], dtype=torch.long)
        xv = {n: t[:1] for n, t in x.items()}
        ov, htv, hv = linattn.chunk_kda(**xv, initial_state=None, output_final_state=True,
                                        cu_seqlens=cu, return_intermediate_states=True,
                                        disable_recompute=False)
        assert ov.shape == (1, T, H, D) and htv.shape == (2, H, D, D)
        assert hv.shape == (1, 4, H, D, D) and hv.dtype == BF
        second = naive(**{n: t[:, 75:75 + 64] for n, t in xv.items()}, output_final_state=True)[1]
        close("h_varlen", hv[:, 3], second, 1e-2)



# ------------------------------------------------------------------ Mamba-2
def test_simple_gla_to_mamba2_form(cpu_ops, monkeypatch):
    """fla's test_simple_gla_to_mamba2: mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size,
    D=None, return_final_states=True) (six positional, chunk_size 8, float32 and float16
    throughout) and chunk_simple_gla(q=C, k=B, v=x, g=A dt, scale=1.0) agree, and with fla's
    naive_recurrent_simple_gla; the final state [b, h, headdim, dstate] is the transposed
    simple GLA one. (The chunked kernels that form Mamba-2's terms are replaced by
    tests/test_call_terms_chunk.py's fp64 model.)"""
    import test_call_terms_chunk
    from linattn.ops import mamba2
    monkeypatch.setattr(mamba2, "_chunk_kernel", test_call_terms_chunk._chunk_model)
    naive = fla_fn("fla.ops.simple_gla.naive", "naive_recurrent_simple_gla")
    for dtype in (F32, F16):
        randn, rand = gen(9)
        b, T, H, P, N = 2, 40, 4, 16, 32
        x = (0.1 * randn(b, T, H, P)).to(dtype)
        dt = torch.ones(b, T, H, dtype=dtype)
        A = (-0.1 * rand(H)).to(dtype)
        Bm, Cm = (0.1 * randn(b, T, H, N)).to(dtype), (0.1 * randn(b, T, H, N)).to(dtype)
        y, final = linattn.mamba_chunk_scan_combined(x, dt, A, Bm, Cm, 8, D=None,
                                                     return_final_states=True)
        o, ht = linattn.chunk_simple_gla(Cm, Bm, x, A * dt, scale=1.0, output_final_state=True)
        o_r, ht_r = naive(Cm, Bm, x, (A * dt).float(), scale=1.0, output_final_state=True)
        tol = 1e-4 if dtype == F32 else 1e-2
        assert y.dtype == dtype and final.shape == (b, H, P, N) and final.dtype == F32
        close("y", y, o_r, tol)
        close("o", o, o_r, tol)
        close("final", final, ht_r.transpose(2, 3), tol)
        close("ht", ht, ht_r, tol)


def _ssu_ref(state, x, dt, A, B, C, D, z, dt_bias):
    """mamba_ssm's selective_state_update_ref (the heads form), in fp64."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    state, x, dt, A, B, C, D, z, dt_bias = map(d, (state, x, dt, A, B, C, D, z, dt_bias))
    nheads, ngroups = state.shape[1], B.shape[1]
    dt = F.softplus(dt + dt_bias)
    dA = torch.exp(dt.unsqueeze(-1) * A)
    B, C = (t.repeat_interleave(nheads // ngroups, 1) for t in (B, C))
    state = state * dA + (dt.unsqueeze(-1) * B.unsqueeze(2)) * x.unsqueeze(-1)
    out = torch.einsum("bhdn,bhn->bhd", state, C) + x * D
    return (out if z is None else out * F.silu(z)), state


@pytest.mark.parametrize("itype", [F32, F16, BF])
@pytest.mark.parametrize("ngroups, has_z, pool", [(1, False, False), (2, True, False),
                                                  (4, True, True)])
def test_selective_state_update_forms(monkeypatch, itype, ngroups, has_z, pool):
    """mamba_ssm's test_selective_state_update_with_heads[_with_batch_indices], tie_hdim:
    dt, dt_bias, A, D expanded along headdim (and dstate) by einops.repeat (stride 0),
    B, C float32 beside an itype x and state, z optional, a state pool read and written at
    int32 state_batch_indices: out and the state against mamba_ssm's reference step."""
    from einops import repeat
    import test_mamba2
    from linattn.ops import mamba2
    monkeypatch.setattr(mamba2, "_decode_kernel", test_mamba2._kernel_model)
    monkeypatch.setattr(validate, "check_devices", lambda q, **t: None)
    randn, rand = gen(10)
    b, nheads, P, N = 3, 4, 16, 16
    rows = 10 * b if pool else b
    state = randn(rows, nheads, P, N, dtype=itype)
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(1))[:b].int() if pool \
        else None
    x = randn(b, nheads, P, dtype=itype)
    dt = repeat(randn(b, nheads, dtype=itype), "b h -> b h p", p=P)
    dt_bias = repeat(rand(nheads) - 4.0, "h -> h p", p=P)
    A = repeat(-rand(nheads) - 1.0, "h -> h p n", p=P, n=N)
    D = repeat(randn(nheads), "h -> h p", p=P)
    B, C = randn(b, ngroups, N), randn(b, ngroups, N)
    z = randn(b, nheads, P, dtype=itype) if has_z else None
    rows_of = idx.long() if pool else slice(None)
    before = state.clone()
    out = linattn.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                         dt_softplus=True, state_batch_indices=idx)
    want, want_state = _ssu_ref(before[rows_of], x, dt, A, B, C, D, z, dt_bias)
    tol = tol_of(itype) * 2
    assert out.dtype == itype and out.shape == (b, nheads, P)
    close("out", out, want, tol)
    close("state", state[rows_of], want_state, tol)
    if pool:
        rest = torch.ones(rows, dtype=torch.bool)
        rest[idx.long()] = False
        assert torch.equal(state[rest], before[rest])
    # mamba_ssm's other forms are Mamba-1's selective scan (per-channel dt / A), not SSD:
    # refused in one line naming the argument
    untied = randn(b, nheads, P, dtype=itype)
    one_line(lambda: linattn.selective_state_update(
        state, x, untied, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
        state_batch_indices=idx), "dt must be the same along headdim")
    one_line(lambda: linattn.selective_state_update(
        randn(b, 64, N, dtype=itype), randn(b, 64, dtype=itype), randn(b, 64, dtype=itype),
        -rand(64, N), randn(b, N), randn(b, N), D=randn(64), dt_bias=rand(64),
        dt_softplus=True), "x has shape [3, 64]")


# ------------------------------------------------------------------ errors fla's tests expect
def _small(fam="gdn", dtype=F32, T=16, K=32):
    randn, rand = gen(11)
    x = dict(q=randn(1, T, 2, K, dtype=dtype), k=randn(1, T, 2, K, dtype=dtype),
             v=randn(1, T, 2, K, dtype=dtype))
    if fam in ("gdn", "kda"):
        x["beta"] = rand(1, T, 2)
    if fam != "ret":
        x["g"] = F.logsigmoid(randn(1, T, 2, K) if fam in ("kda", "gla") else randn(1, T, 2))
    return x


@pytest.mark.parametrize("fn, fam, gate", [
    ("fused_recurrent_gated_delta_rule", "gdn", "g"), ("fused_recurrent_kda", "kda", "g"),
    ("fused_recurrent_gla", "gla", "gk"), ("fused_recurrent_simple_gla", "sgla", "g"),
    ("fused_recurrent_retention", "ret", None)])
def test_transpose_state_layout_forms(cpu_ops, fn, fam, gate):
    """fla's *_state_v_first tests: the old keyword transpose_state_layout=True warns
    (DeprecationWarning) and runs as state_v_first=True; with state_v_first too, a
    ValueError. (GLA's and simple GLA's: q, k, v positional, the gate by keyword.)"""
    x = _small(fam)
    args = (x.pop("q"), x.pop("k"), x.pop("v"))
    if gate is not None:
        x[gate] = x.pop("g")
    call = getattr(linattn, fn)
    with pytest.warns(DeprecationWarning):
        o, ht = call(*args, **x, transpose_state_layout=True, output_final_state=True)
    o2, ht2 = call(*args, **x, state_v_first=True, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    with pytest.raises(ValueError):
        call(*args, **x, state_v_first=True, transpose_state_layout=True)


def test_chunk_size_errors_in_fla_s_words(cpu_ops):
    """fla's test_kda / test_gdn2 test_chunk_invalid_chunk_size: a ValueError matching
    fla's message; other functions' bad chunk_size in one line."""
    x = _small("kda")
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
        linattn.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=16)
    y = _gdn2_inputs(1, 64, 2, 64, 64, F32)
    for size in (16, 32):
        with pytest.raises(ValueError, match=r"`chunk_size` must be 64 for GDN-2"):
            linattn.chunk_gdn2(**y, chunk_size=size)
    r = _small("ret")
    one_line(lambda: linattn.chunk_retention(**r, chunk_size=48), "`chunk_size` must be")
    one_line(lambda: linattn.chunk_dplr_delta_rule(
        r["q"], r["k"], r["v"], r["q"], r["k"], F.logsigmoid(r["q"]), chunk_size=128),
        "`chunk_size` must be")


@pytest.mark.parametrize("varlen", [False, True])
def test_gdn2_return_intermediate_states_form(cpu_ops, varlen):
    """fla's test_gdn2 test_chunk_return_intermediate_states (float32, inference_mode,
    use_qk_l2norm_in_kernel, output_final_state): (o, ht, h) with o, ht as the call without
    it and h [B, NT, H, K, V] the state entering each 64-token chunk, against fla's
    naive_recurrent_gdn2 on the first 64 c tokens (varlen: h [1, NT_total, ...], sequence
    by sequence, with an initial state)."""
    naive = fla_fn("fla.ops.gdn2.naive", "naive_recurrent_gdn2")
    B, T, H, K, V = (1, 150, 2, 32, 32) if varlen else (2, 150, 2, 32, 32)
    y = _gdn2_inputs(B, T, H, K, V, F32)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    cu = [0, 70, 70, 150] if varlen else None
    if varlen:
        kw.update(cu_seqlens=torch.tensor(cu), initial_state=gen(4)[0](3, H, K, V))
    with torch.inference_mode():
        o_ref, ht_ref = linattn.chunk_gdn2(**y, **kw)
        o, ht, h = linattn.chunk_gdn2(**y, **kw, return_intermediate_states=True)
    close("o", o, o_ref, 1e-5)
    close("ht", ht, ht_ref, 1e-5)
    norm = {n: F.normalize(y[n], dim=-1) if n in "qk" else t for n, t in y.items()}
    runs = [(0, T, None)] if not varlen else [(cu[n], cu[n + 1], n) for n in range(3)]
    want = []
    for t0, t1, n in runs:
        h0 = None if n is None else kw["initial_state"][n:n + 1]
        for c0 in range(t0, t1, 64):
            want.append(h0 if c0 == t0 and h0 is not None else
                        torch.zeros(B, H, K, V) if c0 == t0 else
                        naive(**{m: x[:, t0:c0] for m, x in norm.items()}, initial_state=h0,
                              output_final_state=True)[1])
    want = torch.stack(want, 1) if not varlen else torch.cat(want, 0).unsqueeze(0)
    assert h.shape == want.shape == ((1, 4, H, K, V) if varlen else (B, 3, H, K, V))
    assert h.dtype == F32
    close("h", h, want, 1e-4)


def test_intentional_refusals_are_one_line(cpu_ops):
    """Forms fla has and linattn refuses on purpose (a feature it lacks), each in one line
    naming it: the intermediate states under autograd (KDA, GDN-2), fused_recurrent's
    reverse."""
    y = _gdn2_inputs(1, 64, 2, 64, 64, F32)
    y["b"].requires_grad_()
    one_line(lambda: linattn.chunk_gdn2(**y, return_intermediate_states=True), "for inference")
    x = _small("kda", BF)
    x["q"].requires_grad_()
    one_line(lambda: linattn.chunk_kda(**x, return_intermediate_states=True), "for inference")
    s = _small("sgla")
    one_line(lambda: linattn.fused_recurrent_simple_gla(**s, reverse=True), "reverse")
