"""Dispatch shared by the fla-named functions of every family.

``forward`` picks the kernel path for one call of a spec:

* T == 1 (one token per sequence, no cu_seqlens): the fused recurrent (decode) kernel;
* otherwise the chunked forward when the generator has chunked stages for the spec's
  rule and gate (``codegen.plan(spec, "fwd")``);
* otherwise the fused recurrent kernel over all T tokens (correct for every spec, but
  sequential in T: the chunked stages for that gate have not been generated yet).

``options_from_fla`` maps fla's keyword names onto :class:`Options`, and ``reject`` turns
keywords linattn does not implement into a clear error instead of a silent difference.
"""
from __future__ import annotations

from ..codegen.plan import plan
from ..dsl import OpSpec, Options, SpecError
from . import validate
from .recurrent import fused_recurrent  # noqa: F401 (re-exported to the wrappers)


def has_chunked_forward(spec: OpSpec) -> bool:
    return bool(plan(spec, "fwd"))


def forward(spec: OpSpec, q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
            output_final_state=False, options: Options = Options(), cu_seqlens=None,
            cu_seqlens_cpu=None, A_log=None, dt_bias=None):
    """(o, final_state or None) for ``spec``; see ops.chunk.chunk_forward for shapes.
    Not differentiable: raises when autograd would record it (DeltaNet's chunk_delta_rule
    routes such calls to ops/autograd.py first)."""
    validate.reject_grad(spec, q, k, v, g, beta, initial_state, A_log, dt_bias)
    T = q.shape[1] if getattr(q, "dim", lambda: 0)() == 4 else None
    decode = T == 1 and cu_seqlens is None
    if decode or not has_chunked_forward(spec):
        return fused_recurrent(spec, q, k, v, g, beta, scale=scale,
                               initial_state=initial_state,
                               output_final_state=output_final_state, options=options,
                               cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                               A_log=A_log, dt_bias=dt_bias)
    from .chunk import chunk_forward
    return chunk_forward(spec, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, options=options,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         A_log=A_log, dt_bias=dt_bias)


def options_from_fla(use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                     allow_neg_eigval=False, use_gate_in_kernel=False, state_v_first=False,
                     kwargs=None) -> Options:
    """fla's flag names -> Options (``transpose_state_layout`` is fla's old name for
    ``state_v_first`` and is accepted from ``kwargs``)."""
    kwargs = dict(kwargs or {})
    if "transpose_state_layout" in kwargs:
        state_v_first = bool(kwargs.pop("transpose_state_layout")) or state_v_first
    reject(kwargs)
    return Options(l2norm_qk=bool(use_qk_l2norm_in_kernel),
                   beta_sigmoid=bool(use_beta_sigmoid_in_kernel),
                   allow_neg_eigval=bool(allow_neg_eigval),
                   gate_in_kernel=bool(use_gate_in_kernel),
                   state_v_first=bool(state_v_first))


#: fla keywords that change nothing in a forward call when left at these values
_HARMLESS = {"chunk_size": (64,), "chunk_indices": (None,), "cp_context": (None,),
             "safe_gate": (False,), "lower_bound": (None,), "disable_recompute": (False,),
             "return_intermediate_states": (False,), "reverse": (False,), "gv": (None,),
             "head_first": (False,)}


def reject(kwargs: dict) -> None:
    """Raise for any keyword linattn does not implement (unless it is at a no-op value)."""
    def harmless(name, value):
        plain = value is None or isinstance(value, (bool, int, float))
        return name in _HARMLESS and plain and value in _HARMLESS[name]
    bad = {k: v for k, v in kwargs.items() if not harmless(k, v)}
    if bad:
        raise SpecError(f"linattn does not support {sorted(bad)} "
                        f"(got {', '.join(f'{k}={v!r}' for k, v in bad.items())})")
