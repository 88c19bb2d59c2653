"""CPU tests of Comba's generated backward (the delta rule's stages with the erase key p
from rules/comba.py.jinja: chunk_bwd_wy sends the Gram P K^T's row products and w's
beta p e^(G - g) to dp, its column products to dk, and takes the exclusive gate's terms
back out of dg). The stages run as tests/test_chunk_bwd.py's fakes (signature checks
against the traced kernels, the stage math in fp64 rounded where the templates round),
the rebuild's two forward stages as fp64 formulas here (p normalised and the exclusive
decay in w), the forward as the fp64 reference; the gradients of every input (q, k, v,
p, g, beta, h0, with dht) are compared with torch autograd of the fp64 chunked
reference. Varlen, GVA, l2norm and padded head dims included."""
import pytest
import torch

from _forward_states import forward_states, kept_inverse
from _kernel_check import fake_compiles
from test_chunk import by_name
from test_chunk_bwd import EMULATE
from test_chunk_fused import PipelineMath

import linattn
from linattn.codegen.plan import plan
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tref
from linattn.dsl.family import CombaRule
from linattn.ops import autograd, build, chunk_bwd, comba, runtime

F64 = torch.float64
C = chunk_bwd.CHUNK
SPEC = comba.SPEC
#: compiled in this order (chunk_bwd_key_grads once: launched for q, k, then for p)
STAGES = [chunk_bwd.ROWS, "chunk_wu", *chunk_bwd.STAGES, "chunk_bwd_key_grads"]


def _kkt_rows(prm, q, k, g, A_log, dt_bias, chunk_bos, chunk_len, g_cum, qn, kn, p_in, pn):
    """chunk_bwd_kkt_rebuild of the comba rule: PipelineMath's rows (g_cum; qn, kn) and
    p's l2-normalised copy pn with l2norm_qk."""
    H, K = q.shape[1:]
    math = PipelineMath(SPEC, H, prm["HV"], K, None)
    math.kkt_rows(prm, q, k, g, A_log, dt_bias, chunk_bos, chunk_len, g_cum, qn, kn)
    if prm["l2norm_qk"]:
        pn.copy_(tref.l2norm(p_in.to(F64)).to(pn.dtype))


