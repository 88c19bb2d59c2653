"""The dplr rule's chunked backward, staged as the kernels will run it, on the CPU.

fp64 fakes of the six stages of docs/design.md "DPLR's backward, the plan" (not yet
kernels), on the forward fakes' tiles (tests/test_chunk_dplr.py: 64-row chunks, whole-tile
loads past a sequence's end, rows masked there):

  recompute   chunk_prepare_dplr's fake writing X and A_ak too, then its state pass saving
              h (the state entering each chunk, [NT, HV, K, V]) and r = w S + u
  dstate      the reverse walk per (sequence, value head): dS' (the state leaving the
              chunk's gradient) saved as dh [NT, HV, K, V]; dr = A_qb^T do + bg dS',
              dv_d = A_qk^T do + kg dS', dS <- qg^T do + w^T dr + e^g_last dS'; dh0
  dqkw        per (chunk, value head), V summed inside: dqg = do h^T, dw = dr h^T,
              dbg = r dh^T, dkg = v dh^T, dgl = e^g_last sum_v h dh
  wy          per (chunk, value head): T = X and A_ak as the recompute wrote them,
              dx = T^T dw, dy = T^T du, the pairs' gradients dM = [dx w^T + dy u^T,
              dy v^T, s do r^T, s do v^T], dv = dv_d + A_ak^T dy
  pairs       per (key block, chunk, value head): the forward's bisection run backward
              (two GEMMs a level: dM R~ and dM^T L~), the diagonals, the elementwise terms
              and dg = revcumsum(dG + dGe) - dGe; every exponent <= 0

against torch.autograd of torch_reference's chunked forward (itself checked against the
recurrence): ragged and whole lengths, initial and final states, GVA, strong decays,
K = 64 and 128. Outputs start NaN, so a row no chunk writes fails.
"""
import shutil

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
    """chunk_bwd_dqkw_dplr: per (chunk, value head; the kernel also per key block), V
    summed in the CTA: dqg = do h^T, dw = dr h^T, dbg = r dh^T, dkg = v dh^T [Ttot, HV, K]
    and dgl = e^g_last sum_v h dh [NT, HV, K]."""
    Ttot, HV, V = v.shape
    K = h.shape[2]
    outs = {n: np.full((Ttot, HV, K), np.nan) for n in ("dqg", "dw", "dbg", "dkg")}
    dgl = np.full(g_last.shape, np.nan)
    for gc, (t0, rows) in enumerate(chunks):
        for hv in range(HV):
            H_, dH = h[gc, hv], dh[gc, hv]
            rt, vt, dot, drt = (_tile(z[:, hv], t0, rows) for z in (r, v, do, dr))
            got = dict(dqg=dot @ H_.T, dw=drt @ H_.T, dbg=rt @ dH.T, dkg=vt @ dH.T)
            for m, val in got.items():
                outs[m][t0:t0 + rows, hv] = val[:rows]
            dgl[gc, hv] = np.exp(g_last[gc, hv]) * (H_ * dH).sum(1)
    return outs, dgl


def _levels():
    """(W, rows i, columns jr, reference r) of the forward's bisection (its formulas)."""
    x = np.arange(HALF)
    for W in LEVELS:
        yield W, x // W * 2 * W + W + x % W, x // W * 2 * W + x % W, x // W * 2 * W + W - 1


def _gates(g, rows):
    """G (inclusive), Ge (exclusive, the forward's G[i - 1]) and G_last of a tile."""
    G = np.cumsum(g, axis=0)
    return G, np.concatenate([np.zeros((1, G.shape[1])), G[:-1]]), G[rows - 1]


