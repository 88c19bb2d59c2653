"""The chunked forms of the generalized delta rules as the generated kernels compute them
(CPU, fp64 NumPy, one head, written from the templates' formulas), against the fp64
recurrence of each rule; the public chunk_* calls through the chunk op's plumbing
(cpu_ops: the op's CPU kernel is the fp64 reference). GPU: tests/test_comba_gpu.py,
tests/test_gdn2_gpu.py.

Comba (chunk_kkt_inverse, chunk_wu with the rule's erase_cum / kkt_erase_tile pieces):
  L[i, j] = beta_i (p_i . k_j) exp(Gx_i - G_j)  (i > j),  Gx_i = G_{i-1} (0 at i = 0)
  A_b = (I + L)^-1 diag(beta),  w = A_b diag(exp(Gx)) p,  u = A_b v
GDN-2 (chunk_prepare_key with key_erase / key_written / key_row_scale):
  A_kk[i, j] = sum_c b_ic k_ic k_jc exp(G_ic - G_jc)  (i > j),  X = (I + A_kk)^-1
  w = X ((b . k) exp(G)),  u = X (w_gate . v)
then the delta rule's state pass and output (v_new = u - w S, the write key k).
"""
import numpy as np
import pytest
import torch
from _cpu_ops import cpu_ops  # noqa: F401 (fixture)

import linattn
from linattn.dsl import Options
from linattn.dsl.recurrent import random_inputs, recurrent_forward
from linattn.ops.registry import get_spec

C = 64


def _chunks(T):
    return [(s, min(s + C, T)) for s in range(0, T, C)]


def _walk(q, k, gk, factors, S, scale):
    """The state pass and output over the chunks: (o [T, V], S). gk [T, K] the per-key
    log gate (a scalar gate broadcast); factors(s, e, G) -> (w, u) of a chunk."""
    T, V = q.shape[0], S.shape[1]
    o = np.zeros((T, V))
    for s, e in _chunks(T):
        G = np.cumsum(gk[s:e], axis=0)
        w, u = factors(s, e, G)
        vn = u - w @ S
        qg = q[s:e] * np.exp(G)
        pairs = np.einsum("ic,jc,ijc->ij", q[s:e], k[s:e],
                          np.exp(np.clip(G[:, None] - G[None], None, 0)))
        o[s:e] = scale * (qg @ S + np.tril(pairs) @ vn)
        S = np.exp(G[-1])[:, None] * S + (k[s:e] * np.exp(G[-1] - G)).T @ vn
    return o, S


def test_comba_kernel_maths_match_the_recurrence():
    spec = get_spec("comba")
    x = random_inputs(spec, Options(), 1, 150, 1, 1, 32, 16, np.random.default_rng(0))
    q, k, v, p = (x[n][0, :, 0] for n in ("q", "k", "v", "p"))
    g, beta, S0 = x["g"][0, :, 0], x["beta"][0, :, 0], x["initial_state"][0, 0]
    scale = 32 ** -0.5

    def factors(s, e, G):
        Gs = G[:, 0]
        Gx = np.concatenate([[0.0], Gs[:-1]])
        n = e - s
        L = np.tril(beta[s:e, None] * (p[s:e] @ k[s:e].T)
                    * np.exp(np.minimum(Gx[:, None] - Gs[None], 0)), -1)
        Ab = np.linalg.inv(np.eye(n) + L) * beta[s:e][None]
        return Ab @ (np.exp(Gx)[:, None] * p[s:e]), Ab @ v[s:e]
    o, S = _walk(q, k, np.repeat(g[:, None], 32, axis=1), factors, S0, scale)
    want_o, want_h = recurrent_forward(spec, **x)
    np.testing.assert_allclose(o, want_o[0, :, 0], atol=1e-10)
    np.testing.assert_allclose(S, want_h[0, 0], atol=1e-10)


def test_gdn2_kernel_maths_match_the_recurrence():
    spec = get_spec("gdn2")
    x = random_inputs(spec, Options(), 1, 150, 1, 1, 32, 16, np.random.default_rng(1))
    q, k, v = (x[n][0, :, 0] for n in ("q", "k", "v"))
    g, b, wg, S0 = x["g"][0, :, 0], x["b"][0, :, 0], x["w"][0, :, 0], x["initial_state"][0, 0]

    def factors(s, e, G):
        d = np.exp(np.minimum(G[:, None] - G[None], 0))                 # [i, j, c]
        A = np.tril(np.einsum("ic,jc,ijc->ij", b[s:e] * k[s:e], k[s:e], d), -1)
        X = np.linalg.inv(np.eye(e - s) + A)
        return X @ (b[s:e] * k[s:e] * np.exp(G)), X @ (wg[s:e] * v[s:e])
    o, S = _walk(q, k, g, factors, S0, 32 ** -0.5)
    want_o, want_h = recurrent_forward(spec, **x)
    np.testing.assert_allclose(o, want_o[0, :, 0], atol=1e-10)
    np.testing.assert_allclose(S, want_h[0, 0], atol=1e-10)


