"""The fla drop-in surface on the CPU: names, fla's argument forms, one-line errors, the
torch.library ops (fake implementations, torch.compile without graph breaks).

End-to-end tests run the public functions with the device check switched off and the
ops' CPU kernel set to the fp64 torch reference (``cpu_ops``), so everything the wrapper
does (argument forms, conversions, KDA's lower-bounded gate, g_gamma, normalize, the
path choice) is checked against an independent fp64 computation without a GPU.
"""
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tr
from linattn.ops import api, chunk, library, validate
from linattn.ops.registry import get_spec, specs

from _cpu_ops import cpu_ops  # noqa: F401 (fixture)

BF, F32 = torch.bfloat16, torch.float32
PUBLIC = ["chunk_delta_rule", "fused_recurrent_delta_rule", "chunk_gated_delta_rule",
          "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda", "chunk_gla",
          "fused_recurrent_gla", "chunk_simple_gla", "fused_recurrent_simple_gla",
          "chunk_linear_attn", "fused_recurrent_linear_attn"]
DEVICE_ERROR = r"q is on cpu; linattn runs on one CUDA device \(Hopper, sm90; Ampere / Ada, sm80\)"


def inputs(B=2, T=5, H=2, HV=4, K=32, V=16, dtype=BF, gate="scalar", seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = r(B, T, H, K).to(dtype), r(B, T, H, K).to(dtype)
    v = r(B, T, HV, V).to(dtype)
    g = F.logsigmoid(r(B, T, HV, K) if gate == "key" else r(B, T, HV))
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


def calls(dtype=BF):
    """One valid CPU call of every public function: (name, thunk)."""
    q, k, v, g, beta = inputs(dtype=dtype)
    qs, ks, vs, gs, _ = inputs(HV=2, dtype=dtype)
    _, _, vk, gk, bk = inputs(gate="key", dtype=dtype)
    _, _, vg, gg, _ = inputs(HV=2, gate="key", dtype=dtype)
    L = linattn
    return [
        ("chunk_delta_rule", lambda: L.chunk_delta_rule(qs, ks, vs, beta[..., :2])),
        ("fused_recurrent_delta_rule", lambda: L.fused_recurrent_delta_rule(qs, ks, vs)),
        ("chunk_gated_delta_rule", lambda: L.chunk_gated_delta_rule(q, k, v, g, beta)),
        ("fused_recurrent_gated_delta_rule",
         lambda: L.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta)),
        ("chunk_kda", lambda: L.chunk_kda(q, k, vk, gk, bk)),
        ("fused_recurrent_kda", lambda: L.fused_recurrent_kda(q, k, vk, gk, bk)),
        ("chunk_gla", lambda: L.chunk_gla(qs, ks, vs, gg)),
        ("fused_recurrent_gla", lambda: L.fused_recurrent_gla(qs, ks, vs, gg)),
        ("chunk_simple_gla", lambda: L.chunk_simple_gla(qs, ks, vs, gs)),
        ("fused_recurrent_simple_gla", lambda: L.fused_recurrent_simple_gla(qs, ks, vs, gs)),
        ("chunk_linear_attn", lambda: L.chunk_linear_attn(qs, ks, vs)),
        ("fused_recurrent_linear_attn", lambda: L.fused_recurrent_linear_attn(qs, ks, vs)),
    ]


# ------------------------------------------------------------------ names and ops
def test_public_functions_are_importable():
    for name in PUBLIC:
        assert callable(getattr(linattn, name)), name


def test_import_registers_the_ops():
    for spec in specs().values():
        for path in library.SCHEMAS:
            assert hasattr(torch.ops.linattn, library.op_name(spec, path))
    schema = str(torch.ops.linattn.fused_recurrent_gdn_inplace.default._schema)
    assert "Tensor(a!) initial_state" in schema and schema.endswith("-> Tensor")


@pytest.mark.parametrize("path", ["chunk", "recurrent", "inplace"])
@pytest.mark.parametrize("v_first", [False, True])
def test_fake_impls_give_shapes_and_dtypes(path, v_first):
    """The meta (fake) implementations: o [B, T, HV, V] in q's dtype, the final state
    f32 in the state layout, or [0] without output_final_state."""
    spec = get_spec("gdn")
    op = getattr(torch.ops.linattn, library.op_name(spec, path))
    m = lambda *s, dt=BF: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    B, T, H, HV, K, V = 1, 9, 2, 4, 32, 16
    opts = Options(state_v_first=v_first).key()
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    h0 = m(3, HV, K, V, dt=F32)
    args = [m(B, T, H, K), m(B, T, H, K), m(B, T, HV, V), m(B, T, HV, dt=F32), m(B, T, HV),
            None, None, h0, cu, None, 0.5, True, opts]
    if path != "chunk":
        args += [None, None]
    out = op(*args)
    if path == "inplace":
        assert out.shape == (B, T, HV, V) and out.dtype == BF
        return
    o, ht = out
    assert o.shape == (B, T, HV, V) and o.dtype == BF and o.device.type == "meta"
    assert ht.shape == ((3, HV, V, K) if v_first else (3, HV, K, V)) and ht.dtype == F32
    args[11] = False
    assert op(*args)[1].shape == (0,)


def test_fake_impl_under_fake_tensor_mode_with_symbolic_sizes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        q = mode.from_tensor(torch.empty(2, 70, 2, 32, dtype=BF))
        v = mode.from_tensor(torch.empty(2, 70, 4, 16, dtype=BF))
        g = mode.from_tensor(torch.empty(2, 70, 4))
        o, ht = torch.ops.linattn.chunk_gdn(q, q, v, g, g, None, None, None, None, None,
                                            0.5, True, "plain")
    assert tuple(o.shape) == (2, 70, 4, 16) and tuple(ht.shape) == (2, 4, 32, 16)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("dtype", [BF, F32])
