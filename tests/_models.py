"""Random-weight configs of the models linattn serves, built from config (no download):
transformers' Qwen3-Next, Qwen3.5, OLMo-hybrid (Gated DeltaNet) and Kimi Linear (KDA), and
models of fla's layers (GatedDeltaNet, KDA, GLA). Shared by tests/test_models.py (CPU),
tests/test_models_gpu.py and bench/models_bench.py (mid-sized: ``size=``)."""
from __future__ import annotations

import copy

import torch

HF = ("qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear")
FLA = ("fla_gdn", "fla_kda", "fla_gla")
#: the linattn function each model's linear-attention layers call (chunk / recurrent)
FAMILY = {"qwen3_next": "gated_delta_rule", "qwen3_5": "gated_delta_rule",
          "olmo_hybrid": "gated_delta_rule", "kimi_linear": "kda",
          "fla_gdn": "gated_delta_rule", "fla_kda": "kda", "fla_gla": "gla"}
#: op name of the family in linattn's registry (the cpu_ops fixture reports these)
OP = {"gated_delta_rule": "gdn", "kda": "kda", "gla": "gla"}


def layer_types(layers: int) -> list:
    """Three linear-attention layers to one full-attention layer, the last one full."""
    return ["full_attention" if i % 4 == 3 or i == layers - 1 and layers > 1 else
            "linear_attention" for i in range(layers)]


#: per model, the linear-attention geometry of the real model (and of linattn-bench's
#: training rows, whose compiled kernels and fla autotuning a GPU run may carry): key heads
#: (Gated DeltaNet: value heads 2 x), head dim (GLA: K; V = 2 K); hidden size
GPU_DIMS = {
    **dict.fromkeys(("qwen3_next", "qwen3_5", "olmo_hybrid", "fla_gdn"),
                    dict(heads=16, head_dim=128, hidden=256)),
    **dict.fromkeys(("kimi_linear", "fla_kda"), dict(heads=32, head_dim=128, hidden=256)),
    "fla_gla": dict(heads=4, head_dim=256, hidden=512),
}


def hf_config(name, heads=2, head_dim=32, hidden=64, layers=2, vocab=128):
    """A transformers config of ``name`` (one of HF): linear attention with ``heads`` key
    heads of ``head_dim`` (value heads 2 x for the Gated DeltaNet models, as Qwen3-Next);
    full attention with 2 small heads; MoE models with 4 experts of which 2 are routed."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, layer_types=layer_types(layers),
                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None)
    gdn = dict(linear_num_key_heads=heads, linear_num_value_heads=2 * heads,
               linear_key_head_dim=head_dim, linear_value_head_dim=head_dim)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden)
    if name == "qwen3_next":
        return tf.Qwen3NextConfig(**common, **gdn, **moe, head_dim=32,
                                  shared_expert_intermediate_size=hidden)
    if name == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common, **gdn, head_dim=32)
    if name == "olmo_hybrid":
        return tf.OlmoHybridConfig(**common, **gdn)
    if name == "kimi_linear":
        return tf.KimiLinearConfig(
            **{**common, "num_key_value_heads": 2}, linear_num_heads=heads,
            linear_head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=hidden, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    raise ValueError(f"unknown transformers model {name!r}: {HF}")


def fla_config(name, heads=2, head_dim=32, hidden=64, layers=2, vocab=128):
    """A config of fla's model ``name`` (one of FLA), every layer linear attention:
    ``heads`` key heads of ``head_dim`` (GDN: value heads 2 x; GLA: V = 2 K)."""
    import fla.models as fm
    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab,
                  num_heads=heads)
    if name == "fla_gdn":
        return fm.GatedDeltaNetConfig(**common, head_dim=head_dim, num_v_heads=2 * heads,
                                      expand_v=1.0)
    if name == "fla_kda":
        return fm.KDAConfig(**common, head_dim=head_dim)
    if name == "fla_gla":
        expand = heads * head_dim / hidden
        return fm.GLAConfig(**common, expand_k=expand, expand_v=2 * expand)
    raise ValueError(f"unknown fla model {name!r}: {FLA}")


def build(name, seed=0, dtype=torch.float32, device="cpu", **dims):
    """The model ``name`` (HF or FLA) with random weights from ``seed`` (initialised on
    ``device``: the same seed gives other weights on another device), in eval mode."""
    import transformers as tf
    if name in FLA:
        import fla.models  # noqa: F401 (registers fla's models with transformers' Auto*)
    cfg = hf_config(name, **dims) if name in HF else fla_config(name, **dims)
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype=dtype).eval()


def twin(model):
    """An independent copy with the same weights (one side stays on its default path)."""
    return copy.deepcopy(model)


class Pair:
    """One model twice with the same weights: ``fla`` (transformers' models on their default
    path, fla's functions where fla is importable; fla's models as they are) and
    ``linattn`` (transformers' routed by integrations.kernelize; fla's run inside
    ``within("linattn")``, the context that applies integrations.apply_linattn_to_fla)."""

    def __init__(self, name, dtype=torch.bfloat16, device="cuda", seed=0, **dims):
        from linattn import integrations
        self.name = name
        self.fla = build(name, seed=seed, dtype=dtype, device=device, **dims)
        copy_ = twin(self.fla)
        self.linattn = integrations.kernelize(copy_) if name in HF else copy_

    def within(self, side):
        """A context manager factory: what ``side`` ("fla" or "linattn") runs in."""
        import contextlib
        from linattn import integrations
        if side == "linattn" and self.name in FLA:
            return integrations.apply_linattn_to_fla
        return contextlib.nullcontext

    def logits(self, side, x, **kw):
        with self.within(side)(), torch.no_grad():
            return getattr(self, side)(x, **kw).logits.float()


def linear_layers(model) -> int:
    """How many linear-attention layers the model has."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return cfg.num_hidden_layers
    return sum(t == "linear_attention" for t in types)


