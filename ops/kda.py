"""Kimi Delta Attention: the delta rule with a log decay per key channel."""
from ..dsl import OpSpec

SPEC = OpSpec(
    name="kda", rule="delta", gate="key", chunk_size=64,
    supports=frozenset({"l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
                        "state_v_first"}),
    doc="KDA: S <- diag(exp(g)) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).",
)
