"""The operator spec: the one place a linear-attention variant is described.

An :class:`OpSpec` fixes the mathematics of a family (update rule, gate kind, chunk size)
and which per-call options the family accepts. An :class:`Options` value holds the
per-call switches (trace-time flags in the kernels). :class:`HeadMap` checks the
query/key heads against the value heads (GVA).

Recurrence denoted by a spec, per token t and value head h (S in R^{K x V}, K-first):

    gate   none:   S <- S
           scalar: S <- exp(g[t, h]) * S                 (g: [.., HV], natural log)
           key:    S <- diag(exp(g[t, h, :])) @ S          (g: [.., HV, K])
           value:  S <- S @ diag(exp(g[t, h, :]))          (g: [.., HV, V]; fla's gv)
    rule   additive: S <- S + k v^T
           delta:    S <- S + k (beta (v - S^T k))^T
           comba:    S <- exp(g) S_prev + k (beta (v - S_prev^T p))^T   (S_prev before the gate)
           gdn2:     S <- S + k (w . v - S^T (b . k))^T
           dplr:     S <- D S_prev + b (a^T S_prev) + k v^T                (D the gate's decay)
    output o = S^T (scale * q)

With ``state_v_first`` the state is stored transposed ([.., V, K]); the maths is the same.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass, field

from .family import GATES, RULES, GateMaths, RuleMaths


class SpecError(ValueError):
    """A spec, option set or shape that cannot describe a valid operator."""


class Rule(str, enum.Enum):
    ADDITIVE = "additive"   # S += k v^T            (GLA, linear attention)
    DELTA = "delta"         # S += k (beta (v - S^T k))^T   (DeltaNet, GDN, KDA)
    COMBA = "comba"         # S = e^g S + k (beta (v - S^T p))^T, S before the decay (Comba)
    GDN2 = "gdn2"           # S = (I - k (b . k)^T) S_a + k (w . v)^T   (GDN-2)
    DPLR = "dplr"           # S = D S + b (a^T S) + k v^T   (DPLR, IPLR, RWKV-7)

    @property
    def maths(self) -> RuleMaths:
        """The rule's object (dsl/family.py): its inputs and the value it writes."""
        return RULES[self.value]


class Gate(str, enum.Enum):
    """A gate is declared by what it decays: the state axis its log decay runs along
    (:attr:`channels`): none (scalar gate, the whole state alike), "K" (rows: one decay
    per key channel) or "V" (columns: one per value channel). The per-step decay is
    exp(g) broadcast over the axes g does not index."""
    NONE = "none"       # no decay
    SCALAR = "scalar"   # one log decay per value head and token: g [.., HV]
    KEY = "key"         # one log decay per key channel: g [.., HV, K]
    VALUE = "value"     # one log decay per value channel: g [.., HV, V] (fla's gv)

    @property
    def maths(self) -> GateMaths:
        """The gate's object (dsl/family.py): its channels, g's shape, its decay."""
        return GATES[self.value]

    @property
    def channels(self) -> str:
        """The state axis g runs along: "" (one decay per head, or no gate), "K" or "V"."""
        return self.maths.channels

    @property
    def per_key(self) -> bool:
        return self.channels == "K"

    @property
    def per_value(self) -> bool:
        return self.channels == "V"

    def n_channels(self, K: int, V: int) -> int:
        """Decays per value head and token (1 for the scalar gate)."""
        return self.maths.n_channels(K, V)


class StateLayout(str, enum.Enum):
    K_FIRST = "k_first"   # [N, HV, K, V]
    V_FIRST = "v_first"   # [N, HV, V, K]


#: option name -> what it needs from the spec (checked in OpSpec.__post_init__)
OPTION_NAMES = ("l2norm_qk", "beta_sigmoid", "allow_neg_eigval", "gate_in_kernel",
                "state_v_first")


