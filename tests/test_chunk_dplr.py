"""The dplr rule's chunked forward (chunk_prepare_dplr, chunk_state_dplr) on the CPU.

An fp64 "fake" of the two kernels' tile arithmetic: the same 64-row tiles, the prepare's
bisection levels with the template's row formulas (i, jr, r) and quadrant masks, its
diagonal sums, the state pass's whole-tile loads past a sequence's end (the next tokens;
zeros past Ttot) and its masks, against torch_reference's chunked forward (itself checked
against the recurrence in test_dplr_reference.py): ragged lengths, initial states, GVA,
strong decays. Outputs start NaN, so a row no chunk writes fails. Every exponent the
prepare takes is checked <= 0. Both stages compile for sm_90a without spills.
"""
import shutil

import numpy as np
import pytest
import torch

from linattn.codegen import plan
from linattn.codegen.compile import compile_stage, format_record, load_module
from linattn.codegen.render import DEFAULT_OUT
from linattn.dsl import recurrent as R
from linattn.dsl import torch_reference as TR
from linattn.dsl.spec import Options, dplr_specs

SPECS = {s.name: s for s in dplr_specs()}
BT, HALF = 64, 32
LEVELS = (32, 16, 8, 4, 2, 1)         # the template's


def _exp(x, seen):
    seen.append(float(np.max(x)) if np.size(x) else 0.0)
    return np.exp(x)


def _prepare_tile(q, k, a, b, v, g, rows, scale, seen, save=False):
    """One (chunk, value head) CTA of chunk_prepare_dplr: tiles [BT, K] / [BT, V] with
    zeros past rows; returns its written rows (w, u, qg, bg, kg, aqb, aqk; with save
    chunk_bwd_prepare_dplr's xinv, aak too) and g_last."""
    G = np.cumsum(np.where(np.arange(BT)[:, None] < rows, g, 0.0), axis=0)
    t, ak, qb, qk = (np.zeros((BT, BT)) for _ in range(4))
    x = np.arange(HALF)
    for W in LEVELS:
        i, jr, r = x // W * 2 * W + W + x % W, x // W * 2 * W + x % W, x // W * 2 * W + W - 1
        eb = _exp(G[r] - G[jr], seen)
        L = np.concatenate([a[i] * _exp(G[i - 1] - G[r], seen), q[i] * _exp(G[i] - G[r], seen)])
        Rt = np.concatenate([b[jr] * eb, k[jr] * eb])
        st = L @ Rt.T
        X, Y = np.meshgrid(x, x, indexing="ij")
        keep = X // W == Y // W
        ii, jj = i[X[keep]], jr[Y[keep]]
        t[ii, jj] = -st[X[keep], Y[keep]]
        ak[ii, jj] = st[X[keep], HALF + Y[keep]]
        qb[ii, jj] = scale * st[HALF + X[keep], Y[keep]]
        qk[ii, jj] = scale * st[HALF + X[keep], HALF + Y[keep]]
    d = np.arange(BT)
    qb[d, d], qk[d, d] = scale * (q * b).sum(1), scale * (q * k).sum(1)
    Xinv = np.linalg.inv(np.eye(BT) + t)
    Ge = np.concatenate([np.zeros((1, G.shape[1])), G[:-1]])
    gl = G[rows - 1]
    dec = _exp(gl - G, seen)
    out = dict(w=Xinv @ (a * _exp(Ge, seen)), u=Xinv @ (ak @ v), qg=scale * q * _exp(G, seen),
               bg=b * dec, kg=k * dec, aqb=qb, aqk=qk)
    if save:
        out.update(xinv=Xinv, aak=ak)
    return out, gl


def _fake_prepare(x, chunks, HV, scale, seen, save=False):
    """chunk_prepare_dplr's grid: x the flat inputs (q, k, a, b [Ttot, H, K], v [Ttot,
    HV, V], g [Ttot, HV, K] or None), chunks (first token, rows) pairs. Unwritten rows
    stay NaN. save: chunk_bwd_prepare_dplr's (xinv, aak too)."""
    q, k, a, b, v = (x[n] for n in "qkabv")
    Ttot, H, K = q.shape
    g = np.zeros((Ttot, HV, K)) if x.get("g") is None else x["g"]
    names = ("w", "u", "qg", "bg", "kg", "aqb", "aqk") + (("xinv", "aak") if save else ())
    outs = {n: np.full((Ttot, HV, BT if n[0] in "ax" else v.shape[-1] if n == "u" else K),
                       np.nan) for n in names}
    g_last = np.full((len(chunks), HV, K), np.nan)
    for c, (t0, rows) in enumerate(chunks):
        for hv in range(HV):
            hk = hv // (HV // H)

            def tile(z):
                out = np.zeros((BT, z.shape[-1]))
                out[:rows] = z[t0:t0 + rows]
                return out
            o, gl = _prepare_tile(tile(q[:, hk]), tile(k[:, hk]), tile(a[:, hk]),
                                  tile(b[:, hk]), tile(v[:, hv]), tile(g[:, hv]), rows,
                                  scale, seen, save)
            for n, val in o.items():
                outs[n][t0:t0 + rows, hv] = val[:rows]
            g_last[c, hv] = gl
    return outs, g_last


