"""The torch fp64 references: chunked == token recurrence == an independent plain loop,
for every rule x gate and option set, GVA, varlen, states in both layouts; the contract
ops against their definitions; backward (autograd) against finite differences."""
import math

import numpy as np
import pytest
import torch

from linattn.dsl import Gate, Options, all_rule_gate_specs
from linattn.dsl import torch_reference as tr

F64 = torch.float64
SPECS = {s.name: s for s in all_rule_gate_specs()}


def rel(a, b):
    return float((a - b).norm() / b.norm())


def make_inputs(spec, opts, rng, B, T, H, HV, K, V, cu=None):
    t = lambda *s: torch.from_numpy(rng.standard_normal(s))  # noqa: E731
    k = t(B, T, H, K)
    if not opts.l2norm_qk:
        k = k / k.norm(dim=-1, keepdim=True)
    d = dict(q=t(B, T, H, K), k=k, v=t(B, T, HV, V), g=None, beta=None)
    if spec.has_beta:
        d["beta"] = t(B, T, HV) if opts.beta_sigmoid else torch.sigmoid(t(B, T, HV))
    gshape = {Gate.SCALAR: (B, T, HV), Gate.KEY: (B, T, HV, K)}.get(spec.gate)
    if gshape:
        d["g"] = t(*gshape) if opts.gate_in_kernel else torch.nn.functional.logsigmoid(t(*gshape) + 2)
    N = B if cu is None else len(cu) - 1
    st = (N, HV, V, K) if opts.state_v_first else (N, HV, K, V)
    kw = dict(initial_state=0.1 * t(*st), cu_seqlens=None if cu is None else torch.tensor(cu))
    if opts.gate_in_kernel:
        kw["A_log"] = torch.from_numpy(rng.uniform(0, 1, HV))
        kw["dt_bias"] = t(HV * (K if spec.gate is Gate.KEY else 1))
    return d, kw


