"""Real models on linattn's kernels against the same models on fla's, on the GPU.

Tiny random-weight configs built from config (tests/_models.py) with each model's real
linear-attention geometry: transformers' Qwen3-Next, Kimi Linear, Qwen3.5, OLMo-hybrid
routed by linattn.integrations.kernelize, fla's GatedDeltaNet, KDA and GLA models by
apply_linattn_to_fla. Per model: logits (bf16) against fla's, both measured against an fp32
run; transformers' torch path at fp32 on a short input; greedy generation over 32 new
tokens with the cache (prefill through chunk_*, decode through fused_recurrent_*), token
for token but near ties; 50 training steps on a fixed batch, the loss curve against fla's;
packed sequences (cu_seqlens) where the model takes them. Tests are grouped by model
(module-scoped parameter) so a time limit cuts whole models, the three the issue needs
first. CPU halves: tests/test_models.py.
"""
import functools

import pytest
import torch

import linattn
from linattn import integrations

import _models as M

pytestmark = pytest.mark.gpu
MODELS = ("qwen3_next", "kimi_linear", "fla_gdn", "qwen3_5", "olmo_hybrid", "fla_kda", "fla_gla")
VOCAB = 512
DEVICE = "cuda"


def tokens(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (B, T), generator=g).to(DEVICE)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module", params=MODELS)
def name(request):
    pytest.importorskip("kernels")
    pytest.importorskip("transformers")
    pytest.importorskip("fla.layers")
    return request.param


class Models:
    """Everything a model's tests run, built before the tests (outside the NaN-poisoned
    allocations of a gpu test): ``bf16`` (Pair), ``train`` (an fp32 Pair for training
    under autocast), ``cpu`` (transformers' models: fp32 on the CPU, the torch path) and
    ``fp32`` (its twin on linattn, on the GPU)."""

    def __init__(self, name):
        self.name = name
        dims = dict(device=DEVICE, vocab=VOCAB, **M.GPU_DIMS[name])
        self.bf16 = M.Pair(name, **dims)
        self.train = M.Pair(name, dtype=torch.float32, **dims)
        if name in M.HF:       # the bf16 weights, exactly, in fp32
            self.cpu = M.twin(self.bf16.fla).to("cpu", torch.float32)
            self.fp32 = integrations.kernelize(M.twin(self.cpu).to(DEVICE))


@pytest.fixture(scope="module")
def models(name):
    """The models of ``name``, linattn's kernels compiled first in parallel: one call of
    each test's, at its shapes (a kernel's plan follows the shape: a test at shapes not
    warmed would compile its kernels one by one)."""
    m = Models(name)
    res = integrations.precompile(*warm_steps(m))
    for pair in (m.bf16, m.train):
        pair.linattn.zero_grad(set_to_none=True)
        pair.linattn.eval()
    print(f"{name}: precompiled {res}")
    assert not res["errors"], res["errors"][:3]
    return m


def warm_steps(m) -> list:
    """The tests' linattn calls (their inputs' shapes and dtypes), each a callable."""
    p, t = m.bf16, m.train

    def train_step():                      # (test_training_loss_curve_matches_fla)
        x = tokens(2, 256, seed=5)
        with t.within("linattn")(), torch.autocast(DEVICE, dtype=torch.bfloat16):
            t.linattn.train()
            t.linattn(x, labels=x).loss.backward()

    @torch.no_grad()
    def packed():                          # (test_packed_sequences)
        cu = packed_cu()
        if m.name in M.FLA:
            x = tokens(1, sum(PACKED), seed=7)
            p.logits("linattn", x, cu_seqlens=cu)
            for a, b in zip(cu[:-1], cu[1:]):
                p.logits("linattn", x[:, a:b])
        elif gdn_layer(p.linattn) is not None:
            gdn_layer(p.linattn)(packed_hidden(p), cu_seq_lens_q=cu.int())

    @torch.no_grad()
    def fp32():                            # (test_logits_match_torch_path_fp32)
        if m.name in M.HF:
            m.fp32(tokens(2, 16))
    return [lambda: p.logits("linattn", tokens(2, 300)), train_step, packed, fp32,
            lambda: M.greedy(p.linattn, tokens(1, 70), 2, p.within("linattn"))]


def test_logits_match_fla(models):
    """bf16 logits on linattn and on fla (B = 2, T = 300: four chunks of 64 and a partial
    one). transformers' models: each against the fp32 torch path, linattn's error within
    twice fla's; fla's models: linattn within 2% of fla."""
    x, pair = tokens(2, 300), models.bf16
    got, want = pair.logits("linattn", x), pair.logits("fla", x)
    if models.name in M.FLA:
        print(f"{models.name}: logits linattn vs fla {rel(got, want):.2e}")
        assert rel(got, want) < 2e-2
        return
    with torch.no_grad():
        ref = models.cpu(x.cpu()).logits.to(DEVICE)
    e_lin, e_fla = rel(got, ref), rel(want, ref)
    print(f"{models.name}: logits error vs fp32: linattn {e_lin:.2e}, fla {e_fla:.2e}")
    assert e_lin <= 2 * e_fla + 1e-3


