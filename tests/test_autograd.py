"""CPU tests of training through linattn.chunk_delta_rule (ops/autograd.py).

The kernels are replaced by fakes that check each launch against the traced prim_func and
carry out the stage's math in fp64 (tests/test_chunk_bwd.py's install_fakes: the
backward's emulators and the forward stages of the recompute); the forward itself is the
fp64 reference rounded to the input dtype, its per-chunk states too (the h [NT, HV, K, V]
the backward reads chunk by chunk, tests/_forward_states.py forward_states). Gradients (dq,
dk, dv, dbeta, dh0, with dht; the gate's) are compared with torch autograd of the fp64
chunked reference: this checks packed_backward on the call's own token-first tensors
(varlen as it comes, GVA), the scale, the l2norm backward, the state-gradient flags and
the stage decomposition together.
"""
import math

import pytest
import torch

from _forward_states import forward_states, kept_inverse
from test_chunk_bwd import install_fakes

import linattn
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tref
from linattn.ops import autograd, chunk_bwd, deltanet, gdn

F64 = torch.float64


def _reference_forward(call, q, k, v, beta, initial_state, g=None, A_log=None, dt_bias=None):
    cu = None if call.cu is None else torch.tensor(call.cu)
    ref = tref.chunked_forward(call.spec, q, k, v, g, beta=beta, options=call.options,
                               scale=call.scale, initial_state=initial_state,
                               cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias, intermediates=True)
    return (ref["o"].to(q.dtype),
            ref["final_state"].float() if call.output_final_state else None,
            {"h": forward_states(ref["h"], call.cu, q.shape[1], q.dtype),
             "A_inv": kept_inverse(ref["A"], *q.shape[:2], q.dtype)})


@pytest.fixture
def fake_kernels(monkeypatch):
    """Every compile routed to tests/test_chunk_bwd.py's fakes (signature checks, the
    stage math in fp64); the forward itself is the fp64 reference. Returns the stage
    names compiled."""
    calls = install_fakes(monkeypatch)
    monkeypatch.setattr(autograd, "run_forward", _reference_forward)
    return calls


def _inputs(rng, B, T, H, K, V, dtype, N, h0):
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    q, k = r(B, T, H, K), r(B, T, H, K)
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    v = r(B, T, H, V)
    beta = torch.sigmoid(r(B, T, H))
    state = r(N, H, K, V) if h0 else None
    xs = [x.to(dtype) for x in (q, k, v, beta)] + [None if state is None else state.float()]
    do, dht = r(B, T, H, V).to(dtype), r(N, H, K, V).float()
    return xs, do, dht


def _rel(x, ref):
    return float(torch.linalg.norm(x.to(F64) - ref) / max(torch.linalg.norm(ref), 1e-30))


CASES = [   # B, T, H, K, V, cu_seqlens, initial state, dht, l2norm, scale
    pytest.param(2, 130, 2, 64, 64, None, False, False, False, None, id="B2-T130-plain"),
    pytest.param(1, 65, 3, 64, 128, None, True, True, False, 0.3, id="B1-T65-h0-dht"),
    pytest.param(2, 63, 1, 128, 64, None, True, False, True, None, id="B2-T63-h0-l2norm"),
    pytest.param(2, 1, 2, 64, 64, None, False, True, False, None, id="B2-T1-dht"),
    pytest.param(1, 135, 2, 64, 64, (0, 1, 70, 71, 135), True, True, True, None,
                 id="varlen-1tok-h0-dht-l2norm"),
    pytest.param(1, 200, 2, 64, 64, (0, 128, 128, 200), True, True, False, 0.5,
                 id="varlen-empty-h0-dht"),
    pytest.param(2, 70, 2, 48, 100, None, True, True, True, None,
                 id="K48-V100-padded-h0-dht-l2norm"),
]


