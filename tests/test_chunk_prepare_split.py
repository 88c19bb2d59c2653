"""CPU tests of the split chunk_prepare (ops.chunk.PREPARE_SPLIT: chunk_kkt_inverse then
chunk_wu): the stages plan, render and compile for sm_90a, and fake kernels (signature
checks + each stage's formula in fp64, through the same buffers, with the stores'
roundings) run the host code; what the state pass receives (g_cum, kn, w, u) and the
stored A_b = A diag(beta) are compared with the NumPy fp64 chunked reference."""
import numpy as np
import pytest
import torch

from test_chunk import SignatureCheckingKernel

from linattn.codegen.plan import plan
from linattn.dsl import Options, all_rule_gate_specs
from linattn.dsl.chunked import chunked_forward as np_chunked_forward
from linattn.ops import chunk
from linattn.ops.registry import get_spec

F64 = torch.float64
C = 64
SPLIT = chunk.SPLIT_PREPARE_STAGES


def test_split_stages_planned_for_delta_without_key_gate():
    for spec in all_rule_gate_specs():
        names = [s.name for s in plan(spec, "fwd")]
        want = spec.rule.value == "delta" and spec.gate.value in ("none", "scalar")
        assert all((n in names) == want for n in SPLIT), (spec.name, names)


def test_default_is_split_and_knob_selects_fused(monkeypatch):
    """The default (run s3-1) is the split prepare with the warp inverse (64 threads) and
    chunk_wu's loop; PREPARE_SPLIT=False gives the single fused chunk_prepare back."""
    spec, opts = get_spec("gdn"), Options()
    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16")
    params = chunk.stage_params(spec, opts, **kw)
    assert "chunk_prepare" not in params and set(SPLIT) <= set(params)
    assert params["chunk_kkt_inverse"]["inverse"] == "warp"
    assert params["chunk_kkt_inverse"]["threads"] == 64
    assert params["chunk_wu"]["loop_columns"] and params["chunk_wu"]["block_n"] == 64
    for op in ("gla", "kda"):           # no A to split: unchanged
        assert "chunk_prepare" in chunk.stage_params(get_spec(op), opts, **kw)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT", False)
    params = chunk.stage_params(spec, opts, **kw)
    assert "chunk_prepare" in params and not set(SPLIT) & set(params)
    assert chunk.wu_block_n(128, 128) == 64
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_BLOCK_N", 128)
    assert chunk.wu_block_n(128, 128) == 128 and chunk.wu_block_n(64, 128) == 64
    assert chunk.wu_block_n(128, 48) == 16
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_WU", "grid")
    assert "loop_columns" not in chunk.wu_params(128, 128)      # the column grid


def test_wu_loop_knob(monkeypatch):
    """PREPARE_SPLIT_WU="loop": one CTA per (chunk, head), same block_n rule; else the grid."""
    spec, opts = get_spec("gdn"), Options()
    monkeypatch.setattr(chunk, "PREPARE_SPLIT", True)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_WU", "loop")
    wu = chunk.stage_params(spec, opts, H=2, HV=4, K=128, V=128, dtype="bfloat16")["chunk_wu"]
    assert wu["loop_columns"] and wu["block_n"] == 64
    assert chunk.wu_params(128, 48) == dict(block_n=16, loop_columns=True)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_BLOCK_N", 128)
    assert chunk.wu_params(128, 128) == dict(block_n=128, loop_columns=True)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_WU", "grid")
    assert chunk.wu_params(128, 128) == dict(block_n=128)
    for name in ("split-wuloop", "split-wuloop-bn128", "split-warp-wuloop", "split-warp64-wuloop"):
        assert chunk.PREPARE_VARIANTS[name]["PREPARE_SPLIT_WU"] == "loop"


@pytest.mark.parametrize("op,stage,extra", [
    ("gdn", "chunk_kkt_inverse", dict(inverse="tc")),
    ("deltanet", "chunk_kkt_inverse", dict(inverse="blocked", a_dtype="float32")),
    ("gdn", "chunk_wu", {}),
    ("deltanet", "chunk_wu", dict(block_n=128)),
    ("gdn", "chunk_wu", dict(loop_columns=True)),
    ("deltanet", "chunk_wu", dict(loop_columns=True, block_n=128)),
    ("gdn", "chunk_wu", dict(H=2, HV=4, K=128, V=64, a_dtype="float32", loop_columns=True)),
])
def test_split_stage_compiles(op, stage, extra):
    mod = chunk.stage_module(get_spec(op), stage)
    params = dict(mod.EXAMPLES[0], **extra)
    src = chunk.compiled_stage(get_spec(op), stage, **params).get_kernel_source()
    assert "mma" in src or "wgmma" in src


