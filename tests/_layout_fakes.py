"""fp64 emulators of the training layout kernels (chunk_bwd_gather / chunk_bwd_scatter),
positional in the kernels' argument order, writing their outputs in place, each value
rounded to the output's dtype once as the kernels do."""
import torch

from linattn.dsl import torch_reference as tr

F64 = torch.float64
STAGES = ("chunk_bwd_gather", "chunk_bwd_scatter")


def _rows(row_map):
    idx = row_map.long()
    return idx.clamp(min=0), idx >= 0


def _take(x, row_map):
    """x [1, TT, Hx, D] -> [N, Hx, L, D] fp64 (0 on padding rows)."""
    idx, valid = _rows(row_map)
    return (x[0][idx].to(F64) * valid[..., None, None]).transpose(1, 2)


def gather(q, k, v, do, row_map, scale, qh, kh, vh, doh, *, l2norm, G):
    for x, dst in ((q, qh), (k, kh)):
        y = _take(x, row_map)
        dst.copy_((tr.l2norm(y) if l2norm else y).repeat_interleave(G, 1))
    vh.copy_(_take(v, row_map))
    doh.copy_(_take(do, row_map) * scale)


def scatter(dqh, dkh, dvh, q, k, row_map, dq, dk, dv, *, l2norm, G):
    idx, valid = _rows(row_map)
    tok = idx[valid]
    for dxh, x, dst in ((dqh, q, dq), (dkh, k, dk)):
        N, HV, L, K = dxh.shape
        dy = dxh.to(F64).view(N, HV // G, G, L, K).sum(2)
        if l2norm:
            xf = _take(x, row_map)
            r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + tr.L2NORM_EPS)
            dy = r * dy - xf * r ** 3 * (xf * dy).sum(-1, keepdim=True)
        dst[0][tok] = dy.transpose(1, 2)[valid].to(dst.dtype)
    dv[0][tok] = dvh.transpose(1, 2)[valid].to(dv.dtype)


def body(stage, params):
    """The emulator of a layout stage at its build() params."""
    fn = {"chunk_bwd_gather": gather, "chunk_bwd_scatter": scatter}[stage]
    kw = dict(l2norm=bool(params.get("l2norm")), G=params["HV"] // params["H"])
    return lambda *args: fn(*args, **kw)


def forward_states(h, cu, T, dtype):
    """The fp64 reference's states entering each chunk (torch_reference.chunked_forward's
    intermediates h [B', NC', HV, K, V]) in the training forward's layout [NT, HV, K, V]
    (chunk_forward's save_states: sequence by sequence, its chunks in order; the
    reference's row of an empty sequence dropped), rounded once to dtype as the kernels
    store them."""
    C = 64
    if cu is None:
        rows = h[:, :-(-T // C)].reshape(-1, *h.shape[2:])
    else:
        parts, c = [], 0
        for a, b in zip(cu[:-1], cu[1:]):
            n = -(-(b - a) // C)
            parts.append(h[0, c:c + n])
            c += max(n, 1)
        rows = torch.cat(parts)
    return rows.to(dtype).contiguous()