@dataclass(frozen=True)
class Options:
    """Per-call switches. Each is a trace-time flag of the generated kernels.

    l2norm_qk:        q, k <- x * rsqrt(sum x^2 + 1e-6) inside the kernel
    beta_sigmoid:     beta <- sigmoid(beta) inside the kernel
    allow_neg_eigval: beta <- 2 * sigmoid(beta) (requires beta_sigmoid)
    gate_in_kernel:   g <- -exp(A_log) * softplus(g + dt_bias) inside the kernel
    state_v_first:    states are [N, HV, V, K] instead of [N, HV, K, V]
    """
    l2norm_qk: bool = False
    beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    gate_in_kernel: bool = False
    state_v_first: bool = False

    def __post_init__(self):
        for name in OPTION_NAMES:
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"option {name} must be a bool, got {getattr(self, name)!r}")
        if self.allow_neg_eigval and not self.beta_sigmoid:
            raise SpecError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                            "(beta becomes 2 * sigmoid(beta))")

    @property
    def layout(self) -> StateLayout:
        return StateLayout.V_FIRST if self.state_v_first else StateLayout.K_FIRST

    def enabled(self) -> tuple[str, ...]:
        return tuple(n for n in OPTION_NAMES if getattr(self, n))

    def key(self) -> str:
        return "-".join(self.enabled()) or "plain"


@dataclass(frozen=True)
class HeadMap:
    """H query/key heads shared by HV value heads; value head h reads key head h // (HV // H)."""
    H: int
    HV: int

    def __post_init__(self):
        if not (isinstance(self.H, int) and isinstance(self.HV, int)) or self.H < 1 or self.HV < 1:
            raise SpecError(f"head counts must be positive integers, got H={self.H!r}, HV={self.HV!r}")
        if self.HV % self.H != 0:
            raise SpecError(f"HV % H != 0: {self.HV} value heads cannot share {self.H} key heads "
                            "evenly (GVA needs HV to be a multiple of H)")

    @property
    def group(self) -> int:
        return self.HV // self.H

    def key_head(self, hv: int) -> int:
        return hv // self.group


