"""linattn under real model code, on the CPU: transformers' Qwen3-Next, Qwen3.5, OLMo-hybrid
and Kimi Linear routed by the ``kernels`` mapping (linattn.integrations.kernelize), fla's
layers by apply_linattn_to_fla. The kernels' place is taken by the fp64 torch reference
(the ``cpu_ops`` fixture: linattn's public functions run end to end but for the kernels),
so the routing, the arguments each model passes, the caches of generation and the
gradients of training are checked against transformers' own torch path at fp32. The GPU
halves (linattn's kernels against fla's) are tests/test_models_gpu.py.
"""
import functools
import subprocess
import sys

import pytest
import torch

import linattn
from linattn import integrations

from _cpu_ops import cpu_ops  # noqa: F401 (fixture)
import _models as M

DEVICE_ERROR = r"q is on cpu; linattn runs on one CUDA device \(Hopper, sm90; Ampere / Ada, sm80\)"


@pytest.fixture
def hf():
    pytest.importorskip("kernels")
    return pytest.importorskip("transformers")


@pytest.fixture
def hopper(monkeypatch):
    """`kernels` reads the device's capability to pick a mapping: report an H100's."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


@pytest.fixture
def calls(monkeypatch):
    """Every call of linattn's public functions: (name, {argument: value}), through to
    the real function (transformers' slots and the fla patch look the name up in
    ``linattn`` when they call)."""
    seen = []
    for name in integrations.FLA_FUNCTIONS:
        fn = getattr(linattn, name)

        @functools.wraps(fn)
        def recorder(*args, _fn=fn, _name=name, **kwargs):
            seen.append((_name, dict(zip(("q", "k", "v", "g", "beta"), args)) | kwargs))
            return _fn(*args, **kwargs)
        monkeypatch.setattr(linattn, name, recorder)
    return seen


def tokens(B, T, seed=1, vocab=128):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_import_needs_no_model_package():
    code = ("import linattn, linattn.integrations, sys; "
            "print(sorted({'transformers', 'kernels', 'fla'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/tmp", check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("missing, call, pip", [
    ("kernels", lambda: integrations.kernel_mapping(), "kernels>=0.19"),
    ("kernels", lambda: integrations.kernelize(torch.nn.Linear(2, 2)), "kernels>=0.19"),
    ("fla.layers", lambda: integrations.apply_linattn_to_fla(), "flash-linear-attention"),
], ids=["kernel_mapping", "kernelize", "apply_linattn_to_fla"])
def test_missing_package_is_one_clear_line(monkeypatch, missing, call, pip):
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(ImportError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and f"needs `{missing}`" in msg and f"pip install '{pip}'" in msg


@pytest.mark.parametrize("mode", ["TRAINING", "INFERENCE"])
@pytest.mark.parametrize("name", M.HF)
def test_kernelize_routes_every_slot(hf, hopper, name, mode):
    import kernels
    model = M.build(name)
    assert integrations.kernelize(model, mode=getattr(kernels.Mode, mode)) is model
    slots = integrations.routed(model)
    want = {f"chunk_{M.FAMILY[name]}", f"fused_recurrent_{M.FAMILY[name]}"}
    assert len(slots) == 2 * M.linear_layers(model) and all(slots.values())
    assert {s.rsplit(".", 1)[1] for s in slots} == want


def test_kernels_own_kernelize_keeps_originals_off_hopper(hf, monkeypatch):
    import kernels
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))
    model = M.build("qwen3_5")
    with kernels.use_kernel_mapping(integrations.kernel_mapping()):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cuda")
    assert not any(integrations.routed(model).values())
    with pytest.raises(ValueError, match=r"capability \(8, 0\)\): linattn's kernels run on "
                                         r"Hopper"):
        integrations.kernelize(model)


def test_kernelize_refuses_a_model_without_slots(hf, hopper):
    cfg = hf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"\(LlamaForCausalLM\) has no linear-attention "
                                         r"function linattn maps"):
        integrations.kernelize(hf.LlamaForCausalLM(cfg))


def test_kernelized_model_refuses_cpu_tensors(hf, hopper):
    model = integrations.kernelize(M.build("qwen3_next"))
    with pytest.raises(ValueError, match=DEVICE_ERROR), torch.no_grad():
        model(tokens(1, 8))


def _pair(name):
    """(transformers' torch path, the same weights routed to linattn), fp32 on the CPU."""
    ref = M.build(name)
    return ref, integrations.kernelize(M.twin(ref))


@pytest.mark.parametrize("name", M.HF)
def test_logits_match_torch_path(hf, hopper, cpu_ops, calls, name):
    ref, model = _pair(name)
    x = tokens(2, 70)                          # two chunks of 64 and a partial one
    with torch.no_grad():
        want, got = ref(x).logits, model(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    family = M.FAMILY[name]
    assert [n for n, _ in calls] == [f"chunk_{family}"] * M.linear_layers(model)
    assert {op for op, _ in cpu_ops} == {M.OP[family]}


@pytest.mark.parametrize("name", M.HF)
def test_arguments_are_transformers_fla_call(hf, hopper, cpu_ops, calls, name):
    """What the model passes reaches linattn as it reaches fla: q, k, v, g, beta of fla's
    shapes, its keywords, and none of the model's attention kwargs."""
    _, model = _pair(name)
    with torch.no_grad():
        model(tokens(2, 9))
    (fn, kw), = calls[:1]
    cfg = model.config
    H = getattr(cfg, "linear_num_key_heads", None) or cfg.linear_num_heads
    HV = getattr(cfg, "linear_num_value_heads", None) or H
    K = getattr(cfg, "linear_key_head_dim", None) or cfg.linear_head_dim
    assert kw["q"].shape == kw["k"].shape == (2, 9, H, K)
    assert kw["v"].shape[:3] == (2, 9, HV) and kw["beta"].shape == (2, 9, HV)
    assert kw["g"].shape == ((2, 9, HV, K) if M.FAMILY[name] == "kda" else (2, 9, HV))
    assert kw["use_qk_l2norm_in_kernel"] is True and kw["initial_state"] is None
    assert set(kw) <= {"q", "k", "v", "g", "beta", "chunk_size", "initial_state",
                       "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens"}


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "olmo_hybrid"])
def test_packed_sequences_reach_linattn(hf, hopper, cpu_ops, calls, name):
    """transformers hands a packed batch's cu_seq_lens_q to the Gated DeltaNet function as
    cu_seqlens; linattn's output for it equals the torch path's (which ignores it, so the
    layer is compared on one sequence: B = 1, cu_seqlens [0, T])."""
    ref, model = _pair(name)
    layer = lambda m: next(mod for mod in m.modules() if hasattr(mod, "_kernel_funcs")
                           and "GatedDeltaNet" in type(mod).__name__)  # noqa: E731
    x = torch.randn(1, 20, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 20])
    with torch.no_grad():
        got, want = layer(model)(x, cu_seq_lens_q=cu), layer(ref)(x)
    assert calls[0][1]["cu_seqlens"] is cu
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", M.HF)
def test_greedy_generation_matches_torch_path(hf, hopper, cpu_ops, calls, name):
    """Prefill through chunk_*, then one fused_recurrent_* call per layer and new token,
    each from the state the cache kept; tokens equal the torch path's."""
    ref, model = _pair(name)
    x, new = tokens(1, 70), 8
    kw = dict(max_new_tokens=new, do_sample=False, use_cache=True)
    want, got = ref.generate(x, **kw), model.generate(x, **kw)
    assert torch.equal(got, want) and got.shape[1] == 70 + new
    n, family = M.linear_layers(model), M.FAMILY[name]
    assert [c for c, _ in calls] == ([f"chunk_{family}"] * n
                                     + [f"fused_recurrent_{family}"] * n * (new - 1))
    decode = [kw for c, kw in calls if c.startswith("fused_recurrent")]
    assert all(kw["q"].shape[1] == 1 and kw["initial_state"] is not None for kw in decode)


