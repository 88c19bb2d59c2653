"""Implementations per row: each maker returns (fn, outputs): fn() is the timed call (any
conversion an alternative needs is inside it, as the seed timed it), outputs(result) maps
its result to the reference's names and layouts (outside timing).

    linattn        our public functions (linattn.<fla name>) and the contract ops
                   (linattn.ops.contracts.<snake name>)
    fla            fla.ops, same arguments; DeltaNet chunk/recurrent ops with scale=1.0
    torch          the eager fp32 reference of the two recurrent ops
    torch-compile  torch.compile(fullgraph=True) of it
    seed           TileOPs' release (tileops 0.1.0, the seed system's own kernels), every
                   op it has, in a child process on its own TileLang (remote.py)
    flashinfer     flashinfer's GDN prefill and decode, native calls, in a child process

Training rows (GDNTrain, ...): linattn and fla only, through train.make (train.py).
"""
from __future__ import annotations

import functools

import torch

from ...dsl import torch_reference as tr
from .gaps import NotApplicable, NotImplementedImpl  # noqa: F401 (impls.<gap> for run.py)

IMPLS = ("linattn", "fla", "seed", "flashinfer", "torch", "torch-compile")
REMOTE = ("seed", "flashinfer")      # implementations run in a child process (remote.py)
CONTRACT_FN = {"DeltaNetChunkFwd": "deltanet_chunk_fwd", "DeltaNetChunkBwd": "deltanet_chunk_bwd",
               "DeltaNetRecurrentFwd": "deltanet_recurrent_fwd", "GLAChunkFwd": "gla_chunk_fwd",
               "GLAChunkBwd": "gla_chunk_bwd", "GLARecurrentFwd": "gla_recurrent_fwd"}
INFER_FN = {"DeltaNetFwd": ("chunk_delta_rule", "fused_recurrent_delta_rule", "delta_rule"),
            "GDNFwd": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gated_delta_rule"),
            "KDAFwd": ("chunk_kda", "fused_recurrent_kda", "kda"),
            "GLAFwd": ("chunk_gla", "fused_recurrent_gla", "gla")}
TORCH_OPS = ("DeltaNetRecurrentFwd", "GLARecurrentFwd")   # the torch / torch-compile columns
FLAGS = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
         "use_gate_in_kernel", "state_v_first")


def applies(impl: str, row) -> bool:
    """Whether the implementation covers the row's op at all (else make raises
    NotApplicable): the torch ones the two recurrent ops, flashinfer GDNFwd, linattn and
    fla the training rows, seed every other row."""
    if row.is_train:
        return impl in ("linattn", "fla")
    if impl in ("torch", "torch-compile"):
        return row.op in TORCH_OPS
    if impl == "flashinfer":
        return row.op == "GDNFwd"
    return True     # linattn, fla, seed: every op of the table


def make(impl: str, row, x: dict):
    if row.is_train:
        from . import train
        return train.make(impl, row, x)
    if impl in REMOTE:
        if not applies(impl, row):
            raise NotApplicable(row.op)
        from . import remote
        return remote.make(impl, row, x)
    maker = {"linattn": _linattn, "fla": _fla, "torch": _torch, "torch-compile": _torch_compile}.get(impl)
    if maker is None:
        raise ValueError(f"unknown implementation {impl!r}; valid: {', '.join(IMPLS)}")
    return maker(row, x)


def _names(names):
    return lambda res: dict(zip(names, res))