@dataclass(frozen=True)
class OpSpec:
    """One operator family.

    name:        the op's name on the command line (``gdn``); also the generated folder
    rule, gate:  the recurrence (see the module docstring)
    chunk_size:  tokens per chunk of the chunked forms
    supports:    which :class:`Options` switches a call may turn on
    gva:         whether HV may exceed H
    default_scale: "rsqrt_k" (K ** -0.5, fla's default) or a number
    decay:       a log decay per value head fixed by the spec (gate "scalar" only): an
                 expression in h (the value head, 0-based) and H (the value heads), e.g.
                 RetNet's "log(1 - 2**(-5 - h))"; g is then not a call input, every token
                 of head h decays by exp(decay(h, H)) (:meth:`head_decay`); it may also
                 use ``layer`` and ``layers`` (the call's layer index and layer count: a
                 decay fixed per head and layer, lightning attention's "-8 * h / H * (1 -
                 layer / layers)") and ``slope(h, H)`` (ALiBi's head slopes,
                 :func:`alibi_slope`: MiniMax's and the lightning-attention paper's form)
    step:        "dt": the call passes a step dt [B, T, HV] and the kernel forms
                 dt <- clamp(softplus?(dt + dt_bias), dt_limit) and the scalar gate
                 g = A dt (A [HV] <= 0) from it (Mamba-2's discretization)
    value_scale: "dt": the value written is scaled per token by that step, v <- dt v
    skip:        o <- o + D v (the raw value; D [HV] or [HV, V]): a skip term
    output_gate: "silu": o <- o * silu(z), z [B, T, HV, V] (after the skip term)
    """
    name: str
    rule: Rule
    gate: Gate
    chunk_size: int = 64
    supports: frozenset = field(default_factory=frozenset)
    gva: bool = True
    default_scale: object = "rsqrt_k"
    doc: str = ""
    decay: str = ""
    step: str = ""
    value_scale: str = ""
    skip: bool = False
    output_gate: str = ""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise SpecError(f"spec name must be an identifier, got {self.name!r}")
        object.__setattr__(self, "rule", _coerce(Rule, self.rule, "rule"))
        object.__setattr__(self, "gate", _coerce(Gate, self.gate, "gate"))
        object.__setattr__(self, "supports", frozenset(self.supports))
        unknown = self.supports - set(OPTION_NAMES)
        if unknown:
            raise SpecError(f"unknown options {sorted(unknown)}; valid: {list(OPTION_NAMES)}")
        if self.chunk_size not in (16, 32, 64):
            raise SpecError(f"chunk_size must be 16, 32 or 64, got {self.chunk_size}")
        if self.gate is Gate.NONE and "gate_in_kernel" in self.supports:
            raise SpecError(f"{self.name}: gate_in_kernel needs a gate (gate is 'none')")
        if self.rule is Rule.COMBA and self.gate not in (Gate.NONE, Gate.SCALAR):
            raise SpecError(f"{self.name}: the comba rule takes gate 'none' or 'scalar' "
                            f"(fla's chunk_comba), got {self.gate.value!r}")
        if self.rule is Rule.GDN2 and self.gate is not Gate.KEY:
            raise SpecError(f"{self.name}: the gdn2 rule takes gate 'key' (fla's chunk_gdn2), "
                            f"got {self.gate.value!r}")
        if self.rule is Rule.GDN2 and ({"beta_sigmoid", "allow_neg_eigval"} & self.supports):
            raise SpecError(f"{self.name}: the gdn2 rule has no beta (its gates are b and w)")
        if self.rule is Rule.DPLR and (self.gate not in (Gate.NONE, Gate.KEY) or (
                {"beta_sigmoid", "allow_neg_eigval", "gate_in_kernel", "l2norm_qk"}
                & self.supports)):
            raise SpecError(f"{self.name}: the dplr rule takes gate 'none' (IPLR) or 'key' "
                            f"(DPLR) and options state_v_first only (fla's), got gate "
                            f"{self.gate.value!r}, options {sorted(self.supports)}")
        if self.rule is Rule.DELTA and self.gate.per_value:
            raise SpecError(f"{self.name}: gate 'value' needs the additive rule; the delta "
                            "rule supports gate 'none', 'scalar' or 'key'")
        if self.rule is Rule.ADDITIVE and ({"beta_sigmoid", "allow_neg_eigval"} & self.supports):
            raise SpecError(f"{self.name}: beta options need the delta rule (rule is 'additive')")
        if "allow_neg_eigval" in self.supports and "beta_sigmoid" not in self.supports:
            raise SpecError(f"{self.name}: allow_neg_eigval needs beta_sigmoid")
        if not (self.default_scale == "rsqrt_k" or
                (isinstance(self.default_scale, (int, float)) and self.default_scale > 0)):
            raise SpecError(f"default_scale must be 'rsqrt_k' or a positive number, "
                            f"got {self.default_scale!r}")
        if self.decay:
            _check_decay(self, _decay_expr(self))
        _check_call_terms(self)
        object.__setattr__(self, "_content_hash", self._compute_hash())

    # -- derived facts -------------------------------------------------------------------
    @property
    def has_beta(self) -> bool:
        return "beta" in self.rule.maths.inputs

    @property
    def has_gate(self) -> bool:
        return self.gate.maths.takes_input

    def scale_for(self, K: int, scale=None) -> float:
        """The scale a call uses: the given one, else the spec's default."""
        if scale is None:
            return K ** -0.5 if self.default_scale == "rsqrt_k" else float(self.default_scale)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            got = repr(scale) if isinstance(scale, (int, float)) else type(scale).__name__
            raise SpecError(f"scale must be a positive number, got {got}")
        return float(scale)

    def check_options(self, options: Options) -> Options:
        bad = [n for n in options.enabled() if n not in self.supports]
        if bad:
            raise SpecError(f"{self.name} does not support {bad}; it supports "
                            f"{sorted(self.supports) or 'no options'}")
        return options

    def check_heads(self, H: int, HV: int) -> HeadMap:
        hm = HeadMap(H, HV)
        if not self.gva and HV != H:
            raise SpecError(f"{self.name} has no GVA: value heads ({HV}) must equal heads ({H})")
        return hm

    @property
    def gate_is_input(self) -> bool:
        """Whether a call passes g (a gate, and not one the spec fixes by ``decay``)."""
        return self.has_gate and not self.decay

    def head_decay(self, HV: int, layer: int = None, layers: int = None) -> list:
        """The fixed per-step log decay of each of HV value heads (spec ``decay``; a decay
        that depends on the layer needs ``layer`` and ``layers``)."""
        if not self.decay:
            raise SpecError(f"{self.name} fixes no decay (its gate is a call input)")
        if self.layer_decay and (layer is None or layers is None):
            raise SpecError(f"{self.name}: its decay depends on the layer: give layer and "
                            "layers")
        return _head_decays(self, _decay_expr(self), HV, layer, layers)

    @property
    def layer_decay(self) -> bool:
        """Whether the spec's fixed decay depends on the layer (uses layer / layers)."""
        return bool(self.decay) and bool(_decay_layer_symbols(self.decay))

    def gate_shape(self, B: int, T: int, HV: int, K: int, V: int = None) -> tuple:
        """Shape of g for this spec ((), for no gate): [B, T, HV] plus the gate's channel
        axis (K for the key gate, V for the value gate; V is then required)."""
        if self.gate.per_value and V is None:
            raise SpecError(f"{self.name}: a value gate's shape needs V")
        return self.gate.maths.shape(B, T, HV, K, V)

    # -- identity ------------------------------------------------------------------------
    def as_dict(self) -> dict:
        out = {"name": self.name, "rule": self.rule.value, "gate": self.gate.value,
               "chunk_size": self.chunk_size, "supports": sorted(self.supports),
               "gva": self.gva, "default_scale": self.default_scale}
        out = dict(out, decay=self.decay) if self.decay else out
        return dict(out, **_call_terms(self))

    @property
    def key(self) -> str:
        """Readable identity: ``gdn_delta_scalar_c64``."""
        return f"{self.name}_{self.rule.value}_{self.gate.value}_c{self.chunk_size}"

    @property
    def hash(self) -> str:
        """Content hash of everything that shapes generated code (not the doc); computed
        once (a spec is frozen), so a traced call (torch.compile) reads a constant."""
        return self._content_hash

    def _compute_hash(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **kw) -> "OpSpec":
        return dataclasses.replace(self, **kw)