def test_logits_match_torch_path_fp32(models):
    """transformers' torch path (fp32, CPU) against linattn at fp32 (its exact recurrent
    kernel), a short input."""
    if models.name not in M.HF:
        pytest.skip("fla's models have no torch path")
    x = tokens(2, 16)
    with torch.no_grad():
        want, got = models.cpu(x.cpu()).logits, models.fp32(x).logits.cpu()
    assert rel(got, want) < 1e-4


@pytest.fixture
def calls(monkeypatch):
    """Names of linattn's public functions called (the slots and the fla patch look them
    up in ``linattn`` at call time / when applied)."""
    seen = []
    for fn_name in integrations.FLA_FUNCTIONS:
        fn = getattr(linattn, fn_name)

        @functools.wraps(fn)
        def counted(*a, _fn=fn, _n=fn_name, **kw):
            seen.append((_n, a[0].shape[1] if a else kw["q"].shape[1]))
            return _fn(*a, **kw)
        monkeypatch.setattr(linattn, fn_name, counted)
    return seen


def test_greedy_generation_matches_fla(models, calls):
    x, new, pair = tokens(1, 70), 32, models.bf16
    res = M.greedy_agreement(pair.fla, pair.linattn, x, new, within=pair.within("linattn"))
    print(f"{models.name}: generation {res}")
    assert not res["wide"] and res["matched"] + len(res["ties"]) == new
    assert res["matched"] >= new // 2
    family = M.FAMILY[models.name]
    assert (f"chunk_{family}", 70) in calls and (f"fused_recurrent_{family}", 1) in calls
    assert all(n.startswith("chunk") for n, T in calls if T > 64)


def test_training_loss_curve_matches_fla(models):
    """50 AdamW steps (fp32 weights, bf16 autocast) on one fixed batch from the same
    weights: every step's loss within 5% of fla's, 2% on average, and the loss falls."""
    x, pair = tokens(2, 256, seed=5), models.train
    want = M.train_curve(pair.fla, x, 50)
    got = M.train_curve(pair.linattn, x, 50, within=pair.within("linattn"))
    gaps = [abs(a - b) / b for a, b in zip(got, want)]
    print(f"{models.name}: loss fla {want[0]:.3f} -> {want[-1]:.3f}, linattn {got[0]:.3f} -> "
          f"{got[-1]:.3f}, gap worst {max(gaps):.2e} mean {sum(gaps) / len(gaps):.2e}")
    assert max(gaps) < 0.05 and sum(gaps) / len(gaps) < 0.02
    assert got[-1] < 0.8 * got[0] and want[-1] < 0.8 * want[0]


PACKED = (100, 37, 140)


def packed_cu():
    return torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()], device=DEVICE)


def packed_hidden(pair):
    return torch.randn(1, sum(PACKED), pair.fla.config.hidden_size,
                       generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)


def gdn_layer(model):
    """The model's first Gated DeltaNet layer, or None (Kimi Linear)."""
    return next((m for m in model.modules() if "GatedDeltaNet" in type(m).__name__), None)


def test_packed_sequences(models):
    """fla's models: a packed batch (cu_seqlens) on linattn equals its sequences run one by
    one, and fla's packed logits within 2%. transformers' Gated DeltaNet layers take
    cu_seq_lens_q: one layer, linattn against fla (Kimi Linear does not pass it)."""
    pair, cu = models.bf16, packed_cu()
    if models.name == "kimi_linear":
        pytest.skip("transformers' Kimi Linear does not pass cu_seqlens to chunk_kda")
    if models.name in M.FLA:
        x = tokens(1, sum(PACKED), seed=7)
        got = pair.logits("linattn", x, cu_seqlens=cu)
        want = pair.logits("fla", x, cu_seqlens=cu)
        one = torch.cat([pair.logits("linattn", x[:, a:b]) for a, b in zip(cu[:-1], cu[1:])],
                        1)
        print(f"{models.name}: packed vs one by one {rel(got, one):.2e}, vs fla "
              f"{rel(got, want):.2e}")
        assert rel(got, one) < 2e-2 and rel(got, want) < 2e-2
        return
    h, outs = packed_hidden(pair), []
    for side in ("linattn", "fla"):
        with torch.no_grad():
            outs.append(gdn_layer(getattr(pair, side))(h, cu_seq_lens_q=cu.int()))
    print(f"{models.name}: packed layer linattn vs fla {rel(*outs):.2e}")
    assert rel(*outs) < 2e-2
