"""Mamba-2 (SSD) and lightning attention (issue 48), on the CPU: the specs, the fp64
references of the call terms against Mamba-2's recurrence written out step by step, the
public functions end to end with the kernels replaced by the fp64 reference (``cpu_ops``),
and their argument checks (one line naming the argument, before any device work)."""
import inspect
import math

import pytest
import torch

from _cpu_ops import cpu_ops  # noqa: F401 (fixture)
import linattn
from linattn.dsl import OpSpec, Options, SpecError
from linattn.dsl import call_terms
from linattn.dsl.spec import alibi_slope
from linattn.dsl.torch_reference import softplus_fla
from linattn.ops import lightning, mamba2

F64, BF, F32 = torch.float64, torch.bfloat16, torch.float32
V_FIRST = Options(state_v_first=True)


def ssd_inputs(Bn=2, T=37, HV=4, G=2, K=16, V=8, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x = r(Bn, T, HV, V).to(dtype)
    dt = (r(Bn, T, HV) - 1.0).to(dtype)
    A = -torch.rand(HV, generator=gen, dtype=F64) * 2 - 0.1
    B, C = (r(Bn, T, G, K) * 0.5).to(dtype), (r(Bn, T, G, K) * 0.5).to(dtype)
    D, z, dt_bias = r(HV), r(Bn, T, HV, V).to(dtype), r(HV) * 0.5
    h0 = r(Bn, HV, V, K) * 0.3
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0)


# ------------------------------------------------------------------ specs
def test_mamba2_spec_is_one_short_opspec():
    src = inspect.getsource(mamba2)
    start = src.index("SPEC = OpSpec(")
    lines = src[start:src.index("\n)\n", start) + 2].splitlines()
    assert len(lines) <= 25, len(lines)
    s = mamba2.SPEC
    assert (s.rule.value, s.gate.value, s.step, s.value_scale, s.skip, s.output_gate) == \
        ("additive", "scalar", "dt", "dt", True, "silu")
    assert s.gva and s.scale_for(64) == 1.0


def test_call_terms_are_checked_when_a_spec_is_made():
    ok = dict(name="x", rule="additive", gate="scalar")
    with pytest.raises(SpecError, match="step 'dt' forms the scalar gate"):
        OpSpec(**dict(ok, gate="key"), step="dt")
    with pytest.raises(SpecError, match="value_scale 'dt' scales by the step"):
        OpSpec(**ok, value_scale="dt")
    with pytest.raises(SpecError, match="need the additive rule"):
        OpSpec(**dict(ok, rule="delta"), skip=True)
    with pytest.raises(SpecError, match="output_gate must be one of"):
        OpSpec(**ok, output_gate="sigmoid")
    with pytest.raises(SpecError, match="skip must be one of"):
        OpSpec(**ok, skip=1)


def test_call_terms_are_part_of_the_identity_and_absent_ones_are_not():
    base = OpSpec(name="x", rule="additive", gate="scalar")
    assert "step" not in base.as_dict()
    assert OpSpec(name="x", rule="additive", gate="scalar", skip=True).hash != base.hash


def _fla_slopes(n):
    def p2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return p2(n)
    c = 2 ** math.floor(math.log2(n))
    return p2(c) + _fla_slopes(2 * c)[0::2][:n - c]


@pytest.mark.parametrize("H", [1, 4, 6, 8, 12, 20, 64])
def test_alibi_slopes_are_lightnings(H):
    assert [alibi_slope(h, H) for h in range(H)] == pytest.approx(_fla_slopes(H), rel=1e-12)


@pytest.mark.parametrize("layer, layers", [(0, 1), (0, 2), (1, 2), (3, 24), (23, 24)])
def test_lightning_decay_is_fla_s(layer, layers):
    """fla 0.6's chunk_lightning_attn: g_gamma = -(8 / H (1 - layer_idx / L)) arange(H)."""
    H = 8
    want = [-(8 / H * (1 - layer / layers)) * h for h in range(H)]
    assert lightning.SPEC.head_decay(H, layer, layers) == pytest.approx(want, rel=1e-12,
                                                                        abs=1e-15)
    assert lightning.SPEC.layer_decay and not linattn.ops.retention.SPEC.layer_decay


def test_alibi_slope_decays_are_expressible():
    spec = OpSpec(name="minimax", rule="additive", gate="scalar",
                  decay="-slope(h, H) * (1 - layer / layers + 1e-5)")
    want = [-s * (1 - 3 / 24 + 1e-5) for s in _fla_slopes(8)]
    assert spec.head_decay(8, 3, 24) == pytest.approx(want, rel=1e-12)


