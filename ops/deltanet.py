"""DeltaNet: the delta rule without a gate."""
from ..dsl import OpSpec

SPEC = OpSpec(
    name="deltanet", rule="delta", gate="none", chunk_size=64,
    supports=frozenset({"l2norm_qk", "state_v_first"}),
    doc="DeltaNet (Yang et al. 2024): S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).",
)
