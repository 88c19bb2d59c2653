"""GPU checks of Mamba-2 (SSD) and lightning attention (issue 48) against the fp64
references of their specs (dsl/call_terms.py) on fresh random inputs, every new float
allocation NaN-poisoned (conftest), and against mamba_ssm's / fla's own functions where
those import (else those tests skip): mamba_chunk_scan_combined's forward and gradients
(every input), varlen (seq_idx, cu_seqlens with return_varlen_states), initial states, z,
D, dt_limit, ngroups 1 and 8, dstate 64 / 128 / 256; selective_state_update (the decode
kernel with the call terms inside it), state pools; chunk_lightning_attn /
fused_recurrent_lightning_attn forward and gradients.

Run: python3 -m pytest -q -m gpu tests/test_mamba2_gpu.py
"""
import math
import warnings

import pytest

import linattn
from linattn.dsl import Options
from linattn.dsl import call_terms
from linattn.ops import lightning, mamba2

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

BF = torch.bfloat16
V_FIRST = Options(state_v_first=True)
INF = float("inf")


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def inputs(Bn, T, HV, G, K, V=64, seed=0, h0=True, dev="cuda"):
    gen = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    return dict(
        x=r(Bn, T, HV, V).to(BF), dt=r(Bn, T, HV) - 2.0,
        A=-torch.rand(HV, device=dev, generator=gen) * 4 - 0.5,
        B=(r(Bn, T, G, K) / math.sqrt(K)).to(BF), C=(r(Bn, T, G, K) / math.sqrt(K)).to(BF),
        D=r(HV), z=r(Bn, T, HV, V).to(BF), dt_bias=r(HV) * 0.5,
        h0=(0.1 * r(Bn, HV, V, K)) if h0 else None)


def want_scan(p, cu=None, dt_limit=(0.0, INF), terms=True, first_h0=True):
    """The fp64 reference of mamba_chunk_scan_combined (varlen: the first sequence from
    the initial state, the others from zero)."""
    kw = dict(dt=p["dt"].double(), A=p["A"].double(), dt_bias=p["dt_bias"].double(),
              dt_softplus=True, dt_limit=dt_limit, options=V_FIRST)
    if terms:
        kw.update(D=p["D"].double(), z=p["z"].double())
    h0 = p["h0"]
    if cu is not None and h0 is not None:
        h0 = torch.cat([h0, h0.new_zeros((len(cu) - 2,) + tuple(h0.shape[1:]))], 0)
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    return call_terms.reference(mamba2.SPEC, p["C"], p["B"], p["x"],
                                initial_state=None if h0 is None else h0.double(),
                                cu_seqlens=cu_t, **kw)


@pytest.mark.parametrize("Bn, T, HV, G, K, terms, lim", [
    (2, 1000, 8, 1, 64, True, (0.0, INF)),
    (1, 4096, 32, 8, 128, True, (0.01, 0.5)),
    (2, 700, 16, 8, 256, False, (0.0, INF)),
    (1, 63, 128, 8, 128, True, (0.0, INF)),         # Nemotron-H's heads, short
])
def test_chunk_scan_combined_forward(Bn, T, HV, G, K, terms, lim):
    p = inputs(Bn, T, HV, G, K)
    kw = dict(D=p["D"], z=p["z"]) if terms else {}
    y, hT = linattn.mamba_chunk_scan_combined(
        p["x"], p["dt"], p["A"], p["B"], p["C"], 256, dt_bias=p["dt_bias"],
        initial_states=p["h0"], dt_softplus=True, dt_limit=lim, return_final_states=True,
        **kw)
    wy, wh = want_scan(p, dt_limit=lim, terms=terms)
    assert y.dtype == BF and rel(y, wy) < 1e-2 and rel(hT, wh) < 1e-2, (rel(y, wy), rel(hT, wh))


@pytest.mark.parametrize("config", [None, {"state_threads": 256}, {"aqk_per_key_head": True},
                                    {"fused": False}, {"segments": 8},
                                    {"fused": False, "segments": 4}])