def test_layer_decay_needs_the_layer_and_is_checked_at_every_layer():
    with pytest.raises(SpecError, match="give layer and layers"):
        lightning.SPEC.head_decay(8)
    with pytest.raises(SpecError, match="must be a finite log decay <= 0"):
        OpSpec(name="bad", rule="additive", gate="scalar", decay="layer - 1")
    with pytest.raises(SpecError, match="h and H only"):
        OpSpec(name="bad", rule="additive", gate="scalar", decay="-depth")


# ------------------------------------------------------------------ references
@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_reference_is_the_step_by_step_recurrence(recurrent, G):
    p = ssd_inputs(G=G)
    lim = (0.05, 1.5)
    want, hT = call_terms.naive_reference(
        mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"], A=p["A"], dt_bias=p["dt_bias"],
        dt_softplus=True, dt_limit=lim, D=p["D"], z=p["z"], initial_state=p["h0"])
    got, ht = call_terms.reference(
        mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"], A=p["A"], dt_bias=p["dt_bias"],
        dt_softplus=True, dt_limit=lim, D=p["D"], z=p["z"], initial_state=p["h0"],
        options=V_FIRST, recurrent=recurrent)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, hT, rtol=1e-10, atol=1e-10)


def test_reference_without_terms_is_the_plain_recurrence():
    p = ssd_inputs(G=4)
    want, _ = call_terms.naive_reference(mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"],
                                         A=p["A"])
    got, _ = call_terms.reference(mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"], A=p["A"],
                                  options=V_FIRST)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_reference_gradients_reach_every_input():
    p = ssd_inputs(T=9)
    leaves = {n: p[n].clone().requires_grad_(True) for n in
              ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0")}
    o, ht = call_terms.reference(mamba2.SPEC, leaves["C"], leaves["B"], leaves["x"],
                                 dt=leaves["dt"], A=leaves["A"], dt_bias=leaves["dt_bias"],
                                 dt_softplus=True, D=leaves["D"], z=leaves["z"],
                                 initial_state=leaves["h0"], options=V_FIRST)
    (o.sum() + ht.sum()).backward()
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.abs().sum() > 0, n


# ------------------------------------------------------------------ public functions
def _scan_want(p, cu=None, **kw):
    """Per-sequence naive references (cu: packed sequences of batch row 0); dt clamped
    to (0, inf) unless dt_limit says otherwise, as mamba_chunk_scan_combined's default."""
    kw.setdefault("dt_limit", (0.0, math.inf))
    if cu is None:
        return call_terms.naive_reference(mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"],
                                          A=p["A"], **kw)
    ys, hs = [], []
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        h0 = kw.get("initial_state") if i == 0 else None
        y, h = call_terms.naive_reference(
            mamba2.SPEC, p["C"][:, sl], p["B"][:, sl], p["x"][:, sl], dt=p["dt"][:, sl],
            A=p["A"], **dict(kw, initial_state=h0,
                             z=None if kw.get("z") is None else kw["z"][:, sl]))
        ys.append(y)
        hs.append(h)
    return torch.cat(ys, 1), torch.cat(hs, 0)


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("terms", [False, True])
def test_chunk_scan_combined_end_to_end(cpu_ops, G, terms):
    p = ssd_inputs(G=G, dtype=BF)
    kw = dict(D=p["D"], z=p["z"], dt_bias=p["dt_bias"], dt_softplus=True,
              dt_limit=(0.01, 2.0)) if terms else {}
    y, hT = linattn.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"], 256,
                                              initial_states=p["h0"],
                                              return_final_states=True, **kw)
    assert cpu_ops == [("mamba2", "chunk")] or cpu_ops == [("mamba2", "recurrent")]
    assert y.dtype == BF and y.shape == p["x"].shape and hT.shape == p["h0"].shape
    want, hw = _scan_want(p, initial_state=p["h0"], **kw)
    torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(hT.double(), hw, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("by", ["seq_idx", "cu_seqlens"])
def test_chunk_scan_combined_varlen(cpu_ops, by):
    p = ssd_inputs(Bn=1, T=40, dtype=BF)
    cu = [0, 7, 7 + 20, 40]
    seq_idx = torch.tensor([i for i in range(3) for _ in range(cu[i + 1] - cu[i])],
                           dtype=torch.int32).view(1, 40)
    arg = dict(seq_idx=seq_idx) if by == "seq_idx" else dict(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_varlen_states=True)
    out = linattn.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"], 64,
                                            D=p["D"], z=p["z"], initial_states=p["h0"][:1],
                                            return_final_states=True, **arg)
    want, hw = _scan_want(p, cu, initial_state=p["h0"][:1], D=p["D"], z=p["z"])
    torch.testing.assert_close(out[0].double(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out[1].double(), hw[-1:], rtol=1e-2, atol=1e-2)
    if by == "cu_seqlens":
        torch.testing.assert_close(out[2].double(), hw, rtol=1e-2, atol=1e-2)


def test_chunk_scan_combined_returns_mamba_s_tuple_forms(cpu_ops):
    p = ssd_inputs(dtype=BF)
    y = linattn.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"], 64)
    assert isinstance(y, torch.Tensor)


def _kernel_model(spec, q, k, v, g, beta, *, scale, initial_state, options,
                  ssm_state_indices, inplace_final_state, terms):
    """The decode kernel's terms as recurrent.py.jinja / terms/step.py.jinja form them
    (flags and tensors as run_recurrent gets them), in fp64 around the reference."""
    from linattn.dsl import torch_reference as tr
    f, t = terms["flags"], terms["tensors"]
    assert inplace_final_state and beta is None and scale == 1.0
    dt = g.double()
    if f["step_bias_on"]:
        dt = dt + t["step_bias"].double()
    if f["step_softplus"]:
        dt = softplus_fla(dt)
    if f.get("step_clamp"):
        dt = dt.clamp(float(t["step_limit"][0]), float(t["step_limit"][1]))
    vv = v.double() * dt.unsqueeze(-1) if f["value_scale"] else v.double()
    idx = ssm_state_indices
    if idx is None:
        idx = torch.arange(q.shape[0], dtype=torch.int32)
    plain = OpSpec(name="plain", rule="additive", gate="scalar", supports={"state_v_first"})
    o, pool, _ = tr.pool_recurrent_forward(plain, q, k, vv, dt * t["step_A"].double(),
                                           pool=initial_state, ssm_state_indices=idx,
                                           inplace=True, options=options, scale=1.0)
    initial_state.copy_(pool)
    if f["skip"]:
        D = t["skip_D"].double()
        o = o + (D[:, None] if f["skip_per_head"] else D) * v.double()
    if f["output_gate"]:
        o = o * torch.nn.functional.silu(t["gate_z"].double())
    return o.to(q.dtype), initial_state


@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("pool", [False, True])
def test_selective_state_update_end_to_end(monkeypatch, G, pool):
    """The decode's one kernel with its call terms (a model of the kernel: the flags and
    tensors selective_state_update hands it) against Mamba-2's step."""
    monkeypatch.setattr(mamba2, "_decode_kernel", _kernel_model)
    monkeypatch.setattr(linattn.ops.validate, "check_devices", lambda q, **t: None)
    b, HV, V, K = 3, 4, 8, 16
    p = ssd_inputs(Bn=b, T=1, HV=HV, G=G, K=K, V=V, dtype=BF)
    x, z, B, C = p["x"][:, 0], p["z"][:, 0], p["B"][:, 0], p["C"][:, 0]
    dt = p["dt"][:, 0, :, None].expand(b, HV, V)
    A = p["A"].view(HV, 1, 1).expand(HV, V, K)
    dt_bias = p["dt_bias"].view(HV, 1).expand(HV, V)
    D = p["D"].view(HV, 1).expand(HV, V).contiguous()
    state = p["h0"].float()
    idx = None
    if pool:
        state = torch.cat([torch.zeros_like(state), state.flip(0)], 0)
        idx = torch.tensor([5, 4, 3], dtype=torch.int32)
    before = state.clone()
    y = linattn.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                       dt_softplus=True, state_batch_indices=idx)
    want, hw = call_terms.naive_reference(
        mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"], A=p["A"], dt_bias=p["dt_bias"],
        dt_softplus=True, D=p["D"], z=p["z"], initial_state=p["h0"])
    torch.testing.assert_close(y.double(), want[:, 0], rtol=3e-2, atol=3e-2)
    rows = [5, 4, 3] if pool else [0, 1, 2]
    torch.testing.assert_close(state[rows].double(), hw, rtol=1e-2, atol=1e-2)
    if pool:
        torch.testing.assert_close(state[:3], before[:3])


