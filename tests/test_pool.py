"""Decode on a state pool (fla's ssm_state_indices / num_accepted_tokens /
inplace_final_state) on the CPU: the loop reference against plain recurrences, the
kernel's argument plumbing (every argument matches the generated prim_func), and the
public functions end to end on the reference kernel, with poisoned (NaN) slots that are
not named and must stay untouched."""
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tr
from linattn.ops import recurrent as rec_mod
from linattn.ops import runtime
from linattn.ops.recurrent import fused_recurrent
from linattn.ops.registry import get_spec

from _cpu_ops import cpu_ops  # noqa: F401 (fixture)
from test_validate import ArgCheckingKernel

BF, F32 = torch.bfloat16, torch.float32
GDN, KDA = get_spec("gdn"), get_spec("kda")


def decode_inputs(N=3, T=1, H=2, HV=4, K=32, V=16, P=8, key=False, seed=0, varlen=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    B, L = (1, sum(varlen)) if varlen else (N, T)
    q, k = r(B, L, H, K).to(BF), r(B, L, H, K).to(BF)
    v = r(B, L, HV, V).to(BF)
    g = F.logsigmoid(r(B, L, HV, K) if key else r(B, L, HV))
    beta = torch.rand(B, L, HV, generator=gen)
    pool = r(P, HV, K, V)
    cu = torch.tensor([0] + list(torch.tensor(varlen).cumsum(0))) if varlen else None
    return q, k, v, g, beta, pool, cu


def _poison(pool, named):
    """NaN in every slot not in ``named``."""
    out = pool.clone()
    for s in range(pool.shape[0]):
        if s not in named:
            out[s] = float("nan")
    return out


# ------------------------------------------------------------------ the reference
def test_pool_reference_is_the_plain_recurrence_on_gathered_states():
    q, k, v, g, beta, pool, _ = decode_inputs(T=2)
    idx = torch.tensor([5, 0, 2])
    o, new_pool, final = tr.pool_recurrent_forward(GDN, q, k, v, g, beta, pool=pool,
                                                   ssm_state_indices=idx, inplace=True)
    ro, rfinal = tr.recurrent_forward(GDN, q, k, v, g, beta, initial_state=pool[idx])
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(final, rfinal)
    torch.testing.assert_close(new_pool[idx], rfinal)
    rest = [s for s in range(8) if s not in (5, 0, 2)]
    torch.testing.assert_close(new_pool[rest], pool[rest].double())


def test_pool_reference_speculative_slots():
    """[N, S] slots: read at num_accepted - 1, the state after token t into [n, t]."""
    q, k, v, g, beta, pool, _ = decode_inputs(T=3)
    idx = torch.tensor([[0, 1, 2], [3, 4, -1], [6, 7, 5]])
    acc = torch.tensor([1, 2, 3])
    o, new_pool, final = tr.pool_recurrent_forward(GDN, q, k, v, g, beta, pool=pool,
                                                   ssm_state_indices=idx,
                                                   num_accepted_tokens=acc, inplace=True)
    start = pool[torch.tensor([0, 4, 5])]
    ro, rfinal = tr.recurrent_forward(GDN, q, k, v, g, beta, initial_state=start)
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(new_pool[2], rfinal[0])       # sequence 0, token 2
    torch.testing.assert_close(new_pool[5], rfinal[2])       # sequence 2, token 2
    s1 = tr.recurrent_forward(GDN, q[1:2, :2], k[1:2, :2], v[1:2, :2], g[1:2, :2],
                              beta[1:2, :2], initial_state=start[1:2])[1]
    torch.testing.assert_close(new_pool[4], s1[0])           # sequence 1, token 1


def test_pool_reference_skips_padding_slots():
    q, k, v, g, beta, pool, _ = decode_inputs()
    o, new_pool, final = tr.pool_recurrent_forward(GDN, q, k, v, g, beta, pool=pool,
                                                   ssm_state_indices=torch.tensor([1, -1, 8]),
                                                   inplace=True)
    assert o[1:].abs().max() == 0 and final[1:].abs().max() == 0
    torch.testing.assert_close(new_pool[2:], pool[2:].double())


# ------------------------------------------------------------------ kernel plumbing
@pytest.fixture
def fake_kernels(monkeypatch):
    made = []

    def get_kernel(spec, stage, arch, sizes=None, **problem):
        module = runtime.stage_module(spec, stage, arch)
        params = {**runtime.get_arch(arch).tuning(stage, problem, sizes), **problem}
        kern = ArgCheckingKernel(module.build(**params))
        made.append((kern, params))
        return kern, module, params

    monkeypatch.setattr(rec_mod.validate, "check_cuda", lambda name, x: None)
    monkeypatch.setattr(rec_mod.runtime, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(rec_mod.runtime, "get_kernel", get_kernel)
    return made


POOL_CASES = [  # (id, spec, slots shape, accepted, inplace, varlen, pool dtype, index dtype)
    ("1d", GDN, "1d", False, False, None, F32, torch.int32),
    ("1d-inplace", GDN, "1d", False, True, None, F32, torch.int64),
    ("2d-inplace-accepted", GDN, "2d", True, True, [2, 3, 1], F32, torch.int32),
    ("2d-not-inplace", KDA, "2d", False, False, None, BF, torch.int64),
    ("1d-inplace-bf16", KDA, "1d", False, True, [1, 1, 1], BF, torch.int32),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_pool_arguments_match_kernel_signature(fake_kernels, case):
    _, spec, form, acc, inplace, varlen, pool_dtype, idx_dtype = case
    q, k, v, g, beta, pool, cu = decode_inputs(T=3 if form == "2d" and not varlen else 1,
                                               key=spec is KDA, varlen=varlen)
    pool = pool.to(pool_dtype)
    S = 4
    slots = (torch.arange(3, dtype=idx_dtype) if form == "1d"
             else torch.arange(3 * S, dtype=idx_dtype).reshape(3, S) % 8)
    accepted = torch.tensor([1, 2, 1], dtype=torch.int32) if acc else None
    o, ht = fused_recurrent(spec, q, k, v, g, beta, initial_state=pool,
                            output_final_state=True, cu_seqlens=cu, ssm_state_indices=slots,
                            num_accepted_tokens=accepted, inplace_final_state=inplace)
    ((kern, params),) = fake_kernels
    (args, dyn), = kern.calls
    assert params["state_pool"] and params["slots_per_token"] == (form == "2d")
    assert params.get("accepted_tokens", False) == acc and params.get("inplace", False) == inplace
    assert dyn["P"] == 8 and dyn.get("S", S) == S
    assert any(a is slots for a in args)
    if inplace:
        assert ht is pool and sum(a is pool for a in args) == 2          # h0 and ht
    else:
        assert ht.shape == (3, 4, 32, 16) and ht.dtype == F32
        assert params.get("h0_dtype", "float32") == str(pool_dtype).replace("torch.", "")
    assert any(a is o for a in args)     # the kernel writes every o row (skips: zeros)


def test_pool_checks():
    q, k, v, g, beta, pool, _ = decode_inputs()
    with pytest.raises(SpecError, match=r"ssm_state_indices has shape \[2\]; expected \[3\]"):
        linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool,
                                                 ssm_state_indices=torch.zeros(2).int())
    with pytest.raises(SpecError, match=r"num_accepted_tokens needs ssm_state_indices of shape"):
        linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool,
                                                 ssm_state_indices=torch.zeros(3).int(),
                                                 num_accepted_tokens=torch.ones(3).int())
    with pytest.raises(SpecError, match="ssm_state_indices has dtype float32"):
        linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool,
                                                 ssm_state_indices=torch.zeros(3))
    with pytest.raises(SpecError, match="initial_state must be contiguous"):
        linattn.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=pool.transpose(-1, -2).contiguous()
            .transpose(-1, -2), ssm_state_indices=torch.zeros(3).int(),
            inplace_final_state=True)