@pytest.mark.parametrize("cu", [None, [0, 1, 300, 300, 365, 1865]])
def test_call_terms_in_the_chunked_kernels(config, cu, monkeypatch):
    """Every plan form of the chunked forward with the call terms formed inside it
    (chunk_prepare's step and dt per token, the state pass's value scale, the skip term
    and the output gate in the stage writing o), whole and ragged sequences, against the
    fp64 reference; and the public call routes there (no torch pass around it)."""
    from linattn.ops import chunk
    p = inputs(1, 1865 if cu else 1500, 32, 8, 128)
    lim = (0.0, 2.0)
    terms = mamba2.kernel_terms(p["A"], p["D"], p["z"].flatten(0, 1), p["dt_bias"], True,
                                lim)
    h0 = p["h0"] if cu is None else torch.cat([p["h0"], p["h0"].new_zeros(4, 32, 64, 128)])
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    y, ht = chunk.run_chunk_forward(mamba2.SPEC, p["C"], p["B"], p["x"], p["dt"].float(),
                                    None, 1.0, h0, True, mamba2._OPTS, cu_t, None,
                                    config=config, terms=terms)
    wy, wh = want_scan(p, cu, dt_limit=lim)
    assert rel(y, wy) < 1e-2 and rel(ht, wh) < 1e-2, (rel(y, wy), rel(ht, wh))
    seen = []
    real = mamba2._chunk_kernel
    monkeypatch.setattr(mamba2, "_chunk_kernel", lambda *a, **k: seen.append(1) or real(*a, **k))
    y2 = linattn.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"], 256,
                                           D=p["D"], z=p["z"], dt_bias=p["dt_bias"],
                                           initial_states=p["h0"], dt_softplus=True,
                                           dt_limit=lim, cu_seqlens=cu_t)
    assert seen and rel(y2, wy) < 1e-2


@pytest.mark.parametrize("by", ["seq_idx", "cu_seqlens"])
def test_chunk_scan_combined_varlen(by):
    lens = [1, 300, 0, 65, 1500]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    p = inputs(1, cu[-1], 16, 8, 128)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32)
                         for i, n in enumerate(lens)]).view(1, -1).cuda()
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    arg = dict(seq_idx=seq_idx, cu_seqlens=cu_t, return_varlen_states=True) \
        if by == "cu_seqlens" else dict(seq_idx=seq_idx)
    out = linattn.mamba_chunk_scan_combined(
        p["x"], p["dt"], p["A"], p["B"], p["C"], 256, D=p["D"], z=p["z"],
        dt_bias=p["dt_bias"], initial_states=p["h0"], dt_softplus=True,
        return_final_states=True, **arg)
    wy, wh = want_scan(p, cu)
    assert rel(out[0], wy) < 1e-2 and rel(out[1], wh[-1:]) < 1e-2
    if by == "cu_seqlens":
        assert rel(out[2], wh) < 1e-2

def _gradients(G, K, D_channels, z, lim, cu, dev="cuda"):
    """test_chunk_scan_combined_gradients' call on ``dev``: (its inputs, the names of
    those that need gradients, their gradients, dy, dh, cu_seqlens)."""
    T = 500 if cu is None else cu[-1]
    p = inputs(1, T, 16, G, K, dev=dev)
    if D_channels:
        p["D"] = torch.randn(16, 64, device=dev)
    names = tuple(n for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0")
                  if z or n != "z")
    leaves = {n: p[n].detach().clone().requires_grad_(True) for n in names}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    y, hT = linattn.mamba_chunk_scan_combined(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], 256,
        D=leaves["D"], z=leaves.get("z"), dt_bias=leaves["dt_bias"],
        initial_states=leaves["h0"], dt_softplus=True, dt_limit=lim, cu_seqlens=cu_t,
        return_final_states=True)
    gen = torch.Generator(device=dev).manual_seed(1)
    dy, dh = torch.randn(y.shape, device=dev, generator=gen), torch.randn(
        hT.shape, device=dev, generator=gen)
    got = torch.autograd.grad((y, hT), [leaves[n] for n in names], (dy.to(BF), dh))
    return p, names, got, dy, dh, cu_t


