"""Input validation error paths (CPU tensors) and the argument plumbing of fused_recurrent.

The plumbing test swaps the compiled kernel for one that checks every argument against
the generated prim_func's parameters (dtype, static dims, one consistent value per
dynamic dim), so a wrong order, shape or placeholder fails here without a GPU.
"""
import pytest
import torch

from linattn.dsl import Options, SpecError, all_rule_gate_specs
from linattn.ops import recurrent as rec_mod
from linattn.ops import runtime, validate
from linattn.ops.recurrent import fused_recurrent
from linattn.ops.registry import get_spec

BF = torch.bfloat16


def _inputs(spec, B=2, T=3, H=2, HV=4, K=32, V=16, dtype=BF, options=Options(), N=None,
            g_dtype=torch.float32):
    HV = HV if spec.gva else H
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = torch.randn(spec.gate_shape(B, T, HV, K), dtype=g_dtype) if spec.has_gate else None
    beta = torch.rand(B, T, HV, dtype=dtype) if spec.has_beta else None
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def _call(spec, **kw):
    args = _inputs(spec)
    args.update(kw)
    return fused_recurrent(spec, **args)


GDN, KDA, GLA, DN = (get_spec(n) for n in ("gdn", "kda", "gla", "deltanet"))


@pytest.mark.parametrize("spec, change, err, match", [
    (GDN, dict(q="not a tensor"), TypeError, "q must be a torch.Tensor"),
    (GDN, dict(q=torch.randn(2, 3, 2, 32, dtype=torch.float64)), SpecError,
     "q has dtype float64; expected float16 or bfloat16 or float32"),
    (GDN, dict(q=torch.randn(2, 3, 64, dtype=BF)), SpecError,
     r"q has shape \[2, 3, 64\]; expected \[B, T, H, K\]"),
    (GDN, dict(k=torch.randn(2, 3, 2, 32, dtype=torch.float16)), SpecError, "k has dtype"),
    (GDN, dict(k=torch.randn(2, 3, 2, 16, dtype=BF)), SpecError, r"k has shape \[2, 3, 2, 16\]"),
    (GDN, dict(k=torch.randn(2, 3, 32, 2, dtype=BF).transpose(2, 3)), SpecError, "contiguous"),
    (GDN, dict(v=torch.randn(2, 4, 4, 16, dtype=BF)), SpecError, r"v has shape"),
    (GDN, dict(v=torch.randn(2, 3, 3, 16, dtype=BF)), SpecError, "HV % H != 0"),
    (GLA, dict(v=torch.randn(2, 3, 4, 16, dtype=BF)), SpecError, "has no GVA"),
    (DN, dict(g=torch.randn(2, 3, 4)), SpecError, "no gate; g must be None"),
    (GDN, dict(g=None), SpecError, r"needs g of shape \[2, 3, 4\]"),
    (GDN, dict(g=torch.randn(2, 3, 4, 32)), SpecError, r"g has shape \[2, 3, 4, 32\]"),
    (KDA, dict(g=torch.randn(2, 3, 4)), SpecError, r"g has shape \[2, 3, 4\]; expected \[2, 3, 4, 32\]"),
    (GDN, dict(g=torch.randn(2, 3, 4, dtype=torch.float16)), SpecError, "g has dtype"),
    (GDN, dict(beta=None), SpecError, r"needs beta of shape \[2, 3, 4\]"),
    (GLA, dict(beta=torch.rand(2, 3, 2, dtype=BF)), SpecError, "additive rule; beta must be None"),
    (GDN, dict(beta=torch.rand(2, 3, 2, dtype=BF)), SpecError, "beta has shape"),
    (DN, dict(options=Options(gate_in_kernel=True)), SpecError, "deltanet does not support"),
    (GDN, dict(options=Options(gate_in_kernel=True)), SpecError, r"needs A_log of shape \[4\]"),
    (GDN, dict(options=Options(gate_in_kernel=True), A_log=torch.randn(4)), SpecError,
     r"needs dt_bias of shape \[4\]"),
    (GDN, dict(options=Options(gate_in_kernel=True), A_log=torch.randn(4, dtype=BF),
               dt_bias=torch.randn(4)), SpecError, "dt_bias has dtype float32; expected bfloat16"),
    (GDN, dict(options=Options(gate_in_kernel=True), A_log=torch.randn(4, dtype=torch.float64),
               dt_bias=torch.randn(4, dtype=torch.float64)), SpecError, "A_log has dtype float64"),
    (KDA, dict(options=Options(gate_in_kernel=True), A_log=torch.randn(4),
               dt_bias=torch.randn(4)), SpecError, r"dt_bias has shape \[4\]; expected \[128\]"),
    (GDN, dict(A_log=torch.randn(4)), SpecError, "only used with use_gate_in_kernel"),
    (GDN, dict(cu_seqlens=torch.tensor([0, 3])), SpecError, "batch size must be 1"),
    (GDN, dict(cu_seqlens_cpu=torch.tensor([0, 3])), SpecError, "without cu_seqlens"),
    (GDN, dict(initial_state=torch.zeros(3, 4, 32, 16)), SpecError, "N=2 sequences"),
    (GDN, dict(initial_state=torch.zeros(2, 4, 16, 32)), SpecError, r"layout \[N, HV, K, V\]"),
    (GDN, dict(initial_state=torch.zeros(2, 4, 32, 16), options=Options(state_v_first=True)),
     SpecError, r"state_v_first"),
    (GDN, dict(initial_state=torch.zeros(2, 4, 32, 16, dtype=torch.float64)), SpecError,
     "initial_state has dtype float64; expected float32 or float16 or bfloat16"),
    (GDN, dict(ssm_state_indices=torch.zeros(2, dtype=torch.int32)), SpecError,
     r"ssm_state_indices needs initial_state"),
    (GDN, dict(inplace_final_state=True), SpecError, "inplace_final_state=True needs"),
    (GDN, dict(state_dtype=torch.float64), SpecError, "state_dtype must be"),
    (GDN, dict(scale=-1.0), SpecError, "scale must be a positive number"),
    (GDN, dict(), SpecError, "q is on cpu; linattn runs on one CUDA device"),
])
def test_fused_recurrent_rejects(spec, change, err, match):
    with pytest.raises(err, match=match):
        _call(spec, **change)


