"""CPU tests of DeltaNet's chunked backward (ops/chunk_bwd.py): the plan lists the four
stages, they render and compile for sm_90a, the contract's forward takes its stages from
the arch's three-stage plan (contract_plan, wy_params, forward_params), and
the launch arguments match the traced kernel signatures. The fake kernels also carry out
each stage's math in fp64 (the algorithm the template implements, stage by stage, through
the same buffers; the forward's stages by tests/test_chunk_fused.py's PipelineMath), so
the host code's plumbing and the stage decomposition are checked against autograd of the
fp64 reference without a GPU."""
import math

import pytest
import torch

import _layout_fakes as layout_fakes
from _kernel_check import fake_compiles
from test_chunk_fused import PipelineMath

from linattn.codegen.plan import plan
from linattn.dsl import SpecError, all_rule_gate_specs
from linattn.dsl import torch_reference as tref
from linattn.ops import chunk, chunk_bwd, contracts
from linattn.ops.registry import get_spec

F64 = torch.float64
C = chunk_bwd.CHUNK


def test_plan_lists_backward_stages():
    want = list(chunk_bwd.ALL_STAGES)
    assert [s.name for s in plan(get_spec("deltanet"), "bwd")] == want
    gated = [s for s in want if s not in chunk_bwd.SCHEMES["scan"][:2]]   # direct scheme
    assert [s.name for s in plan(get_spec("gdn"), "bwd")] == gated
    for spec in all_rule_gate_specs():          # the delta rule without a gate or scalar
        names = [s.name for s in plan(spec, "bwd")]
        if spec.rule.value == "delta":          # (the additive rule's: test_additive_bwd.py)
            key = ["chunk_bwd_gather", chunk_bwd.RECOMPUTE, *chunk_bwd.KEY_STAGES,
                   "chunk_bwd_scatter"]                             # (test_kda_bwd.py)
            assert names == {"delta_none": want, "delta_scalar": gated,
                             "delta_key": key}[spec.name]


GATED_STAGES = ("chunk_bwd_gather", "chunk_bwd_dv_local",
                 "chunk_bwd_dh", "chunk_bwd_dqkw", "chunk_bwd_wy", "chunk_bwd_scatter")


@pytest.mark.parametrize("family,stage", [("deltanet", s) for s in chunk_bwd.ALL_STAGES]
                         + [("gdn", s) for s in GATED_STAGES])
def test_stage_renders(family, stage):
    from linattn.ops.runtime import arg_names, stage_module
    spec = get_spec(family)
    mod = stage_module(spec, stage, "sm90")
    assert mod.STAGE == stage and mod.VARIANT == "bwd" and mod.SPEC_HASH == spec.hash
    ex = mod.EXAMPLES[0]
    fn = mod.build(**ex)
    assert list(arg_names(fn)) == mod.args(**ex)


@pytest.mark.compile
@pytest.mark.parametrize("block_v,num_stages", [(16, 0), (32, 0), (16, 1), (32, 2)])
def test_dh_pass_compiles_value_blocks_and_pipelines(block_v, num_stages):
    src = chunk_bwd.compiled_stage("chunk_bwd_dh", H=4, K=64, V=64, dtype="bfloat16",
                                   block_v=block_v, num_stages=num_stages).get_kernel_source()
    assert "wgmma" in src or "mma" in src
    assert ("mbarrier" in src) == (num_stages > 0)   # > 0: warp-specialised TMA pipeline


@pytest.mark.compile
def test_dqkw_compiles_with_dv2_from_dh():
    src = chunk_bwd.compiled_stage("chunk_bwd_dqkw", H=4, K=64, V=64, dtype="float16",
                                   dv2_from_dh=True).get_kernel_source()
    assert "wgmma" in src


def test_unknown_scheme_is_refused(monkeypatch):
    monkeypatch.setattr(chunk_bwd, "SCHEME", "fast")
    with pytest.raises(SpecError, match="SCHEME must be one of"):
        chunk_bwd.stage_params(H=4, K=64, V=64, dtype="float16")