def _bf16_case(spec, opts, cu, K, V, seed):
    x = random_inputs(spec, opts, 1, cu[-1], 2, 4, K, V, np.random.default_rng(seed),
                      cu_seqlens=cu)
    t = {n: torch.tensor(a).to(torch.float32 if n in ("g", "initial_state") else
                               torch.bfloat16)
         for n, a in x.items() if a is not None and n != "cu_seqlens"}
    x.update({n: a.double().numpy() for n, a in t.items()})
    return x, t


@pytest.mark.parametrize("l2norm", [False, True])
def test_chunk_comba_takes_the_chunk_op(cpu_ops, l2norm):
    """bf16 inputs take the chunk op, p passed through it (K = 40 padded to the kernels'
    64), varlen with a ragged last chunk; the fp64 reference behind the op."""
    spec, opts, cu = get_spec("comba"), Options(l2norm_qk=l2norm), [0, 70, 161]
    x, t = _bf16_case(spec, opts, cu, 40, 32, 3)
    want_o, want_h = recurrent_forward(spec, options=opts, **x)
    o, ht = linattn.chunk_comba(t["q"], t["k"], t["v"], t["p"], t["g"], t["beta"],
                                initial_state=t["initial_state"], output_final_state=True,
                                use_qk_l2norm_in_kernel=l2norm, cu_seqlens=torch.tensor(cu))
    assert cpu_ops == [("comba", "chunk")]
    np.testing.assert_allclose(o.double().numpy(), want_o, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(ht.double().numpy(), want_h, atol=1e-6, rtol=1e-6)


LAUNCHES = [
    pytest.param("comba", Options(), 2, 4, 128, 128, None, id="comba-gva"),
    pytest.param("comba", Options(l2norm_qk=True, state_v_first=True), 4, 4, 40, 64,
                 [70, 130], id="comba-l2norm-vfirst-K40-varlen"),
    pytest.param("gdn2", Options(), 2, 4, 128, 128, None, id="gdn2-gva"),
    pytest.param("gdn2", Options(l2norm_qk=True, gate_in_kernel=True), 2, 2, 40, 64,
                 [70, 130], id="gdn2-l2norm-gik-K40-varlen"),
]


@pytest.mark.parametrize("name, opts, H, HV, K, V, lens", LAUNCHES)
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_launch_arguments_match_kernels(monkeypatch, name, opts, H, HV, K, V, lens,
                                        gate_dtype):
    """The chunked forward's launches of Comba and GDN-2 (CPU, traced prim_funcs standing in
    for the kernels: tests/_kernel_check.py): every kernel argument, the rule's p_in / pn
    and b_in / w_in included, bound to a tensor of the dtype and shape it declares; each
    stage of the plan launched once."""
    from _kernel_check import fake_compiles
    from linattn.ops import chunk
    spec = get_spec(name)
    fakes = fake_compiles(monkeypatch)
    T = sum(lens) if lens else 150
    B = 1 if lens else 2
    cu = torch.tensor([0] + np.cumsum(lens).tolist()) if lens else None
    bf = torch.bfloat16
    r = lambda *s, dt=bf: torch.randn(*s).to(dt)  # noqa: E731
    gk = K if spec.gate.per_key else None
    g = -torch.rand(*((B, T, HV) + ((gk,) if gk else ()))).to(gate_dtype)
    rule_inputs = ({"p": r(B, T, H, K)} if name == "comba" else
                   {"b": torch.rand(B, T, HV, K).to(gate_dtype),
                    "w": torch.rand(B, T, HV, V).to(gate_dtype)})
    extra = (dict(A_log=torch.rand(HV), dt_bias=torch.rand(HV * K))
             if opts.gate_in_kernel else {})
    o, ht = chunk.run_chunk_forward(
        spec, r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), g,
        r(B, T, HV) if spec.has_beta else None, None, None, True, opts, cu, cu,
        rule_inputs=rule_inputs, **extra)
    assert o.shape == (B, T, HV, V)
    assert ht.shape == ((B if cu is None else len(lens), HV) +
                        ((V, K) if opts.state_v_first else (K, V)))
    launched = sorted(stage for (_, stage, _), (call, _) in fakes.items() if call.checker.calls)
    want = {"comba": ["chunk_kkt_inverse", "chunk_output", "chunk_state", "chunk_wu"],
            "gdn2": ["chunk_prepare", "chunk_state", "chunk_output"]}[name]
    assert launched == sorted(want) or (name == "gdn2" and launched == sorted(
        ["chunk_prepare", "chunk_state_output"])), launched