def train_curve(model, x, steps, lr=1e-3, within=None) -> list:
    """Losses of ``steps`` AdamW steps of ``model`` on the fixed batch ``x`` (labels = x),
    under bf16 autocast on CUDA; ``within``: a context manager factory each step runs in
    (the fla patch). The model is left trained."""
    import contextlib
    within = within or contextlib.nullcontext
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    cast = (torch.autocast("cuda", dtype=torch.bfloat16) if x.is_cuda
            else contextlib.nullcontext())
    losses = []
    for _ in range(steps):
        with within(), cast:
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def greedy(model, x, new, within=None):
    """Greedy generation of ``new`` tokens with the model's cache."""
    import contextlib
    with (within or contextlib.nullcontext)(), torch.no_grad():
        return model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              use_cache=True)


def last_logits(model, x, within=None):
    import contextlib
    with (within or contextlib.nullcontext)(), torch.no_grad():
        return model(x).logits[:, -1].float()


def greedy_agreement(ref, model, x, new, ref_within=None, within=None) -> dict:
    """``model``'s greedy tokens against ``ref``'s, token for token over ``new`` tokens (B = 1).
    Where they first differ, the pick is checked to be a near tie: ref's own logits there
    rank the two tokens closer than twice the largest difference of the two models' logits
    on that prefix (a cache or decode error gives a wide margin). Then ``model`` restarts
    from ref's prefix, so all ``new`` positions are checked. Returns {"matched": tokens
    equal, "ties": [(position, margin, bound)], "wide": [(position, margin, bound)]}."""
    want = greedy(ref, x, new, ref_within)
    L, pos, out = x.shape[1], 0, {"matched": 0, "ties": [], "wide": []}
    while pos < new:
        got = greedy(model, want[:, :L + pos], new - pos, within)
        diff = (got[0, L + pos:] != want[0, L + pos:]).nonzero()
        d = int(diff[0]) if len(diff) else new - pos
        out["matched"] += d
        pos += d
        if pos == new:
            break
        prefix = want[:, :L + pos]
        a, b = last_logits(ref, prefix, ref_within), last_logits(model, prefix, within)
        margin = float(a[0, want[0, L + pos]] - a[0, got[0, L + pos]])
        bound = 2 * float((a - b).abs().max())
        out["ties" if margin <= bound else "wide"].append((pos, margin, bound))
        pos += 1
    return out