def _decay_expr(spec: "OpSpec"):
    """The spec's decay as a function f(h, H) (sympy-parsed; SpecError for a malformed
    expression, other symbols than h and H, or a gate other than "scalar")."""
    if not isinstance(spec.decay, str):
        raise SpecError(f"{spec.name}: decay must be an expression string in h and H, got "
                        f"{type(spec.decay).__name__}")
    if spec.gate is not Gate.SCALAR or "gate_in_kernel" in spec.supports:
        raise SpecError(f"{spec.name}: decay fixes a scalar gate: it needs gate 'scalar' "
                        f"without gate_in_kernel, got gate {spec.gate.value!r}")
    import sympy
    from sympy.utilities.lambdify import implemented_function
    h, H, layer, layers = sympy.symbols("h H layer layers")
    slope = implemented_function("slope", lambda hh, HH: alibi_slope(int(hh), int(HH)))
    try:
        expr = sympy.sympify(spec.decay, locals={"h": h, "H": H, "layer": layer,
                                                 "layers": layers, "slope": slope})
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise SpecError(f"{spec.name}: decay {spec.decay!r} is not an expression: "
                        f"{type(e).__name__}") from None
    allowed = (h, H, layer, layers)
    extra = sorted(str(x) for x in getattr(expr, "free_symbols", ()) if x not in allowed)
    if extra:
        raise SpecError(f"{spec.name}: decay may use h and H only (and layer, layers: a "
                        f"decay by layer), got {extra}")
    return sympy.lambdify(allowed, expr, "math")


def _decay_layer_symbols(decay: str) -> set:
    """The layer symbols (layer, layers) a decay expression names."""
    import re
    return set(re.findall(r"\b(layers?)\b", decay)) if isinstance(decay, str) else set()


def alibi_slope(h: int, H: int) -> float:
    """ALiBi's slope of head h of H (lightning attention's decay rate before its layer
    factor): 2^(-8 (h + 1) / H) for H a power of two; otherwise the slopes of the power of
    two P below H, then every other slope of 2P."""
    import math
    P = 1 << (H.bit_length() - 1)
    if P == H:
        return 2.0 ** (-8.0 * (h + 1) / H)
    return alibi_slope(h, P) if h < P else alibi_slope(2 * (h - P), 2 * P)