def precompile_jobs(items, device="cuda"):
    """The (spec, stage, arch, params) jobs of test_chunk_scan_combined_gradients' selected
    cases among ``items`` (bench/cpu_cache.py; this module's other tests compile as they
    run): each case's call and gradients on ``device`` with every kernel a no-op that
    notes its job, so the backward's stages are reached without a GPU (the values are
    garbage; nothing is checked)."""
    from linattn.ops import runtime
    jobs = {}

    def noted(spec, stage, arch, params, target=None):
        key = runtime._key(spec, stage, arch, params)
        if key not in jobs:
            names = runtime.arg_names(runtime.stage_module(spec, stage, arch).build(**params))
            jobs[key] = ((spec, stage, arch, dict(params)), names)
        return (lambda *args: None), jobs[key][1]
    cases = [it.callspec.params for it in items
             if it.originalname == "test_chunk_scan_combined_gradients"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runtime, "_compiled", noted)
        for c in cases:
            _gradients(*(c[n] for n in ("G", "K", "D_channels", "z", "lim", "cu")), dev=device)
    return [job for job, _ in jobs.values()]


@pytest.mark.parametrize("G, K, D_channels, z, lim, cu", [
    (1, 128, False, True, (0.0, 1.0), None),
    (8, 128, False, True, (0.0, 1.0), None),
    (8, 64, True, False, (0.0, INF), [0, 1, 300, 300, 365, 900]),  # (states saved)
    (8, 64, False, False, (0.0, INF), [0, 1, 300, 300, 365, 900]),
    (1, 64, False, True, (0.01, 0.5), [0, 70, 500]),
    (8, 128, True, True, (0.01, 0.5), [0, 70, 500]),
    (2, 256, False, True, (0.0, INF), None),    # (K 256: dqkvg's 2 key blocks of 128)
    (8, 128, False, False, (0.0, 1.0), None),
], ids=["G1", "G8", "G8-K64-D-channels-no-z-varlen", "G8-K64-no-z-varlen",
        "G1-K64-limit-varlen", "G8-D-channels-limit-varlen", "G2-K256", "G8-no-z"])
def test_chunk_scan_combined_gradients(G, K, D_channels, z, lim, cu, monkeypatch):
    """Every input's gradient through the one Function of the value scale, the additive
    call and the skip term (ops/terms.py train; without z the forward's kernels form dt x
    and o + D x: K 64 with the states saved, K 128 recomputed; dqkvg forms the terms'
    backward: reads x and s, writes dx = s dv' + D do, ds and dD's partials, torch's
    terms_backward not called; without z the states' recompute forms the step and x s in
    its kernels), against torch autograd of the fp64 reference. 16 value heads, so GVA at
    every G: the plan's group loop (a CTA per key head walks its group, 16 heads at G 1,
    2 at G 8; dq, dk stored once, no atomic adds; one key block up to K 128, dx stored,
    two of 128 at K 256, dx added in f32)."""
    from linattn.ops import additive_bwd, terms
    plans, real_plan = [], additive_bwd.backward_plan
    monkeypatch.setattr(additive_bwd, "backward_plan", lambda *a, **k: plans.append(
        real_plan(*a, **k)) or plans[-1])
    seen, real = [], terms.terms_backward
    monkeypatch.setattr(terms, "terms_backward",
                        lambda *a, **k: seen.append(a[4].dtype) or real(*a, **k))
    bwd, real_bwd = [], additive_bwd.run_backward
    monkeypatch.setattr(additive_bwd, "run_backward", lambda *a, **k: bwd.append(
        (k.get("terms") or {}).get("flags")) or real_bwd(*a, **k))
    rec, real_rec = [], additive_bwd.recompute_states
    monkeypatch.setattr(additive_bwd, "recompute_states", lambda *a, **k: rec.append(
        sorted(f for f, on in ((a[8:] or [None])[0] or {}).get("flags", {}).items() if on))
        or real_rec(*a, **k))
    fwd, real_fwd = [], additive_bwd.run_forward
    monkeypatch.setattr(additive_bwd, "run_forward", lambda *a, **k: fwd.append(
        k.get("terms") is not None) or real_fwd(*a, **k))
    p, names, got, dy, dh, cu_t = _gradients(G, K, D_channels, z, lim, cu)
    ref = {n: p[n].detach().double().requires_grad_(True) for n in names}
    h0 = ref["h0"] if cu is None else torch.cat(
        [ref["h0"], ref["h0"].new_zeros((len(cu) - 2,) + tuple(ref["h0"].shape[1:]))])
    wy, wh = call_terms.reference(mamba2.SPEC, ref["C"], ref["B"], ref["x"], dt=ref["dt"],
                                  A=ref["A"], dt_bias=ref["dt_bias"], dt_softplus=True,
                                  dt_limit=lim, D=ref["D"], z=ref.get("z"),
                                  initial_state=h0, options=V_FIRST,
                                  cu_seqlens=None if cu is None else cu_t.long())
    want = torch.autograd.grad((wy, wh[-1:]), [ref[n] for n in names],
                               (dy.to(BF).double(), dh.double()))
    for n, a, b in zip(names, got, want):
        assert a.dtype == p[n].dtype and rel(a, b) < 2e-2, (n, rel(a, b))
    assert seen == [], seen                 # (the terms' backward in dqkvg)
    flags = ("skip",) + (() if D_channels else ("skip_per_head",)) + ("value_scale",)
    assert bwd == [flags], bwd
    step = ["step_bias_on", "step_clamp", "step_dt", "step_softplus", "value_scale"]
    assert bool(rec) == (K * 64 > 64 * 64) and all(r == ([] if z else step) for r in rec), rec
    assert fwd == [not z], fwd                 # (the forward's terms in the kernels)
    assert [(additive_bwd.group_sums(pl), additive_bwd._dqkvg_params(pl).get("group_loop"))
            for pl in plans] == [(False, True)], plans


