"""Torch references in fp64, usable on the GPU for full benchmark shapes (and on CPU in tests).

Derived from an :class:`OpSpec` (rule x gate) and :class:`Options`, in fla's layout:
q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV]; g [B, T, HV] (scalar gate),
[B, T, HV, K] (key gate) or [B, T, HV, V] (value gate, additive rule), natural-log decays; states [N, HV, K, V] (or [N, HV, V, K] with
state_v_first); cu_seqlens [N+1] with B == 1. Conventions as /work/briefs/A_references.md.

Chunked forward, per chunk of C tokens (C = 64), per (sequence, value head):

    gate cumsum      gc_i = sum_{j <= i in chunk} g_j                    (<= 0)
    intra-chunk WY   A = (I + strict_tril(beta_i k_i.k_j e^{gc_i - gc_j}))^-1
                     u = A (beta v),  w = A (beta e^{gc} k)              (delta rule)
    inter-chunk      h_t = state entering chunk t;  v_new = u - w h_t    (additive: v)
                     h_{t+1} = e^{gc_last} h_t + (k e^{gc_last - gc})^T v_new
    output           o = (scale q e^{gc}) h_t + tril(scale q.k e^{gc_i - gc_j}) v_new

Value gate (decay per value channel, gc [.., V]): the state's columns decay instead,
    h_{t+1} = h_t e^{gc_last} + k^T (v e^{gc_last - gc}),
    o = (scale q h_t) e^{gc} + e^{gc} (tril(scale q.k) (v e^{-gc})).

Pairwise decays e^{gc_i - gc_j} are factored around the chunk's middle row, so fp64 only
overflows when one chunk decays by more than ~e^{-1400} (never with realistic gates).
Backward: torch.autograd through :func:`chunked_forward`. Every function computes in
fp64 (inputs are converted) except the recurrent single steps, which take compute_dtype
so the benchmark can also run them as the seed's eager fp32 "torch" implementation.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .preprocess import L2NORM_EPS
from .spec import OpSpec, Options

F64 = torch.float64


def _f64(x):
    return None if x is None else x.to(F64)


def softplus_fla(x: torch.Tensor) -> torch.Tensor:
    """fla's softplus: x when x > 20, else log1p(exp(x))."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def prepare(spec: OpSpec, options: Options, q, k, v, g=None, beta=None, scale=None,
            A_log=None, dt_bias=None):
    """Raw call inputs -> what the recurrence consumes, in fp64, key heads expanded to HV.

    Returns (q_eff [B,T,HV,K] already times scale, k_eff [B,T,HV,K], v [B,T,HV,V],
    g_log [B,T,HV,1 or K] ([B,T,HV,V] for the value gate: spec.gate.per_value) or None,
    beta_eff [B,T,HV] or None).
    """
    spec.check_options(options)
    q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV = v.shape[2]
    group = spec.check_heads(H, HV).group
    if options.l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    q = q * spec.scale_for(K, scale)
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    g_log = None
    if spec.has_gate:
        g_log = spec.gate.maths.per_channel(g)          # [.., 1 (one decay a head) or channels]
        if options.gate_in_kernel:
            a = torch.exp(_f64(A_log)).view(HV, 1)
            bias = _f64(dt_bias).view(HV, -1)
            g_log = -a * softplus_fla(g_log + bias)
    if spec.has_beta:
        if options.beta_sigmoid:
            beta = torch.sigmoid(beta) * (2.0 if options.allow_neg_eigval else 1.0)
    else:
        beta = None
    return q, k, v, g_log, beta


