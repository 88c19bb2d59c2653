"""CPU tests of GDN-2's generated backward (KDA's per-key stages with the erase vector
b . k and the written value w . v from rules/gdn2.py.jinja: chunk_bwd_wy forms dv = w
dbv, dw = v dbv, the erase vector's gradient de = e^G dbk + X, db = k de, dk's b de; the
rebuild reads b, w as the forward's prepare). The per-key stages run as
tests/test_kda_bwd.py's fakes (the stage math in fp64, GEMM operands rounded to the input
dtype), the rebuild and the WY stage in their GDN-2 form here, the forward as the fp64
reference; the gradients of every input (q, k, v, g, b, w, h0 with dht; A_log, dt_bias
with the gate in the kernel) are compared with torch autograd of the fp64 chunked
reference. Varlen, GVA, l2norm and padded head dims included."""
import numpy as np
import pytest
import torch

from _forward_states import forward_states, kept_inverse
from _kernel_check import fake_compiles
from conftest import token_sum_err
from test_chunk import by_name
from test_chunk_bwd import _key_grads
from test_kda_bwd import (KEY_GRADS, STAGES, KeyStageMath, _chunks, _gate,
                          _gate_param_terms, _put, _take)

import linattn
from linattn.codegen.plan import plan
from linattn.dsl import Options
from linattn.dsl import delta_key_bwd as ref
from linattn.dsl import torch_reference as tref
from linattn.ops import autograd, build, chunk, chunk_bwd, gdn2, runtime

F64 = torch.float64
C = chunk_bwd.CHUNK
SPEC = gdn2.SPEC


def _T(x):
    return np.swapaxes(x, -1, -2)


class Gdn2StageMath(KeyStageMath):
    """KeyStageMath with GDN-2's rebuild and WY stage (beta ones: the rows' scale)."""

    def rebuild(self, p, q, k, v, g, beta, chunk_bos, chunk_len, A, qg, kg, g_last, w, u,
                g_cum, qn, kn, b_in, w_in, **_):
        """As KeyStageMath.rebuild, with w = A ((b . k) e^G), u = A (w . v)."""
        rnd = self.rnd
        for ci, t0, n, qc, kc, r in self.prepare(q, k, v, g, beta, chunk_bos, chunk_len,
                                                 p["l2norm_qk"]):
            if p["l2norm_qk"]:
                _put(qn, t0, n, qc)
                _put(kn, t0, n, kc)
            X = _take(A, t0, n)
            r.update(w=rnd(X @ rnd(_take(b_in, t0, n) * kc[self.kh] * np.exp(r["G"]))),
                     u=rnd(X @ rnd(_take(w_in, t0, n) * _take(v, t0, n))))
            for name, dst in (("qg", qg), ("kg", kg), ("w", w), ("u", u), ("G", g_cum)):
                _put(dst, t0, n, r[name])
            g_last[ci] = torch.from_numpy(np.ascontiguousarray(r["g_last"])).to(g_last.dtype)

    def wy(self, p, k, b_in, w_in, v, beta, g_cum, A, dw, du, dk_part, dg_part, dk, db_in,
           dw_in, dv, dbeta, dg, chunk_bos, chunk_len):
        """Back through A = (I + strict_tril(sum_c e_ic k_jc e^(G_ic - G_jc)))^-1,
        e = b . k, w = A (e e^G), u = A (w . v)."""
        rnd = self.rnd
        for _, (t0, n) in _chunks(chunk_bos, chunk_len):
            kc, G = _take(k, t0, n, self.kh), _take(g_cum, t0, n, edge=True)
            vc, bg, wg = _take(v, t0, n), _take(b_in, t0, n), _take(w_in, t0, n)
            bc = _take(beta, t0, n)[:, :, None]
            Ac, dwc, duc, dkp, dgp = (_take(t, t0, n) for t in (A, dw, du, dk_part, dg_part))
            e, eG = bc * bg * kc, np.exp(G)
            bk, bv = rnd(e * eG), rnd(wg * vc)
            dbk, dbv = _T(Ac) @ dwc, _T(Ac) @ duc
            dA = rnd(duc @ _T(bv) + dwc @ _T(bk))
            dM = rnd(np.tril(-(rnd(_T(Ac) @ dA) @ _T(Ac)), -1))
            X, Y = ref.pair_grads(dM, e, kc, G, rnd)
            de = eG * dbk + X
            dG = dgp + e * de - kc * Y
            for dst, y in ((dk, rnd(dkp + bc * bg * de + Y)), (dv, rnd(wg * dbv)),
                           (db_in, kc * de), (dw_in, dbv * vc),
                           (dg, np.flip(np.cumsum(np.flip(dG, 1), 1), 1)),
                           (dbeta, np.zeros(bc.shape[:2]))):
                _put(dst, t0, n, y)