@pytest.mark.parametrize("b, HV, G, K, pool, state_dtype", [
    (1, 128, 8, 128, False, torch.float32),
    (64, 128, 8, 128, True, torch.float32),
    (256, 32, 1, 64, False, BF),
    (7, 16, 8, 256, True, torch.float32),
])
def test_selective_state_update(b, HV, G, K, pool, state_dtype):
    V = 64
    p = inputs(b, 1, HV, G, K)
    x, z, B, C = p["x"][:, 0], p["z"][:, 0], p["B"][:, 0], p["C"][:, 0]
    dt = p["dt"][:, 0, :, None].expand(b, HV, V)
    A = p["A"].view(HV, 1, 1).expand(HV, V, K)
    dt_bias = p["dt_bias"].view(HV, 1).expand(HV, V)
    h0 = p["h0"].to(state_dtype)
    idx = None
    state = h0.clone()
    if pool:
        state = torch.cat([torch.randn_like(h0), h0.flip(0)], 0).contiguous()
        idx = torch.arange(2 * b - 1, b - 1, -1, dtype=torch.int32, device="cuda")
    before = state.clone()
    y = linattn.selective_state_update(state, x, dt, A, B, C, D=p["D"], z=z,
                                       dt_bias=dt_bias, dt_softplus=True,
                                       state_batch_indices=idx)
    wy, wh = call_terms.reference(
        mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"].double(), A=p["A"].double(),
        dt_bias=p["dt_bias"].double(), dt_softplus=True, D=p["D"].double(),
        z=p["z"].double(), initial_state=h0.double(), options=V_FIRST, recurrent=True)
    rows = idx.long() if pool else torch.arange(b, device="cuda")
    assert rel(y, wy[:, 0]) < 1e-2 and rel(state[rows], wh) < 1e-2
    if pool:
        assert torch.equal(state[:b], before[:b])


def _mamba_triton():
    """mamba_ssm's Triton modules (ssd_combined, selective_state_update): the installed
    package, else a source checkout at $MAMBA_SRC loaded without its __init__ (which
    imports the CUDA extensions); skips where neither imports."""
    import importlib
    import os
    import sys
    import types
    src = os.environ.get("MAMBA_SRC")
    try:
        importlib.import_module("mamba_ssm")
    except Exception:                   # noqa: BLE001 (no package, or its extensions)
        if not src:
            pytest.skip("mamba_ssm not importable (set MAMBA_SRC to a checkout)")
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = [os.path.join(src, "mamba_ssm")]
        sys.modules["mamba_ssm"] = pkg
    return (pytest.importorskip("mamba_ssm.ops.triton.ssd_combined"),
            pytest.importorskip("mamba_ssm.ops.triton.selective_state_update"))