def _keep(W):
    """A level's block-diagonal mask of its [HALF, HALF] quadrant."""
    return np.equal.outer(np.arange(HALF) // W, np.arange(HALF) // W)


def _wy_tile(x, d, rows, scale):
    """One (chunk, value head) CTA of chunk_bwd_wy_dplr: x the recompute's tiles (xinv, aak
    [BT, BT], w [BT, K], u [BT, V]) and the forward's v, r, do [BT, V]; d: dw [BT, K], du
    (= dr), dv (the walk's direct part) [BT, V]; every row past len 0. Returns dx [BT, K],
    dM [BT, 4 BT] (the gradients of the pairs A_ab, A_ak, A_qb, A_qk, the scale folded in
    the last two; chunk_bwd_pairs_dplr keeps their lower triangles) and dv [BT, V]."""
    Tm, v = x["xinv"], x["v"]
    dx, dy = Tm.T @ d["dw"], Tm.T @ d["du"]
    dM = np.concatenate([dx @ x["w"].T + dy @ x["u"].T, dy @ v.T, scale * x["do"] @ x["r"].T,
                         scale * x["do"] @ v.T], axis=1)
    return dict(dx=dx, dM=dM, dv=d["dv"] + x["aak"].T @ dy)


def _pairs_tile(x, d, rows, seen):
    """One (key block, chunk, value head) CTA of chunk_bwd_pairs_dplr: x the forward's
    q, k, a, b, g [BT, BK] tiles (zeros past rows); d: dM [BT, 4 BT], dx, dqg, dbg, dkg
    [BT, BK], dgl [BK]. Returns dq, dk, da, db, dg [BT, BK]: the levels' two GEMMs dM R~
    and dM^T L~, the diagonals, the elementwise terms and dg's reverse cumsum."""
    q, k, a, b = (x[n] for n in "qkab")
    G, Ge, gl = _gates(x["g"], rows)
    dM = d["dM"]
    quad = lambda n, i, j: dM[np.ix_(i, n * BT + j)]  # noqa: E731
    pa, pq, pb, pk = (np.zeros_like(q) for _ in range(4))
    for W, i, jr, r in _levels():
        ea, eq, eb = (_exp(Ge[i] - G[r], seen), _exp(G[i] - G[r], seen),
                      _exp(G[r] - G[jr], seen))
        Lt = np.concatenate([a[i] * ea, q[i] * eq])
        Rt = np.concatenate([b[jr] * eb, k[jr] * eb])
        dL_ = np.block([[quad(0, i, jr), quad(1, i, jr)],
                        [quad(2, i, jr), quad(3, i, jr)]]) * np.tile(_keep(W), (2, 2))
        dL, dR = dL_ @ Rt, dL_.T @ Lt
        pa[i] += ea * dL[:HALF]
        pq[i] += eq * dL[HALF:]
        pb[jr] += eb * dR[:HALF]
        pk[jr] += eb * dR[HALF:]
    dd = np.arange(BT)
    sqb, sqk = dM[dd, 2 * BT + dd][:, None], dM[dd, 3 * BT + dd][:, None]
    dec = _exp(gl - G, seen)
    db_d, dk_d = dec * d["dbg"], dec * d["dkg"]
    out = dict(dq=x["scale"] * _exp(G, seen) * d["dqg"] + pq + sqb * b + sqk * k,
               da=_exp(Ge, seen) * d["dx"] + pa, db=db_d + pb + sqb * q, dk=dk_d + pk + sqk * q)
    # the gate: each factor's exponent is +-G or Ge, and the diagonals' terms cancel
    dGe = a * out["da"]
    dG = q * out["dq"] - b * out["db"] - k * out["dk"]
    dG[rows - 1] += d["dgl"] + (b * db_d + k * dk_d).sum(0)
    out["dg"] = np.cumsum((dG + dGe)[::-1], axis=0)[::-1] - dGe
    return out


def _fake_wy(p, v, r, do, d, chunks, HV, scale):
    """chunk_bwd_wy_dplr's grid: per (chunk, value head), p the recompute's outputs (xinv,
    aak, w, u); dx [Ttot, HV, K], dM [Ttot, HV, 4 BT], dv [Ttot, HV, V]."""
    Ttot, _, K = p["w"].shape
    outs = {n: np.full((Ttot, HV, m), np.nan) for n, m in (("dx", K), ("dM", 4 * BT),
                                                            ("dv", v.shape[-1]))}
    for t0, rows in chunks:
        for hv in range(HV):
            xt = {n: _tile(p[n][:, hv], t0, rows) for n in ("xinv", "aak", "w", "u")}
            xt.update({n: _tile(z[:, hv], t0, rows) for n, z in (("v", v), ("r", r),
                                                                 ("do", do))})
            got = _wy_tile(xt, {n: _tile(z[:, hv], t0, rows) for n, z in d.items()}, rows,
                           scale)
            for n, val in got.items():
                outs[n][t0:t0 + rows, hv] = val[:rows]
    return outs


def _fake_pairs(x, d, chunks, HV, scale, seen, BK=64):
    """chunk_bwd_pairs_dplr's grid: per (key block, chunk, value head); dq, dk, da, db
    [Ttot, HV, K] (the host sums each key head's group) and dg [Ttot, HV, K]."""
    Ttot, H, K = x["q"].shape
    outs = {n: np.full((Ttot, HV, K), np.nan) for n in ("dq", "dk", "da", "db", "dg")}
    for gc, (t0, rows) in enumerate(chunks):
        for hv in range(HV):
            hk = hv // (HV // H)
            for kb in range(0, K, BK):
                ks = slice(kb, kb + BK)
                xt = {n: _tile(x[n][:, hk, ks], t0, rows) for n in "qkab"}
                xt.update(g=_tile(x["g"][:, hv, ks], t0, rows), scale=scale)
                dt = {n: _tile(d[n][:, hv, ks], t0, rows) for n in ("dx", "dqg", "dbg", "dkg")}
                dt.update(dM=_tile(d["dM"][:, hv], t0, rows), dgl=d["dgl"][gc, hv, ks])
                for n, val in _pairs_tile(xt, dt, rows, seen).items():
                    outs[n][t0:t0 + rows, hv, ks] = val[:rows]
    return outs


def staged_backward(x, do, dht, lens, HV, scale, seen):
    """The six stages on flat inputs (x: q, k, a, b [Ttot, H, K], v [Ttot, HV, V], g
    [Ttot, HV, K] or None, initial_state [N, HV, K, V]): the gradients by name."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    chunks = [(cu[n] + c * BT, min(BT, lens[n] - c * BT)) for n in range(len(lens))
              for c in range(-(-lens[n] // BT))]
    offs = np.concatenate([[0], np.cumsum([-(-n // BT) for n in lens])])
    p, g_last = _fake_prepare(x, chunks, HV, scale, seen, save=True)
    h, r = _fake_state_saving(p, g_last, x["v"], cu, offs, x["initial_state"])
    dh, dr, dv_d, dh0 = _fake_dstate(p, g_last, do, cu, offs, dht)
    dp, dgl = _fake_dqkw(h, dh, r, x["v"], do, dr, g_last, chunks)
    xg = dict(x, g=np.zeros(x["v"].shape[:2] + x["q"].shape[-1:]) if x.get("g") is None
              else x["g"])
    wy = _fake_wy(p, x["v"], r, do, dict(dw=dp["dw"], du=dr, dv=dv_d), chunks, HV, scale)
    out = _fake_pairs(xg, dict(dp, dx=wy["dx"], dM=wy["dM"], dgl=dgl), chunks, HV, scale,
                      seen)
    out["dv"] = wy["dv"]
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


def _diagonal(chunks):
    """(token, its row in its chunk) of every token: the diagonals of a [Ttot, HV, BT]
    block of per-chunk pairs (chunks in token order, covering every token)."""
    i = np.concatenate([np.arange(rows) for _, rows in chunks])
    return np.arange(len(i)), i


def _fake_bwd_body(spec, stage, params):
    """fake_compiles' body: the backward stages' fakes on the plan's tensors, by name."""
    from linattn.ops import runtime
    names = runtime.arg_names(runtime.stage_module(spec, stage, "sm90").build(**params))
    f64 = lambda t: t.double().numpy()  # noqa: E731
    HV = params["HV"]

    def put(t, outs):
        for n, val in outs.items():
            t[n].copy_(torch.from_numpy(val))

    def run(*args):
        t = dict(zip(names, args))
        tab = lambda n: t[n].tolist()  # noqa: E731
        chunks = list(zip(tab("chunk_bos"), tab("chunk_len"))) if "chunk_bos" in t else None
        if stage.startswith("chunk_bwd_prepare"):
            x = {n: f64(t[n]) if n in t else None for n in "qkabvg"}
            outs, g_last = _fake_prepare(x, chunks, HV, t["scale"], [], save=True)
            put(t, dict(outs, g_last=g_last))
        elif stage == "chunk_bwd_state_dplr":
            cu, offs = tab("cu_seqlens"), tab("chunk_offsets")
            h0 = (f64(t["h0"]) if params["has_initial_state"]
                  else np.zeros((len(cu) - 1,) + tuple(t["h0"].shape[1:])))
            h, r = _fake_state_saving({n: f64(t[n]) for n in ("w", "u", "bg", "kg")},
                                      f64(t["g_last"]), f64(t["v"]), cu, offs, h0)
            put(t, dict(h=h, r=r))
        elif stage == "chunk_bwd_dstate_dplr":
            cu, offs = tab("cu_seqlens"), tab("chunk_offsets")
            dht = (f64(t["dht"]) if params["use_dht"]
                   else np.zeros((len(cu) - 1,) + tuple(t["dht"].shape[1:])))
            p = {n: f64(t[n]) for n in ("qg", "w", "bg", "kg", "aqb", "aqk")}
            dh, dr, dv, dh0 = _fake_dstate(p, f64(t["g_last"]), f64(t["do"]), cu, offs, dht)
            put(t, dict(dh=dh, dr=dr, dv_direct=dv, **({"dh0": dh0} if params["store_dh0"]
                                                         else {})))
        elif stage == "chunk_bwd_dqkw_dplr":
            outs, dgl = _fake_dqkw(*(f64(t[n]) for n in ("h", "dh", "r", "v", "do", "dr",
                                                         "g_last")), chunks)
            put(t, dict(outs, dgl=dgl))
        elif stage == "chunk_bwd_wy_dplr":
            p = {n: f64(t[n]) for n in ("xinv", "aak", "w", "u")}
            d = dict(dw=f64(t["dw"]), du=f64(t["dr"]), dv=f64(t["dv_direct"]))
            outs = _fake_wy(p, f64(t["v"]), f64(t["r"]), f64(t["do"]), d, chunks, HV,
                            t["scale"])
            tok, i = _diagonal(chunks)
            dmd = np.stack([outs["dM"][tok, :, (2 + m) * BT + i] for m in (0, 1)], -1)
            put(t, dict(dx=outs["dx"], dm=outs["dM"], dmd=dmd, dv=outs["dv"]))
        else:                                             # chunk_bwd_pairs_dplr
            x = {n: f64(t[n]) for n in "qkab"}
            Ttot, K = x["q"].shape[0], x["q"].shape[2]
            x["g"] = f64(t["g"]) if "g" in t else np.zeros((Ttot, HV, K))
            d = {n: f64(t[n]) for n in ("dx", "dqg", "dbg", "dkg")}
            d.update(dM=f64(t["dm"]), dgl=f64(t["dgl"]) if "dgl" in t
                     else np.zeros((len(chunks), HV, K)))
            tok, i = _diagonal(chunks)                    # dm in 16 bits, dmd in f32
            for m in (0, 1):
                d["dM"][tok, :, (2 + m) * BT + i] = f64(t["dmd"])[..., m]
            outs = _fake_pairs(x, d, chunks, HV, t["scale"], [])
            put(t, {n: z for n, z in outs.items() if n in t})
    return run


@pytest.mark.parametrize("name", ["dplr", "iplr"])
@pytest.mark.parametrize("HV,g_dtype", [(4, torch.float32), (2, torch.bfloat16)],
                         ids=["GVA2-gf32", "HV=H-gbf16"])
def test_plan_runs_the_backward_stages(monkeypatch, name, HV, g_dtype):
    """ops/dplr_bwd.py's dplr_backward (codegen/arch/sm90/dplr.py's dplr_bwd_plan through
    ops.runtime.run_plan): its launches' arguments match the six kernels' signatures (the
    rule's a, b bound to a_in, b_in; the outputs' dtypes the plan's) and the fakes on its
    f16 buffers give autograd's gradients of the fp64 reference: dq, dk, da, db f16 as
    the kernel stores them where HV == H, f32 where the host sums each key head's group;
    dv f16, dg in g's dtype."""
    from linattn.ops.dplr_bwd import dplr_backward
    from linattn.ops.registry import specs
    from _kernel_check import fake_compiles
    spec, rng = specs()[name], np.random.default_rng(3)
    ref_spec = SPECS[f"dplr_{spec.gate.value}"]
    H, K, V, lens = 2, 64, 32, (3, 70, 200)
    cu = np.concatenate([[0], np.cumsum(lens)])
    x = R.random_inputs(ref_spec, Options(), 1, int(cu[-1]), H, HV, K, V, rng, cu_seqlens=cu)
    h = {n: None if x[n] is None else torch.tensor(x[n][0]).half() for n in "qkabv"}
    g = None if x["g"] is None else torch.tensor(x["g"][0]).to(g_dtype)
    h0 = torch.tensor(x["initial_state"]).float()
    do = torch.tensor(rng.standard_normal((int(cu[-1]), HV, V))).half()
    dht = torch.tensor(rng.standard_normal(h0.shape)).float()
    calls = []
    fake_compiles(monkeypatch, _fake_bwd_body, calls)
    B1 = lambda z: None if z is None else z[None]  # noqa: E731
    cu_t = torch.tensor(cu, dtype=torch.int32)
    grads = dplr_backward(spec, *(B1(h[n]) for n in "qkvab"), B1(g), B1(do), scale=K ** -0.5,
                          initial_state=h0, dht=dht, cu_seqlens=cu_t, cu_seqlens_cpu=cu_t)
    prepare = "chunk_bwd_prepare_iplr" if name == "iplr" else "chunk_bwd_prepare_dplr"
    assert [s for s, _ in calls] == [prepare, "chunk_bwd_state_dplr", "chunk_bwd_dstate_dplr",
                                     "chunk_bwd_dqkw_dplr", "chunk_bwd_wy_dplr",
                                     "chunk_bwd_pairs_dplr"]
    want_dtype = dict.fromkeys(("dq", "dk", "da", "db"),
                               torch.float16 if HV == H else torch.float32)
    want_dtype.update(dv=torch.float16, dg=g_dtype, dinitial_state=torch.float32)
    assert {n: z.dtype for n, z in grads.items()} == {n: want_dtype[n] for n in grads}
    got = {n: z[0].double() if n != "dinitial_state" else z.double() for n, z in grads.items()}
    ref_x = {n: None if z is None else z.double().numpy()[None] for n, z in h.items()}
    ref_x.update(g=None if g is None else g.double().numpy()[None], cu_seqlens=cu,
                 initial_state=h0.double().numpy())
    ref = _reference_grads(ref_spec, ref_x, do.double().numpy()[None], dht.double().numpy(),
                           K ** -0.5)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for n, z in ref.items():
        want = torch.tensor(z[0] if n != "dinitial_state" else z)
        rel = ((got[n] - want).norm() / want.norm()).item()
        assert rel < 1e-2, (n, rel)


@pytest.mark.parametrize("gate", ["key", "none"])
@pytest.mark.parametrize("H,HV,dtype,g_dtype", [
    (4, 4, "bfloat16", "float32"), (4, 4, "float16", "bfloat16"), (2, 4, "bfloat16", "float32"),
    (2, 8, "float16", "float16")], ids=["HV=H-bf16", "HV=H-f16-gbf16", "GVA2", "GVA4-f16"])
def test_plan_stores_gradients_in_the_returned_dtype(gate, H, HV, dtype, g_dtype):
    """dplr_bwd_plan's outputs: dq, dk, da, db in the input dtype where HV == H (the
    caller's, so its cast is a no-op), f32 where the host sums each key head's group; dv in
    the input dtype and dg in the gate's either way (per value head, never summed); dw and
    dm in the input dtype (the next stage's GEMM operands), the other intermediates
    between stages f32 (dmd, dm's diagonals, too); chunk_bwd_pairs_dplr built with that
    grad_dtype."""
    from linattn.codegen.arch import get_arch
    from linattn.codegen.pipeline import DplrBackwardProblem
    p = DplrBackwardProblem(gate=gate, H=H, HV=HV, K=64, V=32, dtype=dtype, Ttot=273,
                            seq_chunks=(1, 2, 2), g_dtype=g_dtype)
    plan = get_arch("sm90").dplr_bwd_plan(p, {})
    bufs = {b.name: b for b in plan.buffers}
    grad = dtype if HV == H else "float32"
    outs = {"dq": grad, "dk": grad, "da": grad, "db": grad, "dv": "input"}
    if gate == "key":
        outs["dg"] = g_dtype
    assert {n: b.dtype for n, b in bufs.items() if b.output} == outs
    for n in ("dv_direct", "dqg", "dbg", "dkg", "dgl", "dx", "dmd"):
        assert bufs[n].dtype == "float32", n
    assert bufs["dw"].dtype == bufs["dm"].dtype == "input"
    pairs = {la.stage: la.kwargs for la in plan.launches}["chunk_bwd_pairs_dplr"]
    assert pairs["grad_dtype"] == grad


BWD_STAGES = ("chunk_bwd_state_dplr", "chunk_bwd_dstate_dplr", "chunk_bwd_dqkw_dplr",
              "chunk_bwd_wy_dplr", "chunk_bwd_pairs_dplr")


def _compile_cases():
    out = []
    for name in ("dplr", "iplr"):
        prepare = "chunk_bwd_prepare_iplr" if name == "iplr" else "chunk_bwd_prepare_dplr"
        for stage in (prepare,) + BWD_STAGES:
            rep = (pytest.mark.representative,) if name == "dplr" else ()
            out.append(pytest.param(name, stage, marks=rep, id=f"{name}-{stage}"))
    return out


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name,stage", _compile_cases())
def test_bwd_stage_compiles_without_spills(name, stage):
    """Registered in the plan for the dplr rule's specs; its K = V = 128 example compiles
    for sm_90a without spills."""
    from linattn.codegen import plan
    from linattn.codegen.compile import compile_stage, format_record, load_module
    from linattn.codegen.render import DEFAULT_OUT
    from linattn.ops.registry import specs
    assert stage in [s.name for s in plan(specs()[name], "bwd", "sm90")]
    module = load_module(DEFAULT_OUT / "sm90" / name / f"{stage}.py")
    ex = next(e for e in module.EXAMPLES if e["K"] == 128 and e["V"] == 128)
    rec = compile_stage(module, ex, "sm90")
    print(format_record(rec))
    assert "error" not in rec, rec.get("error")
    assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
    assert not rec["barriers_in_branches"], rec["barriers_in_branches"]


@pytest.mark.parametrize("name,K,HV", [("dplr", 48, 4), ("iplr", 64, 4), ("dplr", 48, 2)],
                         ids=["dplr-K48-GVA2", "iplr-K64-GVA2", "dplr-K48-HV=H"])
def test_function_trains_through_the_plans(monkeypatch, name, K, HV):
    """ops/dplr_bwd.py's DplrChunkFunction: the forward's plan and the
    backward's, their stages' fakes on the plans' f16 buffers (K = 48 padded to the
    kernels' 64 and cut back: from f32 sums under GVA, from the kernel's f16 stores where
    HV == H), give autograd's gradients of the fp64 reference, contiguous, in the inputs'
    dtypes."""
    from linattn.ops.dplr_bwd import DplrChunkFunction
    from linattn.ops.registry import specs
    from _kernel_check import fake_compiles
    from test_chunk_dplr import _fake_body
    spec, rng = specs()[name], np.random.default_rng(9)
    ref_spec = SPECS[f"dplr_{spec.gate.value}"]
    H, V, lens = 2, 32, (3, 70, 200)
    cu = np.concatenate([[0], np.cumsum(lens)])
    x = R.random_inputs(ref_spec, Options(), 1, int(cu[-1]), H, HV, K, V, rng, cu_seqlens=cu)
    xs = {n: torch.tensor(x[n]).half() for n in "qkabv"}
    if x["g"] is not None:
        xs["g"] = torch.tensor(x["g"]).float()
    xs["initial_state"] = torch.tensor(x["initial_state"]).float()
    do = torch.tensor(rng.standard_normal(x["v"].shape)).half()
    dht = torch.tensor(rng.standard_normal(x["initial_state"].shape)).float()
    fwd = ("chunk_prepare_dplr", "chunk_prepare_iplr", "chunk_state_dplr")
    fake_compiles(monkeypatch, lambda s, st, pr: (_fake_body if st in fwd
                                                  else _fake_bwd_body)(s, st, pr))
    leaves = {n: z.clone().requires_grad_() for n, z in xs.items()}
    cu_t = torch.tensor(cu, dtype=torch.int32)
    o, ht = DplrChunkFunction.apply(spec, *(leaves[n] for n in "qkvab"), leaves.get("g"),
                                    K ** -0.5, leaves["initial_state"], True, cu_t, cu_t)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    ref = _reference_grads(ref_spec, dict({n: z.double().numpy() for n, z in xs.items()},
                                          cu_seqlens=cu, g=x["g"]), do.double().numpy(),
                           dht.double().numpy(), K ** -0.5)
    for n, z in ref.items():
        got = leaves[n[1:]].grad
        assert got is not None and got.dtype == xs[n[1:]].dtype and got.shape == z.shape, n
        assert got.is_contiguous(), n
        want = torch.tensor(z)
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 1e-2, (n, rel)


@pytest.mark.parametrize("fn", ["chunk_dplr_delta_rule", "chunk_iplr_delta_rule",
                                "chunk_rwkv7"])
def test_public_call_trains_through_the_plans(monkeypatch, fn):
    """A 16-bit chunk_* call that needs gradients where the chunked forward fits (chunked
    forced here: the CPU) goes to ops/dplr_bwd.py, not the exact torch path: through the
    plans' fakes its gradients are autograd's of the fp64 reference."""
    import linattn
    from linattn.ops import dplr, exact_train, validate
    from _kernel_check import fake_compiles
    from test_chunk_dplr import _fake_body

    def refuse(*a, **kw):
        raise AssertionError("took the exact torch path")
    monkeypatch.setattr(exact_train, "train", refuse)
    monkeypatch.setattr(dplr, "chunked", lambda spec, q, v, opts: True)
    monkeypatch.setattr(validate, "check_cuda", lambda name, x: None)
    monkeypatch.setattr(validate, "check_devices", lambda q, **tensors: None)
    fwd = ("chunk_prepare_dplr", "chunk_prepare_iplr", "chunk_state_dplr")
    fake_compiles(monkeypatch, lambda s, st, pr: (_fake_body if st in fwd
                                                  else _fake_bwd_body)(s, st, pr))
    gated = fn != "chunk_iplr_delta_rule"
    rng = np.random.default_rng(13)
    H, K, V, lens = 2, 64, 32, (70, 130)
    cu = np.concatenate([[0], np.cumsum(lens)])
    ref_spec = SPECS["dplr_key" if gated else "dplr_none"]
    x = R.random_inputs(ref_spec, Options(), 1, int(cu[-1]), H, H, K, V, rng, cu_seqlens=cu)
    xs = {n: torch.tensor(x[n]).half() for n in "qkabv"}
    if gated:
        xs["g"] = torch.tensor(x["g"]).float()
    xs["initial_state"] = torch.tensor(x["initial_state"]).float()
    do = torch.tensor(rng.standard_normal(x["v"].shape)).half()
    dht = torch.tensor(rng.standard_normal(x["initial_state"].shape)).float()
    leaves = {n: z.clone().requires_grad_() for n, z in xs.items()}
    scale = 1.0 if fn == "chunk_rwkv7" else K ** -0.5
    cu_t = torch.tensor(cu, dtype=torch.int32)
    args = [leaves[n] for n in "qkvab"]
    if gated:
        args.append(leaves["g"])
    if fn == "chunk_rwkv7":        # (r, w, k, v, a, b)
        args = [args[0], args[5], args[1], args[2], args[3], args[4]]
    o, ht = getattr(linattn, fn)(*args, scale=scale, initial_state=leaves["initial_state"],
                                 output_final_state=True, cu_seqlens=cu_t,
                                 cu_seqlens_cpu=cu_t, chunk_size=64)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    ref = _reference_grads(ref_spec, dict({n: z.double().numpy() for n, z in xs.items()},
                                          cu_seqlens=cu), do.double().numpy(),
                           dht.double().numpy(), scale)
    for n, z in ref.items():
        want = torch.tensor(z)
        rel = ((leaves[n[1:]].grad.double() - want).norm() / want.norm()).item()
        assert rel < 1e-2, (n, rel)