#: head counts a fixed decay is checked at when its spec is made (every head of each)
DECAY_CHECK_HEADS = range(1, 65)


def _check_decay(spec: "OpSpec", f) -> None:
    """SpecError unless the decay is a finite log decay <= 0 at every head h < H of every H
    in DECAY_CHECK_HEADS: a per-step factor exp(decay) <= 1 (a larger one grows the state
    without bound; the log's sign is the rule, as for g)."""
    if not _decay_layer_symbols(spec.decay):
        for H in DECAY_CHECK_HEADS:
            _head_decays(spec, f, H)
        return
    for layers in DECAY_CHECK_LAYERS:
        for layer in range(layers):
            for H in DECAY_CHECK_LAYER_HEADS:
                _head_decays(spec, f, H, layer, layers)


#: layer counts (every layer of each) and head counts a layer-dependent decay is checked at
DECAY_CHECK_LAYERS = (1, 2, 3, 24)
DECAY_CHECK_LAYER_HEADS = (1, 6, 8, 12, 64)


def _head_decays(spec: "OpSpec", f, H: int, layer=None, layers=None) -> list:
    """f(h, H) for h < H as floats; SpecError at the first head that is not a finite log
    decay <= 0 (or where the expression is undefined)."""
    out = []
    at = "" if layers is None else f", layer={layer}, layers={layers}"
    for h in range(H):
        try:
            x = float(f(h, H, layer, layers))
        except (ArithmeticError, ValueError, TypeError) as e:
            raise SpecError(f"{spec.name}: decay {spec.decay!r} is undefined at h={h}, "
                            f"H={H}{at} ({type(e).__name__}: {e})") from None
        if not (x <= 0.0 and x > float("-inf")):
            raise SpecError(f"{spec.name}: decay {spec.decay!r} must be a finite log decay "
                            f"<= 0 (a per-step factor exp(decay) <= 1; a larger one grows "
                            f"the state), got {x} at h={h}, H={H}{at}")
        out.append(x)
    return out


def _coerce(enum_cls, value, what):
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(repr(e.value) for e in enum_cls)
        raise SpecError(f"unknown {what} {value!r}; valid: {valid}") from None


def all_rule_gate_specs(chunk_size: int = 64) -> list[OpSpec]:
    """The six rule x gate combinations of the none / scalar / key gates, each with every
    option its maths allows.

    Used by tests and by the generator's coverage check: every combination must flow
    through the references and the generator, not just the four named families. The
    value gate (additive only) is :func:`value_gate_spec`.
    """
    out = []
    for rule in (Rule.ADDITIVE, Rule.DELTA):
        for gate in (Gate.NONE, Gate.SCALAR, Gate.KEY):
            sup = {"l2norm_qk", "state_v_first"}
            if rule is Rule.DELTA:
                sup |= {"beta_sigmoid", "allow_neg_eigval"}
            if gate is not Gate.NONE:
                sup |= {"gate_in_kernel"}
            out.append(OpSpec(name=f"{rule.value}_{gate.value}", rule=rule, gate=gate,
                              chunk_size=chunk_size, supports=frozenset(sup)))
    return out


def value_gate_spec(chunk_size: int = 64) -> OpSpec:
    """The additive rule with the per-value-channel gate (fla's GLA with ``gv``), with
    every option its maths allows; the tests' counterpart of all_rule_gate_specs."""
    return OpSpec(name="additive_value", rule=Rule.ADDITIVE, gate=Gate.VALUE,
                  chunk_size=chunk_size,
                  supports=frozenset({"l2norm_qk", "state_v_first", "gate_in_kernel"}))


