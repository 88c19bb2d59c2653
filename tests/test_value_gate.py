"""The value gate (fla's gv) past the references, on CPU: what the generator plans and
renders for it, and the public path (fused_recurrent_gla(..., gv=...)) up to the kernel.
The kernel itself compiles in tests/test_compile.py (-k "additive_value or value_gate")
and runs on a GPU in tests/test_decode_gpu.py (-k additive_value)."""
import pytest

from linattn.codegen import plan, render_stage
from linattn.dsl import value_gate_spec

SPEC = value_gate_spec()


def test_plan_has_only_the_recurrent_stage():
    """No chunked stage implements the value gate yet: none may be planned for it."""
    assert [s.name for s in plan(SPEC, None, "sm90")] == ["recurrent"]
    assert plan(SPEC, "fwd", "sm90") == [] and plan(SPEC, "bwd", "sm90") == []


def test_recurrent_renders_the_column_decay():
    (stage,) = plan(SPEC, "decode", "sm90")
    text = render_stage(SPEC, stage, "sm90")
    assert "g_shape = (B, Tlen, HV, V)" in text
    assert "dt_bias_shape = (HV * V,)" in text
    assert "S[i, j] = S[i, j] * decay_v[j]" in text
    assert "decay_k" not in text
