"""CPU tests of the chunked forward: templates render, stages compile for sm_90a, and the
host-side chunk tables match a direct NumPy walk over the sequences."""
import types

import numpy as np
import pytest

from linattn.dsl import Gate, Options, SpecError, all_rule_gate_specs
from linattn.ops import chunk
from linattn.ops.registry import get_spec

SIX = {s.name: s for s in all_rule_gate_specs()}
SUPPORTED = [n for n, s in SIX.items() if s.gate in chunk.SUPPORTED_GATES]


def _spec(name):
    return SIX[name] if name in SIX else get_spec(name)


# -- rendering ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", chunk.STAGES)
@pytest.mark.parametrize("name", ["deltanet", "gdn"] + SUPPORTED)
def test_stage_renders(name, stage):
    spec = _spec(name)
    mod = chunk.stage_module(spec, stage)
    assert isinstance(mod, types.ModuleType)
    assert mod.STAGE == stage and mod.SPEC_HASH == spec.hash and mod.SPEC_KEY == spec.key
    assert mod.out_idx(**mod.EXAMPLES[0]) == []
    # the spec's structure reaches the text: no gate, no cumsum; additive, no inverse
    text = _rendered_text(spec, stage)
    assert ("T.cumsum" in text) == (stage == "chunk_prepare" and spec.has_gate)
    assert ("_chunk_inverse" not in text) and (
        ("x_s = T.alloc_shared" in text) == (stage == "chunk_prepare" and spec.has_beta))


def _rendered_text(spec, stage):
    from linattn.codegen.plan import plan
    from linattn.codegen.render import render_stage
    return render_stage(spec, {s.name: s for s in plan(spec, "fwd")}[stage], "sm90")


@pytest.mark.parametrize("name", ["kda", "gla", "delta_key", "additive_key"])
def test_key_gate_has_its_own_prepare(name):
    text = chunk.stage_module(_spec(name), "chunk_prepare").__doc__
    assert "per-key-channel gate" in text
    assert "diag(exp(g_last))" in chunk.stage_module(_spec(name), "chunk_state").__doc__


def test_rendering_is_deterministic():
    spec = get_spec("gdn")
    assert all(_rendered_text(spec, s) == _rendered_text(spec, s) for s in chunk.STAGES)


# -- compiling (sm_90a, no GPU needed) ----------------------------------------------------

COMPILE_CASES = [   # (the other specs' kernels are traced in the launch tests below)
    ("gdn", 0), ("gdn", 1), ("deltanet", 1), ("kda", 0), ("gla", 1),
]


@pytest.mark.compile
@pytest.mark.parametrize("stage", chunk.STAGES)
@pytest.mark.parametrize("name,example", COMPILE_CASES,
                         ids=[f"{n}-ex{e}" for n, e in COMPILE_CASES])
def test_stage_compiles(name, example, stage):
    spec = _spec(name)
    mod = chunk.stage_module(spec, stage)
    params = dict(mod.EXAMPLES[example])
    if stage == "chunk_state":
        params["num_stages"] = chunk.STATE_NUM_STAGES
    kern = chunk.compiled_stage(spec, stage, **params)
    src = kern.get_kernel_source()
    assert "__global__" in src
    uses_gemm = stage != "chunk_prepare" or spec.has_beta or spec.gate is Gate.KEY
    assert ("wgmma" in src) == uses_gemm


@pytest.mark.compile
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_fused_stages_compile(name):
    spec = _spec(name)
    for stage in chunk.FUSED_STAGES:
        if stage == "chunk_qk" and spec.gate is Gate.KEY:
            continue
        mod = chunk.stage_module(spec, stage)
        src = chunk.compiled_stage(spec, stage, **mod.EXAMPLES[0]).get_kernel_source()
        assert "wgmma" in src or "mma" in src


