"""CPU tests of the delta rule's prepare (chunk_kkt_inverse, then chunk_wu where the plan
needs w and u): the stages plan, the sm90 plans' params and bindings, sm_90a compiles
(the contracts' a_beta=False forms included), and fake kernels (signature checks + each
stage's formula in fp64, tests/test_chunk_fused.py's PipelineMath, through the plan's
buffers with the stores' roundings) run chunk_forward's three-stage plan; what the state
pass receives (g_cum, kn, w, u) and the stored A_b = A diag(beta) are compared with the
NumPy fp64 chunked reference."""
import numpy as np
import pytest
import torch

from _kernel_check import fake_compiles
from test_chunk_fused import PipelineMath

from linattn.codegen.plan import plan
from linattn.dsl import Options, all_rule_gate_specs
from linattn.dsl.chunked import chunked_forward as np_chunked_forward
from linattn.ops import chunk
from linattn.ops.registry import get_spec

F64 = torch.float64
C = 64
PREPARE = ("chunk_kkt_inverse", "chunk_wu")


def test_prepare_stages_planned_for_delta_without_key_gate():
    for spec in all_rule_gate_specs():
        names = [s.name for s in plan(spec, "fwd")]
        want = spec.rule.value == "delta" and spec.gate.value in ("none", "scalar")
        assert all((n in names) == want for n in PREPARE), (spec.name, names)
        # chunk_prepare: the additive rule's and the per-key gate's only
        assert ("chunk_prepare" in names) == (spec.rule.value == "additive"
                                              or spec.gate.value == "key"), (spec.name, names)


SIZES_KV = (128, 128)


def _params(name, config=None, options=Options(), **kw):
    sizes = dict(H=2, HV=4, K=SIZES_KV[0], V=SIZES_KV[1], dtype="bfloat16", seq_chunks=(4, 2), Ttot=384,
                 beta_dtype="bfloat16")
    sizes.update(kw)
    p = chunk.forward_plan(get_spec(name), options, config=config, **sizes)
    return p, chunk.plan_params(p)


@pytest.mark.parametrize("name", ["gdn", "deltanet"])
def test_plans_take_the_kkt_and_wu_where_needed(name):
    """The walk reads A_b from chunk_kkt_inverse and forms w, u itself; the three-stage
    plan (per-chunk states, or forced) runs chunk_wu (64 columns) after it; kkt has one
    inverse (the two-warp one: no inverse / threads knobs) and the grid order of the
    chunk count."""
    walk, params = _params(name)
    assert walk.stages()[0] == "chunk_kkt_inverse" and "chunk_wu" not in params
    for p, params in (_params(name, {"fused": False}), _params(name, return_states=True)):
        assert p.name == "three-stage" and p.stages()[:2] == list(PREPARE)
        wu = params["chunk_wu"]
        assert SIZES_KV[0] % wu["block_n"] == 0 and SIZES_KV[1] % wu["block_n"] == 0
        assert wu["block_n"] == 64 and wu["heads_fastest"]      # run s3-1's 64 columns
    kkt = params["chunk_kkt_inverse"]
    assert "inverse" not in kkt and "threads" not in kkt and kkt["heads_fastest"]
    assert kkt["g_dtype"] == "float32" and kkt["beta_dtype"] == "bfloat16"
    for p in (_params(name)[0], _params(name, {"fused": False})[0]):
        chunk.stage_module(get_spec(name), "chunk_kkt_inverse").build(
            **chunk.plan_params(p)["chunk_kkt_inverse"])


def test_kkt_binds_the_normed_copies():
    """Without l2norm_qk kkt's qn / kn outputs alias q / k (not written); with it they are
    buffers the later stages read."""
    p, _ = _params("gdn", {"fused": False})
    kkt, wu = p.launches[0], p.launches[1]
    assert (kkt.tensor("qn"), kkt.tensor("kn"), wu.tensor("k")) == ("q", "k", "k")
    p, _ = _params("gdn", {"fused": False}, Options(l2norm_qk=True))
    kkt, wu = p.launches[0], p.launches[1]
    assert (kkt.tensor("qn"), kkt.tensor("kn"), wu.tensor("k")) == ("qn", "kn", "kn")
    assert {"qn", "kn"} <= {b.name for b in p.buffers}
    walk, _ = _params("gdn", None, Options(l2norm_qk=True))
    assert (walk.launches[-1].tensor("q"), walk.launches[-1].tensor("k")) == ("qn", "kn")


