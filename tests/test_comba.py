"""Comba's public functions (chunk_comba, fused_recurrent_comba: fla's signatures) on CPU
tensors through the ops' plumbing (the cpu_ops fixture: the op's CPU kernel is the fp64
torch reference), against the NumPy fp64 recurrence of the comba rule; their checks;
the generated decode kernel (CPU). GPU: tests/test_comba_gpu.py."""
import numpy as np
import pytest
import torch
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)

import linattn
from linattn.dsl import Options, SpecError
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops import comba
from linattn.ops.registry import get_spec

SPEC = get_spec("comba")


def _inputs(opts=Options(), B=1, T=23, H=2, HV=4, K=32, V=16, cu=None, seed=0):
    x = random_inputs(SPEC, opts, B, T, H, HV, K, V, np.random.default_rng(seed),
                      cu_seqlens=cu)
    return x, {n: None if a is None else torch.tensor(a, dtype=torch.float32)
               for n, a in x.items()}


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, atol=tol, rtol=tol)


@pytest.mark.parametrize("fn", ["chunk_comba", "fused_recurrent_comba"])
@pytest.mark.parametrize("l2norm", [False, True])
def test_public_functions_match_the_recurrence(cpu_ops, fn, l2norm):
    """varlen, an initial state, GVA, l2norm of q, k and p; fla's argument orders
    (chunk: q, k, v, p; fused_recurrent: q, k, p, v)."""
    opts = Options(l2norm_qk=l2norm)
    x, t = _inputs(opts, cu=[0, 9, 23])
    want_o, want_h = recurrent_forward(SPEC, options=opts, **x)
    args = (t["q"], t["k"], t["v"], t["p"]) if fn == "chunk_comba" else (
        t["q"], t["k"], t["p"], t["v"])
    o, ht = getattr(linattn, fn)(*args, t["g"], t["beta"], initial_state=t["initial_state"],
                                 output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                 cu_seqlens=torch.tensor([0, 9, 23]))
    _close(o, want_o)
    _close(ht, want_h)
    assert cpu_ops == [("comba", "recurrent")]


def test_defaults_and_state_v_first(cpu_ops):
    """p None is k, beta None is ones (fla's defaults); state_v_first as a keyword."""
    x, t = _inputs(B=2, T=5)
    x.update(p=x["k"], beta=np.ones_like(x["beta"]))
    want_o, want_h = recurrent_forward(SPEC, options=Options(state_v_first=True),
                                       **dict(x, initial_state=np.swapaxes(
                                           x["initial_state"], -1, -2)))
    o, ht = linattn.chunk_comba(t["q"], t["k"], t["v"], None, t["g"], scale=None,
                                initial_state=t["initial_state"].transpose(-1, -2)
                                .contiguous(), output_final_state=True, state_v_first=True)
    _close(o, want_o)
    _close(ht, want_h)


def test_state_pool_in_place(cpu_ops):
    x, t = _inputs(T=3, cu=[0, 1, 2, 3], seed=2)
    pool = torch.randn(6, 4, 32, 16)
    slots = torch.tensor([4, 0, 2])
    want = pool.clone().double()
    o, ht = linattn.fused_recurrent_comba(t["q"], t["k"], t["p"], t["v"], t["g"], t["beta"],
                                          initial_state=pool, cu_seqlens=torch.tensor(
                                              [0, 1, 2, 3]), ssm_state_indices=slots,
                                          inplace_final_state=True)
    assert ht is pool
    for n, s in enumerate(slots.tolist()):
        sl = {k: None if a is None else a[:, n:n + 1] for k, a in x.items()
              if k in ("q", "k", "v", "g", "beta", "p")}
        ro, rh = recurrent_forward(SPEC, **sl, initial_state=want[s:s + 1].numpy())
        _close(o[:, n:n + 1], ro)
        _close(pool[s:s + 1], rh)


@pytest.mark.parametrize("change, message", [
    (dict(p=torch.zeros(1, 23, 2, 16)), r"p has shape \[1, 23, 2, 16\]; expected \[1, 23, 2, 32\]"),
    (dict(g=None), "g"),
    (dict(beta=torch.zeros(1, 23, 4, 16)), "beta"),
    (dict(use_gate_in_kernel=True), "use_gate_in_kernel"),
])
def test_bad_inputs_fail_in_one_line(cpu_ops, change, message):
    _, t = _inputs()
    kw = dict(q=t["q"], k=t["k"], v=t["v"], p=t["p"], g=t["g"], beta=t["beta"])
    kw.update(change)
    with pytest.raises((SpecError, TypeError), match=message) as e:
        linattn.chunk_comba(**kw)
    assert "\n" not in str(e.value) and len(str(e.value)) <= 300
    assert cpu_ops == []


def test_build_refuses_the_comba_rule():
    with pytest.raises(SpecError, match="chunk_comba"):
        linattn.build(SPEC)


def test_generated_decode_kernel_takes_p():
    from linattn.generated.sm90 import comba as gen
    from importlib import import_module
    mod = import_module(gen.__name__ + ".recurrent")
    assert mod.args()[:6] == ["q", "k", "v", "g", "beta", "p"]
    assert comba.SPEC.hash in open(mod.__file__).read()