# -- inference ops (fla's API), shared by linattn and fla -----------------------------------
def _infer_call(mod, row, x, native_flags=True):
    chunk_name, rec_name, _ = INFER_FN[row.op]
    decode = row.is_decode
    f = getattr(mod, rec_name if decode else chunk_name, None)
    if f is None:
        raise NotImplementedImpl(f"no {rec_name if decode else chunk_name}")
    o = row.options
    kw = {"output_final_state": True}
    if "scale" in o:
        kw["scale"] = o["scale"]
    for name in ("initial_state", "cu_seqlens", "A_log", "dt_bias"):
        if name in x:
            kw[name] = x[name]
    if "cu_seqlens_cpu" in x and not decode:
        kw["cu_seqlens_cpu"] = x["cu_seqlens_cpu"]
    for flag in FLAGS:
        if o.get(flag):
            kw[flag] = True
    q, k, v = x["q"], x["k"], x["v"]
    g, beta = x.get("g"), x.get("beta")
    convert = None
    if not native_flags and row.op == "GDNFwd" and (o.get("use_gate_in_kernel") or o.get("use_beta_sigmoid_in_kernel")):
        # the seed's fla call: raw gate and beta converted in torch inside the timed fn
        gate_raw, beta_raw = o.get("use_gate_in_kernel"), o.get("use_beta_sigmoid_in_kernel")
        neg = o.get("allow_neg_eigval")
        for flag in ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval"):
            kw.pop(flag, None)
        A_log, dt_bias = kw.pop("A_log", None), kw.pop("dt_bias", None)

        def convert(g, beta):
            if gate_raw:
                g = -A_log.float().exp() * torch.nn.functional.softplus(g.float() + dt_bias.float())
            if beta_raw:
                beta = torch.sigmoid(beta.float()) * (2.0 if neg else 1.0)
                beta = beta.to(q.dtype)
            return g, beta
    gate_kw = {"KDAFwd": "g", "GDNFwd": "g", "GLAFwd": "gk" if decode else "g"}.get(row.op)

    def fn():
        gg, bb = convert(g, beta) if convert else (g, beta)
        extra = {}
        if gate_kw:
            extra[gate_kw] = gg
        if bb is not None:
            extra["beta"] = bb
        return f(q, k, v, **extra, **kw)
    return fn, _names(("o", "final_state"))


def _linattn_module():
    import linattn
    return linattn


def _linattn(row, x):
    if row.op in INFER_FN:
        return _infer_call(_linattn_module(), row, x, native_flags=True)
    try:
        from ...ops import contracts
    except ImportError as e:
        raise NotImplementedImpl(f"linattn.ops.contracts not importable ({e})")
    name = CONTRACT_FN[row.op]
    f = getattr(contracts, name, None)
    if f is None:
        raise NotImplementedImpl(f"no linattn.ops.contracts.{name}")
    s = row.options.get("scale")
    op = row.op
    if op == "DeltaNetChunkFwd":
        return (lambda: f(x["q"], x["k"], x["v"], x["beta"])), _names(("o", "S", "Aw", "Au", "w", "u"))
    if op == "DeltaNetChunkBwd":
        args = [x[n] for n in ("do", "q", "k", "v", "beta", "S", "Aw", "Au", "w", "u")]
        return (lambda: f(*args)), _names(("dq", "dk", "dv", "dbeta"))
    if op == "DeltaNetRecurrentFwd":
        return (lambda: f(x["q"], x["k"], x["v"], x["beta"], x["state"])), _names(("o", "state"))
    if op == "GLARecurrentFwd":
        return (lambda: f(x["q"], x["k"], x["v"], x["gk"], x["state"], scale=s)), _names(("o", "state"))
    if op == "GLAChunkFwd":
        return ((lambda: f(x["q"], x["k"], x["v"], x["g"], scale=s, initial_state=x.get("initial_state"))),
                _names(("o", "final_state", "h")))
    if op == "GLAChunkBwd":
        args = [x[n] for n in ("q", "k", "v", "g", "h", "do", "dht")]
        return (lambda: f(*args, scale=s)), _names(("dq", "dk", "dv", "dg"))
    raise NotApplicable(op)


def _fla_module(sub):
    import importlib
    return importlib.import_module(f"fla.ops.{sub}")