#: what a DeltaNet / Gated DeltaNet backward launches: the rebuild of w, u (and of qn, kn,
#: g_cum where the call has l2norm or a gate) from the A its forward kept, the stages
#: (DeltaNet: the folded form's; GDN: the four gated ones), the key heads' dq, dk
#: (chunk_bwd_key_grads)
PACKED_STAGES = ["chunk_wu", *chunk_bwd.FOLD_STAGES, "chunk_bwd_key_grads"]
ROWS_STAGES = [chunk_bwd.ROWS, *PACKED_STAGES]
GATED_STAGES = [chunk_bwd.ROWS, "chunk_wu", *chunk_bwd.STAGES, "chunk_bwd_key_grads"]


@pytest.mark.parametrize("B,T,H,K,V,cu,h0,use_dht,l2norm,scale", CASES)
def test_gradients_match_fp64_autograd(fake_kernels, rng, B, T, H, K, V, cu, h0, use_dht,
                                       l2norm, scale):
    dtype = torch.float16
    N = B if cu is None else len(cu) - 1
    xs, do, dht = _inputs(rng, B, T, H, K, V, dtype, N, h0)
    leaves = [None if x is None else x.clone().requires_grad_() for x in xs]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, ht = linattn.chunk_delta_rule(*leaves[:4], scale=scale, initial_state=leaves[4],
                                     output_final_state=use_dht,
                                     use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu_t)
    loss = (o.float() * do.float()).sum() + ((ht * dht).sum() if use_dht else 0)
    loss.backward()
    assert fake_kernels == (ROWS_STAGES if l2norm else PACKED_STAGES)

    refs = [None if x is None else x.to(F64).requires_grad_() for x in xs]
    cu64 = None if cu is None else torch.tensor(cu)
    o_r, ht_r = tref.chunked_forward(deltanet.SPEC, *refs[:4][:3], beta=refs[3],
                                     options=Options(l2norm_qk=l2norm), scale=scale,
                                     initial_state=refs[4], cu_seqlens=cu64)
    loss_r = (o_r * do.to(F64)).sum() + ((ht_r * dht.to(F64)).sum() if use_dht else 0)
    loss_r.backward()
    for name, x, r in zip(("dq", "dk", "dv", "dbeta", "dh0"), leaves, refs):
        if x is None:
            continue
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == x.dtype, name
        assert not torch.isnan(x.grad).any(), name
        assert _rel(x.grad, r.grad) < 5e-3, (name, _rel(x.grad, r.grad))


