"""CPU tests of the split state pass (ops/chunk_split.py, LINATTN_CHUNK_SPLIT=1): segment
tables against a walk over the sequences, the cost model, sm_90a compiles of the two new
stages, and the decomposition itself: fake kernels carry out each state stage's formula in
fp64 through the real buffers and tables (chunk_state / chunk_state_output as the
GPU-verified kernels compute it; chunk_segment_state on [I | 0] with values [0 | u];
chunk_segment_combine), and the split run's h, v_new, o and final state must equal the
unsplit run's on the same random stage inputs."""
import numpy as np
import pytest
import torch

from test_chunk import fake_stages

from linattn.dsl import Gate, Options, all_rule_gate_specs
from linattn.ops import chunk, chunk_split
from linattn.ops.registry import get_spec

F64 = torch.float64
SIX = {s.name: s for s in all_rule_gate_specs()}


def _spec(name):
    return SIX[name] if name in SIX else get_spec(name)


# -- tables and the cost model ------------------------------------------------------------

def _segments_by_walking(lens, L, C):
    seg_cu, seg_c0, seq_seg, chunk0, tok = [0], [0], [0], 0, 0
    seg_cu, seg_c0 = [], []
    for n, length in enumerate(lens):
        nch = -(-length // C)
        for c in range(0, nch, L):
            seg_cu.append(tok + c * C)
            seg_c0.append(chunk0 + c)
        seq_seg.append(len(seg_cu))
        chunk0 += nch
        tok += length
    return seg_cu + [tok], seg_c0 + [chunk0], seq_seg


@pytest.mark.parametrize("L", [1, 2, 3, 8])
def test_segment_tables_match_walk(rng, L):
    lens = [0, 1, 64, 65, 1000] + rng.integers(0, 400, size=6).tolist()
    rng.shuffle(lens)
    cu = np.concatenate([[0], np.cumsum(lens)])
    got = chunk_split.build_segment_tables(cu, L, 64)
    want = _segments_by_walking(lens, L, 64)
    for g, w in zip(got, want):
        assert g.dtype == np.int32 and g.tolist() == list(w)
    # every segment has 1..L chunks and tiles its sequence
    seg_cu, seg_c0, _ = got
    assert np.all(np.diff(seg_cu) > 0) and np.all((np.diff(seg_c0) >= 1) & (np.diff(seg_c0) <= L))


def test_cost_model_splits_few_heads_only():
    # q35-397b-tp8-8192: one sequence, 128 chunks, 8 value heads: split
    assert chunk_split.segment_chunks([128], 8, 128, 128, 132) >= 2
    # 64 value heads x 8 sequences fill the GPU already: no split
    assert chunk_split.segment_chunks([64] * 8, 64, 128, 128, 132) == 0
    assert chunk_split.segment_chunks([1, 1], 2, 64, 64, 132) == 0      # nothing to split
    assert chunk_split.segment_chunks([40], 2, 64, 64, 132, override=4) == 4


# -- compiling ---------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("name", ["gdn", "kda", "additive_none"])
def test_split_stages_compile(name):
    spec = _spec(name)
    for stage in chunk.SPLIT_STAGES:
        mod = chunk.stage_module(spec, stage)
        src = chunk.compiled_stage(spec, stage, **mod.EXAMPLES[0]).get_kernel_source()
        assert "__global__" in src and ("wgmma" in src or "mma" in src)


# -- fake kernels: the stage formulas in fp64 ---------------------------------------------

def _state_layout(x, v_first):          # [.., K, V] <-> [.., V, K]
    return x.transpose(-1, -2) if v_first else x


class StateMath:
    """fp64 state recurrence over (cu, chunk offsets) tables, as the state kernels do it.
    cols_is_map (segment stage): the first K columns carry values 0 (the map P)."""

    def __init__(self, spec, C, K):
        self.spec, self.C, self.K = spec, C, K

    def run(self, k, w, u, g_cum, cu, c0, S_init, HV, group, on_chunk=None, map_cols=0):
        spec, C = self.spec, self.C
        ends = []
        for n in range(len(cu) - 1):
            bos, seqlen = int(cu[n]), int(cu[n + 1] - cu[n])
            for hv in range(HV):
                S = S_init(n, hv).clone()
                hk = hv if spec.gate is Gate.KEY else hv // group
                for c in range(-(-seqlen // C)):
                    t0, rows = bos + c * C, min(C, seqlen - c * C)
                    kk = k[t0:t0 + rows, hk].to(F64)
                    uu = u[t0:t0 + rows, hv].to(F64)
                    uu = torch.cat([torch.zeros(rows, map_cols, dtype=F64), uu], 1)
                    vn = uu - w[t0:t0 + rows, hv].to(F64) @ S if spec.has_beta else uu
                    if on_chunk is not None:
                        on_chunk(int(c0[n]) + c, t0, rows, hv, S, vn)
                    if spec.gate is Gate.KEY:
                        gl = g_cum[int(c0[n]) + c, hv].to(F64)
                        S = gl.exp()[:, None] * S + kk.T @ vn
                    elif spec.has_gate:
                        row0 = (int(c0[n]) + c) * C
                        gc = g_cum[hv, row0:row0 + rows].to(F64)
                        S = gc[-1].exp() * S + kk.T @ (vn * (gc[-1] - gc).exp()[:, None])
                    else:
                        S = S + kk.T @ vn
                ends.append((n, hv, S))
        return ends


def _run(monkeypatch, spec, lens, options, init, final, fused, split_L, HV=4, H=2, K=32, V=32,
         seed=0):
    """chunk_forward with fake kernels; returns the fp64 record {h, v_new, o, final}."""
    C = spec.chunk_size
    monkeypatch.setattr(chunk, "FUSE_OUTPUT", fused)
    monkeypatch.setattr(chunk, "SPLIT", split_L is not None)
    monkeypatch.setattr(chunk, "SPLIT_SEGMENT_CHUNKS", split_L)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT", False)   # the fakes do chunk_prepare's math
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    math = StateMath(spec, C, K)
    rec = {"h": {}, "v_new": {}, "o": {}, "final": None, "calls": []}
    gen = torch.Generator().manual_seed(seed)
    key_gate = spec.gate is Gate.KEY

    def fill(t, scale=0.3):
        t.copy_((scale * torch.randn(t.shape, generator=gen, dtype=F64)).to(t.dtype))

    def prepare(*a):          # random stage operands (reproducible per seed)
        if key_gate:
            *_, chunk_bos, chunk_len, k_out, q_out, k_state, g_cum, w, u = a
            for t in (k_out, q_out, k_state, w, u):
                fill(t)
            g_cum.copy_(-0.2 * torch.rand(g_cum.shape, generator=gen, dtype=F64))
        else:
            *_, chunk_bos, chunk_len, g_cum, kn, w, u = a
            for t in (kn, w, u):
                fill(t)
            if spec.has_gate:     # chunk-padded within-chunk cumsums of negative logs
                steps = -0.1 * torch.rand(g_cum.shape[0], g_cum.shape[1] // C, C,
                                          generator=gen, dtype=F64)
                g_cum.copy_(steps.cumsum(-1).reshape(g_cum.shape))

    def qk(qf, kn, g_cum, chunk_bos, chunk_len, q_out, k_out):
        fill(q_out), fill(k_out)

    def state_kernel(stage, p):
        def run(k, w, u, g_cum, cu, c0, h0, *rest):
            if stage == "chunk_state":
                h, v_new, ht = rest
            else:
                ht, qg, aqk, o, scale = rest
            vf = p["state_v_first"]
            init = (lambda n, hv: _state_layout(h0[n, hv].to(F64), vf)) if \
                p["has_initial_state"] else (lambda n, hv: torch.zeros(K, V, dtype=F64))

            def on_chunk(ci, t0, rows, hv, S, vn):
                rec["h"][(ci, hv)] = S.clone()
                for i in range(rows):
                    rec["v_new"][(t0 + i, hv)] = vn[i].clone()
                if stage == "chunk_state_output":
                    if p.get("q_gated", True):
                        qq = qg[t0:t0 + rows, hv].to(F64)
                    else:          # q itself [Ttot, H, K], gated here (scalar gate)
                        qq = qg[t0:t0 + rows, hv // (HV // H)].to(F64)
                        if spec.gate is Gate.SCALAR:
                            qq = qq * g_cum[hv, ci * C:ci * C + rows].to(F64).exp()[:, None]
                    oo = scale * (qq @ S + aqk[t0:t0 + rows, hv, :rows].to(F64) @ vn)
                    for i in range(rows):
                        rec["o"][(t0 + i, hv)] = oo[i]

            ends = math.run(k, w, u, g_cum, cu.tolist(), c0.tolist(), init, HV, HV // H,
                            on_chunk)
            if p["output_final_state"]:
                rec["final"] = torch.zeros(ht.shape, dtype=F64)
                for n, hv, S in ends:
                    rec["final"][n, hv] = _state_layout(S, vf)
        return run

    def segment_state(p):
        def run(k, w, u, g_cum, seg_cu, seg_c0, seg_map):
            init = lambda n, hv: torch.cat(   # noqa: E731
                [torch.eye(K, dtype=F64), torch.zeros(K, V, dtype=F64)], 1)
            for s, hv, S in math.run(k, w, u, g_cum, seg_cu.tolist(), seg_c0.tolist(), init,
                                     HV, HV // H, map_cols=K):
                seg_map[s, hv] = S.to(seg_map.dtype)
            rec["seg_map"] = seg_map.clone()
        return run

    def combine(p):
        def run(seg_map, seq_seg, h0, starts, ht):
            vf = p["state_v_first"]
            fin = torch.zeros(ht.shape, dtype=F64)
            for n in range(len(seq_seg) - 1):
                for hv in range(HV):
                    S = (_state_layout(h0[n, hv].to(F64), vf) if p["has_initial_state"]
                         else torch.zeros(K, V, dtype=F64))
                    for s in range(int(seq_seg[n]), int(seq_seg[n + 1])):
                        starts[s, hv] = S.to(starts.dtype)
                        S = seg_map[s, hv, :, :K].to(F64) @ S + seg_map[s, hv, :, K:].to(F64)
                    if p["output_final_state"]:
                        fin[n, hv] = _state_layout(S, vf)
            if p["output_final_state"]:
                rec["final"] = fin
        return run

    fakes = {"chunk_prepare": lambda p: prepare, "chunk_qk": lambda p: qk,
             "chunk_state": lambda p: state_kernel("chunk_state", p),
             "chunk_state_output": lambda p: state_kernel("chunk_state_output", p),
             "chunk_segment_state": segment_state, "chunk_segment_combine": combine,
             "chunk_output": lambda p: (lambda *a: None)}

    fake_stages(monkeypatch, fakes, rec["calls"])
    N, T = len(lens), sum(lens)
    cu = torch.tensor([0] + np.cumsum(lens).tolist())
    bf = torch.bfloat16
    q, k = torch.randn(1, T, H, K, dtype=bf), torch.randn(1, T, H, K, dtype=bf)
    v = torch.randn(1, T, HV, V, dtype=bf)
    g = -torch.rand(*spec.gate_shape(1, T, HV, K)) if spec.has_gate else None
    beta = torch.rand(1, T, HV, dtype=bf) if spec.has_beta else None
    shape = (N, HV, V, K) if options.state_v_first else (N, HV, K, V)
    h0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)) if init else None
    chunk.chunk_forward(spec, q, k, v, g, beta, initial_state=h0, output_final_state=final,
                        options=options, cu_seqlens=cu, cu_seqlens_cpu=cu)
    return rec


CASES = [   # name, lens, options, init, final
    ("gdn", [300], Options(), True, True),
    ("gdn", [0, 1, 129, 64, 260], Options(state_v_first=True), True, True),
    ("deltanet", [200, 70], Options(), False, True),
    ("kda", [1, 250], Options(), True, True),
    ("additive_scalar", [190], Options(), True, False),
]


def _assert_rel_close(got, want, tol=1e-6):
    """||got - want|| / ||want|| < tol: f32 rounding of the maps and start states only (a
    wrong table or formula gives O(1))."""
    err = ((got - want).norm() / want.norm()).item()
    assert err < tol, err


@pytest.mark.parametrize("fused", [False, True], ids=["3stage", "fused"])
@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("name,lens,options,init,final", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_split_pass_equals_sequential(monkeypatch, name, lens, options, init, final, fused, L):
    spec = _spec(name)
    ref = _run(monkeypatch, spec, lens, options, init, final, fused, None)
    got = _run(monkeypatch, spec, lens, options, init, final, fused, L)
    assert "chunk_segment_state" in got["calls"] and "chunk_segment_combine" in got["calls"]
    assert "chunk_segment_state" not in ref["calls"]
    for what in ("h", "v_new", "o"):
        assert got[what].keys() == ref[what].keys(), what
        assert len(ref[what]) > 0 or (what == "o") != fused
        if ref[what]:
            keys = sorted(ref[what])
            _assert_rel_close(torch.stack([got[what][q] for q in keys]),
                              torch.stack([ref[what][q] for q in keys]))
    if final:
        _assert_rel_close(got["final"], ref["final"])
    else:
        assert got["final"] is None
