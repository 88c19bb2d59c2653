"""The spec DSL and the references derived from it."""
from .spec import (Gate, HeadMap, OpSpec, Options, Rule, SpecError, StateLayout,
                   all_rule_gate_specs, OPTION_NAMES)

__all__ = ["Gate", "HeadMap", "OpSpec", "Options", "Rule", "SpecError", "StateLayout",
           "all_rule_gate_specs", "OPTION_NAMES"]
