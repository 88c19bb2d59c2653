"""``linattn.build(spec)``: the fla-style functions of any spec, a user's new variant included.

    from linattn import OpSpec, build
    SIMPLE_GLA = OpSpec(name="simple_gla_user", rule="additive", gate="scalar",
                        supports={"l2norm_qk"})
    ops = build(SIMPLE_GLA)
    o, ht = ops.chunk(q, k, v, g, output_final_state=True)              # prefill
    o, ht = ops.fused_recurrent(q1, k1, v1, g1, initial_state=ht,       # decode
                                output_final_state=True)

Shapes (fla's layout; HV % H == 0, HV == H unless the spec has ``gva``):

    q, k           [B, T, H, K]     float16 / bfloat16
    v              [B, T, HV, V]    q's dtype
    g              [B, T, HV]       gate "scalar": natural-log decay per value head
                                    (not an argument when the spec fixes ``decay``)
                   [B, T, HV, K]    gate "key": natural-log decay per key channel
                                    (no g for gate "none"; raw, with A_log [HV] and
                                    dt_bias [HV] / [HV * K], under use_gate_in_kernel)
    beta           [B, T, HV]       rule "delta" only (fused_recurrent: None means ones)
    initial_state  [N, HV, K, V]    ([N, HV, V, K] with state_v_first), read as float32;
                                    N = B, or len(cu_seqlens) - 1 (then B == 1)
    returns        (o [B, T, HV, V] in q's dtype, final state float32 or None)

Each function's signature holds only what the spec has: g with a gate, beta with the
delta rule, the fla option keywords the spec ``supports`` (use_qk_l2norm_in_kernel,
use_beta_sigmoid_in_kernel, allow_neg_eigval, use_gate_in_kernel with A_log / dt_bias,
state_v_first). ``chunk`` takes the chunked forward (one token per sequence: the decode
kernel); ``fused_recurrent`` the token-by-token kernel for any T. Specs outside the
registry are rendered on first use into ``ops.runtime.gen_dir()`` and compiled there.

Gradients: a spec with DeltaNet's, Gated DeltaNet's or KDA's mathematics (rule "delta", gate
"none", "scalar" or "key", chunk size 64) trains through ``chunk`` (the generated backward,
ops/autograd.py), and so does the additive rule with any gate (ops/additive_bwd.py);
``fused_recurrent`` of such a spec trains as ``chunk`` (the same function of its inputs);
every other call whose inputs need gradients trains exactly in torch (ops/exact_train.py:
the spec's chunked algorithm in fp64 under torch.autograd).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from ..dsl import Gate, OpSpec, Rule, SpecError
from ..dsl.spec import OPTION_NAMES
from . import api
from .api import has_backward
from .inputs import ones_beta

#: Options field -> fla's keyword for it
FLA_OPTION = {"l2norm_qk": "use_qk_l2norm_in_kernel",
              "beta_sigmoid": "use_beta_sigmoid_in_kernel",
              "allow_neg_eigval": "allow_neg_eigval", "gate_in_kernel": "use_gate_in_kernel",
              "state_v_first": "state_v_first"}


@dataclass(frozen=True)
class Ops:
    """The functions of one spec (see the module docstring for shapes)."""
    spec: OpSpec
    chunk: Callable
    fused_recurrent: Callable
    has_backward: bool


def build(spec: OpSpec) -> Ops:
    """The chunked and fused-recurrent functions of ``spec``, with fla's arguments.

    ``ops.chunk(q, k, v[, g][, beta], scale=None, initial_state=None,
    output_final_state=False, *, <supported options>, cu_seqlens=None,
    cu_seqlens_cpu=None)`` and ``ops.fused_recurrent`` (same arguments) each return
    (o [B, T, HV, V], final_state or None); shapes in the module docstring. Nothing is
    rendered or compiled until a call.
    """
    if not isinstance(spec, OpSpec):
        raise SpecError(f"build() takes an OpSpec, got {type(spec).__name__}")
    if spec.rule.maths.vector_inputs:
        raise SpecError(f"build() takes the additive and delta rules; the {spec.rule.value} "
                        f"rule's functions are linattn's chunk_{spec.rule.value} and "
                        f"fused_recurrent_{spec.rule.value}")
    return Ops(spec=spec, chunk=_function(spec, recurrent=False),
               fused_recurrent=_function(spec, recurrent=True),
               has_backward=has_backward(spec))


def signature(spec: OpSpec, recurrent: bool) -> inspect.Signature:
    """The parameters of ``spec``'s functions: only what the spec has."""
    P = inspect.Parameter
    pos = ["q", "k", "v"] + ["g"] * spec.gate_is_input
    params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in pos]
    if spec.has_beta:
        params.append(P("beta", P.POSITIONAL_OR_KEYWORD,
                        **({"default": None} if recurrent else {})))
    params += [P("scale", P.POSITIONAL_OR_KEYWORD, default=None),
               P("initial_state", P.POSITIONAL_OR_KEYWORD, default=None),
               P("output_final_state", P.POSITIONAL_OR_KEYWORD, default=False)]
    params += [P(FLA_OPTION[n], P.KEYWORD_ONLY, default=False)
               for n in OPTION_NAMES if n in spec.supports]
    if "gate_in_kernel" in spec.supports:
        params += [P("A_log", P.KEYWORD_ONLY, default=None),
                   P("dt_bias", P.KEYWORD_ONLY, default=None)]
    params += [P("cu_seqlens", P.KEYWORD_ONLY, default=None),
               P("cu_seqlens_cpu", P.KEYWORD_ONLY, default=None),
               P("kwargs", P.VAR_KEYWORD)]
    return inspect.Signature(params)