@pytest.mark.compile
@pytest.mark.parametrize("num_stages", [0, 1])
def test_state_pass_compiles_unpipelined_and_shallow(num_stages):
    spec = get_spec("gdn")
    params = dict(chunk.stage_module(spec, "chunk_state").EXAMPLES[1], num_stages=num_stages)
    src = chunk.compiled_stage(spec, "chunk_state", **params).get_kernel_source()
    assert ("mbarrier" in src) == (num_stages > 0)     # > 0: warp-specialised TMA pipeline


@pytest.mark.compile
@pytest.mark.parametrize("inverse", ["column", "blocked", "tc"])
def test_prepare_inverses_compile(inverse):
    spec = get_spec("deltanet")
    params = dict(chunk.stage_module(spec, "chunk_prepare").EXAMPLES[0], inverse=inverse)
    src = chunk.compiled_stage(spec, "chunk_prepare", **params).get_kernel_source()
    assert "wgmma" in src


# -- host chunk tables --------------------------------------------------------------------

def _tables_by_walking(lens, C):
    bos, length, offsets = [], [], [0]
    start = 0
    for L in lens:
        t = 0
        while t < L:
            bos.append(start + t)
            length.append(min(C, L - t))
            t += C
        offsets.append(len(bos))
        start += L
    return np.array(bos), np.array(length), np.array(offsets)


@pytest.mark.parametrize("C", [16, 64])
def test_chunk_tables_match_walk(rng, C):
    for _ in range(20):
        n = int(rng.integers(1, 33))
        lens = rng.integers(0, 300, n)
        lens[rng.integers(0, n)] = 1
        cu = np.concatenate([[0], np.cumsum(lens)])
        bos, length, offsets = chunk.build_chunk_tables(cu, C)
        want = _tables_by_walking(lens, C)
        for got, ref in zip((bos, length, offsets), want):
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, ref)
        assert np.all((length >= 1) & (length <= C))


def test_chunk_tables_fixed_length():
    bos, length, offsets = chunk.build_chunk_tables([0, 65, 130], 64)
    assert bos.tolist() == [0, 64, 65, 129]
    assert length.tolist() == [64, 1, 64, 1]
    assert offsets.tolist() == [0, 2, 4]


@pytest.mark.parametrize("cu", [[1, 4], [0, 5, 3], [0]])
def test_chunk_tables_reject_bad_cu(cu):
    with pytest.raises(SpecError):
        chunk.build_chunk_tables(cu, 64)


def test_state_block_fills_gpu():
    assert chunk.state_block_v(128, 512) == 64       # several waves whatever the block
    assert chunk.state_block_v(128, 64) == 64        # 128 CTAs: one wave (32: two)
    assert chunk.state_block_v(128, 32) == 32        # 128 CTAs
    assert chunk.state_block_v(128, 16) == 16        # 128 CTAs
    assert chunk.state_block_v(128, 8) == 16         # 64 CTAs, the smallest block
    assert chunk.state_block_v(48, 1) == 16
    # varlen: unequal sequences (1024 + 7168 tokens, 32 heads): the short ones' CTAs free
    # their SMs early and the long ones' steps are cheaper at block 32
    assert chunk.state_block_v(128, 64, (16, 112)) == 32
    assert chunk.state_block_v(128, 64, (96, 32)) == 32     # 6144 + 2048 tokens
    assert chunk.state_block_v(128, 64, (16, 16)) == 64     # equal: the one-wave rule
    assert chunk.state_block_v(128, 64, (1,) * 64) == 64
    with pytest.raises(SpecError):
        chunk.state_block_v(40, 1)
    with pytest.raises(SpecError):
        chunk.output_block_v(40)
    assert chunk.output_block_v(128) == 128 and chunk.output_block_v(192) == 64


def test_options_checked_before_launch():
    with pytest.raises(SpecError):
        chunk.chunk_forward(get_spec("deltanet"), None, None, None,
                            options=Options(gate_in_kernel=True))


# -- launch arguments against the traced kernel signatures (no GPU: fake kernels) --------

