"""Spec validation: readable errors for everything a spec or option set can get wrong."""
import pytest

from linattn.dsl import (Gate, HeadMap, OpSpec, Options, Rule, SpecError,
                         all_rule_gate_specs, value_gate_spec)
from linattn.ops import get_spec, specs


def test_families_are_registered_with_their_maths():
    table = specs()
    assert {"deltanet", "gdn", "gla", "kda", "linear_attn", "retention", "simple_gla",
            "mamba2", "lightning"} <= set(table)
    assert (table["mamba2"].rule, table["mamba2"].gate, table["mamba2"].step) == \
        (Rule.ADDITIVE, Gate.SCALAR, "dt")
    assert (table["lightning"].gate, table["lightning"].layer_decay) == (Gate.SCALAR, True)
    assert {"comba", "dplr", "gdn2", "iplr"} <= set(table)
    assert (table["dplr"].rule, table["dplr"].gate) == (Rule.DPLR, Gate.KEY)
    assert (table["iplr"].rule, table["iplr"].gate) == (Rule.DPLR, Gate.NONE)
    assert (table["comba"].rule, table["comba"].gate) == (Rule.COMBA, Gate.SCALAR)
    assert (table["gdn2"].rule, table["gdn2"].gate) == (Rule.GDN2, Gate.KEY)
    assert (table["deltanet"].rule, table["deltanet"].gate) == (Rule.DELTA, Gate.NONE)
    assert (table["gdn"].rule, table["gdn"].gate) == (Rule.DELTA, Gate.SCALAR)
    assert (table["kda"].rule, table["kda"].gate) == (Rule.DELTA, Gate.KEY)
    assert (table["gla"].rule, table["gla"].gate) == (Rule.ADDITIVE, Gate.KEY)
    assert (table["simple_gla"].rule, table["simple_gla"].gate) == (Rule.ADDITIVE, Gate.SCALAR)
    assert (table["linear_attn"].rule, table["linear_attn"].gate) == (Rule.ADDITIVE, Gate.NONE)
    assert (table["retention"].gate, table["retention"].gate_is_input) == (Gate.SCALAR, False)


def test_six_rule_gate_combinations_are_expressible():
    combos = {(s.rule, s.gate) for s in all_rule_gate_specs()}
    assert combos == {(r, g) for r in (Rule.ADDITIVE, Rule.DELTA) for g in Gate
                      if g is not Gate.VALUE}
    assert len({s.hash for s in all_rule_gate_specs()}) == 6
    assert (value_gate_spec().rule, value_gate_spec().gate) == (Rule.ADDITIVE, Gate.VALUE)


def test_unknown_op_lists_valid_ones():
    with pytest.raises(SpecError, match="valid ops: .*deltanet, .*gdn, .*gla, .*kda"):
        get_spec("mamba")


@pytest.mark.parametrize("kw, msg", [
    (dict(rule="hebbian"), "unknown rule 'hebbian'; valid: 'additive', 'delta'"),
    (dict(gate="values"), "unknown gate 'values'"),
    (dict(gate="value"), "gate 'value' needs the additive rule; the delta rule supports"),
    (dict(chunk_size=48), "chunk_size must be 16, 32 or 64"),
    (dict(supports={"l2norm"}), "unknown options"),
    (dict(gate="none", supports={"gate_in_kernel"}), "gate_in_kernel needs a gate"),
    (dict(rule="additive", supports={"beta_sigmoid"}), "beta options need the delta rule"),
    (dict(supports={"allow_neg_eigval"}), "allow_neg_eigval needs beta_sigmoid"),
    (dict(default_scale=-1.0), "default_scale"),
    (dict(name="my op"), "identifier"),
])
def test_bad_specs_raise_readable_errors(kw, msg):
    base = dict(name="x", rule="delta", gate="scalar")
    with pytest.raises(SpecError, match=msg):
        OpSpec(**{**base, **kw})


def test_head_map():
    assert HeadMap(2, 8).group == 4 and HeadMap(2, 8).key_head(5) == 1
    with pytest.raises(SpecError, match="HV % H != 0"):
        HeadMap(3, 8)
    with pytest.raises(SpecError, match="positive"):
        HeadMap(0, 8)
    with pytest.raises(SpecError, match="no GVA"):
        get_spec("gla").check_heads(2, 4)
    assert get_spec("gdn").check_heads(2, 4).group == 2


def test_options_validation_and_support():
    with pytest.raises(SpecError, match="requires use_beta_sigmoid_in_kernel"):
        Options(allow_neg_eigval=True)
    with pytest.raises(SpecError, match="must be a bool"):
        Options(l2norm_qk=1)
    with pytest.raises(SpecError, match="does not support"):
        get_spec("deltanet").check_options(Options(gate_in_kernel=True))
    gdn = get_spec("gdn")
    opts = Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True,
                   gate_in_kernel=True, state_v_first=True)
    assert gdn.check_options(opts) is opts
    assert opts.key() == "l2norm_qk-beta_sigmoid-allow_neg_eigval-gate_in_kernel-state_v_first"
    assert Options().key() == "plain"


def test_scale_and_identity():
    gdn = get_spec("gdn")
    assert gdn.scale_for(128) == pytest.approx(128 ** -0.5)
    assert gdn.scale_for(128, 0.5) == 0.5
    with pytest.raises(SpecError, match="positive"):
        gdn.scale_for(128, 0.0)
    assert gdn.key == "gdn_delta_scalar_c64"
    assert gdn.hash == gdn.replace(doc="other words").hash      # doc does not shape code
    assert gdn.hash != gdn.replace(chunk_size=32).hash
    assert gdn.gate_shape(2, 5, 4, 64) == (2, 5, 4)
    assert get_spec("kda").gate_shape(2, 5, 4, 64) == (2, 5, 4, 64)