def test_dh_value_block_fills_gpu():
    assert chunk_bwd.stage_params(H=4, K=64, V=64, dtype="bfloat16", B=2)[
        "chunk_bwd_dh"]["block_v"] == 16
    assert chunk_bwd.stage_params(H=32, K=128, V=128, dtype="bfloat16", B=8)[
        "chunk_bwd_dh"]["block_v"] == 64


# -- fake kernels: signature checks + the stage math in fp64 ------------------------------

def _chunks(x, L):
    """[B, H, L, D] (or [B, H, L]) -> fp64 [B, H, NC, C, D], zero rows past L."""
    x = x.to(F64)
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    NC = math.ceil(L / C)
    x = torch.nn.functional.pad(x, (0, 0, 0, NC * C - L))
    return x.view(*x.shape[:2], NC, C, x.shape[-1])


def _store(out, x, L):
    """Write fp64 chunks [B, H, NC, C, D] back into out [B, H, L(, D)]."""
    B, H = out.shape[:2]
    y = x.reshape(B, H, -1, x.shape[-1])[:, :, :L]
    out.copy_(y.reshape(out.shape).to(out.dtype))


def _dv_local(q, k, do, dv_local):
    L = q.shape[2]
    qc, kc, doc = (_chunks(x, L) for x in (q, k, do))
    P = torch.tril(qc @ kc.transpose(-1, -2))
    _store(dv_local, P.transpose(-1, -2) @ doc, L)


def _dh_start(dht, shape, use_dht):
    return dht.to(F64).clone() if use_dht else torch.zeros(shape, dtype=F64)


def _dh(q, k, w, do, dv_local, dh_out, dv2, dht, dh0, use_dht=False, store_dh0=False):
    L = q.shape[2]
    qc, kc, wc, doc, dvc = (_chunks(x, L) for x in (q, k, w, do, dv_local))
    B, H, NC = qc.shape[:3]
    dh = _dh_start(dht, (B, H, k.shape[-1], do.shape[-1]), use_dht)
    out = torch.zeros_like(dvc)
    for c in reversed(range(NC)):
        dh_out[:, :, c] = dh.to(dh_out.dtype)
        dh_lp = dh.to(dh_out.dtype).to(F64)         # the kernel multiplies the stored dh
        out[:, :, c] = dvc[:, :, c] + kc[:, :, c] @ dh_lp
        d = out[:, :, c].to(dv2.dtype).to(F64)
        dh = dh + qc[:, :, c].transpose(-1, -2) @ doc[:, :, c] - wc[:, :, c].transpose(-1, -2) @ d
    _store(dv2, out, L)
    if store_dh0:
        dh0.copy_(dh)


def _transition(q, k, w, do, dv_local, nP, X):
    L = q.shape[2]
    qc, kc, wc, doc = (_chunks(x, L) for x in (q, k, w, do))
    dvl = torch.tril(qc @ kc.transpose(-1, -2)).transpose(-1, -2) @ doc
    _store(dv_local, dvl, L)
    dvl = _chunks(dv_local, L)                      # the kernel uses the stored dv_local
    nP.copy_(-(wc.transpose(-1, -2) @ kc))
    X.copy_(qc.transpose(-1, -2) @ doc - wc.transpose(-1, -2) @ dvl)


def _dh_scan(nP, X, dh_out, dht, dh0, use_dht=False, store_dh0=False):
    P, Xs = nP.to(F64), X.to(F64)
    dh = _dh_start(dht, Xs[:, :, 0].shape, use_dht)
    for c in reversed(range(P.shape[2])):
        dh_out[:, :, c] = dh.to(dh_out.dtype)
        dh = dh + P[:, :, c] @ dh.to(dh_out.dtype).to(F64) + Xs[:, :, c]
    if store_dh0:
        dh0.copy_(dh)


