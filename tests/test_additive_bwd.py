"""CPU tests of the additive rule's chunked backward (ops/additive_bwd.py): the plan and
its stages (rendered, traced, compiled for sm_90a), and the host code end to end through
fp64 fakes of the kernels, every launch checked against the traced prim_func:

  chunk_bwd_dstate_local / _scan / chunk_bwd_dqkvg    the stage formulas of
        dsl/additive_bwd.py, read and written through the plan's real buffers, host
        tables (state_row, chunk_offsets) and row layout
  the forward's prepare and state stages (the backward's recompute of the states)
        tests/test_chunk_fused.py's PipelineMath

so the GLAChunkBwd contract and training through chunk_gla / chunk_simple_gla /
chunk_linear_attn (varlen without padding, h0 / dht, state_v_first, GVA, g_gamma,
normalize) are checked against torch.autograd of the fp64 recurrence without a GPU."""
import dataclasses

import numpy as np
import pytest
import torch

from conftest import assert_token_sum_of, token_sum_err
from _kernel_check import fake_compiles
from test_chunk import by_name
from test_chunk_additive import poisoned  # noqa: F401
from test_chunk_fused import PipelineMath

import linattn
from linattn.codegen.plan import plan
from linattn.codegen.pipeline import AdditiveBackwardProblem
from linattn.dsl import (Gate, Options, SpecError, all_rule_gate_specs, key_twin,
                         value_gate_spec)
from linattn.dsl import torch_reference as tref
from linattn.dsl.additive_bwd import chunk_grads, chunk_grads_key_blocks
from linattn.ops import (additive_bwd, chunk, contracts, gla, linear_attn, retention,
                         simple_gla)

F64 = torch.float64
C = 64
STAGES = ["chunk_bwd_dstate_local", "chunk_bwd_dstate_gate", "chunk_bwd_dstate_walk",
          "chunk_bwd_dstate_scan", "chunk_bwd_dqkvg"]
SCAN = ["chunk_bwd_dstate_local", "chunk_bwd_dstate_scan", "chunk_bwd_dqkvg"]
CALLS = {"scan": ["local", "scan", "dqkvg"], "walk": ["gate", "walk", "dqkvg"]}
SIX = {s.name: s for s in all_rule_gate_specs()}
FAMILIES = {"gla": gla.SPEC, "simple_gla": simple_gla.SPEC, "linear_attn": linear_attn.SPEC,
            "gla_gv_twin": key_twin(gla.SPEC_GV)}     # (the value gate's backward)


def test_plan_lists_the_stages():
    for spec in list(FAMILIES.values()) + list(SIX.values()):
        names = [s.name for s in plan(spec, "bwd")]
        if spec.rule.value == "additive":
            gated = spec.gate is not Gate.NONE
            assert names == [s for s in STAGES if gated or s != "chunk_bwd_dstate_gate"], \
                spec.name
        else:
            assert not set(STAGES) & set(names), spec.name


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("stage", STAGES)
def test_stage_renders(family, stage):
    from linattn.ops.runtime import stage_module
    spec = FAMILIES[family]
    if spec.gate is Gate.NONE and stage == "chunk_bwd_dstate_gate":
        pytest.skip("no gate: the walk reads q")
    mod = stage_module(spec, stage, "sm90")
    assert mod.STAGE == stage and mod.VARIANT == "bwd" and mod.SPEC_HASH == spec.hash
    for ex in mod.EXAMPLES:
        if spec.gate is Gate.NONE:
            ex = {n: x for n, x in ex.items() if n != "g_dtype"}
        mod.build(**ex)


def test_backward_plan():
    """Stages, tiles and buffers; the scan's tile shrinks until a CTA sits on every SM."""
    p = AdditiveBackwardProblem(gate="key", H=4, HV=4, K=64, V=64, dtype="bfloat16",
                                g_dtype="bfloat16", grad_dtype="float32",
                                seq_chunks=(256, 256), use_dht=True)
    pl = additive_bwd.backward_plan(p)
    assert pl.stages() == SCAN         # 8 chains: the walk's smallest tiles fill 32 SMs
    kw = {la.stage: la.kwargs for la in pl.launches}
    assert (kw["chunk_bwd_dstate_scan"]["block_k"], kw["chunk_bwd_dstate_scan"]["block_v"]) \
        == (8, 16)            # 8 chains x 32 tiles = 256 CTAs (16 x 16: 128 < 132 SMs)
    assert kw["chunk_bwd_dstate_scan"]["use_dht"] and not kw["chunk_bwd_dstate_scan"]["store_dh0"]
    assert kw["chunk_bwd_dqkvg"]["grad_dtype"] == "float32"
    assert {b.name: b.shape for b in pl.buffers} == {"dstate": (514, 4, 64, 64),
                                                     "decay": (512, 4, 64)}
    big = AdditiveBackwardProblem(gate="none", H=16, HV=16, K=128, V=128, dtype="float16",
                                  g_dtype="float32", grad_dtype="float16", seq_chunks=(64,) * 8)
    pl = additive_bwd.backward_plan(big, {"dstate_pass": "scan"})
    assert (pl.launches[1].kwargs["block_k"], pl.launches[1].kwargs["block_v"]) == (16, 32)
    assert [b.name for b in pl.buffers] == ["dstate"]
    assert "g_dtype" not in pl.launches[0].kwargs
    assert all("block_k" not in la.kwargs for la in pl.launches
               if la.stage not in ("chunk_bwd_dstate_scan", "chunk_bwd_dqkvg"))
    assert pl.launches[-1].kwargs["block_k"] == 64      # dqkvg: two CTAs an SM (DQKVG_BLOCK_K)
    print(pl)
    # 128 chains x 2 tiles of 128 x 64 cover the SMs: the walk (no gate: it reads q)
    pl = additive_bwd.backward_plan(big)
    assert pl.stages() == ["chunk_bwd_dstate_walk", "chunk_bwd_dqkvg"]
    kw = pl.launches[0].kwargs
    assert (kw["block_k"], kw["block_v"], kw["use_dht"], kw["store_dh0"]) == (128, 64, False, False)
    assert [b.name for b in pl.buffers] == ["dstate"]
    with pytest.raises(SpecError, match="dstate_pass"):
        additive_bwd.backward_plan(big, {"dstate_pass": "fused"})
    print(pl)


def test_backward_plan_key_blocks():
    """Above K = 128 the per-chunk stages run in key blocks (GLA-1.3B: K = 256, V = 512:
    dstate_local in two CTAs of 128 channels a chunk and head, dqkvg in four of 64, two an
    SM); dqkvg's dv then comes as partials."""
    from linattn.codegen.arch.sm90.backward import backward_dims, key_block
    assert [backward_dims(K, 64)[0] for K in (16, 48, 128, 144, 192, 208, 256)] == \
        [64, 64, 128, 192, 192, 256, 256]     # (the op pads K with zero channels)
    assert [backward_dims(64, V)[1] for V in (16, 48, 64, 80, 512)] == [32, 64, 64, 96, 512]
    assert [key_block(K) for K in (16, 48, 128, 192, 256)] == [16, 48, 128, 64, 128]
    p = AdditiveBackwardProblem(gate="key", H=4, HV=4, K=256, V=512, dtype="bfloat16",
                                g_dtype="float32", grad_dtype="bfloat16", seq_chunks=(64,) * 4)
    pl = additive_bwd.backward_plan(p, {"dstate_pass": "scan"})
    kw = {la.stage: la.kwargs for la in pl.launches}
    assert kw["chunk_bwd_dstate_local"]["block_k"] == 128 and kw["chunk_bwd_dqkvg"]["block_k"] == 64
    assert kw["chunk_bwd_dstate_local"]["block_v"] == 64 and kw["chunk_bwd_dqkvg"]["block_v"] == 32
    assert kw["chunk_bwd_dqkvg"]["min_blocks"] == 2 and additive_bwd.key_blocks(pl) == 4
    assert {b.name: b.shape for b in pl.buffers} == {"dstate": (260, 4, 256, 512),
                                                     "decay": (256, 4, 256)}
    # 16 chains x 2 x 8 tiles of 128 x 64: the walk, after the gate pass (key blocks)
    pl = additive_bwd.backward_plan(p)
    kw = {la.stage: la.kwargs for la in pl.launches}
    assert pl.stages() == ["chunk_bwd_dstate_gate", "chunk_bwd_dstate_walk", "chunk_bwd_dqkvg"]
    assert kw["chunk_bwd_dstate_gate"]["block_k"] == 128
    assert (kw["chunk_bwd_dstate_walk"]["block_k"], kw["chunk_bwd_dstate_walk"]["block_v"]) \
        == (128, 64)
    assert {b.name: b.shape for b in pl.buffers} == {"dstate": (260, 4, 256, 512),
                                                     "qg": (256 * 64, 4, 256),
                                                     "decay": (256, 4, 256)}
    small = AdditiveBackwardProblem(gate="scalar", H=4, HV=4, K=192, V=48, dtype="float16",
                                    g_dtype="float32", grad_dtype="float16", seq_chunks=(3,))
    pl = additive_bwd.backward_plan(small)
    assert additive_bwd.key_blocks(pl) == 3 and pl.launches[-1].kwargs["min_blocks"] == 2
    print(pl)
    with pytest.raises(SpecError, match="multiples of 64"):
        additive_bwd.backward_plan(dataclasses.replace(small, K=144))


