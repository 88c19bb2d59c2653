"""The training forward's per-chunk states as the backward reads them, from the fp64
reference's."""
import torch


def forward_states(h, cu, T, dtype):
    """The fp64 reference's states entering each chunk (torch_reference.chunked_forward's
    intermediates h [B', NC', HV, K, V]) in the training forward's layout [NT, HV, K, V]
    (chunk_forward's save_states: sequence by sequence, its chunks in order; the
    reference's row of an empty sequence dropped), rounded once to dtype as the kernels
    store them."""
    C = 64
    if cu is None:
        rows = h[:, :-(-T // C)].reshape(-1, *h.shape[2:])
    else:
        parts, c = [], 0
        for a, b in zip(cu[:-1], cu[1:]):
            n = -(-(b - a) // C)
            parts.append(h[0, c:c + n])
            c += max(n, 1)
        rows = torch.cat(parts)
    return rows.to(dtype).contiguous()


def kept_inverse(A, B, T, dtype):
    """The WY inverse a none / scalar gate's training forward keeps (A_inv [B T, HV, 64],
    chunk_kkt_inverse_save: A itself, the chunk's columns) from the fp64 reference's
    intermediates A [B', tokens, HV, 64], rounded to dtype; tokens past the last sequence
    zero."""
    flat = A.reshape(-1, *A.shape[2:])
    out = torch.zeros(B * T, *A.shape[2:], dtype=dtype)
    out[:flat.shape[0]] = flat.to(dtype)
    return out
