"""CPU tests of the delta rule's chunked backward (ops/chunk_bwd.py): the plan lists the
backward's stages, they render and compile for sm_90a, the contract's forward takes its stages
from the arch's three-stage plan (contract_plan, wy_params, forward_params), the
backward's recompute of A, w, u (recompute) is the forward's prepare on token-first
packed tensors, and the launch arguments match the traced kernel signatures. The fake
kernels also carry out each stage's math in fp64 (the algorithm the template implements,
stage by stage, through the same token-first packed buffers and chunk tables; the
forward's stages by tests/test_chunk_fused.py's PipelineMath), so the host code's
plumbing and the stage decomposition are checked against autograd of the fp64 reference
without a GPU."""
import math

import pytest
import torch

from _kernel_check import fake_compiles
from test_chunk import by_name
from test_chunk_fused import PipelineMath

from linattn.codegen.arch import DEFAULT_ARCH
from linattn.codegen.arch import get_arch
from linattn.codegen.arch.sm90 import backward as sm90_backward
from linattn.codegen.plan import plan
from linattn.dsl import Options, SpecError, all_rule_gate_specs
from linattn.dsl import torch_reference as tref
from linattn.ops import chunk, chunk_bwd, contracts, runtime
from linattn.ops.registry import get_spec

F64 = torch.float64
C = chunk_bwd.CHUNK


#: the none and the scalar gate's backward stages (after the recompute by the forward's
#: chunk_kkt_inverse and chunk_wu): the four stages, then the key heads' dq, dk
PACKED_STAGES = (*chunk_bwd.STAGES, "chunk_bwd_key_grads")


def test_plan_lists_backward_stages():
    """The none and the scalar gate rebuild from the kept A by the kkt's row pass first
    (chunk_bwd.rebuild; then the forward's chunk_wu), run the four stages on the call's
    token-first tensors, then chunk_bwd_key_grads; the per-key gate's plan rebuilds by
    its own prepare first (chunk_bwd.key_rebuild_packed)."""
    want = [chunk_bwd.ROWS, *PACKED_STAGES]
    # no gate: the folded form's stages instead of the four (chunk_bwd.FOLD_STAGES)
    fold = [chunk_bwd.ROWS, *chunk_bwd.FOLD_STAGES, want[-1]]
    assert [s.name for s in plan(get_spec("deltanet"), "bwd")] == fold
    assert [s.name for s in plan(get_spec("gdn"), "bwd")] == want
    key = [chunk_bwd.REBUILD, *PACKED_STAGES]
    for spec in all_rule_gate_specs():
        names = [s.name for s in plan(spec, "bwd")]
        if spec.rule.value == "delta":          # (the additive rule's: test_additive_bwd.py)
            assert names == {"delta_none": fold, "delta_scalar": want,
                             "delta_key": key}[spec.name]      # (key: test_kda_bwd.py)


@pytest.mark.parametrize("family,stage", [("gdn", s) for s in PACKED_STAGES] +
                         [("deltanet", s) for s in (*chunk_bwd.FOLD_STAGES,
                                                    "chunk_bwd_key_grads")])
def test_stage_renders(family, stage):
    from linattn.ops.runtime import arg_names, stage_module
    spec = get_spec(family)
    mod = stage_module(spec, stage, "sm90")
    assert mod.STAGE == stage and mod.VARIANT == "bwd" and mod.SPEC_HASH == spec.hash
    for ex in mod.EXAMPLES:                     # (one of them GVA: H=2, HV=4)
        fn = mod.build(**ex)
        assert list(arg_names(fn)) == mod.args(**ex)


@pytest.mark.compile
@pytest.mark.parametrize("block_v,num_stages", [(16, 0), (32, 0), (16, 1), (32, 2)])
def test_dh_pass_compiles_value_blocks_and_pipelines(block_v, num_stages):
    src = chunk_bwd.compiled_stage("chunk_bwd_dh", get_spec("gdn"), H=2, HV=4, K=64, V=64,
                                   dtype="bfloat16", block_v=block_v,
                                   num_stages=num_stages).get_kernel_source()
    assert "wgmma" in src or "mma" in src
    assert ("mbarrier" in src) == (num_stages > 0)   # > 0: warp-specialised TMA pipeline


@pytest.mark.compile
@pytest.mark.parametrize("l2norm", [False, True])
def test_key_grads_compiles(l2norm):
    src = chunk_bwd.compiled_stage("chunk_bwd_key_grads", H=2, HV=4, K=128, dtype="bfloat16",
                                   l2norm=l2norm).get_kernel_source()
    assert ("rsqrt" in src) == l2norm


