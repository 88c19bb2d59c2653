"""Gated DeltaNet: the delta rule with one scalar log decay per value head and token."""
from ..dsl import OpSpec

SPEC = OpSpec(
    name="gdn", rule="delta", gate="scalar", chunk_size=64,
    supports=frozenset({"l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
                        "state_v_first"}),
    doc="Gated DeltaNet: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).",
)