def test_group_loop_plan():
    """The plan's group loop (sm90 _group_loop): every GVA spec without a per-key gate. At
    Mamba-2's Nemotron-H row one key block of 128 (x, do read once, dx stored), value
    block 32 (64 does not fit: dqkvg_smem's loop model), one CTA an SM, dq, dk stored
    (group_sums false); K 256 in two key blocks of 128; no gate likewise. A per-key
    gate's GVA keeps the f32 atomic adds (group_sums), HV == H neither (dq, dk per head).
    sm80 where the loop's shared memory does not fit (K 128, 16-bit states): the atomic
    adds; with f32 states the loop. The old plan config is no key."""
    p = AdditiveBackwardProblem(gate="scalar", H=8, HV=128, K=128, V=64, dtype="bfloat16",
                                g_dtype="float32", grad_dtype="bfloat16", seq_chunks=(64,),
                                state_dtype="bfloat16", terms=("skip", "skip_per_head",
                                                               "value_scale"))
    dqkvg = additive_bwd._dqkvg_params
    pl = additive_bwd.backward_plan(p)
    kw = dqkvg(pl)
    assert kw["group_loop"] and "block_k" not in kw and kw["block_v"] == 32
    assert kw["min_blocks"] == 1 and not additive_bwd.group_sums(pl)
    assert additive_bwd.key_blocks(pl) == 1
    wide = dqkvg(additive_bwd.backward_plan(dataclasses.replace(p, K=256)))
    assert wide["group_loop"] and wide["block_k"] == 128
    plain = dataclasses.replace(p, gate="none", g_dtype="float32", terms=())
    assert dqkvg(additive_bwd.backward_plan(plain))["group_loop"]
    keyed = additive_bwd.backward_plan(dataclasses.replace(p, gate="key", terms=()))
    assert "group_loop" not in dqkvg(keyed) and additive_bwd.group_sums(keyed)
    own = additive_bwd.backward_plan(dataclasses.replace(p, HV=8))
    assert "group_loop" not in dqkvg(own) and not additive_bwd.group_sums(own)
    sm80 = dataclasses.replace(p, terms=())
    tight = additive_bwd.backward_plan(sm80, None, "sm80")
    assert "group_loop" not in dqkvg(tight) and additive_bwd.group_sums(tight)
    roomy = additive_bwd.backward_plan(dataclasses.replace(sm80, state_dtype="float32"),
                                       None, "sm80")
    assert dqkvg(roomy)["group_loop"] and not additive_bwd.group_sums(roomy)
    with pytest.raises(SpecError, match="unknown backward plan config"):
        additive_bwd.backward_plan(p, {"dqkvg_group_loop": True})


def test_plans_with_the_call_terms():
    """The backward's terms are dqkvg's flags (sm90; sm80 forms none: its calls keep
    torch's), x's tile in its shared-memory model; a recompute of the states forms the
    step and the value scale (no output: no skip term)."""
    from linattn.ops import mamba2
    p = AdditiveBackwardProblem(gate="scalar", H=8, HV=128, K=128, V=64, dtype="bfloat16",
                                g_dtype="float32", grad_dtype="bfloat16", seq_chunks=(64,),
                                state_dtype="bfloat16", terms=("skip", "value_scale"))
    kw = additive_bwd.backward_plan(p).launches[-1].kwargs
    assert kw["skip"] and kw["value_scale"] and "skip_per_head" not in kw
    with pytest.raises(SpecError, match="call terms"):
        additive_bwd.backward_plan(p, arch="sm80")
    with pytest.raises(SpecError, match="call terms"):
        additive_bwd.backward_plan(dataclasses.replace(p, terms=("output_gate",)))
    fp = chunk.forward_problem(mamba2.SPEC, Options(), H=8, HV=128, K=128, V=64,
                               dtype="bfloat16", Ttot=4096, seq_chunks=(64,), g_dtype="float32",
                               output_final_state=True, return_states=True, states_only=True,
                               terms=["step_dt", "value_scale"])
    kw = {la.stage: la.kwargs for la in chunk._plan("sm90", fp, chunk._config({})).launches}
    assert kw["chunk_prepare"]["step_dt"] and kw["chunk_state"]["value_scale"]
    with pytest.raises(SpecError, match="recompute"):
        chunk._plan("sm90", dataclasses.replace(fp, terms=("skip", "value_scale")),
                    chunk._config({}))


@pytest.mark.parametrize("gate", [Gate.KEY, Gate.SCALAR, Gate.NONE])
def test_key_blocks_sum_to_the_chunk(rng, gate):
    """dqkvg's key blocks: dq, dk, dg per channel and dv's partials add up to the whole
    chunk's (fp64; no rounding)."""
    HV, K, V = 2, 48, 32
    r = lambda *s: rng.standard_normal(s)  # noqa: E731
    q, k, v, do = r(HV, C, K), r(HV, C, K), r(HV, C, V), r(HV, C, V)
    g = np.log(1 / (1 + np.exp(-r(HV, C, K) - 2)))
    if gate is not Gate.KEY:          # (one decay a row, broadcast; none: 0)
        g = np.repeat(g[..., :1], K, axis=-1) * (gate is Gate.SCALAR)
    st = [0.1 * r(HV, K, V) for _ in range(2)]            # h_in, dh
    whole = chunk_grads(gate, q, k, v, do, g, *st)
    dq, dk, dv, dg = chunk_grads_key_blocks(gate, q, k, v, do, g, *st, 16)
    assert dv.shape == (3, HV, C, V)
    for x, ref in zip((dq, dk, dv.sum(0), dg), whole):
        np.testing.assert_allclose(x, ref, rtol=1e-10, atol=1e-10)


# -- fp64 fakes of the three stages -----------------------------------------------------------