def test_stage_params():
    """stage_params: every stage at H key heads and HV value heads (default H); the dh
    pass's flags, its tuning from the arch (dh_config) unless a probe passes dh, the
    contract's f32 states; without a gate the folded form's stages, the walk taking the
    dh pass's flags and tuning, the tail the states' dtype."""
    n = chunk_bwd.stage_params(H=2, HV=4, K=64, V=128, dtype="float16", chains=8,
                               use_dht=True, store_dh0=True, state_dtype="float32")
    local, walk, tail = chunk_bwd.FOLD_STAGES
    assert list(n) == list(chunk_bwd.FOLD_STAGES)
    assert n[walk]["use_dht"] and n[walk]["store_dh0"] and "use_dht" not in n[local]
    assert n[walk]["block_v"] == get_arch("sm90").dh_config(128, 8)["block_v"]
    assert n[tail]["state_dtype"] == "float32"
    p = chunk_bwd.stage_params(H=2, HV=4, K=64, V=128, dtype="float16", chains=8,
                               use_dht=True, gate="scalar")
    assert list(p) == list(chunk_bwd.STAGES)
    for stage, params in p.items():
        assert {k: params[k] for k in ("H", "HV", "K", "V", "dtype")} == dict(
            H=2, HV=4, K=64, V=128, dtype="float16"), stage
    dh = p["chunk_bwd_dh"]
    assert dh["use_dht"] and "store_dh0" not in dh
    assert dh["num_stages"] == sm90_backward.DH_NUM_STAGES
    assert "state_dtype" not in p["chunk_bwd_dqkw"]
    g = chunk_bwd.stage_params(H=3, K=64, V=64, dtype="bfloat16", store_dh0=True,
                               state_dtype="float32", gate="key")
    assert all(params["HV"] == 3 for params in g.values())
    assert g["chunk_bwd_dh"]["store_dh0"] and "use_dht" not in g["chunk_bwd_dh"]
    assert g["chunk_bwd_dh"]["num_stages"] == sm90_backward.DH_NUM_STAGES
    assert g["chunk_bwd_dqkw"]["state_dtype"] == "float32"
    want = get_arch("sm90").dh_config(64, 3)
    assert {n: g["chunk_bwd_dh"][n] for n in want} == want
    x = chunk_bwd.stage_params(H=3, K=64, V=64, dtype="bfloat16", dh={"block_v": 64},
                               gate="scalar")
    assert (x["chunk_bwd_dh"]["block_v"], x["chunk_bwd_dh"]["num_stages"]) == (
        64, sm90_backward.DH_NUM_STAGES)


def test_train_params():
    """train_params: what packed_backward runs, the rebuild from the kept A (the kkt's row
    pass l2-normalising q, k with l2norm and forming a gate's g_cum, run for either; chunk_wu
    applying beta) at the call's key and value heads, the four stages, then
    chunk_bwd_key_grads (the l2norm's backward with l2norm)."""
    p = chunk_bwd.train_params(H=2, HV=4, K=64, V=128, dtype="bfloat16", chains=8,
                               l2norm=True, use_dht=True, spec=get_spec("gdn"))
    assert list(p) == [chunk_bwd.ROWS, "chunk_wu", *PACKED_STAGES]
    rows, wu = p[chunk_bwd.ROWS], p["chunk_wu"]
    assert rows["l2norm_qk"] and not wu["a_beta"]
    for spec, l2norm, want in (("deltanet", False, ["chunk_wu"]),
                               ("deltanet", True, [chunk_bwd.ROWS, "chunk_wu"]),
                               ("gdn", False, [chunk_bwd.ROWS, "chunk_wu"])):
        q = chunk_bwd.train_params(H=2, HV=2, K=64, V=64, dtype="float16", chains=2,
                                   l2norm=l2norm, spec=get_spec(spec))
        stages = chunk_bwd.FOLD_STAGES if spec == "deltanet" else chunk_bwd.STAGES
        assert list(q) == [*want, *stages, "chunk_bwd_key_grads"], (spec, l2norm)
    assert p["chunk_bwd_key_grads"]["l2norm"]
    assert all((x["H"], x["HV"]) == (2, 4) for x in p.values())
    assert p["chunk_bwd_dh"]["use_dht"] and "store_dh0" not in p["chunk_bwd_dh"]
    assert p["chunk_bwd_dh"]["num_stages"] == sm90_backward.DH_NUM_STAGES


@pytest.mark.parametrize("gate", ["none", "scalar", "key"])
def test_backward_runs_as_a_plan(monkeypatch, gate):
    """run_stages runs the arch's delta_backward_plan through runtime.run_plan, the
    forward's path: its four stages in order at stage_params' params, dv2 and dh bound to
    du and dh_out; each intermediate present from its stage to its last reader only (the
    recompute's tensors dropped after theirs), dg_part / dg with a gate; outputs the
    caller binds are written in place, the others allocated."""
    Ttot, NT, H, HV, K, V = 130, 3, 2, 4, 64, 64
    params = chunk_bwd.stage_params(H=H, HV=HV, K=K, V=V, dtype="bfloat16", chains=8,
                                    gate=gate)
    seen = []

    def launch(spec, arch, stage, p, tensors, bind=lambda n: n):
        assert p == params[stage]
        seen.append((stage, set(tensors), bind("du"), bind("dh_out")))
    monkeypatch.setattr(runtime, "launch_kernel", launch)
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16)  # noqa: E731
    dq = e(Ttot, HV, K)
    x = dict(q=e(Ttot, H, K), k=e(Ttot, H, K), v=e(Ttot, HV, V), beta=e(Ttot, HV),
             chunk_bos=torch.zeros(NT, dtype=torch.int32), w=e(Ttot, HV, K),
             u=e(Ttot, HV, V), A=e(Ttot, HV, C), aqk=e(Ttot, HV, C), dq=dq)
    chunk_bwd.run_stages(all_rule_gate_specs()[3 + ["none", "scalar", "key"].index(gate)],
                         params, x)
    if gate == "none":
        return _check_folded_plan(seen, x, dq, Ttot, HV, K)
    assert [s[0] for s in seen] == list(chunk_bwd.STAGES)
    (_, dvl, _, _), (_, dh, _, dh_out), (_, dqkw, _, _), (_, wy, du, _) = seen
    assert (dh_out, du) == ("dh", "dv2")
    assert "aqk" in dvl and "dv_local" in dvl and "dv2" not in dvl
    assert {"dv_local", "dv2", "dh"} <= dh and "aqk" not in dh and "dk_part" not in dh
    assert {"dh", "w", "u", "dk_part", "dw"} <= dqkw and "dv_local" not in dqkw
    assert {"dv2", "dk_part", "dw", "dk", "dv", "dbeta"} <= wy and not {"dh", "w", "u"} & wy
    assert "dg_part" in dqkw and "dg" in wy
    assert not {"A", "dw", "dv2", "dk_part", "dg_part"} & set(x) and x["dq"] is dq
    assert x["dk"].shape == (Ttot, HV, K) and x["dbeta"].shape == (Ttot, HV)
    assert x["dg"].shape == ((Ttot, HV, K) if gate == "key" else (Ttot, HV))