def _dqkw(q, k, w, u, do, dv2, S, srow, dh, dq, dk_part, dw, dv2_from_dh=False):
    L = q.shape[2]
    qc, kc, wc, uc, doc, dvc = (_chunks(x, L) for x in (q, k, w, u, do, dv2))
    St = S[srow.long()].to(F64)                     # [B, H, NC, K, V]: each chunk's row
    dhc = dh.to(F64)
    if dv2_from_dh:
        _store(dv2, dvc + kc @ dhc, L)
        dvc = _chunks(dv2, L)
    vn = uc - wc @ St
    ds = torch.tril(doc @ vn.transpose(-1, -2))
    _store(dq, doc @ St.transpose(-1, -2) + ds @ kc, L)
    _store(dk_part, ds.transpose(-1, -2) @ qc + vn @ dhc.transpose(-1, -2), L)
    _store(dw, -dvc @ St.transpose(-1, -2), L)


def _wy(k, v, beta, A, dw, du, dk_part, dk, dv, dbeta):
    L = k.shape[2]
    kc, vc, bc, Ac, dwc, duc, dkp = (_chunks(x, L) for x in (k, v, beta, A, dw, du, dk_part))
    At = Ac.transpose(-1, -2)
    dbk, dbv = At @ dwc, At @ duc
    dA = duc @ (bc * vc).transpose(-1, -2) + dwc @ (bc * kc).transpose(-1, -2)
    dM = torch.tril(-At @ dA @ At, -1)
    G = bc * dM
    _store(dv, bc * dbv, L)
    _store(dk, dkp + bc * dbk + G @ kc + G.transpose(-1, -2) @ kc, L)
    db = ((dbv * vc).sum(-1) + (dbk * kc).sum(-1) + (dM * (kc @ kc.transpose(-1, -2))).sum(-1))
    _store(dbeta, db.unsqueeze(-1), L)


EMULATE = {"chunk_bwd_dv_local": _dv_local,
           "chunk_bwd_transition": _transition, "chunk_bwd_dh_scan": _dh_scan, "chunk_bwd_dh": _dh, "chunk_bwd_dqkw": _dqkw,
           "chunk_bwd_wy": _wy}


# the scalar gate's stages (g_cum [B, H, L] f32, L a multiple of 64): the same math with
# E_ij = exp(g_cum_i - g_cum_j) on the pairs and the e^g scalings of the templates, each
# value rounded to the input dtype (_lp) exactly where the template casts it or keeps it
# in a 16-bit shared buffer (a GEMM operand), so that the emulated errors are the kernels'
# (bf16 keeps 8 bits of mantissa: a cancellation that f16 hides shows there)

def _lp(x, dt):
    """x rounded to the kernel's input dtype dt, back in fp64."""
    return x.to(dt).to(F64)


def _decays(g_cum, L):
    gc = _chunks(g_cum, L)                          # [B, H, NC, C, 1]
    E = torch.tril(torch.exp(gc - gc.transpose(-1, -2)))
    return gc, gc[..., -1:, :], E                   # g_cum, g_last [.., 1, 1], E


def _dv_local_g(q, k, do, g_cum, dv_local):
    L, dt = q.shape[2], q.dtype
    qc, kc, doc = (_chunks(x, L) for x in (q, k, do))
    _, _, E = _decays(g_cum, L)
    P = _lp((qc @ kc.transpose(-1, -2)) * E, dt)   # p_s
    _store(dv_local, P.transpose(-1, -2) @ doc, L)


def _dh_g(q, k, w, do, g_cum, dv_local, dh_out, dv2, dht, dh0, use_dht=False,
          store_dh0=False):
    L, dt = q.shape[2], q.dtype
    qc, kc, wc, doc, dvc = (_chunks(x, L) for x in (q, k, w, do, dv_local))
    gc, gl, _ = _decays(g_cum, L)
    B, H, NC = qc.shape[:3]
    dh = _dh_start(dht, (B, H, k.shape[-1], do.shape[-1]), use_dht)
    out = torch.zeros_like(dvc)
    for c in reversed(range(NC)):
        dh_out[:, :, c] = dh.to(dh_out.dtype)       # f32
        dh_s = _lp(dh, dt)                          # the k dh operand
        d = _lp(dvc[:, :, c] + (kc[:, :, c] @ dh_s) * torch.exp(gl[:, :, c] - gc[:, :, c]), dt)
        out[:, :, c] = d
        do_s = _lp(doc[:, :, c] * torch.exp(gc[:, :, c]), dt)
        dh = (torch.exp(gl[:, :, c]) * dh + qc[:, :, c].transpose(-1, -2) @ do_s
              - wc[:, :, c].transpose(-1, -2) @ d)
    _store(dv2, out, L)
    if store_dh0:
        dh0.copy_(dh)