# -- fake kernels: signature checks + the stage formulas in fp64 ---------------------------

def _f64(x):
    return x.to(F64)


def _kkt_inverse(spec, p, k, g, beta, A_log, dt_bias, chunk_bos, chunk_len, g_cum, kn, A):
    """Per chunk and value head: gate cumsum, l2norm, beta, X = (I + M)^-1, A_b = X beta."""
    HV, group = p["HV"], p["HV"] // p["H"]
    lp = getattr(torch, p["dtype"])
    for c, (t0, L) in enumerate(zip(chunk_bos.tolist(), chunk_len.tolist())):
        kc = _f64(k[t0:t0 + L]).repeat_interleave(group, dim=1).transpose(0, 1)  # [HV, L, K]
        if p["l2norm_qk"]:
            kc = kc / torch.sqrt((kc * kc).sum(-1, keepdim=True) + 1e-6)
            kn[t0:t0 + L] = kc[::group].transpose(0, 1).to(lp)
            kc = kc.to(lp).to(F64)                   # the GEMM reads the stored k
        gc = torch.zeros(HV, C, dtype=F64)
        if spec.has_gate:
            x = _f64(g[t0:t0 + L]).T
            if p["gate_in_kernel"]:
                x = -torch.exp(_f64(A_log))[:, None] * torch.nn.functional.softplus(
                    x + _f64(dt_bias)[:, None], threshold=20.0)
            gc[:, :L] = x
            gc = gc.cumsum(1)                        # padded rows keep the chunk's last sum
            g_cum[:, c * C:(c + 1) * C] = gc.float()
        b = _f64(beta[t0:t0 + L]).T                  # [HV, L]
        if p["beta_sigmoid"]:
            b = (2.0 if p["allow_neg_eigval"] else 1.0) * torch.sigmoid(b)
        g_l = gc[:, :L]
        M = torch.tril(b[:, :, None] * (kc @ kc.transpose(1, 2))
                       * torch.exp(g_l[:, :, None] - g_l[:, None, :]), -1)
        eye = torch.eye(L, dtype=F64)
        X = torch.linalg.solve_triangular(eye + M, eye.expand_as(M), upper=False)
        A[t0:t0 + L] = 0
        A[t0:t0 + L, :, :L] = (X * b[:, None, :]).transpose(0, 1).to(A.dtype)


def _wu(spec, p, k, v, A, g_cum, chunk_bos, chunk_len, w, u):
    """Per chunk: w = (A_b e^g_j) k, u = A_b v, the A operand rounded to the input dtype."""
    HV, group = p["HV"], p["HV"] // p["H"]
    lp = getattr(torch, p["dtype"])
    for c, (t0, L) in enumerate(zip(chunk_bos.tolist(), chunk_len.tolist())):
        Ab = _f64(A[t0:t0 + L, :, :L]).transpose(0, 1)                          # [HV, L, L]
        kc = _f64(k[t0:t0 + L]).repeat_interleave(group, dim=1).transpose(0, 1)
        vc = _f64(v[t0:t0 + L]).transpose(0, 1)
        Aw = Ab
        if spec.has_gate:
            Aw = Ab * torch.exp(_f64(g_cum[:, c * C:c * C + L]))[:, None, :]
        w[t0:t0 + L] = (Aw.to(lp).to(F64) @ kc).transpose(0, 1).to(lp)
        u[t0:t0 + L] = (Ab.to(lp).to(F64) @ vc).transpose(0, 1).to(lp)


EMULATE = {"chunk_kkt_inverse": _kkt_inverse, "chunk_wu": _wu}


class StageKernel(SignatureCheckingKernel):
    """Checks the signature; emulates the split stages, records the later stages' args."""

    def __init__(self, spec, stage, func, params, seen):
        super().__init__(func)
        self.spec, self.stage, self.params, self.seen = spec, stage, params, seen

    def __call__(self, *args):
        super().__call__(*args)
        self.seen[self.stage] = args
        if self.stage in EMULATE:
            EMULATE[self.stage](self.spec, self.params, *args)


SPLIT_CASES = [
    ("gdn", dict(B=2, T=130, H=2, HV=4, K=64, V=64), Options(), None, None),
    ("gdn", dict(B=1, T=0, H=1, HV=2, K=64, V=128),
     Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True, gate_in_kernel=True),
     [1, 64, 1, 65, 7], "float32"),
    ("deltanet", dict(B=1, T=0, H=2, HV=2, K=128, V=64), Options(l2norm_qk=True),
     [63, 1, 100], None),
    ("deltanet", dict(B=3, T=1, H=1, HV=1, K=64, V=64), Options(), None, "float32"),
]


