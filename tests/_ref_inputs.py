"""Shared pieces of the reference tests: option sets per spec, sizes, error measure."""
import numpy as np
import pytest

from linattn.dsl import Options, all_rule_gate_specs

SPECS = all_rule_gate_specs()


def option_sets(spec):
    """(id, Options): plain, each supported option alone, and all of them together."""
    sets = [("plain", Options())]
    for name in sorted(spec.supports):
        kw = {name: True}
        if name == "allow_neg_eigval":
            kw["beta_sigmoid"] = True     # allow_neg_eigval needs beta_sigmoid
        sets.append((name, Options(**kw)))
    sets.append(("all", Options(**{n: True for n in spec.supports})))
    return sets


def spec_option_params():
    return [pytest.param(spec, opts, id=f"{spec.name}-{oid}")
            for spec in SPECS for oid, opts in option_sets(spec)]


def all_options(spec):
    return Options(**{n: True for n in spec.supports})


def rel_err(got, want):
    """||got - want|| / ||want|| (NaN never passes)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = np.linalg.norm(want)
    return np.linalg.norm(got - want) / (scale if scale > 0 else 1.0)


def assert_close(got, want, tol, what=""):
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"