def test_allow_neg_eigval_needs_sigmoid():
    with pytest.raises(SpecError, match="requires use_beta_sigmoid_in_kernel"):
        Options(allow_neg_eigval=True)


@pytest.mark.parametrize("vals, cpu, match", [
    ([[0, 3]], False, r"expected \[N \+ 1\]"),
    ([0], False, r"expected \[N \+ 1\]"),
    ([1, 3], False, "must start at 0"),
    ([0, 2, 1, 3], False, "nondecreasing"),
    ([0, 1, 2], False, "must end at T=3"),
    ([0, 1, 3], True, None),
    ([0, 0, 3, 3], False, None),
])
def test_cu_seqlens(vals, cpu, match):
    cu = torch.tensor(vals, dtype=torch.int32)
    if match is None:
        assert validate.check_cu_seqlens(cu, 1, 3, cu.clone() if cpu else None) == cu.numel() - 1
    else:
        with pytest.raises(SpecError, match=match):
            validate.check_cu_seqlens(cu, 1, 3)
    with pytest.raises(SpecError, match="cu_seqlens has dtype float32"):
        validate.check_cu_seqlens(torch.tensor([0.0, 3.0]), 1, 3)
    with pytest.raises(SpecError, match=r"cu_seqlens_cpu has shape"):
        validate.check_cu_seqlens(torch.tensor([0, 3]), 1, 3, torch.tensor([0, 1, 3]))


def test_cu_seqlens_cpu_is_used_without_reading_device_values():
    # values of cu_seqlens itself are wrong; the CPU copy is the one checked
    assert validate.check_cu_seqlens(torch.tensor([0, 9]), 1, 3, torch.tensor([0, 3])) == 1