def _check_folded_plan(seen, x, dq, Ttot, HV, K):
    """Without a gate: the folded form's three stages; dv_local, dh_local and nwk from the
    first to the walk (dropped after it), dh from the walk to the tail, every output from
    the tail; no gradient of a gate."""
    assert [s[0] for s in seen] == list(chunk_bwd.FOLD_STAGES)
    (_, local, _, _), (_, walk, _, dh_out), (_, tail, _, _) = seen
    assert dh_out == "dh" and {"dv_local", "dh_local", "nwk"} <= local
    assert {"dh_local", "nwk", "dh"} <= walk and "dv_local" in walk
    assert {"dh", "dv_local", "w", "u", "A", "dk", "dv", "dbeta"} <= tail
    assert not {"dh_local", "nwk"} & tail and "dg" not in tail
    assert not {"A", "dh", "dv_local"} & set(x) and x["dq"] is dq
    assert x["dk"].shape == (Ttot, HV, K) and x["dbeta"].shape == (Ttot, HV)


def test_dh_value_block_fills_gpu():
    for gate, stage in (("scalar", "chunk_bwd_dh"), ("none", "chunk_bwd_fold_walk")):
        assert chunk_bwd.stage_params(H=4, K=64, V=64, dtype="bfloat16", chains=8,
                                      gate=gate)[stage]["block_v"] == 16
        assert chunk_bwd.stage_params(H=32, K=128, V=128, dtype="bfloat16", chains=256,
                                      gate=gate)[stage]["block_v"] == 64


# -- fake kernels: signature checks + the stage math in fp64 ------------------------------
#
# Token-first packed tensors [Ttot, heads, D] ([Ttot, heads] for beta, dbeta and the
# scalar gate's per-token ones), cut into chunks by the forward's tables: the per-chunk
# stages walk chunk_bos / chunk_len, the dh pass each sequence's chunks chunk_offsets[n] ..
# chunk_offsets[n+1] (tokens cu_seqlens[n] ..), last first. A chunk is an fp64 tile
# [HV, 64, D] with zero rows past its length (as the kernels load it); q, k [Ttot, H, K]
# are read at key head h // (HV / H). Each value is rounded to the input dtype (_lp)
# exactly where the template casts it or keeps it in a 16-bit shared buffer (a GEMM
# operand), so that the emulated errors are the kernels' (bf16 keeps 8 bits of mantissa:
# a cancellation that f16 hides shows there). The scalar gate (g_cum [HV, NT * 64] f32,
# chunk_kkt_inverse's layout: chunk c's rows at c * 64, rows past its length holding its
# last row's value) adds E_ij = exp(g_cum_i - g_cum_j) on the pairs and the templates'
# e^g scalings; without it (g_cum None) they are 1. The fakes take the kernels' arguments
# by name (test_chunk.by_name), after the traced signature's check.

def _lp(x, dt):
    """x rounded to the kernel's input dtype dt, back in fp64."""
    return x.to(dt).to(F64)


def _chunk_rows(chunk_bos, chunk_len):
    """(chunk, first token, length) of every chunk of the tables."""
    return zip(range(chunk_bos.numel()), chunk_bos.tolist(), chunk_len.tolist())


def _seq_chunks(cu_seqlens, chunk_offsets, n):
    """(chunk, first token, length) of sequence n's chunks, last first (the dh pass's
    walk: from the sequence's bounds, as the kernel finds them)."""
    bos, eos = cu_seqlens[n].item(), cu_seqlens[n + 1].item()
    c0, c1 = chunk_offsets[n].item(), chunk_offsets[n + 1].item()
    for c in reversed(range(c0, c1)):
        t0 = bos + (c - c0) * C
        yield c, t0, min(C, eos - t0)