def test_valid_cpu_calls_fail_with_the_one_device_error(dtype):
    """float32 passes the dtype checks: a valid CPU call of every public function reaches
    the device check, which has one wording."""
    for name, call in calls(dtype):
        with pytest.raises(SpecError, match=DEVICE_ERROR):
            call()


def test_bad_argument_on_cpu_is_reported_before_the_device():
    q, k, v, g, beta = inputs()
    with pytest.raises(SpecError, match=r"g has shape \[2, 5, 3\]; expected \[2, 5, 4\]"):
        linattn.chunk_gated_delta_rule(q, k, v, g[..., :3], beta)
    with pytest.raises(SpecError, match=r"beta has dtype int64"):
        linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta.long())
    with pytest.raises(SpecError, match="initial_state has shape"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 4, 16, 32))
    with pytest.raises(SpecError, match=r"ssm_state_indices has shape \[3\]"):
        linattn.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=torch.zeros(8, 4, 32, 16),
            ssm_state_indices=torch.zeros(3, dtype=torch.int32))


def _bad_calls():
    q, k, v, g, beta = inputs()
    big = torch.full((2, 5, 4, 16), 1234.5)           # its contents must never be printed
    _, _, vk, gk, bk = inputs(gate="key")
    L = linattn
    return [
        lambda: L.fused_recurrent_gated_delta_rule(q, k, v, g, gv=big, beta=beta),
        lambda: L.fused_recurrent_gla(q[:, :, :1], k[:, :, :1], v[:, :, :1], gv=big),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, reverse=big),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, not_an_argument=big),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=big),
        lambda: L.chunk_gated_delta_rule(q, k, v, big, beta),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, scale=big),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True,
                                         A_log=big),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.arange(999)),
        lambda: L.chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1],
                                         cu_seqlens=torch.tensor([0] + [3, 1] * 400 + [5])),
        lambda: L.chunk_kda(q, k, vk, gk, bk, safe_gate=True, use_gate_in_kernel=True),
        lambda: L.chunk_kda(q, k, vk, gk, bk, safe_gate=True, use_gate_in_kernel=True,
                            lower_bound=-9.0),
        lambda: L.chunk_kda(q, k, vk, gk, bk, lower_bound=big),
        lambda: L.chunk_kda(q, k, vk, gk, bk, return_intermediate_states=True, chunk_size=32),
        lambda: L.chunk_kda(q, k, vk, gk, bk, cp_context=big),
        lambda: L.chunk_delta_rule(q, k, v[:, :, :2], g, beta[..., :2]),
        lambda: L.chunk_linear_attn(q, k, v[:, :, :2], g),
        lambda: L.chunk_simple_gla(q, k, v[:, :, :2], g_gamma=big),
        lambda: L.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta,
                                                   num_accepted_tokens=big.long()),
        lambda: L.chunk_gated_delta_rule(q.double(), k.double(), v.double(), g, beta),
        lambda: L.chunk_gated_delta_rule(torch.randn(2, 5, 2, 100, dtype=BF),
                                         torch.randn(2, 5, 2, 100, dtype=BF), v, g, beta),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_errors_are_one_short_line_without_tensor_contents(index):
    with pytest.raises((SpecError, TypeError)) as info:
        _bad_calls()[index]()
    msg = str(info.value)
    print(msg)
    assert "\n" not in msg and len(msg) <= validate.MAX_MESSAGE, msg
    assert "1234" not in msg and "tensor(" not in msg, msg
    assert "cuda" not in msg.lower() or "CUDA device" in msg, msg


def test_chunk_size_takes_fla_values_and_names_them_otherwise():
    """fla's chunk_size values per function run (the chunk-64 kernels: the same
    recurrence); any other is refused in fla's wording (fla's KDA test matches it)."""
    q, k, v, g, beta = inputs()
    qs, ks, vs, gs, _ = inputs(HV=2)
    _, _, vk, gk, bk = inputs(gate="key")
    _, _, _, gg, _ = inputs(HV=2, gate="key")
    for size in (16, 32, 64):
        with pytest.raises(SpecError, match=DEVICE_ERROR):
            linattn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=size)
        with pytest.raises(SpecError, match=DEVICE_ERROR):
            linattn.chunk_delta_rule(qs, ks, vs, beta[..., :2], chunk_size=size)
        with pytest.raises(SpecError, match=DEVICE_ERROR):
            linattn.chunk_simple_gla(qs, ks, vs, gs, chunk_size=size)
    with pytest.raises(SpecError, match=DEVICE_ERROR):
        linattn.chunk_kda(q, k, vk, gk, bk, chunk_size=32)
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
        linattn.chunk_kda(q, k, vk, gk, bk, chunk_size=16)
    with pytest.raises(SpecError, match=r"`chunk_size` must be 16, 32, or 64, got 48$"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(SpecError, match=r"`chunk_size` must be 64, got 32$"):
        linattn.chunk_gla(qs, ks, vs, gg, chunk_size=32)
    with pytest.raises(SpecError, match=r"`chunk_size` must be .*, got True$"):
        linattn.chunk_simple_gla(qs, ks, vs, gs, chunk_size=True)
    with pytest.raises(SpecError, match=DEVICE_ERROR):     # fused_recurrent: ignored (fla)
        linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, chunk_size=16)


