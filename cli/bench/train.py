"""Training rows of linattn-bench (workloads.TRAIN_OPS): one step, forward + backward,
checked against fp64 reference gradients, timed whole, its peak memory recorded.

    step        o, final_state = <family's chunk function>(q, k, v, [g,] [beta,] scale,
                initial_state, output_final_state=True, cu_seqlens, flags); then
                torch.autograd.grad((o, final_state), inputs, (do, dht)): the gradients of
                loss = sum(o * do) + sum(final_state * dht) with do, dht fixed random
                tensors of the row. inputs: q, k, v, the gate g, beta, initial_state
                where the row has them (leaves requiring grad; nothing accumulates into
                .grad, so every call is the same step). Returns (o, final_state,
                dq, dk, dv, [dg,] [dbeta,] [dh0]).
    linattn     linattn.<fla name> (chunk_gated_delta_rule, chunk_kda, chunk_gla,
                chunk_delta_rule), host cu_seqlens given; a call linattn refuses (a
                SpecError: no backward for the family or the head dims) is recorded
                "not implemented: <its message>"
    fla         fla.ops.<family>.<same name>, the same arguments (no cu_seqlens_cpu)
    reference   torch.autograd of the fp64 chunked reference (dsl.torch_reference.
                chunked_forward, itself checked against the fp64 recurrence) on the row's
                own inputs, full size, on the row's device: every output and gradient
                is checked, ||x - ref|| / ||ref|| < reference.TOLERANCE (1e-2 bf16)
    peak memory torch.cuda.max_memory_allocated over one step, after the check's call
                (compiles and autotuning done), minus what was allocated before it
                (inputs, reference results): peak_mib, with held_mib (that baseline)
"""
from __future__ import annotations

import importlib

import torch

from ...dsl import torch_reference as tr
from .gaps import NotApplicable, NotImplementedImpl
from .inputs import row_options

F64 = torch.float64

FAMILY = {"GDNTrain": "gdn", "KDATrain": "kda", "GLATrain": "gla", "DeltaNetTrain": "deltanet"}
#: op -> (function name in linattn and in fla.ops.<module>, that module)
CALLS = {"GDNTrain": ("chunk_gated_delta_rule", "gated_delta_rule"),
         "KDATrain": ("chunk_kda", "kda"), "GLATrain": ("chunk_gla", "gla"),
         "DeltaNetTrain": ("chunk_delta_rule", "delta_rule")}
#: differentiable input -> the name of its gradient, in the step's order
GRAD_OF = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
FLAGS = ("use_qk_l2norm_in_kernel",)


def grad_inputs(row) -> list[str]:
    """The row's differentiable inputs, in GRAD_OF's order."""
    return [n for n in GRAD_OF if n in row.tensors]


def output_names(row) -> list[str]:
    return ["o", "final_state"] + [GRAD_OF[n] for n in grad_inputs(row)]


def reference(row, x: dict) -> dict:
    """name -> fp64 tensor: o, final_state and every gradient of the step (autograd of
    the fp64 chunked reference on the row's inputs)."""
    from ...ops.registry import get_spec
    names = grad_inputs(row)
    leaves = {n: x[n].detach().to(F64).requires_grad_() for n in names}
    with torch.enable_grad():
        o, ht = tr.chunked_forward(
            get_spec(FAMILY[row.op]), leaves["q"], leaves["k"], leaves["v"], leaves.get("g"),
            leaves.get("beta"), options=row_options(row), scale=row.options.get("scale"),
            initial_state=leaves.get("initial_state"), cu_seqlens=x.get("cu_seqlens"))
        grads = torch.autograd.grad((o, ht), [leaves[n] for n in names],
                                    (x["do"].to(F64), x["dht"].to(F64)))
    out = {"o": o.detach(), "final_state": ht.detach()}
    out.update({GRAD_OF[n]: gr for n, gr in zip(names, grads)})
    return out


def function(impl: str, op: str):
    """The chunk function an implementation trains through (tests replace it)."""
    name, module = CALLS[op]
    if impl == "linattn":
        import linattn
        return getattr(linattn, name)
    if impl == "fla":
        return getattr(importlib.import_module(f"fla.ops.{module}"), name)
    raise NotApplicable(f"{impl} has no training step")


def make(impl: str, row, x: dict):
    """(fn, outputs) of an implementation's training step (impls.make's contract)."""
    f = function(impl, row.op)
    kw = {"scale": row.options.get("scale"), "output_final_state": True}
    kw.update({n: True for n in FLAGS if row.options.get(n)})
    if "cu_seqlens" in x:
        kw["cu_seqlens"] = x["cu_seqlens"]
        if impl == "linattn":
            kw["cu_seqlens_cpu"] = x["cu_seqlens_cpu"]
    fn = step(f, row, x, kw)
    if impl == "linattn":
        fn = _refusal_as_gap(fn, NotImplementedImpl)
    return fn, lambda res: dict(zip(output_names(row), res))


def step(f, row, x: dict, kw: dict):
    """The timed call: forward, then the gradients of every differentiable input."""
    names = grad_inputs(row)
    leaves = [x[n].detach().requires_grad_() for n in names]
    do, dht = x["do"], x["dht"]

    def fn():
        t = dict(zip(names, leaves))
        per_token = {n: t[n] for n in ("g", "beta") if n in t}
        o, ht = f(t["q"], t["k"], t["v"], **per_token, initial_state=t.get("initial_state"),
                  **kw)
        grads = torch.autograd.grad((o, ht), leaves, (do, dht))
        return (o.detach(), ht.detach(), *grads)
    return fn


def _refusal_as_gap(fn, gap):
    from ...dsl import SpecError

    def guarded():
        try:
            return fn()
        except SpecError as e:
            raise gap(f"{type(e).__name__}: {e}") from None
    return guarded


def peak_memory(fn) -> dict:
    """Peak memory of one call above what is allocated before it (MiB; CUDA only)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return {"peak_mib": (peak - base) / 2 ** 20, "held_mib": base / 2 ** 20}