def test_same_device():
    q = torch.randn(1, 2, 1, 16, dtype=BF)
    with pytest.raises(SpecError, match=r"k is on meta \(q is on cpu\)"):
        validate.check_tensor("k", torch.empty(1, 2, 1, 16, dtype=BF, device="meta"), like=q)


@pytest.mark.parametrize("K, V, match", [(100, 64, "K \\(key head dim\\)"), (512, 64, "K="),
                                         (64, 12, "V \\(value head dim\\)"), (64, 1024, "V=1024")])
def test_head_dim_limits(K, V, match):
    with pytest.raises(SpecError, match=match):
        validate.check_head_dims(K, V)
    with pytest.raises(SpecError, match=match):
        _call(GDN, **_inputs(GDN, K=K, V=V))


def test_key_gate_dt_bias_2d_is_flattened():
    dims = validate.Dims(1, 2, 2, 4, 32, 16)
    out = validate.check_gate_params(KDA, Options(gate_in_kernel=True), torch.randn(4),
                                     torch.randn(4, 32), dims)
    assert out.shape == (128,)


# ---------------------------------------------------------------- argument plumbing
class ArgCheckingKernel:
    """Stands in for a compiled kernel: checks the call against the prim_func."""

    def __init__(self, func):
        self.func = func
        self.calls = []

    def __call__(self, *args):
        from tilelang import tvm
        params = list(self.func.params)
        assert len(args) == len(params), (len(args), [p.name for p in params])
        bound, deferred = {}, []
        for p, a in zip(params, args):
            buf = self.func.buffer_map.get(p)
            if buf is None:
                assert isinstance(a, float) and str(p.dtype) == "float32", (p.name, a)
                continue
            assert isinstance(a, torch.Tensor), buf.name
            assert str(a.dtype).replace("torch.", "") == str(buf.dtype), (buf.name, a.dtype, buf.dtype)
            assert a.is_contiguous() and a.dim() == len(buf.shape), (buf.name, a.shape, buf.shape)
            for s, d in zip(buf.shape, a.shape):
                if isinstance(s, tvm.tirx.IntImm):
                    assert int(s) == d, (buf.name, list(buf.shape), list(a.shape))
                elif isinstance(s, tvm.tirx.Var):
                    assert bound.setdefault(s, d) == d, (buf.name, s, bound[s], d)
                else:
                    deferred.append((buf.name, s, d))
        for name, expr, d in deferred:
            value = tvm.arith.Analyzer().simplify(tvm.tirx.stmt_functor.substitute(
                expr, {var: tvm.tirx.IntImm("int32", val) for var, val in bound.items()}))
            assert int(value) == d, (name, expr, d)
        self.calls.append((args, {v.name: d for v, d in bound.items()}))


@pytest.fixture
def fake_kernels(monkeypatch):
    made = []

    def get_kernel(spec, stage, arch, sizes=None, **problem):
        module = runtime.stage_module(spec, stage, arch)
        params = {**runtime.get_arch(arch).tuning(stage, problem, sizes), **problem}
        kern = ArgCheckingKernel(module.build(**params))
        made.append(kern)
        return kern, module, params

    monkeypatch.setattr(rec_mod.validate, "check_cuda", lambda name, x: None)
    monkeypatch.setattr(rec_mod.runtime, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(rec_mod.runtime, "get_kernel", get_kernel)
    return made


PLUMBING = [  # (spec, options, varlen, initial, final, state dtype, beta/g dtype f32)
    (GDN, Options(), False, False, False, None, True),
    (GDN, Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True,
                  gate_in_kernel=True, state_v_first=True), True, True, True, None, False),
    (KDA, Options(gate_in_kernel=True), False, True, True, None, True),
    (GLA, Options(state_v_first=True), True, False, True, None, True),
    (DN, Options(), False, True, True, BF, False),
] + [(s, Options(), True, True, True, None, True) for s in all_rule_gate_specs()]


@pytest.mark.parametrize("spec, options, varlen, initial, final, sdt, f32", PLUMBING,
                         ids=[f"{p[0].name}-{i}" for i, p in enumerate(PLUMBING)])