def _dqkw_g(q, k, w, u, do, g_cum, dv2, S, srow, dh, dq, dk_part, dw, dg_part):
    L, dt = q.shape[2], q.dtype
    qc, kc, wc, uc, doc, dvc = (_chunks(x, L) for x in (q, k, w, u, do, dv2))
    gc, gl, E = _decays(g_cum, L)
    S = S[srow.long()]                              # [B, H, NC, K, V]: each chunk's row
    St, dhs = _lp(S.to(F64), dt), _lp(dh.to(F64), dt)   # S_s, dh_s
    vn = _lp(uc - wc @ St, dt)
    ds = _lp(torch.tril(doc @ vn.transpose(-1, -2)) * E, dt)
    dk_state = (vn @ dhs.transpose(-1, -2)) * torch.exp(gl - gc)
    dqc = (doc @ St.transpose(-1, -2)) * torch.exp(gc) + ds @ kc
    dkc = dk_state + ds.transpose(-1, -2) @ qc
    _store(dq, dqc, L)
    _store(dk_part, dkc, L)
    _store(dw, -dvc @ St.transpose(-1, -2), L)
    dg = (qc * dqc).sum(-1, keepdim=True) - (kc * dkc).sum(-1, keepdim=True)
    dg[..., -1, :] += (kc * dk_state).sum((-1, -2)).unsqueeze(-1)
    # g_last also scales the state the chunk enters with: e^g_last <S, dh> (f32 from global)
    sdh = (S.to(F64) * dh.to(F64)).sum((-1, -2))
    dg[..., -1, :] += (torch.exp(gl[..., 0, 0]) * sdh).unsqueeze(-1)
    _store(dg_part, dg, L)


def _wy_g(k, v, beta, g_cum, A, dw, du, dk_part, dg_part, dk, dv, dbeta, dg):
    L, dt = k.shape[2], k.dtype
    kc, vc, bc, Ac, dwc, duc, dkp, dgp = (_chunks(x, L) for x in
                                          (k, v, beta, A, dw, du, dk_part, dg_part))
    gc, _, E = _decays(g_cum, L)
    At = Ac.transpose(-1, -2)
    bk, bv = _lp(bc * kc * torch.exp(gc), dt), _lp(bc * vc, dt)
    dbk, dbv = At @ dwc, At @ duc
    dA = _lp(duc @ bv.transpose(-1, -2) + dwc @ bk.transpose(-1, -2), dt)
    dM = torch.tril(-_lp(At @ dA, dt) @ At, -1)
    Q = dM * (kc @ kc.transpose(-1, -2)) * E
    P = bc * Q
    G = _lp(bc * dM * E, dt)
    rk = (dbk * kc).sum(-1, keepdim=True) * torch.exp(gc)
    _store(dv, bc * dbv, L)
    _store(dk, dkp + bc * torch.exp(gc) * dbk + G @ kc + G.transpose(-1, -2) @ kc, L)
    _store(dbeta, (dbv * vc).sum(-1, keepdim=True) + rk + Q.sum(-1, keepdim=True), L)
    dgc = dgp + bc * rk + P.sum(-1, keepdim=True) - P.sum(-2).unsqueeze(-1)
    _store(dg, dgc, L)


EMULATE_GATED = {"chunk_bwd_dv_local": _dv_local_g,
                 "chunk_bwd_dh": _dh_g, "chunk_bwd_dqkw": _dqkw_g, "chunk_bwd_wy": _wy_g}


def _bwd_flags(params):
    return {f: True for f in ("dv2_from_dh", "use_dht", "store_dh0") if params.get(f)}