def prepare_rule_inputs(spec: OpSpec, options: Options, rule_inputs: dict, HV: int) -> dict:
    """The rule's vector inputs (Comba's p [B, T, H, K], GDN-2's b [B, T, HV, K] and w
    [B, T, HV, V]) as the recurrence reads them: fp64; a key of its own (heads "H")
    l2-normalised with l2norm_qk (as k) and expanded to HV heads."""
    out = {}
    for name in spec.rule.maths.vector_inputs:
        x = _f64(rule_inputs[name])
        if spec.rule.maths.vector_axes[name][0] == "H":
            x = (l2norm(x) if options.l2norm_qk else x).repeat_interleave(HV // x.shape[2], 2)
        out[name] = x
    return out


def _segments(B, T, cu_seqlens):
    """(batch slice, t0, t1) per independent run of tokens; one per sequence if varlen."""
    if cu_seqlens is None:
        return [(slice(0, B), 0, T)]
    if B != 1:
        raise ValueError(f"cu_seqlens needs B == 1, got B={B}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(slice(0, 1), cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _state_in(initial_state, n0, n1, b, HV, K, V, v_first, device):
    if initial_state is None:
        return torch.zeros(b, HV, K, V, dtype=F64, device=device)
    s = _f64(initial_state[n0:n1])
    return s.transpose(-1, -2) if v_first else s


def _chunk_segment(q, k, v, g, beta, S, C, value_gate=False, rule=None, x=None):
    """One run of tokens, all fp64, [b, L, HV, D] (g [b, L, HV, 1 or K], or [b, L, HV, V]
    with value_gate (additive rule only); beta [b, L, HV]; ``rule`` (dsl/family.py) and
    its vector inputs ``x`` (name -> [b, L, HV, D]) give the erase vector (beta k; Comba's
    beta p read before each token's decay; GDN-2's b . k) and the written value (beta v;
    GDN-2's w . v)).

    Returns o [b,L,HV,V], final S [b,HV,K,V] and the intermediates (head-major chunks).
    """
    b, L, HV, K = k.shape
    NC = max(1, math.ceil(L / C))
    pad = NC * C - L

    def chunks(x):  # [b, L, HV, D] -> [b, HV, NC, C, D]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(b, NC, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    gvc = chunks(g).cumsum(-2) if value_gate else None             # [b,HV,NC,C,V]
    g = None if value_gate else g
    gc = torch.zeros_like(kc[..., :1]) if g is None else chunks(g).cumsum(-2)
    ref = gc[..., C // 2:C // 2 + 1, :]
    k_inv = kc * torch.exp(ref - gc)                               # k_j e^{r - gc_j}
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    Aqk = ((qc * torch.exp(gc - ref)) @ k_inv.transpose(-1, -2)).masked_fill(~causal, 0)
    gl = gc[..., -1:, :]                                           # [b,HV,NC,1,Kg]
    k_last = kc * torch.exp(gl - gc)
    q_dec = qc * torch.exp(gc)
    A = w = None
    if rule is not None and rule.lifts:
        return _dplr_chunks(qc, kc, vc, gc, None if g is None else chunks(g), S,
                            {n: chunks(a) for n, a in (x or {}).items()}, rule, tokens_of(b, L))
    if rule is not None and rule.reads_state:
        xc = {n: chunks(a) for n, a in (x or {}).items()}
        # the write's scale (beta [.., 1], GDN-2's w [.., V]; ones for none)
        bc = (chunks(beta.unsqueeze(-1)) if rule.scale_input == "beta"
              else xc[rule.scale_input] if rule.scale_input else torch.ones_like(vc[..., :1]))
        ec = rule.read_key(kc, xc)              # the erase key, and its decay: inclusive,
        gr = gc if rule.reads_decayed or g is None else gc - chunks(g)   # or exclusive
        if rule.scale_input == "beta":
            ec = bc * ec
        Akk = ((ec * torch.exp(gr - ref)) @ k_inv.transpose(-1, -2))
        Akk = Akk.masked_fill(~causal.tril(-1), 0)                 # strictly lower
        eye = torch.eye(C, dtype=F64, device=k.device)
        A = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False,
                                          unitriangular=True)
        u = A @ (bc * vc)
        w = A @ (torch.exp(gr) * ec)
    else:
        u = vc
    hs, vnews = [], []
    for t in range(NC):
        hs.append(S)
        vn = u[:, :, t] if w is None else u[:, :, t] - w[:, :, t] @ S
        vnews.append(vn)
        vd = vn
        if gvc is not None:                                        # the columns decay
            gvl = gvc[:, :, t, -1:, :]                             # [b,HV,1,V]
            S, vd = S * torch.exp(gvl), vn * torch.exp(gvl - gvc[:, :, t])
        S = torch.exp(gl[:, :, t]).transpose(-1, -2) * S + k_last[:, :, t].transpose(-1, -2) @ vd
    h = torch.stack(hs, 2)                                         # [b,HV,NC,K,V]
    vnew = torch.stack(vnews, 2)
    if gvc is None:
        o = q_dec @ h + Aqk @ vnew
    else:
        ref_v = gvc[..., C // 2:C // 2 + 1, :]
        o = ((q_dec @ h) * torch.exp(gvc)
             + torch.exp(gvc - ref_v) * (Aqk @ (vnew * torch.exp(ref_v - gvc))))
        gc = gvc                                                   # reported as g_cum

    tokens = tokens_of(b, L)
    inter = dict(h=h.permute(0, 2, 1, 3, 4), v_new=tokens(vnew), g_cum=tokens(gc),
                 A=None if A is None else tokens(A), w=None if w is None else tokens(w),
                 u=tokens(u))
    return tokens(o), S, inter


def tokens_of(b, L):
    """[b, HV, NC, C, D] -> [b, L, HV, D] (a chunked run's rows back in token order)."""
    def tokens(x):
        HV, NC, C = x.shape[1:4]
        return x.permute(0, 2, 3, 1, 4).reshape(b, NC * C, HV, x.shape[-1])[:, :L]
    return tokens


def _dplr_chunks(qc, kc, vc, gc, g_tok, S, xc, rule, tokens):
    """The DPLR rule's chunks (S_t = D_t S + b_t r_t^T + k_t v_t^T, r_t = S_{t-1}^T a_t,
    o_t = S_t^T q_t), head-major [b, HV, NC, C, D]; gc the inclusive in-chunk cumsum of
    the log decay (zeros without a gate), g_tok the chunked per-token decay or None.
    The reads r of a chunk entering with S solve (I - A_ab) r = w0 S + A_ak v, the pairs
    read through a with the exclusive decay (e^(G_j - g_j - G_l), l < j):
      T = (I - strict_tril(a_j . b_l))^-1,  w = T (a e^(G - g)),  u = T A_ak v,
      r = w S + u,  o = (q e^G) S + A_qb r + A_qk v  (inclusive pairs, l <= j),
      S <- e^G_last S + (b e^(G_last - G))^T r + (k e^(G_last - G))^T v."""
    C = kc.shape[-2]
    a, bk = rule.read_key(kc, xc), rule.lift_key(kc, xc)
    ge = gc if g_tok is None else gc - g_tok                       # exclusive cumsum
    ref = gc[..., C // 2:C // 2 + 1, :]
    incl = torch.ones(C, C, dtype=torch.bool, device=kc.device).tril()

    def pairs(x, gx, y, mask):       # sum_c x_jc y_lc e^(gx_jc - G_lc), masked
        return ((x * torch.exp(gx - ref)) @ (y * torch.exp(ref - gc)).transpose(-1, -2)
                ).masked_fill(~mask, 0)
    strict = incl.tril(-1)
    eye = torch.eye(C, dtype=F64, device=kc.device)
    Tm = torch.linalg.solve_triangular(eye - pairs(a, ge, bk, strict), eye.expand(
        *kc.shape[:3], C, C), upper=False, unitriangular=True)
    w = Tm @ (a * torch.exp(ge))
    u = Tm @ (pairs(a, ge, kc, strict) @ vc)
    Aqb, Aqk = pairs(qc, gc, bk, incl), pairs(qc, gc, kc, incl)
    gl = gc[..., -1:, :]
    b_last, k_last, q_dec = bk * torch.exp(gl - gc), kc * torch.exp(gl - gc), qc * torch.exp(gc)
    hs, rs = [], []
    for t in range(kc.shape[2]):
        hs.append(S)
        r = w[:, :, t] @ S + u[:, :, t]
        rs.append(r)
        S = (torch.exp(gl[:, :, t]).transpose(-1, -2) * S + b_last[:, :, t].transpose(-1, -2) @ r
             + k_last[:, :, t].transpose(-1, -2) @ vc[:, :, t])
    h, r = torch.stack(hs, 2), torch.stack(rs, 2)
    o = q_dec @ h + Aqb @ r + Aqk @ vc
    inter = dict(h=h.permute(0, 2, 1, 3, 4), v_new=tokens(r), g_cum=tokens(gc), A=tokens(Tm),
                 w=tokens(w), u=tokens(u))
    return tokens(o), S, inter


def chunked_forward(spec: OpSpec, q, k, v, g=None, beta=None, *, options: Options = Options(),
                    scale=None, initial_state=None, cu_seqlens=None, A_log=None, dt_bias=None,
                    chunk_size=None, intermediates=False, piece_tokens=None,
                    **rule_inputs):
    """fp64 chunked forward of any spec; differentiable (autograd) in every input.

    piece_tokens: without intermediates, each sequence is processed in pieces of this
    many tokens (a multiple of the chunk size; None: sized for ~1 GiB fp64 tensors, 0: one
    piece) with the state carried from piece to piece.

    Returns (o [B,T,HV,V], final_state [N,HV,K,V] (v-first: [N,HV,V,K])), or with
    intermediates=True a dict with o, final_state, h [B', NC, HV, K, V] (state entering
    each chunk; varlen: B' = 1 and chunks of all sequences in order), A, w, u, v_new,
    g_cum ([B,T,HV,*] token rows; A is None for the additive rule).
    """
    C = chunk_size or spec.chunk_size
    B, T, _, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    # without intermediates, long runs go in pieces of whole chunks (the state carried
    # across; the same arithmetic) so the fp64 working set stays ~1 GiB per tensor
    if intermediates or piece_tokens == 0:
        piece = C * (T // C + 1)              # one piece, longer than any sequence
    else:
        piece = piece_tokens or max(C, (2 ** 20 // max(1, B * HV)) // C * C)
    if piece % C:
        raise ValueError(f"piece_tokens={piece_tokens} must be a multiple of the chunk size {C}")
    outs, finals, inters = [], [], []
    for n, (bs, t0, t1) in enumerate(_segments(B, T, cu_seqlens)):
        n0, n1 = (0, B) if cu_seqlens is None else (n, n + 1)
        S = _state_in(initial_state, n0, n1, bs.stop - bs.start, HV, K, V,
                      options.state_v_first, k.device)
        for p0 in range(t0, max(t1, t0 + 1), piece):
            p1 = min(t1, p0 + piece)
            sl = lambda x: None if x is None else x[bs, p0:p1]  # noqa: E731
            qe, ke, ve, ge, be = prepare(spec, options, sl(q), sl(k), sl(v), sl(g), sl(beta),
                                         scale, A_log, dt_bias)
            xs = {n: sl(a) for n, a in rule_inputs.items()}
            o, S, inter = _chunk_segment(qe, ke, ve, ge, be, S, C, spec.gate.per_value,
                                         spec.rule.maths,
                                         prepare_rule_inputs(spec, options, xs, ve.shape[2]))
            outs.append(o)
            inters.append(inter)
        finals.append(S)
    o = torch.cat(outs, 1)
    final = torch.cat(finals, 0)
    if options.state_v_first:
        final = final.transpose(-1, -2)
    if not intermediates:
        return o, final
    res = dict(o=o, final_state=final, h=torch.cat([i["h"] for i in inters], 1))
    for name in ("A", "w", "u", "v_new", "g_cum"):
        parts = [i[name] for i in inters]
        res[name] = None if parts[0] is None else torch.cat(parts, 1)
    return res


def recurrent_forward(spec: OpSpec, q, k, v, g=None, beta=None, *, options: Options = Options(),
                      scale=None, initial_state=None, cu_seqlens=None, A_log=None, dt_bias=None,
                      **rule_inputs):
    """fp64 token-by-token recurrence (decay, then delta/additive update, then output;
    Comba's write reads the state before the decay, through p).

    Same arguments and returns as :func:`chunked_forward` (without intermediates).
    """
    qe, ke, ve, ge, be = prepare(spec, options, q, k, v, g, beta, scale, A_log, dt_bias)
    B, T, HV, K = ke.shape
    V = ve.shape[-1]
    xe, rule = prepare_rule_inputs(spec, options, rule_inputs, HV), spec.rule.maths
    o = torch.zeros(B, T, HV, V, dtype=F64, device=ke.device)
    finals = []
    for n, (bs, t0, t1) in enumerate(_segments(B, T, cu_seqlens)):
        n0, n1 = (0, B) if cu_seqlens is None else (n, n + 1)
        S = _state_in(initial_state, n0, n1, bs.stop - bs.start, HV, K, V,
                      options.state_v_first, ke.device)
        for t in range(t0, t1):
            S_prev = S
            if ge is not None:                 # decay rows (key / scalar) or columns
                S = spec.gate.maths.decay(S, torch.exp(ge[bs, t]))
            kt, vt = ke[bs, t], ve[bs, t]
            xt = {n: a[bs, t] for n, a in xe.items()}
            bt = (None if be is None else be[bs, t].unsqueeze(-1)) if rule.scale_input in (
                "", "beta") else xt[rule.scale_input]
            S_read = S if rule.reads_decayed else S_prev
            rk = rule.read_key(kt, xt)
            lift = rule.lift_key(kt, xt)
            if lift is not None:               # DPLR: the read written back along b
                S = S + lift.unsqueeze(-1) * torch.einsum("bhkv,bhk->bhv", S_read,
                                                          rk).unsqueeze(-2)
            vt = rule.write(vt, bt, lambda: torch.einsum("bhkv,bhk->bhv", S_read, rk))
            S = S + kt.unsqueeze(-1) * vt.unsqueeze(-2)
            o[bs, t] = torch.einsum("bhkv,bhk->bhv", S, qe[bs, t])
        finals.append(S)
    final = torch.cat(finals, 0)
    return o, (final.transpose(-1, -2) if options.state_v_first else final)


def pool_recurrent_forward(spec: OpSpec, q, k, v, g=None, beta=None, *, pool,
                           ssm_state_indices, num_accepted_tokens=None, inplace=False,
                           options: Options = Options(), scale=None, cu_seqlens=None,
                           A_log=None, dt_bias=None, **rule_inputs):
    """Decode on a state pool (fla's continuous batching), as a loop over sequences and
    tokens of :func:`recurrent_forward`: sequence n starts from pool slot
    ssm_state_indices[n] ([N]) or [n, c] ([N, S]; c = num_accepted_tokens[n] - 1, else
    0); a slot outside [0, P) skips the sequence (o rows zero, nothing written).

    Returns (o [B, T, HV, V] fp64, new_pool fp64: ``pool`` with the final state written
    to slot [n] ([N] form) or the state after token t to slot [n, t] ([N, S] form) when
    ``inplace``, else unchanged; final [N, HV, K, V] fp64, the sequences' final states
    (zeros for a skipped one))."""
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    new_pool = _f64(pool).clone()
    idx = ssm_state_indices.long().cpu()
    o = torch.zeros(B, T, HV, V, dtype=F64, device=q.device)
    finals = []
    for n, (bs, t0, t1) in enumerate(_segments(B, T, cu_seqlens) if cu_seqlens is not None
                                     else [(slice(b, b + 1), 0, T) for b in range(B)]):
        col = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
        slot = int(idx[n, max(0, min(col, idx.shape[1] - 1))] if idx.dim() == 2 else idx[n])
        if not 0 <= slot < pool.shape[0]:
            finals.append(torch.zeros_like(new_pool[:1]))
            continue
        S = _f64(pool[slot:slot + 1])
        for t in range(t0, t1):
            one = lambda x: None if x is None else x[bs, t:t + 1]  # noqa: E731
            o_t, S = recurrent_forward(spec, one(q), one(k), one(v), one(g), one(beta),
                                       options=options, scale=scale, initial_state=S,
                                       A_log=A_log, dt_bias=dt_bias,
                                       **{n: one(a) for n, a in rule_inputs.items()})
            o[bs, t:t + 1] = o_t
            w = int(idx[n, t - t0]) if idx.dim() == 2 and t - t0 < idx.shape[1] else -1
            if inplace and idx.dim() == 2 and 0 <= w < pool.shape[0]:
                new_pool[w] = S[0]
        if inplace and idx.dim() == 1:
            new_pool[slot] = S[0]
        finals.append(S)
    return o, new_pool, torch.cat(finals, 0)


# -- the seed's contract ops -----------------------------------------------------------------
_DELTANET_PLAIN = OpSpec(name="deltanet_contract", rule="delta", gate="none", chunk_size=64)
_GLA_PLAIN = OpSpec(name="gla_contract", rule="additive", gate="key", chunk_size=64, gva=False)


def _bhld(x):  # [B, H, L, D] <-> [B, L, H, D]
    return x.transpose(1, 2)


def deltanet_chunk_fwd(q, k, v, beta, chunk_size=64):
    """DeltaNetChunkFwd contract, head-first, no scale, zero initial state, fp64.

    q, k [B,H,L,DK]; v [B,H,L,DV]; beta [B,H,L] -> (o [B,H,L,DV], S [B,H,NC+1,DK,DV],
    Aw [B,H,L,C], Au (= Aw), w [B,H,L,DK], u [B,H,L,DV]).
    """
    r = chunked_forward(_DELTANET_PLAIN, _bhld(q), _bhld(k), _bhld(v), None, beta.transpose(1, 2),
                        scale=1.0, chunk_size=chunk_size, intermediates=True)
    S = torch.cat([r["h"], r["final_state"].unsqueeze(1)], 1).transpose(1, 2)
    return (_bhld(r["o"]), S, _bhld(r["A"]), _bhld(r["A"]), _bhld(r["w"]), _bhld(r["u"]))


def deltanet_chunk_bwd(do, q, k, v, beta, chunk_size=64):
    """DeltaNetChunkBwd contract: exact gradients of deltanet_chunk_fwd's o under sum(o*do).

    Shapes as deltanet_chunk_fwd; returns (dq, dk, dv, dbeta) in fp64.
    """
    xs = [x.detach().to(F64).requires_grad_(True) for x in (q, k, v, beta)]
    with torch.enable_grad():
        o = deltanet_chunk_fwd(*xs, chunk_size=chunk_size)[0]
        return torch.autograd.grad(o, xs, do.to(F64))


def deltanet_recurrent_fwd(q, k, v, beta, state, compute_dtype=F64):
    """DeltaNetRecurrentFwd contract: one decode step, no scale.

    q, k [B,H,DK]; v [B,H,DV]; beta [B,H]; state [B,H,DK,DV] -> (o [B,H,DV], new state),
    computed in compute_dtype and returned in it if fp64, else in the input dtype.
    """
    out = q.dtype if compute_dtype != F64 else F64
    q, k, v, beta, S = (x.to(compute_dtype) for x in (q, k, v, beta, state))
    vn = beta.unsqueeze(-1) * (v - torch.einsum("bhkv,bhk->bhv", S, k))
    S = S + k.unsqueeze(-1) * vn.unsqueeze(-2)
    o = torch.einsum("bhkv,bhk->bhv", S, q)
    return o.to(out), S.to(out)


def gla_recurrent_fwd(q, k, v, gk, state, scale=None, compute_dtype=F64):
    """GLARecurrentFwd contract: S' = diag(exp gk) S + k v^T; o = scale S'^T q.

    q, k, gk [B,H,DK]; v [B,H,DV]; state [B,H,DK,DV]; scale <= 0 or None -> DK^-0.5.
    """
    out = q.dtype if compute_dtype != F64 else F64
    scale = q.shape[-1] ** -0.5 if scale is None or scale <= 0 else scale
    q, k, v, gk, S = (x.to(compute_dtype) for x in (q, k, v, gk, state))
    S = torch.exp(gk).unsqueeze(-1) * S + k.unsqueeze(-1) * v.unsqueeze(-2)
    o = torch.einsum("bhkv,bhk->bhv", S, q * scale)
    return o.to(out), S.to(out)


def gla_chunk_fwd(q, k, v, g, scale=None, initial_state=None, chunk_size=64):
    """GLAChunkFwd contract: q, k, g [B,T,H,K]; v [B,T,H,V]; initial_state [B,H,K,V] or None.

    Returns (o [B,T,H,V], final_state [B,H,K,V], h [B,NC+1,H,K,V]: state entering each
    chunk, h[:, NC] = final state), all fp64.
    """
    r = chunked_forward(_GLA_PLAIN, q, k, v, g, scale=scale, initial_state=initial_state,
                        chunk_size=chunk_size, intermediates=True)
    h = torch.cat([r["h"], r["final_state"].unsqueeze(1)], 1)
    return r["o"], r["final_state"], h


def gla_chunk_bwd(q, k, v, g, h, do, dht, scale=None, chunk_size=64):
    """GLAChunkBwd contract: gradients of sum(o*do) + sum(ht*dht) for the forward started
    from initial state h[:, 0]. Returns (dq, dk, dv, dg, dh0) in fp64."""
    xs = [x.detach().to(F64).requires_grad_(True) for x in (q, k, v, g, h[:, 0])]
    with torch.enable_grad():
        o, ht, _ = gla_chunk_fwd(*xs[:4], scale=scale, initial_state=xs[4], chunk_size=chunk_size)
        return torch.autograd.grad((o, ht), xs, (do.to(F64), dht.to(F64)))