def test_arguments_match_kernel_signature(fake_kernels, spec, options, varlen, initial,
                                          final, sdt, f32):
    H, HV, K, V = (2, 2, 32, 16) if not spec.gva else (2, 4, 32, 16)
    B, T = (1, 7) if varlen else (3, 2)
    args = _inputs(spec, B=B, T=T, H=H, HV=HV, K=K, V=V, g_dtype=torch.float32 if f32 else BF)
    if spec.has_beta and f32:
        args["beta"] = args["beta"].float()
    cu = torch.tensor([0, 1, 1, 7], dtype=torch.int64) if varlen else None
    N = 3
    state_dtype = sdt or torch.float32
    shape = (N, HV, V, K) if options.state_v_first else (N, HV, K, V)
    h0 = torch.randn(shape, dtype=state_dtype) if initial else None
    extra = {}
    if options.gate_in_kernel:
        extra = dict(A_log=torch.randn(HV),
                     dt_bias=torch.randn(HV * (K if spec.gate.value == "key" else 1)))
    before = {n: t.clone() for n, t in args.items() if t is not None}
    o, ht = fused_recurrent(spec, **args, initial_state=h0, output_final_state=final,
                            options=options, cu_seqlens=cu, state_dtype=sdt, **extra)
    (kern,) = fake_kernels
    (call_args, dyn), = kern.calls
    assert o.shape == (B, T, HV, V) and o.dtype == BF
    assert any(a is o for a in call_args)
    assert dyn["B"] == B and dyn.get("N", B) == N
    if final:
        assert ht.shape == shape and ht.dtype == state_dtype
        assert any(a is ht for a in call_args)
    else:
        assert ht is None
    if initial:
        assert any(a is h0 for a in call_args)
    for n, t in before.items():
        assert torch.equal(t, args[n]), n


@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("N,HV,K,V", [(1, 8, 128, 128), (8, 64, 128, 128), (8, 48, 128, 128),
                                      (256, 32, 128, 128), (3, 4, 64, 96), (512, 16, 256, 64),
                                      (128, 8, 128, 128), (8, 32, 128, 128)])
def test_decode_tuning_is_a_valid_layout(N, HV, K, V, state_dtype, v_first, pool):
    """The sm90 decode table's pick always satisfies the template's thread-map rules;
    the doubled block (64 values a thread) only for 16-bit states with CTAs to spare, the
    f32 block of 64 (one warp per 16 columns) only on grids of >= 16 CTAs per SM (8 on a
    state pool); value-first f32 states one warp per 8 columns on small grids, else per 4."""
    from linattn.codegen.arch import sm90
    problem = dict(K=K, V=V, HV=HV, state_dtype=state_dtype, state_v_first=v_first,
                   state_pool=pool)
    t = sm90.tuning("recurrent", problem, {"N": N})
    assert sm90.recurrent_layout_ok(K, V, t["block_v"], t["threads"], t["vec"], t["warps_k"],
                                    v_first)
    ctas64 = N * HV * V // 64
    wide_f32 = ctas64 >= (8 if pool else 16) * sm90.NUM_SMS     # enough CTAs at block 64
    if (state_dtype, v_first, K, V) == ("float32", False, 128, 128):
        assert (t["block_v"] == 64) == wide_f32
    if t["block_v"] == 64 and state_dtype == "float32":
        assert not v_first and K <= 128 and wide_f32
        assert t == {"block_v": 64, "threads": 128, "vec": 4, "warps_k": 1,
                     "ctas_per_sm": 3}                  # (run s41-2: 3 CTAs an SM)
    elif t["block_v"] == 64:
        assert not v_first
        assert ctas64 >= 6 * sm90.NUM_SMS
    if (N, HV, state_dtype, v_first) == (8, 64, "bfloat16", False):   # the swept row
        assert t == {"block_v": 64, "threads": 128, "vec": 8, "warps_k": 4}
    if v_first and state_dtype == "float32" and N * HV * V // 8 <= 32 * sm90.NUM_SMS:
        assert t == {"block_v": 8, "threads": 32, "vec": 8, "warps_k": 1}   # one warp, 32 B
    elif v_first and state_dtype == "float32" and V % 16 == 0 and K % 32 == 0:
        assert t == {"block_v": 16, "threads": 128, "vec": 4, "warps_k": 1}  # 16 values a thread