def install_fakes(monkeypatch):
    names = []

    def body(spec, stage, params):
        names.append(stage)
        if stage == KEY_GRADS:
            return by_name({stage: _key_grads})(spec, stage, params)
        fn = getattr(Gdn2StageMath(params), stage.replace("chunk_bwd_", "").replace(
            "key_rebuild", "rebuild"))
        return by_name({stage: fn})(spec, stage, params)
    fake_compiles(monkeypatch, body)
    monkeypatch.setattr(chunk_bwd, "_check_device", lambda n, x: None)
    return names


def _reference_forward(call, q, k, v, beta, initial_state, g=None, A_log=None, dt_bias=None,
                       rule_inputs=None):
    """The training forward in fp64: o, the final state, h, the kept inverse A (the
    reference's) and A_qk (KeyStageMath.kept, which does not read beta)."""
    cu = None if call.cu is None else torch.tensor(call.cu)
    g_ref, opts, A_ref, dt_ref = g, call.options, A_log, dt_bias
    if call.lower_bound is not None:        # (formed here: the reference's is the softplus)
        g_ref, _ = _gate(None, g.double(), A_log.double(), dt_bias.double(), call.lower_bound)
        opts, A_ref, dt_ref = Options(l2norm_qk=call.l2norm_qk), None, None
    r = tref.chunked_forward(call.spec, q, k, v, g_ref, options=opts, scale=call.scale,
                             initial_state=initial_state, cu_seqlens=cu, A_log=A_ref,
                             dt_bias=dt_ref, intermediates=True, **rule_inputs)
    B, T, H, K = q.shape
    g_in, _ = autograd._gated_inputs(call, g, beta, A_log, dt_bias)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    tables = chunk._tables(call.cu or tuple(range(0, B * T + 1, T)), C, "cpu", 0)
    math = KeyStageMath(dict(H=H, HV=v.shape[2], dtype=str(q.dtype).replace("torch.", "")))
    aqk = math.kept(flat(q), flat(k), flat(v), flat(g_in), flat(beta), tables,
                    call.l2norm_qk)["aqk"]
    return (r["o"].to(q.dtype), r["final_state"].float() if call.output_final_state else None,
            dict(h=forward_states(r["h"], call.cu, T, q.dtype), aqk=aqk,
                 A=kept_inverse(r["A"], B, T, q.dtype)))


@pytest.fixture
def fake_kernels(monkeypatch):
    return install_gdn2_fakes(monkeypatch)


def install_gdn2_fakes(monkeypatch):
    """The backward's stages by their emulators, the forward the fp64 reference."""
    names = install_fakes(monkeypatch)
    monkeypatch.setattr(autograd, "run_forward", _reference_forward)
    return names


def _rel(x, r):
    return float(torch.linalg.norm(x.to(F64) - r) / max(torch.linalg.norm(r), 1e-30))