class BackwardMath:
    """The stages' formulas (dsl/additive_bwd.py), by argument name, in fp64."""

    def __init__(self, spec, H, HV, K, V):
        self.spec, self.H, self.HV, self.K, self.V = spec, H, HV, K, V
        self.group = HV // H
        self.calls = []

    def _gate(self, g, t0, n, hv):
        """[n, K] per-key log gate rows (scalar broadcast, zeros without a gate)."""
        if self.spec.gate is Gate.KEY:
            return g[t0:t0 + n, hv].to(F64)
        if self.spec.gate is Gate.SCALAR:
            return g[t0:t0 + n, hv].to(F64)[:, None].expand(n, self.K)
        return torch.zeros(n, self.K, dtype=F64)

    def _chunks(self, chunk_bos, chunk_len):
        return enumerate(zip(chunk_bos.tolist(), chunk_len.tolist()))

    def local(self, p, q, do, chunk_bos, chunk_len, state_row, dstate, scale, g=None,
              decay=None):
        self.calls.append("local")
        self.K, self.V = p["K"], p["V"]      # (the kernels' K, V: padded by backward_dims)
        for c, (t0, n) in self._chunks(chunk_bos, chunk_len):
            for hv in range(self.HV):
                G = self._gate(g, t0, n, hv).cumsum(0)
                qg = q[t0:t0 + n, hv // self.group].to(F64) * G.exp()
                dstate[state_row[c], hv] = (scale * qg.T @ do[t0:t0 + n, hv].to(F64)).float()
                if decay is not None:
                    decay[c, hv] = G[-1].exp().float()

    def gate(self, p, q, g, chunk_bos, chunk_len, qg, decay):
        """qg rows per chunk (rows past its len: 0), as the walk reads them whole."""
        self.calls.append("gate")
        self.K = p["K"]
        qg.fill_(0)
        for c, (t0, n) in self._chunks(chunk_bos, chunk_len):
            for hv in range(self.HV):
                G = self._gate(g, t0, n, hv).cumsum(0)
                qg[c * C:c * C + n, hv] = (q[t0:t0 + n, hv // self.group].to(F64) * G.exp()).to(qg.dtype)
                decay[c, hv] = G[-1].exp().float()

    def walk(self, p, do, cu_seqlens, chunk_offsets, dht, dstate, dh0, scale, q=None, qg=None,
             decay=None):
        """Gated: qg's 64 rows of a chunk against do's 64 rows from its start (the next
        sequence's, or zeros past Ttot, beyond it); no gate: q and do of the chunk's rows."""
        self.calls.append("walk")
        self.K, self.V = p["K"], p["V"]
        cu, offs = cu_seqlens.tolist(), chunk_offsets.tolist()
        dop = torch.cat([do.to(F64), torch.zeros(C, *do.shape[1:], dtype=F64)])
        for n in range(len(offs) - 1):
            c0, nc = offs[n], offs[n + 1] - offs[n]
            for hv in range(self.HV):
                dh = dht[n, hv].to(F64) if p["use_dht"] else torch.zeros(self.K, self.V, dtype=F64)
                for t in reversed(range(nc)):
                    dstate[c0 + n + t + 1, hv] = dh.float()
                    t0 = cu[n] + t * C
                    if qg is not None:
                        x = qg[(c0 + t) * C:(c0 + t + 1) * C, hv].to(F64).T @ dop[t0:t0 + C, hv]
                        dh = decay[c0 + t, hv].to(F64)[:, None] * dh + scale * x
                    else:
                        e = min(t0 + C, cu[n + 1])
                        dh = dh + scale * q[t0:e, hv // self.group].to(F64).T @ dop[t0:e, hv]
                if p["store_dh0"]:
                    dh0[n, hv] = dh.float()

    def scan(self, p, chunk_offsets, dht, dstate, dh0, decay=None):
        self.calls.append("scan")
        self.K, self.V = p["K"], p["V"]      # (the kernels' K, V: padded by backward_dims)
        offs = chunk_offsets.tolist()
        for n in range(len(offs) - 1):
            c0, nc = offs[n], offs[n + 1] - offs[n]
            for hv in range(self.HV):
                dh = dht[n, hv].to(F64) if p["use_dht"] else torch.zeros(self.K, self.V, dtype=F64)
                for t in reversed(range(nc)):
                    x = dstate[c0 + n + t, hv].to(F64)
                    dstate[c0 + n + t + 1, hv] = dh.float()
                    a = decay[c0 + t, hv].to(F64)[:, None] if decay is not None else 1.0
                    dh = a * dh + x
                if p["store_dh0"]:
                    dh0[n, hv] = dh.float()

    def dqkvg(self, p, q, k, v, do, states, dstate, chunk_bos, chunk_len, state_row, dq, dk,
              dv, scale, g=None, dg=None, dt_tok=None, skip_D=None, ds_part=None,
              dD_part=None):
        """With block_k (key blocks): dv summed in f32 into the caller's zeros, a scalar
        gate's dg as per-block f32 partials. GVA: dq, dk [Ttot, H, K] f32, each value
        head's added into the caller's zeros (the kernel's atomic adds). Call terms
        (value_scale, skip): v is x, the GEMMs' v' = x s rounded once into x's dtype, dv
        x's gradient s dv' + D do, ds_part each key block's sum_V dv' x, dD_part each
        chunk's sum over its rows of do x."""
        self.calls.append("dqkvg")
        self.terms = tuple(t for t in ("value_scale", "skip", "skip_per_head") if p.get(t))
        self.K = p["K"]
        bk = p.get("block_k", self.K)
        self.key_blocks = self.K // bk
        pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, C - x.shape[0])).numpy()  # noqa: E731
        self.group_loop = bool(p.get("group_loop"))
        for c, (t0, n) in self._chunks(chunk_bos, chunk_len):
            sr = int(state_row[c])
            sums = {}
            for hv in range(self.HV):
                hk = hv // self.group
                rows = lambda x, h: pad(x[t0:t0 + n, h].to(F64))[None]  # noqa: E731
                x = v[t0:t0 + n, hv].to(F64)
                st = dt_tok[t0:t0 + n, hv].to(F64)[:, None] if p.get("value_scale") else None
                vv = v if st is None else v.clone().index_put_(
                    (torch.arange(t0, t0 + n), torch.tensor(hv)), (x * st).to(v.dtype))
                out = chunk_grads_key_blocks(
                    self.spec.gate, scale * rows(q, hk), rows(k, hk), rows(vv, hv), rows(do, hv),
                    pad(self._gate(g, t0, n, hv))[None],
                    *(x.to(F64).numpy()[None] for x in (states[sr, hv], dstate[sr + 1, hv])), bk)
                dqc, dkc, dgc = (torch.from_numpy(x[0, :n]) for x in (out[0], out[1], out[3]))
                dvc = torch.from_numpy(out[2][:, 0, :n])            # [key blocks, n, V]
                if st is not None:          # (each key block's ds; dv' -> s dv')
                    ds_part[:, t0:t0 + n, hv] = (dvc * x).sum(-1).float()
                    dvc = dvc * st
                if p.get("skip"):           # (key block 0 adds D do; dD's chunk partial)
                    Dv = (skip_D[hv] if p.get("skip_per_head") else skip_D[hv]).to(F64)
                    dvc[0] += Dv * do[t0:t0 + n, hv].to(F64)
                    dD_part[c, hv] = (do[t0:t0 + n, hv].to(F64) * x).sum(0).float()
                if self.group_loop:     # (a CTA per key head: the group's sums stored once)
                    sq, sk = sums.get(hk, (0.0, 0.0))
                    sums[hk] = (sq + scale * dqc, sk + dkc)
                    if hv % self.group == self.group - 1:
                        assert dq.dtype == dk.dtype == q.dtype and dq.shape[1] == self.H
                        dq[t0:t0 + n, hk] = sums[hk][0].to(dq.dtype)
                        dk[t0:t0 + n, hk] = sums[hk][1].to(dk.dtype)
                elif self.group > 1:            # (atomic adds into the caller's zeros)
                    assert dq.dtype == dk.dtype == torch.float32
                    dq[t0:t0 + n, hk] += (scale * dqc).float()
                    dk[t0:t0 + n, hk] += dkc.float()
                else:
                    dq[t0:t0 + n, hv] = (scale * dqc).to(dq.dtype)
                    dk[t0:t0 + n, hv] = dkc.to(dk.dtype)
                if self.key_blocks > 1:         # (atomic adds into the caller's zeros)
                    assert dv.dtype == torch.float32
                    dv[t0:t0 + n, hv] += dvc.sum(0).to(dv.dtype)
                else:
                    dv[t0:t0 + n, hv] = dvc[0].to(dv.dtype)
                if self.spec.gate is Gate.KEY:
                    dg[t0:t0 + n, hv] = dgc.float()
                elif self.spec.gate is Gate.SCALAR and self.key_blocks > 1:
                    dg[:, t0:t0 + n, hv] = dgc.view(n, -1, bk).sum(-1).T.float()
                elif self.spec.gate is Gate.SCALAR:
                    dg[t0:t0 + n, hv] = dgc.sum(-1).float()


def install_fakes(monkeypatch, spec, H, HV, K, V):
    """Route every compile to fakes checked against the traced kernels: the backward's
    stages run BackwardMath, the forward's (the states' recompute) PipelineMath."""
    bwd = BackwardMath(spec, H, HV, K, V)
    body = by_name({"chunk_bwd_dstate_local": bwd.local, "chunk_bwd_dstate_scan": bwd.scan,
                    "chunk_bwd_dstate_gate": bwd.gate, "chunk_bwd_dstate_walk": bwd.walk,
                    "chunk_bwd_dqkvg": bwd.dqkvg})

    def route(spec_, stage, params):
        if stage in STAGES:
            return body(spec_, stage, params)
        return PipelineMath(spec_, params["H"], params["HV"], params["K"],
                            params.get("V")).body(spec_, stage, params)
    fake_compiles(monkeypatch, route)
    monkeypatch.setattr(additive_bwd, "_check_device", lambda n, x: None)
    return bwd


@pytest.fixture
def dstate_pass(monkeypatch, request):
    """Force the state gradient's reverse pass (the walk where any tile fills an SM, the
    scan where none can): the param's name; the cached plans cleared before and after."""
    from linattn.codegen.arch.sm90 import backward as sm90_backward
    monkeypatch.setattr(sm90_backward, "NUM_SMS", 1 if request.param == "walk" else 10 ** 9)
    additive_bwd._plan.cache_clear()
    yield request.param
    additive_bwd._plan.cache_clear()


def _rel(x, ref):
    return float(torch.linalg.norm(x.to(F64) - ref.to(F64)) / torch.linalg.norm(ref.to(F64)))


# -- the GLAChunkBwd contract ---------------------------------------------------------------

@pytest.mark.parametrize("B, T, H, K, V, h0", [(2, 130, 2, 64, 64, True), (1, 63, 3, 32, 64, False),
                                               (2, 64, 1, 64, 32, True),
                                               (1, 70, 1, 256, 512, True),
                                               (1, 70, 2, 144, 64, False)])
@pytest.mark.parametrize("dstate_pass", ["scan", "walk"], indirect=True)
def test_contract_matches_reference(monkeypatch, rng, B, T, H, K, V, h0, dstate_pass):
    bwd = install_fakes(monkeypatch, gla.SPEC, H, H, K, V)
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    dt = torch.float16
    q, k, v, do = (x.to(dt) for x in (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, V)))
    g = torch.nn.functional.logsigmoid(r(B, T, H, K) + 2).to(dt)
    init = 0.1 * r(B, H, K, V)
    _, _, h = tref.gla_chunk_fwd(q, k, v, g, scale=0.125, initial_state=init)
    dht = (0.1 * r(B, H, K, V)).float()
    out = contracts.gla_chunk_bwd(q, k, v, g, h.float(), do, dht, scale=0.125,
                                  initial_state=init.float() if h0 else None)
    assert bwd.calls == CALLS[dstate_pass]
    assert bwd.key_blocks == {256: 4, 144: 3, 128: 2}.get(K, 1)   # (dqkvg's blocks of 64;
    #                                                                144: padded to 192)
    refs = tref.gla_chunk_bwd(q, k, v, g, h, do, dht, scale=0.125)
    assert len(out) == (5 if h0 else 4)
    for name, x, ref, like in zip(("dq", "dk", "dv", "dg", "dh0"), out, refs,
                                  (q, k, v, g, init)):
        assert x.shape == like.shape and x.dtype == torch.float32, name
        assert _rel(x, ref) < 2e-3, (name, _rel(x, ref))


def test_contract_refuses_bad_inputs(monkeypatch):
    install_fakes(monkeypatch, gla.SPEC, 2, 2, 64, 64)
    x = torch.zeros(1, 70, 2, 64, dtype=torch.bfloat16)
    h = torch.zeros(1, 3, 2, 64, 64)
    contracts.gla_chunk_bwd(x, x, x, x, h, x, None)
    with pytest.raises(SpecError, match="h must have shape"):
        contracts.gla_chunk_bwd(x, x, x, x, h[:, :2], x, None)
    with pytest.raises(SpecError, match="h must have dtype"):
        contracts.gla_chunk_bwd(x, x, x, x, h.double(), x, None)
    with pytest.raises(SpecError, match="float16 / bfloat16"):
        contracts.gla_chunk_bwd(x.float(), x, x, x, h, x, None)
    with pytest.raises(SpecError, match="K a multiple of 16 up to 256"):
        y = torch.zeros(1, 70, 2, 320, dtype=torch.bfloat16)
        contracts.gla_chunk_bwd(y, y, x, y, torch.zeros(1, 3, 2, 320, 64), x, None)
    with pytest.raises(SpecError, match="dht must have shape"):
        contracts.gla_chunk_bwd(x, x, x, x, h, x, torch.zeros(1, 2, 64, 32))


# -- training ------------------------------------------------------------------------------

def _reference_forward(call, q, k, v, g, initial_state):
    """The forward (run_forward) on the CPU: the fp64 reference, rounded like the kernels',
    with the states (K-first, per sequence: entering each chunk, then the final one) when
    the call saves them."""
    r = tref.chunked_forward(call.spec, q, k, v, g, options=Options(
        state_v_first=call.state_v_first), scale=call.scale, initial_state=initial_state,
        cu_seqlens=None if call.cu is None else torch.tensor(call.cu), intermediates=True)
    o, ht = r["o"].to(q.dtype), r["final_state"].float()
    states = None
    if call.save_states:
        final = ht.transpose(-1, -2) if call.state_v_first else ht
        B, T = q.shape[:2]
        cu = call.cu or tuple(range(0, (B + 1) * T, T))
        rows, c0 = [], 0
        for n, (a, b) in enumerate(zip(cu, cu[1:])):
            nc = -(-(b - a) // C)
            h = r["h"][0, c0:c0 + nc] if call.cu else r["h"][n, :nc]
            rows += [*h, final[n]]
            c0 += max(nc, 1)            # (the reference keeps a chunk for an empty sequence)
        states = torch.stack(rows).float()
    return o, (ht if call.output_final_state else None), states


CASES = [   # name, B, T, H, HV, K, V, lens, h0, dht, v_first
    pytest.param("gla", 2, 130, 2, 2, 32, 32, None, True, True, False, id="gla-B2-T130"),
    pytest.param("gla", 1, 200, 2, 2, 32, 16, [1, 70, 0, 129], True, True, False,
                 id="gla-varlen"),
    pytest.param("gla", 1, 70, 1, 1, 16, 32, None, True, False, True, id="gla-v-first"),
    pytest.param("simple_gla", 2, 100, 2, 2, 32, 32, None, False, True, False, id="sgla"),
    pytest.param("simple_gla", 1, 150, 1, 1, 16, 16, [64, 1, 85], True, True, True,
                 id="sgla-varlen-v-first"),
    pytest.param("linear_attn", 1, 129, 2, 2, 32, 32, None, True, True, False, id="la"),
    pytest.param("additive_key", 1, 90, 1, 2, 32, 16, None, True, True, False, id="key-GVA2"),
    pytest.param("additive_scalar", 1, 90, 2, 4, 16, 16, [30, 60], True, False, False,
                 id="scalar-GVA2-varlen"),
    pytest.param("additive_none", 2, 65, 1, 2, 16, 16, None, False, True, False, id="none-GVA2"),
    # above K = 128: key blocks (dv, a scalar gate's dg from partials); K = 144: padded
    # to 192, 3 blocks of 64
    pytest.param("gla", 1, 70, 1, 1, 256, 512, None, True, True, False, id="gla-K256-V512"),
    pytest.param("simple_gla", 1, 80, 1, 1, 256, 512, [15, 65], True, True, True,
                 id="sgla-K256-V512-varlen-v-first"),
    pytest.param("linear_attn", 1, 66, 1, 1, 256, 32, None, False, True, False, id="la-K256"),
    pytest.param("additive_scalar", 1, 70, 1, 2, 144, 48, None, True, True, False,
                 id="scalar-K144-GVA2"),
    pytest.param("gla", 1, 70, 1, 1, 144, 96, None, True, True, False, id="gla-K144-V96"),
    # head dims off 16's multiples: zero-padded to them (ops/padding.py)
    pytest.param("gla", 1, 90, 2, 2, 60, 20, [40, 50], True, True, True,
                 id="gla-K60-V20-padded-varlen-v-first"),
    pytest.param("simple_gla", 1, 70, 2, 2, 100, 36, None, True, True, False,
                 id="sgla-K100-V36-padded"),
]


def _train_inputs(spec, rng, B, T, H, HV, K, V, N, h0, v_first, dtype=torch.float16):
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x = dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, HV, V).to(dtype))
    if spec.has_gate:
        x["g"] = torch.nn.functional.logsigmoid(r(*spec.gate_shape(B, T, HV, K, V)) + 2).float()
    if h0:
        x["initial_state"] = 0.1 * (r(N, HV, V, K) if v_first else r(N, HV, K, V))
    st = (N, HV, V, K) if v_first else (N, HV, K, V)
    return x, r(B, T, HV, V).to(dtype), 0.1 * r(*st)


