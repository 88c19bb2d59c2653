"""CPU tests of KDA's chunked backward (the delta rule with a per-key gate; ops/chunk_bwd.py
key_rebuild_packed, run_stages, key_grads; ops/autograd.py packed_backward):
the plan lists the stages, they render with the arguments the host passes, they compile
for sm_90a without spills, the token-first rebuild, the stages and chunk_bwd_key_grads
on packed varlen inputs match dsl/delta_key_bwd.py, and training through linattn.chunk_kda
matches torch.autograd of the fp64 reference. The kernels are replaced by fakes that check
every launch against the traced prim_func and carry out the stage's math in fp64 by
dsl/delta_key_bwd.py's stage functions (per chunk, with the kernels' rounding of GEMM
operands emulated); the training forward itself is the fp64 reference rounded to the input
dtype, its per-chunk states too (the backward reads them, tests/_forward_states.py
forward_states), and the A, A_qk it keeps by the fp64 prepare (KeyStageMath.prepare). The four stages read token-first packed tensors [Ttot, heads, D] cut into
chunks by the chunk tables; the fakes walk those tables as the kernels do."""
import numpy as np
import pytest
import torch

from _forward_states import forward_states
from conftest import assert_token_sum_of, token_sum_err
from _kernel_check import fake_compiles
from test_chunk import by_name
from test_autograd import v_first_matches_k_first
from test_chunk_bwd import _key_grads

import linattn
from linattn.codegen.arch import DEFAULT_ARCH
from linattn.codegen.plan import plan
from linattn.dsl import Options, SpecError
from linattn.dsl import delta_key_bwd as ref
from linattn.dsl import torch_reference as tref
from linattn.dsl.additive_bwd import rounding
from linattn.codegen.arch.sm90 import backward as sm90_backward
from linattn.ops import autograd, chunk, chunk_bwd, runtime
from linattn.ops.kda import SPEC

F64 = torch.float64
C = chunk_bwd.CHUNK
STAGES = (chunk_bwd.REBUILD,) + chunk_bwd.STAGES
KEY_GRADS = "chunk_bwd_key_grads"


def test_plan_lists_the_stages():
    assert [s.name for s in plan(SPEC, "bwd")] == [*STAGES, KEY_GRADS]


@pytest.mark.parametrize("stage", STAGES + (KEY_GRADS,))
def test_stage_renders(stage):
    mod = chunk.stage_module(SPEC, stage)
    assert mod.STAGE == stage and mod.VARIANT == "bwd" and mod.SPEC_HASH == SPEC.hash
    for ex in mod.EXAMPLES[:2]:
        fn = mod.build(**ex)
        if hasattr(mod, "args"):
            assert list(runtime.arg_names(fn)) == mod.args(**ex)


def test_rebuild_params_are_the_forward_prepare():
    """The rebuild renders the forward's per-key prepare (reading A) at the params the
    arch's plan gives chunk_prepare, and nothing else (the states are the forward's)."""
    p = chunk_bwd.key_rebuild_params(H=3, K=64, V=128, dtype="bfloat16", B=2, L=128)
    fwd = chunk.plan_params(chunk.forward_plan(
        SPEC, Options(), H=1, HV=1, K=64, V=128, dtype="bfloat16", beta_dtype="bfloat16",
        seq_chunks=(2,) * 6, Ttot=768, has_initial_state=True, output_final_state=True,
        return_states=True, config={"fused": False}))
    assert p == {chunk_bwd.REBUILD: fwd["chunk_prepare"]}   # (the states: the forward's)
    assert not any(p[chunk_bwd.REBUILD][f] for f in ("l2norm_qk", "beta_sigmoid",
                                                       "gate_in_kernel"))


def test_stage_params_are_the_one_head_gated_ones():
    """The four stages' gated params: the heads given, the gated dh pass's pipeline depth,
    dht / dh0 only where asked, the states in the input dtype (no state_dtype)."""
    sp = chunk_bwd.stage_params(gate="key", H=1, K=64, V=128, dtype="bfloat16", chains=6,
                                use_dht=True)
    assert list(sp) == list(chunk_bwd.STAGES)
    for stage, p in sp.items():
        assert (p["H"], p["HV"], p["K"], p["V"], p["dtype"]) == (1, 1, 64, 128, "bfloat16"), \
            stage
    assert sp["chunk_bwd_dh"]["use_dht"] and "store_dh0" not in sp["chunk_bwd_dh"]
    assert sp["chunk_bwd_dh"]["num_stages"] == sm90_backward.DH_NUM_STAGES
    assert "state_dtype" not in sp["chunk_bwd_dqkw"]
    sp = chunk_bwd.stage_params(gate="key", H=1, K=64, V=128, dtype="bfloat16", chains=6,
                                store_dh0=True)
    assert sp["chunk_bwd_dh"]["store_dh0"] and "use_dht" not in sp["chunk_bwd_dh"]