def _tile(x, t0, n, HV):
    """Tokens t0 .. t0 + n of x [Ttot, heads, D] (or [Ttot, heads]: D = 1) as an fp64 tile
    [HV, 64, D], zero rows past n; key heads (heads < HV) repeated to the value heads."""
    y = x[t0:t0 + n].to(F64)
    y = y.unsqueeze(-1) if y.dim() == 2 else y
    y = torch.cat([y, y.new_zeros(C - n, *y.shape[1:])])
    return y.repeat_interleave(HV // y.shape[1], 1).transpose(0, 1)


def _untile(out, t0, n, y):
    """The tile y [HV, 64, D]'s first n rows into out's tokens t0 .. t0 + n (out's
    dtype): the kernels store only the chunk's rows."""
    rows = out[t0:t0 + n]
    rows.copy_(y[:, :n].transpose(0, 1).reshape(rows.shape).to(out.dtype))


def _gate(g_cum, c, HV):
    """Chunk c's gate tiles: (g_cum [HV, 64, 1], g_last [HV, 1, 1]: its row 63 as the
    kernels read it, E [HV, 64, 64] = tril_incl(exp(g_cum_i - g_cum_j))); 0, 0, tril(1)
    without a gate."""
    gc = torch.zeros(HV, C, 1, dtype=F64) if g_cum is None else \
        g_cum[:, c * C:(c + 1) * C].to(F64).unsqueeze(-1)
    return gc, gc[:, -1:], torch.tril(torch.exp(gc - gc.transpose(-1, -2)))


def _dv_local(p, q, k, do, dv_local, chunk_bos, chunk_len, g_cum=None):
    """dv_local = (tril_incl(q k^T) E)^T do."""
    dt, HV = q.dtype, do.shape[1]
    for c, t0, n in _chunk_rows(chunk_bos, chunk_len):
        qc, kc, doc = (_tile(x, t0, n, HV) for x in (q, k, do))
        P = _lp((qc @ kc.transpose(-1, -2)) * _gate(g_cum, c, HV)[2], dt)     # p_s
        _untile(dv_local, t0, n, P.transpose(-1, -2) @ doc)


def _dh(p, q, k, w, do, dv_local, dh_out, dv2, dht, dh0, cu_seqlens, chunk_offsets,
        g_cum=None):
    """Per sequence, its chunks last first, dh from dht[n] (use_dht) or 0:
    dh_out[c] = dh; dv2 = dv_local + (k dh) e^(g_last - g_cum);
    dh = e^g_last dh + q^T (do e^g_cum) - w^T dv2; dh0[n] = dh (store_dh0)."""
    dt, HV = q.dtype, do.shape[1]
    for s in range(cu_seqlens.numel() - 1):
        dh = dht[s].to(F64) if p.get("use_dht") else torch.zeros(dh_out.shape[1:], dtype=F64)
        for c, t0, n in _seq_chunks(cu_seqlens, chunk_offsets, s):
            qc, kc, wc, doc, dvc = (_tile(x, t0, n, HV) for x in (q, k, w, do, dv_local))
            gc, gl, _ = _gate(g_cum, c, HV)
            dh_out[c] = dh.to(dh_out.dtype)
            dh_s = _lp(dh, dt)                          # the k dh operand
            d = _lp(dvc + (kc @ dh_s) * torch.exp(gl - gc), dt)         # dv_s
            _untile(dv2, t0, n, d)
            do_s = _lp(doc * torch.exp(gc), dt)
            dh = torch.exp(gl) * dh + qc.transpose(-1, -2) @ do_s - wc.transpose(-1, -2) @ d
        if p.get("store_dh0"):
            dh0[s] = dh.to(dh0.dtype)


def _dqkw(p, q, k, w, u, do, dv2, S, state_row, dh, dq, dk_part, dw, chunk_bos, chunk_len,
          g_cum=None, dg_part=None):
    """Per chunk, S = S[state_row[c]] (rounded to the input dtype: S_s), dh[c]:
    v_new = u - w S; ds = tril_incl(do v_new^T) E; dq = (do S^T) e^g_cum + ds k;
    dk_part = ds^T q + (v_new dh^T) e^(g_last - g_cum); dw = -dv2 S^T; gated, dg_part =
    rowsum(q dq) - rowsum(k dk_part), the chunk's last row (n - 1, a partial chunk's too:
    g_last is its g_cum) + the state terms of g_last."""
    dt, HV = q.dtype, do.shape[1]
    rows = state_row.tolist()
    for c, t0, n in _chunk_rows(chunk_bos, chunk_len):
        qc, kc, wc, uc, doc, dvc = (_tile(x, t0, n, HV) for x in (q, k, w, u, do, dv2))
        gc, gl, E = _gate(g_cum, c, HV)
        St, dhs = _lp(S[rows[c]].to(F64), dt), _lp(dh[c].to(F64), dt)   # S_s, dh_s
        vn = _lp(uc - wc @ St, dt)
        ds = _lp(torch.tril(doc @ vn.transpose(-1, -2)) * E, dt)
        dk_state = (vn @ dhs.transpose(-1, -2)) * torch.exp(gl - gc)
        dqc = (doc @ St.transpose(-1, -2)) * torch.exp(gc) + ds @ kc
        dkc = dk_state + ds.transpose(-1, -2) @ qc
        _untile(dq, t0, n, dqc)
        _untile(dk_part, t0, n, dkc)
        _untile(dw, t0, n, -dvc @ St.transpose(-1, -2))
        if dg_part is not None:
            dg = (qc * dqc).sum(-1, keepdim=True) - (kc * dkc).sum(-1, keepdim=True)
            # g_last scales the state leaving the chunk (the state terms of dk: the f32
            # values its rows subtract) and the state it enters with: e^g_last <S, dh> (an
            # f32 sum of the 16-bit tiles)
            dg[:, n - 1] += ((kc * dk_state).sum((-1, -2))
                             + torch.exp(gl[:, 0, 0]) * (St * dhs).sum((-1, -2))).unsqueeze(-1)
            _untile(dg_part, t0, n, dg)


def _wy(prm, k, v, beta, A, dw, du, dk_part, dk, dv, dbeta, chunk_bos, chunk_len, g_cum=None,
        dg_part=None, dg=None, p=None, dp=None):
    """Per chunk, back through A = (I + M)^-1, M = strict_tril(beta_i e_i.k_j E_ij),
    w = A (beta e^g_cum e), u = A (beta v) with the erase key e = k (the rule's own, p,
    with its exclusive gate g_cum - g in E's rows and w's: Comba's): dv, dk (complete), dp
    (the erase key's), dbeta and, gated, dg: the reverse cumulative sum within the chunk
    of dG, the gradient of g_cum, less the exclusive gate's terms dX (its row's own)."""
    dt, HV = k.dtype, v.shape[1]
    for c, t0, n in _chunk_rows(chunk_bos, chunk_len):
        kc, vc, bc, Ac, dwc, duc, dkp = (_tile(x, t0, n, HV) for x in
                                         (k, v, beta, A, dw, du, dk_part))
        gc, _, E = _gate(g_cum, c, HV)
        ec, gx = kc, gc
        if p is not None:                       # the exclusive gate: row i's g_cum[i - 1]
            ec, gx = _tile(p, t0, n, HV), torch.cat([torch.zeros_like(gc[:, :1]), gc[:, :-1]], 1)
            E = torch.tril(torch.exp(gx - gc.transpose(-1, -2)), -1)
        At = Ac.transpose(-1, -2)
        bk, bv = _lp(bc * ec * torch.exp(gx), dt), _lp(bc * vc, dt)
        dbk, dbv = At @ dwc, At @ duc
        dA = _lp(duc @ bv.transpose(-1, -2) + dwc @ bk.transpose(-1, -2), dt)
        dM = torch.tril(-_lp(At @ dA, dt) @ At, -1)
        Q = dM * (ec @ kc.transpose(-1, -2)) * E
        G = _lp(bc * dM * E, dt)
        rk = (dbk * ec).sum(-1, keepdim=True) * torch.exp(gx)
        de = bc * torch.exp(gx) * dbk + G @ kc          # the erase key's gradient
        _untile(dv, t0, n, bc * dbv)
        dkw = dkp + G.transpose(-1, -2) @ ec
        _untile(dk, t0, n, dkw + de if p is None else dkw)
        if p is not None:
            _untile(dp, t0, n, de)
        _untile(dbeta, t0, n, (dbv * vc).sum(-1, keepdim=True) + rk + Q.sum(-1, keepdim=True))
        if dg is not None:
            P = bc * Q
            dX = bc * rk + P.sum(-1, keepdim=True)
            dG = _tile(dg_part, t0, n, HV) + dX - P.sum(-2).unsqueeze(-1)
            dG[:, n:] = 0                                # rows past the chunk
            rev = dG.flip(1).cumsum(1).flip(1)
            _untile(dg, t0, n, rev if p is None else rev - dX)


def _key_grads(p, dq, dk, q, k, scale, dq_out, dk_out):
    """The call's dq, dk [Ttot, H, K] from the stages' per-value-head ones [Ttot, HV, K]:
    dy = factor * the sum over key head h's value heads h G .. h G + G - 1 (factor: scale
    for dq, 1 for dk), through the l2norm's backward of the raw q, k with l2norm
    (dx = r dy - x r^3 (x . dy), r = rsqrt(x . x + eps)); rounded once."""
    Ttot, H, K = q.shape
    for dxv, x, out, factor in ((dq, q, dq_out, scale), (dk, k, dk_out, 1.0)):
        dy = dxv.to(F64).view(Ttot, H, -1, K).sum(2) * factor
        if p.get("l2norm"):
            xf = x.to(F64)
            r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + tref.L2NORM_EPS)
            dy = r * dy - xf * r ** 3 * (xf * dy).sum(-1, keepdim=True)
        out.copy_(dy.to(out.dtype))


