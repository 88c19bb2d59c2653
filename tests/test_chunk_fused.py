"""CPU check of the fused and three-stage forward pipelines (the plans of what the walk
does not run: the additive rule, the per-key gate, the delta rule's three-stage path):
fp64 fakes carry out each stage's formula through the plan's real buffers, bindings and
host tables (every launch checked against the traced kernel), reading what the earlier
stages stored; o and the final state must match the torch fp64 reference within f16
storage rounding (a wrong gate, head map, binding or layout is an O(1) error).

Stages emulated (``PipelineMath``): chunk_prepare (additive: gate cumsum, kn; per-key
gate: A_qk, qg, kg, g_last, w, u; chunk_prepare_states: kg, g_last), chunk_kkt_inverse + chunk_wu (the delta rule's
prepare), chunk_qk, chunk_state, chunk_state_output, chunk_output."""
import numpy as np
import pytest
import torch

from _kernel_check import fake_compiles
from test_chunk import by_name, record_plans

from linattn.dsl import Gate, Options, all_rule_gate_specs, value_gate_spec
from linattn.dsl import torch_reference as tr
from linattn.ops import chunk
from linattn.ops.registry import get_spec

F64 = torch.float64
C = 64
SIX = {s.name: s for s in all_rule_gate_specs()}
VALUE_GATE = value_gate_spec()


def _spec(name):
    if name == VALUE_GATE.name:
        return VALUE_GATE
    return SIX[name] if name in SIX else get_spec(name)


def _tril_decay(gc):
    """e^(gc_i - gc_j) on i >= j (0 above), gc [n] or [n, K] -> [n, n] or [n, n, K]."""
    d = gc[:, None] - gc[None, :]
    mask = torch.ones(gc.shape[0], gc.shape[0], dtype=torch.bool).tril()
    if d.dim() == 3:
        mask = mask[..., None]
    return torch.where(mask, d, torch.full_like(d, -torch.inf)).exp()