# ------------------------------------------------------------------ end to end (CPU reference)
PUBLIC_POOL = [
    ("gdn", lambda x, **kw: linattn.fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], beta=x["beta"], **kw)),
    ("kda", lambda x, **kw: linattn.fused_recurrent_kda(x["q"], x["k"], x["v"], x["gk"],
                                                        x["beta"], **kw)),
    ("deltanet", lambda x, **kw: linattn.fused_recurrent_delta_rule(
        x["q"], x["k"], x["v"], x["beta"], **kw)),
    ("gla", lambda x, **kw: linattn.fused_recurrent_gla(x["q"], x["k"], x["v"], x["gk"], **kw)),
    ("simple_gla", lambda x, **kw: linattn.fused_recurrent_simple_gla(
        x["q"], x["k"], x["v"], x["g"], **kw)),
    ("linear_attn", lambda x, **kw: linattn.fused_recurrent_linear_attn(
        x["q"], x["k"], x["v"], **kw)),
]


def _family_inputs(name, T=1):
    HV = 2 if name in ("gla", "simple_gla", "linear_attn", "deltanet") else 4
    q, k, v, g, beta, pool, _ = decode_inputs(T=T, HV=HV)
    _, _, _, gk, _, _, _ = decode_inputs(T=T, HV=HV, key=True, seed=1)
    return dict(q=q, k=k, v=v, g=g, gk=gk, beta=beta), pool