class SignatureCheckingKernel:
    """Stands in for a compiled stage: checks each call's arguments against the traced
    prim_func (count, dtypes, static dims, one value per dynamic size, contiguity)."""

    def __init__(self, func):
        self.func = func
        self.calls = 0

    def __call__(self, *args):
        params = list(self.func.params)
        assert len(args) == len(params), (len(args), [p.name for p in params])
        binds, exprs = {}, []
        for p, a in zip(params, args):
            buf = self.func.buffer_map.get(p)
            if buf is None:
                assert isinstance(a, float), (p.name, type(a))
                continue
            name = buf.name
            assert str(a.dtype).replace("torch.", "") == str(buf.dtype), (name, a.dtype, buf.dtype)
            assert a.dim() == len(buf.shape), (name, tuple(a.shape), list(buf.shape))
            assert a.is_contiguous(), name
            for s, d in zip(buf.shape, a.shape):
                text = str(s)
                if text.isdigit():
                    assert int(text) == d, (name, list(buf.shape), tuple(a.shape))
                elif text.isidentifier():
                    assert binds.setdefault(text, d) == d, (name, text, binds[text], d)
                else:
                    exprs.append((name, text, d))
        for name, text, d in exprs:
            for op, solve in ((" + ", lambda d, c: d - c), (" * ", lambda d, c: d // c)):
                var, hit, const = text.partition(op)   # TileLang solves "N + 1", "NT * 64"
                if hit and var.isidentifier() and const.isdigit() and var not in binds:
                    binds[var] = solve(d, int(const))
            assert eval(text, {}, dict(binds)) == d, (name, text, binds, d)
        self.calls += 1


LAUNCH_CASES = [
    ("gdn", dict(B=2, T=65, H=2, HV=4, K=64, V=64), Options(), True, True, None),
    ("gdn", dict(B=1, T=0, H=2, HV=4, K=64, V=64), Options(), False, True, [0]),
    ("gdn", dict(B=1, T=0, H=2, HV=2, K=128, V=128),
     Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True, gate_in_kernel=True,
             state_v_first=True), True, False, [1, 64, 1, 200]),
    ("deltanet", dict(B=3, T=1, H=4, HV=4, K=128, V=64), Options(l2norm_qk=True), False, False,
     None),
    ("additive_none", dict(B=1, T=100, H=2, HV=2, K=64, V=64), Options(), True, True, None),
    ("additive_scalar", dict(B=1, T=100, H=1, HV=2, K=64, V=64), Options(l2norm_qk=True),
     False, True, None),
    ("kda", dict(B=2, T=70, H=2, HV=4, K=128, V=128), Options(l2norm_qk=True), True, True,
     None),
    ("kda", dict(B=1, T=0, H=1, HV=2, K=64, V=64),
     Options(gate_in_kernel=True, beta_sigmoid=True, state_v_first=True), True, True,
     [5, 64, 1]),
    ("gla", dict(B=2, T=65, H=2, HV=2, K=64, V=128), Options(), False, True, None),
    ("additive_key", dict(B=1, T=0, H=1, HV=2, K=64, V=64), Options(gate_in_kernel=True),
     True, False, [3, 100]),
]


def fake_stages(monkeypatch, bodies: dict, calls: list | None = None):
    """Replace ops.chunk's compiled stages by fakes: each launch is checked against the
    traced prim_func (SignatureCheckingKernel), then runs bodies[stage](params)(*args),
    the stage's formula; calls (if given) collects the stage names compiled."""
    def fake_compiled(spec_, stage, **params):
        checker = SignatureCheckingKernel(chunk.stage_module(spec_, stage).build(**params))
        body = bodies[stage](params)
        if calls is not None:
            calls.append(stage)

        def call(*args):
            checker(*args)
            body(*args)
        return call
    monkeypatch.setattr(chunk, "compiled_stage", fake_compiled)


@pytest.mark.parametrize("prepare", ["fused", "split-warp64-wuloop"])
@pytest.mark.parametrize("fused", [False, True], ids=["3stage", "fused"])
@pytest.mark.parametrize("name,dims,options,init,final,lens", LAUNCH_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(LAUNCH_CASES)])
def test_launch_arguments_match_kernels(monkeypatch, name, dims, options, init, final, lens,
                                        fused, prepare):
    import torch
    spec = _spec(name)
    fakes = {}
    monkeypatch.setattr(chunk, "FUSE_OUTPUT", fused)
    for knob, value in chunk.PREPARE_VARIANTS[prepare].items():
        monkeypatch.setattr(chunk, knob, value)

    def fake_compiled(spec_, stage, **params):
        mod = chunk.stage_module(spec_, stage)
        key = (stage, tuple(sorted(params.items())))
        if key not in fakes:
            fakes[key] = SignatureCheckingKernel(mod.build(**params))
        return fakes[key]

    monkeypatch.setattr(chunk, "compiled_stage", fake_compiled)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    B, T, H, HV, K, V = (dims[k] for k in ("B", "T", "H", "HV", "K", "V"))
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + np.cumsum(lens).tolist())
        T = int(cu[-1])
    N = B if cu is None else len(lens)
    bf = torch.bfloat16
    q, k = torch.randn(B, T, H, K, dtype=bf), torch.randn(B, T, H, K, dtype=bf)
    v = torch.randn(B, T, HV, V, dtype=bf)
    g = -torch.rand(*spec.gate_shape(B, T, HV, K)) if spec.has_gate else None
    beta = torch.rand(B, T, HV, dtype=bf) if spec.has_beta else None
    shape = (N, HV, V, K) if options.state_v_first else (N, HV, K, V)
    h0 = torch.randn(shape) if init else None
    A_log = torch.rand(HV) if options.gate_in_kernel else None
    dt_bias = (torch.rand(HV * (K if spec.gate is Gate.KEY else 1)) if options.gate_in_kernel
               else None)
    o, ht = chunk.chunk_forward(spec, q, k, v, g, beta, initial_state=h0,
                                output_final_state=final, options=options, cu_seqlens=cu,
                                cu_seqlens_cpu=cu, A_log=A_log, dt_bias=dt_bias)
    assert o.shape == (B, T, HV, V) and o.dtype == bf
    assert (ht is not None) == final and (ht is None or ht.shape == shape)
    calls = {stage: sum(f.calls for (s, _), f in fakes.items() if s == stage)
             for stage in chunk.STAGES + chunk.FUSED_STAGES + chunk.SPLIT_PREPARE_STAGES}
    if T > 0:
        if fused:
            assert calls["chunk_state_output"] == 1 and calls["chunk_state"] == 0
            assert calls["chunk_qk"] == int(spec.gate is not Gate.KEY)
        else:
            assert calls["chunk_state"] == 1 and calls["chunk_output"] == 1
        needs_prepare = spec.has_gate or spec.has_beta or options.l2norm_qk
        split = chunk.PREPARE_SPLIT and spec.has_beta and spec.gate is not Gate.KEY
        assert calls["chunk_prepare"] == int(needs_prepare and not split)
        assert calls["chunk_kkt_inverse"] == calls["chunk_wu"] == int(split)


