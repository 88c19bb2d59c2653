"""symbolic (sympy) == recurrent == chunked, forward and backward, at tiny sizes.

The sympy reference writes every option again as a formula and takes gradients by sympy
differentiation, so it checks the shared preprocessing and both hand-written backwards.
"""
import dataclasses

import numpy as np
import pytest

from linattn.dsl import Options, SpecError
from linattn.dsl.chunked import chunked_forward
from linattn.dsl.chunked_bwd import chunked_backward
from linattn.dsl.recurrent import random_inputs, recurrent_backward, recurrent_forward
from linattn.dsl.symbolic import symbolic_reference

from _ref_inputs import SPECS, all_options, assert_close, spec_option_params

TOL = 1e-10
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")


def _check_all_agree(spec, opts, inp, rng, chunk_size=2):
    o, ht = recurrent_forward(spec, options=opts, **inp)
    do = rng.standard_normal(o.shape)
    dht = rng.standard_normal(ht.shape)
    sym = symbolic_reference(spec, options=opts, do=do, dht=dht, **inp)
    chunk = chunked_forward(spec, options=opts, chunk_size=chunk_size, **inp)
    for name, got in (("recurrent o", o), ("chunked o", chunk["o"])):
        assert_close(got, sym["o"], TOL, name)
    for name, got in (("recurrent ht", ht), ("chunked ht", chunk["final_state"])):
        assert_close(got, sym["final_state"], TOL, name)
    rec = recurrent_backward(spec, options=opts, do=do, dht=dht, **inp)
    chb = chunked_backward(spec, options=opts, do=do, dht=dht, chunk_size=chunk_size, **inp)
    for name in GRADS:
        assert (sym[name] is None) == (rec[name] is None) == (chb[name] is None), name
        if sym[name] is not None:
            assert_close(rec[name], sym[name], TOL, f"recurrent {name}")
            assert_close(chb[name], sym[name], TOL, f"chunked {name}")


@pytest.mark.parametrize("spec, opts", spec_option_params())
def test_symbolic_recurrent_chunked_agree(spec, opts, rng):
    inp = random_inputs(spec, opts, 2, 4, 1, 2, 2, 2, rng)
    _check_all_agree(spec, opts, inp, rng)


@pytest.mark.parametrize("K, V, HV", [(2, 1, 1), (1, 3, 2), (3, 2, 2)],
                         ids=["K2-V1-HV1", "K1-V3-HV2", "K3-V2-HV2"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_symbolic_varlen_and_dims(spec, K, V, HV, rng):
    """Ragged sequences (lengths 1, 3, 0, 2), K != V, both GVA ratios, all options (but
    l2norm at K = 1: normalising a scalar is sign(x), its gradient eps / |x|^3 cancels
    to ~1e-10 relative in fp64 whichever way it is written)."""
    opts = all_options(spec)
    if K == 1:
        opts = dataclasses.replace(opts, l2norm_qk=False)
    inp = random_inputs(spec, opts, 1, 6, 1, HV, K, V, rng, cu_seqlens=[0, 1, 4, 4, 6])
    _check_all_agree(spec, opts, inp, rng)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.has_gate],
                         ids=[s.name for s in SPECS if s.has_gate])
def test_symbolic_softplus_threshold(spec, rng):
    """gate_in_kernel with g + dt_bias on both sides of fla's softplus threshold (20) and
    far above it (exp would overflow), all finite and in agreement."""
    opts = all_options(spec)
    inp = random_inputs(spec, opts, 1, 4, 1, 2, 2, 2, rng)
    shape = inp["g"].shape
    inp["g"] = rng.choice([-3.0, 19.5, 20.5, 800.0], shape) + 0.1 * rng.random(shape)
    inp["A_log"] = np.log(rng.uniform(1e-4, 1e-3, inp["A_log"].shape))   # moderate decays
    _check_all_agree(spec, opts, inp, rng)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_symbolic_without_state_or_bias(spec, rng):
    opts = all_options(spec)
    inp = random_inputs(spec, opts, 2, 3, 1, 2, 2, 2, rng, initial_state=False)
    if spec.has_gate:
        inp["dt_bias"] = None
    _check_all_agree(spec, opts, inp, rng)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_full_differentiation_matches_steps(spec, rng):
    """All of L differentiated as one expression == chained token Jacobians."""
    opts = Options(state_v_first=True)
    T = 3 if not spec.has_beta else 2
    inp = random_inputs(spec, opts, 1, T, 1, 2, 2, 2, rng)
    o, ht = recurrent_forward(spec, options=opts, **inp)
    do, dht = rng.standard_normal(o.shape), rng.standard_normal(ht.shape)
    full = symbolic_reference(spec, options=opts, do=do, dht=dht, method="full", **inp)
    steps = symbolic_reference(spec, options=opts, do=do, dht=dht, method="steps", **inp)
    for name in ("o", "final_state") + GRADS:
        assert (full[name] is None) == (steps[name] is None), name
        if full[name] is not None:
            assert_close(full[name], steps[name], TOL, name)


def test_full_differentiation_with_every_option(rng):
    spec = SPECS[2]                                               # additive_key
    opts = all_options(spec)
    inp = random_inputs(spec, opts, 1, 2, 1, 2, 2, 2, rng)
    o, ht = recurrent_forward(spec, options=opts, **inp)
    do, dht = rng.standard_normal(o.shape), rng.standard_normal(ht.shape)
    full = symbolic_reference(spec, options=opts, do=do, dht=dht, method="full", **inp)
    rec = recurrent_backward(spec, options=opts, do=do, dht=dht, **inp)
    assert_close(full["o"], o, TOL, "o")
    for name in GRADS:
        if rec[name] is not None:
            assert_close(full[name], rec[name], TOL, name)


def test_symbolic_refuses_large_sizes(rng):
    spec = SPECS[3]
    inp = random_inputs(spec, Options(), 1, 2, 1, 1, 8, 2, rng)
    with pytest.raises(SpecError, match="tiny sizes"):
        symbolic_reference(spec, **inp)
    inp = random_inputs(spec, Options(), 1, 5, 1, 1, 2, 2, rng)
    with pytest.raises(SpecError, match="T <= 3"):
        symbolic_reference(spec, method="full", **inp)
