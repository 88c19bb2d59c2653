"""The members of the family: an update rule and a gate, each one object that owns its
maths, so that a new member is one new object (and its macros, codegen/members.py).

One token's transition, per value head (S [K, V], K-first):

    S_a = gate.decay(S, exp(g))          the gate's decay: none, e^g S, diag(e^g) S, S diag(e^g)
    S   = S_a + k write^T                write = rule.write(v, beta, lambda: S_a^T k)
    o   = S^T (scale q)

A gate says which state axis its log decay g runs along (:attr:`GateMaths.channels`),
the shape of g, and how it decays a state; a rule says which per-token inputs it takes
beyond q, k, v (:attr:`RuleMaths.inputs`) and the value it writes. The fp64 references
(dsl/recurrent.py, chunked.py, torch_reference.py, preprocess.py, symbolic.py) take
these from the spec's members (``spec.rule.maths``, ``spec.gate.maths``) instead of
testing the rule and the gate; the generator renders the same members' macros
(codegen/templates/rules/<name>.py.jinja, gates/<name>.py.jinja).
"""
from __future__ import annotations


class RuleMaths:
    """An update rule: S = S_a + k write^T with write = :meth:`write`, in the generalized
    delta form S = (I - k e^T) S_a + k u^T: e the erase vector (:meth:`erase`, none for a
    rule that reads no state), u the written value (:meth:`written`), write = u - S_a^T e.

    name:   the rule's name (Rule's value; its macros' file, rules/<name>.py.jinja)
    inputs: per-token inputs beyond q, k, v, each [B, T, HV] (the delta rule's beta)
    reads_state: whether the write reads the state (S_a^T k): the chunked form then
            carries WY factors A, w, u (:meth:`chunk_factors`) and its state pass walks all
            of K at once; a rule that reads none has a diagonal transition (the state's
            rows independent: key blocks, and sequence segments summed exactly)
    """
    name = ""
    inputs: tuple = ()
    reads_state = False
    #: per-token vector inputs beyond q, k, v (by name; their axes: :attr:`vector_axes`):
    #: Comba's erase key p, GDN-2's erase gate b and write gate w
    vector_inputs: tuple = ()
    #: name -> (heads, channels) of a vector input: ("H", "K") a key of its own ([B, T, H,
    #: K], key heads, l2-normalised with l2norm_qk as q and k are, read in q's dtype);
    #: ("HV", "K") / ("HV", "V") a gate per value head and key / value channel (f32)
    vector_axes: dict = {}
    #: whether the write reads the decayed state S_a (else the state before the gate's
    #: decay, S_{t-1}: Comba's S_t = e^g S_{t-1} + k (beta (v - S_{t-1}^T p))^T)
    reads_decayed = True
    #: the input that scales the write (write's second argument): "beta", GDN-2's "w"
    #: (per value channel), "" for none
    scale_input = ""

    def read_key(self, k, x: dict):
        """The key the write reads the state through (k; Comba's p; GDN-2's b . k), from
        k and the token's vector inputs (``x``: name -> the effective tensor)."""
        return k

    def read_key_vjp(self, k, x: dict, dkey):
        """(dk, {name: d input}) from the gradient of :meth:`read_key`'s key."""
        return dkey, {}

    #: whether the rule writes its read back along a key of its own (:meth:`lift_key`)
    lifts = False
    #: the vector input that is the erase key in place of k (Comba's "p", a key of its
    #: own per key head; the chunked kernels read it as <name>_in, l2-normalised <name>n),
    #: "" for none
    erase_key = ""
    #: the gates whose generated chunked backward a rule with vector inputs trains through
    #: (the delta backward's stages taking its erase side from its macros: Comba's scalar
    #: gate, GDN-2's per-key gate); others train exactly in torch (ops/exact_train.py)
    backward_gates: tuple = ()

    @property
    def dtype_inputs(self) -> tuple:
        """The vector inputs the kernels read in their own dtype (f32 or q's; the gates
        per value head, GDN-2's b and w), as g and beta: a ``{name}_dtype`` each."""
        return tuple(n for n in self.vector_inputs if self.vector_axes[n][0] == "HV")

    def lift_key(self, k, x: dict):
        """The key the read r = S_read^T read_key is written back along, as a second
        rank-one term S += lift r^T (DPLR's b: S = D S + b (a^T S) + k v^T), or None where
        the read enters :meth:`write` (the delta forms: k (scale (v - r))^T)."""
        return None

    def lift_key_vjp(self, k, x: dict, dlift):
        """(dk, {name: d input}) from the gradient of :meth:`lift_key`'s key."""
        return dlift, {}

    def erase(self, k, beta):
        """The erase vector e (S_a^T e is what the write takes off), None for none; beta
        shaped to broadcast over k's key axis."""
        return None

    def written(self, v, beta):
        """The written value u before the erase (beta shaped to broadcast over v)."""
        return v

    def write(self, v, beta, read):
        """The value written, from v, beta (shaped to broadcast over v's value axis) and
        read(), which gives S_a^T k (numpy, torch and sympy callers alike)."""
        raise NotImplementedError

    def write_vjp(self, v, beta, read, dwrite):
        """(dv, dbeta summed over the value axis or None, d(read) or None: the gradient
        of S_a^T k where the rule reads the state) from dwrite, read = S_a^T k."""
        raise NotImplementedError

    def chunk_factors(self, k, v, beta, g_cum, dot):
        """The chunked form's factors of one chunk (all heads): (A, w, u), or None for a
        rule that reads no state. k [HV, L, K], v [HV, L, V], beta [HV, L], g_cum [HV, L,
        Kg] the in-chunk cumulative log decay, dot(a, b) the gated a b^T of two [HV, L, K]
        tiles (sum_c a_ic b_jc e^(g_cum_ic - g_cum_jc))."""
        raise NotImplementedError

    def new_values(self, v, w, u, S):
        """The chunked form's written values of a chunk from its factors w, u."""
        raise NotImplementedError

    def input_dims(self, B="B", T="T", HV="HV", H="H", K="K", V="V") -> list:
        """(name, shape) of each input (symbolic by default: ("B", "T", "HV")), the vector
        inputs after the per-token ones."""
        size = {"H": H, "HV": HV, "K": K, "V": V}
        return [(name, (B, T, HV)) for name in self.inputs] + [
            (name, (B, T) + tuple(size[a] for a in self.vector_axes[name]))
            for name in self.vector_inputs]


