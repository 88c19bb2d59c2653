"""TileOPs' release (tileops 0.1.0) as a benchmark implementation: loaded by worker.py in
a process whose package path holds tileops and the TileLang it pins (0.1.12), never
imported by linattn. ``make`` maps a workload row to the release's op with the row's
options, called with the row's own tensors; the release's contracts are the table's
(its layouts and output tuples), so nothing is converted.

A call the release does not serve raises its OpNotAvailableError (a refusal), at the
first call, when its dispatcher sees the call.
"""
from __future__ import annotations

INFER_FLAGS = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
               "state_v_first", "use_gate_in_kernel")

try:
    from tileops.backend import OpNotAvailableError
    REFUSALS = (OpNotAvailableError,)
except ImportError:          # the worker reports the import error when make() runs
    REFUSALS = ()


def describe() -> dict:
    import tileops
    import tilelang
    return {"tileops": getattr(tileops, "__version__", "?"), "tilelang": tilelang.__version__}


def _names(*names):
    return lambda res: dict(zip(names, res))


def _flags(options: dict, allowed) -> dict:
    return {k: bool(options[k]) for k in allowed if options.get(k)}


def make(op: str, options: dict, decode: bool, x: dict):
    import tileops.linear_attention as L
    scale = options.get("scale")
    if op in ("GDNFwd", "KDAFwd"):
        kw = _flags(options, INFER_FLAGS)
        if op == "KDAFwd" and options.get("lower_bound") is not None:
            kw["lower_bound"] = options["lower_bound"]
        f = (L.GDNFwdOp if op == "GDNFwd" else L.KDAFwdOp)(scale=scale, **kw)
        args = [x[n] for n in ("q", "k", "v", "g", "beta")]
        args += [x.get(n) for n in ("initial_state", "cu_seqlens", "cu_seqlens_cpu", "A_log", "dt_bias")]
        return (lambda: f(*args)), _names("o", "final_state")
    if op in ("DeltaNetFwd", "GLAFwd"):
        if op == "DeltaNetFwd":
            f = L.DeltaNetFwdOp(scale=scale, **_flags(options, ("use_qk_l2norm_in_kernel",)))
            args = [x[n] for n in ("q", "k", "v", "beta")]
        else:
            f = L.GLAFwdOp(scale=scale)
            args = [x[n] for n in ("q", "k", "v", "g")]
        args += [x.get(n) for n in ("initial_state", "cu_seqlens", "cu_seqlens_cpu")]
        return (lambda: f(*args)), _names("o", "final_state")
    return _contract(L, op, scale, x)


def _contract(L, op: str, scale, x: dict):
    """The chunk / recurrent contracts (the table's layouts are the release's)."""
    if op == "DeltaNetChunkFwd":
        f = L.DeltaNetChunkFwdOp()
        return (lambda: f(x["q"], x["k"], x["v"], x["beta"])), _names("o", "S", "Aw", "Au", "w", "u")
    if op == "DeltaNetChunkBwd":
        f = L.DeltaNetChunkBwdOp()
        args = [x[n] for n in ("do", "q", "k", "v", "beta", "S", "Aw", "Au", "w", "u")]
        return (lambda: f(*args)), _names("dq", "dk", "dv", "dbeta")
    if op == "DeltaNetRecurrentFwd":
        f = L.DeltaNetRecurrentFwdOp()
        return (lambda: f(x["q"], x["k"], x["v"], x["beta"], x["state"])), _names("o", "state")
    if op == "GLARecurrentFwd":
        f = L.GLARecurrentFwdOp(scale=scale)
        return (lambda: f(x["q"], x["k"], x["v"], x["gk"], x["state"])), _names("o", "state")
    if op == "GLAChunkFwd":
        f = L.GLAChunkFwdOp(scale=scale)
        return (lambda: f(x["q"], x["k"], x["v"], x["g"], x.get("initial_state"))), \
            _names("o", "final_state", "h")
    if op == "GLAChunkBwd":
        f = L.GLAChunkBwdOp(scale=scale)
        args = [x[n] for n in ("do", "dht", "q", "k", "v", "g", "h")]
        return (lambda: f(*args)), _names("dq", "dk", "dv", "dg")
    raise NotImplementedError(f"the release has no op for {op}")