def install_fakes(monkeypatch):
    """Route every compile (ops.runtime) to fakes checked against the traced kernels: the
    backward's stages run EMULATE (positional, the kernels' argument order), the forward's
    (chunk_kkt_inverse, chunk_wu, chunk_state, chunk_output) PipelineMath's formulas by
    argument name. Returns the list of stage names compiled, in order."""
    names = []

    def body(spec, stage, params):
        names.append(stage)
        if stage in layout_fakes.STAGES:
            return layout_fakes.body(stage, params)
        table = EMULATE_GATED if chunk_bwd.is_gated(spec) else EMULATE
        if stage in table:
            flags = _bwd_flags(params)
            return lambda *args: table[stage](*args, **flags)
        math = PipelineMath(spec, params["H"], params["HV"], params["K"], params.get("V"))
        return math.body(spec, stage, params)
    fake_compiles(monkeypatch, body)
    monkeypatch.setattr(chunk_bwd, "_check_device", lambda n, x: None)
    return names


@pytest.fixture
def fake_backward(monkeypatch):
    return install_fakes(monkeypatch)


def _contract_inputs(rng, B, H, L, K, V, dtype):
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q = torch.nn.functional.normalize(torch.randn(B, H, L, K, generator=g, dtype=F64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, H, L, K, generator=g, dtype=F64), dim=-1)
    v = torch.randn(B, H, L, V, generator=g, dtype=F64)
    beta = torch.sigmoid(torch.randn(B, H, L, generator=g, dtype=F64))
    do = torch.randn(B, H, L, V, generator=g, dtype=F64)
    q, k, v, beta, do = (x.to(dtype) for x in (q, k, v, beta, do))
    return q, k, v, beta, do


def _rel(x, ref):
    return float(torch.linalg.norm(x.to(F64) - ref) / torch.linalg.norm(ref))


@pytest.mark.parametrize("scheme", sorted(chunk_bwd.SCHEMES))
@pytest.mark.parametrize("B,H,L,K,V", [(2, 2, 130, 64, 64), (1, 3, 63, 64, 128),
                                       (1, 1, 65, 128, 64), (2, 1, 1, 64, 64)])
def test_backward_plumbing_and_stage_math(fake_backward, monkeypatch, rng, scheme, B, H, L, K,
                                          V):
    monkeypatch.setattr(chunk_bwd, "SCHEME", scheme)
    dtype = torch.float16
    q, k, v, beta, do = _contract_inputs(rng, B, H, L, K, V, dtype)
    o, S, Aw, Au, w, u = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
    S = S.float()
    Aw, Au, w, u = (x.to(dtype) for x in (Aw, Au, w, u))
    grads = contracts.deltanet_chunk_bwd(do, q, k, v, beta, S, Aw, Au, w, u)
    assert fake_backward == list(chunk_bwd.SCHEMES[scheme])
    refs = tref.deltanet_chunk_bwd(do, q, k, v, beta)
    for name, g, ref, like in zip(("dq", "dk", "dv", "dbeta"), grads, refs, (q, k, v, beta)):
        assert g.shape == like.shape and g.dtype == dtype, name
        assert not torch.isnan(g).any(), name
        assert _rel(g, ref) < 5e-3, (name, _rel(g, ref))


def test_backward_refuses_bad_inputs(fake_backward):
    x = torch.zeros(1, 2, 70, 64, dtype=torch.bfloat16)
    b = torch.zeros(1, 2, 70, dtype=torch.bfloat16)
    A = torch.zeros(1, 2, 70, 64, dtype=torch.bfloat16)
    S = torch.zeros(1, 2, 3, 64, 64)
    contracts.deltanet_chunk_bwd(x, x, x, x, b, S, A, A, x, x)
    with pytest.raises(SpecError, match="NC\\+1 = 3"):
        contracts.deltanet_chunk_bwd(x, x, x, x, b, S[:, :, :2], A, A, x, x)
    with pytest.raises(SpecError, match="dtype"):
        contracts.deltanet_chunk_bwd(x, x, x, x, b, S.double(), A, A, x, x)
    with pytest.raises(SpecError, match="DK, DV in"):
        y = torch.zeros(1, 2, 70, 32, dtype=torch.bfloat16)
        contracts.deltanet_chunk_bwd(y, y, y, y, b, S, A, A, y, y)
    with pytest.raises(SpecError, match="float16 or bfloat16"):
        contracts.deltanet_chunk_bwd(x, x.float(), x, x, b, S, A, A, x, x)