def test_tokens_past_the_last_sequence(fake_kernels, rng):
    """packed_backward with cu_seqlens ending before the packed tokens: those tokens are
    in no sequence (not read; zero gradients), the sequences' gradients match the fp64
    reference on their own tokens."""
    cu, T, n, H, K, V = (0, 70, 100), 130, 100, 2, 64, 64
    xs, do, dht = _inputs(rng, 1, T, H, K, V, torch.float16, 2, True)
    q, k, v, beta, h0 = xs
    call = autograd.DeltaRuleCall(spec=deltanet.SPEC, scale=deltanet.SPEC.scale_for(K, None),
                                  output_final_state=True, cu=cu)
    head = [x[:, :n] for x in (q, k, v, beta)]
    kept = _reference_forward(call, *head, h0)[2]
    grads = autograd.deltanet_backward(call, q, k, v, beta, h0, do, dht, kept.pop("h"), kept)
    assert fake_kernels == PACKED_STAGES
    refs = [x.to(F64).requires_grad_() for x in head + [h0]]
    o_r, ht_r = tref.chunked_forward(deltanet.SPEC, *refs[:3], beta=refs[3],
                                     initial_state=refs[4], cu_seqlens=torch.tensor(cu))
    ((o_r * do[:, :n].to(F64)).sum() + (ht_r * dht.to(F64)).sum()).backward()
    for name, g, x, r in zip(("dq", "dk", "dv", "dbeta", "dh0"), grads, xs, refs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        if name != "dh0":
            assert (g[:, n:] == 0).all(), name
            g = g[:, :n]
        assert _rel(g, r.grad) < 5e-3, (name, _rel(g, r.grad))


@pytest.mark.parametrize("B,T,cu", [(2, 0, None), (1, 5, (0, 0, 0))], ids=["T0", "cu-empty"])
def test_no_tokens(fake_kernels, rng, B, T, cu):
    """No token in any sequence: no kernel runs, zero gradients, and the initial state's
    gradient is the final state's (the final state is the initial one)."""
    H, K, V = 2, 64, 64
    N = B if cu is None else len(cu) - 1
    xs, do, dht = _inputs(rng, B, T, H, K, V, torch.float16, N, True)
    call = autograd.DeltaRuleCall(spec=deltanet.SPEC, scale=0.125, output_final_state=True,
                                  cu=cu)
    h = xs[0].new_empty(0, H, K, V)
    grads = autograd.deltanet_backward(call, *xs, do, dht, h, {})
    assert fake_kernels == []
    for g, x in zip(grads[:4], xs[:4]):
        assert g.shape == x.shape and g.dtype == x.dtype and not g.any()
    assert torch.equal(grads[4], dht)


def test_only_o_used_and_inputs_without_grad(fake_kernels, rng):
    xs, do, _ = _inputs(rng, 1, 70, 2, 64, 64, torch.bfloat16, 1, True)
    q, k, v, beta, h0 = xs
    v = v.clone().requires_grad_()          # only v needs a gradient
    o, ht = linattn.chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    assert ht.grad_fn is not None           # ht unused below: its gradient is None (zero)
    (o.float() * do.float()).sum().backward()
    refs = [x.detach().to(F64) for x in (q, k, v, beta)]
    refs[2].requires_grad_()
    o_r, _ = tref.chunked_forward(deltanet.SPEC, *refs[:3], beta=refs[3],
                                  initial_state=h0.to(F64))
    (o_r * do.to(F64)).sum().backward()
    assert _rel(v.grad, refs[2].grad) < 2e-2


def test_views_are_copied_once(fake_kernels, monkeypatch, rng):
    """q, k, v views (a model's split of one projection, as Qwen3.5's) reach the Function
    contiguous, so its saved tensors need no copy in the backward; gradients unchanged."""
    xs, do, _ = _inputs(rng, 1, 70, 2, 64, 64, torch.float16, 1, False)
    q, k, v, beta, _ = xs
    joint = torch.cat([q, k, v], dim=-1).transpose(1, 2).contiguous().transpose(1, 2)
    joint.requires_grad_()
    qv, kv, vv = joint.split([64, 64, 64], dim=-1)
    assert not qv.is_contiguous()
    seen = []
    forward = autograd.run_forward
    monkeypatch.setattr(autograd, "run_forward", lambda call, q, k, v, *a: seen.append(
        all(x.is_contiguous() for x in (q, k, v))) or forward(call, q, k, v, *a))
    o, _ = linattn.chunk_delta_rule(qv, kv, vv, beta)
    (o.float() * do.float()).sum().backward()
    assert seen == [True]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o2, _ = linattn.chunk_delta_rule(*leaves, beta)
    (o2.float() * do.float()).sum().backward()
    assert torch.equal(joint.grad, torch.cat([x.grad for x in leaves], dim=-1))


def test_no_grad_takes_the_plain_forward(fake_kernels, monkeypatch, rng):
    seen = []
    monkeypatch.setattr(linattn.ops.api, "forward", lambda *a, **kw: seen.append(1) or (1, 2))
    xs, _, _ = _inputs(rng, 1, 70, 2, 64, 64, torch.bfloat16, 1, False)
    with torch.no_grad():
        linattn.chunk_delta_rule(*(x.requires_grad_() for x in xs[:4]))
    assert seen == [1] and fake_kernels == []


def _grad_inputs(K=64, V=64, dtype=torch.bfloat16, T=70):
    q = torch.zeros(1, T, 2, K, dtype=dtype, requires_grad=True)
    return q, torch.zeros(1, T, 2, K, dtype=dtype), torch.zeros(1, T, 2, V, dtype=dtype), \
        torch.zeros(1, T, 2, dtype=dtype)


@pytest.mark.parametrize("kwargs,match", [
    (dict(K=160), "q is on cpu"),       # (K, V past 128 train exactly: exact_train)
    (dict(V=256), "q is on cpu"),
    (dict(dtype=torch.float32), "q is on cpu"),       # (float32 trains: exact_train)
])
def test_shapes_past_the_kernels_train_exactly(kwargs, match):
    with pytest.raises(SpecError, match=match):
        linattn.chunk_delta_rule(*_grad_inputs(**kwargs))


def v_first_matches_k_first(fn, x: dict, do, dht, flag="state_v_first", **kw):
    """fn (a chunk_* function) with its states value-first ([N, HV, V, K]: the initial
    state, the final state and their gradients transposed) against the same call
    key-first: o, the final state and every gradient equal (the transposes are exact)."""
    runs = []
    for v_first in (False, True):
        x1 = dict(x, initial_state=x["initial_state"].transpose(-1, -2).contiguous()
                  if v_first else x["initial_state"])
        leaves = {n: t.clone().requires_grad_() for n, t in x1.items()}
        o, ht = fn(**leaves, output_final_state=True, **{flag: v_first}, **kw)
        assert ht.shape == x1["initial_state"].shape
        ht = ht.transpose(-1, -2) if v_first else ht
        ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        grads = {n: t.grad for n, t in leaves.items()}
        if v_first:
            grads["initial_state"] = grads["initial_state"].transpose(-1, -2)
        runs.append((o, ht, grads))
    (o0, h0, g0), (o1, h1, g1) = runs
    assert torch.equal(o0, o1) and torch.equal(h0, h1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_state_v_first(fake_kernels, rng):
    """chunk_delta_rule's transpose_state_layout (fla's name of state_v_first) trains: the
    Function runs key-first, the states transposed around it."""
    xs, do, dht = _inputs(rng, 1, 100, 2, 64, 128, torch.float16, 1, True)
    x = dict(zip(("q", "k", "v", "beta", "initial_state"), xs))
    v_first_matches_k_first(linattn.chunk_delta_rule, x, do, dht,
                            flag="transpose_state_layout", use_qk_l2norm_in_kernel=True)


# (chunk_gla and fused_recurrent_gla train: test_additive_bwd.py; chunk_kda: test_kda_bwd.py;
# fused_recurrent_delta_rule: test_fused_recurrent_delta_rule_trains_as_chunk)
@pytest.mark.parametrize("gate", ["g", "gk", "none", "kda"])
def test_fused_recurrent_delta_rules_train_as_their_chunk_twin(monkeypatch, gate):
    """fused_recurrent_gated_delta_rule (g: GDN, gk: KDA, neither: DeltaNet) and
    fused_recurrent_kda with gradients run the same training as the chunk_* function of
    their spec (autograd.train, called with the same arguments; a missing beta: ones); a
    state pool is refused."""
    from linattn.ops import deltanet, gdn, kda
    seen = []
    monkeypatch.setattr(autograd, "train", lambda *a, **kw: seen.append((a, kw)) or ("o", None))
    q, k, v, beta = _grad_inputs()
    sg = torch.zeros(1, 70, 2)
    kg = torch.zeros(1, 70, 2, 64)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    ones = torch.ones(1, 70, 2, dtype=q.dtype)
    if gate == "kda":
        spec, twin = kda.SPEC, lambda: linattn.chunk_kda(q, k, v, kg, beta, **kw)
        fn = lambda **x: linattn.fused_recurrent_kda(q, k, v, kg, beta, **kw, **x)  # noqa
    else:
        g = dict(g=sg, gk=kg, none=None)[gate]
        spec = dict(g=gdn.SPEC, gk=kda.SPEC, none=deltanet.SPEC)[gate]
        twin = lambda: autograd.train(spec, linattn.ops.api.fla_options(True), q, k, v, g,  # noqa
                                      ones, None, None, True, None, None, None, None)
        fn = lambda **x: linattn.fused_recurrent_gated_delta_rule(  # noqa: E731
            q, k, v, **{gate: g} if g is not None else {}, **kw, **x)
    twin()
    assert fn() == ("o", None)
    (a0, kw0), (a1, kw1) = seen
    assert a0[0] is a1[0] is spec and kw0 == kw1
    for x, y in zip(a0[1:], a1[1:]):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)
    with pytest.raises(SpecError, match="state pool .* has no backward"):
        fn(initial_state=torch.zeros(3, 2, 64, 64), inplace_final_state=True,
           ssm_state_indices=torch.tensor([0]))


def test_fused_recurrent_delta_rule_trains_as_chunk(fake_kernels, rng):
    """fused_recurrent_delta_rule with gradients (as fla's) runs chunk_delta_rule's
    training: the same o, final state and gradients (a missing beta: ones); a state pool
    is refused."""
    xs, do, dht = _inputs(rng, 1, 70, 2, 64, 64, torch.float16, 1, True)
    for beta in (xs[3], None):
        runs = []
        for fn in (linattn.chunk_delta_rule, linattn.fused_recurrent_delta_rule):
            leaves = [None if x is None else x.clone().requires_grad_()
                      for x in (xs[0], xs[1], xs[2], beta, xs[4])]
            b = leaves[3] if beta is not None else (
                torch.ones(1, 70, 2, dtype=torch.float16) if fn is linattn.chunk_delta_rule
                else None)
            o, ht = fn(leaves[0], leaves[1], leaves[2], b, initial_state=leaves[4],
                       output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=64)
            ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
            runs.append((o, ht, [x.grad for x in leaves if x is not None]))
        (o0, h0, g0), (o1, h1, g1) = runs
        assert torch.equal(o0, o1) and torch.equal(h0, h1)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    q = xs[0].clone().requires_grad_()
    with pytest.raises(SpecError, match="state pool .* has no backward"):
        linattn.fused_recurrent_delta_rule(q, xs[1], xs[2], xs[3], initial_state=xs[4],
                                           inplace_final_state=True,
                                           ssm_state_indices=torch.tensor([0]))


def test_gpu_check_recorder():
    """conftest.record_errors / rel_err (the GPU gradient tests' checker) on CPU tensors:
    under the limit passes and is recorded; over it, or NaN, fails."""
    from conftest import record_errors, rel_err
    ref = torch.ones(4, dtype=torch.float64)
    assert rel_err(ref * (1 + 1e-3), ref) == pytest.approx(1e-3)
    assert math.isnan(rel_err(torch.full((4,), float("nan")), ref))
    res = []
    record_errors(res, "t", {"dtype": "bfloat16"}, {"a": 5e-3}, 1)
    assert res[0]["passed"] and res[0]["tol"] == 1e-2
    with pytest.raises(AssertionError, match="over"):
        record_errors(res, "t", {"dtype": "float16"}, {"a": 6e-3}, 1)
    with pytest.raises(AssertionError):
        record_errors(res, "t", {"dtype": "bfloat16"}, {"a": float("nan")}, 1)
    assert [r["passed"] for r in res] == [True, False, False] and res[2]["errors"]["a"] is None


# -- Gated DeltaNet (the scalar gate) -------------------------------------------------------

def _gdn_inputs(rng, B, T, H, HV, K, V, dtype, N, h0, gik):
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(B, T, H, K), dim=-1) for _ in "qk")
    x = dict(q=q.to(dtype), k=k.to(dtype), v=r(B, T, HV, V).to(dtype),
             beta=torch.sigmoid(r(B, T, HV)).to(dtype),
             initial_state=r(N, HV, K, V).float() if h0 else None)
    if gik:
        x.update(g=r(B, T, HV).float(), A_log=torch.log(torch.rand(HV, generator=g) * 4 + .5),
                 dt_bias=(r(HV) * 0.5).float())
    else:
        x["g"] = (torch.nn.functional.logsigmoid(r(B, T, HV)) / 8).float()
    return x, r(B, T, HV, V).to(dtype), r(N, HV, K, V).float()