def plain_loop(q, k, v, g, beta, scale, S0, key_gate):
    """An independent token loop, plain options, H == HV, K-first state, fixed length."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=F64)
    S = S0.clone()
    for b in range(B):
        for h in range(H):
            s = S[b, h]
            for t in range(T):
                if g is not None:
                    s = (torch.diag(torch.exp(g[b, t, h])) @ s) if key_gate else math.exp(g[b, t, h]) * s
                vt = v[b, t, h]
                if beta is not None:
                    vt = beta[b, t, h] * (vt - s.T @ k[b, t, h])
                s = s + torch.outer(k[b, t, h], vt)
                o[b, t, h] = s.T @ (scale * q[b, t, h])
            S[b, h] = s
    return o, S


@pytest.mark.parametrize("name", sorted(SPECS))
def test_chunked_matches_plain_loop(name, rng):
    spec = SPECS[name]
    d, kw = make_inputs(spec, Options(), rng, 2, 37, 2, 2, 8, 6)
    o, s = tr.chunked_forward(spec, **d, initial_state=kw["initial_state"], chunk_size=16)
    o2, s2 = plain_loop(d["q"], d["k"], d["v"], d["g"], d["beta"], 8 ** -0.5,
                        kw["initial_state"], spec.gate is Gate.KEY)
    assert rel(o, o2) < 1e-10 and rel(s, s2) < 1e-10


CASES = [pytest.param(n, all_on, shape, id=f"{n}-{'all' if all_on else 'plain'}-{sid}")
         for n in sorted(SPECS) for all_on in (False, True)
         for sid, shape in (("B2-T65-H1-HV2", (2, 65, 1, 2, 8, 6, None)),
                            ("varlen-1-63-66", (1, 130, 2, 4, 8, 8, [0, 1, 64, 130])))]


@pytest.mark.parametrize("name,all_on,shape", CASES)
def test_chunked_matches_recurrent(name, all_on, shape, rng):
    spec = SPECS[name]
    opts = Options(**{n: True for n in spec.supports}) if all_on else Options()
    B, T, H, HV, K, V, cu = shape
    d, kw = make_inputs(spec, opts, rng, B, T, H, HV, K, V, cu)
    o, s = tr.chunked_forward(spec, **d, options=opts, **kw, chunk_size=32)
    o2, s2 = tr.recurrent_forward(spec, **d, options=opts, **kw)
    assert rel(o, o2) < 1e-10 and rel(s, s2) < 1e-10
    assert torch.isfinite(o).all()


def test_intermediates_chunk64(rng):
    spec = SPECS["delta_scalar"]
    d, kw = make_inputs(spec, Options(), rng, 1, 130, 1, 1, 8, 8)
    r = tr.chunked_forward(spec, **d, initial_state=kw["initial_state"], intermediates=True)
    assert r["h"].shape == (1, 3, 1, 8, 8) and r["A"].shape == (1, 130, 1, 64)
    assert rel(r["h"][:, 0], kw["initial_state"]) == 0
    # state entering chunk 1 == recurrent final state after 64 tokens
    _, s64 = tr.recurrent_forward(spec, **{n: (None if x is None else x[:, :64]) for n, x in d.items()},
                                  initial_state=kw["initial_state"])
    assert rel(r["h"][:, 1], s64) < 1e-10


def test_deltanet_chunk_contract(rng):
    B, H, L, K, V = 1, 2, 100, 8, 4
    t = lambda *s: torch.from_numpy(rng.standard_normal(s))  # noqa: E731
    q, k, v = t(B, H, L, K), torch.nn.functional.normalize(t(B, H, L, K), dim=-1), t(B, H, L, V)
    beta = torch.sigmoid(t(B, H, L))
    o, S, Aw, Au, w, u = tr.deltanet_chunk_fwd(q, k, v, beta)
    assert S.shape == (B, H, 3, K, V) and Aw.shape == (B, H, L, 64) and float(S[:, :, 0].abs().max()) == 0
    # definitions: Aw = (I + strict_tril(beta K K^T))^-1 on chunk 0, w = Aw (beta k), u = Aw (beta v)
    kc, bc = k[0, 0, :64], beta[0, 0, :64]
    A = torch.eye(64, dtype=F64) + torch.tril(bc[:, None] * (kc @ kc.T), -1)
    assert rel(Aw[0, 0, :64], torch.linalg.inv(A)) < 1e-10
    assert rel(w[0, 0, :64], Aw[0, 0, :64] @ (bc[:, None] * kc)) < 1e-10
    assert rel(u[0, 0, :64], Aw[0, 0, :64] @ (bc[:, None] * v[0, 0, :64])) < 1e-10
    # o and final state against step-by-step recurrent decode with no scale
    s = torch.zeros(B, H, K, V, dtype=F64)
    for i in range(L):
        oi, s = tr.deltanet_recurrent_fwd(q[:, :, i], k[:, :, i], v[:, :, i], beta[:, :, i], s)
        assert rel(o[:, :, i], oi) < 1e-10
    assert rel(S[:, :, -1], s) < 1e-10


def test_deltanet_chunk_bwd_finite_difference(rng):
    t = lambda *s: torch.from_numpy(rng.standard_normal(s))  # noqa: E731
    q, k, v = t(1, 1, 20, 4), torch.nn.functional.normalize(t(1, 1, 20, 4), dim=-1), t(1, 1, 20, 3)
    beta, do = torch.sigmoid(t(1, 1, 20)), t(1, 1, 20, 3)
    grads = tr.deltanet_chunk_bwd(do, q, k, v, beta, chunk_size=16)
    for x, gx in zip((q, k, v, beta), grads):
        idx = tuple(int(rng.integers(n)) for n in x.shape)
        eps = 1e-6
        xp, xm = x.clone(), x.clone()
        xp[idx] += eps
        xm[idx] -= eps
        f = lambda y: float((tr.deltanet_chunk_fwd(*[y if z is x else z for z in (q, k, v, beta)],  # noqa: E731
                                                   chunk_size=16)[0] * do).sum())
        assert abs((f(xp) - f(xm)) / (2 * eps) - float(gx[idx])) < 1e-6 * (1 + abs(float(gx[idx])))


def test_gla_contracts(rng):
    B, T, H, K, V = 2, 70, 2, 8, 4
    t = lambda *s: torch.from_numpy(rng.standard_normal(s))  # noqa: E731
    q, k, v = t(B, T, H, K), t(B, T, H, K), t(B, T, H, V)
    g = torch.nn.functional.logsigmoid(t(B, T, H, K) + 2)
    s0 = 0.1 * t(B, H, K, V)
    o, ht, h = tr.gla_chunk_fwd(q, k, v, g, scale=0.3, initial_state=s0)
    assert h.shape == (B, 3, H, K, V) and rel(h[:, 0], s0) == 0 and rel(h[:, -1], ht) == 0
    s = s0
    for i in range(T):
        oi, s = tr.gla_recurrent_fwd(q[:, i], k[:, i], v[:, i], g[:, i], s, scale=0.3)
        assert rel(o[:, i], oi) < 1e-10
    assert rel(ht, s) < 1e-10
    do, dht = t(B, T, H, V), t(B, H, K, V)
    dq, dk, dv, dg, dh0 = tr.gla_chunk_bwd(q, k, v, g, h, do, dht, scale=0.3)
    assert dg.shape == g.shape and dh0.shape == s0.shape
    # directional derivative check on g
    dirg, eps = t(B, T, H, K), 1e-6
    f = lambda gg: float((tr.gla_chunk_fwd(q, k, v, gg, 0.3, s0)[0] * do).sum()  # noqa: E731
                         + (tr.gla_chunk_fwd(q, k, v, gg, 0.3, s0)[1] * dht).sum())
    fd = (f(g + eps * dirg) - f(g - eps * dirg)) / (2 * eps)
    assert abs(fd - float((dg * dirg).sum())) < 1e-6 * (1 + abs(fd))


def test_recurrent_step_fp32_compute_returns_input_dtype(rng):
    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(torch.bfloat16)  # noqa: E731
    q, k, v, s = t(2, 3, 8), t(2, 3, 8), t(2, 3, 8), t(2, 3, 8, 8)
    beta = torch.sigmoid(t(2, 3))
    o, s1 = tr.deltanet_recurrent_fwd(q, k, v, beta, s, compute_dtype=torch.float32)
    o64, s64 = tr.deltanet_recurrent_fwd(q, k, v, beta, s)
    assert o.dtype == torch.bfloat16 and s1.dtype == torch.bfloat16 and o64.dtype == F64
    assert rel(o.double(), o64) < 1e-2


NUMPY_CASES = [pytest.param(n, all_on, id=f"{n}-{'all' if all_on else 'plain'}")
               for n in sorted(SPECS) for all_on in (False, True)]


@pytest.mark.parametrize("name,all_on", NUMPY_CASES)
def test_matches_numpy_references(name, all_on, rng):
    """Against helper A's NumPy fp64 references (dsl/recurrent.py, dsl/chunked.py)."""
    from linattn.dsl import chunked as np_chunked
    from linattn.dsl import recurrent as np_recurrent
    spec = SPECS[name]
    opts = Options(**{n: True for n in spec.supports}) if all_on else Options()
    cu = [0, 1, 40, 100] if all_on else None
    B = 1 if all_on else 2
    d = np_recurrent.random_inputs(spec, opts, B, 100, 2, 4, 8, 6, rng, cu_seqlens=cu)
    args = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
    kw = {n: d[n] for n in ("initial_state", "cu_seqlens", "A_log", "dt_bias")}
    tt = lambda x: None if x is None else torch.from_numpy(np.asarray(x))  # noqa: E731
    mine = tr.chunked_forward(spec, **{n: tt(x) for n, x in args.items()}, options=opts,
                              **{n: tt(x) for n, x in kw.items()}, chunk_size=32, intermediates=True)
    o_np, s_np = np_recurrent.recurrent_forward(spec, **args, options=opts, **kw)
    assert rel(mine["o"], tt(o_np)) < 1e-10 and rel(mine["final_state"], tt(s_np)) < 1e-10
    ch = np_chunked.chunked_forward(spec, **args, options=opts, **kw, chunk_size=32)
    for n in ("A", "w", "u", "v_new"):
        if ch[n] is not None:
            assert rel(mine[n], tt(ch[n])) < 1e-10, n
    if not opts.state_v_first:
        assert rel(mine["h"], tt(ch["h"])) < 1e-10


@pytest.mark.parametrize("name", sorted(SPECS))
def test_chunked_in_pieces_is_the_same_computation(name, rng):
    """Long runs go in pieces of whole chunks with the state carried: varlen with a
    sequence shorter than a piece, every option on, GVA; pieces of 1 and 2 chunks."""
    spec = SPECS[name]
    opts = Options(**{n: True for n in spec.supports})
    d, kw = make_inputs(spec, opts, rng, 1, 200, 2, 4, 8, 8, [0, 5, 150, 200])
    o, s = tr.chunked_forward(spec, **d, options=opts, **kw, chunk_size=16, piece_tokens=0)
    for piece in (16, 32):
        o2, s2 = tr.chunked_forward(spec, **d, options=opts, **kw, chunk_size=16,
                                    piece_tokens=piece)
        assert rel(o2, o) < 1e-12 and rel(s2, s) < 1e-12
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        tr.chunked_forward(spec, **d, options=opts, **kw, chunk_size=16, piece_tokens=24)