class PipelineMath:
    """fp64 formulas of the stages, as fake_compiles bodies (by argument name)."""

    def __init__(self, spec, H, HV, K, V):
        self.spec, self.H, self.HV, self.K, self.V = spec, H, HV, K, V
        self.group = HV // H
        self.key = spec.gate is Gate.KEY
        self.value = spec.gate.per_value        # (the columns of S decay)
        self.seen = {}

    # -- helpers ------------------------------------------------------------------------
    def effective(self, p, t0, n, q=None, k=None, g=None, beta=None, A_log=None,
                  dt_bias=None):
        """The reference's prepared chunk rows (l2norm, gate activation, beta), fp64,
        heads expanded to HV: (q [n, HV, K], k, gate log [n, HV, Kg] or None, beta)."""
        opts = Options(**{f: bool(p.get(f)) for f in ("l2norm_qk", "beta_sigmoid",
                                                     "allow_neg_eigval", "gate_in_kernel")})
        sl = lambda x: None if x is None else x[None, t0:t0 + n]  # noqa: E731
        k = k if k is not None else q
        q = q if q is not None else k
        dummy_v = torch.zeros(1, n, self.HV, 1)
        qe, ke, _, ge, be = tr.prepare(self.spec, opts, sl(q), sl(k), dummy_v,
                                       sl(g) if self.spec.has_gate else None,
                                       sl(beta) if self.spec.has_beta else None, 1.0,
                                       A_log, dt_bias)
        return qe[0], ke[0], None if ge is None else ge[0].cumsum(0), \
            None if be is None else be[0]

    def chunks(self, bos, lens):
        return list(enumerate(zip(bos.tolist(), lens.tolist())))

    def scalar_gate(self, g_cum, hv, ci, n):
        if not self.spec.has_gate:
            return torch.zeros(n, dtype=F64)
        return g_cum[hv, ci * C:ci * C + n].to(F64)

    # -- prepare stages ------------------------------------------------------------------
    def prepare(self, p, **a):
        if self.value:
            return self.prepare_value(p, **a)
        return self.prepare_key(p, **a) if self.key else self.prepare_additive(p, **a)

    def prepare_value(self, p, k, v, g, A_log, dt_bias, chunk_bos, chunk_len, g_cum, kn, u,
                      g_last, **_):
        """The value gate's prepare: g_cum [Ttot, HV, V], g_last [NT, HV, V], u = v e^(g_last
        - g_cum), kn."""
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            _, ke, G, _ = self.effective(p, t0, n, k=k, g=g, A_log=A_log, dt_bias=dt_bias)
            if p["l2norm_qk"]:
                kn[t0:t0 + n] = ke[:, ::self.group].to(kn.dtype)
            g_cum[t0:t0 + n] = G.to(g_cum.dtype)
            g_last[ci] = G[-1].to(g_last.dtype)
            u[t0:t0 + n] = (v[t0:t0 + n].to(F64) * (G[-1] - G).exp()).to(u.dtype)

    def step(self, p, g, step_A, step_bias, step_limit, t0, n):
        """The call terms' step (terms/step.py.jinja prepare_step): dt [n, HV] from the
        raw dt g carries, and the gate A dt as effective()'s cumsum [n, HV, 1]."""
        dt = g[t0:t0 + n].to(F64)
        if p.get("step_bias_on"):
            dt = dt + step_bias.to(F64)
        if p.get("step_softplus"):
            dt = tr.softplus_fla(dt)
        if p.get("step_clamp"):
            dt = dt.clamp(float(step_limit[0]), float(step_limit[1]))
        return dt, (dt * step_A.to(F64)).cumsum(0)[..., None]

    def prepare_additive(self, p, k, g, beta, A_log, dt_bias, chunk_bos, chunk_len, g_cum,
                         kn, **terms):
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            _, ke, gc, _ = self.effective(p, t0, n, k=k, g=g, A_log=A_log, dt_bias=dt_bias)
            if p.get("step_dt"):
                dt, gc = self.step(p, g, terms["step_A"], terms["step_bias"],
                                   terms["step_limit"], t0, n)
                if p.get("value_scale"):
                    terms["dt_c"][:, ci * C:(ci + 1) * C] = 0.0
                    terms["dt_c"][:, ci * C:ci * C + n] = dt.T.to(terms["dt_c"].dtype)
            if p["l2norm_qk"]:
                kn[t0:t0 + n] = ke[:, ::self.group].to(kn.dtype)
            if gc is not None:
                g_cum[:, ci * C:ci * C + n] = gc[..., 0].T.to(g_cum.dtype)
                g_cum[:, ci * C + n:(ci + 1) * C] = gc[-1, :, 0, None].to(g_cum.dtype)

    def prepare_key(self, p, q, k, v, g, beta, A_log, dt_bias, chunk_bos, chunk_len, aqk,
                    qg, kg, g_last, w, u):
        aqk.zero_()
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            qe, ke, G, be = self.effective(p, t0, n, q, k, g, beta, A_log, dt_bias)
            for hv in range(self.HV):
                qq, kk, Gh = qe[:, hv], ke[:, hv], G[:, hv]
                D = _tril_decay(Gh)                                     # [n, n, K]
                aqk[t0:t0 + n, hv, :n] = torch.einsum("ic,jc,ijc->ij", qq, kk, D).to(aqk.dtype)
                qg[t0:t0 + n, hv] = (qq * Gh.exp()).to(qg.dtype)
                kg[t0:t0 + n, hv] = (kk * (Gh[-1] - Gh).exp()).to(kg.dtype)
                g_last[ci, hv] = Gh[-1].to(g_last.dtype)
                if self.spec.has_beta:
                    b = be[:, hv]
                    M = (b[:, None] * torch.einsum("ic,jc,ijc->ij", kk, kk, D)).tril(-1)
                    X = torch.linalg.inv(torch.eye(n, dtype=F64) + M)
                    w[t0:t0 + n, hv] = (X @ (b[:, None] * kk * Gh.exp())).to(w.dtype)
                    u[t0:t0 + n, hv] = (X @ (b[:, None] * v[t0:t0 + n, hv].to(F64))).to(u.dtype)

    def prepare_states(self, p, q, k, v, g, beta, A_log, dt_bias, chunk_bos, chunk_len, kg,
                       g_last, w, u):
        """chunk_prepare_states (a recompute of the states alone): kg, g_last, nothing else."""
        self.seen["prepare_states"] = True
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            _, ke, G, _ = self.effective(p, t0, n, q, k, g, beta, A_log, dt_bias)
            for hv in range(self.HV):
                kg[t0:t0 + n, hv] = (ke[:, hv] * (G[-1, hv] - G[:, hv]).exp()).to(kg.dtype)
                g_last[ci, hv] = G[-1, hv].to(g_last.dtype)

    def kkt(self, p, q, k, g, beta, A_log, dt_bias, chunk_bos, chunk_len, g_cum, qn, kn, A,
            chunk_norm, A_out=None):
        """chunk_kkt_inverse (chunk_kkt_inverse_save: A itself into A_out as well)."""
        A.zero_()
        if A_out is not None:
            A_out.zero_()
        self.seen["kkt_a_beta"] = p.get("a_beta", True)
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            qe, ke, gc, be = self.effective(p, t0, n, q, k, g, beta, A_log, dt_bias)
            self._rows(p, qe, ke, gc, ci, t0, n, g_cum, qn, kn)
            for hv in range(self.HV):
                kk, b = ke[:, hv], be[:, hv]
                gh = gc[:, hv, 0] if gc is not None else torch.zeros(n, dtype=F64)
                M = (b[:, None] * (kk @ kk.T) * _tril_decay(gh)).tril(-1)
                X = torch.linalg.inv(torch.eye(n, dtype=F64) + M)
                Ab = X * b[None, :] if p.get("a_beta", True) else X
                A[t0:t0 + n, hv, :n] = Ab.to(A.dtype)
                if A_out is not None:
                    A_out[t0:t0 + n, hv, :n] = X.to(A_out.dtype)
                d = b * kk.pow(2).sum(-1)
                chunk_norm[hv, ci] = gh[-1] + (d - 1).clamp_min(1).log().sum()

    def _rows(self, p, qe, ke, gc, ci, t0, n, g_cum, qn, kn):
        """kkt's row outputs: qn, kn (l2norm_qk), the scalar gate's g_cum (rows past the
        chunk's length: its last row's)."""
        if p["l2norm_qk"]:
            kn[t0:t0 + n] = ke[:, ::self.group].to(kn.dtype)
            qn[t0:t0 + n] = qe[:, ::self.group].to(qn.dtype)
        if gc is not None:
            g_cum[:, ci * C:ci * C + n] = gc[..., 0].T.to(g_cum.dtype)
            g_cum[:, ci * C + n:(ci + 1) * C] = gc[-1, :, 0, None].to(g_cum.dtype)

    def kkt_rows(self, p, q, k, g, A_log, dt_bias, chunk_bos, chunk_len, g_cum, qn, kn):
        """chunk_bwd_kkt_rebuild: kkt's row outputs only (no beta, no inverse)."""
        beta = torch.ones(q.shape[0], self.HV, dtype=F64)
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            qe, ke, gc, _ = self.effective(p, t0, n, q, k, g, beta, A_log, dt_bias)
            self._rows(p, qe, ke, gc, ci, t0, n, g_cum, qn, kn)

    def wu(self, p, k, v, A, beta, chunk_bos, chunk_len, w, u, g_cum=None):
        """w = A_b e^g k, u = A_b v (a_beta=False: A_b = A diag(beta))."""
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            for hv in range(self.HV):
                Ab = A[t0:t0 + n, hv, :n].to(F64)
                if not p.get("a_beta", True):
                    Ab = Ab * beta[t0:t0 + n, hv].to(F64)[None, :]
                gh = self.scalar_gate(g_cum, hv, ci, n)
                kk = k[t0:t0 + n, hv // self.group].to(F64)
                w[t0:t0 + n, hv] = ((Ab * gh.exp()[None, :]) @ kk).to(w.dtype)
                u[t0:t0 + n, hv] = (Ab @ v[t0:t0 + n, hv].to(F64)).to(u.dtype)

    def qk(self, p, q, k, g_cum, chunk_bos, chunk_len, qg, aqk):
        self.seen["q_out"] = p.get("q_out", "gated")
        self.seen["per_key_head"] = per_key = p.get("per_key_head", False)
        aqk.zero_()
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            for hv in range(self.H if per_key else self.HV):
                hk = hv if per_key else hv // self.group
                qq = q[t0:t0 + n, hk].to(F64)
                qq = tr.l2norm(qq) if p["l2norm_qk"] else qq
                gc = torch.zeros(n, dtype=F64) if per_key else self.scalar_gate(g_cum, hv, ci, n)
                aqk[t0:t0 + n, hv, :n] = ((qq @ k[t0:t0 + n, hk].to(F64).T)
                                          * _tril_decay(gc)).to(aqk.dtype)
                if self.seen["q_out"] == "gated":
                    qg[t0:t0 + n, hv] = (qq * gc.exp()[:, None]).to(qg.dtype)
                elif self.seen["q_out"] == "normed" and (per_key or hv % self.group == 0):
                    qg[t0:t0 + n, hk] = qq.to(qg.dtype)

    # -- the state pass and the output ----------------------------------------------------
    def _chunk_step(self, p, k, u, w, g_cum, ci, t0, n, hv, S, kb=slice(None)):
        """(v_new, S after chunk ci) for key rows kb of S (the additive rule's rows are
        independent; the delta rule's S is whole), with the state passes' roundings to the
        input dtype: the kernels' w S takes S in the input dtype, and k^T v_new the
        (decayed) v_new."""
        lp = lambda x: x.to(u.dtype).to(F64)  # noqa: E731
        kk = k[t0:t0 + n, hv if self.key else hv // self.group, kb].to(F64)
        uu = u[t0:t0 + n, hv].to(F64)
        if p.get("value_scale"):            # the call terms' dt x (dt_c: chunk_prepare's)
            uu = uu * self.dt_c[hv, ci * C:ci * C + n].to(F64)[:, None]
        vn = uu - w[t0:t0 + n, hv].to(F64) @ lp(S) if self.spec.has_beta else uu
        if self.key:
            return vn, g_cum[ci, hv, kb].to(F64).exp()[:, None] * S + kk.T @ lp(vn)
        if self.value:          # (u: v gated by chunk_prepare, g_cum: g_last [NT, HV, V])
            return vn, S * g_cum[ci, hv].to(F64).exp()[None, :] + kk.T @ lp(vn)
        gc = self.scalar_gate(g_cum, hv, ci, n)
        return vn, gc[-1].exp() * S + kk.T @ lp((gc[-1] - gc).exp()[:, None] * vn)

    def _chunk_decay(self, g_cum, ci, n, hv):
        """The log decay of chunk ci over all K (additive summaries' G)."""
        if self.key or self.value:
            return g_cum[ci, hv].to(F64)
        return self.scalar_gate(g_cum, hv, ci, n)[-1].expand(self.K)

    def _start(self, p, h0, hv, a, extra):
        """The state entering piece a: h0 of its sequence (seg_seq), chained with the
        summaries of its sequence's earlier pieces (segment_starts)."""
        S = torch.zeros(self.K, self.V, dtype=F64)
        m = int(extra["seg_seq"][a]) if "seg_seq" in extra else a
        if p["has_initial_state"]:
            S = h0[m, hv].to(F64)
            S = S.T if p["state_v_first"] else S
        if p.get("segment_starts"):
            for s in range(int(extra["seg_first"][a]), a):
                if self.spec.has_gate:
                    d = extra["seg_decay"][s, hv].to(F64).exp()
                    S = S * d[None, :] if self.value else d[:, None] * S
                S = S + extra["seg_state"][s, hv].to(F64)
        return S, m

    def _walk(self, p, k, w, u, g_cum, cu_seqlens, chunk_offsets, h0, on_chunk, extra):
        """The sequential pass over the pieces (sequences or segments); on_chunk(ci, t0, n,
        hv, S, vn) per chunk; yields (piece, sequence, hv, final S, chunks walked). The
        additive rule's state is walked tile by tile (block_k x block_v), as its CTAs do."""
        cu, c0s = cu_seqlens.tolist(), chunk_offsets.tolist()
        BK = p.get("block_k") or self.K
        self.seen.setdefault("block_k", set()).add(BK)
        for a in range(len(cu) - 1):
            for hv in range(self.HV):
                S, m = self._start(p, h0, hv, a, extra)
                starts = range(cu[a], cu[a + 1], C)
                for j, t0 in enumerate(starts):
                    ci, n = c0s[a] + j, min(C, cu[a + 1] - t0)
                    if self.spec.has_beta:
                        vn, S_next = self._chunk_step(p, k, u, w, g_cum, ci, t0, n, hv, S)
                    else:
                        S_next = S.clone()
                        for ik in range(self.K // BK):
                            kb = slice(ik * BK, (ik + 1) * BK)
                            vn, S_next[kb] = self._chunk_step(p, k, u, w, g_cum, ci, t0, n,
                                                              hv, S[kb], kb)
                    on_chunk(ci, t0, n, hv, S, vn, m)
                    S = S_next
                yield a, m, hv, (S.T if p["state_v_first"] else S), len(starts)

    def _final_row(self, p, extra, a, m, c0, walked):
        """ht's row of piece a's final state (None: a segment before its sequence's end)."""
        row = int(extra["final_row"][a]) if "final_row" in extra else a
        if row < 0:
            return None
        return row + (c0 + walked if p.get("states_out") else 0)

    def summary(self, p, k, u, g_cum, cu_seqlens, chunk_offsets, map_seg, seg_state,
                seg_decay, dt_c=None, **_):
        """chunk_state_summary: each mapped segment walked from zero (B) and its log decay
        (G); the others' rows are left as they were (NaN in the tests)."""
        self.seen["summary"] = dict(p)
        self.dt_c = dt_c
        h0, mapped = torch.zeros(1), set(map_seg.tolist())
        cu, c0s = cu_seqlens.tolist(), chunk_offsets.tolist()
        for a, _, hv, S, walked in self._walk(dict(p, has_initial_state=False,
                                                   state_v_first=False), k, None, u, g_cum,
                                              cu_seqlens, chunk_offsets, h0,
                                              lambda *_: None, {}):
            if a not in mapped:
                continue
            seg_state[a, hv] = S.to(seg_state.dtype)
            if self.spec.has_gate:
                G = sum((self._chunk_decay(g_cum, c0s[a] + j, min(C, cu[a + 1] - cu[a] - j * C),
                                           hv) for j in range(walked)),
                        torch.zeros(self.V if self.value else self.K, dtype=F64))
                seg_decay[a, hv] = G.to(seg_decay.dtype)

    def state(self, p, k, w, u, g_cum, cu_seqlens, chunk_offsets, h0, h, v_new, ht, **extra):
        self.seen["state"] = dict(p)
        self.dt_c = extra.get("dt_c")

        def on_chunk(ci, t0, n, hv, S, vn, m):
            if p.get("h_out", True):           # (states_only: f32 ht alone)
                h[ci, hv] = S.to(h.dtype)      # h [NT, HV, K, V] whatever the state layout
            if self.spec.has_beta:
                v_new[t0:t0 + n, hv] = vn.to(v_new.dtype)
            if p.get("states_out"):
                ht[ci + m, hv] = S.T if p["state_v_first"] else S
        for a, m, hv, S, walked in self._walk(p, k, w, u, g_cum, cu_seqlens, chunk_offsets,
                                              h0, on_chunk, extra):
            row = self._final_row(p, extra, a, m, int(chunk_offsets[a]), walked)
            if p["output_final_state"] and row is not None:
                ht[row, hv] = S

    def state_output(self, p, k, w, u, g_cum, cu_seqlens, chunk_offsets, h0, ht, qg, aqk, o,
                     scale, **extra):
        self.seen["q_gated"] = p.get("q_gated", True)
        self.seen["qg_heads"] = qg.shape[1]
        self.seen["state_output"] = dict(p)
        self.dt_c = extra.get("dt_c")

        def on_chunk(ci, t0, n, hv, S, vn, m):
            if p.get("states_out"):
                ht[ci + m, hv] = S.T if p["state_v_first"] else S
            if self.seen["q_gated"]:
                qq = qg[t0:t0 + n, hv].to(F64)
            else:       # q itself (or its normed copy) per key head, gated here
                qq = qg[t0:t0 + n, hv // self.group].to(F64)
                qq = qq * self.scalar_gate(g_cum, hv, ci, n).exp()[:, None]
            if p.get("aqk_per_key_head"):   # the key head's pairs, this head's decay
                pairs = (aqk[t0:t0 + n, hv // self.group, :n].to(F64)
                         * _tril_decay(self.scalar_gate(g_cum, hv, ci, n)))
            else:
                pairs = aqk[t0:t0 + n, hv, :n].to(F64)
            oo = self.terms_out(p, scale * (qq @ S + pairs @ vn), u, t0, n, hv, extra)
            o[t0:t0 + n, hv] = oo.to(o.dtype)
        for a, m, hv, S, walked in self._walk(p, k, w, u, g_cum, cu_seqlens, chunk_offsets,
                                              h0, on_chunk, extra):
            row = self._final_row(p, extra, a, m, int(chunk_offsets[a]), walked)
            if p["output_final_state"] and row is not None:
                ht[row, hv] = S

    def terms_out(self, p, oo, x, t0, n, hv, terms):
        """The call terms on a chunk's output (terms/step.py.jinja chunk_output): + D x
        (x the raw values), * silu(z)."""
        if p.get("skip"):
            oo = oo + terms["skip_D"][hv].to(F64) * x[t0:t0 + n, hv].to(F64)
        if p.get("output_gate"):
            oo = oo * torch.nn.functional.silu(terms["gate_z"][t0:t0 + n, hv].to(F64))
        return oo

    def output(self, p, q, k, v_new, h, g_cum, chunk_bos, chunk_len, o, scale, **terms):
        for ci, (t0, n) in self.chunks(chunk_bos, chunk_len):
            for hv in range(self.HV):
                hh = h[ci, hv].to(F64)
                vn = v_new[t0:t0 + n, hv].to(F64)
                if p.get("value_scale"):    # dt x, rounded to the input dtype (v_s)
                    dt = terms["dt_c"][hv, ci * C:ci * C + n].to(F64)
                    vn = (vn * dt[:, None]).to(v_new.dtype).to(F64)
                if self.key:            # q <- qg, k <- A_qk (chunk_prepare's), g_cum unused
                    oo = q[t0:t0 + n, hv].to(F64) @ hh + k[t0:t0 + n, hv, :n].to(F64) @ vn
                elif self.value:        # g_cum [Ttot, HV, V]: per row and value channel
                    hk = hv // self.group
                    qq = q[t0:t0 + n, hk].to(F64)
                    qq = tr.l2norm(qq) if p["l2norm_qk"] else qq
                    G = g_cum[t0:t0 + n, hv].to(F64)
                    P = qq @ k[t0:t0 + n, hk].to(F64).T
                    oo = G.exp() * (qq @ hh) + torch.einsum("ij,jc,ijc->ic", P, vn,
                                                            _tril_decay(G))
                else:
                    hk = hv // self.group
                    qq = q[t0:t0 + n, hk].to(F64)
                    qq = tr.l2norm(qq) if p["l2norm_qk"] else qq
                    gc = self.scalar_gate(g_cum, hv, ci, n)
                    P = (qq @ k[t0:t0 + n, hk].to(F64).T) * _tril_decay(gc)
                    oo = (qq * gc.exp()[:, None]) @ hh + P @ vn
                oo = self.terms_out(p, scale * oo, v_new, t0, n, hv, terms)
                o[t0:t0 + n, hv] = oo.to(o.dtype)

    def body(self, spec, stage, params):
        fn = {"chunk_prepare": self.prepare, "chunk_prepare_states": self.prepare_states,
              "chunk_kkt_inverse": self.kkt,
              "chunk_kkt_inverse_save": self.kkt, "chunk_bwd_kkt_rebuild": self.kkt_rows,
              "chunk_wu": self.wu,
              "chunk_qk": self.qk, "chunk_state": self.state,
              "chunk_state_summary": self.summary,
              "chunk_state_output": self.state_output, "chunk_output": self.output}[stage]
        return by_name({stage: fn})(spec, stage, params)


def make_inputs(spec, options, lens, H, HV, K, V, seed=0, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()])
    q, k = rnd(1, T, H, K), rnd(1, T, H, K)
    if not options.l2norm_qk:
        q, k = tr.l2norm(q), tr.l2norm(k)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=rnd(1, T, HV, V).to(dtype), g=None, beta=None,
             A_log=None, dt_bias=None, initial_state=0.1 * rnd(N, HV, K, V), cu_seqlens=cu,
             cu_seqlens_cpu=cu)
    if options.state_v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    if spec.has_beta:
        b = rnd(1, T, HV)
        x["beta"] = (b if options.beta_sigmoid else torch.sigmoid(b)).to(dtype)
    if spec.has_gate:
        shape = spec.gate_shape(1, T, HV, K, V)
        if options.gate_in_kernel:
            x["g"] = rnd(*shape)
            x["A_log"] = torch.rand(HV, generator=gen) - 2
            x["dt_bias"] = torch.rand(HV * spec.gate.n_channels(K, V), generator=gen)
        else:
            x["g"] = torch.nn.functional.logsigmoid(rnd(*shape) + 3)
    return x


def run_pipeline(monkeypatch, name, options, lens, config, H=2, HV=4, K=64, V=32,
                 final=True, kernel_K=None):
    """chunk_forward through the fp64 fakes; (o, ht, reference (o, ht), the fakes' notes,
    the plan). kernel_K: the K the kernels run at (the op pads K up to it)."""
    spec = _spec(name)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    math = PipelineMath(spec, H, HV, kernel_K or K, V)
    fake_compiles(monkeypatch, math.body)
    plans = record_plans(monkeypatch)
    x = make_inputs(spec, options, lens, H, HV, K, V)
    o, ht = chunk.chunk_forward(spec, **{n: x[n] for n in ("q", "k", "v", "g", "beta")},
                                initial_state=x["initial_state"], output_final_state=final,
                                options=options, cu_seqlens=x["cu_seqlens"],
                                cu_seqlens_cpu=x["cu_seqlens_cpu"], A_log=x["A_log"],
                                dt_bias=x["dt_bias"], config=config)
    ref = tr.chunked_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"], options=options,
                             initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                             A_log=x["A_log"], dt_bias=x["dt_bias"])
    return o, ht, ref, math.seen, plans[0]


def _rel(a, b):
    return ((a.to(F64) - b).norm() / b.norm()).item()


LENS = [1, 70, 0, 5, 130]
CASES = [
    ("additive_none", Options()), ("additive_none", Options(l2norm_qk=True)),
    ("additive_scalar", Options()),
    ("additive_scalar", Options(l2norm_qk=True, gate_in_kernel=True, state_v_first=True)),
    ("gla", Options()), ("gla", Options(state_v_first=True)),
    ("kda", Options()),
    ("kda", Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True,
                    gate_in_kernel=True)),
    ("additive_key", Options(gate_in_kernel=True)),
    ("delta_key", Options(l2norm_qk=True, state_v_first=True)),
]


def _ids(cases):
    return [f"{n}-" + ("-".join(f for f in ("l2norm_qk", "beta_sigmoid", "gate_in_kernel",
                                            "state_v_first") if getattr(o, f)) or "plain")
            for n, o in cases]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "3stage"])