@pytest.mark.parametrize("bad,match", [
    (dict(g_shape=(1, 5, 3)), "g has shape"),
    (dict(beta=None), "needs beta"),
    (dict(K=40), "K \\(key head dim\\)"),
    (dict(cu=[0, 3, 2, 5]), "nondecreasing"),
    (dict(cu=[0, 2, 4]), "end at T"),
    (dict(h0_rows=3), "N=2"),
])
def test_bad_inputs_are_refused(bad, match, monkeypatch):
    import torch
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    K = bad.get("K", 64)
    q = torch.zeros(1, 5, 2, K, dtype=torch.bfloat16)
    v = torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)
    g = torch.zeros(bad.get("g_shape", (1, 5, 2)))
    beta = bad.get("beta", torch.zeros(1, 5, 2))
    cu = torch.tensor(bad.get("cu", [0, 2, 5]))
    h0 = torch.zeros(bad.get("h0_rows", 2), 2, K, 64)
    with pytest.raises(SpecError, match=match):
        chunk.chunk_forward(get_spec("gdn"), q, q, v, g, beta, initial_state=h0,
                            cu_seqlens=cu, cu_seqlens_cpu=cu)


def test_using_sets_and_restores_knobs():
    before = (chunk.FUSE_OUTPUT, chunk.STATE_NUM_STAGES)
    with chunk.using(FUSE_OUTPUT=not before[0], STATE_NUM_STAGES=3):
        assert (chunk.FUSE_OUTPUT, chunk.STATE_NUM_STAGES) == (not before[0], 3)
    assert (chunk.FUSE_OUTPUT, chunk.STATE_NUM_STAGES) == before
    with pytest.raises(RuntimeError):
        with chunk.using(FUSE_OUTPUT=not before[0]):
            raise RuntimeError("inside")
    assert chunk.FUSE_OUTPUT == before[0]
    with pytest.raises(AttributeError, match="no knob"):
        with chunk.using(NOT_A_KNOB=1):
            pass
    with pytest.raises(AttributeError, match="no knob"):
        with chunk.using(stage_params=None):      # functions are not knobs
            pass