@pytest.mark.compile
@pytest.mark.parametrize("op,stage,extra", [
    ("gdn", "chunk_kkt_inverse", {}),
    ("deltanet", "chunk_kkt_inverse", dict(a_dtype="float32")),
    ("deltanet", "chunk_kkt_inverse", dict(a_beta=False)),        # the DeltaNet contract's
    ("gdn", "chunk_wu", {}),
    ("deltanet", "chunk_wu", dict(a_dtype="float32")),
    ("deltanet", "chunk_wu", dict(a_beta=False, beta_dtype="bfloat16")),
])
def test_prepare_stage_compiles(op, stage, extra):
    mod = chunk.stage_module(get_spec(op), stage)
    params = dict(mod.EXAMPLES[0], **extra)
    src = chunk.compiled_stage(get_spec(op), stage, **params).get_kernel_source()
    assert "mma" in src


# -- fake kernels: the plan's prepare, its output checked against the NumPy reference -------

SPLIT_CASES = [
    ("gdn", dict(B=2, T=130, H=2, HV=4, K=64, V=64), Options(), None),
    ("gdn", dict(B=1, T=0, H=1, HV=2, K=64, V=128),
     Options(l2norm_qk=True, beta_sigmoid=True, allow_neg_eigval=True, gate_in_kernel=True),
     [1, 64, 1, 65, 7]),
    ("deltanet", dict(B=1, T=0, H=2, HV=2, K=128, V=64), Options(l2norm_qk=True),
     [63, 1, 100]),
    ("deltanet", dict(B=3, T=1, H=1, HV=1, K=64, V=64), Options(), None),
]


@pytest.mark.parametrize("name,dims,options,lens", SPLIT_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(SPLIT_CASES)])
def test_prepare_math_against_fp64_reference(monkeypatch, rng, name, dims, options, lens):
    spec = get_spec(name)
    B, T, H, HV, K, V = (dims[x] for x in ("B", "T", "H", "HV", "K", "V"))
    math = PipelineMath(spec, H, HV, K, V)
    seen = {}

    def body(spec_, stage, params):
        run = math.body(spec_, stage, params)
        if stage != "chunk_state":
            return run

        def state(*args):               # what the state pass receives
            seen["state"] = [a.clone() if hasattr(a, "clone") else a for a in args]
            run(*args)
        return state
    calls = []
    fake_compiles(monkeypatch, body, calls)
    monkeypatch.setattr(chunk, "_check_device", lambda n, t: None)
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
    # chunk_kkt_inverse's A_b buffer, kept: run_plan allocates it; capture through kkt
    kkt_real = math.kkt

    def kkt(p, **a):
        kkt_real(p, **a)
        seen["A"] = a["A"].clone()
    math.kkt = kkt
    chunk.chunk_forward(spec, q, k, v, g, beta, options=options, cu_seqlens=cu,
                        cu_seqlens_cpu=cu, A_log=A_log, dt_bias=dt_bias,
                        config={"fused": False})
    assert [s for s, _ in calls] == ["chunk_kkt_inverse", "chunk_wu", "chunk_state",
                                     "chunk_output"]

    npy = lambda x: None if x is None else x.double().numpy()  # noqa: E731
    ref = np_chunked_forward(spec, npy(q), npy(k), npy(v), npy(g), npy(beta), options=options,
                             cu_seqlens=npy(cu), A_log=npy(A_log), dt_bias=npy(dt_bias))
    k_state, w, u, g_cum = seen["state"][:4]
    Ttot = B * T
    rel = lambda got, want: float(np.linalg.norm(got.double().numpy().reshape(want.shape) - want)  # noqa: E731
                                  / max(np.linalg.norm(want), 1e-30))
    # A_b[t, h, j] = A[t, h, j] beta[chunk start + j]: beta of the chunk's column tokens
    bos, length, _ = chunk.build_chunk_tables(cu.tolist() if cu is not None
                                              else list(range(0, (B + 1) * T, T)), C)
    A_ref, b_eff = ref["A"].reshape(Ttot, HV, C), ref["prepared"].beta.reshape(Ttot, HV)
    Ab_ref = np.zeros_like(A_ref)
    for t0, L in zip(bos, length):
        Ab_ref[t0:t0 + L, :, :L] = A_ref[t0:t0 + L, :, :L] * b_eff[t0:t0 + L].T[None]
    assert rel(seen["A"], Ab_ref) < 1e-2            # bf16 storage
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