def _fla(row, x):
    op, s = row.op, row.options.get("scale")
    if op in INFER_FN:
        return _infer_call(_fla_module(INFER_FN[op][2]), row, x, native_flags=False)
    if op in ("DeltaNetChunkFwd", "DeltaNetChunkBwd"):
        chunk_delta_rule = _fla_module("delta_rule").chunk_delta_rule
        q, k, v = (x[n].transpose(1, 2).contiguous() for n in ("q", "k", "v"))   # BTHK, untimed
        beta = x["beta"].transpose(1, 2).contiguous()
        if op == "DeltaNetChunkFwd":
            fn = lambda: chunk_delta_rule(q, k, v, beta, scale=1.0)  # noqa: E731
            return fn, lambda res: {"o": res[0].transpose(1, 2)}
        ins = [t.detach().requires_grad_(True) for t in (q, k, v, beta)]
        o, _ = chunk_delta_rule(*ins, scale=1.0)
        do = x["do"].transpose(1, 2).contiguous()
        fn = lambda: torch.autograd.grad(o, ins, do, retain_graph=True)  # noqa: E731
        return fn, lambda res: {n: t.transpose(1, 2) for n, t in zip(("dq", "dk", "dv", "dbeta"), res)}
    if op == "DeltaNetRecurrentFwd":
        f = _fla_module("delta_rule").fused_recurrent_delta_rule
        st = x["state"]

        def fn():
            o, ht = f(x["q"].unsqueeze(1), x["k"].unsqueeze(1), x["v"].unsqueeze(1), x["beta"].unsqueeze(1),
                      scale=1.0, initial_state=st.float(), output_final_state=True)
            return o, ht.to(st.dtype)
        return fn, lambda res: {"o": res[0][:, 0], "state": res[1]}
    if op == "GLARecurrentFwd":
        f = _fla_module("gla").fused_recurrent_gla
        st = x["state"]

        def fn():
            o, ht = f(x["q"].unsqueeze(1), x["k"].unsqueeze(1), x["v"].unsqueeze(1), gk=x["gk"].unsqueeze(1),
                      scale=s, initial_state=st, output_final_state=True)
            return o, ht.to(st.dtype)
        return fn, lambda res: {"o": res[0][:, 0], "state": res[1]}
    chunk_gla = _fla_module("gla").chunk_gla
    if op == "GLAChunkFwd":
        fn = lambda: chunk_gla(x["q"], x["k"], x["v"], x["g"], scale=s,  # noqa: E731
                               initial_state=x.get("initial_state"), output_final_state=True)
        return fn, _names(("o", "final_state"))
    if op == "GLAChunkBwd":   # the seed's baseline: fp32 upcasts, forward untimed
        ins = [x[n].float().detach().requires_grad_(True) for n in ("q", "k", "v", "g")]
        o, ht = chunk_gla(*ins, scale=s, initial_state=x["h"][:, 0].contiguous(), output_final_state=True)
        do, dht = x["do"].float(), x["dht"].float()
        fn = lambda: torch.autograd.grad((o, ht), ins, (do, dht), retain_graph=True)  # noqa: E731
        return fn, _names(("dq", "dk", "dv", "dg"))
    raise NotApplicable(op)


def _eager_step(row):
    s = row.options.get("scale")
    if row.op == "DeltaNetRecurrentFwd":
        return lambda q, k, v, b, st: tr.deltanet_recurrent_fwd(q, k, v, b, st, compute_dtype=torch.float32)
    if row.op == "GLARecurrentFwd":
        return lambda q, k, v, g, st: tr.gla_recurrent_fwd(q, k, v, g, st, scale=s, compute_dtype=torch.float32)
    raise NotApplicable(row.op)


def _step_args(row, x):
    gate = "beta" if row.op == "DeltaNetRecurrentFwd" else "gk"
    return [x[n] for n in ("q", "k", "v", gate, "state")]


def _torch(row, x):
    step, args = _eager_step(row), _step_args(row, x)
    return (lambda: step(*args)), _names(("o", "state"))


@functools.lru_cache(maxsize=None)
def _compiled(op, scale):
    class _R:
        pass
    r = _R()
    r.op, r.options = op, ({"scale": scale} if scale is not None else {})
    return torch.compile(_eager_step(r), fullgraph=True)


def _torch_compile(row, x):
    _eager_step(row)  # NotApplicable for other ops
    step, args = _compiled(row.op, row.options.get("scale")), _step_args(row, x)
    return (lambda: step(*args)), _names(("o", "state"))
