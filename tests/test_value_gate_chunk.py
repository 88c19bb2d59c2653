"""The value gate's chunked forward (chunk_prepare -> chunk_state -> chunk_output, the
sequence split's chunk_state_summary) on CPU: the plan's launches bound against the
traced kernels and run as fp64 fakes of each stage (tests/test_chunk_fused.py's
PipelineMath), every fresh allocation NaN-filled, against the fp64 torch reference;
the plan's rules; the public chunk_gla(gv=...) path and its refusals. The kernels
compile in tests/test_compile.py (-k value_gate) and run on a GPU in
tests/test_value_gate_gpu.py."""
import pytest
import torch

from test_chunk_additive import LENS, _rel, _ref_states, poisoned, run  # noqa: F401

import linattn
from linattn.dsl import Options, SpecError, value_gate_spec
from linattn.ops import chunk

SPEC = value_gate_spec()
NAME = SPEC.name

CASES = [
    (Options(), {}, dict(H=2, HV=2, K=64, V=64)),
    (Options(), {"segments": 2}, dict(H=2, HV=2, K=64, V=64)),
    (Options(state_v_first=True), {"segments": 1, "block_k": 32, "block_v": 16},
     dict(H=2, HV=2, K=64, V=64)),
    (Options(l2norm_qk=True, gate_in_kernel=True), {"segments": 3, "block_v": 32},
     dict(H=1, HV=2, K=64, V=96)),                                    # GVA, V != K
    (Options(l2norm_qk=True), {}, dict(H=2, HV=4, K=128, V=32)),
]


def _id(case):
    o, cfg, dims = case
    flags = [f for f in ("l2norm_qk", "gate_in_kernel", "state_v_first") if getattr(o, f)]
    return "-".join(flags + [f"{k}{v}" for k, v in cfg.items()]
                    + [f"H{dims['H']}-HV{dims['HV']}-K{dims['K']}-V{dims['V']}"])


@pytest.mark.parametrize("options,config,dims", CASES, ids=[_id(c) for c in CASES])
def test_pipeline_matches_reference(monkeypatch, poisoned, options, config, dims):  # noqa: F811
    """o and the final states within f16 storage of the fp64 reference (ragged, empty
    and one-token sequences; split or whole; key / value tiles forced)."""
    (o, ht), ref, seen, plan = run(monkeypatch, NAME, options, LENS, config, **dims)
    split = bool(config.get("segments"))
    assert plan.name == ("three-stage-split" if split else "three-stage"), str(plan)
    assert plan.stages()[0] == "chunk_prepare" and plan.stages()[-1] == "chunk_output"
    assert _rel(o, ref["o"]) < 5e-3
    assert _rel(ht, ref["final_state"]) < 5e-3
    if "block_k" in config:
        assert seen["block_k"] == {config["block_k"]}


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vfirst"])
def test_states_match_reference(monkeypatch, poisoned, v_first):  # noqa: F811
    """return_states: every chunk's entering state and the final states at the contract's
    rows, through the split."""
    (o, fin, states), ref, _, plan = run(monkeypatch, NAME, Options(state_v_first=v_first),
                                         LENS, {"segments": 2}, states=True)
    want = _ref_states(ref, LENS, v_first)
    assert states.shape == want.shape and _rel(states, want) < 5e-3
    assert _rel(fin, ref["final_state"]) < 5e-3 and _rel(o, ref["o"]) < 5e-3


def test_no_fused_form():
    """The value gate's output is chunk_output's: no fused plan, a forced one refused."""
    kw = dict(H=4, HV=64, K=128, V=128, dtype="bfloat16", seq_chunks=(64,) * 4,
              Ttot=64 * 256)
    assert chunk.forward_plan(SPEC, Options(), **kw).name.startswith("three-stage")
    with pytest.raises(SpecError, match="no fused") as e:
        chunk.forward_plan(SPEC, Options(), config={"fused": True}, **kw)
    assert "\n" not in str(e.value)


def _gla(T=70, B=2, H=2, K=64, V=64):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in "qk")
    v = torch.randn(B, T, H, V, generator=gen).bfloat16()
    gv = torch.nn.functional.logsigmoid(torch.randn(B, T, H, V, generator=gen))
    return q, k, v, gv


def test_chunk_gla_gv_refusals():
    q, k, v, gv = _gla(T=5, K=32, V=48)
    gk = -torch.rand(2, 5, 2, 32)
    for args, kw, match in [((q, k, v), {}, "got neither"),
                            ((q, k, v, gk), {"gv": gv}, "got both"),
                            ((q, k, v), {"gv": gk}, r"\[2, 5, 2, 48\]")]:
        with pytest.raises(SpecError, match=match) as e:
            linattn.chunk_gla(*args, **kw)
        assert "\n" not in str(e.value)
    q, k, v, gv = _gla(T=5, K=32, V=272)        # the backward's twin has K' = V <= 256
    with pytest.raises(SpecError, match="V up to 256, got V=272") as e:
        linattn.chunk_gla(q, k, v, gv=gv.requires_grad_())
    assert "\n" not in str(e.value)