@pytest.mark.parametrize("name", M.HF)
def test_training_gradients_match_torch_path(hf, hopper, cpu_ops, name):
    """fp32 training runs linattn's exact torch path (ops/exact_train.py): the loss and
    every parameter's gradient equal transformers' torch path's."""
    ref, model = _pair(name)
    x = tokens(2, 40)
    for m in (ref, model):
        m.train()
        m(x, labels=x).loss.backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=n)


@pytest.fixture
def fla_layers():
    pytest.importorskip("transformers")
    return pytest.importorskip("fla.layers")


def test_apply_linattn_to_fla_rebinds_and_undoes(fla_layers):
    import fla.layers.gated_deltanet as gdn
    import fla.layers.kda as kda
    import fla.ops.gated_delta_rule as ops
    with integrations.apply_linattn_to_fla() as patch:
        assert gdn.chunk_gated_delta_rule is linattn.chunk_gated_delta_rule
        assert kda.fused_recurrent_kda is linattn.fused_recurrent_kda
        for name in ("gated_deltanet.chunk_gated_delta_rule", "kda.chunk_kda", "gla.chunk_gla",
                     "delta_net.chunk_delta_rule", "linear_attn.chunk_linear_attn",
                     "multiscale_retention.parallel_retention"):
            assert f"fla.layers.{name}" in patch.names
        assert integrations.apply_linattn_to_fla().names == []     # already routed
    assert gdn.chunk_gated_delta_rule is ops.chunk_gated_delta_rule
    assert patch.replaced == []
    only = integrations.apply_linattn_to_fla(["chunk_kda"])
    assert only.names == ["fla.layers.kda.chunk_kda"]
    only.undo()


