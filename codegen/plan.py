"""Which stages (generated kernels) a spec needs, per variant.

``STAGE_TABLE`` maps a variant ("fwd", "bwd", "decode") to its ordered stages. A stage
is one mathematical step, one template, one generated file. A stage may apply only to
some rules or gates (``rules`` / ``gates``); ``plan`` drops the stages that do not apply
to a spec, so a variant without stages yet simply plans to fewer files.

To add a stage, append a :class:`Stage` to its variant's tuple below.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..dsl import Gate, OpSpec, Rule, SpecError

VARIANTS = ("fwd", "bwd", "decode")
#: the rules a stage implements by default: the additive and delta rules, and the delta
#: forms whose erase vector and written value come from their macros (GDN-2's on the
#: per-key gate's prepare, Comba's on the scalar gate's kkt and w, u); a stage naming its
#: rules overrides this. The dplr rule has its own two (DPLR_RULES) and the decode stage.
ALL_RULES = frozenset({"additive", "delta", "gdn2", "comba"})
#: the scalar / no gate's WY stages (the kkt inverse and w, u of the three-stage pipeline)
WY_RULES = frozenset({"delta", "comba"})
#: the delta rule's backward stages (the rebuilds, the four stages, the key gradients): the
#: delta rule's and the forms whose erase side its macros give (Comba's p on the scalar
#: gate's WY stage, GDN-2's b . k and w . v on the per-key gate's); the folded form: the
#: delta rule's
DELTA_BWD_RULES = frozenset({"delta", "comba", "gdn2"})
DELTA_BWD_SKIP = frozenset({"comba/none"})
#: the rules the recurrent (decode) stage implements
DECODE_RULES = frozenset(r.value for r in Rule)
#: the dplr rule's chunked forward (chunk_prepare_dplr, chunk_state_dplr: its own form,
#: two written blocks); sized for sm90's shared memory (the prepare holds all of K, ~200 KB
#: at K = V = 128), so an arch without TMA does not generate it
DPLR_RULES = frozenset({"dplr"})
DPLR_FEATURES = frozenset({"tma"})
ALL_GATES = frozenset(g.value for g in Gate)
#: a stage's gates by default: the value gate (per value channel) has the decode stage
#: and the additive rule's three-stage chunked forward, which name it
DEFAULT_GATES = frozenset({"none", "scalar", "key"})
WITH_VALUE = DEFAULT_GATES | {"value"}
#: the delta rule's walk and its sequence split: warpgroup roles (one CTA of four
#: warpgroups with setmaxnreg budgets, TMA loads by a producer warp)
WALK = frozenset({"warpgroups"})


@dataclass(frozen=True)
class Stage:
    """One generated kernel module.

    name:     file stem and stage id ("recurrent" -> generated/<arch>/<op>/recurrent.py)
    template: template file in codegen/templates ("recurrent.py.jinja")
    variant:  "fwd" | "bwd" | "decode"
    doc:      one line on what the stage computes
    rules, gates: the rule / gate values the template implements (others are skipped;
              gates default to none / scalar / key)
    skip:     "rule/gate" pairs inside rules x gates that no pipeline runs it for
    requires: the arch features its template needs (codegen/arch hardware.FEATURES: the
              walk's warpgroup roles); an arch without them does not generate it
    """
    name: str
    template: str
    variant: str
    doc: str = ""
    rules: frozenset = ALL_RULES
    gates: frozenset = DEFAULT_GATES
    skip: frozenset = frozenset()
    requires: frozenset = frozenset()

    def applies_to(self, spec: OpSpec) -> bool:
        return (spec.rule.value in self.rules and spec.gate.value in self.gates
                and f"{spec.rule.value}/{spec.gate.value}" not in self.skip)


STAGE_TABLE: dict[str, tuple[Stage, ...]] = {
    "fwd": (
        Stage("chunk_kkt_inverse", "chunk_kkt_inverse.py.jinja", "fwd",
              doc="per chunk: gate cumsum, l2norm q, k, beta, A diag(beta), the chunk's norm bound",
              rules=WY_RULES, gates=frozenset({"none", "scalar"})),
        Stage("chunk_kkt_inverse_save", "chunk_kkt_inverse.py.jinja", "fwd",
              doc="training: chunk_kkt_inverse writing the WY inverse A itself too (the "
                  "backward keeps it)",
              rules=WY_RULES, skip=DELTA_BWD_SKIP, gates=frozenset({"none", "scalar"})),
        Stage("chunk_walk", "chunk_walk.py.jinja", "fwd",
              doc="the delta rule's walk: state, WY step and output by concurrent warpgroups",
              rules=frozenset({"delta"}), gates=frozenset({"none", "scalar"}),
              requires=WALK),
        Stage("chunk_walk_fused", "chunk_walk.py.jinja", "fwd",
              doc="the walk with the WY inverse formed inside by a fourth warpgroup, a "
                  "chunk ahead (the whole chunked forward in one kernel)",
              rules=frozenset({"delta"}), gates=frozenset({"none", "scalar"}),
              requires=WALK),
        Stage("chunk_walk_map", "chunk_walk.py.jinja", "fwd",
              doc="sequence split, per segment: its affine map [M | B] (M only where needed)",
              rules=frozenset({"delta"}), gates=frozenset({"none", "scalar"}),
              requires=WALK),
        Stage("chunk_segment_combine", "chunk_segment_combine.py.jinja", "fwd",
              doc="sequence split: chain segment maps into the segments' start states",
              rules=frozenset({"delta"}), gates=frozenset({"none", "scalar"}),
              requires=WALK),
        Stage("chunk_wu", "chunk_wu.py.jinja", "fwd",
              doc="per chunk: w = A_b e^g k, u = A_b v (the per-chunk-state pipeline, the contracts)",
              rules=WY_RULES, gates=frozenset({"none", "scalar"})),
        Stage("chunk_prepare", "chunk_prepare.py.jinja", "fwd",
              doc="per chunk, additive rule: gate cumsum, l2norm k (value gate: its "
                  "decay and gated values)",
              rules=frozenset({"additive"}), gates=frozenset({"none", "scalar", "value"})),
        Stage("chunk_prepare", "chunk_prepare_key.py.jinja", "fwd",
              doc="per chunk, per-key gate: cumsum, A_qk, WY inverse A, w, u, qg, kg",
              gates=frozenset({"key"})),
        Stage("chunk_prepare_save", "chunk_prepare_key.py.jinja", "fwd",
              doc="per chunk, per-key gate, training: chunk_prepare writing the WY "
                  "inverse A too (the backward keeps it)",
              rules=DELTA_BWD_RULES, gates=frozenset({"key"})),
        Stage("chunk_prepare_states", "chunk_prepare_key.py.jinja", "fwd",
              doc="per chunk, per-key gate, the states alone (a training backward's "
                  "recompute): cumsum, kg, g_last; no pair sums",
              rules=frozenset({"additive"}), gates=frozenset({"key"})),
        Stage("chunk_state_summary", "chunk_state.py.jinja", "fwd",
              doc="sequence split, additive rule: each segment's end state from zero and "
                  "its summed log decay (S_end = diag(e^G) S_start + B)",
              rules=frozenset({"additive"}), gates=WITH_VALUE),
        Stage("chunk_state", "chunk_state.py.jinja", "fwd",
              doc="sequential inter-chunk state pass: h per chunk, v_new, final state",
              gates=WITH_VALUE),
        Stage("chunk_output", "chunk_output.py.jinja", "fwd",
              doc="per chunk: o = scale (q h + causal(q k^T) v_new), gated",
              gates=WITH_VALUE),
        Stage("chunk_qk", "chunk_qk.py.jinja", "fwd",
              doc="fused path, per chunk: the causal gated A_qk (and the l2-normalised q)",
              rules=frozenset({"additive"}), gates=frozenset({"none", "scalar"})),
        Stage("chunk_prepare_dplr", "chunk_prepare_dplr.py.jinja", "fwd",
              doc="per chunk, dplr rule: G, the pairs A_ab, A_ak, A_qb, A_qk by bisection, "
                  "X = (I - A_ab)^-1, w, u, qg, bg, kg, g_last",
              rules=DPLR_RULES, gates=frozenset({"key"}), requires=DPLR_FEATURES),
        Stage("chunk_prepare_iplr", "chunk_prepare_iplr.py.jinja", "fwd",
              doc="per chunk, dplr rule without a decay: the pairs as plain GEMMs, "
                  "X = (I - A_ab)^-1, w, u, qg, bg, kg",
              rules=DPLR_RULES, gates=frozenset({"none"}), requires=DPLR_FEATURES),
        Stage("chunk_state_dplr", "chunk_state_dplr.py.jinja", "fwd",
              doc="dplr rule's sequential pass: r = w S + u, o = qg S + A_qb r + A_qk v, "
                  "S <- e^g_last S + bg^T r + kg^T v",
              rules=DPLR_RULES, gates=frozenset({"none", "key"}), requires=DPLR_FEATURES),
        Stage("chunk_state_output", "chunk_state_output.py.jinja", "fwd",
              doc="fused path: the state pass forming o = scale (qg S + A_qk v_new)",
              skip=frozenset({"delta/none", "delta/scalar", "comba/none", "comba/scalar"})),
    ),
    "bwd": (
        Stage("chunk_bwd_prepare_dplr", "chunk_prepare_dplr.py.jinja", "bwd",
              doc="dplr rule, the backward's recompute: chunk_prepare_dplr writing X and "
                  "A_ak too",
              rules=DPLR_RULES, gates=frozenset({"key"}), requires=DPLR_FEATURES),
        Stage("chunk_bwd_prepare_iplr", "chunk_prepare_iplr.py.jinja", "bwd",
              doc="dplr rule without a decay, the backward's recompute: chunk_prepare_iplr "
                  "writing X and A_ak too",
              rules=DPLR_RULES, gates=frozenset({"none"}), requires=DPLR_FEATURES),
        Stage("chunk_bwd_state_dplr", "chunk_state_dplr.py.jinja", "bwd",
              doc="dplr rule, the backward's recompute: chunk_state_dplr's walk saving h "
                  "(the state entering each chunk) and r = w S + u, no output",
              rules=DPLR_RULES, gates=frozenset({"none", "key"}), requires=DPLR_FEATURES),
        Stage("chunk_bwd_dstate_dplr", "chunk_bwd_dstate_dplr.py.jinja", "bwd",
              doc="dplr rule, reverse sequential pass: dh per chunk, dr = A_qb^T do + bg dS', "
                  "dv = A_qk^T do + kg dS', dh0",
              rules=DPLR_RULES, gates=frozenset({"none", "key"}), requires=DPLR_FEATURES),
        Stage("chunk_bwd_dqkw_dplr", "chunk_bwd_dqkw_dplr.py.jinja", "bwd",
              doc="dplr rule, per chunk and key block: dqg = do h^T, dw = dr h^T, "
                  "dbg = r dh^T, dkg = v dh^T, dgl",
              rules=DPLR_RULES, gates=frozenset({"none", "key"}), requires=DPLR_FEATURES),
        Stage("chunk_bwd_wy_dplr", "chunk_bwd_wy_dplr.py.jinja", "bwd",
              doc="dplr rule, per chunk: dx = X^T dw, dy = X^T du, the pairs' gradients "
                  "dm, dv = dv_direct + A_ak^T dy",
              rules=DPLR_RULES, gates=frozenset({"none", "key"}), requires=DPLR_FEATURES),
        Stage("chunk_bwd_pairs_dplr", "chunk_bwd_pairs_dplr.py.jinja", "bwd",
              doc="dplr rule, per chunk and key block: the pairs' gradients by the "
                  "forward's bisection, the gate's terms: dq, dk, da, db, dg",
              rules=DPLR_RULES, gates=frozenset({"none", "key"}), requires=DPLR_FEATURES),
        Stage("chunk_bwd_key_rebuild", "chunk_prepare_key.py.jinja", "bwd",
              doc="per chunk, per-key gate: w, u, qg, kg, g_last, G (and the l2-normalised "
                  "q, k) from the inverse A the training forward kept",
              rules=DELTA_BWD_RULES, gates=frozenset({"key"})),
        Stage("chunk_bwd_kkt_rebuild", "chunk_kkt_inverse.py.jinja", "bwd",
              doc="per chunk, none / scalar gate: the gate cumsum and the l2-normalised q, k "
                  "(the kept A spares the inverse)",
              rules=DELTA_BWD_RULES, skip=DELTA_BWD_SKIP, gates=frozenset({"none", "scalar"})),
        Stage("chunk_bwd_dv_local", "chunk_bwd_dv_local.py.jinja", "bwd",
              doc="per chunk (token-first packed): dv_local = (tril_incl(q k^T) E)^T do",
              rules=DELTA_BWD_RULES, skip=DELTA_BWD_SKIP, gates=frozenset({"scalar", "key"})),
        Stage("chunk_bwd_dh", "chunk_bwd_dh.py.jinja", "bwd",
              doc="reverse sequential pass: dh per chunk, dv2 = dv_local + k dh",
              rules=DELTA_BWD_RULES, skip=DELTA_BWD_SKIP, gates=frozenset({"scalar", "key"})),
        Stage("chunk_bwd_dqkw", "chunk_bwd_dqkw.py.jinja", "bwd",
              doc="per chunk: v_new, dq, dk (output + state terms), dw = -dv2 S^T",
              rules=DELTA_BWD_RULES, skip=DELTA_BWD_SKIP, gates=frozenset({"scalar", "key"})),
        Stage("chunk_bwd_wy", "chunk_bwd_wy.py.jinja", "bwd",
              doc="per chunk: back through A, w, u: dk += WY terms, dv, dbeta",
              rules=DELTA_BWD_RULES, skip=DELTA_BWD_SKIP, gates=frozenset({"scalar", "key"})),
        Stage("chunk_bwd_fold_local", "chunk_bwd_fold_local.py.jinja", "bwd",
              doc="folded form, per chunk: dv_local, and the reverse pass's dh-free parts "
                  "dh_local = q^T do - w^T dv_local, nwk = -(w^T k)",
              rules=frozenset({"delta"}), gates=frozenset({"none"})),
        Stage("chunk_bwd_fold_walk", "chunk_bwd_fold_walk.py.jinja", "bwd",
              doc="folded form, reverse sequential pass: dh += dh_local + nwk dh, one "
                  "product a chunk",
              rules=frozenset({"delta"}), gates=frozenset({"none"})),
        Stage("chunk_bwd_fold_tail", "chunk_bwd_fold_tail.py.jinja", "bwd",
              doc="folded form, per chunk: dv2 = dv_local + k dh, v_new, dq, dk, dw, then back "
                  "through A, w, u: dv, dbeta (du, dw, dk's first terms in the CTA)",
              rules=frozenset({"delta"}), gates=frozenset({"none"})),
        Stage("chunk_bwd_key_grads", "chunk_bwd_key_grads.py.jinja", "bwd",
              doc="token-first: the per-value-head dq, dk to the key heads' (GVA sum, scale, "
                  "l2norm backward)",
              rules=DELTA_BWD_RULES, skip=DELTA_BWD_SKIP, gates=frozenset({"none", "scalar", "key"})),
        Stage("chunk_bwd_dstate_local", "chunk_bwd_dstate_local.py.jinja", "bwd",
              doc="additive rule, per chunk: its state-gradient term scale (q e^g)^T do, its decay",
              rules=frozenset({"additive"})),
        Stage("chunk_bwd_dstate_gate", "chunk_bwd_dstate_local.py.jinja", "bwd",
              doc="additive rule, per chunk (before the walk): q e^g, its decay",
              rules=frozenset({"additive"}), gates=frozenset({"scalar", "key"})),
        Stage("chunk_bwd_dstate_walk", "chunk_bwd_dstate_walk.py.jinja", "bwd",
              doc="additive rule, reverse sequential pass (where its tiles fill the GPU): "
                  "the gradient of the state leaving each chunk, dh0",
              rules=frozenset({"additive"})),
        Stage("chunk_bwd_dstate_scan", "chunk_bwd_dstate_scan.py.jinja", "bwd",
              doc="additive rule, reverse element-wise pass: the gradient of the state leaving each chunk, dh0",
              rules=frozenset({"additive"})),
        Stage("chunk_bwd_dqkvg", "chunk_bwd_dqkvg.py.jinja", "bwd",
              doc="additive rule, per chunk: dq, dk, dv, dg from the states, their gradients and the pairs",
              rules=frozenset({"additive"})),
    ),
    "decode": (
        Stage("recurrent", "recurrent.py.jinja", "decode",
              doc="token-by-token recurrence, state on chip (decode, small T, varlen)",
              rules=DECODE_RULES, gates=ALL_GATES),
    ),
}


def plan(spec: OpSpec, variant: str | None = None, arch: str | None = None) -> list[Stage]:
    """The ordered stages generated for ``spec`` on ``arch`` (codegen.arch.DEFAULT_ARCH when
    None; all variants when ``variant`` is None): those whose template's requirements the
    arch has (Stage.requires)."""
    from .arch import DEFAULT_ARCH, get_arch
    features = get_arch(arch or DEFAULT_ARCH).FEATURES     # (validates the name)
    if variant is not None and variant not in STAGE_TABLE:
        raise SpecError(f"unknown variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    variants = VARIANTS if variant is None else (variant,)
    stages = [s for v in variants for s in STAGE_TABLE[v]
              if s.applies_to(spec) and s.requires <= features]
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise SpecError(f"duplicate stage names in plan for {spec.name}: {names}")
    return stages


def all_stages() -> list[Stage]:
    return [s for v in VARIANTS for s in STAGE_TABLE[v]]