def test_contract_plan_and_params():
    """The contract's forward is the arch's three-stage plan over B * H one-head sequences
    of L tokens: kkt (A itself, a_beta=False) and chunk_wu (applying beta), chunk_state
    with every chunk's state in f32 (states_out) and the final one, chunk_output (the
    backward's recompute takes its prepare; its states are the training forward's)."""
    plan = chunk_bwd.contract_plan(K=64, V=128, dtype="float16", B=2, H=3, L=130)
    assert plan.name == "three-stage"
    assert plan.stages() == ["chunk_kkt_inverse", "chunk_wu", "chunk_state", "chunk_output"]
    dims = dict(H=3, K=64, V=128, dtype="float16", B=2, L=130)
    wy = chunk_bwd.wy_params(**dims)
    assert set(wy) == {"chunk_kkt_inverse", "chunk_wu"}
    assert wy["chunk_kkt_inverse"]["a_beta"] is False and wy["chunk_wu"]["a_beta"] is False
    assert wy["chunk_wu"]["beta_dtype"] == "float16"
    assert wy["chunk_kkt_inverse"]["H"] == wy["chunk_kkt_inverse"]["HV"] == 1
    # one head: the chunks on the grid's first index (no 65535 limit of gridDim.y)
    assert not wy["chunk_kkt_inverse"]["heads_fastest"] and not wy["chunk_wu"]["heads_fastest"]
    fwd = chunk_bwd.forward_params(**dims)
    assert list(fwd) == ["chunk_kkt_inverse", "chunk_wu", "chunk_state", "chunk_output"]
    assert fwd["chunk_state"]["states_out"] and fwd["chunk_state"]["output_final_state"]
    assert not fwd["chunk_state"]["has_initial_state"]
    spec = chunk_bwd.default_spec()
    assert spec.name == "deltanet"
    for stage, params in fwd.items():
        chunk.stage_module(spec, stage).build(**params)        # the templates take them
    # the backward's stages at the same sizes
    params = chunk_bwd.stage_params(H=3, K=64, V=128, dtype="float16", B=2, use_dht=True)
    assert set(chunk_bwd.SCHEMES[chunk_bwd.SCHEME]) == set(params)
    assert params["chunk_bwd_dh"]["num_stages"] == chunk_bwd.DH_NUM_STAGES
    assert params["chunk_bwd_dh"]["use_dht"] and "store_dh0" not in params["chunk_bwd_dh"]


def test_compute_wy_matches_reference(fake_backward, rng):
    """compute_wy: A (without beta), w = A diag(beta) k, u = A diag(beta) v of head-first
    inputs, through the plan's two prepare kernels and the chunk tables."""
    B, H, L, K, V = 2, 2, 100, 64, 64
    q, k, v, beta, _ = _contract_inputs(rng, B, H, L, K, V, torch.float16)
    A = torch.empty(B, H, L, C, dtype=torch.float16)
    w, u = torch.empty_like(k), torch.empty_like(v)
    tables = chunk._tables(tuple(range(0, B * H * L + 1, L)), C, "cpu", 0)
    chunk_bwd.compute_wy(k, v, beta, A, w, u, tables)
    assert fake_backward == ["chunk_kkt_inverse", "chunk_wu"]
    ref = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
    for name, x, r in (("A", A, ref[2]), ("w", w, ref[4]), ("u", u, ref[5])):
        assert _rel(x, r) < 2e-3, (name, _rel(x, r))