@pytest.mark.parametrize("recurrent", [False, True])
def test_lightning_end_to_end(cpu_ops, recurrent):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 21, 4, 16, generator=gen).to(BF) for _ in range(3))
    fn = (linattn.fused_recurrent_lightning_attn if recurrent
          else linattn.chunk_lightning_attn)
    o, ht = fn(q, k, v, 2, 8, output_final_state=True)
    g = torch.tensor(lightning.SPEC.head_decay(4, 2, 8), dtype=F64).view(1, 1, 4)
    spec = OpSpec(name="plain", rule="additive", gate="scalar")
    want, hw = call_terms.reference(spec, q, k, v, g=g.expand(2, 21, 4), recurrent=True)
    torch.testing.assert_close(o.double(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(ht.double(), hw, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ argument checks
def _scan_args(**over):
    p = ssd_inputs(dtype=BF)
    a = dict(x=p["x"], dt=p["dt"], A=p["A"], B=p["B"], C=p["C"], chunk_size=64)
    a.update(over)
    return a


@pytest.mark.parametrize("over, match", [
    (dict(x=torch.zeros(2, 37, 4, dtype=BF)), r"^x .*shape"),
    (dict(x=torch.zeros(2, 37, 4, 8, dtype=torch.int32)), r"^x "),
    (dict(x=torch.zeros(2, 37, 4, 8, dtype=torch.float64)), r"^x "),
    (dict(dt=torch.zeros(2, 37, 3)), r"^dt "),
    (dict(A=torch.zeros(3)), r"^A "),
    (dict(B=torch.zeros(2, 37, 2, 8)), r"^C |^B "),
    (dict(C=torch.zeros(2, 37, 3, 16)), r"^C "),
    (dict(B=torch.zeros(2, 37, 3, 16), C=torch.zeros(2, 37, 3, 16)), r"multiple of ngroups"),
    (dict(chunk_size=0), r"^chunk_size"),
    (dict(D=torch.zeros(5)), r"^D "),
    (dict(z=torch.zeros(2, 37, 4, 7)), r"^z "),
    (dict(dt_bias=torch.zeros(4, 8)), r"^dt_bias "),
    (dict(dt_limit=(1.0, 0.5)), r"^dt_limit"),
    (dict(seq_idx=torch.zeros(2, 37, dtype=torch.int32)), r"seq_idx needs batch 1"),
    (dict(initial_states=torch.zeros(2, 4, 16, 8)), r"^initial_states "),
    (dict(cu_seqlens=torch.tensor([0, 37], dtype=torch.int32)), r"batch size must be 1"),
    (dict(return_varlen_states=True), r"return_varlen_states=True needs cu_seqlens"),
])
def test_chunk_scan_combined_argument_errors(over, match):
    with pytest.raises((SpecError, TypeError), match=match) as e:
        linattn.mamba_chunk_scan_combined(**_scan_args(**over))
    assert "\n" not in str(e.value)


def test_chunk_scan_combined_names_x_off_the_gpu():
    with pytest.raises(SpecError, match=r"^x is on cpu"):
        linattn.mamba_chunk_scan_combined(**_scan_args())


def _update_args(**over):
    b, HV, V, K = 2, 4, 8, 16
    a = dict(state=torch.zeros(b, HV, V, K), x=torch.zeros(b, HV, V, dtype=BF),
             dt=torch.zeros(b, HV, 1).expand(b, HV, V), A=torch.zeros(HV, 1, 1).expand(HV, V, K),
             B=torch.zeros(b, 2, K, dtype=BF), C=torch.zeros(b, 2, K, dtype=BF))
    a.update(over)
    return a


@pytest.mark.parametrize("over, match", [
    (dict(x=torch.zeros(2, 4)), r"^x "),
    (dict(dt=torch.zeros(2, 4, 8)), r"^dt must be the same along headdim"),
    (dict(A=torch.zeros(4, 8, 16)), r"^A must be the same along headdim"),
    (dict(A=torch.zeros(4, 8)), r"^A "),
    (dict(dt_bias=torch.zeros(4, 8)), r"^dt_bias must be the same along headdim"),
    (dict(B=torch.zeros(2, 3, 16)), r"^C |^B "),
    (dict(state=torch.zeros(3, 4, 8, 16)), r"^state "),
    (dict(state=torch.zeros(2, 4, 16, 8)), r"^state "),
    (dict(D=torch.zeros(4, 7)), r"^D "),
    (dict(z=torch.zeros(2, 4, 9)), r"^z "),
    (dict(state_batch_indices=torch.zeros(3, dtype=torch.int32)), r"^state_batch_indices "),
])
def test_selective_state_update_argument_errors(over, match):
    with pytest.raises((SpecError, TypeError), match=match) as e:
        linattn.selective_state_update(**_update_args(**over))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layer_idx, num_layers, match", [
    (0, 0, r"^num_layers must be >= 1"), (3, 3, r"^layer_idx must be in"),
    (-1, 4, r"^layer_idx must be in"), (1.0, 4, r"^layer_idx must be an int"),
])
def test_lightning_argument_errors(layer_idx, num_layers, match):
    q = torch.zeros(1, 4, 2, 16, dtype=BF)
    for fn in (linattn.chunk_lightning_attn, linattn.fused_recurrent_lightning_attn):
        with pytest.raises(SpecError, match=match):
            fn(q, q, q, layer_idx, num_layers)


def test_public_signatures_are_mamba_ssm_s_and_fla_s():
    names = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert names(linattn.mamba_chunk_scan_combined) == [
        "x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "initial_states",
        "seq_idx", "cu_seqlens", "dt_softplus", "dt_limit", "return_final_states",
        "return_varlen_states"]
    assert names(linattn.selective_state_update)[:10] == [
        "state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus"]
    assert names(linattn.chunk_lightning_attn)[:8] == [
        "q", "k", "v", "layer_idx", "num_layers", "scale", "initial_state",
        "output_final_state"]


def test_chunk_scan_combined_gradients_of_every_input(cpu_ops):
    """A float32 call trains through the wrapper (the step, value scale, skip and gate by
    autograd around the additive training; float32: ops/exact_train.py) with the
    gradients of Mamba-2's recurrence written out step by step."""
    p = ssd_inputs(Bn=1, T=20, G=2, dtype=F32)
    p["h0"] = p["h0"].float()
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0")
    mine = {n: p[n].float().clone().requires_grad_(True) for n in names}
    ref = {n: p[n].double().clone().requires_grad_(True) for n in names}
    lim = (0.05, 1.5)
    y, hT = linattn.mamba_chunk_scan_combined(
        mine["x"], mine["dt"], mine["A"], mine["B"], mine["C"], 64, D=mine["D"],
        z=mine["z"], dt_bias=mine["dt_bias"], initial_states=mine["h0"], dt_softplus=True,
        dt_limit=lim, return_final_states=True)
    wy, wh = call_terms.naive_reference(
        mamba2.SPEC, ref["C"], ref["B"], ref["x"], dt=ref["dt"], A=ref["A"],
        dt_bias=ref["dt_bias"], dt_softplus=True, dt_limit=lim, D=ref["D"], z=ref["z"],
        initial_state=ref["h0"])
    gen = torch.Generator().manual_seed(5)
    dy, dh = torch.randn(y.shape, generator=gen), torch.randn(hT.shape, generator=gen)
    got = torch.autograd.grad((y, hT), [mine[n] for n in names], (dy, dh))
    want = torch.autograd.grad((wy, wh), [ref[n] for n in names], (dy.double(), dh.double()))
    torch.testing.assert_close(y.double(), wy, rtol=1e-4, atol=1e-4)
    for n, a, b in zip(names, got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-4, msg=n)


@pytest.mark.parametrize("recurrent", [False, True])
def test_lightning_gradients(cpu_ops, recurrent):
    """float32 lightning trains through the wrapper (exact in torch) with the gradients of
    the plain recurrence under fla's decay."""
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(1, 13, 4, 16, generator=gen) for _ in range(3)]
    h0 = torch.randn(1, 4, 16, 16, generator=gen) * 0.1
    mine = [t.clone().requires_grad_(True) for t in xs + [h0]]
    ref = [t.double().requires_grad_(True) for t in xs + [h0]]
    fn = (linattn.fused_recurrent_lightning_attn if recurrent
          else linattn.chunk_lightning_attn)
    o, ht = fn(*mine[:3], 1, 3, initial_state=mine[3], output_final_state=True)
    g = torch.tensor(lightning.SPEC.head_decay(4, 1, 3), dtype=F64).view(1, 1, 4)
    plain = OpSpec(name="plain", rule="additive", gate="scalar")
    wo, wh = call_terms.reference(plain, *ref[:3], g=g.expand(1, 13, 4),
                                  initial_state=ref[3], recurrent=True)
    got = torch.autograd.grad((o, ht), mine, (torch.ones_like(o), torch.ones_like(ht)))
    want = torch.autograd.grad((wo, wh), ref, (torch.ones_like(wo), torch.ones_like(wh)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