@pytest.mark.parametrize("l2norm", [False, True])
def test_key_train_params(l2norm):
    """key_train_params: the token-first backward's kernels, the rebuild at the params
    the arch's plan gives the forward's chunk_prepare for the call (its key and value
    heads, its l2norm_qk), the four stages in their gated form at the same heads, then
    chunk_bwd_key_grads (the l2norm's backward with l2norm)."""
    p = chunk_bwd.key_train_params(H=2, HV=4, K=64, V=128, dtype="bfloat16", chains=12,
                                   l2norm=l2norm, use_dht=True)
    assert list(p) == [*STAGES, KEY_GRADS]
    fwd = chunk.plan_params(chunk.forward_plan(
        SPEC, Options(l2norm_qk=l2norm), H=2, HV=4, K=64, V=128, dtype="bfloat16",
        beta_dtype="bfloat16", seq_chunks=(2, 1, 3), Ttot=6 * C, has_initial_state=True,
        output_final_state=True, return_states=True, config={"fused": False}))
    assert p[chunk_bwd.REBUILD] == fwd["chunk_prepare"]
    assert p[chunk_bwd.REBUILD]["l2norm_qk"] == l2norm
    assert p[KEY_GRADS] == dict(H=2, HV=4, K=64, dtype="bfloat16", l2norm=l2norm)
    sp = chunk_bwd.stage_params(gate="key", H=2, HV=4, K=64, V=128, dtype="bfloat16", chains=12,
                                use_dht=True)
    assert {s: p[s] for s in chunk_bwd.STAGES} == sp


@pytest.mark.compile
@pytest.mark.parametrize("K,V,dtype", [(128, 128, "bfloat16"), (64, 64, "float16"),
                                       (128, 64, "float16"), (64, 128, "bfloat16")])