def test_fla_argument_forms_are_accepted():
    """fla's A_log shapes, no dt_bias, states of any float dtype, KDA's safe gate and
    disable_recompute, chunk_indices: all reach the device check."""
    q, k, v, g, beta = inputs()
    _, _, vk, gk, bk = inputs(gate="key")
    L = linattn
    ok = [
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True,
                                         A_log=torch.randn(1, 1, 4, 1)),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True,
                                         A_log=torch.randn(4, dtype=BF), dt_bias=torch.randn(4)),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, A_log=torch.randn(7)),  # ignored
        lambda: L.chunk_gated_delta_rule(q, k, v, g.to(torch.float16), beta.to(BF),
                                         initial_state=torch.zeros(2, 4, 32, 16, dtype=BF)),
        lambda: L.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=torch.zeros(2, 4, 32, 16, dtype=torch.float64)),
        lambda: L.chunk_kda(q, k, vk, gk, bk, use_gate_in_kernel=True, A_log=torch.randn(4),
                            dt_bias=torch.randn(4, 32), safe_gate=True, lower_bound=-5.0,
                            disable_recompute=True),
        lambda: L.chunk_kda(q, k, vk, gk, bk, use_gate_in_kernel=True, lower_bound=-3.0),
        lambda: L.chunk_kda(q, k, vk, gk, bk, safe_gate=True),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, chunk_indices=torch.zeros(3, 2)),
        lambda: L.chunk_gated_delta_rule(q, k, v, g, beta, transpose_state_layout=True),
        lambda: L.chunk_simple_gla(q, k, v[:, :, :2], g_gamma=torch.randn(2)),
        lambda: L.chunk_linear_attn(q, k, v[:, :, :2], normalize=False),
    ]
    for call in ok:
        with pytest.raises(SpecError, match=DEVICE_ERROR):
            call()


def test_gate_params_reach_the_recurrent_kernel_in_their_dtype():
    """fla's layers hold A_log / dt_bias in the model's dtype: the recurrent kernel reads
    them as they are (a cast per decode step cost two launches); the chunk kernels, or
    two different dtypes, get f32."""
    from linattn.ops.inputs import kernel_inputs
    from linattn.ops.recurrent import GATE_PARAM_DTYPES, _problem
    q, k, v, g, beta = inputs()
    spec, opts = get_spec("gdn"), Options(gate_in_kernel=True)
    dims = validate.Dims(2, 5, 2, 4, 32, 16)

    def params(a, b, dtypes=GATE_PARAM_DTYPES):
        x, _ = kernel_inputs(spec, opts, dims, q, k, v, g, beta, A_log=a, dt_bias=b,
                             param_dtypes=dtypes)
        return x["A_log"].dtype, x["dt_bias"].dtype
    a16, b16 = torch.randn(1, 1, 4, 1, dtype=BF), torch.randn(4, dtype=BF)
    assert params(a16, b16) == (BF, BF)
    assert params(a16, b16, dtypes=("float32",)) == (F32, F32)       # the chunk path
    assert params(a16, b16.float()) == (F32, F32)
    assert params(a16.double(), b16.double()) == (F32, F32)
    problem = lambda a: _problem(spec, opts, dims, q, g, beta, None, F32, False,  # noqa
                                 None, A_log=a)
    assert problem(a16)["gate_param_dtype"] == "bfloat16"
    assert "gate_param_dtype" not in problem(a16.float())     # f32: the default kernel


def test_safe_gate_follows_fla():
    q, k, _, _, _ = inputs()
    _, _, vk, gk, bk = inputs(gate="key")
    with pytest.raises(SpecError, match="needs lower_bound"):
        linattn.chunk_kda(q, k, vk, gk, bk, safe_gate=True, use_gate_in_kernel=True,
                          A_log=torch.randn(4))
    with pytest.raises(SpecError, match=r"safe range \[-5, 0\), got -6"):
        linattn.chunk_kda(q, k, vk, gk, bk, safe_gate=True, use_gate_in_kernel=True,
                          lower_bound=-6)
    with pytest.raises(SpecError, match=r"needs A_log of shape \[4\]"):
        linattn.chunk_kda(q, k, vk, gk, bk, use_gate_in_kernel=True)


@pytest.mark.parametrize("gate, K, V, dtype, T, path", [
    ("scalar", 128, 128, BF, 64, "chunk"), ("scalar", 128, 128, BF, 1, "recurrent"),
    ("scalar", 128, 128, F32, 64, "recurrent"), ("scalar", 128, 512, BF, 64, "recurrent"),
    ("key", 128, 128, BF, 64, "chunk"), ("key", 256, 128, BF, 64, "chunk"),
    ("key", 128, 512, BF, 64, "recurrent"),
    ("scalar", 256, 256, torch.float16, 64, "chunk")])
def test_path_choice(gate, K, V, dtype, T, path):
    spec = get_spec("gdn" if gate == "scalar" else "kda")
    assert api.choose_path(spec, validate.Dims(1, T, 2, 2, K, V), dtype, False) == path


# ------------------------------------------------------------------ end to end on the CPU
def _close(got, want, tol=2e-2):
    got, want = got.double(), want.double()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err < tol, err


def test_gdn_gate_in_kernel_with_fla_shapes(cpu_ops):
    """A_log [1, 1, HV, 1] in bf16, no dt_bias: -exp(A_log) * softplus(g)."""
    q, k, v, g, beta = inputs(T=70)
    A_log = torch.randn(1, 1, 4, 1).to(BF)
    h0 = torch.randn(2, 4, 32, 16).to(BF)
    o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True,
                                           A_log=A_log, initial_state=h0,
                                           output_final_state=True)
    assert cpu_ops == [("gdn", "chunk")] and o.dtype == BF and ht.dtype == F32
    g_act = -torch.exp(A_log.double().reshape(4)) * F.softplus(g.double())
    ro, rht = tr.recurrent_forward(get_spec("gdn"), q, k, v, g_act, beta, initial_state=h0)
    _close(o, ro)
    _close(ht, rht)


@pytest.mark.parametrize("with_A", [True, False])
def test_kda_lower_bound_gate(cpu_ops, with_A):
    """fla's lower-bounded gate: lower_bound * sigmoid(exp(A_log) * (g + dt_bias))."""
    q, k, _, _, _ = inputs(T=9)
    _, _, v, g, beta = inputs(T=9, gate="key", seed=1)
    A_log = torch.randn(4) if with_A else None
    dt_bias = torch.randn(4, 32)
    o, ht = linattn.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log,
                              dt_bias=dt_bias, safe_gate=True, lower_bound=-5.0,
                              output_final_state=True)
    x = g.double() + dt_bias.double()
    if with_A:
        x = torch.exp(A_log.double()).view(4, 1) * x
    g_act = -5.0 * torch.sigmoid(x)
    ro, rht = tr.recurrent_forward(get_spec("kda"), q, k, v, g_act, beta)
    _close(o, ro)
    _close(ht, rht)


