"""torch.library registration: each registered spec's kernels as custom ops.

``import linattn`` defines, for every family of ops/registry.py (``gdn``, ``kda``, ...):

    torch.ops.linattn.chunk_<op>                   the chunked forward (ops/chunk.py)
    torch.ops.linattn.fused_recurrent_<op>         the recurrent kernel (ops/recurrent.py)
    torch.ops.linattn.fused_recurrent_<op>_inplace the same, final states written into
                                                   initial_state (a state pool) in place

with a fake (meta) implementation each, so torch.compile(fullgraph=True) traces a model
calling linattn's public functions as one opaque op per call (their argument checks are
plain Python on shapes and dtypes and trace away), and the outputs' shapes are known
without running a kernel. Arguments are the kernels' (after ops/api.py's checks and
conversions); ``options`` is :meth:`Options.key` ("plain", "l2norm_qk-state_v_first").
The second result is the final state, or an empty f32 tensor without output_final_state.
The public functions call the ops through :func:`run`; specs outside the registry (tests,
a user's variant) run the same code without an op.
"""
from __future__ import annotations

from ..dsl import OPTION_NAMES, OpSpec, Options

NAMESPACE = "linattn"
_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? A_log, "
         "Tensor? dt_bias, Tensor{h0} initial_state, Tensor? cu_seqlens, "
         "Tensor? cu_seqlens_cpu, float scale, bool output_final_state, str options")
_POOL = ", Tensor? ssm_state_indices, Tensor? num_accepted_tokens"
#: the rule's key-shaped inputs (Comba's p), in the rule's vector_inputs order; None: none
_RULE = ", Tensor[]? rule_inputs=None"
SCHEMAS = {
    "chunk": f"({_ARGS.format(h0='?')}{_RULE}) -> (Tensor, Tensor)",
    "recurrent": f"({_ARGS.format(h0='?')}{_POOL}{_RULE}) -> (Tensor, Tensor)",
    "inplace": f"({_ARGS.format(h0='(a!)')}{_POOL}{_RULE}) -> Tensor",
}
_OPS: dict = {}      # (spec name, path) -> (spec hash, op)


def op_name(spec: OpSpec, path: str) -> str:
    return {"chunk": f"chunk_{spec.name}", "recurrent": f"fused_recurrent_{spec.name}",
            "inplace": f"fused_recurrent_{spec.name}_inplace"}[path]


def options_from_key(key: str) -> Options:
    names = () if key == "plain" else key.split("-")
    return Options(**{n: True for n in names if n in OPTION_NAMES})


def _final_or_empty(ht, q):
    import torch
    return ht if ht is not None else q.new_empty(0, dtype=torch.float32)


def _impl(spec: OpSpec, path: str):
    """The op's real implementation: the kernel entry point of its path, on arguments the
    public call checked (ops/validate.py check_call): the unchecked run_* functions."""
    def chunk(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
              scale, output_final_state, options, rule_inputs=None):
        from .chunk import run_chunk_forward
        o, ht = run_chunk_forward(spec, q, k, v, g, beta, scale=scale,
                                  initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  options=options_from_key(options), cu_seqlens=cu_seqlens,
                                  cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log,
                                  dt_bias=dt_bias, rule_inputs=rule_dict(spec, rule_inputs))
        return o, _final_or_empty(ht, q)

    def recurrent(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                  cu_seqlens_cpu, scale, output_final_state, options, ssm_state_indices,
                  num_accepted_tokens, rule_inputs=None):
        from .recurrent import run_recurrent
        o, ht = run_recurrent(spec, q, k, v, g, beta, scale=scale,
                              initial_state=initial_state,
                              output_final_state=output_final_state or path == "inplace",
                              options=options_from_key(options), cu_seqlens=cu_seqlens,
                              A_log=A_log, dt_bias=dt_bias,
                              ssm_state_indices=ssm_state_indices,
                              num_accepted_tokens=num_accepted_tokens,
                              inplace_final_state=path == "inplace",
                              rule_inputs=rule_dict(spec, rule_inputs))
        return o if path == "inplace" else (o, _final_or_empty(ht, q))
    return chunk if path == "chunk" else recurrent


def _fake(spec: OpSpec, path: str):
    """Outputs' shapes and dtypes: o [B, T, HV, V] in q's dtype; the final state f32
    [N, HV, K, V] ([N, HV, V, K] with state_v_first) or [0]."""
    import torch

    def fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
             scale, output_final_state, options, ssm_state_indices=None,
             num_accepted_tokens=None, rule_inputs=None):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        o = q.new_empty(B, T, HV, V)
        if path == "inplace":
            return o
        N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
        shape = (N, HV, V, K) if options_from_key(options).state_v_first else (N, HV, K, V)
        ht = q.new_empty(shape if output_final_state else (0,), dtype=torch.float32)
        return o, ht
    return fake


def register(spec: OpSpec) -> None:
    """Define spec's three ops (once per process and spec name)."""
    import torch
    for path, schema in SCHEMAS.items():
        if (spec.name, path) in _OPS:
            continue
        name = f"{NAMESPACE}::{op_name(spec, path)}"
        op = torch.library.custom_op(
            name, _impl(spec, path), schema=schema,
            mutates_args=("initial_state",) if path == "inplace" else ())
        op.register_fake(_fake(spec, path))
        _OPS[(spec.name, path)] = (spec.hash, getattr(getattr(torch.ops, NAMESPACE),
                                                      op_name(spec, path)))


def register_all() -> None:
    from .registry import specs
    for spec in specs().values():
        register(spec)


def run(spec: OpSpec, path: str, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
        cu_seqlens_cpu, scale: float, output_final_state: bool, options: Options, *,
        ssm_state_indices=None, num_accepted_tokens=None, inplace=False, rule_inputs=None):
    """Run one kernel path of ``spec`` through its op: (o, final state or an empty tensor).
    ``path``: "chunk" or "recurrent" (with ``inplace``: the in-place op, final = h0)."""
    path = "inplace" if inplace else path
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
            float(scale), bool(output_final_state), options.key())
    if path != "chunk":
        args += (ssm_state_indices, num_accepted_tokens)
    if rule_inputs:         # (as a list, in the rule's order: the schema's Tensor[])
        args += ([rule_inputs[n] for n in spec.rule.maths.vector_inputs],)
    entry = _OPS.get((spec.name, path))
    fn = entry[1] if entry is not None and entry[0] == spec.hash else _impl(spec, path)
    out = fn(*args)
    return (out, initial_state) if path == "inplace" else out


def rule_dict(spec: OpSpec, rule_inputs) -> dict:
    """The op's rule_inputs list (or None) as name -> tensor (the rule's vector_inputs)."""
    return dict(zip(spec.rule.maths.vector_inputs, rule_inputs or ()))