def test_fuse_output_rule():
    """FUSE_OUTPUT unset: the arch table picks the path by (sequences x value heads), with
    the fused path from CHUNK_FUSE_OUTPUT_MIN_CHAINS on; True / False force it."""
    from linattn.codegen.arch import sm90
    m = sm90.CHUNK_FUSE_OUTPUT_MIN_CHAINS_DEFAULT
    with chunk.using(FUSE_OUTPUT=None):
        assert not chunk.fuse_output(m - 1) and chunk.fuse_output(m)
        for dtype in ("bfloat16", "float16"):
            m = sm90.CHUNK_FUSE_OUTPUT_MIN_CHAINS.get(dtype, m)
            assert not chunk.fuse_output(m - 1, dtype) and chunk.fuse_output(m, dtype)
        assert not chunk.fuse_output(8) and chunk.fuse_output(16)    # tp8-8192, prefill-4k
        assert chunk.fuse_output(8, "float16")      # tp8 f16: the 3-stage state pass is slower
        small = sm90.CHUNK_FUSE_OUTPUT_MIN_CHAINS_SMALL_K["bfloat16"]
        assert not chunk.fuse_output(16, "bfloat16", 64)    # prefill-narrow-state
        assert not chunk.fuse_output(small - 1, "bfloat16", 64)
        assert chunk.fuse_output(small, "bfloat16", 64) and chunk.fuse_output(16, "bfloat16", 128)
        assert chunk.fuse_output(8, "float16", 64)
    for forced in (True, False):
        with chunk.using(FUSE_OUTPUT=forced):
            assert chunk.fuse_output(1) is forced and chunk.fuse_output(10_000) is forced


def test_prepare_variants_name_every_split_knob():
    """A named prepare variant means the same whatever the module defaults are."""
    knobs = {"PREPARE_SPLIT_INVERSE", "PREPARE_SPLIT_KKT_THREADS", "PREPARE_SPLIT_WU"}
    for name, v in chunk.PREPARE_VARIANTS.items():
        assert "PREPARE_SPLIT" in v, name
        if v["PREPARE_SPLIT"]:
            assert knobs <= set(v), name