def test_float32_inputs_take_the_recurrent_kernel(cpu_ops):
    q, k, v, g, beta = inputs(T=70, dtype=F32)
    o, _ = linattn.chunk_gated_delta_rule(q, k, v, g, beta)
    assert cpu_ops == [("gdn", "recurrent")] and o.dtype == F32
    _close(o, tr.recurrent_forward(get_spec("gdn"), q, k, v, g, beta)[0], 1e-5)


def test_mixed_input_dtypes_run_promoted(cpu_ops):
    """q, k, v of different float dtypes (fla's test: q, k float32, v, beta float16): all
    three upcast to their promoted dtype (exact), o in q's dtype."""
    q, k, _, g, beta = inputs(T=70, dtype=F32)
    v = inputs(T=70)[2].half()
    o, ht = linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta.half(),
                                                     output_final_state=True)
    assert cpu_ops == [("gdn", "recurrent")] and o.dtype == F32
    ro, rht = tr.recurrent_forward(get_spec("gdn"), q, k, v.float(), g, beta.half().float())
    _close(o, ro, 1e-5)
    _close(ht, rht, 1e-5)
    qb, kb, vb, gb, _ = inputs(T=70, HV=2)
    o, _ = linattn.chunk_simple_gla(qb, kb.half(), vb.float(), gb)
    assert cpu_ops[-1] == ("simple_gla", "recurrent") and o.dtype == BF
    _close(o, tr.recurrent_forward(get_spec("simple_gla"), qb.float(), kb.half().float(),
                                   vb.float(), gb, None)[0])


def test_non_contiguous_inputs_are_accepted(cpu_ops):
    q, k, v, g, beta = inputs(T=6)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    o, _ = linattn.fused_recurrent_gated_delta_rule(qt, k, v, g, beta=beta[..., ::1])
    _close(o, tr.recurrent_forward(get_spec("gdn"), q, k, v, g, beta)[0])


@pytest.mark.parametrize("form", ["g", "g_gamma", "both", "none"])
def test_simple_gla_gates(cpu_ops, form):
    q, k, v, g, _ = inputs(T=9, HV=2, K=64)         # (the state pass takes K in 64s)
    gamma = -torch.rand(2)
    kw = dict(g=g if form in ("g", "both") else None,
              g_gamma=gamma if form in ("g_gamma", "both") else None)
    o, ht = linattn.chunk_simple_gla(q, k, v, output_final_state=True, **kw)
    g_eff = (g.double() if kw["g"] is not None else 0) + (
        gamma.double().view(1, 1, 2) if kw["g_gamma"] is not None else 0)
    spec = get_spec("linear_attn" if form == "none" else "simple_gla")
    assert cpu_ops == [(spec.name, "chunk")]
    ro, rht = tr.recurrent_forward(spec, q, k, v,
                                   None if form == "none" else g_eff.expand(2, 9, 2))
    _close(o, ro)
    _close(ht, rht)


def _normalized_reference(q, k, v, scale, cu=None, z0=None, h0=None):
    """fla's normalized linear attention, token by token in fp64."""
    B, T, H, K = q.shape
    cu = cu.tolist() if cu is not None else None
    runs = [(b, 0, T) for b in range(B)] if cu is None else [
        (0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    zs = []
    for n, (b, t0, t1) in enumerate(runs):
        S = h0[n].double() if h0 is not None else torch.zeros(H, K, v.shape[-1],
                                                              dtype=torch.float64)
        z = z0[n, 0].double() if z0 is not None else torch.zeros(H, K, dtype=torch.float64)
        for t in range(t0, t1):
            S = S + k[b, t].double().unsqueeze(-1) * v[b, t].double().unsqueeze(-2)
            z = z + k[b, t].double()
            qt = q[b, t].double() * scale
            o[b, t] = torch.einsum("hkv,hk->hv", S, qt) / ((qt * z).sum(-1, keepdim=True)
                                                           + 1e-10)
        zs.append(z)
    return o, torch.stack(zs).unsqueeze(1)


@pytest.mark.parametrize("varlen", [False, True])
def test_linear_attn_normalize(cpu_ops, varlen):
    B = 1 if varlen else 2
    q, k, v, _, _ = inputs(B=B, T=12, HV=2)
    q, k = q.float().abs().to(BF), k.float().abs().to(BF)      # positive feature maps
    cu = torch.tensor([0, 5, 5, 12]) if varlen else None
    N = 3 if varlen else 2
    z0 = torch.rand(N, 1, 2, 32)
    h0 = torch.randn(N, 2, 32, 16)
    o, (ht, z) = linattn.chunk_linear_attn(q, k, v, initial_state=(h0, z0),
                                           output_final_state=True, cu_seqlens=cu)
    ro, rz = _normalized_reference(q, k, v, 32 ** -0.5, cu, z0, h0)
    _close(o, ro)
    _close(z, rz, 1e-5)
    assert z.shape == (N, 1, 2, 32) and ht.shape == (N, 2, 32, 16)
    o2, (ht2, z2) = linattn.fused_recurrent_linear_attn(q, k, v, initial_state=(h0, z0),
                                                        normalize=True, cu_seqlens=cu)
    _close(o2, ro)
    assert ht2 is None


def test_decode_and_fused_recurrent_paths(cpu_ops):
    q, k, v, g, beta = inputs(T=1)
    linattn.chunk_gated_delta_rule(q, k, v, g, beta)
    linattn.fused_recurrent_gla(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    linattn.fused_recurrent_delta_rule(q, k, v)
    assert cpu_ops == [("gdn", "recurrent"), ("linear_attn", "recurrent"),
                       ("deltanet", "recurrent")]


# ------------------------------------------------------------------ torch.compile
def test_torch_compile_fullgraph_without_graph_breaks(cpu_ops):
    """A model calling a chunk_* and a fused_recurrent_* function compiles as one graph
    (the ops opaque, the checks traced away) and matches eager."""
    q, k, v, g, beta = inputs(T=70)

    def model(q, k, v, g, beta):
        o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        o1, _ = linattn.fused_recurrent_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:],
                                                         g[:, -1:], beta=beta[:, -1:],
                                                         initial_state=ht)
        return o.float().sum(-1) + o1.float().sum()

    with torch.no_grad():
        want = model(q, k, v, g, beta)
        torch._dynamo.reset()
        explain = torch._dynamo.explain(model)(q, k, v, g, beta)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        names = {str(n.target) for gm in explain.graphs for n in gm.graph.nodes}
        assert any("linattn.chunk_gdn" in n for n in names), names
        assert any("linattn.fused_recurrent_gdn" in n for n in names), names
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(q, k, v, g, beta)
    torch.testing.assert_close(got, want)



def test_torch_compile_first_call_traces_the_plan_lookup(cpu_ops):
    """A spec's first call under torch.compile(fullgraph=True) (no eager call before it)
    traces the plan lookup (codegen.arch.get_arch is a dict lookup once loaded)."""
    from linattn.ops import api
    q, k, v, g, beta = inputs(T=70)
    api._CHUNKED.clear()

    def model(q, k, v, g, beta):
        return linattn.chunk_gated_delta_rule(q, k, v, g, beta)[0]
    with torch.no_grad():
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True)(q, k, v, g, beta)
        want = model(q, k, v, g, beta)
    torch.testing.assert_close(got, want)

