"""GPU checks of decode on a state pool (marked gpu; skipped without CUDA): the recurrent
kernel with ssm_state_indices / num_accepted_tokens / inplace_final_state against the
loop reference (dsl/torch_reference.pool_recurrent_forward), every family, with the
slots no sequence names filled with NaN: they must come back bit-identical (never
written) and nothing NaN may reach o or a named slot (never read)."""
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.dsl import torch_reference as tr
from linattn.ops.registry import get_spec

pytestmark = pytest.mark.gpu
BF = torch.bfloat16

CALLS = {
    "gdn": lambda x, **kw: linattn.fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], beta=x["beta"], **kw),
    "kda": lambda x, **kw: linattn.fused_recurrent_kda(x["q"], x["k"], x["v"], x["gk"],
                                                       x["beta"], **kw),
    "deltanet": lambda x, **kw: linattn.fused_recurrent_delta_rule(
        x["q"], x["k"], x["v"], x["beta"], **kw),
    "gla": lambda x, **kw: linattn.fused_recurrent_gla(x["q"], x["k"], x["v"], x["gk"], **kw),
    "simple_gla": lambda x, **kw: linattn.fused_recurrent_simple_gla(
        x["q"], x["k"], x["v"], x["g"], **kw),
    "linear_attn": lambda x, **kw: linattn.fused_recurrent_linear_attn(
        x["q"], x["k"], x["v"], **kw),
}
#: (id, slots per sequence, tokens, accepted, varlen lengths, pool dtype, index dtype, in place)
CASES = [
    pytest.param(1, 1, None, None, torch.float32, torch.int32, True, id="1d-inplace"),
    pytest.param(1, 1, None, None, BF, torch.int64, True, id="1d-inplace-bf16-pool"),
    pytest.param(1, 1, None, None, BF, torch.int32, False, id="1d-bf16-pool-final-f32"),
    pytest.param(3, 3, True, None, torch.float32, torch.int32, True, id="2d-spec-decoding"),
    pytest.param(4, None, True, [3, 1, 4, 2, 3], torch.float32, torch.int64, True,
                 id="2d-spec-varlen"),
    pytest.param(1, 1, None, None, torch.float32, torch.int32, True, id="1d-padding"),
]


def _inputs(name, N, T, varlen, seed=0):
    torch.manual_seed(seed)
    HV = 2 if name in ("gla", "simple_gla", "linear_attn", "deltanet") else 8
    B, L = (1, sum(varlen)) if varlen else (N, T)
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    return dict(q=F.normalize(r(B, L, 2, 128), dim=-1).to(BF),
                k=F.normalize(r(B, L, 2, 128), dim=-1).to(BF), v=r(B, L, HV, 128).to(BF),
                g=F.logsigmoid(r(B, L, HV)), gk=F.logsigmoid(r(B, L, HV, 128)),
                beta=torch.rand(B, L, HV, device="cuda")), HV


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("S, T, accepted, varlen, pool_dtype, idx_dtype, inplace", CASES)
def test_pool_decode_matches_the_loop_reference(name, S, T, accepted, varlen, pool_dtype,
                                                idx_dtype, inplace, request):
    _check_pool(name, S, T, accepted, varlen, pool_dtype, idx_dtype, inplace,
                "padding" in request.node.callspec.id)


#: the resident-CTA cap (codegen/arch/sm90 DECODE_FULL_GRID) on a pool
CTA_CAP_KNOBS = [
    pytest.param(dict(block_v=64, threads=128, vec=4, warps_k=1, ctas_per_sm=3), id="s64-c3"),
]


@pytest.mark.parametrize("name", ["gdn", "kda"])
@pytest.mark.parametrize("S, T, accepted, varlen, pool_dtype, idx_dtype, inplace",
                         [c for c in CASES if c.id in ("2d-spec-varlen", "1d-padding")])
@pytest.mark.parametrize("knobs", CTA_CAP_KNOBS)
def test_pool_decode_cta_cap_matches_the_loop_reference(name, S, T, accepted, varlen, pool_dtype,
                                                        idx_dtype, inplace, knobs, request):
    from linattn.ops.recurrent import tuning_override
    with tuning_override(**knobs):
        _check_pool(name, S, T, accepted, varlen, pool_dtype, idx_dtype, inplace,
                    "padding" in request.node.callspec.id)


def _check_pool(name, S, T, accepted, varlen, pool_dtype, idx_dtype, inplace, padding):
    N, P = (len(varlen) if varlen else 5), 40
    x, HV = _inputs(name, N, T, varlen)
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(P, generator=gen)[:N * S].view(N, S) if S > 1 else \
        torch.randperm(P, generator=gen)[:N]
    slots = perm.clone()
    if padding:
        slots[1], slots[3] = -1, P + 7          # padding: that sequence is skipped
    named = {int(s) for s in slots.flatten() if 0 <= s < P}
    pool = torch.randn(P, HV, 128, 128, device="cuda").to(pool_dtype)
    pool[[s for s in range(P) if s not in named]] = float("nan")
    before = pool.clone()
    acc = (torch.randint(1, S + 1, (N,), generator=gen).cuda() if accepted else None)
    cu = (torch.tensor([0] + torch.tensor(varlen).cumsum(0).tolist(), device="cuda")
          if varlen else None)
    slots = slots.to(idx_dtype).cuda()
    spec = get_spec(name)
    gate = x["gk"] if spec.gate.value == "key" else x["g"] if spec.has_gate else None
    want_o, want_pool, want_final = tr.pool_recurrent_forward(
        spec, x["q"], x["k"], x["v"], gate, x["beta"] if spec.has_beta else None, pool=pool,
        ssm_state_indices=slots, num_accepted_tokens=acc, inplace=inplace, cu_seqlens=cu)
    # o is allocated uninitialised: leave NaNs where the caching allocator will hand it out,
    # so that a skipped sequence's rows count only if the kernel writes their zeros
    torch.full((x["v"].numel() * 4,), float("nan"), device="cuda")
    o, ht = CALLS[name](x, initial_state=pool, ssm_state_indices=slots,
                        num_accepted_tokens=acc, inplace_final_state=inplace,
                        output_final_state=True, cu_seqlens=cu)
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.double(), want_o, atol=2e-2, rtol=2e-2)
    unnamed = [s for s in range(P) if s not in named]
    assert torch.isnan(pool[unnamed]).all()
    if inplace:
        assert ht is pool
        tol = 2e-2 if pool_dtype == BF else 1e-3
        torch.testing.assert_close(pool[sorted(named)].double(), want_pool[sorted(named)],
                                   atol=tol, rtol=tol)
    else:
        assert torch.equal(pool.nan_to_num(), before.nan_to_num())    # not modified
        assert ht.dtype == torch.float32
        torch.testing.assert_close(ht.double(), want_final, atol=1e-3, rtol=1e-3)