def _fold_local(p, q, k, w, do, dv_local, dh_local, nwk, chunk_bos, chunk_len):
    """The folded form's first stage (no gate): dv_local = tril_incl(q k^T)^T do;
    dh_local[c] = q^T do - w^T dv_local (dv_local rounded: its GEMM operand, f32 out);
    nwk[c] = -(w^T k) (rounded)."""
    dt, HV = q.dtype, do.shape[1]
    for c, t0, n in _chunk_rows(chunk_bos, chunk_len):
        qc, kc, wc, doc = (_tile(x, t0, n, HV) for x in (q, k, w, do))
        P = _lp(torch.tril(qc @ kc.transpose(-1, -2)), dt)
        dvl = _lp(P.transpose(-1, -2) @ doc, dt)
        _untile(dv_local, t0, n, dvl)
        dh_local[c] = (qc.transpose(-1, -2) @ doc - wc.transpose(-1, -2) @ dvl).to(
            dh_local.dtype)
        nwk[c] = (-(wc.transpose(-1, -2) @ kc)).to(nwk.dtype)


def _fold_walk(p, nwk, dh_local, dh_out, dht, dh0, chunk_offsets):
    """Per sequence, its chunks last first, dh from dht[n] (use_dht) or 0: dh_out[c] = dh;
    dh = dh + dh_local[c] + nwk[c] dh (dh rounded: the product's operand); dh0[n] = dh
    (store_dh0)."""
    dt = nwk.dtype
    for s in range(chunk_offsets.numel() - 1):
        dh = dht[s].to(F64) if p.get("use_dht") else torch.zeros(dh_out.shape[1:], dtype=F64)
        for c in reversed(range(chunk_offsets[s].item(), chunk_offsets[s + 1].item())):
            dh_out[c] = dh.to(dh_out.dtype)
            dh = dh + dh_local[c].to(F64) + nwk[c].to(F64) @ _lp(dh, dt)
        if p.get("store_dh0"):
            dh0[s] = dh.to(dh0.dtype)


def _fold_dqkw(p, q, k, w, u, do, dv_local, S, state_row, dh, dq, dk_part, dw, dv2,
               chunk_bos, chunk_len):
    """The folded form's dqkw: dv2 = dv_local + k dh[c] (rounded, then dw's operand), and
    _dqkw's gradients (no gate)."""
    dt, HV = q.dtype, do.shape[1]
    rows = state_row.tolist()
    for c, t0, n in _chunk_rows(chunk_bos, chunk_len):
        kc, dvl = _tile(k, t0, n, HV), _tile(dv_local, t0, n, HV)
        _untile(dv2, t0, n, _lp(dvl + kc @ _lp(dh[c].to(F64), dt), dt))
    _dqkw(p, q, k, w, u, do, dv2, S, state_row, dh, dq, dk_part, dw, chunk_bos, chunk_len)


def _fold_tail(p, q, k, w, u, v, beta, A, do, dv_local, S, state_row, dh, dq, dk, dv,
               dbeta, chunk_bos, chunk_len):
    """The fused tail: _fold_dqkw then _wy, du, dw rounded as the split form's memory
    (the kernel keeps them 16-bit in shared memory) and dk_part f32."""
    Ttot, HV, K = dq.shape
    dk_part = torch.empty(Ttot, HV, K, dtype=torch.float32)
    dw, dv2 = torch.empty(Ttot, HV, K, dtype=dq.dtype), torch.empty_like(dv)
    _fold_dqkw(p, q, k, w, u, do, dv_local, S, state_row, dh, dq, dk_part, dw, dv2,
               chunk_bos, chunk_len)
    _wy(p, k, v, beta, A, dw, dv2, dk_part, dk, dv, dbeta, chunk_bos, chunk_len)


