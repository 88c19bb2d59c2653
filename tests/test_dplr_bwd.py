"""The dplr rule's chunked backward, staged as the kernels will run it, on the CPU.

fp64 fakes of the four stages of docs/design.md "DPLR's backward, the plan" (not yet
kernels), on the forward fakes' tiles (tests/test_chunk_dplr.py: 64-row chunks, whole-tile
loads past a sequence's end, rows masked there):

  recompute   chunk_prepare_dplr's fake, then its state pass saving h (the state entering
              each chunk, [NT, HV, K, V]) and r = w S + u ([Ttot, HV, V])
  dstate      the reverse walk per (sequence, value head): dS' (the state leaving the
              chunk's gradient) saved as dh [NT, HV, K, V]; dr = A_qb^T do + bg dS',
              dv_d = A_qk^T do + kg dS', dS <- qg^T do + w^T dr + e^g_last dS'; dh0
  dqkw        per (chunk, value head), V summed inside: dqg = do h^T, dw = dr h^T,
              dbg = r dh^T, dkg = v dh^T, dA_qb = do r^T, dA_qk = do v^T,
              dgl = e^g_last sum_v h dh
  prepare_bwd per (chunk, value head), all of K: the inverse rebuilt (the forward's
              levels), dx = T^T dw, dy = T^T du, dA_ab = dx w^T + dy u^T, dA_ak = dy v^T,
              dv = dv_d + A_ak^T dy; the four pair sums' gradients by the forward's
              bisection (two GEMMs a level: dM R~ and dM^T L~), every exponent <= 0;
              dg = revcumsum(dG + dGe) - dGe

against torch.autograd of torch_reference's chunked forward (itself checked against the
recurrence): ragged and whole lengths, initial and final states, GVA, strong decays,
K = 64 and 128. Outputs start NaN, so a row no chunk writes fails.
"""
import numpy as np
import pytest
import torch

from linattn.dsl import recurrent as R
from linattn.dsl import torch_reference as TR
from linattn.dsl.spec import Options, dplr_specs

from test_chunk_dplr import BT, HALF, LEVELS, _exp, _fake_prepare

SPECS = {s.name: s for s in dplr_specs()}


def _tile(z, t0, rows=None):
    """A whole-tile load of z[t0:t0+BT] (zeros past the end of z); rows: zeros past them."""
    out = np.zeros((BT,) + z.shape[1:])
    n = min(BT, z.shape[0] - t0)
    out[:n] = z[t0:t0 + n]
    if rows is not None:
        out[rows:] = 0
    return out


