"""CPU check of the delta rule's walk pipeline (chunk_kkt_inverse -> [chunk_walk_map ->
chunk_segment_combine ->] chunk_walk): fp64 fakes carry out each stage's formula through
the real buffers, bindings and host tables of the plan (every launch's arguments checked
against the traced kernels), so the plan, the sequence split's tables, the warm-up rule
and the combine are checked against the fp64 reference; the kernels themselves are
checked on the GPU (tests/test_chunk_fwd_gpu.py)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _kernel_check import fake_compiles

from linattn.dsl import Options
from linattn.dsl import torch_reference as tr
from linattn.ops import chunk, runtime
from linattn.ops.registry import get_spec

F64 = torch.float64
C = 64


def _l2(x):
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()


def _step(kk, vv, Ab, gc, S):
    """One chunk of the walk (rows valid only): (Vd, S after the chunk)."""
    Vd = Ab @ (vv - gc.exp()[:, None] * (kk @ S))
    return Vd, gc[-1].exp() * S + ((gc[-1] - gc).exp()[:, None] * kk).T @ Vd


def _wy(spec, p, kk, b, gg, A_log, dt_bias):
    """A chunk's (gate cumsum gc [rows], X = (I + L)^-1) in fp64 from its keys and raw beta
    and gate rows, as chunk_kkt_inverse (and chunk_walk_fused) form them."""
    rows = kk.shape[0]
    if p["beta_sigmoid"]:
        b = b.sigmoid() * (2 if p["allow_neg_eigval"] else 1)
    gc = torch.zeros(rows, dtype=F64)
    if spec.has_gate:
        if p["gate_in_kernel"]:
            gg = -A_log.to(F64).exp() * F.softplus(gg + dt_bias.to(F64))
        gc = gg.cumsum(0)
    G = (gc[:, None] - gc[None, :]).exp()
    M = torch.eye(rows, dtype=F64) + (b[:, None] * (kk @ kk.T) * G).tril(-1)
    return gc, b, torch.linalg.inv(M)


def _start(p, h0, n, hv, K, V):
    """Sequence n's state entering its first chunk (K-first, fp64)."""
    if not p["has_initial_state"]:
        return torch.zeros(K, V, dtype=F64)
    S = h0[n, hv].to(F64)
    return S.T if p["state_v_first"] else S