class AdditiveRule(RuleMaths):
    """S = S_a + k v^T (GLA, linear attention, retention)."""
    name = "additive"

    def write(self, v, beta, read):
        return v

    def write_vjp(self, v, beta, read, dwrite):
        return dwrite, None, None

    def chunk_factors(self, k, v, beta, g_cum, dot):
        return None

    def new_values(self, v, w, u, S):
        return v


class DeltaRule(RuleMaths):
    """S = S_a + k (beta (v - S_a^T k))^T (DeltaNet, GDN, KDA)."""
    name = "delta"
    inputs = ("beta",)
    reads_state = True
    scale_input = "beta"

    def erase(self, k, beta):
        return beta * k

    def written(self, v, beta):
        return beta * v

    def write(self, v, beta, read):
        return beta * (v - read())          # (= written(v) - S_a^T erase(k))

    def write_vjp(self, v, beta, read, dwrite):
        return beta * dwrite, (dwrite * (v - read)).sum(axis=-1), -beta * dwrite

    def chunk_factors(self, k, v, beta, g_cum, dot):
        """The WY form of (I - k e^T): A = (I + strict_tril(dot(e, k)))^-1, w = A (e e^g_cum),
        u = A written(v)."""
        import numpy as np
        L, b = k.shape[1], beta[:, :, None]
        e = self.erase(k, b)
        A = np.linalg.inv(np.eye(L) + dot(e, k) * np.tril(np.ones((L, L)), -1))
        return A, A @ (e * np.exp(g_cum)), A @ self.written(v, b)

    def new_values(self, v, w, u, S):
        return u - w @ S