def _function(spec: OpSpec, recurrent: bool) -> Callable:
    sig = signature(spec, recurrent)
    kind = "fused_recurrent" if recurrent else "chunk"

    def fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return _call(spec, recurrent, dict(bound.arguments))

    fn.__name__ = fn.__qualname__ = f"{kind}_{spec.name}"
    fn.__signature__ = sig
    fn.__doc__ = (f"{'Token-by-token (any T)' if recurrent else 'Chunked'} forward of "
                  f"{spec.name} ({spec.key}): rule {spec.rule.value}, gate "
                  f"{spec.gate.value}; g {_shape(spec)}. See linattn.ops.build for shapes."
                  + (f"\n\n{spec.doc}" if spec.doc else ""))
    return fn


def _shape(spec: OpSpec) -> str:
    if spec.decay:
        return f"fixed by the spec (log decay {spec.decay} per head)"
    return {Gate.NONE: "none", Gate.SCALAR: "[B, T, HV]", Gate.KEY: "[B, T, HV, K]",
            Gate.VALUE: "[B, T, HV, V]"}[spec.gate]


def _call(spec: OpSpec, recurrent: bool, a: dict):
    """One call: keywords -> Options, then the dispatch of ops/api.py (or autograd)."""
    extra = a.pop("kwargs")
    for name in ("g", "gk", "gv", "g_gamma", "beta", "A_log", "dt_bias", *FLA_OPTION.values()):
        if name in extra:
            raise SpecError(f"{spec.name} ({spec.key}, supports "
                            f"{sorted(spec.supports) or 'no options'}) takes no {name}")
    if extra.pop("chunk_size", spec.chunk_size) != spec.chunk_size:
        raise SpecError(f"{spec.name} is built for chunk_size {spec.chunk_size}")
    flags = {n: a.pop(FLA_OPTION[n], False) for n in OPTION_NAMES}
    opts = spec.check_options(api.fla_options(
        flags["l2norm_qk"], flags["beta_sigmoid"], flags["allow_neg_eigval"],
        flags["gate_in_kernel"], flags["state_v_first"], extra,
        chunk_sizes=None if recurrent else (spec.chunk_size,)))
    q, k, v, g, beta = a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g", None), a.pop("beta", None)
    if spec.decay:
        g = fixed_gate(spec, q, v)
    if recurrent and not (has_backward(spec) and api.recurrent_trains(
            q, k, v, g, beta, a["initial_state"], a.get("A_log"), a.get("dt_bias"))):
        # (a missing beta means ones, as in fla)
        return api.recurrent(spec, q, k, v, g, beta, options=opts, beta_ones=True, **a)
    if recurrent and spec.has_beta and beta is None:    # (trains as ``chunk``)
        beta = ones_beta(q, v)
    if has_backward(spec) and spec.rule is Rule.ADDITIVE:
        from . import additive_bwd
        if additive_bwd.needs_grad(q, k, v, g, a["initial_state"], a.get("A_log"),
                                   a.get("dt_bias")):
            return additive_bwd.train(spec, opts, q, k, v, g, a["scale"], a["initial_state"],
                                      a["output_final_state"], a["cu_seqlens"],
                                      a["cu_seqlens_cpu"], a.get("A_log"), a.get("dt_bias"))
    elif has_backward(spec):
        from . import autograd
        if spec.gate in (Gate.SCALAR, Gate.KEY) and autograd.needs_grad(
                q, k, v, g, beta, a["initial_state"], a.get("A_log"), a.get("dt_bias")):
            return autograd.train(spec, opts, q, k, v, g, beta, a["scale"],
                                  a["initial_state"], a["output_final_state"],
                                  a["cu_seqlens"], a["cu_seqlens_cpu"], a.get("A_log"),
                                  a.get("dt_bias"))
        if autograd.needs_grad(q, k, v, beta, a["initial_state"]):
            return _train(spec, opts, q, k, v, beta, a)
    return api.forward(spec, q, k, v, g, beta, options=opts, **a)


def fixed_gate(spec: OpSpec, q, v):
    """g [B, T, HV] f32 of a spec whose ``decay`` fixes it (every token of value head h:
    spec.head_decay(HV)[h]), on q's device; None for inputs the validator will refuse."""
    import torch
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4
            and v.dim() == 4):
        return None
    B, T, HV = v.shape[:3]
    gamma = torch.tensor(spec.head_decay(HV), dtype=torch.float32)
    return gamma.to(q.device).view(1, 1, HV).expand(B, T, HV).contiguous()


def _train(spec: OpSpec, opts, q, k, v, beta, a: dict):
    """A differentiable call of a DeltaNet-like spec: DeltaNet's autograd Function, at
    the scale this spec gives."""
    from . import autograd, deltanet
    if not autograd.wide_heads(q, v):      # (wide ones train exactly in torch)
        autograd.check_trainable(q, k, v, beta, a["initial_state"], opts, a["cu_seqlens"])
    return deltanet.chunk_delta_rule(
        q, k, v, beta, scale=spec.scale_for(q.shape[-1], a["scale"]),
        initial_state=a["initial_state"], output_final_state=a["output_final_state"],
        use_qk_l2norm_in_kernel=opts.l2norm_qk, state_v_first=opts.state_v_first,
        cu_seqlens=a["cu_seqlens"], cu_seqlens_cpu=a["cu_seqlens_cpu"])
