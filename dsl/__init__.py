"""The spec DSL and the references derived from it."""
from .spec import (Gate, HeadMap, OpSpec, Options, Rule, SpecError, StateLayout,
                   all_rule_gate_specs, key_twin, value_gate_spec, OPTION_NAMES)
from .preprocess import Prepared, prepare, prepare_vjp
from .recurrent import random_inputs, recurrent_backward, recurrent_forward
from .chunked import chunked_forward
from .chunked_bwd import chunked_backward


def __getattr__(name):
    """symbolic_reference on first use (importing sympy is slow)."""
    if name == "symbolic_reference":
        from .symbolic import symbolic_reference
        return symbolic_reference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Gate", "HeadMap", "OpSpec", "Options", "Rule", "SpecError", "StateLayout",
           "all_rule_gate_specs", "key_twin", "value_gate_spec", "OPTION_NAMES",
           "Prepared", "prepare", "prepare_vjp",
           "random_inputs", "recurrent_forward", "recurrent_backward", "chunked_forward",
           "chunked_backward", "symbolic_reference"]
