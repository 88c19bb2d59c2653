"""A call's pipeline as data: which generated stages run, with which parameters, and the
named tensors that flow between them.

An arch package (codegen/arch/<arch>/) turns a :class:`ForwardProblem` into a
:class:`Plan`; the runtime (ops/runtime.py ``run_plan``) allocates the plan's buffers and
launches its stages in order, passing each kernel its tensors by name: a kernel argument
``x`` reads the plan tensor ``launch.bind.get(x, x)``. Tensor names the runtime provides
itself (the call's inputs, outputs and host tables) are listed in :data:`PROVIDED`.

    plan = get_arch("sm90").forward_plan(problem)
    print(plan)                                   # stages, tiles, tensors, the rules used
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: tensors the runtime binds from the call (flat [Ttot, ...] views), its outputs and the
#: host tables (int32 on the device); everything else a plan uses is one of its buffers
PROVIDED = {
    "q": "q [Ttot, H, K]", "k": "k [Ttot, H, K]", "v": "v [Ttot, HV, V]",
    "g": "gate [Ttot, HV] (scalar) or [Ttot, HV, K] (per key)", "beta": "beta [Ttot, HV]",
    "A_log": "A_log [HV]", "dt_bias": "dt_bias [HV] or [HV * K]",
    "h0": "initial state f32 in the state layout (or a placeholder)",
    "scale": "f32 scalar", "o": "output [Ttot, HV, V]",
    "ht": "final states f32 in the state layout (or a placeholder)",
    "cu_seqlens": "[N + 1]", "chunk_bos": "[NT] first token of each chunk",
    "chunk_len": "[NT] valid rows of each chunk", "chunk_offsets": "[N + 1] first chunk of each sequence",
    "final_row": "[N] row of ht per sequence (0 .. N-1)",
    "seg_cu": "[NS + 1] token bounds of the segments", "seg_c0": "[NS + 1] first chunk of each segment",
    "seq_seg_offsets": "[N + 1] first segment of each sequence",
    "map_seg": "[NM] the segments whose maps are formed (all but each sequence's last)",
    "seg_final_row": "[NS] row of ht per segment (-1 but for each sequence's last)",
    "seg_seq": "[NS] the sequence of each segment",
    "seg_first": "[NS] the first segment of each segment's sequence",
    "step_A": "the call terms' A [HV] f32 (or a placeholder)",
    "step_bias": "dt_bias [HV] f32 (or a placeholder)",
    "step_limit": "dt_limit's (lo, hi) f32 (or a placeholder)",
    "skip_D": "D [HV, V] or [HV] f32 (or a placeholder)",
    "gate_z": "z [Ttot, HV, V] (or a placeholder)",
}


class _Chunked:
    """N (sequences) and NT (chunks) of a problem's seq_chunks, each sequence's chunks."""
    @property
    def N(self) -> int:
        return len(self.seq_chunks)

    @property
    def NT(self) -> int:
        return sum(self.seq_chunks)


@dataclass(frozen=True)
class ForwardProblem(_Chunked):
    """One chunked-forward call, as the arch rules see it (sizes, dtypes, flags; no data).

    seq_chunks: each sequence's chunk count (the split and the value block depend on it).
    return_states: every chunk's state in f32 and the final one (the chunk contracts);
    save_states: the delta rule's per-chunk states h [NT, HV, K, V] in the input dtype,
    kept for the training backward (which then runs no state pass of its own).
    states_only: with return_states, the states alone in the input dtype (a training
    backward's recompute; its GEMMs take them rounded so): no output stage, no per-chunk
    h of its own, and the per-key gate's prepare forms only what the state pass reads.
    terms: the call terms the kernels form (dsl/call_terms.py; the build() flags of the
    terms' hooks, sorted: step_dt, step_bias_on, step_softplus, step_clamp, value_scale,
    skip, output_gate); the g the call passes is then the raw step.
    """
    rule: str                     # the rule's name ("delta", "additive", "gdn2")
    gate: str                     # "none" | "scalar" | "key"
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    g_dtype: str
    beta_dtype: str
    Ttot: int
    seq_chunks: tuple
    l2norm_qk: bool = False
    beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    gate_in_kernel: bool = False
    state_v_first: bool = False
    has_initial_state: bool = False
    output_final_state: bool = False
    return_states: bool = False
    save_states: bool = False
    states_only: bool = False
    chunk_size: int = 64
    #: the dtypes of the rule's vector gates as the prepare reads them (GDN-2's
    #: (("b_dtype", "float32"), ("w_dtype", "bfloat16")))
    rule_dtypes: tuple = ()
    terms: tuple = ()

    @property
    def rule_kind(self) -> str:
        """The pipeline the rule takes: "delta" for a rule whose write reads the state (the
        WY factors w, u: the delta rule, GDN-2's), "additive" otherwise."""
        from ..dsl.family import RULES
        return "delta" if RULES[self.rule].reads_state else "additive"

    @property
    def erase_key(self) -> str:
        """The rule's erase key input in place of k ("" for k itself; Comba's "p")."""
        from ..dsl.family import RULES
        return RULES[self.rule].erase_key


@dataclass(frozen=True)
class Buffer:
    """A tensor the plan allocates: shape (ints), dtype ("float32", "int32", or "input":
    the dtype of q); at: the stage it is allocated just before ("": before the first, so
    that a buffer lives only from its first writer on; a launch's ``release`` ends it);
    output: one of the call's results, taken as given where the caller binds its own."""
    name: str
    shape: tuple
    dtype: str = "float32"
    at: str = ""
    output: bool = False


@dataclass(frozen=True)
class Launch:
    """One generated stage: its build() params (problem and tuning) as sorted pairs, the
    kernel arguments that read a plan tensor of another name, and the tensors (buffers or
    the call's inputs) no later stage reads, released after it (their memory serves the
    later stages)."""
    stage: str
    params: tuple
    bind: tuple = ()
    note: str = ""
    release: tuple = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    def tensor(self, arg: str) -> str:
        return dict(self.bind).get(arg, arg)


def launch(stage: str, params: dict, note: str = "", release: tuple = (), **bind) -> Launch:
    return Launch(stage, tuple(sorted(params.items())), tuple(sorted(bind.items())), note,
                  tuple(release))


@dataclass(frozen=True)
class Plan:
    """The stages one call runs, in order. ``name`` says which pipeline; ``segments`` the
    sequence split's segment length in chunks (0: not split); ``reasons`` the rules that
    chose it, one line each; ``saved`` the buffers a training forward (save_states) keeps
    for the backward."""
    name: str
    arch: str
    launches: tuple
    buffers: tuple = ()
    segments: int = 0
    reasons: tuple = field(default=(), compare=False)
    saved: tuple = ()

    def stages(self) -> list[str]:
        return [la.stage for la in self.launches]

    def __str__(self) -> str:
        lines = [f"plan {self.name} ({self.arch})" + (f", segments of {self.segments} chunks"
                                                       if self.segments else "")]
        lines += [f"  because {r}" for r in self.reasons]
        for la in self.launches:
            tune = ", ".join(f"{k}={v}" for k, v in la.params)
            lines.append(f"  {la.stage}: {tune}" + (f"  # {la.note}" if la.note else ""))
            if la.bind:
                lines.append("      " + ", ".join(f"{a} <- {t}" for a, t in la.bind))
            if la.release:
                lines.append(f"      then released: {', '.join(la.release)}")
        for b in self.buffers:
            lines.append(f"  buffer {b.name} {list(b.shape)} {b.dtype}"
                         + (f" from {b.at}" if b.at else "") + (" (output)" if b.output else ""))
        if self.saved:
            lines.append(f"  saved for the backward: {', '.join(self.saved)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class DeltaBackwardProblem:
    """One chunked backward of the delta rule (every gate), its four stages over
    token-first packed tensors, as the arch rules see it. chains: sequences x value heads
    (the reverse dh pass's grid); use_dht / store_dh0: the final state's gradient is given
    / the initial state's is wanted; state_dtype: the forward's states' where they are not
    the input dtype (the DeltaNetChunkBwd contract's f32); dh: a probe's num_stages /
    block_v of the dh pass, as (key, value) pairs. Without a gate the arch runs its
    folded form (delta_stages)."""
    gate: str                     # "none" | "scalar" | "key"
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    chains: int = 1
    Ttot: int = 0
    NT: int = 0
    use_dht: bool = False
    store_dh0: bool = False
    state_dtype: str = ""
    dh: tuple = ()


@dataclass(frozen=True)
class DplrBackwardProblem(_Chunked):
    """One chunked backward of the dplr rule (DPLR, IPLR, RWKV-7: docs/design.md "DPLR's
    backward"), its six stages over token-first packed tensors, as the arch rules see it.
    use_dht / store_dh0: the final state's gradient is given / the initial state's is
    wanted; Ttot: the tokens; seq_chunks: each sequence's chunks."""
    gate: str                     # "none" | "key"
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    Ttot: int
    seq_chunks: tuple
    g_dtype: str = "float32"
    has_initial_state: bool = False
    use_dht: bool = False
    store_dh0: bool = False
    chunk_size: int = 64


@dataclass(frozen=True)
class AdditiveBackwardProblem(_Chunked):
    """One chunked backward of the additive rule (the GLA family), as the arch rules see
    it. grad_dtype: the dtype of dq, dk, dv ("float32" for the GLAChunkBwd contract, the
    input dtype under autograd); use_dht / store_dh0: the final state's gradient is given
    / the initial state's is wanted; state_dtype: the saved states' ("float32" for the
    contract, the input dtype for a training recompute's); terms: the call terms dqkvg
    forms (dsl/call_terms.py; its build() flags, sorted: skip, skip_per_head,
    value_scale): v is then the raw value x and dv x's gradient."""
    gate: str                     # "none" | "scalar" | "key"
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    g_dtype: str
    grad_dtype: str
    seq_chunks: tuple
    use_dht: bool = False
    store_dh0: bool = False
    state_dtype: str = "float32"
    chunk_size: int = 64
    terms: tuple = ()
