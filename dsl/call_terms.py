"""The terms a spec may add around its recurrence (OpSpec ``step``, ``value_scale``,
``skip``, ``output_gate``; dsl/spec.py), and the fp64 references of such specs.

Per token t and value head h (Mamba-2's SSD when all are on):

    step         dt = clamp(softplus?(dt_raw + dt_bias), dt_limit)       [B, T, HV]
                 g  = A dt                                              (the scalar gate)
    value_scale  v' = dt v                                              (the value written)
    recurrence   S <- exp(g) S + k v'^T;  o = S^T (scale q)             (the spec's rule)
    skip         o <- o + D v                                           (D [HV] or [HV, V])
    output_gate  o <- o * silu(z)                                       (z [B, T, HV, V])

The functions are torch, differentiable, and compute in the dtype they are given: the
references below call them in fp64, the ops layer (ops/mamba2.py) in float32 around the
generated kernels. Key heads may be shared by groups of value heads (the spec's GVA).
"""
from __future__ import annotations

from .spec import OpSpec, Options


def step(dt, dt_bias=None, dt_softplus=False, dt_limit=None):
    """dt [B, T, HV] -> clamp(softplus?(dt + dt_bias), dt_limit) (no clamp for None)."""
    import torch
    from .torch_reference import softplus_fla     # Mamba's softplus is fla's
    if dt_bias is not None:
        dt = dt + dt_bias.reshape(-1)
    if dt_softplus:
        dt = softplus_fla(dt)
    if dt_limit is not None:
        dt = torch.clamp(dt, min=float(dt_limit[0]), max=float(dt_limit[1]))
    return dt


def gate_and_value(spec: OpSpec, v, dt, A, dt_bias=None, dt_softplus=False, dt_limit=None,
                   dtype=None):
    """(v written [B, T, HV, V] in v's dtype, g [B, T, HV] in ``dtype``) of a spec with
    step 'dt': g = A dt and, with value_scale 'dt', v scaled by dt; the step and the
    product computed in ``dtype`` (default v's; the ops pass float32 with 16-bit v: one
    pass over v, rounded once)."""
    dtype = dtype or v.dtype
    s = step(dt.to(dtype), None if dt_bias is None else dt_bias.to(dtype),
             dt_softplus, dt_limit)
    g = s * A.to(dtype).reshape(-1)
    if spec.value_scale == "dt":
        v = (v * s.unsqueeze(-1)).to(v.dtype)
    return v, g


def epilogue(spec: OpSpec, o, v, D=None, z=None):
    """o + D v (skip, D [HV] or [HV, V]; None: no term), then o * silu(z) (output_gate;
    None: no gate), computed in o's dtype promoted to at least float32 (16-bit o, v, z are
    read as they are: one pass each, no widened copies)."""
    import torch
    import torch.nn.functional as F
    acc = torch.promote_types(o.dtype, torch.float32)
    if spec.skip and D is not None:
        o = torch.addcmul(o, v, D.to(acc).reshape(v.shape[2], -1))
    if spec.output_gate == "silu" and z is not None:
        o = o * F.silu(z.to(acc) if acc == torch.float64 else z)
    return o.to(acc)


def reference(spec: OpSpec, q, k, v, *, dt=None, A=None, dt_bias=None, dt_softplus=False,
              dt_limit=None, D=None, z=None, g=None, scale=None, initial_state=None,
              cu_seqlens=None, options: Options = Options(), recurrent=False):
    """fp64 forward of a spec with call terms: the step, gate and value scale, the spec's
    recurrence (dsl/torch_reference.py, chunked or token by token), then the skip and
    output gate. q, k [B, T, H, K]; v [B, T, HV, V]; dt [B, T, HV]; A, dt_bias [HV];
    states [N, HV, K, V] ([N, HV, V, K] with state_v_first). Differentiable.
    Returns (o [B, T, HV, V] fp64, final state fp64)."""
    from . import torch_reference as tr
    F64 = tr.F64
    q, k, v = (x.to(F64) for x in (q, k, v))
    ve = v
    if spec.step == "dt":
        ve, g = gate_and_value(spec, v, dt, A, dt_bias, dt_softplus, dt_limit)
    run = tr.recurrent_forward if recurrent else tr.chunked_forward
    o, ht = run(spec, q, k, ve, g, options=options, scale=scale,
                initial_state=initial_state, cu_seqlens=cu_seqlens)
    return epilogue(spec, o, v, D, z), ht