@pytest.mark.parametrize("save, dstate_pass", [(True, "walk"), (False, "scan")],
                         ids=["saved-walk", "recomputed-scan"], indirect=["dstate_pass"])
@pytest.mark.parametrize("name, B, T, H, HV, K, V, lens, h0, with_dht, v_first", CASES)
def test_training_matches_fp64_autograd(monkeypatch, rng, name, B, T, H, HV, K, V, lens, h0,
                                        with_dht, v_first, save, dstate_pass):
    """The states saved by the forward or recomputed by the backward (the arch's rule
    forced both ways), each with one of the two reverse passes for the state gradient."""
    from linattn.codegen.arch.sm90 import backward as sm90_backward
    spec = FAMILIES.get(name) or SIX[name]
    bwd = install_fakes(monkeypatch, spec, H, HV, K, V)
    monkeypatch.setattr(additive_bwd, "run_forward", _reference_forward)
    monkeypatch.setattr(sm90_backward, "SAVE_STATES_MAX_KV", K * V if save else 0)
    _train_and_compare(spec, rng, B, T, H, HV, K, V, lens, h0, with_dht, v_first)
    assert bwd.calls == [c for c in CALLS[dstate_pass] if spec.has_gate or c != "gate"]


def _train_and_compare(spec, rng, B, T, H, HV, K, V, lens, h0, with_dht, v_first):
    """additive_bwd.train's gradients of every input against torch.autograd of the fp64
    recurrence (5e-3)."""
    cu = None if lens is None else torch.tensor([0, *np.cumsum(lens).tolist()])
    N = B if cu is None else len(lens)
    x, do, dht = _train_inputs(spec, rng, B, T, H, HV, K, V, N, h0, v_first)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = additive_bwd.train(spec, Options(state_v_first=v_first), leaves["q"], leaves["k"],
                               leaves["v"], leaves.get("g"), 0.3, leaves.get("initial_state"),
                               True, cu, cu)
    loss = (o.double() * do).sum() + ((ht.double() * dht).sum() if with_dht else 0)
    loss.backward()
    ref_leaves = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rht = tref.recurrent_forward(spec, **ref_leaves, options=Options(state_v_first=v_first),
                                     scale=0.3, cu_seqlens=cu)
    ((ro * do).sum() + ((rht * dht).sum() if with_dht else 0)).backward()
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, n
        assert _rel(t.grad, ref_leaves[n].grad) < 5e-3, (n, _rel(t.grad, ref_leaves[n].grad))