def test_apply_linattn_to_fla_refuses_unknown_names(fla_layers):
    with pytest.raises(ValueError, match=r"functions=\['fused_chunk_gla'\]: linattn "
                                         r"implements fla's chunk_delta_rule"):
        integrations.apply_linattn_to_fla(["chunk_kda", "fused_chunk_gla"])


class _Stop(Exception):
    pass


def _layer(name):
    """One fla layer of the model ``name`` (no short convolution: its kernel is Triton's)."""
    import fla.layers as L
    common = dict(hidden_size=64, num_heads=2, use_short_conv=False, layer_idx=0)
    if name == "fla_gdn":
        return L.GatedDeltaNet(**common, head_dim=32, num_v_heads=4, expand_v=1.0)
    if name == "fla_kda":
        return L.KimiDeltaAttention(**common, head_dim=32)
    return L.GatedLinearAttention(**{**common, "use_short_conv": False}, expand_k=1.0)


@pytest.mark.parametrize("mode, T", [("chunk", 70), ("fused_recurrent", 1)])
@pytest.mark.parametrize("name", M.FLA)
def test_fla_layer_calls_linattn_with_fla_arguments(fla_layers, cpu_ops, monkeypatch, name,
                                                    mode, T):
    """The patched layer's call reaches linattn with fla's arguments, and linattn runs
    them (fp64 reference kernels): fla's v-first state comes back [B, HV, V, K]. The layer
    stops there (its output norm is a Triton kernel)."""
    from fla.models.utils import Cache
    layer = _layer(name).eval()
    family = M.FAMILY[name]
    fn = f"{'chunk' if mode == 'chunk' else 'fused_recurrent'}_{family}"
    got = {}

    def stop(*args, **kwargs):
        got["kw"], got["out"] = kwargs, getattr(linattn, fn)(*args, **kwargs)
        raise _Stop
    with integrations.apply_linattn_to_fla():
        module = sys.modules[type(layer).__module__]
        monkeypatch.setattr(module, fn, functools.wraps(getattr(module, fn))(stop))
        x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(3))
        with pytest.raises(_Stop), torch.no_grad():       # fla: T <= 64 -> fused_recurrent
            layer(x, past_key_values=Cache(), use_cache=True)
    o, state = got["out"]
    kw = got["kw"]
    assert kw["state_v_first"] is True and o.shape[:2] == (2, T) and torch.isfinite(o).all()
    assert kw["output_final_state"] and state.shape == (2, kw["v"].shape[2], kw["v"].shape[3],
                                                        kw["q"].shape[3])
    if family != "gla":
        assert kw["use_qk_l2norm_in_kernel"] and kw["use_gate_in_kernel"]
        assert kw["A_log"] is not None