@pytest.mark.parametrize("name, call", PUBLIC_POOL, ids=[p[0] for p in PUBLIC_POOL])
@pytest.mark.parametrize("form", ["1d", "2d-accepted", "padding"])
def test_public_pool_decode_leaves_unnamed_slots(cpu_ops, name, call, form):
    T = 2 if form == "2d-accepted" else 1
    x, pool = _family_inputs(name, T)
    if form == "1d":
        idx, acc, named = torch.tensor([6, 1, 3]), None, {6, 1, 3}
    elif form == "2d-accepted":
        idx, acc = torch.tensor([[0, 2], [4, 5], [7, -1]]), torch.tensor([1, 2, 1])
        named = {0, 2, 4, 5, 7}
    else:
        idx, acc, named = torch.tensor([2, -1, 99]), None, {2}
    poisoned = _poison(pool, named)
    spec = get_spec(name)
    gate = x["gk"] if spec.gate.value == "key" else x["g"] if spec.has_gate else None
    want_o, want_pool, _ = tr.pool_recurrent_forward(
        spec, x["q"], x["k"], x["v"], gate, x["beta"] if spec.has_beta else None,
        pool=poisoned, ssm_state_indices=idx, num_accepted_tokens=acc, inplace=True)
    o, ht = call(x, initial_state=poisoned, ssm_state_indices=idx, num_accepted_tokens=acc,
                 inplace_final_state=True)
    assert cpu_ops == [(name, "inplace")] and ht is poisoned
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.double(), want_o, atol=2e-2, rtol=2e-2)
    for s in range(pool.shape[0]):
        if s in named:
            torch.testing.assert_close(poisoned[s].double(), want_pool[s], atol=1e-4, rtol=1e-4)
        else:
            assert torch.isnan(poisoned[s]).all(), s          # never written


def test_public_pool_without_inplace_returns_final_states(cpu_ops):
    x, pool = _family_inputs("gdn")
    idx = torch.tensor([6, 1, 3])
    bf_pool = pool.to(BF)
    o, ht = linattn.fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=bf_pool,
        output_final_state=True, ssm_state_indices=idx)
    assert torch.equal(bf_pool, pool.to(BF)) and ht.dtype == F32 and ht.shape == (3, 4, 32, 16)
    ro, rht = tr.recurrent_forward(GDN, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   initial_state=bf_pool[idx])
    torch.testing.assert_close(ht.double(), rht, atol=1e-4, rtol=1e-4)


def test_inplace_without_pool_updates_rows(cpu_ops):
    x, pool = _family_inputs("gdn")
    h = pool[:3].clone()
    before = h.clone()
    o, ht = linattn.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"],
                                                     beta=x["beta"], initial_state=h,
                                                     inplace_final_state=True)
    assert ht is h
    rht = tr.recurrent_forward(GDN, x["q"], x["k"], x["v"], x["g"], x["beta"],
                               initial_state=before)[1]
    torch.testing.assert_close(h.double(), rht, atol=1e-4, rtol=1e-4)


def test_inplace_op_fake_and_opcheck(cpu_ops):
    x, pool = _family_inputs("gdn")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, pool.clone(), None, None,
            0.3, False, Options().key(), torch.tensor([6, 1, 3]), None)
    torch.library.opcheck(torch.ops.linattn.fused_recurrent_gdn_inplace.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