VALUE_CASES = [   # name, B, T, H, HV, K, V, lens, h0, dht, v_first
    pytest.param("gla_gv", 2, 130, 2, 2, 32, 16, None, True, True, False, id="gv-B2-T130"),
    pytest.param("gla_gv", 1, 200, 2, 2, 16, 32, [1, 70, 0, 129], True, True, False,
                 id="gv-varlen"),
    pytest.param("gla_gv", 1, 63, 1, 1, 32, 32, None, True, False, True, id="gv-T63-v-first"),
    pytest.param("additive_value", 1, 90, 1, 2, 32, 16, [40, 50], False, True, False,
                 id="value-GVA2-varlen"),
    pytest.param("gla_gv", 1, 70, 1, 1, 64, 144, None, True, True, False, id="gv-K64-V144"),
    pytest.param("gla_gv", 1, 70, 1, 1, 40, 28, None, True, True, False,
                 id="gv-K40-V28-padded"),
]


@pytest.mark.parametrize("name, B, T, H, HV, K, V, lens, h0, with_dht, v_first", VALUE_CASES)
def test_value_gate_trains_through_its_twin(monkeypatch, rng, poisoned, name, B, T, H,  # noqa: F811
                                            HV, K, V, lens, h0, with_dht, v_first):
    """The value gate's backward: the key-gated twin's forward (dq and the transposed
    states) and its three backward stages at K' = V, V' = K (q, k widened to HV heads),
    NaN-poisoned allocations."""
    spec = gla.SPEC_GV if name == "gla_gv" else value_gate_spec()
    bwd = install_fakes(monkeypatch, key_twin(spec), HV, HV, V, K)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    monkeypatch.setattr(additive_bwd, "run_forward", _reference_forward)
    _train_and_compare(spec, rng, B, T, H, HV, K, V, lens, h0, with_dht, v_first)
    assert bwd.calls == ["local", "scan", "dqkvg"]


def test_chunk_gla_gv_trains(monkeypatch, rng):
    """chunk_gla(gv=...) with inputs that need gradients takes the value gate's backward."""
    B, T, H, K, V = 1, 80, 2, 32, 16
    bwd = install_fakes(monkeypatch, key_twin(gla.SPEC_GV), H, H, V, K)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    monkeypatch.setattr(additive_bwd, "run_forward", _reference_forward)
    x, do, _ = _train_inputs(gla.SPEC_GV, rng, B, T, H, H, K, V, B, True, False)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = gla.chunk_gla(leaves["q"], leaves["k"], leaves["v"], gv=leaves["g"], scale=0.2,
                         initial_state=leaves["initial_state"])
    (o.double() * do).sum().backward()
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, _ = tref.recurrent_forward(gla.SPEC_GV, **ref, scale=0.2)
    (ro * do).sum().backward()
    assert bwd.calls == ["local", "scan", "dqkvg"]
    for n, t in leaves.items():
        assert _rel(t.grad, ref[n].grad) < 5e-3, n