F16, BF16 = torch.float16, torch.bfloat16
CASES = [   # B, T, H, HV, K, V, cu, h0, dht, l2norm, gate in kernel, lower_bound, dtype
    pytest.param(2, 130, 2, 2, 64, 64, None, False, False, False, False, None, F16,
                 id="B2-T130-f16"),
    pytest.param(1, 100, 1, 2, 128, 64, None, True, True, True, False, None, BF16,
                 id="GVA2-K128-h0-dht-l2norm-bf16"),
    pytest.param(1, 135, 2, 2, 64, 128, (0, 1, 70, 71, 135), True, True, True, False, None,
                 F16, id="varlen-1tok-h0-dht"),
    pytest.param(2, 70, 1, 2, 64, 64, None, True, False, True, True, None, F16,
                 id="gate-in-kernel-GVA2"),
    pytest.param(1, 80, 1, 1, 64, 64, None, False, True, False, True, -5.0, F16,
                 id="lower-bound"),
    pytest.param(1, 90, 1, 2, 80, 48, (0, 30, 90), True, True, True, True, None, F16,
                 id="K80-V48-padded-varlen-GVA2-h0-dht-l2norm-gik"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,cu,h0,use_dht,l2,gik,lb,dtype", CASES)
def test_training_matches_fp64_autograd(fake_kernels, rng, B, T, H, HV, K, V, cu, h0,
                                        use_dht, l2, gik, lb, dtype):
    """chunk_gdn2 under autograd trains through the generated stages: every input's
    gradient vs torch autograd of the fp64 chunked reference."""
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k = r(B, T, H, K), r(B, T, H, K)
    if not l2:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    x = dict(q=q.to(dtype), k=k.to(dtype), v=r(B, T, HV, V).to(dtype),
             b=torch.sigmoid(r(B, T, HV, K)).float(), w=torch.sigmoid(r(B, T, HV, V)).float(),
             initial_state=r(N, HV, K, V).float() * 0.1 if h0 else None)
    if gik:
        x.update(g=r(B, T, HV, K).float(), A_log=torch.log(torch.rand(HV, generator=gen) * 4
                                                             + .5),
                 dt_bias=(r(HV * K) * 0.5).float())
    else:
        x["g"] = torch.nn.functional.logsigmoid(r(B, T, HV, K)).float()
    do, dht = r(B, T, HV, V).to(dtype), r(N, HV, K, V).float()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, ht = linattn.chunk_gdn2(**leaves, output_final_state=use_dht,
                               use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gik,
                               lower_bound=lb, cu_seqlens=cu_t)
    loss = (o.float() * do.float()).sum() + ((ht * dht).sum() if use_dht else 0)
    loss.backward()
    assert fake_kernels == [*STAGES, KEY_GRADS]

    refs = {n: t.detach().to(F64).requires_grad_() for n, t in x.items() if t is not None}
    g, opts = refs["g"], Options(l2norm_qk=l2, gate_in_kernel=gik)
    A_log, dt_bias = refs.get("A_log"), refs.get("dt_bias")
    if lb is not None:
        g, _ = _gate(None, g, A_log, dt_bias, lb)
        opts, A_log, dt_bias = Options(l2norm_qk=l2), None, None
    o_r, ht_r = tref.chunked_forward(SPEC, refs["q"], refs["k"], refs["v"], g, options=opts,
                                     initial_state=refs.get("initial_state"),
                                     cu_seqlens=None if cu is None else torch.tensor(cu),
                                     A_log=A_log, dt_bias=dt_bias, b=refs["b"], w=refs["w"])
    loss_r = (o_r * do.to(F64)).sum() + ((ht_r * dht.to(F64)).sum() if use_dht else 0)
    loss_r.backward()
    tol = 1e-2 if dtype == BF16 else 5e-3
    terms = _gate_param_terms(refs, lb) if gik else {}
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, n
        assert not torch.isnan(t.grad).any(), n
        err = _rel(t.grad, refs[n].grad)
        if n in terms:      # a token sum whose terms cancel: judged against their size
            err = token_sum_err(t.grad, refs[n].grad, terms[n])
        assert err < tol, (n, err)


def test_plan_and_build():
    """GDN-2 has the per-key gate's backward stages and trains through them."""
    assert [s.name for s in plan(SPEC, "bwd")] == [*STAGES, KEY_GRADS]
    assert build.has_backward(SPEC)


def test_wy_stage_takes_the_gates():
    mod = runtime.stage_module(SPEC, "chunk_bwd_wy", "sm90")
    names = mod.args(**mod.EXAMPLES[0])
    assert names[:3] == ["k", "b_in", "w_in"] and {"db_in", "dw_in"} <= set(names)
    assert list(runtime.arg_names(mod.build(**mod.EXAMPLES[0]))) == names


def test_state_v_first(fake_kernels, rng):
    """chunk_gdn2 with state_v_first trains as key-first (GVA, l2norm, padded K)."""
    from test_autograd import v_first_matches_k_first
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x = dict(q=r(1, 80, 1, 48).half(), k=r(1, 80, 1, 48).half(), v=r(1, 80, 2, 64).half(),
             g=torch.nn.functional.logsigmoid(r(1, 80, 2, 48)).float(),
             b=torch.sigmoid(r(1, 80, 2, 48)).float(), w=torch.sigmoid(r(1, 80, 2, 64)).float(),
             initial_state=0.1 * r(1, 2, 48, 64).float())
    v_first_matches_k_first(linattn.chunk_gdn2, x, r(1, 80, 2, 64).half(),
                            r(1, 2, 48, 64).float(), use_qk_l2norm_in_kernel=True)


def test_fused_recurrent_trains_as_chunk(fake_kernels, rng):
    """fused_recurrent_gdn2 under autograd trains as chunk_gdn2 (the kernels)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x = dict(q=r(1, 70, 1, 64).half(), k=r(1, 70, 1, 64).half(), v=r(1, 70, 2, 64).half(),
             g=torch.nn.functional.logsigmoid(r(1, 70, 2, 64)).float(),
             b=torch.sigmoid(r(1, 70, 2, 64)).float(), w=torch.sigmoid(r(1, 70, 2, 64)).float())
    do = r(1, 70, 2, 64).half()
    runs = []
    for fn in (linattn.chunk_gdn2, linattn.fused_recurrent_gdn2):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, _ = fn(**leaves, use_qk_l2norm_in_kernel=True)
        (o.float() * do.float()).sum().backward()
        runs.append((o, {n: t.grad for n, t in leaves.items()}))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])