def test_models_bench_sorts_kernels_and_prints_rows(fla_layers):
    """bench/models_bench.py's pieces that need no GPU: which kernels are linear attention
    (linattn's generated stages, fla.ops' Triton kernels) and the summary table."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import models_bench as B
    import fla.ops.gated_delta_rule  # noqa: F401
    assert B.linattn_kernel("chunk_walk_kernel") and B.linattn_kernel("recurrent_kernel")
    assert not B.linattn_kernel("ampere_bf16_s16816gemm") and not B.fla_kernel("chunk_walk")
    assert B.fla_kernel("chunk_gated_delta_rule_fwd_kernel_h_blockdim64")
    assert not B.fla_kernel("rms_norm_fwd_kernel") and set(B.MODELS) == set(M.HF + M.FLA)
    row = dict(model="qwen3_5", task="train", impls={
        "linattn": dict(ms=10.0, attn_ms=2.0, ok=True), "fla": dict(ms=12.5, attn_ms=4.0)})
    bad = dict(model="fla_gla", task="generate", impls={"error": "RuntimeError: x"})
    lines = B.table([row, bad]).splitlines()
    assert "1.25x" in lines[1] and lines[1].endswith("True") and "ERROR RuntimeError" in lines[2]
    ks = [(0, 2000, "gemm_a(int)"), (0, 500, "cast"), (10, 1510, "gemm_a(float)"), (0, 900, "c")]
    assert B.top_kernels(ks, n=2) == [["gemm_a", 2, 3.5], ["c", 1, 0.9]]


def test_models_bench_prefill_check(hf, hopper, cpu_ops):
    """bench/models_bench.py prefill_check on a tiny Kimi Linear (bf16 on the CPU: fla's
    side transformers' torch path, linattn's the fp64 reference): each side's error against
    the fp32 twin, its own (fla's unchanged when linattn's KDA output is 5% off); linattn
    ok within twice fla's, and not ok when off."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import models_bench as B
    pair, x = M.Pair("kimi_linear", device="cpu"), tokens(1, 70)
    check = B.prefill_check(pair, x)
    print(check)
    assert check["ok"] and 0 < check["fla"] < 5e-2 and cpu_ops == [("kda", "chunk")]
    kda = linattn.chunk_kda

    @functools.wraps(kda)                    # (the slot passes the keywords kda declares)
    def off(*a, **kw):
        o, state = kda(*a, **kw)
        return o * 1.05, state
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linattn, "chunk_kda", off)
        bad = B.prefill_check(pair, x)
    print(bad)
    assert not bad["ok"] and bad["linattn"] > 2 * bad["fla"] and bad["fla"] == check["fla"]



def test_integrations_precompile_rounds_share_one_pool(monkeypatch):
    """integrations.precompile: rounds until the steps request nothing (a step stops at its
    first missing kernel: a forward, then its backward), every round's requests compiled
    in one pool (its processes start once), the seconds of each round reported."""
    from linattn.ops import gdn, runtime
    p1 = dict(H=2, HV=4, K=64, V=64, dtype="bfloat16")
    p2 = dict(p1, block_v=32)
    pools, rounds = [], []

    class Pool:
        def __enter__(self):
            pools.append(self)
            return self

        def __exit__(self, *exc):
            pass

    def precompile(jobs, load=False, pool=None):      # (loads each: the memo holds it)
        rounds.append((sorted(j[1] for j in jobs), pool, load))
        for j in jobs:
            runtime._KERNELS[runtime._key(*j[:3], j[3])] = (None, ())
        return []
    monkeypatch.setattr(runtime, "_KERNELS", {})
    monkeypatch.setattr(runtime, "compile_pool", lambda workers=None: Pool())
    monkeypatch.setattr(runtime, "precompile", precompile)

    def step():                                        # a forward, then its backward
        runtime.compile_stage(gdn.SPEC, "chunk_output", "sm90", p1)
        runtime.announce(gdn.SPEC, "sm90", {"chunk_state": p2, "chunk_wu": p1})
    res = integrations.precompile(step, lambda: runtime.compile_stage(gdn.SPEC, "chunk_output",
                                                                      "sm90", p1))
    assert [r[0] for r in rounds] == [["chunk_output", "chunk_output"],
                                      ["chunk_state", "chunk_wu"]]
    assert len(pools) == 1 and all(r[1] is pools[0] and r[2] for r in rounds)
    assert (res["requests"], res["rounds"], res["errors"]) == (4, 3, [])
    assert len(res["steps_s"]) == 3 and len(res["compile_s"]) == 2