@pytest.mark.parametrize("kind", ["chunk", "fused_recurrent"])
def test_family_functions_train(monkeypatch, rng, kind):
    """chunk_gla / chunk_simple_gla (g and g_gamma) / chunk_linear_attn (normalize) /
    chunk_retention route calls that need gradients through the backward, with fla's
    argument names; so do their fused_recurrent_* twins (as fla's, they train: the
    chunked training runs them; fused_recurrent_gla's gate is named gk)."""
    monkeypatch.setattr(additive_bwd, "run_forward", _reference_forward)
    B, T, H, K, V = 1, 80, 2, 32, 32
    for name, spec, kw in (("gla", gla.SPEC, {}),
                           ("simple_gla", simple_gla.SPEC, {"gamma": True}),
                           ("retention", retention.SPEC, {"fixed": True}),
                           ("linear_attn", linear_attn.SPEC, {"normalize": True})):
        fn = getattr(linattn, f"{kind}_{name}")
        install_fakes(monkeypatch, spec, H, H, K, V)
        x, do, _ = _train_inputs(spec, rng, B, T, H, H, K, V, B, True, False)
        if kw.get("normalize"):         # a positive feature map: the normaliser q.z > 0
            for n in "qk":
                x[n] = (torch.nn.functional.elu(x[n].double()) + 1).to(x[n].dtype)
        if kw.get("fixed"):             # the spec's decay: no g argument
            x.pop("g")
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        args = dict(leaves)
        if kw.get("gamma"):
            args["g_gamma"] = torch.tensor([-0.05, -0.2]).requires_grad_()
        if kw.get("normalize") is not None:
            args["normalize"] = True
        call = dict(args)
        if kind == "fused_recurrent" and name == "gla":
            call["gk"] = call.pop("g")
        o, ht = fn(**call, scale=0.2, output_final_state=True)
        (o.double() * do).sum().backward()
        ref = {n: t.detach().double().requires_grad_() for n, t in args.items()
               if isinstance(t, torch.Tensor)}
        g_ref = ref.get("g")
        if kw.get("gamma"):
            g_ref = ref["g"] + ref["g_gamma"].view(1, 1, H)
        if kw.get("fixed"):
            g_ref = torch.tensor(spec.head_decay(H), dtype=torch.float64).view(1, 1, H)
            g_ref = g_ref.expand(B, T, H)
        ro, _ = tref.recurrent_forward(spec, ref["q"], ref["k"], ref["v"], g_ref, scale=0.2,
                                       initial_state=ref["initial_state"])
        if kw.get("normalize"):
            ro, _ = linear_attn.normalize_output(ro, ref["q"], ref["k"], 0.2)
        (ro * do).sum().backward()
        for n, t in args.items():
            if isinstance(t, torch.Tensor):
                assert _rel(t.grad, ref[n].grad) < 5e-3, (fn.__name__, n)