class GateMaths:
    """A gate: what it decays (:attr:`channels`: "" the whole state alike, "K" its rows,
    "V" its columns), the shape of its log decay g, how it decays a state. The base
    decays the rows by a per-key-channel g (the key gate); the others override.

    name:          the gate's name (Gate's value; its macros' file, gates/<name>.py.jinja)
    axis:          the state axis whose channels decay apart ("K" rows, "V" columns; the
                   gates of one decay a head store theirs per row)
    inputs:        its per-token inputs (g, natural-log decays of :meth:`shape`)
    kernel_params: the parameters of its activation inside the kernel (gate_in_kernel:
                   g <- -exp(A_log) softplus(g + dt_bias))
    """
    name = ""
    channels = ""
    axis = "K"
    inputs: tuple = ("g",)
    kernel_params: tuple = ("A_log", "dt_bias")

    @property
    def takes_input(self) -> bool:
        """Whether a call passes g."""
        return bool(self.inputs)

    @property
    def per_key(self) -> bool:
        """Whether each key channel decays apart: the chunked form then gates q and k per
        channel in its prepare (q e^G, k e^(G_l - G), the causal A_qk) and sums the
        intra-chunk pairs per channel."""
        return self.channels == "K"

    def n_channels(self, K: int, V: int) -> int:
        """Decays per value head and token (1 for one per head)."""
        return {"K": K, "V": V}.get(self.channels, 1)

    def shape(self, B: int, T: int, HV: int, K: int, V: int) -> tuple:
        """g's shape: [B, T, HV] plus the channel axis ((): no g)."""
        if not self.takes_input:
            return ()
        return (B, T, HV) + ((self.n_channels(K, V),) if self.channels else ())

    def input_dims(self, B="B", T="T", HV="HV", K="K", V="V") -> list:
        """(name, shape) of each input (symbolic by default: g ("B", "T", "HV", "K"))."""
        return [(name, self.shape(B, T, HV, K, V)) for name in self.inputs]

    def per_channel(self, g):
        """g with its channel axis ([.., 1] for one decay per head)."""
        return g

    def decay(self, S, d):
        """The state S [.., K, V] decayed by d = exp(g) with its channel axis
        (:meth:`per_channel`)."""
        return d[..., :, None] * S

    def decay_matrix(self, S, D):
        """The same for one head's sympy matrices, D = diag(exp(g)) over the axis."""
        return D * S

    def key_decay(self, g):
        """g as a log decay per key channel [.., K] (None: the gate decays no rows)."""
        return g

    def value_decay(self, g):
        """g as a log decay per value channel [.., V] (None: the gate decays no columns)."""
        return None

    def dg_of(self, dg_key, dg_value):
        """dL/dg of the gate's g from the gradients of the per-key log decay dg_key
        [.., K] and of the per-value one dg_value [.., V] (the value gate's)."""
        return dg_key


class NoGate(GateMaths):
    """S_a = S."""
    name = "none"
    inputs = ()
    kernel_params = ()

    def decay(self, S, d):
        return S

    def decay_matrix(self, S, D):
        return S

    def key_decay(self, g):
        return None


class ScalarGate(GateMaths):
    """S_a = exp(g) S, one log decay per value head and token: g [.., HV]."""
    name = "scalar"

    def per_channel(self, g):
        return g[..., None]

    def key_decay(self, g):
        return g[..., None]

    def dg_of(self, dg_key, dg_value):
        return dg_key.sum(axis=-1)


class KeyGate(GateMaths):
    """S_a = diag(exp(g)) S, one per key channel: g [.., HV, K]."""
    name = "key"
    channels = "K"


class ValueGate(GateMaths):
    """S_a = S diag(exp(g)), one per value channel: g [.., HV, V] (fla's gv)."""
    name = "value"
    channels = "V"
    axis = "V"

    def decay(self, S, d):
        return S * d[..., None, :]

    def decay_matrix(self, S, D):
        return S * D

    def key_decay(self, g):
        return None

    def value_decay(self, g):
        return g

    def dg_of(self, dg_key, dg_value):
        return dg_value