class Walk:
    """The fakes' shared state: the sizes, chunk_kkt_inverse's outputs in fp64 (the later
    fakes read these after checking that the buffers hold them rounded: the buffers'
    rounding is the kernels' business, the pipeline's arithmetic is checked in fp64), and
    what the split's stages wrote."""

    def __init__(self, spec, H, HV, K, V):
        self.spec, self.H, self.HV, self.K, self.V = spec, H, HV, K, V
        self.group = HV // H
        self.seen = {}

    def exact(self, name, buf, *index):
        """The fp64 value of buf[index] that chunk_kkt_inverse wrote (checked)."""
        x = self.f64[name][index]
        tol = 1e-3 * x.abs().max().item() + 1e-6
        assert (buf[index].to(F64) - x).abs().max().item() <= tol, name
        return x

    def gate(self, g_cum, hv, ci, rows):
        if not self.spec.has_gate:
            return torch.zeros(rows, dtype=F64)
        return g_cum[hv, ci * C:ci * C + rows].to(F64)

    def kkt(self, p):
        def run(q, k, g, beta, A_log, dt_bias, bos, lens, g_cum, qn, kn, A, chunk_norm,
                A_out=None):        # (A_out: chunk_kkt_inverse_save's A itself)
            A.zero_()
            if A_out is not None:
                A_out.zero_()
            self.f64 = dict(a=torch.zeros(A.shape, dtype=F64), q=q.to(F64), k=k.to(F64))
            for ci, (t0, rows) in enumerate(zip(bos.tolist(), lens.tolist())):
                for hv in range(self.HV):
                    hk = hv // self.group
                    kk, qq = k[t0:t0 + rows, hk].to(F64), q[t0:t0 + rows, hk].to(F64)
                    if p["l2norm_qk"]:
                        kk, qq = _l2(kk), _l2(qq)
                        self.f64["k"][t0:t0 + rows, hk], self.f64["q"][t0:t0 + rows, hk] = kk, qq
                        if hv % self.group == 0:
                            kn[t0:t0 + rows, hk] = kk.to(kn.dtype)
                            qn[t0:t0 + rows, hk] = qq.to(qn.dtype)
                    gg = g[t0:t0 + rows, hv].to(F64) if self.spec.has_gate else None
                    gr, b, X = _wy(self.spec, p, kk, beta[t0:t0 + rows, hv].to(F64), gg,
                                   A_log[hv], dt_bias[hv])
                    gc = torch.zeros(C, dtype=F64)
                    if self.spec.has_gate:
                        gc[:rows], gc[rows:] = gr, gr[-1]
                        g_cum[hv, ci * C:(ci + 1) * C] = gc.to(g_cum.dtype)
                    Ab = X * b[None, :]
                    self.f64["a"][t0:t0 + rows, hv, :rows] = Ab
                    A[t0:t0 + rows, hv, :rows] = Ab.to(A.dtype)
                    if A_out is not None:
                        A_out[t0:t0 + rows, hv, :rows] = X.to(A_out.dtype)
                    d = b * kk.pow(2).sum(-1)
                    chunk_norm[hv, ci] = gc[rows - 1] + (d - 1).clamp_min(1).log().sum()
        return run

    def walk(self, p):
        v_first = p["state_v_first"]

        def run(q, k, v, a, g_cum, cu, c0s, h0, final_row, ht, h, o, scale):
            cu, c0s = cu.tolist(), c0s.tolist()
            for n in range(len(cu) - 1):
                for hv in range(self.HV):
                    hk = hv // self.group
                    S = _start(p, h0, n, hv, self.K, self.V)
                    for ci, t0 in enumerate(range(cu[n], cu[n + 1], C)):
                        rows = min(C, cu[n + 1] - t0)
                        gc = self.gate(g_cum, hv, c0s[n] + ci, rows)
                        rs = slice(t0, t0 + rows)
                        if p.get("states_out"):     # the state entering the chunk, K-first
                            h[c0s[n] + ci, hv] = S.to(h.dtype)
                        qq, kk = self.exact("q", q, rs, hk), self.exact("k", k, rs, hk)
                        Ab = self.exact("a", a, rs, hv)[:, :rows]
                        Vd, S_next = _step(kk, v[t0:t0 + rows, hv].to(F64), Ab, gc, S)
                        P = (qq @ kk.T).tril() * (gc[:, None] - gc[None, :]).exp()
                        oo = scale * (gc.exp()[:, None] * (qq @ S) + P.tril() @ Vd)
                        o[t0:t0 + rows, hv] = oo.to(o.dtype)
                        S = S_next
                    if p["output_final_state"] and final_row[n] >= 0:
                        ht[final_row[n], hv] = (S.T if v_first else S).to(ht.dtype)
        return run

    def walk_map(self, p):
        bound = chunk.stage_module(self.spec, "chunk_walk_map").WARMUP_LOG_BOUND

        def run(k, v, a, g_cum, chunk_norm, seg_cu, seg_c0, map_seg, seg_map, exact):
            K = self.K
            for s in map_seg.tolist():
                b, L, c0 = int(seg_cu[s]), int(seg_cu[s + 1] - seg_cu[s]) // C, int(seg_c0[s])
                for hv in range(self.HV):
                    warm, acc, formed = L, 0.0, True
                    for j in range(L):
                        if self.spec.has_gate and formed:
                            acc += float(chunk_norm[hv, c0 + L - 1 - j])
                            if acc <= bound:
                                warm, formed = j + 1, False
                    exact[s, hv] = int(formed)
                    M = torch.eye(K, dtype=F64)
                    B = torch.zeros(K, self.V, dtype=F64)
                    for ci in range(L):
                        t0, hk = b + ci * C, hv // self.group
                        kk = self.exact("k", k, slice(t0, t0 + C), hk)
                        Ab = self.exact("a", a, slice(t0, t0 + C), hv)
                        gc = self.gate(g_cum, hv, c0 + ci, C)
                        if formed:
                            M = _step(kk, torch.zeros(C, K, dtype=F64), Ab, gc, M)[1]
                        if ci >= L - warm:
                            B = _step(kk, v[t0:t0 + C, hv].to(F64), Ab, gc, B)[1]
                    if formed:
                        seg_map[s, hv, :, :K] = M.to(seg_map.dtype)
                    seg_map[s, hv, :, K:] = B.to(seg_map.dtype)
            self.seen["exact"] = exact[map_seg.long()].clone()
        return run

    def combine(self, p):
        v_first = p["state_v_first"]

        def run(seg_map, exact, seq_seg, h0, starts, ht):
            K, seq_seg = self.K, seq_seg.tolist()
            for n in range(len(seq_seg) - 1):
                for hv in range(self.HV):
                    S = torch.zeros(K, self.V, dtype=F64)
                    if p["has_initial_state"]:
                        S = h0[n, hv].to(F64).T if v_first else h0[n, hv].to(F64)
                    for s in range(seq_seg[n], seq_seg[n + 1]):
                        starts[s, hv] = (S.T if v_first else S).to(starts.dtype)
                        B = seg_map[s, hv, :, K:].to(F64)
                        S = (seg_map[s, hv, :, :K].to(F64) @ S if exact[s, hv] else 0) + B
            self.seen["starts"] = starts.clone()
        return run

    def walk_fused(self, p):
        """chunk_walk_fused: each chunk's gate cumsum and A_b from the raw g, beta (as
        chunk_kkt_inverse forms them), then the walk's step, in fp64."""
        v_first = p["state_v_first"]

        def run(q, k, v, g, beta, A_log, dt_bias, cu, h0, final_row, ht, o, scale):
            cu = cu.tolist()
            for n in range(len(cu) - 1):
                for hv in range(self.HV):
                    hk = hv // self.group
                    S = _start(p, h0, n, hv, self.K, self.V)
                    for t0 in range(cu[n], cu[n + 1], C):
                        rs = slice(t0, min(t0 + C, cu[n + 1]))
                        qq, kk = q[rs, hk].to(F64), k[rs, hk].to(F64)
                        gg = g[rs, hv].to(F64) if self.spec.has_gate else None
                        gc, b, X = _wy(self.spec, p, kk, beta[rs, hv].to(F64), gg, A_log[hv],
                                       dt_bias[hv])
                        Vd, S_next = _step(kk, v[rs, hv].to(F64), X * b[None, :], gc, S)
                        P = (qq @ kk.T).tril() * (gc[:, None] - gc[None, :]).exp()
                        oo = scale * (gc.exp()[:, None] * (qq @ S) + P @ Vd)
                        o[rs, hv] = oo.to(o.dtype)
                        S = S_next
                    if p["output_final_state"] and final_row[n] >= 0:
                        ht[final_row[n], hv] = (S.T if v_first else S).to(ht.dtype)
        return run

    def body(self, spec, stage, params):
        return {"chunk_kkt_inverse": self.kkt, "chunk_kkt_inverse_save": self.kkt,
                "chunk_walk": self.walk, "chunk_walk_fused": self.walk_fused,
                "chunk_walk_map": self.walk_map,
                "chunk_segment_combine": self.combine}[stage](params)