def test_no_grad_and_refusals(monkeypatch):
    """Without gradients the plain forward runs; what the backward lacks is refused in
    one line before any kernel."""
    x = torch.zeros(1, 70, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.zeros(1, 70, 2, 64)
    with pytest.raises(SpecError, match="q is on cpu"):   # (float32 trains: exact_train)
        gla.chunk_gla(x.float(), x.float(), x.float(), g)
    y = torch.zeros(1, 70, 2, 272, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(SpecError, match="q is on cpu"):   # (K past 256: key blocks, split)
        linear_attn.chunk_linear_attn(y, y, x)
    w = torch.zeros(1, 70, 2, 528, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(SpecError, match="V up to 512"):
        linear_attn.chunk_linear_attn(x, x, w)
    with pytest.raises(SpecError, match="needs g"):
        gla.chunk_gla(x, x, x, g[..., :32])
    with pytest.raises(SpecError, match="cu_seqlens needs B == 1"):
        z = torch.zeros(2, 70, 2, 64, dtype=torch.bfloat16, requires_grad=True)
        gla.chunk_gla(z, z, z, torch.zeros(2, 70, 2, 64), cu_seqlens=torch.tensor([0, 70]))


@pytest.mark.compile
@pytest.mark.parametrize("family, K, V, dtype, states", [
    ("gla", 64, 64, "bfloat16", "input"), ("gla", 128, 128, "float16", "float32"),
    ("gla", 128, 128, "float16", "input"), ("simple_gla", 64, 64, "float16", "input"),
    ("linear_attn", 128, 256, "bfloat16", "float32"), ("gla", 256, 512, "bfloat16", "input"),
    ("gla", 256, 512, "bfloat16", "float32"), ("simple_gla", 256, 512, "bfloat16", "input"),
    ("linear_attn", 256, 512, "float16", "input"), ("gla_gv_twin", 128, 128, "bfloat16", "float32"),
    ("gla_gv_twin", 64, 256, "float16", "float32")])
def test_stages_compile_without_spills(family, K, V, dtype, states):
    """The plan's stages, with either reverse pass (walk, scan), at a table-like call (B=2,
    H=4, 256 chunks each, with dht and dh0) compile for sm_90a: <= 255 registers, no
    spills, TMA shared destinations 128-byte aligned, no CTA barrier in a
    thread-dependent branch (as test_compile). states: f32 (the contract's, the value
    gate's twin's) or the input dtype (a training recompute's; with the walk also dqkvg's
    direct_states probe knob)."""
    from linattn.codegen.compile import compile_stage, format_record
    from linattn.ops.runtime import stage_module
    spec = FAMILIES[family]
    gated = spec.gate is not Gate.NONE
    p = AdditiveBackwardProblem(gate=spec.gate.value, H=4, HV=4, K=K, V=V, dtype=dtype,
                                g_dtype=dtype if gated else "float32", grad_dtype="float32",
                                seq_chunks=(256, 256), use_dht=True, store_dh0=True,
                                state_dtype=dtype if states == "input" else states)
    configs = [{"dstate_pass": "walk"}, {"dstate_pass": "scan"}]
    if states == "input":
        configs.append({"dstate_pass": "walk", "dqkvg_direct_states": True})
    launches = {la.stage + repr(la.params): la for config in configs
                for la in additive_bwd.backward_plan(p, config).launches}
    for la in launches.values():
        rec = compile_stage(stage_module(spec, la.stage, "sm90"), la.kwargs, "sm90")
        print(format_record(rec))
        assert "error" not in rec and "ptxas_error" not in rec, rec
        assert rec["registers"] <= 255 and rec["spill_store_bytes"] == 0, rec
        assert not rec["tma_misaligned"] and not rec["barriers_in_branches"], rec


@pytest.mark.parametrize("K, V, terms, states", [
    (64, 64, ("skip", "skip_per_head", "value_scale"), "float32"),
    (128, 64, ("skip", "skip_per_head", "value_scale"), "bfloat16"),
    (128, 64, ("skip", "value_scale"), "bfloat16"),
    (256, 64, ("skip", "skip_per_head", "value_scale"), "bfloat16")],
    ids=["K64-saved", "K128-recomputed", "K128-D-channels", "K256"])
def test_mamba2_dqkvg_terms_compile_without_spills(K, V, terms, states):
    """Mamba-2's dqkvg with the call terms' backward (Nemotron-H-like: 8 key heads, 128
    value heads, bf16) compiles for sm_90a within its plan's register cap (65536 / (256
    threads x min_blocks), at most 255), no spills; the plan's launch carries the flags.
    GVA without a per-key gate: the plan's group loop (a CTA per key head, one an SM),
    its shared memory within the plan's model (dqkvg_smem) and one CTA's share of an SM."""
    from linattn.codegen.arch.sm90 import backward as sm90_backward
    from linattn.codegen.compile import compile_stage, format_record
    from linattn.ops import mamba2
    from linattn.ops.runtime import stage_module
    p = AdditiveBackwardProblem(gate="scalar", H=8, HV=128, K=K, V=V, dtype="bfloat16",
                                g_dtype="float32", grad_dtype="bfloat16", seq_chunks=(64,),
                                state_dtype=states, terms=terms)
    la = next(la for la in additive_bwd.backward_plan(p).launches
              if la.stage == "chunk_bwd_dqkvg")
    assert all(la.kwargs.get(t) for t in terms), la.kwargs
    assert la.kwargs.get("group_loop"), la.kwargs
    rec = compile_stage(stage_module(mamba2.SPEC, la.stage, "sm90"), la.kwargs, "sm90")
    print(format_record(rec))
    assert "error" not in rec and "ptxas_error" not in rec, rec
    cap = 65536 // (256 * la.kwargs["min_blocks"])
    assert rec["registers"] <= min(cap, 255) and rec["spill_store_bytes"] == 0, rec
    assert not rec["barriers_in_branches"], rec
    bk = la.kwargs.get("block_k", K)
    model = sm90_backward.dqkvg_smem(p, la.kwargs["block_v"], bk, True)
    assert rec["dynamic_smem_bytes"] <= model <= sm90_backward.SM_SMEM_BYTES - 1024, rec


@pytest.mark.parametrize("name", ["additive_key", "additive_scalar"])
def test_user_spec_options_train(monkeypatch, rng, name):
    """A user's additive spec with l2norm_qk and gate_in_kernel (A_log, dt_bias) trains
    through ops.build's chunk: the options by torch before the autograd Function, every
    raw input's gradient (A_log, dt_bias included) against the fp64 recurrence's."""
    from linattn.ops.build import build
    spec = SIX[name]
    B, T, H, HV, K, V = 1, 100, 1, 2, 16, 16
    install_fakes(monkeypatch, spec, H, HV, K, V)
    monkeypatch.setattr(additive_bwd, "run_forward", _reference_forward)
    x, do, dht = _train_inputs(spec, rng, B, T, H, HV, K, V, B, True, False)
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    x["A_log"] = torch.rand(HV, generator=gen, dtype=F64).float()
    x["dt_bias"] = 0.3 * torch.randn(HV * (K if spec.gate is Gate.KEY else 1), generator=gen,
                                     dtype=F64).float()
    x["g"] = torch.randn(x["g"].shape, generator=gen, dtype=F64).float()     # raw
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = build(spec).chunk(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=True)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rht = tref.recurrent_forward(spec, **ref, options=Options(l2norm_qk=True,
                                                                  gate_in_kernel=True))
    ((ro * do).sum() + (rht * dht).sum()).backward()
    terms = _gate_param_terms(spec, ref)
    for n, t in leaves.items():
        err = _rel(t.grad, ref[n].grad)
        if n in terms:      # a sum over the tokens: judged against its terms' magnitude
            err = token_sum_err(t.grad, ref[n].grad, terms[n])
        assert err < 5e-3, (n, err)
    # ... and dt_bias's is the token sum of g's own (checked above), to f32 rounding
    assert_token_sum_of(leaves["dt_bias"].grad, leaves["g"].grad, terms["dt_bias"], "dt_bias")


def _gate_param_terms(spec, ref) -> dict:
    """The per-token terms of dt_bias's and A_log's gradients (fp64 reference), whose
    token sums can cancel (a 225x cancellation made a 0.6 % error of the sum from 16-bit
    inputs, seed 3131474477). With x = g + dt_bias and the gate -e^A_log softplus(x), x's
    gradient is g's, and A_log's terms are g's gradient times softplus(x) / sigmoid(x)."""
    HV = ref["A_log"].shape[0]
    gg = ref["g"].grad
    x = ref["g"].detach() + ref["dt_bias"].detach().reshape(HV, -1).squeeze(-1)
    return {"dt_bias": gg, "A_log": gg * torch.nn.functional.softplus(x) / torch.sigmoid(x)}


# -- Mamba-2 and lightning: their public calls train through the kernels' launches ---------

def _ssd_leaves(lens, G, K, V, HV=4, dtype=torch.float16, seed=7, D_channels=False, z=True):
    """mamba_chunk_scan_combined's inputs (x, z, B, C in ``dtype``; the rest f32), as
    leaves that need gradients, and their fp64 copies (D [HV] or [HV, V]; z or none)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    T = sum(lens)
    p = dict(x=r(1, T, HV, V).to(dtype), dt=(r(1, T, HV) - 1.0).float(),
             A=(-torch.rand(HV, generator=gen, dtype=F64) * 2 - 0.1).float(),
             B=(0.5 * r(1, T, G, K)).to(dtype), C=(0.5 * r(1, T, G, K)).to(dtype),
             D=(r(HV, V) if D_channels else r(HV)).float(), z=r(1, T, HV, V).to(dtype),
             dt_bias=(0.5 * r(HV)).float(), h0=(0.1 * r(1, HV, V, K)).float())
    if not z:
        del p["z"]
    return ({n: t.clone().requires_grad_() for n, t in p.items()},
            {n: t.detach().double().requires_grad_() for n, t in p.items()})


SSD_CASES = [   # lens, G, K, D per (head, channel), z, dt_limit (HV 4; HV_CASES: more)
    pytest.param([130], 2, 32, False, True, (0.0, 1.0), id="G2"),
    pytest.param([1, 70, 0, 59], 1, 32, False, True, (0.0, 1.0), id="varlen-G1"),
    pytest.param([100], 4, 32, True, False, (0.0, float("inf")), id="G4-D-channels-no-z"),
    pytest.param([1, 90], 2, 128, True, True, (0.05, 0.8),
                 id="varlen-K128-key-blocks-D-channels"),
    pytest.param([1, 90], 2, 128, False, False, (0.05, 0.8), id="varlen-K128-key-blocks-no-z"),
    pytest.param([70, 60], 1, 64, True, False, (0.0, float("inf")), id="varlen-K64-G1"),
    pytest.param([90], 1, 256, False, False, (0.0, float("inf")), id="K256-G1"),
]
#: value heads by case id (default 4): G 8 needs 8 or more
SSD_HV = {"varlen-K64-G8": 16, "K128-G8-D-channels": 8}
SSD_CASES += [
    pytest.param([1, 90], 8, 64, False, True, (0.0, 1.0), id="varlen-K64-G8"),
    pytest.param([120], 8, 128, True, False, (0.05, 0.8), id="K128-G8-D-channels"),
]


@pytest.mark.parametrize("dqkvg", ["plan", "atomic"])
@pytest.mark.parametrize("save", [False, True], ids=["recomputed", "saved"])
@pytest.mark.parametrize("lens, G, K, D_channels, z, lim", SSD_CASES)
def test_mamba2_trains_through_every_launch(monkeypatch, request, poisoned, save, dqkvg,  # noqa: F811
                                            lens, G, K, D_channels, z, lim):
    """mamba_chunk_scan_combined with 16-bit inputs that need gradients: the forward and
    the backward's recompute of the states (chunk_prepare, the state pass: kernels whose
    signatures carry the call terms' tensors, off there) and the backward stages run
    through fakes checked against the traced kernels (runtime.launch_kernel raises on an
    argument without a tensor), NaN-poisoned allocations; the value scale, the call and
    the skip term one Function (ops/terms.py; without z the forward's kernels form dt x
    and o + D x; dqkvg forms the terms' backward: it reads x and s, writes dx = s dv' +
    D do (f32 where the key blocks add it), ds's key-block partials and dD's chunk
    partials, and torch's terms_backward is not called); every input's gradient against
    the fp64 reference. dqkvg "plan": the plan's choice, at GVA (HV > G) its group loop
    (a CTA per key head: dq, dk the group's sums stored once in the input dtype, no
    zeros, no cast), else dq, dk per head; "atomic" (GVA only): the plan's group loop
    ruled out (sm90 _group_loop, as where its shared memory does not fit: sm80 at K 128
    with 16-bit states), dq, dk added by f32 atomic adds into the host's zeros, cast."""
    from linattn.codegen.arch.sm90 import backward as sm90_backward
    from linattn.dsl import call_terms
    from linattn.ops import mamba2, terms, validate
    HV, V = SSD_HV.get(request.node.callspec.id.rsplit("-", 2)[0], 4), 16
    if dqkvg == "atomic":
        if HV == G:
            pytest.skip("group 1: no group to add")
        monkeypatch.setattr(sm90_backward, "_group_loop", lambda p: False)
        additive_bwd._plan.cache_clear()
        request.addfinalizer(additive_bwd._plan.cache_clear)
    bwd = install_fakes(monkeypatch, mamba2.SPEC, G, HV, K, V)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    monkeypatch.setattr(validate, "check_devices", lambda q, **t: None)
    monkeypatch.setattr(sm90_backward, "SAVE_STATES_MAX_KV", K * V if save else 0)
    seen, real = [], terms.terms_backward
    monkeypatch.setattr(terms, "terms_backward",
                        lambda *a, **k: seen.append(a[4].dtype) or real(*a, **k))
    rec, real_rec = [], additive_bwd.recompute_states
    monkeypatch.setattr(additive_bwd, "recompute_states", lambda *a, **k: rec.append(
        sorted(f for f, on in ((a[8:] or [None])[0] or {}).get("flags", {}).items() if on))
        or real_rec(*a, **k))
    rec_v, real_scaled = [], additive_bwd._recompute
    monkeypatch.setattr(additive_bwd, "_recompute", lambda *a: rec_v.append(
        a[7].get("value") if z else True) or real_scaled(*a))
    formed, real_fwd = [], chunk.run_chunk_forward
    monkeypatch.setattr(chunk, "run_chunk_forward", lambda *a, **k: formed.append(
        sorted(f for f, on in (k.get("terms") or {}).get("flags", {}).items() if on))
        or real_fwd(*a, **k))
    mine, ref = _ssd_leaves(lens, G, K, V, HV=HV, D_channels=D_channels, z=z)
    cu = torch.tensor(np.cumsum([0] + lens).tolist(), dtype=torch.int32)
    kw = dict(dt_softplus=True, dt_limit=lim)
    names = list(mine)
    y, hT = linattn.mamba_chunk_scan_combined(
        *(mine[n] for n in ("x", "dt", "A", "B", "C")), 64, D=mine["D"], z=mine.get("z"),
        dt_bias=mine["dt_bias"], initial_states=mine["h0"], return_final_states=True,
        cu_seqlens=cu if len(lens) > 1 else None, **kw)
    h0 = torch.cat([ref["h0"], ref["h0"].new_zeros(len(lens) - 1, HV, V, K)])
    wy, wh = call_terms.reference(
        mamba2.SPEC, ref["C"], ref["B"], ref["x"], dt=ref["dt"], A=ref["A"],
        dt_bias=ref["dt_bias"], D=ref["D"], z=ref.get("z"), initial_state=h0,
        cu_seqlens=cu.long() if len(lens) > 1 else None, options=Options(state_v_first=True),
        **kw)
    gen = torch.Generator().manual_seed(1)
    dy, dh = torch.randn(y.shape, generator=gen, dtype=F64), torch.randn(hT.shape, generator=gen,
                                                                          dtype=F64)
    got = torch.autograd.grad((y, hT), [mine[n] for n in names], (dy.to(y.dtype), dh.float()))
    want = torch.autograd.grad((wy, wh[-1:]), [ref[n] for n in names], (dy, dh))
    errs = {n: _rel(a, b) for n, a, b in zip(names, got, want)}
    err_y = _rel(y.detach(), wy.detach())
    assert err_y < 1e-2 and max(errs.values()) < 1e-2, (err_y, errs)
    assert all(a.dtype == mine[n].dtype and a.shape == mine[n].shape
               for n, a in zip(names, got))
    assert seen == [], seen         # (the terms' backward formed by dqkvg: no torch pass)
    assert bwd.group_loop == (dqkvg == "plan" and HV > G)
    assert bwd.terms == ("value_scale", "skip") + (() if D_channels else ("skip_per_head",))
    kernel_terms = ["skip", "step_bias_on", "step_clamp", "step_dt", "step_softplus",
                    "value_scale"] + (["skip_per_head"] if not D_channels else [])
    assert formed[0] == ([] if z else sorted(kernel_terms)), formed   # (the forward's)
    assert all(f == [] for f in formed[1:]), formed
    step = sorted(set(kernel_terms) - {"skip", "skip_per_head"})
    assert bool(rec) != save and all(r == ([] if z else step) for r in rec), rec  # (its
    # states' recompute: the step and v' = x s formed in its kernels where the forward's were)
    assert all(rv is not None for rv in rec_v[:1]), rec_v   # (z: from the forward's v')


@pytest.mark.parametrize("save", [False, True], ids=["recomputed", "saved"])
def test_lightning_trains_through_every_launch(monkeypatch, save):
    """chunk_lightning_attn with 16-bit inputs that need gradients (the additive training,
    the spec's layer decay as its scalar gate): every launch of the forward, the states'
    recompute and the backward checked against the traced kernels, the gradients against
    the fp64 reference."""
    from linattn.codegen.arch.sm90 import backward as sm90_backward
    from linattn.dsl import call_terms
    from linattn.ops import lightning, validate
    B, T, H, K, V = 1, 100, 2, 32, 16
    install_fakes(monkeypatch, lightning.SPEC, H, H, K, V)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    monkeypatch.setattr(validate, "check_devices", lambda q, **t: None)
    monkeypatch.setattr(sm90_backward, "SAVE_STATES_MAX_KV", K * V if save else 0)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(B, T, H, d, generator=gen, dtype=F64) for d in (K, K, V)]
    xs.append(0.1 * torch.randn(B, H, K, V, generator=gen, dtype=F64))
    mine = [t.to(torch.float16 if i < 3 else torch.float32).requires_grad_()
            for i, t in enumerate(xs)]
    ref = [t.detach().double().requires_grad_() for t in mine]
    o, ht = linattn.chunk_lightning_attn(*mine[:3], 2, 6, initial_state=mine[3],
                                         output_final_state=True)
    g = torch.tensor(lightning.SPEC.head_decay(H, 2, 6), dtype=F64).view(1, 1, H)
    wo, wh = call_terms.reference(lightning.SPEC, *ref[:3], g=g.expand(B, T, H),
                                  initial_state=ref[3])
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad((o, ht), mine, (do.to(o.dtype), torch.ones_like(ht)))
    want = torch.autograd.grad((wo, wh), ref, (do, torch.ones_like(wh)))
    errs = [_rel(a, b) for a, b in zip(got, want)]
    assert _rel(o.detach(), wo.detach()) < 1e-2 and max(errs) < 1e-2, errs


@pytest.mark.parametrize("z", [False, True], ids=["no-z", "z"])
def test_mamba2_final_state_alone_trains(monkeypatch, poisoned, z):  # noqa: F811
    """Only the final state's gradient asked (y's gradient None in the terms' Function:
    dx from dv' alone, dD zero), then only D's."""
    from linattn.dsl import call_terms
    from linattn.ops import mamba2, validate
    HV, K, V, G = 4, 32, 16, 2
    install_fakes(monkeypatch, mamba2.SPEC, G, HV, K, V)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
    monkeypatch.setattr(validate, "check_devices", lambda q, **t: None)
    mine, ref = _ssd_leaves([100], G, K, V, z=z)
    y, hT = linattn.mamba_chunk_scan_combined(
        *(mine[n] for n in ("x", "dt", "A", "B", "C")), 64, D=mine["D"], z=mine.get("z"),
        dt_bias=mine["dt_bias"], initial_states=mine["h0"], return_final_states=True,
        dt_softplus=True)
    wy, wh = call_terms.reference(
        mamba2.SPEC, ref["C"], ref["B"], ref["x"], dt=ref["dt"], A=ref["A"],
        dt_bias=ref["dt_bias"], D=ref["D"], z=ref.get("z"), initial_state=ref["h0"],
        options=Options(state_v_first=True), dt_softplus=True, dt_limit=(0.0, float("inf")))
    names = ["x", "dt", "A", "B", "dt_bias", "h0"]      # (C: none, the state's)
    got = torch.autograd.grad(hT.sum(), [mine[n] for n in names], retain_graph=True)
    want = torch.autograd.grad(wh.sum(), [ref[n] for n in names])
    errs = {n: _rel(a, b) for n, a, b in zip(names, got, want)}
    assert max(errs.values()) < 1e-2, errs
    (dD,), (wD,) = (torch.autograd.grad((t.double() * 2).sum(), [p["D"]])
                    for t, p in ((y, mine), (wy, ref)))
    assert _rel(dD, wD) < 1e-2