def test_forward_plumbing(fake_backward, rng):
    """The contract's forward: chunk_kkt_inverse writes A itself and chunk_wu applies
    beta; launches match the traced kernels, and o, A, w, u and S (emulated stage math; the
    state pass writes S itself) match the fp64 reference; no backward stage runs."""
    B, H, L, K, V = 2, 2, 130, 64, 128
    q, k, v, beta, _ = _contract_inputs(rng, B, H, L, K, V, torch.bfloat16)
    o, S, Aw, Au, w, u = contracts.deltanet_chunk_fwd(q, k, v, beta)
    assert fake_backward == ["chunk_kkt_inverse", "chunk_wu", "chunk_state", "chunk_output"]
    ref = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
    for name, x, r in (("o", o, ref[0]), ("A", Aw, ref[2]), ("w", w, ref[4]),
                       ("u", u, ref[5]), ("S", S, ref[1])):
        assert _rel(x, r) < 1e-2, (name, _rel(x, r))
    NC = math.ceil(L / C)
    assert o.shape == (B, H, L, V) and u.shape == (B, H, L, V) and w.shape == (B, H, L, K)
    assert Aw.shape == (B, H, L, C) and Aw.dtype == torch.bfloat16 and Aw is Au
    assert S.shape == (B, H, NC + 1, K, V) and S.dtype == torch.float32


def test_recompute_wy(fake_backward, rng):
    """A, w, u as the autograd backward takes them (the plan's prepare; the states are
    the training forward's)."""
    B, H, L, K, V = 1, 2, 70, 64, 64
    q, k, v, beta, _ = _contract_inputs(rng, B, H, L, K, V, torch.float16)
    A, w, u = chunk_bwd.recompute_wy(k, v, beta)
    assert fake_backward == ["chunk_kkt_inverse", "chunk_wu"]
    ref = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
    assert _rel(A, ref[2]) < 2e-3 and _rel(w, ref[4]) < 2e-3 and _rel(u, ref[5]) < 2e-3


def test_recompute_wy_gated(fake_backward, rng):
    """The scalar gate's A, w, u by the same two kernels (gdn's): chunk_kkt_inverse takes
    the per-token g's in-chunk cumulative sum, chunk_wu w = A diag(beta e^g_cum) k, u =
    A diag(beta) v; checked against the fp64 formulas chunk by chunk."""
    B, H, L, K, V = 2, 2, 128, 64, 64
    _, k, v, beta, _ = _contract_inputs(rng, B, H, L, K, V, torch.bfloat16)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    g = -torch.rand(B, H, L, generator=gen, dtype=torch.float32) * 0.2
    A, w, u = chunk_bwd.recompute_wy(k, v, beta, g=g, spec=get_spec("gdn"))
    assert fake_backward == ["chunk_kkt_inverse", "chunk_wu"]
    kc, vc, bc = (x.to(F64).view(B, H, L // C, C, -1) for x in (k, v, beta.unsqueeze(-1)))
    gc = g.to(F64).view(B, H, L // C, C, 1).cumsum(3)
    M = torch.tril(bc * (kc @ kc.transpose(-1, -2)) * (gc - gc.transpose(-1, -2)).exp(), -1)
    eye = torch.eye(C, dtype=F64)
    Ar = torch.linalg.inv(eye + M)
    wr, ur = Ar @ (bc * gc.exp() * kc), Ar @ (bc * vc)
    for x, r in ((A, Ar), (w, wr), (u, ur)):
        assert _rel(x.view(r.shape), r) < 1e-2, _rel(x.view(r.shape), r)


@pytest.mark.compile
@pytest.mark.parametrize("K,V,dtype,dh_stages", [(128, 128, "bfloat16", None),
                                                 (64, 64, "float16", 2)])
def test_gated_stages_compile(K, V, dtype, dh_stages):
    """Gated DeltaNet's backward stages at the params one call runs (B=2, H=4, with dht
    and dh0) compile for sm_90a; dh_stages: the dh pass's pipelined form as well."""
    from linattn.codegen.compile import compile_stage, format_record
    spec = get_spec("gdn")
    params = chunk_bwd.stage_params(H=4, K=K, V=V, dtype=dtype, B=2, use_dht=True,
                                    store_dh0=True, gated=True)
    if dh_stages is not None:
        params = {"chunk_bwd_dh": dict(params["chunk_bwd_dh"], num_stages=dh_stages)}
    assert params["chunk_bwd_dh"]["num_stages"] == (dh_stages or chunk_bwd.GATED_DH_NUM_STAGES)
    for stage, p in params.items():
        rec = compile_stage(chunk.stage_module(spec, stage), p, "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["registers"] and rec["registers"] <= 255, rec