@pytest.mark.parametrize("wu", ["grid", "loop"])
@pytest.mark.parametrize("name,dims,options,lens,a_dtype", SPLIT_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(SPLIT_CASES)])
def test_split_stage_math_against_fp64_reference(monkeypatch, rng, name, dims, options, lens,
                                                 a_dtype, wu):
    spec = get_spec(name)
    seen = {}
    monkeypatch.setattr(chunk, "PREPARE_SPLIT", True)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_WU", wu)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_A_DTYPE", a_dtype)
    monkeypatch.setattr(chunk, "PREPARE_SPLIT_BLOCK_N", 64)

    def fake_compiled(spec_, stage, **params):
        mod = chunk.stage_module(spec_, stage)
        seen[stage + "_params"] = params
        return StageKernel(spec_, stage, mod.build(**params), params, seen)

    monkeypatch.setattr(chunk, "compiled_stage", fake_compiled)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    B, T, H, HV, K, V = (dims[x] for x in ("B", "T", "H", "HV", "K", "V"))
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + np.cumsum(lens).tolist())
        T = int(cu[-1])
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    bf = torch.bfloat16
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = rnd(B, T, H, K).to(bf)
    k = (rnd(B, T, H, K) if options.l2norm_qk
         else torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)).to(bf)
    v = rnd(B, T, HV, V).to(bf)
    g = (rnd(B, T, HV) if options.gate_in_kernel
         else -0.1 * torch.rand(B, T, HV, generator=gen)) if spec.has_gate else None
    beta = (rnd(B, T, HV) if options.beta_sigmoid
            else torch.rand(B, T, HV, generator=gen)).to(bf)
    A_log = torch.rand(HV, generator=gen) - 2 if options.gate_in_kernel else None
    dt_bias = torch.rand(HV, generator=gen) if options.gate_in_kernel else None
    chunk.chunk_forward(spec, q, k, v, g, beta, options=options, cu_seqlens=cu,
                        cu_seqlens_cpu=cu, A_log=A_log, dt_bias=dt_bias)
    assert set(SPLIT) <= set(seen) and "chunk_prepare" not in seen
    assert bool(seen["chunk_wu_params"].get("loop_columns")) == (wu == "loop")

    npy = lambda x: None if x is None else x.double().numpy()  # noqa: E731
    ref = np_chunked_forward(spec, npy(q), npy(k), npy(v), npy(g), npy(beta), options=options,
                             cu_seqlens=npy(cu), A_log=npy(A_log), dt_bias=npy(dt_bias))
    k_state, w, u, g_cum = seen["chunk_state"][:4]
    Ttot = B * T
    rel = lambda got, want: float(np.linalg.norm(got.double().numpy().reshape(want.shape) - want)  # noqa: E731
                                  / max(np.linalg.norm(want), 1e-30))
    A = seen["chunk_kkt_inverse"][-1]
    # A_b[t, h, j] = A[t, h, j] beta[chunk start + j]: beta of the chunk's column tokens
    Ab_ref = np.zeros_like(ref["A"])
    bos, length, _ = chunk.build_chunk_tables(cu.tolist() if cu is not None
                                              else list(range(0, (B + 1) * T, T)), C)
    A_ref, b_eff = ref["A"].reshape(Ttot, HV, C), ref["prepared"].beta.reshape(Ttot, HV)
    Ab_ref = Ab_ref.reshape(Ttot, HV, C)
    for t0, L in zip(bos, length):
        Ab_ref[t0:t0 + L, :, :L] = A_ref[t0:t0 + L, :, :L] * b_eff[t0:t0 + L].T[None]
    # f32 A is exact up to f32 rounding, unless the KKT used the bf16-stored kn (l2norm)
    tol_a = 1e-6 if a_dtype == "float32" and not options.l2norm_qk else 1e-2
    assert rel(A, Ab_ref) < tol_a
    assert rel(w, ref["w"].reshape(Ttot, HV, K)) < 2e-2
    assert rel(u, ref["u"].reshape(Ttot, HV, V)) < 2e-2
    kn_ref = ref["prepared"].k.reshape(Ttot, HV, K)[:, ::HV // H]
    assert rel(k_state, kn_ref) < 1e-2
    if spec.has_gate:
        g_ref = np.zeros((HV, len(bos) * C))
        g_eff = ref["g_cum"].reshape(Ttot, HV)
        for c, (t0, L) in enumerate(zip(bos, length)):
            g_ref[:, c * C:c * C + L] = g_eff[t0:t0 + L].T
            g_ref[:, c * C + L:(c + 1) * C] = g_eff[t0 + L - 1][:, None]
        assert rel(g_cum, g_ref) < 1e-6