def test_gla_chunk_fwd_contract_assembles_states(monkeypatch):
    """GLAChunkFwd through the chunked forward (fake kernels checked against the traced
    prim_funcs): the 3-stage path whatever FUSE_OUTPUT says, the state pass with
    states_out writing h [B, NC+1, H, K, V] f32 itself (chunk c of sequence n at row
    chunk_offsets[n] + n + c, the final state after them), final_state the view h[:, NC];
    varlen: each sequence's final row gathered; a bad shape is refused before any launch."""
    import torch
    from linattn.ops import contracts
    monkeypatch.setattr(chunk, "FUSE_OUTPUT", True)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    stages = []

    def fake_compiled(spec_, stage, **params):
        checker = SignatureCheckingKernel(chunk.stage_module(spec_, stage).build(**params))
        stages.append(stage)

        def call(*args):
            checker(*args)
            if stage == "chunk_state":      # states: chunk c of the call holds c; final: -1-n
                assert params["states_out"] and params["output_final_state"]
                offs, states = args[5].tolist(), args[9]
                states.fill_(float("nan"))
                for n in range(len(offs) - 1):
                    for c in range(offs[n], offs[n + 1]):
                        states[c + n] = c
                    states[offs[n + 1] + n] = -1.0 - n
        return call

    monkeypatch.setattr(chunk, "compiled_stage", fake_compiled)
    B, T, H, K, V = 2, 130, 2, 64, 64
    bf = torch.bfloat16
    q, k = torch.randn(B, T, H, K, dtype=bf), torch.randn(B, T, H, K, dtype=bf)
    v, g = torch.randn(B, T, H, V, dtype=bf), -torch.rand(B, T, H, K).to(bf)
    o, final, h = contracts.gla_chunk_fwd(q, k, v, g, scale=0.125)
    NC = 3
    assert stages == ["chunk_prepare", "chunk_state", "chunk_output"]
    assert o.shape == (B, T, H, V) and o.dtype == bf
    assert final.shape == (B, H, K, V) and final.dtype == torch.float32
    assert h.shape == (B, NC + 1, H, K, V) and h.dtype == torch.float32
    for b in range(B):
        for c in range(NC):
            assert torch.all(h[b, c] == b * NC + c)
        assert torch.all(final[b] == -1 - b)
    assert torch.equal(h[:, NC], final)
    lens = [70, 1, 0, 130]                              # varlen: 2 + 1 + 0 + 3 chunks
    cu = torch.tensor([0, 70, 71, 71, 201])
    qv, kv, vv = (torch.randn(1, 201, H, D, dtype=bf) for D in (K, K, V))
    gv = -torch.rand(1, 201, H, K).to(bf)
    _, fin, states = chunk.chunk_forward(get_spec("gla"), qv, kv, vv, gv, scale=0.125,
                                         cu_seqlens=cu, output_final_state=True,
                                         return_states=True)
    assert states.shape == (6 + len(lens), H, K, V)
    assert [float(fin[n, 0, 0, 0]) for n in range(4)] == [-1.0, -2.0, -3.0, -4.0]
    with pytest.raises(SpecError):
        contracts.gla_chunk_fwd(q, k, v, g[..., :32])


def test_many_chunks_take_grids_that_fit(monkeypatch):
    """Past CUDA's gridDim.y limit (MAX_GRID_YZ, made small here) in chunks, the forward
    takes chunk-fastest grids and the fused path (no chunk_output, whose grid has the
    chunk on y); the per-chunk states (GLAChunkFwd) and the DeltaNet contract forward are
    refused with a clear error instead of a failed launch."""
    import torch
    from linattn.ops import contracts
    monkeypatch.setattr(chunk._ARCH, "MAX_GRID_YZ", 2)
    monkeypatch.setattr(chunk, "FUSE_OUTPUT", False)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    seen = {}

    def fake_compiled(spec_, stage, **params):
        checker = SignatureCheckingKernel(chunk.stage_module(spec_, stage).build(**params))
        seen[stage] = params
        return checker

    monkeypatch.setattr(chunk, "compiled_stage", fake_compiled)
    bf = torch.bfloat16
    B, T, H, K, V = 1, 130, 2, 64, 64        # 3 chunks > 2
    q, k, v = (torch.randn(B, T, H, D, dtype=bf) for D in (K, K, V))
    g, beta = -torch.rand(B, T, H), torch.rand(B, T, H, dtype=bf)
    chunk.chunk_forward(get_spec("gdn"), q, k, v, g, beta, output_final_state=True)
    assert "chunk_state_output" in seen and "chunk_output" not in seen
    assert not any(p.get("heads_fastest") for p in seen.values())
    with pytest.raises(SpecError, match="per-chunk states"):
        contracts.gla_chunk_fwd(q, k, v, -torch.rand(B, T, H, K).to(bf))
    hf = lambda *s: torch.randn(*s, dtype=bf)  # noqa: E731
    from linattn.ops import chunk_bwd
    monkeypatch.setattr(chunk_bwd, "_check_device", lambda n, t: None)
    with pytest.raises(SpecError, match="chunks in all"):
        contracts.deltanet_chunk_fwd(hf(1, 2, 130, 64), hf(1, 2, 130, 64), hf(1, 2, 130, 64),
                                     torch.rand(1, 2, 130, dtype=bf))
    seen.clear()
    monkeypatch.setattr(chunk._ARCH, "MAX_GRID_YZ", 65535)     # 3 chunks fit: as before
    chunk.chunk_forward(get_spec("gdn"), q, k, v, g, beta, output_final_state=True)
    assert "chunk_output" in seen and seen["chunk_output"].get("heads_fastest")