def key_twin(spec: OpSpec) -> OpSpec:
    """The key-gated spec whose state is a value-gated spec's transposed, T = S^T [V, K]:
    T <- diag(exp(g)) T + v k^T, keys v and values k. Every term of
    L = sum(o * do) + <S_T, dS_T> (o = S^T (scale q)) is sum_{j <= i} (q_i . k_j)
    (do_i . v_j e^{G_i - G_j}) and its state forms, multilinear in (q, k, v, do); swapping
    (q, k, v, do) -> (do, v, k, q) and the state axes turns the value gate's into the key
    gate's. So a value-gated call's backward is the twin's (q', k', v', do') =
    (do, v, k, q) with the states transposed: the twin's dk', dv', dg, dh0' are dv, dk, dg,
    dh0^T, and dq = dL/d(do') is the twin's forward output o' (dsl/additive_bwd.py
    value_gate_backward; ops/additive_bwd.py). q' = do has HV heads: the twin has no GVA
    (k, q are taken at HV heads)."""
    if not spec.gate.per_value:
        raise SpecError(f"{spec.name}: key_twin is the value gate's (gate is {spec.gate.value!r})")
    return OpSpec(name=f"{spec.name}_twin", rule=Rule.ADDITIVE, gate=Gate.KEY,
                  chunk_size=spec.chunk_size, supports=frozenset({"state_v_first"}),
                  gva=False, doc=f"{spec.name}'s transposed state, for its backward "
                  "(dsl.spec.key_twin).")


#: the call-level terms a spec may add around its recurrence (OpSpec fields -> allowed values)
CALL_TERMS = {"step": ("", "dt"), "value_scale": ("", "dt"), "skip": (False, True),
              "output_gate": ("", "silu")}


def _call_terms(spec: "OpSpec") -> dict:
    """The spec's call-level terms that differ from the defaults (its identity's part)."""
    return {n: getattr(spec, n) for n, allowed in CALL_TERMS.items()
            if getattr(spec, n) != allowed[0]}


def _check_call_terms(spec: "OpSpec") -> None:
    """SpecError unless step, value_scale, skip and output_gate are valid for the spec: the
    step forms a scalar gate (the additive rule; no g, decay or gate_in_kernel beside it),
    the value scale needs the step; skip and output_gate need the additive rule."""
    for n, allowed in CALL_TERMS.items():
        if getattr(spec, n) not in allowed or type(getattr(spec, n)) is not type(allowed[0]):
            raise SpecError(f"{spec.name}: {n} must be one of {list(allowed)}, got "
                            f"{getattr(spec, n)!r}")
    if spec.step and (spec.gate is not Gate.SCALAR or spec.decay
                      or "gate_in_kernel" in spec.supports):
        raise SpecError(f"{spec.name}: step 'dt' forms the scalar gate g = A dt: it needs "
                        "gate 'scalar' without decay or gate_in_kernel")
    if spec.value_scale and not spec.step:
        raise SpecError(f"{spec.name}: value_scale 'dt' scales by the step: it needs step 'dt'")
    if (spec.step or spec.skip or spec.output_gate) and spec.rule is not Rule.ADDITIVE:
        raise SpecError(f"{spec.name}: step, skip and output_gate need the additive rule "
                        f"(rule is {spec.rule.value!r})")


def comba_specs(chunk_size: int = 64) -> list[OpSpec]:
    """The comba rule with no and with a scalar gate, with every option its maths allows;
    the tests' counterpart of all_rule_gate_specs for Comba."""
    out = []
    for gate in (Gate.NONE, Gate.SCALAR):
        sup = {"l2norm_qk", "state_v_first", "beta_sigmoid", "allow_neg_eigval"}
        if gate is not Gate.NONE:
            sup |= {"gate_in_kernel"}
        out.append(OpSpec(name=f"comba_{gate.value}", rule=Rule.COMBA, gate=gate,
                          chunk_size=chunk_size, supports=frozenset(sup)))
    return out


def gdn2_spec(chunk_size: int = 64) -> OpSpec:
    """The gdn2 rule with the per-key gate and every option its maths allows."""
    return OpSpec(name="gdn2_key", rule=Rule.GDN2, gate=Gate.KEY, chunk_size=chunk_size,
                  supports=frozenset({"l2norm_qk", "state_v_first", "gate_in_kernel"}))


def dplr_specs(chunk_size: int = 64) -> list[OpSpec]:
    """The dplr rule without a gate (IPLR) and with the per-key gate (DPLR, RWKV-7)."""
    return [OpSpec(name=f"dplr_{g.value}", rule=Rule.DPLR, gate=g, chunk_size=chunk_size,
                   supports=frozenset({"state_v_first"})) for g in (Gate.NONE, Gate.KEY)]
