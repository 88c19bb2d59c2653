"""DPLR's, IPLR's and RWKV-7's public functions (fla's signatures) on CPU tensors through
the ops' plumbing (the cpu_ops fixture: the op's CPU kernel is the fp64 torch
reference), against the NumPy fp64 recurrence of the dplr rule; their checks; the
generated decode kernels (CPU). GPU: tests/test_dplr_gpu.py."""
import numpy as np
import pytest
import torch
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)
from test_dplr_gpu import FLA_FUNCTIONS, fla_args
from test_dplr_gpu import _case as gpu_case

import linattn
from linattn.dsl import Options, SpecError
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec


def _inputs(fam, B=1, T=23, H=2, HV=2, K=32, V=16, cu=None, seed=0):
    x = random_inputs(get_spec(fam), Options(), B, T, H, HV, K, V,
                      np.random.default_rng(seed), cu_seqlens=cu)
    return x, {n: None if a is None else torch.tensor(a, dtype=torch.float32)
               for n, a in x.items()}


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, atol=tol, rtol=tol)


@pytest.mark.parametrize("fn, fam", [
    ("chunk_dplr_delta_rule", "dplr"), ("fused_recurrent_dplr_delta_rule", "dplr"),
    ("chunk_iplr_delta_rule", "iplr"), ("fused_recurrent_iplr_delta_rule", "iplr"),
    ("chunk_rwkv7", "dplr"), ("fused_recurrent_rwkv7", "dplr")])
def test_public_functions_match_the_recurrence(cpu_ops, fn, fam):
    """varlen, an initial state, K and V not multiples of 16 (a, b zero-padded), fla's
    argument orders (RWKV-7: r, w, k, v, a, b; its scales: 1.0 for chunk_rwkv7, K^-0.5
    for fused_recurrent_rwkv7)."""
    x, t = _inputs(fam, K=30, V=12, cu=[0, 9, 23])
    scale = 1.0 if fn == "chunk_rwkv7" else None
    want_o, want_h = recurrent_forward(get_spec(fam), scale=scale, **x)
    kw = dict(initial_state=t["initial_state"], output_final_state=True,
              cu_seqlens=torch.tensor([0, 9, 23]))
    q, k, v, a, b, g = (t[n] for n in ("q", "k", "v", "a", "b", "g"))
    if "rwkv7" in fn:
        o, ht = getattr(linattn, fn)(q, g, k, v, a, b, **kw)
    else:
        o, ht = getattr(linattn, fn)(q, k, v, a, b, *([g] if fam == "dplr" else []), **kw)
    _close(o, want_o)
    _close(ht, want_h)
    assert cpu_ops == [(fam, "recurrent")]


@pytest.mark.parametrize("change, message", [
    (dict(a=torch.zeros(1, 23, 2, 16)), r"a has shape \[1, 23, 2, 16\]; expected "
                                        r"\[1, 23, 2, 32\]"),
    (dict(b=None), "b"),
    (dict(gk=torch.zeros(1, 23, 2)), "g"),
    (dict(chunk_size=128), "chunk_size"),
    (dict(cp_context=object()), "cp_context"),
    (dict(lower_bound="x"), "lower_bound"),
])
def test_bad_inputs_fail_in_one_line(cpu_ops, change, message):
    _, t = _inputs("dplr")
    kw = dict(q=t["q"], k=t["k"], v=t["v"], a=t["a"], b=t["b"], gk=t["g"])
    kw.update(change)
    with pytest.raises((SpecError, TypeError), match=message) as e:
        linattn.chunk_dplr_delta_rule(**kw)
    assert "\n" not in str(e.value) and len(str(e.value)) <= 300
    assert cpu_ops == []


def test_fla_noops_accepted_and_refusals(cpu_ops):
    _, t = _inputs("dplr", T=4)
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["g"])
    linattn.chunk_dplr_delta_rule(*args, safe_gate=True, disable_recompute=True,
                                  lower_bound=-5.0, chunk_size=32)
    with pytest.raises(SpecError, match="reverse"):
        linattn.fused_recurrent_dplr_delta_rule(*args, reverse=True)


def test_generated_decode_kernels_take_a_and_b():
    from importlib import import_module
    dplr = import_module("linattn.generated.sm90.dplr.recurrent")
    iplr = import_module("linattn.generated.sm90.iplr.recurrent")
    assert dplr.args()[:6] == ["q", "k", "v", "g", "a", "b"]
    assert iplr.args()[:5] == ["q", "k", "v", "a", "b"]



@pytest.mark.parametrize("fn", list(FLA_FUNCTIONS))
def test_fla_comparison_binds_fla_arguments(fn):
    """tests/test_dplr_gpu.py test_against_fla's call, on CPU tensors: its inputs (IPLR's
    without a gate) bind to fla's parameters of their names (RWKV-7: r, w, k, v, a, b;
    DPLR: q, k, v, a, b, gk; IPLR: q, k, v, a, b), and to linattn's alike."""
    import inspect
    pytest.importorskip("fla.ops")
    import fla.ops.generalized_delta_rule as gdr
    import fla.ops.rwkv7 as rwkv7
    fam = FLA_FUNCTIONS[fn]
    _, t = gpu_case(fam, 1, 8, 2, 16, 16, "float32", device="cpu")
    args = fla_args(fn, fam, t)
    want = (["r", "w", "k", "v", "a", "b"] if "rwkv7" in fn else
            ["q", "k", "v", "a", "b"] + (["gk"] if fam == "dplr" else []))
    for f in (getattr(rwkv7 if "rwkv7" in fn else gdr, fn), getattr(linattn, fn)):
        assert list(inspect.signature(f).bind(*args).arguments) == want, f