F16, BF16 = torch.float16, torch.bfloat16
GDN_CASES = [   # B, T, H, HV, K, V, cu_seqlens, initial state, dht, l2norm, gate in kernel
    pytest.param(2, 130, 2, 2, 64, 64, None, False, False, False, False, F16, id="B2-T130-plain"),
    pytest.param(1, 65, 1, 2, 64, 128, None, True, True, True, False, F16, id="T65-GVA2-h0-dht"),
    pytest.param(2, 64, 2, 4, 128, 64, None, True, False, False, True, F16, id="T64-GVA2-gik"),
    pytest.param(1, 135, 1, 2, 64, 64, (0, 1, 70, 71, 135), True, True, True, True, F16,
                 id="varlen-h0-dht-l2norm-gik"),
    pytest.param(1, 200, 2, 4, 64, 64, None, True, True, True, True, BF16,
                 id="T200-GVA2-h0-dht-l2norm-gik-bf16"),
    pytest.param(1, 150, 1, 2, 64, 64, (0, 64, 64, 150), True, True, False, False, F16,
                 id="varlen-empty-GVA2-h0-dht"),
    pytest.param(1, 90, 1, 2, 100, 32, (0, 20, 90), True, True, True, True, F16,
                 id="K100-V32-padded-varlen-GVA2-h0-dht-l2norm-gik"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,cu,h0,use_dht,l2norm,gik,dtype", GDN_CASES)
def test_gdn_gradients_match_fp64_autograd(fake_kernels, rng, B, T, H, HV, K, V, cu, h0,
                                           use_dht, l2norm, gik, dtype):
    """chunk_gated_delta_rule under autograd: q, k, v, g, beta, h0 (and A_log, dt_bias
    with the gate in the kernel) vs torch autograd of the fp64 chunked reference (the
    stages' emulators round where the kernels do: bf16's limit is 1e-2)."""
    N = B if cu is None else len(cu) - 1
    x, do, dht = _gdn_inputs(rng, B, T, H, HV, K, V, dtype, N, h0, gik)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, ht = linattn.chunk_gated_delta_rule(**leaves, output_final_state=use_dht,
                                           use_qk_l2norm_in_kernel=l2norm,
                                           use_gate_in_kernel=gik, cu_seqlens=cu_t)
    loss = (o.float() * do.float()).sum() + ((ht * dht).sum() if use_dht else 0)
    loss.backward()
    assert fake_kernels == GATED_STAGES
    refs = {n: t.detach().to(F64).requires_grad_() for n, t in leaves.items()}
    o_r, ht_r = tref.chunked_forward(gdn.SPEC, **refs, cu_seqlens=None if cu is None else
                                     torch.tensor(cu),
                                     options=Options(l2norm_qk=l2norm, gate_in_kernel=gik))
    loss_r = (o_r * do.to(F64)).sum() + ((ht_r * dht.to(F64)).sum() if use_dht else 0)
    loss_r.backward()
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, n
        assert not torch.isnan(t.grad).any(), n
        # A_log's and dt_bias' gradients are torch's sums over tokens of dg's (checked to
        # 5e-3) times the activation's derivative: terms of both signs cancel, so the sum's
        # relative error is larger
        tol = 3e-2 if n in ("A_log", "dt_bias") else 5e-3 if dtype == F16 else 1e-2
        assert _rel(t.grad, refs[n].grad) < tol, (n, _rel(t.grad, refs[n].grad))


def test_gdn_state_v_first(fake_kernels, rng):
    """chunk_gated_delta_rule with state_v_first trains (GVA, gate in kernel, padded K)."""
    x, do, dht = _gdn_inputs(rng, 1, 90, 1, 2, 48, 64, F16, 1, True, True)
    v_first_matches_k_first(linattn.chunk_gated_delta_rule, x, do, dht,
                            use_gate_in_kernel=True)


def test_gdn_unsupported_raise():
    q, k, v, beta = _grad_inputs()
    g = torch.zeros(1, 70, 2)
    with pytest.raises(SpecError, match="g \\[B, T, HV\\]"):
        linattn.chunk_gated_delta_rule(q, k, v, g[:, :, :1], beta)
    with pytest.raises(SpecError, match="HV a multiple of H"):
        linattn.chunk_gated_delta_rule(q, k, v[:, :, :1], g[:, :, :1], beta[:, :, :1])
    with pytest.raises(SpecError, match="q is on cpu"):     # (float32 trains: exact_train)
        linattn.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta)
    with pytest.raises(SpecError, match="q is on cpu"):     # (mixed, q float32: exact_train)
        linattn.chunk_gated_delta_rule(q.float(), k, v, g, beta)
    with pytest.raises(SpecError, match="backward needs q, k, v in one of float16"):
        linattn.chunk_gated_delta_rule(q, k.float(), v, g, beta)


def test_gdn_bf16_gate_gradient_through_rounding_emulators(fake_kernels, rng):
    """bfloat16 through the stages' emulators, which round where the templates do (the
    forward's states, dh and v_new in the input dtype): run s7-4's varlen case. The gate's
    chunk-boundary term once came from <dh, S_leaving> in f32 while the rows subtracted
    their part of it from dh and v_new rounded to bf16; that did not cancel (dA_log 8.6e-2,
    dg 4e-3 here; 0.35 and 7e-2 at T = 1000, K = 128). Now dqkw adds the rows' own sum.
    Its sequences (1, 129, 1, 64, 300, 1 tokens) mostly end in a partial chunk, whose g_last
    terms dqkw must put on the chunk's last row (n - 1, not 63: the packed layout has no
    padding rows to carry them)."""
    cu = (0, 1, 130, 131, 195, 495, 496)
    B, T, H, HV, K, V = 1, 496, 2, 4, 64, 64
    x, do, dht = _gdn_inputs(rng, B, T, H, HV, K, V, torch.bfloat16, len(cu) - 1, True, True)
    call = autograd.DeltaRuleCall(spec=gdn.SPEC, scale=gdn.SPEC.scale_for(K, None),
                                  l2norm_qk=True, output_final_state=True,
                                  gate_in_kernel=True, cu=cu)
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    kept = _reference_forward(call, x["q"], x["k"], x["v"], x["beta"], x["initial_state"],
                              x["g"], x["A_log"], x["dt_bias"])[2]
    grads = dict(zip(names, autograd.gated_backward(
        call, x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["A_log"],
        x["dt_bias"], do, dht, kept.pop("h"), kept)))
    assert fake_kernels == GATED_STAGES
    refs = {n: t.detach().to(F64).requires_grad_() for n, t in x.items()}
    o_r, ht_r = tref.chunked_forward(gdn.SPEC, **refs, cu_seqlens=torch.tensor(cu),
                                     options=Options(l2norm_qk=True, gate_in_kernel=True))
    ((o_r * do.to(F64)).sum() + (ht_r * dht.to(F64)).sum()).backward()
    for n in names:
        assert grads[n].shape == x[n].shape and grads[n].dtype == x[n].dtype, n
        tol = 2e-2 if n in ("A_log", "dt_bias") else 1e-2
        assert _rel(grads[n], refs[n].grad) < tol, (n, _rel(grads[n], refs[n].grad))