def _wu(prm, k, v, A, beta, chunk_bos, chunk_len, w, u, g_cum):
    """chunk_wu with the erase key (bound to k): w = A diag(beta e^(g_cum - g)) p (the
    exclusive gate: row j's g_cum[j - 1]), u = A diag(beta) v."""
    HV, group = v.shape[1], v.shape[1] // k.shape[1]
    for c, (t0, n) in enumerate(zip(chunk_bos.tolist(), chunk_len.tolist())):
        for hv in range(HV):
            Ab = A[t0:t0 + n, hv, :n].to(F64) * beta[t0:t0 + n, hv].to(F64)[None, :]
            gc = g_cum[hv, c * C:c * C + n].to(F64)
            gx = torch.cat([gc.new_zeros(1), gc[:-1]])
            w[t0:t0 + n, hv] = ((Ab * gx.exp()[None, :]) @ k[t0:t0 + n, hv // group].to(F64)
                                ).to(w.dtype)
            u[t0:t0 + n, hv] = (Ab @ v[t0:t0 + n, hv].to(F64)).to(u.dtype)


COMBA = {chunk_bwd.ROWS: _kkt_rows, "chunk_wu": _wu}


def _reference_forward(call, q, k, v, beta, initial_state, g=None, A_log=None, dt_bias=None,
                       rule_inputs=None):
    cu = None if call.cu is None else torch.tensor(call.cu)
    ref = tref.chunked_forward(call.spec, q, k, v, g, beta=beta, options=call.options,
                               scale=call.scale, initial_state=initial_state,
                               cu_seqlens=cu, intermediates=True, **rule_inputs)
    return (ref["o"].to(q.dtype),
            ref["final_state"].float() if call.output_final_state else None,
            {"h": forward_states(ref["h"], call.cu, q.shape[1], q.dtype),
             "A_inv": kept_inverse(ref["A"], *q.shape[:2], q.dtype)})


@pytest.fixture
def fake_kernels(monkeypatch):
    return install_comba_fakes(monkeypatch)


def install_comba_fakes(monkeypatch):
    """Every compile routed to fakes: the backward's stages test_chunk_bwd's EMULATE,
    the rebuild's COMBA; the forward the fp64 reference. Returns the stages compiled."""
    names = []
    emulate, rebuild = by_name(EMULATE), by_name(COMBA)

    def body(spec, stage, params):
        names.append(stage)
        return (rebuild if stage in COMBA else emulate)(spec, stage, params)
    fake_compiles(monkeypatch, body)
    monkeypatch.setattr(autograd, "run_forward", _reference_forward)
    return names


def _inputs(rng, B, T, H, HV, K, V, dtype, N, h0):
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    q, k, p = (torch.nn.functional.normalize(r(B, T, H, K), dim=-1) for _ in "qkp")
    x = dict(q=q.to(dtype), k=k.to(dtype), v=r(B, T, HV, V).to(dtype), p=p.to(dtype),
             g=(torch.nn.functional.logsigmoid(r(B, T, HV)) / 8).float(),
             beta=torch.sigmoid(r(B, T, HV)).to(dtype),
             initial_state=r(N, HV, K, V).float() if h0 else None)
    return x, r(B, T, HV, V).to(dtype), r(N, HV, K, V).float()


def _rel(x, ref):
    return float(torch.linalg.norm(x.to(F64) - ref) / max(torch.linalg.norm(ref), 1e-30))


F16, BF16 = torch.float16, torch.bfloat16
CASES = [   # B, T, H, HV, K, V, cu_seqlens, initial state, dht, l2norm, dtype
    pytest.param(2, 130, 2, 2, 64, 64, None, False, False, False, F16, id="B2-T130-plain"),
    pytest.param(1, 65, 1, 2, 64, 128, None, True, True, True, F16, id="T65-GVA2-h0-dht-l2"),
    pytest.param(1, 135, 1, 2, 64, 64, (0, 1, 70, 71, 135), True, True, True, F16,
                 id="varlen-h0-dht-l2norm"),
    pytest.param(1, 200, 2, 4, 64, 64, None, True, True, True, BF16,
                 id="T200-GVA2-h0-dht-l2norm-bf16"),
    pytest.param(1, 150, 1, 2, 64, 64, (0, 64, 64, 150), True, True, False, F16,
                 id="varlen-empty-GVA2-h0-dht"),
    pytest.param(1, 90, 1, 2, 40, 32, (0, 20, 90), True, True, True, F16,
                 id="K40-V32-padded-varlen-GVA2-h0-dht-l2norm"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,cu,h0,use_dht,l2norm,dtype", CASES)
def test_gradients_match_fp64_autograd(fake_kernels, rng, B, T, H, HV, K, V, cu, h0,
                                       use_dht, l2norm, dtype):
    """chunk_comba under autograd trains through the generated stages (no exact torch
    path): q, k, v, p, g, beta, h0 vs torch autograd of the fp64 chunked reference."""
    N = B if cu is None else len(cu) - 1
    x, do, dht = _inputs(rng, B, T, H, HV, K, V, dtype, N, h0)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, ht = linattn.chunk_comba(**leaves, output_final_state=use_dht,
                                use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu_t)
    loss = (o.float() * do.float()).sum() + ((ht * dht).sum() if use_dht else 0)
    loss.backward()
    assert fake_kernels == STAGES
    refs = {n: t.detach().to(F64).requires_grad_() for n, t in leaves.items()}
    p = refs.pop("p")
    o_r, ht_r = tref.chunked_forward(SPEC, **refs, p=p, options=Options(l2norm_qk=l2norm),
                                     cu_seqlens=None if cu is None else torch.tensor(cu))
    refs["p"] = p
    loss_r = (o_r * do.to(F64)).sum() + ((ht_r * dht.to(F64)).sum() if use_dht else 0)
    loss_r.backward()
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, n
        assert not torch.isnan(t.grad).any(), n
        tol = 5e-3 if dtype == F16 else 1e-2
        assert _rel(t.grad, refs[n].grad) < tol, (n, _rel(t.grad, refs[n].grad))


def test_beta_none_and_only_some_inputs_need_grad(fake_kernels, rng):
    """A missing beta is ones (fla's); an input without requires_grad gets none, the
    others theirs (p alone here)."""
    x, do, _ = _inputs(rng, 1, 70, 1, 2, 64, 64, F16, 1, False)
    p = x["p"].clone().requires_grad_()
    o, _ = linattn.chunk_comba(x["q"], x["k"], x["v"], p, x["g"])
    (o.float() * do.float()).sum().backward()
    ref_p = x["p"].to(F64).requires_grad_()
    o_r, _ = tref.chunked_forward(SPEC, x["q"].to(F64), x["k"].to(F64), x["v"].to(F64),
                                  x["g"].to(F64), torch.ones(1, 70, 2, dtype=F64), p=ref_p)
    (o_r * do.to(F64)).sum().backward()
    assert _rel(p.grad, ref_p.grad) < 5e-3


def test_fused_recurrent_trains_as_chunk(fake_kernels, rng):
    """fused_recurrent_comba (fla's order q, k, p, v) under autograd trains as its chunk_*
    twin, through the kernels: the same o and gradients."""
    x, do, _ = _inputs(rng, 1, 90, 1, 2, 64, 64, F16, 1, True)
    runs = []
    for fn, order in ((linattn.chunk_comba, "qkvp"), (linattn.fused_recurrent_comba, "qkpv")):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
        o, _ = fn(*(leaves[n] for n in order), leaves["g"], leaves["beta"],
                  initial_state=leaves["initial_state"])
        (o.float() * do.float()).sum().backward()
        runs.append((o, {n: t.grad for n, t in leaves.items()}))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])
    assert chunk_bwd.ROWS in fake_kernels


def test_state_v_first(fake_kernels, rng):
    """chunk_comba with state_v_first trains (GVA, padded K): the same o, final state and
    gradients as key-first."""
    from test_autograd import v_first_matches_k_first
    x, do, dht = _inputs(rng, 1, 90, 1, 2, 48, 64, F16, 1, True)
    v_first_matches_k_first(linattn.chunk_comba, x, do, dht)


def test_float32_trains_exactly(monkeypatch, rng):
    """A float32 call takes the exact torch path (ops/exact_train.py), not the kernels."""
    from linattn.ops import exact_train
    seen = []
    monkeypatch.setattr(exact_train, "train", lambda *a, **kw: seen.append(1) or (None, None))
    x, _, _ = _inputs(rng, 1, 70, 1, 2, 64, 64, torch.float32, 1, False)
    linattn.chunk_comba(**{n: t.requires_grad_() for n, t in x.items() if t is not None})
    assert seen == [1]


def test_plan_and_build(monkeypatch):
    """Comba's scalar gate has the delta rule's backward stages (its rebuild, the four
    stages, the key gradients) and trains through them (the rule's backward_gates); its
    no-gate form trains exactly in torch (no generated backward: the folded form takes no
    erase key)."""
    from linattn.dsl.spec import comba_specs
    assert [s.name for s in plan(SPEC, "bwd")] == [chunk_bwd.ROWS, *chunk_bwd.STAGES,
                                                   "chunk_bwd_key_grads"]
    assert build.has_backward(SPEC)
    monkeypatch.setattr(CombaRule, "backward_gates", ())
    assert not build.has_backward(SPEC)
    none = next(s for s in comba_specs() if s.gate.value == "none")
    assert not build.has_backward(none) and plan(none, "bwd") == []


def test_wy_stage_takes_the_erase_key():
    """chunk_bwd_wy of the comba rule reads p and writes dp (per value head) besides the
    delta rule's arguments."""
    mod = runtime.stage_module(SPEC, "chunk_bwd_wy", "sm90")
    names = mod.args(**mod.EXAMPLES[0])
    assert names[:2] == ["k", "p"] and "dp" in names
    assert list(runtime.arg_names(mod.build(**mod.EXAMPLES[0]))) == names


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_wy_erase_tile_holds_p(arch):
    """In chunk_bwd_wy's source the tile p loads into is written by that load alone and is
    the operand of dk's column GEMM ((beta dM E)^T p): the emulator (by argument name)
    cannot see a buffer of the kernel's; the old module's p_s was the scalar gate's P =
    beta Q too (two allocations of one name), so dk read P for p on the GPU."""
    import ast
    with open(runtime.stage_module(SPEC, "chunk_bwd_wy", arch).__file__) as f:
        tree = ast.parse(f.read())
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and isinstance(n.targets[0], ast.Subscript)
             and "p[t0 + i, hk, j]" in ast.unparse(n.value)]
    assert len(loads) == 1
    tile = loads[0].targets[0].value.id
    allocs = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and isinstance(n.targets[0], ast.Name) and n.targets[0].id == tile]
    writes = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and isinstance(n.targets[0], ast.Subscript)
              and isinstance(n.targets[0].value, ast.Name) and n.targets[0].value.id == tile]
    assert len(allocs) == 1 and "(BT, K)" in ast.unparse(allocs[0].value)
    assert writes == loads
    gemms = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == "T.gemm" and "dk_f" in ast.unparse(n)]
    assert gemms == [f"T.gemm(m_s, {tile}, dk_f, transpose_A=True)"]


def test_bad_p_fails_in_one_line(rng):
    x, _, _ = _inputs(rng, 1, 70, 1, 2, 64, 64, F16, 1, False)
    leaves = {n: t.requires_grad_() for n, t in x.items() if t is not None}
    with pytest.raises(SpecError, match="comba backward needs p|p has shape"):
        linattn.chunk_comba(**dict(leaves, p=leaves["p"][..., :32]))
