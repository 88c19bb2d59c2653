"""The families with no generated backward (DPLR, IPLR, RWKV-7; Comba's and GDN-2's
float32 calls) train exactly in torch (ops/exact_train.py): their chunk_* and
fused_recurrent_* calls, in float32 and bfloat16 (Comba's and GDN-2's 16-bit calls train
through their generated backward: tests/test_comba_bwd.py, tests/test_gdn2_bwd.py), with varlen, an initial state and the final state's gradient,
against torch autograd of the independent fp64 token recurrence
(dsl/torch_reference.recurrent_forward) on the same (rounded) inputs. CPU tensors through
the ops' plumbing (the cpu_ops fixture switches the device check off)."""
import warnings

import numpy as np
import pytest
import torch
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)

import linattn
from linattn.dsl import Options, SpecError
from linattn.dsl import torch_reference as tr
from linattn.dsl.recurrent import random_inputs
from linattn.ops.registry import get_spec

#: function -> (family, its positional inputs in fla's order)
CALLS = {
    "chunk_comba": ("comba", ("q", "k", "v", "p", "g", "beta")),
    "fused_recurrent_comba": ("comba", ("q", "k", "p", "v", "g", "beta")),
    "chunk_gdn2": ("gdn2", ("q", "k", "v", "g", "b", "w")),
    "fused_recurrent_gdn2": ("gdn2", ("q", "k", "v", "g", "b", "w")),
    "chunk_dplr_delta_rule": ("dplr", ("q", "k", "v", "a", "b", "g")),
    "fused_recurrent_dplr_delta_rule": ("dplr", ("q", "k", "v", "a", "b", "g")),
    "chunk_iplr_delta_rule": ("iplr", ("q", "k", "v", "a", "b")),
    "fused_recurrent_iplr_delta_rule": ("iplr", ("q", "k", "v", "a", "b")),
    "chunk_rwkv7": ("dplr", ("q", "g", "k", "v", "a", "b")),
}
CU = [0, 20, 21, 70]


def _inputs(fam, dtype, seed):
    x = random_inputs(get_spec(fam), Options(), 1, CU[-1], 2, 4 if fam == "comba" else 2,
                      32, 16, np.random.default_rng(seed), cu_seqlens=CU)
    x = {n: torch.tensor(a) for n, a in x.items() if a is not None and n != "cu_seqlens"}
    # (the 16-bit inputs rounded; the gates, beta and the state stay float32 as fla's)
    low = {"q", "k", "v", "p", "a", "b", "w"}
    return {n: t.to(dtype if n in low else torch.float32) for n, t in x.items()}


#: the generated backward's calls (16-bit chunk_* of a spec ops/build.py has_backward takes)
KERNEL_TRAINED = {(f"{kind}_{fam}", torch.bfloat16) for kind in ("chunk", "fused_recurrent")
                  for fam in ("comba", "gdn2")}


@pytest.mark.parametrize("fn,dtype", [
    pytest.param(fn, dt, id=f"{fn}-{name}") for fn in CALLS
    for dt, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16"))
    if (fn, dt) not in KERNEL_TRAINED])
def test_trains_exactly(cpu_ops, fn, dtype, rng):
    fam, order = CALLS[fn]
    spec = get_spec(fam)
    x = _inputs(fam, dtype, int(rng.integers(1 << 30)))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    scale = 1.0 if fn == "chunk_rwkv7" else None
    o, ht = getattr(linattn, fn)(*(leaves[n] for n in order),
                                 initial_state=leaves["initial_state"], output_final_state=True,
                                 cu_seqlens=torch.tensor(CU), scale=scale)
    assert cpu_ops == [] and o.dtype == dtype and ht.dtype == torch.float32
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()

    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    rule = {n: ref[n] for n in spec.rule.maths.vector_inputs}
    ro, rht = tr.recurrent_forward(spec, ref["q"], ref["k"], ref["v"], ref.get("g"),
                                   ref.get("beta"), scale=scale,
                                   initial_state=ref["initial_state"],
                                   cu_seqlens=torch.tensor(CU), **rule)
    ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    _close(o, ro, tol)
    _close(ht, rht, 1e-5)           # (the state and the gradients: fp64, then cast)
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype, n
        _close(t.grad, ref[n].grad, tol)


def _close(a, b, tol):
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    assert err <= tol, err


def test_a_state_pool_does_not_train(cpu_ops):
    x = _inputs("comba", torch.float32, 0)
    q = x["q"][:, :3].clone().requires_grad_()
    pool = torch.zeros(5, 4, 32, 16)
    with pytest.raises(SpecError, match="state pool .* has no backward"):
        linattn.fused_recurrent_comba(q, x["k"][:, :3], x["p"][:, :3], x["v"][:, :3],
                                      x["g"][:, :3], x["beta"][:, :3], initial_state=pool,
                                      ssm_state_indices=torch.tensor([1]),
                                      inplace_final_state=True)


def test_a_16bit_call_is_told_once_that_it_trains_in_torch(cpu_ops, monkeypatch):
    from linattn.ops import exact_train
    monkeypatch.setattr(exact_train, "_NOTED", set())
    x = _inputs("iplr", torch.bfloat16, 1)
    args = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "a", "b")]
    with pytest.warns(UserWarning, match="iplr has no backward kernels yet"):
        linattn.chunk_iplr_delta_rule(*args, cu_seqlens=torch.tensor(CU),
                                      initial_state=x["initial_state"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linattn.chunk_iplr_delta_rule(*args, cu_seqlens=torch.tensor(CU),
                                      initial_state=x["initial_state"])