def test_opcheck(cpu_ops):
    """torch.library.opcheck: schema, fake implementation, aot dispatch (on the CPU
    kernel of these tests)."""
    q, k, v, g, beta = inputs(T=7)
    args = (q, k, v, g, beta, None, None, torch.zeros(2, 4, 32, 16), None, None, 0.3, True,
            "l2norm_qk")
    torch.library.opcheck(torch.ops.linattn.chunk_gdn.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.linattn.fused_recurrent_gdn.default, args + (None, None),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------- head dims off the multiples
def _padded_runs(monkeypatch):
    """The head dims (K, V) each kernel call ran at."""
    dims, real = [], library.run

    def run(spec, path, q, k, v, *args, **kw):
        dims.append((q.shape[-1], v.shape[-1]))
        return real(spec, path, q, k, v, *args, **kw)
    monkeypatch.setattr(library, "run", run)
    return dims


@pytest.mark.parametrize("fn, fam, gate, K, V, v_first, T", [
    ("chunk_gated_delta_rule", "gdn", "scalar", 60, 100, False, 70),
    ("chunk_gated_delta_rule", "gdn", "scalar", 100, 36, True, 70),
    ("fused_recurrent_gated_delta_rule", "gdn", "scalar", 20, 12, False, 3),
    ("chunk_kda", "kda", "key", 100, 36, False, 70),
    ("fused_recurrent_kda", "kda", "key", 60, 20, True, 1),
    ("fused_recurrent_kda", "kda", "key", 100, 100, True, 5),
    ("chunk_kda", "kda", "key", 96, 64, True, 1),
    ("chunk_gla", "gla", "key", 60, 50, False, 70),
    ("chunk_delta_rule", "deltanet", None, 100, 100, False, 70)])
def test_head_dims_off_the_kernel_multiples_run_zero_padded(cpu_ops, monkeypatch, fn, fam, gate,
                                                            K, V, v_first, T):
    """K, V that no kernel takes as they are (K not a multiple of 16, or V of 8; with
    value-first states in the recurrent kernel, K not a power of two) run zero-padded: outputs and final states equal the fp64 reference at
    the call's own dims (gates in the kernel with per-channel dt_bias, initial states
    either layout, GVA). The call pads once: a chunked call straight to the chunked
    kernels' K (the arch's chunk_k, a multiple of 64)."""
    ran = _padded_runs(monkeypatch)
    spec = get_spec(fam)
    HV = 2 if spec.rule.value == "additive" or gate is None else 4
    q, k, v, g, beta = inputs(T=T, K=K, V=V, HV=HV, H=2, gate=gate or "scalar")
    gen = torch.Generator().manual_seed(3)
    h0 = torch.randn(2, HV, *((V, K) if v_first else (K, V)), generator=gen)
    kw = dict(initial_state=h0, output_final_state=True, state_v_first=v_first)
    ref_kw = dict(initial_state=h0.transpose(-1, -2) if v_first else h0)
    if spec.rule.value == "additive":
        args, ref_args = (q, k, v, g), (q, k, v, g, None)
        kw = dict(kw, state_v_first=False, initial_state=h0) if v_first else kw
    elif gate is None:
        args, ref_args = (q, k, v, beta[..., :HV]), (q, k, v, None, beta[..., :HV])
    else:
        A_log = torch.randn(HV, generator=gen)
        dt_bias = torch.randn(HV * (K if gate == "key" else 1), generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        ref_kw.update(options=Options(gate_in_kernel=True), A_log=A_log, dt_bias=dt_bias)
        args, ref_args = (q, k, v, g, beta), (q, k, v, g, beta)
        if fn == "fused_recurrent_gated_delta_rule":      # (its 5th argument is gk)
            args, kw["beta"] = args[:4], beta
    if "state_v_first" in kw and not kw["state_v_first"]:
        del kw["state_v_first"]
    o, ht = getattr(linattn, fn)(*args, **kw)
    Kp, Vp = -(-K // 16) * 16, (V if K % 16 == 0 and V % 8 == 0 else -(-V // 16) * 16)
    if v_first and (fn.startswith("fused") or T == 1):   # (value-first recurrent: 2^n)
        Kp = 1 << (Kp - 1).bit_length()
    if not (fn.startswith("fused") or T == 1):           # (the chunked kernels' K)
        Kp = chunk.kernel_k(spec, Kp, "cpu")
        assert Kp % 64 == 0
    assert ran == [(Kp, Vp)], ran
    ro, rht = tr.recurrent_forward(spec, *ref_args, **ref_kw)
    assert o.shape == ro.shape and ht.shape == h0.shape
    _close(o, ro)
    _close(ht.transpose(-1, -2) if v_first else ht, rht)


def test_state_pool_with_padded_dims_refused(cpu_ops):
    q, k, v, g, beta = inputs(T=1, K=60, V=16)
    pool = torch.zeros(8, 4, 60, 16)
    with pytest.raises(SpecError, match="state pool .* needs K a multiple of 16"):
        linattn.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=pool, inplace_final_state=True,
            ssm_state_indices=torch.tensor([1, 3]))


# ------------------------------------------------------------------ float32 training
@pytest.mark.parametrize("fn, fam", [
    ("chunk_gated_delta_rule", "gdn"), ("chunk_kda", "kda"), ("chunk_delta_rule", "deltanet"),
    ("chunk_gla", "gla"), ("fused_recurrent_simple_gla", "simple_gla"),
    ("fused_recurrent_delta_rule", "deltanet")])
def test_float32_training_is_exact(cpu_ops, fn, fam):
    """A float32 call that needs gradients (ops/exact_train.py: the chunked algorithm in
    fp64 by torch) against torch autograd of the independent fp64 token recurrence, with
    varlen, an initial state, the final state's gradient, GVA and the gate in the kernel
    (KDA's lower-bounded form) where the family has them."""
    spec = get_spec(fam)
    key = spec.gate.value == "key"
    HV = 4 if fam in ("gdn", "kda") else 2
    q, k, v, g, beta = inputs(B=1, T=70, H=2, HV=HV, K=32, V=16, dtype=F32,
                              gate="key" if key else "scalar")
    gen = torch.Generator().manual_seed(5)
    x = dict(q=q, k=k, v=v, initial_state=torch.randn(3, HV, 32, 16, generator=gen))
    kw = dict(cu_seqlens=torch.tensor([0, 20, 21, 70]), output_final_state=True)
    lb = None
    if fam in ("gdn", "kda"):
        x.update(g=torch.randn(g.shape, generator=gen), beta=beta,
                 A_log=torch.randn(HV, generator=gen),
                 dt_bias=torch.randn(HV * (32 if key else 1), generator=gen))
        kw.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
        lb = -5.0 if key else None
        if key:
            kw.update(lower_bound=lb, safe_gate=True)
    elif fam == "deltanet":
        x["beta"] = beta[..., :HV]
    else:                       # simple GLA: a decay per head; GLA: per key channel
        x["g"] = g if fam == "simple_gla" else F.logsigmoid(torch.randn(1, 70, 2, 32,
                                                                        generator=gen))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = getattr(linattn, fn)(**leaves, **kw)
    assert cpu_ops == [] and o.dtype == F32 and ht.dtype == F32
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    ((o * do).sum() + (ht * dht).sum()).backward()

    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    g_r, opts = ref.get("g"), Options(l2norm_qk=fam in ("gdn", "kda"),
                                      gate_in_kernel=fam == "gdn")
    A_log, dt_bias = ref.get("A_log"), ref.get("dt_bias")
    if fam == "kda":            # lower_bound * sigmoid(exp(A_log) (g + dt_bias))
        g_r = lb * torch.sigmoid(torch.exp(A_log).view(HV, 1) * (g_r + dt_bias.view(HV, 32)))
        A_log = dt_bias = None
    ro, rht = tr.recurrent_forward(spec, ref["q"], ref["k"], ref["v"], g_r, ref.get("beta"),
                                   options=opts, initial_state=ref["initial_state"],
                                   cu_seqlens=kw["cu_seqlens"], A_log=A_log, dt_bias=dt_bias)
    ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
    _close(o, ro, 1e-5)
    _close(ht, rht, 1e-5)
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype, n
        _close(t.grad, ref[n].grad, 1e-5)


def test_return_intermediate_states_rules_and_shapes(monkeypatch):
    """chunk_kda's return_intermediate_states: refused in one line under autograd, with
    another chunk size, f32 or an unsupported head dim; otherwise the training forward's
    saved states come back as fla's h (the kernels replaced by a stub on the CPU)."""
    from linattn.ops import autograd
    q, k, v, g, beta = inputs(B=2, T=130, K=32, V=16, gate="key")
    ris = dict(return_intermediate_states=True)
    with pytest.raises(SpecError, match="for inference"):
        linattn.chunk_kda(q.requires_grad_(), k, v, g, beta, **ris)
    q = q.detach()
    with pytest.raises(SpecError, match="needs chunk_size=64"):
        linattn.chunk_kda(q, k, v, g, beta, chunk_size=32, **ris)
    with pytest.raises(SpecError, match="float16 / bfloat16"):
        linattn.chunk_kda(q.float(), k.float(), v.float(), g, beta, **ris)
    with pytest.raises(SpecError, match="got bfloat16, K=40, V=40"):
        linattn.chunk_kda(*inputs(K=40, V=40, gate="key"), **ris)
    with pytest.raises(SpecError, match=DEVICE_ERROR):
        linattn.chunk_kda(*inputs(K=40, V=48, gate="key"), **ris)
    with pytest.raises(SpecError, match=DEVICE_ERROR):
        linattn.chunk_kda(q, k, v, g, beta, **ris)
    seen, rows = {}, torch.randn(6, 4, 32, 16).to(q.dtype)

    def fake(spec, q, k, v, g, beta, **kw):
        seen.update(kw)
        return "o", "ht", {"h": rows}
    monkeypatch.setattr(autograd, "train_forward", fake)
    o, ht, h = linattn.chunk_kda(q, k, v, g, beta, lower_bound=-5.0, **ris)
    assert (o, ht) == ("o", "ht") and seen["lower_bound"] == -5.0
    assert h.shape == (2, 3, 4, 32, 16) and h.dtype == q.dtype
    assert torch.equal(h[1, 0], rows[3])
    _, _, hv = linattn.chunk_kda(q, k, v, g, beta, state_v_first=True, **ris)
    assert hv.shape == (2, 3, 4, 16, 32) and torch.equal(hv, h.transpose(-1, -2))
    cu = torch.tensor([0, 100, 260])
    _, _, hc = linattn.chunk_kda(*(t.reshape(1, 260, *t.shape[2:]) for t in
                                   (q, k, v, g, beta)), cu_seqlens=cu, **ris)
    assert hc.shape == (1, 6, 4, 32, 16)


def test_transpose_state_layout_is_fla_s_deprecated_name():
    """fla's old name of state_v_first: a DeprecationWarning; with state_v_first too, fla's
    ValueError (before the device check)."""
    q, k, v, g, beta = inputs()
    with pytest.warns(DeprecationWarning, match="renamed to `state_v_first`"):
        with pytest.raises(SpecError, match=DEVICE_ERROR):
            linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta,
                                                     transpose_state_layout=True)
    with pytest.raises(ValueError, match="Cannot pass both `state_v_first`"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, state_v_first=True,
                                       transpose_state_layout=True)


@pytest.mark.parametrize("fn", ["parallel_simple_gla", "parallel_retention"])
def test_parallel_forms_return_o_and_the_attention_scores(cpu_ops, monkeypatch, fn):
    """fla's parallel_simple_gla / parallel_retention: o as the chunk function's, and with
    output_attentions the causal scores attn [B, H, T, T] (f32) with attn @ v == o (both
    against the fp64 reference); with cu_seqlens the scores are refused, as in fla.
    (Retention's op has no CPU kernel here: its chunk function is the reference.)"""
    from linattn.ops import retention
    from linattn.ops.build import fixed_gate
    q, k, v, g, _ = inputs(T=40, HV=2, K=64, dtype=F32)
    monkeypatch.setattr(retention, "chunk_retention", lambda q, k, v, *a, **kw: (
        tr.recurrent_forward(retention.SPEC, q, k, v, fixed_gate(retention.SPEC, q, v), None)))
    args = (q, k, v, g) if fn == "parallel_simple_gla" else (q, k, v)
    o, attn = getattr(linattn, fn)(*args, output_attentions=True)
    o2, none = getattr(linattn, fn)(*args)
    assert none is None and torch.equal(o, o2)
    spec = get_spec("simple_gla") if fn == "parallel_simple_gla" else retention.SPEC
    gate = g if fn == "parallel_simple_gla" else fixed_gate(retention.SPEC, q, v)
    ro, _ = tr.recurrent_forward(spec, q, k, v, gate, None)
    assert attn.shape == (2, 2, 40, 40) and attn.dtype == F32
    assert torch.equal(attn.triu(1), torch.zeros_like(attn))
    _close(o, ro, 1e-5)
    _close((attn.double() @ v.double().transpose(1, 2)).transpose(1, 2), ro, 1e-5)
    with pytest.raises(SpecError, match="output_attentions=True is not supported with cu"):
        getattr(linattn, fn)(*(t[:1] for t in args), output_attentions=True,
                             cu_seqlens=torch.tensor([0, 40]))


def test_fused_chunk_forms_are_the_chunk_functions(cpu_ops):
    q, k, v, g, _ = inputs(T=40, HV=2, K=64)
    assert linattn.fused_chunk_retention is linattn.chunk_retention
    assert linattn.fused_chunk_linear_attn is linattn.chunk_linear_attn
    a = linattn.fused_chunk_simple_gla(q, k, v, g, None, 0.5, None, True)
    b = linattn.chunk_simple_gla(q, k, v, g, scale=0.5, output_final_state=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_fla_gate_functions():
    """fused_gdn_gate / fused_kda_gate (fla's standalone gate activations) against the
    formulas in fp64, with gradients for g, A_log, dt_bias; one-line errors for bad
    shapes."""
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g, A, b = r(2, 7, 3), r(3), r(3)
    sp = lambda x: torch.log1p(torch.exp(x))  # noqa: E731
    got = linattn.fused_gdn_gate(g.bfloat16(), A.float(), b.float(), output_dtype=BF)
    assert got.dtype == BF and got.shape == g.shape
    _close(got, -torch.exp(A) * sp(g.bfloat16().double() + b), 1e-2)
    gk, bk = r(2, 7, 3, 8), r(24)
    ref = -torch.exp(A).view(3, 1) * sp(gk + bk.view(3, 8))
    leaves = [t.float().requires_grad_() for t in (gk, A, bk)]
    out = linattn.fused_kda_gate(*leaves)
    assert out.dtype == F32
    _close(out, ref, 1e-6)
    out.sum().backward()
    refs = [t.clone().requires_grad_() for t in (gk, A, bk)]
    (-torch.exp(refs[1]).view(3, 1) * sp(refs[0] + refs[2].view(3, 8))).sum().backward()
    for got_t, ref_t in zip(leaves, refs):
        _close(got_t.grad, ref_t.grad, 1e-5)
    low = linattn.fused_kda_gate(gk, None, bk, lower_bound=-5.0)
    _close(low, -5.0 * torch.sigmoid(gk + bk.view(3, 8)), 1e-6)
    with pytest.raises(SpecError, match="dt_bias must have 24 elements"):
        linattn.fused_kda_gate(gk, A, b)
    with pytest.raises(SpecError, match="needs A_log"):
        linattn.fused_kda_gate(gk)


@pytest.mark.parametrize("fn, K, v_first", [("chunk_gla", 320, False),
                                            ("fused_recurrent_gla", 300, True),
                                            ("chunk_simple_gla", 520, False),
                                            ("chunk_linear_attn", 272, False)])
def test_additive_keys_past_256_run_in_key_blocks(cpu_ops, fn, K, v_first):
    """The additive rule with K > 256 (fla's GLA tests: 320, 512): the sum of calls on key
    blocks (each key channel's state row is independent), the scale K^-0.5 of the whole
    call: o and the final state against the fp64 reference at the call's own K."""
    spec = get_spec({"chunk_gla": "gla", "fused_recurrent_gla": "gla"}.get(fn, fn[6:]))
    q, k, v, g, _ = inputs(T=70, HV=2, K=K, V=32, gate="key" if spec.gate.value == "key"
                           else "scalar")
    h0 = torch.randn(2, 2, K, 32)
    kw = dict(initial_state=h0.transpose(-1, -2) if v_first else h0, output_final_state=True)
    if v_first:
        kw["state_v_first"] = True
    if fn == "chunk_linear_attn":
        kw["normalize"] = False
    args = (q, k, v) if spec.gate.value == "none" else (q, k, v, g)
    o, ht = getattr(linattn, fn)(*args, **kw)
    assert len(cpu_ops) == -(-K // 256)
    ro, rht = tr.recurrent_forward(spec, q, k, v, g if len(args) == 4 else None, None,
                                   initial_state=h0)
    _close(o, ro)
    _close(ht.transpose(-1, -2) if v_first else ht, rht)


def test_additive_keys_past_256_train_in_key_blocks(cpu_ops, monkeypatch):
    """Training by key blocks: the autograd Function replaced by the differentiable fp64
    recurrence, so o, the final state and every gradient of chunk_gla at K = 320 against
    torch autograd of the whole call's recurrence (scale, state rows, gate slices)."""
    from linattn.ops import additive_bwd
    spec = get_spec("gla")

    blocks = []

    def fake(call, q, k, v, g, h0):
        blocks.append(q.shape[-1])
        o, ht = tr.recurrent_forward(call.spec, q, k, v, g, None, scale=call.scale,
                                     initial_state=h0)
        return o.to(q.dtype), ht.float()
    monkeypatch.setattr(additive_bwd.ChunkAdditiveFunction, "apply", fake)
    q, k, v, g, _ = inputs(T=40, HV=2, K=320, V=32, gate="key")
    x = dict(q=q, k=k, v=v, g=g, initial_state=torch.randn(2, 2, 320, 32))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = linattn.chunk_gla(**leaves, output_final_state=True)
    assert blocks == [160, 160]
    do, dht = torch.randn_like(o.float()), torch.randn_like(ht)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rht = tr.recurrent_forward(spec, ref["q"], ref["k"], ref["v"], ref["g"], None,
                                   initial_state=ref["initial_state"])
    ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
    _close(o, ro)
    _close(ht, rht, 1e-5)
    for n, t in leaves.items():
        _close(t.grad, ref[n].grad)


def test_fused_recurrent_kda_fwd_decodes_on_a_pool_in_place(cpu_ops):
    """fla's fused_recurrent_kda_fwd as vLLM calls it (fla's own test, small): one token
    per sequence, cu_seqlens, a pool whose unnamed slots hold 1e30, inplace_final_state by
    default, o written into ``out``: o and the named slots against a loop of the fp64
    recurrence, the other slots untouched."""
    B, H, D = 5, 2, 32
    gen = torch.Generator().manual_seed(9)
    pool = torch.full((3 * B, H, D, D), 1e30)
    slots = torch.randperm(3 * B, generator=gen)[:B].int()
    pool[slots.long()] = torch.randn(B, H, D, D, generator=gen)
    q, k, v, g, beta = inputs(B=1, T=B, H=H, HV=H, K=D, V=D, gate="key")
    cu = torch.arange(B + 1, dtype=torch.int32)
    want = pool.clone()
    out = torch.empty_like(v)
    o, ht = linattn.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, scale=0.5,
                                            cu_seqlens=cu, ssm_state_indices=slots, out=out)
    assert o is out and ht is pool
    for i in range(B):
        s = int(slots[i])
        ro, rht = tr.recurrent_forward(get_spec("kda"), *(t[:, i:i + 1] for t in (q, k, v, g, beta)),
                                       scale=0.5, initial_state=want[s:s + 1])
        _close(o[:, i:i + 1], ro)
        want[s] = rht[0].float()
    _close(pool[slots.long()], want[slots.long()], 1e-5)
    rest = torch.ones(3 * B, dtype=torch.bool)
    rest[slots.long()] = False
    assert torch.equal(pool[rest], want[rest])


@pytest.mark.parametrize("fn, fam", [("chunk_kda", "kda"), ("chunk_delta_rule", "deltanet"),
                                     ("fused_recurrent_gated_delta_rule", "gdn")])
def test_delta_rule_training_past_the_kernels_head_dims_is_exact(cpu_ops, fn, fam):
    """16-bit delta-rule training with K or V past the backward kernels' 128 (fla's KDA
    test: 256) runs the exact torch path (ops/exact_train.py): o, the final state and
    every gradient against torch autograd of the fp64 token recurrence."""
    spec = get_spec(fam)
    HV = 2 if fam == "deltanet" else 4
    q, k, v, g, beta = inputs(B=1, T=40, H=2, HV=HV, K=160, V=144, gate="key" if fam == "kda"
                              else "scalar")
    x = dict(q=q, k=k, v=v, initial_state=torch.randn(1, HV, 160, 144), beta=beta[..., :HV])
    if fam != "deltanet":
        x["g"] = g
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = getattr(linattn, fn)(**leaves, output_final_state=True)
    assert o.dtype == BF
    do, dht = torch.randn_like(o.float()), torch.randn_like(ht)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rht = tr.recurrent_forward(spec, ref["q"], ref["k"], ref["v"], ref.get("g"),
                                   ref["beta"], initial_state=ref["initial_state"])
    ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
    _close(o, ro)
    _close(ht, rht, 1e-4)
    for n, t in leaves.items():
        _close(t.grad, ref[n].grad)