def test_against_mamba_ssm():
    """mamba_ssm's own Triton functions on the same inputs (skips where not importable)."""
    ssd, ssu = _mamba_triton()
    for G in (1, 8):
        p = inputs(2, 2048, 32, G, 128)
        kw = dict(D=p["D"], z=p["z"], dt_bias=p["dt_bias"], initial_states=p["h0"],
                  dt_softplus=True, dt_limit=(0.0, 2.0), return_final_states=True)
        y, hT = linattn.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"],
                                                  256, **kw)
        my, mh = ssd.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"],
                                               256, **kw)
        assert rel(y, my) < 2e-2 and rel(hT, mh) < 2e-2
    b, HV, V, K = 16, 32, 64, 128
    p = inputs(b, 1, HV, 8, K)
    args = (p["x"][:, 0], p["dt"][:, 0, :, None].expand(b, HV, V),
            p["A"].view(HV, 1, 1).expand(HV, V, K), p["B"][:, 0], p["C"][:, 0])
    kw = dict(D=p["D"].view(HV, 1).expand(HV, V), z=p["z"][:, 0],    # (mamba_ssm: D [HV, V])
              dt_bias=p["dt_bias"].view(HV, 1).expand(HV, V), dt_softplus=True)
    s1, s2 = p["h0"].clone(), p["h0"].clone()
    y1 = linattn.selective_state_update(s1, *args, **kw)
    y2 = ssu.selective_state_update(s2, *args, **kw)
    assert rel(y1, y2) < 2e-2 and rel(s1, s2) < 1e-3


@pytest.mark.parametrize("recurrent", [False, True])
def test_lightning_forward_and_gradients(recurrent):
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 700, 8, 128, device="cuda", generator=gen).to(BF) * 0.3
               for _ in range(3))
    h0 = 0.1 * torch.randn(2, 8, 128, 128, device="cuda", generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, h0)]
    fn = (linattn.fused_recurrent_lightning_attn if recurrent
          else linattn.chunk_lightning_attn)
    o, ht = fn(*leaves[:3], 5, 24, initial_state=leaves[3], output_final_state=True)
    g = torch.tensor(lightning.SPEC.head_decay(8, 5, 24), dtype=torch.float64,
                     device="cuda").view(1, 1, 8).expand(2, 700, 8)
    refs = [t.detach().double().requires_grad_(True) for t in (q, k, v, h0)]
    wo, wh = call_terms.reference(lightning.SPEC, *refs[:3], g=g, initial_state=refs[3])
    assert rel(o, wo) < 1e-2 and rel(ht, wh) < 1e-2
    do = torch.randn_like(wo)
    got = torch.autograd.grad((o, ht), leaves, (do.to(BF), torch.ones_like(ht)))
    want = torch.autograd.grad((wo, wh), refs, (do, torch.ones_like(wh)))
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2


def test_lightning_against_fla():
    """chunk_lightning_attn at fla's test shape (T = 1000: a partial last chunk) against
    the fp64 reference, then against fla's own chunk_lightning_attn where fla's results
    are finite; a non-finite result of fla's is noted (a warning), not a failure here."""
    fla = pytest.importorskip("fla.ops.lightning_attn")
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(1, 1000, 8, 64, device="cuda", generator=gen).to(BF) * 0.3
               for _ in range(3))
    for layer in (0, 7, 11):
        o, ht = linattn.chunk_lightning_attn(q, k, v, layer, 12, output_final_state=True)
        g = torch.tensor(lightning.SPEC.head_decay(8, layer, 12), dtype=torch.float64,
                         device="cuda").view(1, 1, 8).expand(1, 1000, 8)
        wo, wh = call_terms.reference(lightning.SPEC, q, k, v, g=g)
        err_o, err_h = rel(o, wo), rel(ht, wh)
        assert err_o < 1e-2 and err_h < 1e-2, (layer, err_o, err_h)
        fo, fh = fla.chunk_lightning_attn(q, k, v, layer, 12, output_final_state=True)
        for name, mine, theirs in (("o", o, fo), ("final state", ht, fh)):
            # fla 0.6.0's chunk_fwd_h (USE_G_GAMMA) scales the last partial chunk's padded
            # rows by exp2(gamma (last - t)): inf for steep heads (layer 0, T = 1000: up to
            # 24 x 10.1 > 128), and 0 x inf = NaN enters the final state
            if not bool(torch.isfinite(theirs).all()):
                warnings.warn(f"fla's chunk_lightning_attn {name} at layer {layer} has "
                              "non-finite values: compared with the fp64 reference only")
                continue
            err = rel(mine, theirs)
            assert err < 2e-2, (layer, name, err)