class CombaRule(DeltaRule):
    """S = e^g S + k (beta (v - S^T p))^T (Comba; fla's chunk_comba): the delta rule whose
    erase key p differs from the write key k, reading the state before the token's decay
    (S the state after token t - 1). In the generalized form, the erase vector of S_a is
    beta e^-g p; the chunked factors read S through p with the exclusive decay:
    A = (I + strict_tril(beta_i p_i.k_j e^(G_i - g_i - G_j)))^-1, w = A (beta p e^(G - g))."""
    name = "comba"
    erase_key = "p"
    backward_gates = ("scalar",)
    vector_inputs = ("p",)
    vector_axes = {"p": ("H", "K")}
    reads_decayed = False

    def read_key(self, k, x: dict):
        return x["p"]

    def read_key_vjp(self, k, x: dict, dkey):
        return 0.0, {"p": dkey}


class Gdn2Rule(DeltaRule):
    """S = (I - k (b . k)^T) S_a + k (w . v)^T (GDN-2; fla's chunk_gdn2): the erase gate b
    per key channel, the write gate w per value channel, both per value head and token
    ([B, T, HV, K], [B, T, HV, V]); no beta (b = w = beta is KDA). The erase vector is
    b . k, the written value w . v; the chunked factors A = (I + strict_tril((b . k)_i
    .k_j e^(G_i - G_j)))^-1 (b inside the pair sums, per channel), w = A ((b . k) e^G),
    u = A (w . v)."""
    name = "gdn2"
    inputs = ()
    vector_inputs = ("b", "w")
    vector_axes = {"b": ("HV", "K"), "w": ("HV", "V")}
    scale_input = "w"
    backward_gates = ("key",)

    def erase(self, k, beta):
        raise NotImplementedError("gdn2: the erase vector is b . k (read_key)")

    def read_key(self, k, x: dict):
        return x["b"] * k

    def read_key_vjp(self, k, x: dict, dkey):
        return x["b"] * dkey, {"b": k * dkey}

    def write(self, v, w, read):
        return w * v - read()

    def write_vjp(self, v, w, read, dwrite):
        return w * dwrite, dwrite * v, -dwrite

    def chunk_factors(self, k, v, beta, g_cum, dot):
        raise NotImplementedError("gdn2: the chunked references are torch_reference's")


class DplrRule(RuleMaths):
    """S = D S + b (a^T S) + k v^T, D the gate's decay, both reads of the state before
    it (DPLR: fla's dplr_delta_rule, S_t = S_t (D_t + a_t b_t^T) + v_t k_t^T in its
    value-first words; IPLR without a gate; RWKV-7's r, w, k, v, a, b): a and b keys of
    their own per key head ([B, T, H, K]); the written value v itself; the read r = S^T a
    written back along b (:meth:`lift_key`). Its chunked form (torch_reference's
    _dplr_chunks) solves each chunk's reads r = w S + u by one triangular inverse
    (I - strict_tril(a . b))^-1 and writes along both b (r) and k (v)."""
    name = "dplr"
    vector_inputs = ("a", "b")
    vector_axes = {"a": ("H", "K"), "b": ("H", "K")}
    reads_state = True
    reads_decayed = False
    lifts = True

    def read_key(self, k, x: dict):
        return x["a"]

    def read_key_vjp(self, k, x: dict, dkey):
        return 0.0, {"a": dkey}

    def lift_key(self, k, x: dict):
        return x["b"]

    def lift_key_vjp(self, k, x: dict, dlift):
        return 0.0, {"b": dlift}

    def write(self, v, beta, read):
        return v

    def write_vjp(self, v, beta, read, dwrite):
        return dwrite, None, None

    def chunk_factors(self, k, v, beta, g_cum, dot):
        raise NotImplementedError("dplr: the chunked reference is torch_reference's")

    def new_values(self, v, w, u, S):
        raise NotImplementedError("dplr: the chunked reference is torch_reference's")


RULES = {r.name: r for r in (AdditiveRule(), DeltaRule(), CombaRule(), Gdn2Rule(),
                             DplrRule())}
GATES = {g.name: g for g in (NoGate(), ScalarGate(), KeyGate(), ValueGate())}