@pytest.mark.parametrize("name,options", CASES, ids=_ids(CASES))
def test_pipeline_matches_reference(monkeypatch, name, options, fused):
    heads = dict(H=4) if name == "gla" else {}          # (GLA has no GVA)
    o, ht, (o_ref, ht_ref), seen, plan = run_pipeline(monkeypatch, name, options, LENS,
                                                      {"fused": fused}, **heads)
    assert plan.name == ("fused" if fused else "three-stage"), str(plan)
    if fused and _spec(name).gate is not Gate.KEY:
        # chunk_qk writes A_qk only (the normed q with l2norm); the state pass reads q per
        # key head and gates its rows itself
        assert seen["q_out"] == ("normed" if options.l2norm_qk else "none")
        assert seen["q_gated"] is False and seen["qg_heads"] == 2      # H, not HV
    assert _rel(o, o_ref) < 5e-3
    assert _rel(ht, ht_ref) < 5e-3


DELTA_CASES = [
    ("gdn", Options()), ("deltanet", Options(l2norm_qk=True)),
    ("gdn", Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True,
                    gate_in_kernel=True, state_v_first=True)),
]


@pytest.mark.parametrize("name,options", DELTA_CASES, ids=_ids(DELTA_CASES))
def test_delta_three_stage_matches_reference(monkeypatch, name, options):
    """The delta rule forced off the walk: chunk_kkt_inverse -> chunk_wu -> chunk_state ->
    chunk_output."""
    o, ht, (o_ref, ht_ref), seen, plan = run_pipeline(monkeypatch, name, options, LENS,
                                                      {"fused": False}, K=64, V=64)
    assert plan.stages() == ["chunk_kkt_inverse", "chunk_wu", "chunk_state", "chunk_output"]
    assert seen["kkt_a_beta"] is True
    assert _rel(o, o_ref) < 5e-3
    assert _rel(ht, ht_ref) < 5e-3


