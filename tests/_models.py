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


def hf_config(name, head_dim=32, hidden=64, layers=2, vocab=128, heads=2):
    """A transformers config of ``name`` (one of HF): ``heads`` key heads of ``head_dim``
    (value heads 2 x for the Gated DeltaNet models, as Qwen3-Next), MoE models with 4
    experts of which 2 are routed."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, layer_types=layer_types(layers),
                  num_attention_heads=heads, num_key_value_heads=1, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None)
    gdn = dict(linear_num_key_heads=heads, linear_num_value_heads=2 * heads,
               linear_key_head_dim=head_dim, linear_value_head_dim=head_dim)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden)
    if name == "qwen3_next":
        return tf.Qwen3NextConfig(**common, **gdn, **moe, head_dim=head_dim,
                                  shared_expert_intermediate_size=hidden)
    if name == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common, **gdn, head_dim=head_dim)
    if name == "olmo_hybrid":
        return tf.OlmoHybridConfig(**common, **gdn)
    if name == "kimi_linear":
        return tf.KimiLinearConfig(
            **{**common, "num_key_value_heads": heads}, linear_num_heads=heads,
            linear_head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=hidden, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    raise ValueError(f"unknown transformers model {name!r}: {HF}")


def fla_config(name, head_dim=32, hidden=64, layers=2, vocab=128, heads=2):
    """A config of fla's model ``name`` (one of FLA), every layer linear attention."""
    import fla.models as fm
    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab,
                  num_heads=heads)
    if name == "fla_gdn":
        return fm.GatedDeltaNetConfig(**common, head_dim=head_dim, num_v_heads=2 * heads,
                                      expand_v=1.0)
    if name == "fla_kda":
        return fm.KDAConfig(**common, head_dim=head_dim)
    if name == "fla_gla":
        return fm.GLAConfig(**common, expand_k=head_dim * heads / hidden,
                            expand_v=head_dim * heads / hidden)
    raise ValueError(f"unknown fla model {name!r}: {FLA}")


def build(name, seed=0, dtype=torch.float32, device="cpu", **dims):
    """The model ``name`` (HF or FLA) with random weights from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    if name in HF:
        import transformers as tf
        model = tf.AutoModelForCausalLM.from_config(hf_config(name, **dims))
    else:
        import transformers as tf
        import fla.models  # noqa: F401 (registers fla's models with transformers' Auto*)
        model = tf.AutoModelForCausalLM.from_config(fla_config(name, **dims))
    return model.to(device=device, dtype=dtype).eval()


def twin(model):
    """An independent copy with the same weights (one side stays on its default path)."""
    return copy.deepcopy(model)


def linear_layers(model) -> int:
    """How many linear-attention layers the model has."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return cfg.num_hidden_layers
    return sum(t == "linear_attention" for t in types)