def _inputs(spec, options, lens, H, HV, K, V, gate_scale=1.0, key_scale=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    T, N, dt = sum(lens), len(lens), torch.float16
    cu = torch.tensor([0, *np.cumsum(lens).tolist()])
    q, k = rnd(1, T, H, K), rnd(1, T, H, K)
    if not options.l2norm_qk:
        q, k = _l2(q), _l2(k)
    if key_scale is not None:
        k = k * key_scale
    x = dict(q=q.to(dt), k=k.to(dt), v=rnd(1, T, HV, V).to(dt), g=None, A_log=None,
             dt_bias=None, h0=0.1 * rnd(N, HV, K, V))
    b = rnd(1, T, HV)
    x["beta"] = (b if options.beta_sigmoid else torch.sigmoid(b)).to(dt)
    if spec.has_gate:
        if options.gate_in_kernel:
            x["g"] = rnd(1, T, HV)
            x["A_log"], x["dt_bias"] = torch.rand(HV, generator=gen), torch.rand(HV, generator=gen)
        else:
            x["g"] = gate_scale * F.logsigmoid(rnd(1, T, HV) + 2)
    return x, cu


def _run(monkeypatch, name, options, lens, config, H=2, HV=4, K=64, V=32, save_states=False,
         **kw):
    spec = get_spec(name)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    walk = Walk(spec, H, HV, K, V)
    calls = []
    fake_compiles(monkeypatch, walk.body, calls)
    x, cu = _inputs(spec, options, lens, H, HV, K, V, **kw)
    h0 = x["h0"].transpose(-1, -2).contiguous() if options.state_v_first else x["h0"]
    o, ht, *out = chunk.chunk_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                initial_state=h0, output_final_state=True, options=options,
                                cu_seqlens=cu, cu_seqlens_cpu=cu, A_log=x["A_log"],
                                dt_bias=x["dt_bias"], config=config, save_states=save_states)
    ref = tr.chunked_forward(spec, x["q"], x["k"], x["v"], x["g"], x["beta"], options=options,
                             initial_state=h0, cu_seqlens=cu, A_log=x["A_log"],
                             dt_bias=x["dt_bias"], intermediates=True)
    return o, ht, ref, walk.seen, [s for s, _ in calls], out