@pytest.mark.parametrize("K,V", [(128, 32), (64, 48)])
def test_delta_three_stage_at_narrow_heads(monkeypatch, K, V):
    """V not a multiple of 64: chunk_wu's column block divides both (the state pass takes
    K in 64s, codegen/arch/sm90/stages.py STATE_K_MULTIPLE)."""
    o, ht, (o_ref, ht_ref), _, plan = run_pipeline(monkeypatch, "gdn", Options(), LENS,
                                                   {"fused": False}, K=K, V=V)
    assert _rel(o, o_ref) < 5e-3 and _rel(ht, ht_ref) < 5e-3


@pytest.mark.parametrize("name,options", [
    ("gla", Options()), ("kda", Options(l2norm_qk=True, gate_in_kernel=True)),
    ("additive_scalar", Options(state_v_first=True))])
def test_padded_k(monkeypatch, name, options):
    """K = 48 (not a multiple of the state pass's 64): the op runs the kernels at K = 64
    with zero channels (q, k, the per-key gate and dt_bias, the initial state) and cuts
    the final state back; o and ht match the reference at K = 48."""
    o, ht, (o_ref, ht_ref), _, plan = run_pipeline(monkeypatch, name, options, LENS, {},
                                                   HV=2, K=48, kernel_K=64)
    assert {la.kwargs["K"] for la in plan.launches if "K" in la.kwargs} == {64}
    assert ht.shape == ht_ref.shape
    assert _rel(o, o_ref) < 5e-3 and _rel(ht, ht_ref) < 5e-3


def test_default_plans_match_reference(monkeypatch):
    """The arch's own choice (many chains: fused) for GLA at 16 value heads."""
    o, ht, (o_ref, ht_ref), _, plan = run_pipeline(monkeypatch, "gla", Options(), [3, 90],
                                                   {}, H=8, HV=8, K=64, V=16)
    assert plan.name == "fused"
    assert _rel(o, o_ref) < 5e-3 and _rel(ht, ht_ref) < 5e-3