def _walks(cu, chunk_offsets):
    """(n, c, global chunk, first token, rows) of every chunk, in each sequence's order."""
    for n in range(len(cu) - 1):
        bos, seqlen = cu[n], cu[n + 1] - cu[n]
        yield n, [(c, chunk_offsets[n] + c, bos + c * BT, min(BT, seqlen - c * BT))
                  for c in range(-(-seqlen // BT))]


def _fake_state_saving(p, g_last, v, cu, offs, h0):
    """chunk_state_dplr with saved states: h [NT, HV, K, V] (entering each chunk), r."""
    Ttot, HV, V = v.shape
    h = np.full((offs[-1], HV) + h0.shape[2:], np.nan)
    r_out = np.full(v.shape, np.nan)
    for n, chunks in _walks(cu, offs):
        for hv in range(HV):
            S = h0[n, hv].copy()
            for c, gc, t0, rows in chunks:
                h[gc, hv] = S
                t = {m: _tile(p[m][:, hv], t0) for m in p}
                r = t["w"] @ S + t["u"]
                r[rows:] = 0
                vm = _tile(v[:, hv], t0, rows)
                r_out[t0:t0 + rows, hv] = r[:rows]
                S = np.exp(g_last[gc, hv])[:, None] * S + t["bg"].T @ r + t["kg"].T @ vm
    return h, r_out


def _fake_dstate(p, g_last, do, cu, offs, dht):
    """The reverse walk: dh [NT, HV, K, V] (the gradient of the state leaving each chunk),
    dr, dv_d [Ttot, HV, V], dh0 [N, HV, K, V]."""
    Ttot, HV, V = do.shape
    dh = np.full((offs[-1], HV) + dht.shape[2:], np.nan)
    dr_out, dv_out = np.full(do.shape, np.nan), np.full(do.shape, np.nan)
    dh0 = np.zeros_like(dht)
    for n, chunks in _walks(cu, offs):
        for hv in range(HV):
            dS = dht[n, hv].copy()
            for c, gc, t0, rows in reversed(chunks):
                dh[gc, hv] = dS
                t = {m: _tile(p[m][:, hv], t0) for m in ("qg", "w", "bg", "kg", "aqb", "aqk")}
                dom = _tile(do[:, hv], t0, rows)
                dr = t["aqb"].T @ dom + t["bg"] @ dS
                dr[rows:] = 0
                dv = t["aqk"].T @ dom + t["kg"] @ dS
                dr_out[t0:t0 + rows, hv], dv_out[t0:t0 + rows, hv] = dr[:rows], dv[:rows]
                dS = t["qg"].T @ dom + t["w"].T @ dr + np.exp(g_last[gc, hv])[:, None] * dS
            dh0[n, hv] = dS
    return dh, dr_out, dv_out, dh0


def _fake_dqkw(h, dh, r, v, do, dr, g_last, chunks):
    """Per (chunk, value head): the state side's gradients (V summed in the CTA)."""
    Ttot, HV, V = v.shape
    K = h.shape[2]
    outs = {n: np.full((Ttot, HV, BT if n.startswith("daq") else K), np.nan)
            for n in ("dqg", "dw", "dbg", "dkg", "daqb", "daqk")}
    dgl = np.full(g_last.shape, np.nan)
    for gc, (t0, rows) in enumerate(chunks):
        for hv in range(HV):
            H_, dH = h[gc, hv], dh[gc, hv]
            rt, vt, dot, drt = (_tile(z[:, hv], t0, rows) for z in (r, v, do, dr))
            got = dict(dqg=dot @ H_.T, dw=drt @ H_.T, dbg=rt @ dH.T, dkg=vt @ dH.T,
                       daqb=dot @ rt.T, daqk=dot @ vt.T)
            for m, val in got.items():
                outs[m][t0:t0 + rows, hv] = val[:rows]
            dgl[gc, hv] = np.exp(g_last[gc, hv]) * (H_ * dH).sum(1)
    return outs, dgl


def _levels():
    """(W, rows i, columns jr, reference r) of the forward's bisection (its formulas)."""
    x = np.arange(HALF)
    for W in LEVELS:
        yield W, x // W * 2 * W + W + x % W, x // W * 2 * W + x % W, x // W * 2 * W + W - 1


def _prepare_bwd_tile(x, d, rows, scale, seen):
    """One (chunk, value head) CTA of the prepare's backward: x the forward's input tiles
    (q, k, a, b [BT, K], v [BT, V], g [BT, K]; zeros past rows), d the gradients of its
    outputs (dqg, dw, dbg, dkg [BT, K], du, dv [BT, V] (dv: the state pass's direct part),
    daqb, daqk [BT, BT], dgl [K]). Returns dq, dk, da, db [BT, K], dv [BT, V], dg [BT, K]."""
    q, k, a, b, v, g = (x[n] for n in "qkabvg")
    G = np.cumsum(g, axis=0)
    Ge = np.concatenate([np.zeros((1, G.shape[1])), G[:-1]])    # exclusive (as the forward's)
    gl = G[rows - 1]
    # the forward's levels again: T's inverse and A_ak
    t, ak = np.zeros((BT, BT)), np.zeros((BT, BT))
    keep = lambda W: np.equal.outer(np.arange(HALF) // W, np.arange(HALF) // W)  # noqa: E731
    for W, i, jr, r in _levels():
        eb = _exp(G[r] - G[jr], seen)
        st = (a[i] * _exp(Ge[i] - G[r], seen)) @ np.concatenate([b[jr] * eb, k[jr] * eb]).T
        X, Y = np.nonzero(keep(W))
        t[i[X], jr[Y]], ak[i[X], jr[Y]] = -st[X, Y], st[X, HALF + Y]
    Tm = np.linalg.inv(np.eye(BT) + t)
    xw, y = a * _exp(Ge, seen), ak @ v
    w, u = Tm @ xw, Tm @ y
    dx, dy = Tm.T @ d["dw"], Tm.T @ d["du"]
    dab, dak = dx @ w.T + dy @ u.T, dy @ v.T          # (strictly lower: the levels' masks)
    dv = d["dv"] + ak.T @ dy
    da = _exp(Ge, seen) * dx
    dGe = xw * dx
    dec = _exp(gl - G, seen)
    dq, db, dk = scale * _exp(G, seen) * d["dqg"], dec * d["dbg"], dec * d["dkg"]
    dG = scale * q * _exp(G, seen) * d["dqg"] - b * db - k * dk
    dgl = d["dgl"] + (b * db + k * dk).sum(0)
    # the pairs' gradients, level by level: dM the quadrants' [ab ak; qb qk] gradients
    pa, pq, pb, pk = (np.zeros_like(q) for _ in range(4))
    for W, i, jr, r in _levels():
        ea, eq, eb = (_exp(Ge[i] - G[r], seen), _exp(G[i] - G[r], seen),
                      _exp(G[r] - G[jr], seen))
        Lt = np.concatenate([a[i] * ea, q[i] * eq])
        Rt = np.concatenate([b[jr] * eb, k[jr] * eb])
        m = np.tile(keep(W), (2, 2))
        dM = np.block([[dab[np.ix_(i, jr)], dak[np.ix_(i, jr)]],
                       [scale * d["daqb"][np.ix_(i, jr)], scale * d["daqk"][np.ix_(i, jr)]]]) * m
        dL, dR = dM @ Rt, dM.T @ Lt
        pa[i] += ea * dL[:HALF]
        pq[i] += eq * dL[HALF:]
        pb[jr] += eb * dR[:HALF]
        pk[jr] += eb * dR[HALF:]
    dGe += a * pa
    dG += q * pq - b * pb - k * pk
    dd = np.arange(BT)
    sqb, sqk = scale * d["daqb"][dd, dd][:, None], scale * d["daqk"][dd, dd][:, None]
    dq += pq + sqb * b + sqk * k                       # the diagonals: no exponent
    da += pa
    db += pb + sqb * q
    dk += pk + sqk * q
    dG[rows - 1] += dgl
    dg = np.cumsum((dG + dGe)[::-1], axis=0)[::-1] - dGe
    return dict(dq=dq, dk=dk, da=da, db=db, dv=dv, dg=dg)


def _fake_prepare_bwd(x, d, chunks, HV, scale, seen):
    """The prepare's backward grid: per (chunk, value head); dq, dk, da, db per value head
    ([Ttot, HV, K]; the host sums each key head's group), dv [Ttot, HV, V], dg."""
    Ttot, H, K = x["q"].shape
    g = np.zeros((Ttot, HV, K)) if x.get("g") is None else x["g"]
    outs = {n: np.full((Ttot, HV, x["v"].shape[-1] if n == "dv" else K), np.nan)
            for n in ("dq", "dk", "da", "db", "dv", "dg")}
    for gc, (t0, rows) in enumerate(chunks):
        for hv in range(HV):
            hk = hv // (HV // H)
            xt = {n: _tile(z[:, hk], t0, rows) for n, z in x.items() if n in "qkab"}
            xt.update(v=_tile(x["v"][:, hv], t0, rows), g=_tile(g[:, hv], t0, rows))
            dt = {n: _tile(z[:, hv], t0, rows) for n, z in d.items() if n != "dgl"}
            dt["dgl"] = d["dgl"][gc, hv]
            got = _prepare_bwd_tile(xt, dt, rows, scale, seen)
            for n, val in got.items():
                outs[n][t0:t0 + rows, hv] = val[:rows]
    return outs


def staged_backward(x, do, dht, lens, HV, scale, seen):
    """The four stages on flat inputs (x: q, k, a, b [Ttot, H, K], v [Ttot, HV, V], g
    [Ttot, HV, K] or None, initial_state [N, HV, K, V]): the gradients by name."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    chunks = [(cu[n] + c * BT, min(BT, lens[n] - c * BT)) for n in range(len(lens))
              for c in range(-(-lens[n] // BT))]
    offs = np.concatenate([[0], np.cumsum([-(-n // BT) for n in lens])])
    p, g_last = _fake_prepare(x, chunks, HV, scale, seen)
    h, r = _fake_state_saving(p, g_last, x["v"], cu, offs, x["initial_state"])
    dh, dr, dv_d, dh0 = _fake_dstate(p, g_last, do, cu, offs, dht)
    dp, dgl = _fake_dqkw(h, dh, r, x["v"], do, dr, g_last, chunks)
    d = dict(dqg=dp["dqg"], dw=dp["dw"], dbg=dp["dbg"], dkg=dp["dkg"], du=dr, dv=dv_d,
             daqb=dp["daqb"], daqk=dp["daqk"], dgl=dgl)
    out = _fake_prepare_bwd(x, d, chunks, HV, scale, seen)
    H = x["q"].shape[1]
    for n in "qkab":                                   # the host's GVA sum
        z = out.pop("d" + n)
        out["d" + n] = z.reshape(z.shape[0], H, HV // H, -1).sum(2)
    if x.get("g") is None:
        out.pop("dg")
    out["dinitial_state"] = dh0
    return out


def _reference_grads(spec, x, do, dht, scale):
    t = {n: None if z is None else torch.tensor(z, requires_grad=n not in ("cu_seqlens",))
         for n, z in x.items()}
    o, ht = TR.chunked_forward(spec, scale=scale, **t)
    (o * torch.tensor(do)).sum().add((ht * torch.tensor(dht)).sum()).backward()
    return {"d" + n: z.grad.numpy() for n, z in t.items()
            if z is not None and z.requires_grad}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("lens,K", [((3, 70, 200), 64), ((64, 128, 1), 64), ((130,), 128)],
                         ids=["ragged-K64", "whole-K64", "one-K128"])
def test_staged_backward_matches_autograd(name, lens, K):
    spec, rng = SPECS[name], np.random.default_rng(11)
    H, HV, V = 2, 4, 32
    cu = np.concatenate([[0], np.cumsum(lens)])
    x = R.random_inputs(spec, Options(), 1, int(cu[-1]), H, HV, K, V, rng, cu_seqlens=cu)
    if x.get("g") is not None:
        x["g"] = x["g"] * 4.0                         # strong decays
    scale = K ** -0.5
    do = rng.standard_normal(x["v"].shape[1:])
    dht = rng.standard_normal(x["initial_state"].shape)
    seen = []
    flat = {n: None if x[n] is None else x[n][0] for n in "qkabvg"}
    flat["initial_state"] = x["initial_state"]
    got = staged_backward(flat, do, dht, lens, HV, scale, seen)
    assert max(seen) <= 0.0                           # no exponential of a positive number
    ref = _reference_grads(spec, {n: x[n] for n in ("q", "k", "v", "g", "a", "b",
                                                      "initial_state", "cu_seqlens")},
                           do[None], dht, scale)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for n, z in ref.items():
        want = z[0] if n != "dinitial_state" else z
        np.testing.assert_allclose(got[n], want, atol=1e-9, rtol=1e-8, err_msg=n)