def test_qk_group_loop_launch_matches_kernel(monkeypatch):
    """QK_GROUP_LOOP: chunk_qk built per key head takes the same launch arguments (GVA)."""
    import torch
    monkeypatch.setattr(chunk, "FUSE_OUTPUT", True)
    monkeypatch.setattr(chunk, "QK_GROUP_LOOP", True)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    seen = {}

    def fake_compiled(spec_, stage, **params):
        seen[stage] = params
        return SignatureCheckingKernel(chunk.stage_module(spec_, stage).build(**params))

    monkeypatch.setattr(chunk, "compiled_stage", fake_compiled)
    bf = torch.bfloat16
    B, T, H, HV, K, V = 1, 100, 2, 4, 64, 64
    q, k = torch.randn(B, T, H, K, dtype=bf), torch.randn(B, T, H, K, dtype=bf)
    v = torch.randn(B, T, HV, V, dtype=bf)
    chunk.chunk_forward(get_spec("gdn"), q, k, v, -torch.rand(B, T, HV),
                        torch.rand(B, T, HV, dtype=bf), options=Options(l2norm_qk=True))
    assert seen["chunk_qk"].get("group_loop") is True


def test_key_gate_prepare_knobs():
    """PREPARE_KEY_THREADS / _INVERSE reach the per-key gate's chunk_prepare (KDA; GLA has
    no inverse) and leave the scalar-gate stages alone; the default is 256 threads (run
    s5-3) and the shared PREPARE_INVERSE."""
    kw = dict(H=2, HV=2, K=64, V=64, dtype="bfloat16")
    kda, gla, gdn = (get_spec(n) for n in ("kda", "gla", "gdn"))
    p = chunk.stage_params(kda, Options(), **kw)["chunk_prepare"]
    assert p["threads"] == 256 and p["inverse"] == chunk.PREPARE_INVERSE
    assert all("threads" not in v or v["threads"] != 256
               for v in chunk.stage_params(gdn, Options(), **kw).values())
    assert "skew" not in p                       # the template's default: no skew
    with chunk.using(PREPARE_KEY_THREADS=128, PREPARE_KEY_INVERSE="blocked",
                     PREPARE_KEY_SKEW=True):
        p = chunk.stage_params(kda, Options(), **kw)["chunk_prepare"]
        assert "threads" not in p and p["inverse"] == "blocked"   # 128: the template's
        assert p["skew"]
        p = chunk.stage_params(gla, Options(), **kw)["chunk_prepare"]
        assert "threads" not in p and "inverse" not in p and p["skew"]
        assert all("skew" not in v for v in chunk.stage_params(gdn, Options(), **kw).values())
        chunk.stage_module(kda, "chunk_prepare").build(**chunk.stage_params(kda, Options(), **kw)["chunk_prepare"])
