"""A call's head dims zero-padded to those its kernels take, and its outputs sliced back.

Exact: a zero key channel (q, k and the initial state's row zero) adds nothing to any
product and its state row stays zero under any finite decay, so its gate and dt_bias may
take zeros too; a zero value channel (v and the initial state's column zero) has zero
outputs. The forward (ops/api.py), the delta rule's training (ops/autograd.py) and the
additive rule's (ops/additive_bwd.py) pad by torch ops, differentiable where they train.
"""
from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_heads(gate_channels, v_first: bool, K: int, V: int, Kp: int, Vp: int, q, k, v,
              g=None, dt_bias=None, initial_state=None) -> tuple:
    """(q, k, v, g, dt_bias, initial_state) padded from head dims K, V to Kp, Vp: q, k in
    K, v in V, the gate and its per-channel dt_bias ([HV * channels]) in K or V as
    ``gate_channels`` ("K", "V", or none: untouched), the initial state in both (its last
    two dims [V, K] with v_first, else [K, V]). Unchanged where (Kp, Vp) == (K, V)."""
    import torch.nn.functional as F
    if (Kp, Vp) == (K, V):
        return q, k, v, g, dt_bias, initial_state
    pk, pv = (0, Kp - K), (0, Vp - V)
    q, k, v = F.pad(q, pk), F.pad(k, pk), F.pad(v, pv)
    p = {"K": pk, "V": pv}.get(gate_channels)
    if p is not None and g is not None:
        g = F.pad(g, p)
    if p is not None and dt_bias is not None:
        dt_bias = F.pad(dt_bias.reshape(v.shape[2], -1), p).reshape(-1)
    if initial_state is not None:
        initial_state = F.pad(initial_state, pk + pv if v_first else pv + pk)
    return q, k, v, g, dt_bias, initial_state


def unpad(v_first: bool, K: int, V: int, o, final):
    """(o, final state or None) of a padded run at head dims K, V (contiguous; an unpadded
    run's own tensors where they are contiguous already)."""
    o = o[..., :V].contiguous()
    if final is not None:
        final = (final[..., :V, :K] if v_first else final[..., :K, :V]).contiguous()
    return o, final