def naive_reference(spec: OpSpec, q, k, v, *, dt, A, dt_bias=None, dt_softplus=False,
                    dt_limit=None, D=None, z=None, scale=1.0, initial_state=None):
    """Mamba-2's recurrence written out step by step in fp64, for the tests: per batch
    row, token and head, h <- exp(A dt) h + (dt x) B^T in Mamba's layout h [V, K]
    (headdim x dstate), y = h C + D x, y * silu(z); heads h share key head h // (HV / H).
    No varlen; differentiable (no in-place writes). Returns (y [B, T, HV, V], final h
    [B, HV, V, K])."""
    import torch
    F64 = torch.float64
    Bn, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    grp = HV // H
    q, k, v, dt, A = (x.to(F64) for x in (q, k, v, dt, A))
    Dm = None if D is None else D.to(F64).reshape(HV, -1)
    ys, finals = [], []
    for b in range(Bn):
        hs = [torch.zeros(V, K, dtype=F64) if initial_state is None
              else initial_state[b, h].to(F64) for h in range(HV)]
        rows = []
        for t in range(T):
            outs = []
            for h in range(HV):
                d = dt[b, t, h] + (0.0 if dt_bias is None else dt_bias[h].to(F64))
                if dt_softplus:
                    d = torch.where(d > 20, d, torch.log1p(torch.exp(torch.clamp(d, max=20.0))))
                if dt_limit is not None:
                    d = torch.clamp(d, min=float(dt_limit[0]), max=float(dt_limit[1]))
                hk = h // grp
                hs[h] = (torch.exp(A[h] * d) * hs[h]
                         + torch.outer(d * v[b, t, h], k[b, t, hk]))
                out = hs[h] @ (scale * q[b, t, hk])
                if Dm is not None:
                    out = out + Dm[h] * v[b, t, h]
                if z is not None:
                    zz = z[b, t, h].to(F64)
                    out = out * zz * torch.sigmoid(zz)
                outs.append(out)
            rows.append(torch.stack(outs))
        ys.append(torch.stack(rows))
        finals.append(torch.stack(hs))
    return torch.stack(ys), torch.stack(finals)


class TermsMaths:
    """The call terms as a member of the generated kernels (codegen/members.py; pieces in
    codegen/templates/terms/<name>.py.jinja): "none" (a spec without call terms: every
    hook empty) or "step" (any of step, value_scale, skip, output_gate: the kernel takes
    their tensors and forms each term a call turns on, by trace-time flags).

    kernel_params: the kernel's tensors of the terms, after the gate's: step_A [HV] (A),
    step_bias [HV] (dt_bias), step_limit [2] (dt_limit's lo, hi), skip_D [HV, V] or [HV] (D),
    gate_z [B, T, HV, V] (z); placeholders (1,) where a call does not use them. With the
    step the gate's tensor g carries the raw dt. chunk_params: the chunked stages' (the
    same and dt_c, the step per token that chunk_prepare writes for the value scale: a
    buffer of the plan, a placeholder where the call scales no value). backward_params: the
    additive backward's dqkvg's (the step per token dt_tok [Ttot, HV], skip_D, and its
    outputs ds_part [key blocks, Ttot, HV], dD_part [NT, HV, V]; placeholders where off)."""

    def __init__(self, name: str, kernel_params: tuple = ()):
        self.name = name
        self.kernel_params = kernel_params
        self.chunk_params = kernel_params + (("dt_c",) if kernel_params else ())
        self.backward_params = (("dt_tok", "skip_D", "ds_part", "dD_part") if kernel_params
                                else ())


TERMS = {"none": TermsMaths("none"),
         "step": TermsMaths("step", ("step_A", "step_bias", "step_limit", "skip_D", "gate_z"))}


def terms_of(spec: OpSpec) -> TermsMaths:
    """The spec's call-terms member: "step" when it has any call term, else "none"."""
    on = spec.step or spec.value_scale or spec.skip or spec.output_gate
    return TERMS["step" if on else "none"]
