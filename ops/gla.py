"""Gated Linear Attention: the additive rule with a log decay per key channel."""
from ..dsl import OpSpec

SPEC = OpSpec(
    name="gla", rule="additive", gate="key", chunk_size=64,
    supports=frozenset({"state_v_first"}), gva=False,
    doc="GLA: S <- diag(exp(g)) S + k v^T; o = S^T (scale q).",
)
