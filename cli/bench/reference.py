"""fp64 reference outputs per workload row (torch, on the row's device) and the check
of an implementation's outputs against them."""
from __future__ import annotations

import torch

from ...dsl import torch_reference as tr
from .inputs import row_options

F64 = torch.float64
FAMILY = {"DeltaNetFwd": "deltanet", "GDNFwd": "gdn", "KDAFwd": "kda", "GLAFwd": "gla"}
TOLERANCE = {"bf16": 1e-2, "f16": 5e-3, "f32": 1e-4}
def reference_outputs(row, x: dict) -> dict:
    """name -> fp64 tensor of every output the op's contract defines (a training row: o,
    final_state and the step's gradients, train.reference)."""
    op, scale = row.op, row.options.get("scale")
    if row.is_train:
        from .train import reference
        return reference(row, x)
    if op == "DeltaNetChunkFwd":
        return dict(zip(("o", "S", "Aw", "Au", "w", "u"),
                        tr.deltanet_chunk_fwd(x["q"], x["k"], x["v"], x["beta"])))
    if op == "DeltaNetChunkBwd":
        return dict(zip(("dq", "dk", "dv", "dbeta"),
                        tr.deltanet_chunk_bwd(x["do"], x["q"], x["k"], x["v"], x["beta"])))
    if op == "DeltaNetRecurrentFwd":
        return dict(zip(("o", "state"), tr.deltanet_recurrent_fwd(x["q"], x["k"], x["v"], x["beta"],
                                                                  x["state"])))
    if op == "GLARecurrentFwd":
        return dict(zip(("o", "state"), tr.gla_recurrent_fwd(x["q"], x["k"], x["v"], x["gk"],
                                                             x["state"], scale=scale)))
    if op == "GLAChunkFwd":
        return dict(zip(("o", "final_state", "h"),
                        tr.gla_chunk_fwd(x["q"], x["k"], x["v"], x["g"], scale=scale,
                                         initial_state=x.get("initial_state"))))
    if op == "GLAChunkBwd":
        return dict(zip(("dq", "dk", "dv", "dg"),
                        tr.gla_chunk_bwd(x["q"], x["k"], x["v"], x["g"], x["h"], x["do"], x["dht"],
                                         scale=scale)[:4]))
    from ...ops.registry import get_spec
    spec = get_spec(FAMILY[op])
    fwd = tr.recurrent_forward if row.is_decode else tr.chunked_forward
    o, ht = fwd(spec, x["q"], x["k"], x["v"], x.get("g"), x.get("beta"), options=row_options(row),
                scale=scale, initial_state=x.get("initial_state"), cu_seqlens=x.get("cu_seqlens"),
                A_log=x.get("A_log"), dt_bias=x.get("dt_bias"))
    return {"o": o, "final_state": ht}


def check(outputs: dict, ref: dict, dtype: str) -> tuple[bool, dict, str]:
    """Relative error ||out - ref|| / ||ref|| per output (fp64); ok when every one is
    finite and under the dtype's tolerance. Returns (ok, errors, message)."""
    tol = TOLERANCE[dtype]
    errs, bad = {}, []
    if not outputs:
        return False, {}, "no outputs to check"
    for name, out in outputs.items():
        r = ref[name]
        if tuple(out.shape) != tuple(r.shape):
            bad.append(f"{name}: shape {tuple(out.shape)} != {tuple(r.shape)}")
            continue
        d = out.to(F64)
        if not torch.isfinite(d).all():
            errs[name] = float("nan")
            bad.append(f"{name}: non-finite values")
            continue
        rn = float(r.norm())
        e = float((d - r).norm()) / (rn if rn > 0 else 1.0)
        errs[name] = e
        if not e < tol:
            bad.append(f"{name}: rel err {e:.3g} >= {tol:g}")
    return not bad, errs, "; ".join(bad)