def test_decode_full_grid_ctas_per_sm_rule(monkeypatch):
    """DECODE_FULL_GRID's ctas_per_sm rule changes only the tiles of full f32 grids (>= 16
    block-64 CTAs an SM, 8 on a pool), into knobs the template accepts; off, the tile is
    the table's."""
    from linattn.codegen.arch import sm90
    from linattn.ops import runtime
    from linattn.ops.registry import get_spec
    check = runtime.stage_module(get_spec("gdn"), "recurrent", "sm90").check_params
    for on in (False, True):
        monkeypatch.setitem(sm90.DECODE_FULL_GRID, "ctas_per_sm", 3 if on else None)
        for N in (1, 8, 33, 64, 256, 512):
            for pool in (False, True):
                problem = dict(H=16, HV=32, K=128, V=128, state_dtype="float32",
                               state_pool=pool, has_initial_state=True)
                t = sm90.tuning("recurrent", problem, {"N": N})
                full = N * 32 * 2 >= (8 if pool else 16) * sm90.NUM_SMS
                assert ("ctas_per_sm" in t) == (on and full), (N, pool, t)
                assert sm90.recurrent_layout_ok(128, 128, t["block_v"], t["threads"], t["vec"],
                                                t["warps_k"], False)
                check(**problem, **t)


def test_decode_tuning_v_first_swept_row():
    """GDNFwd decode-vfirst-b17 (f32 state, value rows first) and Mamba-2's decode from
    batch 8 (runs s40-6 / s40-7): the swept winners."""
    from linattn.codegen.arch import sm90
    problem = dict(K=128, V=128, HV=12, state_dtype="float32", state_v_first=True)
    assert sm90.tuning("recurrent", problem, {"N": 17}) == {
        "block_v": 8, "threads": 32, "vec": 8, "warps_k": 1}
    mamba2 = dict(K=128, V=64, HV=128, state_dtype="float32", state_v_first=True)
    for n in (8, 256):
        assert sm90.tuning("recurrent", mamba2, {"N": n}) == {
            "block_v": 16, "threads": 128, "vec": 4, "warps_k": 1}


@pytest.mark.parametrize("path", ["chunk", "recurrent"])
def test_the_ops_run_what_the_public_call_checked(monkeypatch, path):
    """A public call is checked once (ops/api.py's check_call): the torch.library ops'
    implementations (ops/library.py) run chunk.run_chunk_forward / recurrent.run_recurrent,
    which check nothing again (the direct entry points' checks, chunk._check_inputs and
    recurrent._check, are never reached); a call with no tokens returns its empty o and
    the initial states as final states."""
    from linattn.ops import chunk, library

    def refuse(*a, **kw):
        raise AssertionError("a second check")
    monkeypatch.setattr(chunk, "_check_inputs", refuse)
    monkeypatch.setattr(rec_mod, "_check", refuse)
    spec = get_spec("gdn")
    B, T, H, HV, K, V = 2, 0, 2, 4, 64, 64
    q, k = (torch.zeros(B, T, H, K, dtype=torch.bfloat16) for _ in "qk")
    v = torch.zeros(B, T, HV, V, dtype=torch.bfloat16)
    g, beta = torch.zeros(B, T, HV), torch.zeros(B, T, HV, dtype=torch.bfloat16)
    h0 = torch.randn(B, HV, K, V)
    args = (q, k, v, g, beta, None, None, h0, None, None, 0.125, True, "plain")
    o, ht = library._impl(spec, path)(*args, *(() if path == "chunk" else (None, None)))
    assert o.shape == (B, T, HV, V) and torch.equal(ht, h0)