EMULATE = {"chunk_bwd_dv_local": _dv_local, "chunk_bwd_dh": _dh, "chunk_bwd_dqkw": _dqkw,
           "chunk_bwd_wy": _wy, "chunk_bwd_key_grads": _key_grads,
           "chunk_bwd_fold_local": _fold_local, "chunk_bwd_fold_walk": _fold_walk,
           "chunk_bwd_fold_tail": _fold_tail}


def install_fakes(monkeypatch):
    """Route every compile (ops.runtime) to fakes checked against the traced kernels: the
    backward's stages run EMULATE, the forward's (chunk_kkt_inverse, chunk_wu,
    chunk_state, chunk_output) PipelineMath's formulas, both by argument name. Returns the
    list of stage names compiled, in order."""
    names = []
    emulate = by_name(EMULATE)

    def body(spec, stage, params):
        names.append(stage)
        if stage in EMULATE:
            return emulate(spec, stage, params)
        math = PipelineMath(spec, params["H"], params["HV"], params["K"], params.get("V"))
        return math.body(spec, stage, params)
    fake_compiles(monkeypatch, body)
    monkeypatch.setattr(chunk_bwd, "_check_device", lambda n, x: None)
    return names


@pytest.fixture
def fake_backward(monkeypatch):
    return install_fakes(monkeypatch)


def _contract_inputs(rng, B, H, L, K, V, dtype):
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q = torch.nn.functional.normalize(torch.randn(B, H, L, K, generator=g, dtype=F64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, H, L, K, generator=g, dtype=F64), dim=-1)
    v = torch.randn(B, H, L, V, generator=g, dtype=F64)
    beta = torch.sigmoid(torch.randn(B, H, L, generator=g, dtype=F64))
    do = torch.randn(B, H, L, V, generator=g, dtype=F64)
    q, k, v, beta, do = (x.to(dtype) for x in (q, k, v, beta, do))
    return q, k, v, beta, do


def _rel(x, ref):
    return float(torch.linalg.norm(x.to(F64) - ref) / torch.linalg.norm(ref))


@pytest.mark.parametrize("B,H,L,K,V", [(2, 2, 130, 64, 64), (1, 3, 63, 64, 128),
                                       (1, 1, 65, 128, 64), (2, 1, 1, 64, 64)])
def test_backward_plumbing_and_stage_math(fake_backward, rng, B, H, L, K, V):
    """DeltaNetChunkBwd: the folded form's stages on the (b, h) one-head sequences (the
    contract's f32 S read through state_row) against autograd of the fp64 reference."""
    dtype = torch.float16
    q, k, v, beta, do = _contract_inputs(rng, B, H, L, K, V, dtype)
    o, S, Aw, Au, w, u = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
    S = S.float()
    Aw, Au, w, u = (x.to(dtype) for x in (Aw, Au, w, u))
    grads = contracts.deltanet_chunk_bwd(do, q, k, v, beta, S, Aw, Au, w, u)
    assert fake_backward == list(chunk_bwd.FOLD_STAGES)
    refs = tref.deltanet_chunk_bwd(do, q, k, v, beta)
    for name, g, ref, like in zip(("dq", "dk", "dv", "dbeta"), grads, refs, (q, k, v, beta)):
        assert g.shape == like.shape and g.dtype == dtype, name
        assert not torch.isnan(g).any(), name
        assert _rel(g, ref) < 5e-3, (name, _rel(g, ref))


def test_backward_refuses_bad_inputs(fake_backward):
    x = torch.zeros(1, 2, 70, 64, dtype=torch.bfloat16)
    b = torch.zeros(1, 2, 70, dtype=torch.bfloat16)
    A = torch.zeros(1, 2, 70, 64, dtype=torch.bfloat16)
    S = torch.zeros(1, 2, 3, 64, 64)
    contracts.deltanet_chunk_bwd(x, x, x, x, b, S, A, A, x, x)
    with pytest.raises(SpecError, match="NC\\+1 = 3"):
        contracts.deltanet_chunk_bwd(x, x, x, x, b, S[:, :, :2], A, A, x, x)
    with pytest.raises(SpecError, match="dtype"):
        contracts.deltanet_chunk_bwd(x, x, x, x, b, S.double(), A, A, x, x)
    with pytest.raises(SpecError, match="DK, DV in"):
        y = torch.zeros(1, 2, 70, 32, dtype=torch.bfloat16)
        contracts.deltanet_chunk_bwd(y, y, y, y, b, S, A, A, y, y)
    with pytest.raises(SpecError, match="float16 or bfloat16"):
        contracts.deltanet_chunk_bwd(x, x.float(), x, x, b, S, A, A, x, x)


