"""CPU check of the fused forward path's formulas: chunk_qk + chunk_state_output in both
q-operand modes (FUSED_Q "gated": chunk_qk writes q e^g per value head; "raw": the state
pass reads q, or its l2-normalised copy, per key head and gates the rows of q S itself).
Fake kernels carry out each stage's formula in fp64 through the real buffers and tables
(chunk_prepare's outputs taken from the fp64 reference's intermediates); o and the final
state must match the torch fp64 reference within f16 storage rounding (a wrong gate,
head map or layout is an O(1) error)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from test_chunk import fake_stages
from test_chunk_split import StateMath

from linattn.dsl import Gate, Options
from linattn.dsl import torch_reference as tr
from linattn.ops import chunk
from linattn.ops.registry import get_spec

F64 = torch.float64


def _l2(x):
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()


def _run(monkeypatch, spec, options, lens, fused_q, H=2, HV=4, K=32, V=32, seed=0):
    C = spec.chunk_size
    for name, value in dict(FUSE_OUTPUT=True, FUSED_Q=fused_q, SPLIT=False,
                            PREPARE_SPLIT=False).items():
        monkeypatch.setattr(chunk, name, value)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    N, T, group, dt = len(lens), sum(lens), HV // H, torch.float16
    cu = torch.tensor([0, *np.cumsum(lens).tolist()])
    q, k, v = rnd(1, T, H, K).to(dt), rnd(1, T, H, K), rnd(1, T, HV, V).to(dt)
    k = (k if options.l2norm_qk else _l2(k)).to(dt)
    g = F.logsigmoid(rnd(1, T, HV) + 2) if spec.gate is Gate.SCALAR else None
    beta = torch.sigmoid(rnd(1, T, HV)).to(dt)
    h0 = 0.1 * rnd(N, HV, K, V)
    ref = tr.chunked_forward(spec, q, k, v, g, beta, options=options, initial_state=h0,
                             cu_seqlens=cu, intermediates=True)
    g_tok = ref["g_cum"][0, :, :, 0]                                   # [T, HV]
    seen = {}

    def prepare(kf, vf, gf, betaf, A_log, dt_bias, chunk_bos, chunk_len, g_cum, kn, w, u):
        w.copy_(ref["w"][0].to(w.dtype))
        u.copy_(ref["u"][0].to(u.dtype))
        if kn.data_ptr() != kf.data_ptr():
            kn.copy_(_l2(kf.to(F64)).to(kn.dtype))
        if spec.gate is Gate.SCALAR:
            g_cum.zero_()
            for ci, (t0, rows) in enumerate(zip(chunk_bos.tolist(), chunk_len.tolist())):
                g_cum[:, ci * C:ci * C + rows] = g_tok[t0:t0 + rows].T.to(g_cum.dtype)

    def qk(p):
        def run(qf, kn, g_cum, chunk_bos, chunk_len, q_out, aqk):
            aqk.zero_()
            for ci, (t0, rows) in enumerate(zip(chunk_bos.tolist(), chunk_len.tolist())):
                for hv in range(HV):
                    qq = qf[t0:t0 + rows, hv // group].to(F64)
                    qq = _l2(qq) if options.l2norm_qk else qq
                    A = (qq @ kn[t0:t0 + rows, hv // group].to(F64).T).tril()
                    if spec.gate is Gate.SCALAR:
                        gc = g_cum[hv, ci * C:ci * C + rows].to(F64)
                        A = A * (gc[:, None] - gc[None, :]).exp().tril()
                        qg = qq * gc.exp()[:, None]
                    else:
                        qg = qq
                    aqk[t0:t0 + rows, hv, :rows] = A.to(aqk.dtype)
                    if p.get("q_out", "gated") == "gated":
                        q_out[t0:t0 + rows, hv] = qg.to(q_out.dtype)
                    elif p["q_out"] == "normed":
                        q_out[t0:t0 + rows, hv // group] = qq.to(q_out.dtype)
        return run

    def state_output(p):
        def run(k_, w, u, g_cum, cu_, c0, h0_, ht, qg, aqk, o, scale):
            seen["q_gated"] = p.get("q_gated", True)
            seen["qg_shape"] = tuple(qg.shape)

            def on_chunk(ci, t0, rows, hv, S, vn):
                if seen["q_gated"]:
                    qq = qg[t0:t0 + rows, hv].to(F64)
                else:
                    qq = qg[t0:t0 + rows, hv // group].to(F64)
                    if spec.gate is Gate.SCALAR:
                        qq = qq * g_cum[hv, ci * C:ci * C + rows].to(F64).exp()[:, None]
                oo = scale * (qq @ S + aqk[t0:t0 + rows, hv, :rows].to(F64) @ vn)
                o[t0:t0 + rows, hv] = oo.to(o.dtype)
            init = lambda n, hv: h0_[n, hv].to(F64)  # noqa: E731
            for n, hv, S in StateMath(spec, C, K).run(k_, w, u, g_cum, cu_.tolist(),
                                                       c0.tolist(), init, HV, group, on_chunk):
                ht[n, hv] = S.to(ht.dtype)
        return run

    fakes = {"chunk_prepare": lambda p: prepare, "chunk_qk": qk,
             "chunk_state_output": state_output}

    fake_stages(monkeypatch, fakes)
    o, ht = chunk.chunk_forward(spec, q, k, v, g, beta, initial_state=h0,
                                output_final_state=True, options=options, cu_seqlens=cu,
                                cu_seqlens_cpu=cu)
    return o, ht, ref, seen


def _rel(a, b):
    return ((a.to(F64) - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fused_q", ["raw", "gated"])
@pytest.mark.parametrize("name,l2norm", [("gdn", False), ("gdn", True), ("deltanet", False),
                                         ("deltanet", True)])
def test_fused_path_matches_reference(monkeypatch, name, l2norm, fused_q):
    spec = get_spec(name)
    options = Options(l2norm_qk=l2norm)
    o, ht, ref, seen = _run(monkeypatch, spec, options, [1, 70, 5, 130], fused_q)
    assert seen["q_gated"] == (fused_q == "gated")
    assert seen["qg_shape"][1] == (4 if fused_q == "gated" else 2)     # HV or H heads
    assert _rel(o, ref["o"]) < 5e-3
    assert _rel(ht, ref["final_state"]) < 5e-3


def test_fused_q_knob_is_checked(monkeypatch):
    monkeypatch.setattr(chunk, "FUSED_Q", "sideways")
    with pytest.raises(Exception, match="FUSED_Q"):
        chunk.stage_params(get_spec("gdn"), Options(), H=2, HV=4, K=64, V=64,
                           dtype="bfloat16", fused=True)