def _fake_state(p, g_last, v, cu, chunk_offsets, h0):
    """chunk_state_dplr: per (sequence, value head), whole-tile loads (past the sequence
    end the next tokens, zeros past Ttot), r and v masked past len."""
    Ttot, HV, V = v.shape

    def tile(z, t0):
        out = np.zeros((BT,) + z.shape[1:])
        n = min(BT, Ttot - t0)
        out[:n] = z[t0:t0 + n]
        return out
    o = np.full(v.shape, np.nan)
    ht = np.zeros_like(h0)
    for n in range(len(cu) - 1):
        bos, seqlen = cu[n], cu[n + 1] - cu[n]
        for hv in range(HV):
            S = h0[n, hv].copy()
            for c in range(-(-seqlen // BT)):
                t0, rows = bos + c * BT, min(BT, seqlen - c * BT)
                T_ = {m: tile(p[m][:, hv], t0) for m in p}
                vm = tile(v[:, hv], t0)
                r = T_["w"] @ S + T_["u"]
                r[rows:], vm[rows:] = 0, 0
                ot = T_["qg"] @ S + T_["aqb"] @ r + T_["aqk"] @ vm
                o[t0:t0 + rows, hv] = ot[:rows]
                S = (np.exp(g_last[chunk_offsets[n] + c, hv])[:, None] * S + T_["bg"].T @ r
                     + T_["kg"].T @ vm)
            ht[n, hv] = S
    return o, ht


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("lens", [(3, 70, 200), (64, 128, 1)], ids=["ragged", "whole"])
def test_fake_kernels_match_reference(name, lens):
    spec, rng = SPECS[name], np.random.default_rng(5)
    H, HV, K, V = 2, 4, 16, 8
    cu = np.concatenate([[0], np.cumsum(lens)])
    x = R.random_inputs(spec, Options(), 1, int(cu[-1]), H, HV, K, V, rng, cu_seqlens=cu)
    if x.get("g") is not None:
        x["g"] = x["g"] * 4.0                         # strong decays
    scale = K ** -0.5
    chunks = [(cu[n] + c * BT, min(BT, lens[n] - c * BT)) for n in range(len(lens))
              for c in range(-(-lens[n] // BT))]
    offsets = np.concatenate([[0], np.cumsum([-(-n // BT) for n in lens])])
    seen = []
    p, g_last = _fake_prepare({n: None if x[n] is None else x[n][0] for n in "qkabvg"}, chunks,
                              HV, scale, seen)
    assert max(seen) <= 0.0                           # no exponential of a positive number
    o, ht = _fake_state(p, g_last, x["v"][0], cu, offsets, x["initial_state"])
    t = {n: None if z is None else torch.tensor(z) for n, z in x.items()}
    ref_o, ref_h = TR.chunked_forward(spec, scale=scale, **t)
    np.testing.assert_allclose(o, ref_o[0].numpy(), atol=1e-10, rtol=1e-9)
    np.testing.assert_allclose(ht, ref_h.numpy(), atol=1e-10, rtol=1e-9)


def _fake_body(spec, stage, params):
    """fake_compiles' body: the stage's fake on the plan's tensors, by argument name."""
    from linattn.ops import runtime
    names = runtime.arg_names(runtime.stage_module(spec, stage, "sm90").build(**params))
    f64 = lambda t: t.double().numpy()  # noqa: E731

    def run(*args):
        t = dict(zip(names, args))
        if stage in ("chunk_prepare_dplr", "chunk_prepare_iplr"):   # (the same outputs)
            chunks = list(zip(t["chunk_bos"].tolist(), t["chunk_len"].tolist()))
            x = {n: f64(t[n]) if n in t else None for n in "qkabvg"}
            outs, g_last = _fake_prepare(x, chunks, params["HV"], t["scale"], [])
            for n, val in outs.items():
                t[n].copy_(torch.from_numpy(val))
            t["g_last"].copy_(torch.from_numpy(g_last))
            return
        p = {n: f64(t[n]) for n in ("w", "u", "qg", "bg", "kg", "aqb", "aqk")}
        cu, offs = t["cu_seqlens"].tolist(), t["chunk_offsets"].tolist()
        h0 = (f64(t["h0"]) if params["has_initial_state"]
              else np.zeros((len(cu) - 1,) + tuple(t["h0"].shape[1:])))
        o, ht = _fake_state(p, f64(t["g_last"]), f64(t["v"]), cu, offs, h0)
        t["o"].copy_(torch.from_numpy(o))
        if params["output_final_state"]:
            t["ht"].copy_(torch.from_numpy(ht))
    return run


@pytest.mark.parametrize("name", ["dplr", "iplr"])
def test_plan_runs_the_stages(monkeypatch, name):
    """The arch's plan through ops.chunk.run_chunk_forward: its
    launches' arguments match the kernels' signatures (K = 16 padded to the kernels' 64,
    the rule's a, b bound to a_in, b_in) and the fakes on its f16 buffers give the
    reference's o and final state; without a decay the prepare is chunk_prepare_iplr."""
    from linattn.ops import chunk
    from linattn.ops.registry import specs
    from _kernel_check import fake_compiles
    spec, rng = specs()[name], np.random.default_rng(7)
    H, HV, K, V, lens = 2, 4, 16, 32, (3, 70, 200)
    cu = np.concatenate([[0], np.cumsum(lens)])
    x = R.random_inputs(SPECS[f"dplr_{spec.gate.value}"], Options(), 1, int(cu[-1]), H, HV,
                        K, V, rng, cu_seqlens=cu)
    t = {n: None if z is None else torch.tensor(z) for n, z in x.items()}
    h = {n: None if z is None else z.half() for n, z in t.items() if n != "cu_seqlens"}
    calls = []
    fake_compiles(monkeypatch, _fake_body, calls)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    args = (spec, h["q"], h["k"], h["v"], h["g"], None, K ** -0.5, h["initial_state"].float(),
            True, Options(), cu_t, cu_t)
    o, ht = chunk.run_chunk_forward(*args, rule_inputs={"a": h["a"], "b": h["b"]})
    prepare = "chunk_prepare_iplr" if name == "iplr" else "chunk_prepare_dplr"
    assert [s for s, _ in calls] == [prepare, "chunk_state_dplr"]
    ref = {n: None if z is None else z.double() for n, z in h.items()}
    ref_o, ref_h = TR.chunked_forward(SPECS[f"dplr_{spec.gate.value}"], scale=K ** -0.5,
                                      cu_seqlens=cu, **ref)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(o, ref_o) < 3e-3 and rel(ht, ref_h) < 3e-3, (rel(o, ref_o), rel(ht, ref_h))


def test_chunked_switch_and_fits():
    """sm90 takes the dplr rule's calls that fit, sm80 (no stages) none."""
    from linattn.codegen.arch import get_arch
    a90, a80 = get_arch("sm90"), get_arch("sm80")
    assert a90.dplr_chunked("key") and a90.dplr_chunked("none") and not a80.dplr_chunked("key")
    assert a90.dplr_fits(128, 64, False) and a90.dplr_fits(64, 256, False)
    assert not any(a90.dplr_fits(K, V, vf) for K, V, vf in
                   ((192, 64, False), (64, 48, False), (64, 512, False), (64, 64, True)))


def _cases():
    out = []
    for name in ("dplr", "iplr"):
        prepare = "chunk_prepare_iplr" if name == "iplr" else "chunk_prepare_dplr"
        for stage in (prepare, "chunk_state_dplr"):
            rep = (pytest.mark.representative,) if name == "dplr" else ()
            out.append(pytest.param(name, stage, marks=rep, id=f"{name}-{stage}"))
    return out


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name,stage", _cases())
def test_stage_compiles_without_spills(name, stage):
    """Registered in the plan for the dplr rule's specs; its K = V = 64 example compiles for
    sm_90a without spills (test_compile.py compiles every example in the exhaustive run)."""
    from linattn.ops.registry import specs
    assert stage in [s.name for s in plan(specs()[name], "fwd", "sm90")]
    module = load_module(DEFAULT_OUT / "sm90" / name / f"{stage}.py")
    ex = next(e for e in module.EXAMPLES if e["K"] == 64)
    rec = compile_stage(module, ex, "sm90")
    print(format_record(rec))
    assert "error" not in rec, rec.get("error")
    assert rec["spill_store_bytes"] == 0 and rec["spill_load_bytes"] == 0, rec
    assert not rec["barriers_in_branches"], rec["barriers_in_branches"]


@pytest.mark.parametrize("name, config, stage, threads", [
    ("dplr", {}, "chunk_prepare_dplr", 256),
    ("dplr", {"prepare_threads": 128}, "chunk_prepare_dplr", 128),
    ("iplr", {}, "chunk_prepare_iplr", 128),
    ("iplr", {"prepare_threads": 256}, "chunk_prepare_iplr", 256)])
def test_prepare_probe_configs(name, config, stage, threads):
    """The prepare's stage (the levels under a decay, the direct GEMMs without) and its
    threads: the arch's PREPARE_THREADS, or probe config prepare_threads."""
    from linattn.ops import chunk
    from linattn.ops.registry import specs
    p = chunk.forward_plan(specs()[name], Options(), "sm90", config=config, H=2, HV=2, K=64,
                           V=64, dtype="bfloat16", Ttot=128, seq_chunks=(2,),
                           g_dtype="float32", output_final_state=True)
    prep = p.launches[0]
    assert prep.stage == stage and dict(prep.params)["threads"] == threads