def test_contract_plan_and_params():
    """The contract's forward is the arch's three-stage plan over B * H one-head sequences
    of L tokens: kkt (A itself, a_beta=False) and chunk_wu (applying beta), chunk_state
    with every chunk's state in f32 (states_out) and the final one, chunk_output (the
    backward's recompute takes its prepare; its states are the training forward's)."""
    plan = chunk_bwd.contract_plan(K=64, V=128, dtype="float16", B=2, H=3, L=130)
    assert plan.name == "three-stage"
    assert plan.stages() == ["chunk_kkt_inverse", "chunk_wu", "chunk_state", "chunk_output"]
    dims = dict(H=3, K=64, V=128, dtype="float16", B=2, L=130)
    wy = chunk_bwd.wy_params(**dims)
    assert set(wy) == {"chunk_kkt_inverse", "chunk_wu"}
    assert wy["chunk_kkt_inverse"]["a_beta"] is False and wy["chunk_wu"]["a_beta"] is False
    assert wy["chunk_wu"]["beta_dtype"] == "float16"
    assert wy["chunk_kkt_inverse"]["H"] == wy["chunk_kkt_inverse"]["HV"] == 1
    # one head: the chunks on the grid's first index (no 65535 limit of gridDim.y)
    assert not wy["chunk_kkt_inverse"]["heads_fastest"] and not wy["chunk_wu"]["heads_fastest"]
    fwd = chunk_bwd.forward_params(**dims)
    assert list(fwd) == ["chunk_kkt_inverse", "chunk_wu", "chunk_state", "chunk_output"]
    assert fwd["chunk_state"]["states_out"] and fwd["chunk_state"]["output_final_state"]
    assert not fwd["chunk_state"]["has_initial_state"]
    spec = chunk_bwd.default_spec()
    assert spec.name == "deltanet"
    for stage, params in fwd.items():
        chunk.stage_module(spec, stage).build(**params)        # the templates take them
    # the backward's stages at the same sizes (as chunk_backward runs them: one head per
    # sequence, the contract's f32 states)
    params = chunk_bwd.stage_params(H=1, K=64, V=128, dtype="float16", chains=6,
                                    state_dtype="float32")
    assert list(params) == list(chunk_bwd.FOLD_STAGES)
    assert params["chunk_bwd_fold_tail"]["state_dtype"] == "float32"
    for stage, p in params.items():
        runtime.stage_module(spec, stage, DEFAULT_ARCH).build(**p)


def test_compute_wy_matches_reference(fake_backward, rng):
    """compute_wy: A (without beta), w = A diag(beta) k, u = A diag(beta) v of head-first
    inputs, through the plan's two prepare kernels and the chunk tables."""
    B, H, L, K, V = 2, 2, 100, 64, 64
    q, k, v, beta, _ = _contract_inputs(rng, B, H, L, K, V, torch.float16)
    A = torch.empty(B, H, L, C, dtype=torch.float16)
    w, u = torch.empty_like(k), torch.empty_like(v)
    tables = chunk._tables(tuple(range(0, B * H * L + 1, L)), C, "cpu", 0)
    chunk_bwd.compute_wy(k, v, beta, A, w, u, tables)
    assert fake_backward == ["chunk_kkt_inverse", "chunk_wu"]
    ref = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
    for name, x, r in (("A", A, ref[2]), ("w", w, ref[4]), ("u", u, ref[5])):
        assert _rel(x, r) < 2e-3, (name, _rel(x, r))


def test_forward_plumbing(fake_backward, rng):
    """The contract's forward: chunk_kkt_inverse writes A itself and chunk_wu applies
    beta; launches match the traced kernels, and o, A, w, u and S (emulated stage math; the
    state pass writes S itself) match the fp64 reference; no backward stage runs."""
    B, H, L, K, V = 2, 2, 130, 64, 128
    q, k, v, beta, _ = _contract_inputs(rng, B, H, L, K, V, torch.bfloat16)
    o, S, Aw, Au, w, u = contracts.deltanet_chunk_fwd(q, k, v, beta)
    assert fake_backward == ["chunk_kkt_inverse", "chunk_wu", "chunk_state", "chunk_output"]
    ref = tref.deltanet_chunk_fwd(*(x.to(F64) for x in (q, k, v, beta)))
    for name, x, r in (("o", o, ref[0]), ("A", Aw, ref[2]), ("w", w, ref[4]),
                       ("u", u, ref[5]), ("S", S, ref[1])):
        assert _rel(x, r) < 1e-2, (name, _rel(x, r))
    NC = math.ceil(L / C)
    assert o.shape == (B, H, L, V) and u.shape == (B, H, L, V) and w.shape == (B, H, L, K)
    assert Aw.shape == (B, H, L, C) and Aw.dtype == torch.bfloat16 and Aw is Au
    assert S.shape == (B, H, NC + 1, K, V) and S.dtype == torch.float32


F16, BF16 = torch.float16, torch.bfloat16
RECOMPUTE_CASES = [     # family, B, T, H, HV, K, V, cu_seqlens, l2norm, dtype
    pytest.param("deltanet", 2, 70, 2, 2, 64, 64, None, False, F16, id="deltanet-B2-T70"),
    pytest.param("deltanet", 1, 135, 1, 1, 128, 64, (0, 1, 70, 71, 135), True, F16,
                 id="deltanet-varlen-l2norm"),
    pytest.param("gdn", 2, 128, 2, 2, 64, 64, None, False, BF16, id="gdn-B2-T128"),
    pytest.param("gdn", 1, 200, 1, 2, 64, 128, (0, 1, 130, 200), True, BF16,
                 id="gdn-varlen-GVA2-l2norm"),
    pytest.param("gdn", 2, 65, 2, 4, 128, 64, None, False, F16, id="gdn-B2-T65-GVA2"),
]