def _rel(a, b):
    return ((a.to(F64) - b).norm() / b.norm()).item()


LENS = [1, 70, 0, 5, 400]           # an empty and a one-token sequence among them


@pytest.mark.parametrize("name,options,kw,exact", [
    ("gdn", Options(), {}, "some"),                                  # strong gates: warm-up
    ("gdn", Options(), dict(gate_scale=1e-2), "all"),                # weak gates: the maps
    ("deltanet", Options(), {}, "all"),                              # no gate: the maps
    ("gdn", Options(), dict(key_scale=3.0), "all"),                  # |k|^2 beta > 2: maps
    ("gdn", Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True,
                    gate_in_kernel=True, state_v_first=True), {}, None),
    ("deltanet", Options(l2norm_qk=True, state_v_first=True), {}, "all"),
], ids=["gdn", "gdn-weak", "deltanet", "gdn-expanding", "gdn-options", "deltanet-options"])
@pytest.mark.parametrize("config", [{}, {"segments": 2}, {"segments": 1, "block_v": 16}],
                         ids=["model", "L2", "L1"])
def test_walk_pipeline_matches_reference(monkeypatch, name, options, kw, exact, config):
    key_scale = kw.get("key_scale")
    o, ht, ref, seen, stages, _ = _run(monkeypatch, name, options, LENS, config, **kw)
    split = "segments" in config
    assert stages[:1] == ["chunk_kkt_inverse"] and stages[-1] == "chunk_walk"
    assert ("chunk_walk_map" in stages) == split
    if key_scale is None:        # (expanding keys: the recurrence itself grows large)
        assert _rel(o, ref["o"]) < 2e-3
    assert _rel(ht, ref["final_state"]) < 1e-6      # (f32 storage; fp64 arithmetic)
    if not split:
        return
    L = config["segments"]
    cu = np.concatenate([[0], np.cumsum(LENS)])
    starts = seen["starts"].to(F64)
    if options.state_v_first:
        starts = starts.transpose(-1, -2)
    h, s, c = ref["h"][0], 0, 0
    for b, e in zip(cu[:-1], cu[1:]):
        nc = -(-(e - b) // C)
        for j in range(max(1, -(-nc // L))):
            if j * L < nc:       # the exact state entering segment j (chunk c + j L)
                want = h[c + j * L]
                err = ((starts[s] - want).norm() / want.norm().clamp_min(1e-30)).item()
                assert err < 5e-6, (s, err)     # f32 storage (and at most 2^-23 dropped)
            s += 1
        c += max(nc, 1)          # (the reference gives an empty sequence one state row)
    mapped = seen["exact"].bool()
    if exact == "all":
        assert mapped.all()
    elif exact == "some" and L >= 2:     # (GDN's gates: ~ -8 a chunk, 2 chunks reach e^-16)
        assert not mapped.all()


@pytest.mark.parametrize("name,options", [
    ("gdn", Options()), ("deltanet", Options(l2norm_qk=True, state_v_first=True))],
    ids=["gdn", "deltanet-options"])
@pytest.mark.parametrize("config", [{}, {"segments": 2}], ids=["model", "L2"])
def test_walk_saves_every_chunks_state(monkeypatch, name, options, config):
    """save_states (training): h [NT, HV, K, V] in q's dtype, K-first in either state
    layout, sequence n's chunk c at row chunk_offsets[n] + c: the reference's state
    entering that chunk (rounded once to f16; the split's segments from their combined
    starts, each chunk stored once); and A_inv [Ttot, HV, 64], the WY inverse without
    beta (chunk_kkt_inverse_save), the reference's A."""
    o, ht, ref, seen, stages, (saved,) = _run(monkeypatch, name, options, LENS, config,
                                              save_states=True)
    assert list(saved) == ["h", "A_inv"]
    h = saved["h"]
    assert stages[0] == "chunk_kkt_inverse_save"
    assert stages[-1] == "chunk_walk" and ("chunk_walk_map" in stages) == bool(config)
    A = saved["A_inv"]
    assert A.shape == (sum(LENS), 4, C) and A.dtype == torch.float16
    assert _rel(A, ref["A"][0]) < 2e-3
    assert h.dtype == torch.float16 and h.shape == (sum(-(-n // C) for n in LENS), 4, 64, 32)
    want, row, c = ref["h"][0], 0, 0        # (K-first, as h)
    for n in LENS:
        for j in range(-(-n // C)):
            err = ((h[row + j].to(F64) - want[c + j]).abs().max()
                   / want[c + j].abs().max().clamp_min(1e-30)).item()
            assert err < 2e-3, (row + j, err)       # (f16 storage)
        row, c = row + -(-n // C), c + max(-(-n // C), 1)   # (an empty sequence: a ref row)


@pytest.mark.parametrize("options,config,save", [
    (Options(l2norm_qk=True), {"inverse_in_walk": 1}, False),
    (Options(), {"inverse_in_walk": 1, "segments": 2}, False),
    (Options(), {"inverse_in_walk": 1}, True),
], ids=["l2norm", "split", "save_states"])
def test_fused_walk_refuses_what_it_does_not_form(options, config, save):
    from linattn.dsl import SpecError
    with pytest.raises(SpecError, match="inverse_in_walk"):
        chunk.forward_plan(get_spec("gdn"), options, H=2, HV=4, K=64, V=32, dtype="bfloat16",
                           seq_chunks=(8, 8), Ttot=1024, output_final_state=True,
                           config=config, save_states=save)


@pytest.mark.parametrize("lens,HV,fused", [
    ((8192,) * 8, 16, True),        # q35-2b-8x8192: 128 chains, one wave
    ((1024,) * 8, 16, True),        # q35-397b-tp4-8x1024
    ((4096,), 16, False),           # prefill-4k: 16 chains, split
    ((1024,) * 8, 8, False),        # tp8-8x1024: 64 chains < 0.75 x 132
])
def test_inverse_in_walk_rule(monkeypatch, lens, HV, fused):
    """INVERSE_IN_WALK (data in the arch module): where its default is on (as now), the walk
    forms the inverse itself when the chains fill min_fill of the SMs; off, never unasked."""
    from linattn.codegen.arch.sm90 import forward
    args = dict(H=HV, HV=HV, K=128, V=128, dtype="bfloat16", seq_chunks=tuple(n // C for n in lens),
                Ttot=sum(lens), output_final_state=True)
    monkeypatch.setitem(forward.INVERSE_IN_WALK, "default", False)
    chunk._plan.cache_clear()
    assert chunk.forward_plan(get_spec("gdn"), Options(), **args).name != "walk-fused"
    monkeypatch.setitem(forward.INVERSE_IN_WALK, "default", True)
    chunk._plan.cache_clear()
    try:
        plan = chunk.forward_plan(get_spec("gdn"), Options(), **args)
        assert (plan.name == "walk-fused") == fused, str(plan)
        l2 = chunk.forward_plan(get_spec("gdn"), Options(l2norm_qk=True), **args)
        assert l2.name != "walk-fused"
    finally:
        chunk._plan.cache_clear()


def test_split_tables_give_every_sequence_a_segment():
    t = chunk._tables((0, 1, 71, 71, 76, 476), C, "cpu", 2)
    assert t["seg_cu"].tolist() == [0, 1, 71, 71, 76, 204, 332, 460, 476]
    assert t["seq_seg_offsets"].tolist() == [0, 1, 2, 3, 4, 8]
    assert t["seg_final_row"].tolist() == [0, 1, 2, 3, -1, -1, -1, 4]
    assert t["map_seg"].tolist() == [4, 5, 6]
    assert t["seg_c0"].tolist()[:5] == [0, 1, 3, 3, 4]


@pytest.mark.parametrize("config", [{}, {"inverse_in_walk": 1}], ids=["model", "fused"])
def test_walk_plan_is_printable_and_named(config):
    spec = get_spec("gdn")
    plan = chunk.forward_plan(spec, Options(), H=16, HV=16, K=128, V=128, dtype="bfloat16",
                              seq_chunks=(64,), Ttot=4096, output_final_state=True,
                              config=config)
    text = str(plan)
    assert plan.name in ("walk", "walk-split", "walk-fused") and "chunk_walk" in text
    assert "because" in text
    for la in plan.launches:     # every kernel argument names a provided tensor or a buffer
        mod = chunk.stage_module(spec, la.stage)
        names = runtime.arg_names(mod.build(**la.kwargs))
        have = set(b.name for b in plan.buffers) | set(__import__(
            "linattn.codegen.pipeline", fromlist=["PROVIDED"]).PROVIDED)
        assert all(la.tensor(n) in have for n in names), (la.stage, names)
