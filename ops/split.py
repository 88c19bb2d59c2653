"""Key head dims past the kernels' limit, exactly, by splitting: in the additive rule each
key channel's row of the state evolves on its own (S <- decay S + k v^T, o = S^T q), so a
call of K channels is the sum of the outputs of calls on blocks of at most
:data:`KEY_BLOCK` channels, each with its rows of the states (the scale stays the whole
call's). Each block is an ordinary call (differentiable where that call is)."""
from ..dsl import Gate, OpSpec, Rule
from .padding import round_up

#: the widest K a kernel takes (the recurrent kernel's and the chunked ones' limit)
KEY_BLOCK = 256


def wide_keys(spec: OpSpec, options, q) -> bool:
    """Whether a call goes by key blocks: the additive rule, K past KEY_BLOCK, the gate
    not activated in the kernel (its per-channel dt_bias is not split here)."""
    shape = getattr(q, "shape", ())
    return (spec.rule is Rule.ADDITIVE and len(shape) == 4 and shape[-1] > KEY_BLOCK
            and not options.gate_in_kernel)


def by_key_blocks(spec: OpSpec, run, q, k, g, initial_state, scale, v_first: bool):
    """(o, final_state or None) of a call as the sum over key blocks of
    ``run(q, k, g, initial_state, scale)`` on each block's channels (the per-key gate's
    too; the initial state's rows, its columns when ``v_first``): o summed in f32 (in the
    blocks' dtype), the final states joined along K."""
    import torch
    K = q.shape[-1]
    step = round_up(-(-K // -(-K // KEY_BLOCK)), 16)
    scale = spec.scale_for(K, scale)
    outs, finals = [], []
    for s in range(0, K, step):
        cut = slice(s, min(K, s + step))
        h0 = None if initial_state is None else (
            initial_state[..., cut] if v_first else initial_state[..., cut, :])
        o, ht = run(q[..., cut], k[..., cut], g[..., cut] if spec.gate is Gate.KEY else g,
                    h0, scale)
        outs.append(o)
        finals.append(ht)
    o = torch.stack([x.float() for x in outs]).sum(0).to(outs[0].dtype)
    ht = None if finals[0] is None else torch.cat(finals, dim=-1 if v_first else -2)
    return o, ht