def test_stages_compile_without_spills(K, V, dtype):
    """Every stage one call runs (B = 2, H = 4, with dht and dh0: the B H one-head
    sequences) compiles for sm_90a without spills and without a CTA barrier in a
    thread-dependent branch."""
    from linattn.codegen.compile import compile_stage, format_record
    params = dict(chunk_bwd.key_rebuild_params(H=4, K=K, V=V, dtype=dtype, B=2, L=128),
                  **chunk_bwd.stage_params(gate="key", H=1, K=K, V=V, dtype=dtype, chains=2 * 4,
                                           use_dht=True, store_dh0=True))
    for stage, p in params.items():
        rec = compile_stage(chunk.stage_module(SPEC, stage), p, "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["registers"] and rec["registers"] <= 255, rec
        assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
        assert not rec["barriers_in_branches"], rec


@pytest.mark.compile
def test_token_first_rebuild_compiles_without_spills():
    """The token-first rebuild (GVA, l2norm: g_cum, qn, kn written too) and
    chunk_bwd_key_grads at key_train_params compile for sm_90a without spills and without
    a CTA barrier in a thread-dependent branch."""
    from linattn.codegen.compile import compile_stage, format_record
    params = chunk_bwd.key_train_params(H=2, HV=4, K=128, V=128, dtype="bfloat16", chains=8,
                                        l2norm=True)
    for stage in (chunk_bwd.REBUILD, KEY_GRADS):
        rec = compile_stage(chunk.stage_module(SPEC, stage), params[stage], "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["registers"] and rec["registers"] <= 255, rec
        assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
        assert not rec["barriers_in_branches"], rec


# -- fakes: the stages' math by dsl/delta_key_bwd.py, chunk by chunk ------------------------

def _np(x):
    return x.detach().to(F64).numpy()


def _t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def _rel(x, r):
    return float(torch.linalg.norm(x.to(F64) - r) / max(torch.linalg.norm(r), 1e-30))


def _take(x, t0, n, heads=None, edge=False):
    """Rows t0 .. t0 + n of token-first x [Ttot, Hx, ..] as fp64 [heads, 64, ..] (heads:
    the index of the head each value head reads; None: all of x's), padded to the whole
    chunk as the kernels pad it: zeros, or the last row repeated (edge: the cumulative gate,
    which stays at G_l past the chunk)."""
    y = _np(x[t0:t0 + n])
    y = np.swapaxes(y if heads is None else y[:, heads], 0, 1)
    return np.pad(y, [(0, 0), (0, C - n)] + [(0, 0)] * (y.ndim - 2),
                  mode="edge" if edge else "constant")


def _put(dst, t0, n, y):
    """dst[t0 : t0 + n] = y [heads, 64, ..]'s first n rows (rounded once to dst's dtype)."""
    dst[t0:t0 + n] = _t(np.swapaxes(y[:, :n], 0, 1)).to(dst.dtype)


def _chunks(chunk_bos, chunk_len):
    return enumerate(zip(chunk_bos.tolist(), chunk_len.tolist()))


class KeyStageMath:
    """The per-key stages in fp64 (dsl/delta_key_bwd.py), rounding GEMM operands to the
    kernels' input dtype, on token-first packed tensors [Ttot, heads, D] as the kernels
    take them (by argument name, with the build() params p): the per-chunk stages walk
    chunk_bos / chunk_len (rows past a short chunk zero, the cumulative gate held at its
    last row, only the chunk's rows written), the dh pass each sequence's chunks
    chunk_offsets[n] .. chunk_offsets[n+1] - 1 (tokens from cu_seqlens[n]) last first;
    value head h reads q, k at key head h // (HV / H) and chunk t the state S[state_row[t]]."""

    def __init__(self, params):
        self.p = params
        self.rnd = rounding(params["dtype"])
        H, HV = params["H"], params["HV"]
        assert HV % H == 0, params
        self.kh = np.arange(HV) // (HV // H)      # each value head's key head

    def prepare(self, q, k, v, g, beta, chunk_bos, chunk_len, l2norm):
        """The forward's per-key prepare per chunk in fp64 (chunks of any length: rows past
        it zero, g = 0 there, so G stays at its last row and g_last = G[len - 1]); with
        l2norm q, k l2-normalised first (the kernel scales its raw sums by rsqrt(sum x^2 +
        eps) in f32: unrounded here). Yields (chunk, t0, len, q, k (normalised), the
        dict of dsl/delta_key_bwd.recompute)."""
        norm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + tref.L2NORM_EPS)  # noqa: E731
        for ci, (t0, n) in _chunks(chunk_bos, chunk_len):
            qc, kc = _take(q, t0, n), _take(k, t0, n)      # [H, 64, K]
            if l2norm:
                qc, kc = norm(qc), norm(kc)
            yield ci, t0, n, qc, kc, ref.recompute(qc[self.kh], kc[self.kh], _take(v, t0, n),
                                                   _take(beta, t0, n), _take(g, t0, n),
                                                   self.rnd)

    def kept(self, q, k, v, g, beta, tables, l2norm):
        """What the training forward keeps for the backward besides its states (A, aqk
        [Ttot, HV, 64] in v's dtype), by :meth:`prepare`."""
        Tt, HV = v.shape[:2]
        out = {n: v.new_zeros(Tt, HV, C) for n in ("A", "aqk")}
        for _, t0, n, _, _, r in self.prepare(q, k, v, g, beta, tables["chunk_bos"],
                                              tables["chunk_len"], l2norm):
            for name, dst in out.items():
                _put(dst, t0, n, r[name])
        return out

    def rebuild(self, p, q, k, v, g, beta, chunk_bos, chunk_len, A, qg, kg, g_last, w, u,
                g_cum, qn, kn, **_):
        """The rebuild from the kept inverse A (read as given: w = A (beta k e^G), u =
        A (beta v), rounded as the kernel stores them), qg, kg, g_last and G (g_cum, the
        chunk's rows) by the forward's prepare; with l2norm_qk qn, kn written rounded once
        (without, they are left alone)."""
        assert not (p["beta_sigmoid"] or p["gate_in_kernel"]), p
        rnd = self.rnd
        for ci, t0, n, qc, kc, r in self.prepare(q, k, v, g, beta, chunk_bos, chunk_len,
                                                 p["l2norm_qk"]):
            if p["l2norm_qk"]:
                _put(qn, t0, n, qc)
                _put(kn, t0, n, kc)
            X, b = _take(A, t0, n), _take(beta, t0, n)[:, :, None]
            r.update(w=rnd(X @ rnd(b * kc[self.kh] * np.exp(r["G"]))),
                     u=rnd(X @ rnd(b * _take(v, t0, n))))
            for name, dst in (("qg", qg), ("kg", kg), ("w", w), ("u", u), ("G", g_cum)):
                _put(dst, t0, n, r[name])
            g_last[ci] = _t(r["g_last"]).to(g_last.dtype)

    def dv_local(self, p, aqk, do, dv_local, chunk_bos, chunk_len):
        for _, (t0, n) in _chunks(chunk_bos, chunk_len):
            _put(dv_local, t0, n, ref.dv_local(_take(aqk, t0, n), _take(do, t0, n), self.rnd))

    def dh(self, p, qg, kg, w, do, g_last, dv_local, dh_out, dv2, dht, dh0, cu_seqlens,
           chunk_offsets):
        cu, offs = cu_seqlens.tolist(), chunk_offsets.tolist()
        HV, K, V = dh_out.shape[1:]
        for n in range(len(cu) - 1):
            bos, eos = cu[n], cu[n + 1]
            c0, nc = offs[n], offs[n + 1] - offs[n]
            assert nc == -(-(eos - bos) // C), (n, cu, offs)
            dh = _np(dht[n]) if p.get("use_dht") else np.zeros((HV, K, V))   # f32 registers
            for r in reversed(range(nc)):
                c, t0 = c0 + r, bos + r * C
                rows = min(C, eos - t0)
                dh_out[c] = _t(dh).to(dh_out.dtype)
                x = [_take(t, t0, rows) for t in (qg, kg, w, do)]
                d, dh = ref.dh_step(*x, _np(g_last[c]), _take(dv_local, t0, rows), dh,
                                    self.rnd)
                _put(dv2, t0, rows, d)
            if p.get("store_dh0"):
                dh0[n] = _t(dh).to(dh0.dtype)

    def dqkw(self, p, q, k, w, u, do, g_cum, dv2, S, state_row, dh, dq, dk_part, dw, dg_part,
             chunk_bos, chunk_len):
        assert p.get("state_dtype") in (None, p["dtype"]), p
        rows = state_row.tolist()
        for c, (t0, n) in _chunks(chunk_bos, chunk_len):
            x = [_take(q, t0, n, self.kh), _take(k, t0, n, self.kh)]
            x += [_take(t, t0, n) for t in (w, u, do)]
            x += [_take(g_cum, t0, n, edge=True), _take(dv2, t0, n)]
            out = list(ref.dqkw(*x, _np(S[rows[c]]), _np(dh[c]), self.rnd))
            if n < out[3].shape[1]:     # the kernel adds the last row's terms at row n - 1
                out[3] = out[3].copy()      # (row 63 of a short chunk: q, k rows 0)
                out[3][:, n - 1] += out[3][:, -1]
            for dst, y in zip((dq, dk_part, dw, dg_part), out):
                _put(dst, t0, n, y)

    def wy(self, p, k, v, beta, g_cum, A, dw, du, dk_part, dg_part, dk, dv, dbeta, dg,
           chunk_bos, chunk_len):
        for _, (t0, n) in _chunks(chunk_bos, chunk_len):
            x = [_take(k, t0, n, self.kh), _take(v, t0, n), _take(beta, t0, n),
                 _take(g_cum, t0, n, edge=True)]
            x += [_take(t, t0, n) for t in (A, dw, du, dk_part, dg_part)]
            for dst, y in zip((dk, dv, dbeta, dg), ref.wy(*x, self.rnd)):
                _put(dst, t0, n, y)


def install_key_fakes(monkeypatch):
    """Route every compile to fakes checked against the traced kernels: the per-key
    stages (the per-key spec's kernels) run KeyStageMath, chunk_bwd_key_grads
    test_chunk_bwd's emulation. Returns the stage names compiled, in order."""
    names = []

    def body(spec, stage, params):
        names.append(stage)
        assert chunk_bwd.is_key(spec), (spec.name, stage)
        if stage == KEY_GRADS:
            return by_name({stage: _key_grads})(spec, stage, params)
        if stage == chunk_bwd.REBUILD or stage in chunk_bwd.STAGES:
            fn = getattr(KeyStageMath(params), stage.replace("chunk_bwd_", "").replace(
                "key_rebuild", "rebuild"))
            return by_name({stage: fn})(spec, stage, params)
        raise AssertionError(f"the per-key backward launched {stage}")
    fake_compiles(monkeypatch, body)
    monkeypatch.setattr(chunk_bwd, "_check_device", lambda n, x: None)
    return names


@pytest.mark.parametrize("cu,H,HV,K,V,dtype", [
    ((0, 128, 192, 320), 1, 2, 64, 64, torch.float16),
    ((0, 64, 256), 2, 4, 128, 64, torch.bfloat16)])
def test_stages_token_first_match_reference(monkeypatch, rng, cu, H, HV, K, V, dtype):
    """The four stages on token-first packed varlen inputs with GVA (run_stages, the per-key gate:
    q, k [Ttot, H, K] read at key head h // (HV / H); each sequence's dh pass by
    cu_seqlens / chunk_offsets; chunk t's state S[state_row[t]], the rows shuffled) after
    the rebuild at the same heads, against dsl/delta_key_backward in fp64 (dq, dk summed
    over each key head's value heads). Sequences of whole chunks, as the per-key path
    gives the stages."""
    names = install_key_fakes(monkeypatch)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    Tt, N, G = cu[-1], len(cu) - 1, HV // H
    q, k = (torch.nn.functional.normalize(r(Tt, H, K), dim=-1).to(dtype) for _ in "qk")
    v, do = r(Tt, HV, V).to(dtype), r(Tt, HV, V).to(dtype)
    beta = torch.sigmoid(r(Tt, HV)).to(dtype)
    g = torch.nn.functional.logsigmoid(r(Tt, HV, K)).float()
    h0, dht = (0.1 * r(N, HV, K, V)).float(), r(N, HV, K, V).float()
    tables = chunk._tables(cu, C, "cpu", 0)
    NT, dt = tables["chunk_bos"].numel(), str(dtype).replace("torch.", "")
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32)  # noqa: E731
    rp = dict(chunk_bwd.key_rebuild_params(H=1, K=K, V=V, dtype=dt)[chunk_bwd.REBUILD],
              H=H, HV=HV)
    kept = KeyStageMath(rp).kept(q, k, v, g, beta, tables, False)
    x = dict(tables, q=q, k=k, v=v, g=g, beta=beta, A_log=f32(HV), dt_bias=f32(HV * K),
             qg=v.new_empty(Tt, HV, K), kg=v.new_empty(Tt, HV, K),
             g_last=f32(NT, HV, K), w=v.new_empty(Tt, HV, K), u=v.new_empty(Tt, HV, V),
             g_cum=f32(Tt, HV, K), qn=q, kn=k, **kept)
    runtime.launch_kernel(SPEC, DEFAULT_ARCH, chunk_bwd.REBUILD, rp, x)
    del x["g"]
    x["g_cum"] = g.view(NT, C, HV, K).cumsum(1).view(Tt, HV, K)
    h = tref.chunked_forward(SPEC, *(t.to(F64)[None] for t in (q, k, v, g)),
                             beta=beta.to(F64)[None], scale=1.0, initial_state=h0.double(),
                             cu_seqlens=torch.tensor(cu), intermediates=True)["h"]
    S = forward_states(h, list(cu), Tt, dtype)               # [NT, HV, K, V]
    assert S.shape == (NT, HV, K, V), S.shape
    perm = torch.randperm(NT, generator=gen)
    x["S"] = torch.empty_like(S)
    x["S"][perm] = S
    x.update(do=do, state_row=perm.to(torch.int32), dht=dht, dh0=f32(N, HV, K, V))
    params = chunk_bwd.stage_params(gate="key", H=H, HV=HV, K=K, V=V, dtype=dt, chains=N * HV,
                                    use_dht=True, store_dh0=True)
    chunk_bwd.run_stages(SPEC, params, x)
    assert names == list(STAGES)
    want = ref.delta_key_backward(SPEC, *(t.to(F64)[None].numpy() for t in (q, k, v, g, beta)),
                                  do=do.to(F64)[None].numpy(), dht=dht.double().numpy(),
                                  scale=1.0, initial_state=h0.double().numpy(),
                                  cu_seqlens=np.array(cu))
    got = dict(dq=x["dq"].to(F64).view(Tt, H, G, K).sum(2),
               dk=x["dk"].to(F64).view(Tt, H, G, K).sum(2),
               dv=x["dv"], dbeta=x["dbeta"], dg=x["dg"], dh0=x["dh0"])
    for name, t in got.items():
        w = torch.from_numpy(want[name])
        w = w if name == "dh0" else w[0]
        assert t.shape == w.shape and not torch.isnan(t).any(), name
        assert _rel(t, w) < 1e-2, (name, _rel(t, w))


@pytest.mark.parametrize("cu,H,HV,K,V,l2norm,dtype", [
    pytest.param((0, 128, 192, 320), 1, 2, 64, 64, False, torch.float16, id="whole-GVA2"),
    pytest.param((0, 128, 192, 320), 1, 2, 64, 64, True, torch.float16,
                 id="whole-GVA2-l2norm"),
    pytest.param((0, 100, 164, 257), 2, 4, 64, 128, True, torch.bfloat16,
                 id="partial-GVA2-l2norm"),
    pytest.param((0, 1, 70, 134, 200), 1, 2, 128, 64, False, torch.bfloat16,
                 id="partial-1tok-GVA2"),
    pytest.param((0, 64, 150), 2, 4, 128, 64, True, torch.float16,
                 id="mixed-GVA2-l2norm")])
def test_token_first_rebuild_stages_match_reference(monkeypatch, rng, cu, H, HV, K, V,
                                                    l2norm, dtype):
    """The per-key gate's token-first backward from the call's packed varlen tensors:
    key_rebuild_packed (from the A, A_qk the forward keeps: w, u, qg, kg, g_last, g_cum
    and, with l2norm, the l2-normalised q, k), run_stages (chunk t's state S[state_row[t]], the
    rows shuffled), then chunk_bwd_key_grads (dq, dk summed over each key head's value
    heads, through the l2norm's backward; the scale folded into do, so dq's factor is 1),
    against dsl/delta_key_backward in fp64 with the same scale and l2norm. Sequences of
    whole chunks and not."""
    names = install_key_fakes(monkeypatch)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    Tt, N = cu[-1], len(cu) - 1
    q, k = r(Tt, H, K), r(Tt, H, K)
    if not l2norm:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    q, k = q.to(dtype), k.to(dtype)
    v, do = r(Tt, HV, V).to(dtype), r(Tt, HV, V).to(dtype)
    beta = torch.sigmoid(r(Tt, HV)).to(dtype)
    g = torch.nn.functional.logsigmoid(r(Tt, HV, K)).float()
    h0, dht = (0.1 * r(N, HV, K, V)).float(), r(N, HV, K, V).float()
    scale = K ** -0.5
    tables = chunk._tables(cu, C, "cpu", 0)
    NT, dt = tables["chunk_bos"].numel(), str(dtype).replace("torch.", "")
    params = chunk_bwd.key_train_params(H=H, HV=HV, K=K, V=V, dtype=dt, chains=N * HV,
                                        l2norm=l2norm, use_dht=True, store_dh0=True)
    kept = KeyStageMath(params[chunk_bwd.REBUILD]).kept(q, k, v, g, beta, tables, l2norm)
    x = chunk_bwd.key_rebuild_packed(q, k, v, beta, g, kept["A"], kept["aqk"], tables, params)
    assert names == [chunk_bwd.REBUILD]
    assert set(x) == {"q", "k", "A", "aqk", "qg", "kg", "g_last", "w", "u", "g_cum"}
    for name, raw in (("q", q), ("k", k)):
        if l2norm:
            assert x[name].shape == raw.shape and x[name].dtype == dtype, name
            want = tref.l2norm(raw.to(F64))
            assert _rel(x[name], want) < 1e-2, (name, _rel(x[name], want))
        else:
            assert x[name] is raw, name
    assert x["g_cum"].shape == (Tt, HV, K) and x["g_cum"].dtype == torch.float32
    assert x["g_last"].shape == (NT, HV, K) and x["g_last"].dtype == torch.float32
    for c, (t0, n) in _chunks(tables["chunk_bos"], tables["chunk_len"]):
        want = g[t0:t0 + n].double().cumsum(0)
        torch.testing.assert_close(x["g_cum"][t0:t0 + n].double(), want, rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(x["g_last"][c].double(), want[-1], rtol=1e-5, atol=1e-5)

    opts = Options(l2norm_qk=l2norm)
    h = tref.chunked_forward(SPEC, *(t.to(F64)[None] for t in (q, k, v, g)),
                             beta=beta.to(F64)[None], options=opts, scale=scale,
                             initial_state=h0.double(), cu_seqlens=torch.tensor(cu),
                             intermediates=True)["h"]
    S = forward_states(h, list(cu), Tt, dtype)               # [NT, HV, K, V]
    assert S.shape == (NT, HV, K, V), S.shape
    perm = torch.randperm(NT, generator=gen)
    x["S"] = torch.empty_like(S)
    x["S"][perm] = S
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32)  # noqa: E731
    x.update(tables, v=v, beta=beta, do=(do.to(F64) * scale).to(dtype),
             state_row=perm.to(torch.int32), dht=dht, dh0=f32(N, HV, K, V))
    chunk_bwd.run_stages(SPEC, params, x)
    dq, dk = chunk_bwd.key_grads(x, q, k, 1.0, params, SPEC)
    assert names == [*STAGES, KEY_GRADS]
    want = ref.delta_key_backward(SPEC, *(t.to(F64)[None].numpy() for t in (q, k, v, g, beta)),
                                  do=do.to(F64)[None].numpy(), dht=dht.double().numpy(),
                                  options=opts, scale=scale,
                                  initial_state=h0.double().numpy(), cu_seqlens=np.array(cu))
    got = dict(dq=dq, dk=dk, dv=x["dv"], dbeta=x["dbeta"], dg=x["dg"], dh0=x["dh0"])
    for name, t in got.items():
        w = torch.from_numpy(want[name])
        w = w if name == "dh0" else w[0]
        assert t.shape == w.shape and not torch.isnan(t).any(), name
        assert _rel(t, w) < 1e-2, (name, _rel(t, w))


def _gate_param_terms(refs, lower_bound) -> dict:
    """The per-token terms of A_log's and dt_bias's gradients (the fp64 reference's),
    whose token sums can cancel (seed 1631519592: A_log 2.8 % off its sum in f16): with
    x = g + dt_bias, x's gradient is g's; A_log's terms are g's gradient times
    softplus(x) / sigmoid(x) (the softplus gate) or times x (the lower-bounded
    lb sigmoid(e^A_log x))."""
    g, dt_bias = refs["g"], refs["dt_bias"]
    HV, K = g.shape[2], g.shape[3]
    x = g.detach() + dt_bias.detach().view(HV, K)
    factor = x if lower_bound is not None else \
        torch.nn.functional.softplus(x) / torch.sigmoid(x)
    return {"dt_bias": g.grad, "A_log": g.grad * factor}


def _gate(call_or_opts, g, A_log, dt_bias, lower_bound):
    """(g as the fp64 reference takes it, its options): KDA's lower-bounded gate formed
    here (the reference knows the softplus form only)."""
    if lower_bound is None:
        return g, call_or_opts
    HV, K = g.shape[2], g.shape[3]
    x = g + (0 if dt_bias is None else dt_bias.view(HV, K))
    a = 1.0 if A_log is None else torch.exp(A_log.view(HV, 1))
    return lower_bound * torch.sigmoid(a * x), None


def _reference_forward(call, q, k, v, beta, initial_state, g=None, A_log=None, dt_bias=None):
    """The training forward in fp64 (rounded as the kernels store): o, the final state and
    what it keeps (h; A, aqk by KeyStageMath.kept from the activated gate and beta)."""
    cu = None if call.cu is None else torch.tensor(call.cu)
    g_raw, A_log_raw, dt_bias_raw = g, A_log, dt_bias
    opts = call.options
    if call.lower_bound is not None:
        g, _ = _gate(None, g.double(), A_log.double(), dt_bias.double(), call.lower_bound)
        opts, A_log, dt_bias = Options(l2norm_qk=call.l2norm_qk, beta_sigmoid=call.beta_sigmoid,
                                       allow_neg_eigval=call.allow_neg_eigval), None, None
    ref = tref.chunked_forward(call.spec, q, k, v, g, beta=beta, options=opts,
                               scale=call.scale, initial_state=initial_state,
                               cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias, intermediates=True)
    B, T, H, K = q.shape
    g_in, b_in = autograd._gated_inputs(call, g_raw, beta, A_log_raw, dt_bias_raw)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    tables = chunk._tables(call.cu or tuple(range(0, B * T + 1, T)), C, "cpu", 0)
    math = KeyStageMath(dict(H=H, HV=v.shape[2], dtype=str(q.dtype).replace("torch.", "")))
    kept = math.kept(flat(q), flat(k), flat(v), flat(g_in), flat(b_in.to(q.dtype)), tables,
                     call.l2norm_qk)
    return (ref["o"].to(q.dtype),
            ref["final_state"].float() if call.output_final_state else None,
            dict(h=forward_states(ref["h"], call.cu, q.shape[1], q.dtype), **kept))


@pytest.fixture
def fake_kernels(monkeypatch):
    names = install_key_fakes(monkeypatch)
    monkeypatch.setattr(autograd, "run_forward", _reference_forward)
    return names


CASES = [   # B, T, H, HV, K, V, cu, h0, dht, l2norm, gate in kernel, lower_bound, dtype
    pytest.param(2, 130, 2, 2, 64, 64, None, False, False, False, False, None,
                 torch.float16, id="B2-T130-plain-f16"),
    pytest.param(1, 100, 1, 2, 128, 64, None, True, True, True, False, None,
                 torch.bfloat16, id="GVA2-K128-h0-dht-l2norm-bf16"),
    pytest.param(1, 135, 2, 2, 64, 128, (0, 1, 70, 71, 135), True, True, True, False, None,
                 torch.float16, id="varlen-1tok-h0-dht"),
    pytest.param(2, 70, 1, 2, 64, 64, None, True, False, True, True, None, torch.float16,
                 id="gate-in-kernel-GVA2"),
    pytest.param(1, 80, 1, 1, 64, 64, None, False, True, False, True, -5.0, torch.float16,
                 id="lower-bound"),
    pytest.param(1, 90, 1, 2, 80, 48, (0, 30, 90), True, True, True, True, None, torch.float16,
                 id="K80-V48-padded-varlen-GVA2-h0-dht-l2norm-gik"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,cu,h0,use_dht,l2,gik,lb,dtype", CASES)
def test_training_matches_fp64_autograd(fake_kernels, rng, B, T, H, HV, K, V, cu, h0, use_dht,
                                        l2, gik, lb, dtype):
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k = r(B, T, H, K), r(B, T, H, K)
    if not l2:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    x = dict(q=q.to(dtype), k=k.to(dtype), v=r(B, T, HV, V).to(dtype),
             beta=torch.sigmoid(r(B, T, HV)).to(dtype),
             initial_state=r(N, HV, K, V).float() * 0.1 if h0 else None)
    if gik:
        x.update(g=r(B, T, HV, K).float(), A_log=torch.log(torch.rand(HV, generator=gen) * 4
                                                             + .5),
                 dt_bias=(r(HV * K) * 0.5).float())
    else:
        x["g"] = torch.nn.functional.logsigmoid(r(B, T, HV, K)).float()
    do, dht = r(B, T, HV, V).to(dtype), r(N, HV, K, V).float()
    leaves = {n: None if t is None else t.clone().requires_grad_() for n, t in x.items()}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, ht = linattn.chunk_kda(**leaves, output_final_state=use_dht, use_qk_l2norm_in_kernel=l2,
                              use_gate_in_kernel=gik, lower_bound=lb, cu_seqlens=cu_t)
    loss = (o.float() * do.float()).sum() + ((ht * dht).sum() if use_dht else 0)
    loss.backward()
    assert fake_kernels == [*STAGES, KEY_GRADS]

    refs = {n: None if t is None else t.detach().to(F64).requires_grad_() for n, t in x.items()}
    g, opts = refs["g"], Options(l2norm_qk=l2, gate_in_kernel=gik)
    A_log, dt_bias = refs.get("A_log"), refs.get("dt_bias")
    if lb is not None:
        g, _ = _gate(None, g, A_log, dt_bias, lb)
        opts, A_log, dt_bias = Options(l2norm_qk=l2), None, None
    o_r, ht_r = tref.chunked_forward(SPEC, refs["q"], refs["k"], refs["v"], g,
                                     beta=refs["beta"], options=opts,
                                     initial_state=refs["initial_state"],
                                     cu_seqlens=None if cu is None else torch.tensor(cu),
                                     A_log=A_log, dt_bias=dt_bias)
    loss_r = (o_r * do.to(F64)).sum() + ((ht_r * dht.to(F64)).sum() if use_dht else 0)
    loss_r.backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    terms = _gate_param_terms(refs, lb) if gik else {}
    for n, t in leaves.items():
        if t is None:
            continue
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, n
        assert not torch.isnan(t.grad).any(), n
        err = _rel(t.grad, refs[n].grad)
        if n in terms:      # a token sum whose terms cancel: judged against their size
            err = token_sum_err(t.grad, refs[n].grad, terms[n])
        assert err < tol, (n, err)
    if gik:     # ... and dt_bias's is the token sum of g's own (checked above)
        assert_token_sum_of(leaves["dt_bias"].grad, leaves["g"].grad, terms["dt_bias"],
                            "dt_bias")


def test_state_v_first(fake_kernels, rng):
    """chunk_kda with state_v_first trains: the states transposed around the key-first
    Function (GVA, l2norm, gate in kernel)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x = dict(q=r(1, 80, 1, 64).half(), k=r(1, 80, 1, 64).half(), v=r(1, 80, 2, 128).half(),
             g=r(1, 80, 2, 64).float(), beta=torch.sigmoid(r(1, 80, 2)).half(),
             initial_state=0.1 * r(1, 2, 64, 128).float(),
             A_log=torch.log(torch.rand(2, generator=gen) * 4 + .5).float(),
             dt_bias=(r(2 * 64) * 0.5).float())
    v_first_matches_k_first(linattn.chunk_kda, x, r(1, 80, 2, 128).half(),
                            r(1, 2, 64, 128).float(), use_qk_l2norm_in_kernel=True,
                            use_gate_in_kernel=True)


def test_refusals():
    q = torch.zeros(1, 70, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.zeros(1, 70, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 70, 2, 64,
                                                                       dtype=torch.bfloat16)
    beta = torch.zeros(1, 70, 2, dtype=torch.bfloat16)
    with pytest.raises(SpecError, match="KDA backward needs g"):
        linattn.chunk_kda(q, k, v, torch.zeros(1, 70, 2), beta)
    with pytest.raises(SpecError, match="on cpu"):      # (K past 128: exact_train)
        y = torch.zeros(1, 70, 2, 192, dtype=torch.bfloat16)
        linattn.chunk_kda(y.requires_grad_(), y, y, torch.zeros(1, 70, 2, 192), beta)