@pytest.mark.parametrize("family,B,T,H,HV,K,V,cu,l2norm,dtype", RECOMPUTE_CASES)
def test_rebuild(fake_backward, rng, family, B, T, H, HV, K, V, cu, l2norm, dtype):
    """rebuild: from the WY inverse A the training forward kept (the reference's, rounded),
    on the call's token-first packed tensors, varlen as it comes, q, k at their key heads
    (GVA): chunk_bwd_kkt_rebuild (where the call has l2norm or a gate) and chunk_wu give
    q, k l2-normalised with l2norm (else the inputs themselves), per value head
    w = A diag(beta e^g_cum) k, u = A diag(beta) v and, with the scalar gate, g_cum in
    chunk_kkt_inverse's layout [HV, NT * 64] (rows past a chunk's length holding its last
    row's value), against the fp64 reference's intermediates."""
    spec = get_spec(family)
    gated = chunk_bwd.is_gated(spec)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k = r(B, T, H, K), r(B, T, H, K)
    if not l2norm:
        q, k = tref.l2norm(q), tref.l2norm(k)
    q, k, v = q.to(dtype), k.to(dtype), r(B, T, HV, V).to(dtype)
    beta = torch.sigmoid(r(B, T, HV)).to(dtype)
    g = (torch.nn.functional.logsigmoid(r(B, T, HV)) / 8).float() if gated else None
    Ttot = B * T
    tables = chunk._tables(cu or tuple(range(0, Ttot + 1, T)), C, "cpu", 0)
    ref = tref.chunked_forward(spec, q.to(F64), k.to(F64), v.to(F64),
                               None if g is None else g.to(F64), beta=beta.to(F64),
                               options=Options(l2norm_qk=l2norm), scale=1.0,
                               cu_seqlens=None if cu is None else torch.tensor(cu),
                               intermediates=True)
    params = chunk_bwd.rebuild_params(H=H, HV=HV, K=K, V=V, l2norm=l2norm, spec=spec,
                                      dtype=str(dtype).replace("torch.", ""))
    flat = lambda x: x.reshape(Ttot, *x.shape[2:]).contiguous()  # noqa: E731
    qf, kf, A = flat(q), flat(k), flat(ref["A"]).to(dtype)
    out = chunk_bwd.rebuild(qf, kf, flat(v), flat(beta), None if g is None else flat(g), A,
                            tables, params, spec)
    assert fake_backward == ([chunk_bwd.ROWS] if l2norm or gated else []) + ["chunk_wu"]
    assert out["A"] is A
    tol = 2e-3 if dtype == F16 else 1e-2
    for name, x, raw in (("q", out["q"], qf), ("k", out["k"], kf)):
        if l2norm:
            assert x.shape == raw.shape and x.dtype == dtype, name
            want = tref.l2norm(raw.to(F64))
            assert _rel(x, want) < tol, (name, _rel(x, want))
        else:
            assert x is raw, name
    for name, D in (("w", K), ("u", V)):
        x, want = out[name], flat(ref[name])
        assert x.shape == (Ttot, HV, D) and x.dtype == dtype, name
        assert _rel(x, want) < tol, (name, _rel(x, want))
    assert ("g_cum" in out) == gated
    if gated:
        gc, want = out["g_cum"], flat(ref["g_cum"])[..., 0]        # [Ttot, HV]
        assert gc.shape == (HV, tables["chunk_bos"].numel() * C) and gc.dtype == torch.float32
        for c, t0, n in _chunk_rows(tables["chunk_bos"], tables["chunk_len"]):
            rows = gc[:, c * C:(c + 1) * C].to(F64)
            torch.testing.assert_close(rows[:, :n], want[t0:t0 + n].T, rtol=1e-5, atol=1e-5)
            assert (rows[:, n:] == rows[:, n - 1:n]).all(), c


@pytest.mark.compile
@pytest.mark.parametrize("K,V,dtype,dh_stages", [(128, 128, "bfloat16", None),
                                                 (64, 64, "float16", 0)])
def test_gated_stages_compile(K, V, dtype, dh_stages):
    """Gated DeltaNet's backward stages at the params one call runs (2 sequences, H=2
    key heads, HV=4 value heads, with dht and dh0) compile for sm_90a; dh_stages: the dh
    pass's plain loop as well (an explicit dh config)."""
    from linattn.codegen.compile import compile_stage, format_record
    spec = get_spec("gdn")
    dh = None if dh_stages is None else {"num_stages": dh_stages}
    params = chunk_bwd.stage_params(H=2, HV=4, K=K, V=V, dtype=dtype, chains=8, use_dht=True,
                                    store_dh0=True, dh=dh, gate="scalar")
    if dh is not None:
        params = {"chunk_bwd_dh": params["chunk_bwd_dh"]}
    want = sm90_backward.DH_NUM_STAGES if dh_stages is None else dh_stages
    assert params["chunk_bwd_dh"]["num_stages"] == want
    for stage, p in params.items():
        rec = compile_stage(chunk.stage_module(spec, stage), p, "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["registers"] and rec["registers"] <= 255, rec


def test_contract_backward_takes_more_than_65535_sequences(monkeypatch):
    """The contract backward's stages put the B * H sequences and their chunks on
    gridDim.x: its size checks pass B * H = 70000; the forward's output stage (the chunks
    on gridDim.y) refuses it in one line."""
    monkeypatch.setattr(chunk_bwd, "_check_device", lambda n, x: None)
    B, H, L, K = 1, 70000, 64, 64
    m = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    q, beta = m(B, H, L, K), m(B, H, L)
    assert chunk_bwd._dims(q, q, q, beta) == (B, H, L, K, K)
    with pytest.raises(SpecError, match="forward supports up to 65535 chunks"):
        chunk_bwd._dims(q, q, q, beta, forward=True)


@pytest.mark.compile
@pytest.mark.parametrize("state_dtype", [None, "float32"])
@pytest.mark.parametrize("K,V", [(128, 128), (64, 64), (128, 64)])
def test_fold_stages_compile_without_spills(state_dtype, K, V):
    """DeltaNet's backward (the folded form) at the training states' dtype and the
    contract's f32: every stage compiles for sm_90a, within the registers, no spills."""
    from linattn.codegen.compile import compile_stage, format_record
    params = chunk_bwd.stage_params(H=16, K=K, V=V, dtype="bfloat16", chains=64,
                                    state_dtype=state_dtype, use_dht=True, store_dh0=True)
    for stage, p in params.items():
        rec = compile_stage(chunk.stage_module(get_spec("deltanet"), stage), p, "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
