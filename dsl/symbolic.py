"""The sympy reference: the recurrence built symbolically from the spec, for tiny sizes.

Independent of :mod:`~linattn.dsl.preprocess` and of every hand-written backward: each
option is written here again as a formula (l2norm x / sqrt(sum x^2 + 10^-6), sigmoid
1 / (1 + exp(-b)) (times 2 with allow_neg_eigval), fla's softplus as a Piecewise at
threshold 20, the gate -exp(A_log) softplus(g + dt_bias), the scale), and gradients of

    L = sum(o * do) + sum(ht * dht)

come from sympy differentiation. Two ways, both from the same token map
(S_prev, raw token inputs, A_log, dt_bias) -> (S, o):

* ``method="steps"`` (default, any T): sympy differentiates the token map once per
  structure (its full Jacobian), the Jacobians are evaluated at each token and chained
  in reverse (L's gradient by the chain rule over the token sequence);
* ``method="full"`` (T <= 3): the whole of L is built as one sympy expression over all
  tokens and differentiated w.r.t. every raw input directly. Slow; used to check "steps".

Expressions are compiled with ``lambdify(cse=True)`` and cached per structure (spec,
options, sizes, scale, which inputs are present); numeric inputs are evaluated in fp64.
Sizes: K, V <= 3, and keep H, HV tiny (H = 1, HV in {1, 2} in the tests).
"""
from __future__ import annotations

import functools

import numpy as np
import sympy as sp

from .preprocess import check_call, state_from_k_first, state_to_k_first
from .spec import OpSpec, Options, SpecError

MAX_DIM, MAX_T_FULL = 3, 3
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")        # one row per token
SHARED_INPUTS = ("A_log", "dt_bias")                # shared by all tokens


def _sym_array(name, shape):
    """An object ndarray of fresh real symbols name_i_j..."""
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        out[idx] = sp.Symbol(name + "_" + "_".join(map(str, idx)), real=True)
    return out


def _input_symbols(spec, H, HV, K, V, prefix=""):
    """Symbols of one token's raw inputs and of the shared gate parameters."""
    tok = dict(q=_sym_array(prefix + "q", (H, K)), k=_sym_array(prefix + "k", (H, K)),
               v=_sym_array(prefix + "v", (HV, V)))
    if spec.has_gate:
        tok["g"] = _sym_array(prefix + "g", (HV, spec.gate.n_channels(K, V))
                              if spec.gate.channels else (HV,))
    if spec.has_beta:
        tok["beta"] = _sym_array(prefix + "b", (HV,))
    return tok


def _shared_symbols(spec, options, HV, K, V, has_dt_bias):
    shared = {}
    if spec.has_gate and options.gate_in_kernel:
        shared["A_log"] = _sym_array("A", (HV,))
        if has_dt_bias:
            shared["dt_bias"] = _sym_array("dt", (HV * spec.gate.n_channels(K, V),))
    return shared


# -- the spec's formulas, written once more ---------------------------------------------------

def _l2norm(x):
    r = 1 / sp.sqrt(sum(e * e for e in x) + sp.Rational(1, 10 ** 6))
    return [e * r for e in x]


def _softplus(x):
    return sp.Piecewise((x, x > 20), (sp.log(1 + sp.exp(x)), True))


def _token_update(spec, options, scale, S, tok, shared):
    """One token for every value head: S list of [K, V] Matrices -> (new S list, o list)."""
    HV, H, K, V = len(S), tok["q"].shape[0], tok["q"].shape[1], tok["v"].shape[1]
    new_S, outs = [], []
    for hv in range(HV):
        h = hv // (HV // H)
        q, k = list(tok["q"][h]), list(tok["k"][h])
        if options.l2norm_qk:
            q, k = _l2norm(q), _l2norm(k)
        q = sp.Matrix([scale * e for e in q])
        k = sp.Matrix(k)
        v = sp.Matrix(list(tok["v"][hv]))
        if spec.has_gate:                          # decays rows (K) or columns (V)
            n = V if spec.gate.per_value else K
            raw = list(tok["g"][hv]) if spec.gate.channels else [tok["g"][hv]] * n
            if options.gate_in_kernel:
                bias = [0] * n
                if "dt_bias" in shared:
                    bias = [shared["dt_bias"][hv * n + c if spec.gate.channels else hv]
                            for c in range(n)]
                raw = [-sp.exp(shared["A_log"][hv]) * _softplus(raw[c] + bias[c])
                       for c in range(n)]
            D = sp.diag(*[sp.exp(x) for x in raw])
            S_hv = spec.gate.maths.decay_matrix(S[hv], D)
        else:
            S_hv = S[hv]
        beta = None
        if spec.has_beta:
            beta = tok["beta"][hv]
            if options.beta_sigmoid:
                beta = (2 if options.allow_neg_eigval else 1) / (1 + sp.exp(-beta))
        v = spec.rule.maths.write(v, beta, lambda: S_hv.T * k)
        S_hv = S_hv + k * v.T
        new_S.append(S_hv)
        outs.append(list(S_hv.T * q))
    return new_S, outs


def _state_symbols(HV, K, V):
    sym = _sym_array("S", (HV, K, V))
    return sym, [sp.Matrix(K, V, lambda i, j, h=h: sym[h, i, j]) for h in range(HV)]


def _flat(arrays):
    return [e for a in arrays for e in np.asarray(a, dtype=object).ravel()]


# -- method "steps": the token map and its Jacobian ---------------------------------------------

@functools.lru_cache(maxsize=None)
def _compiled_step(spec, options, H, HV, K, V, scale, has_dt_bias):
    tok = _input_symbols(spec, H, HV, K, V)
    shared = _shared_symbols(spec, options, HV, K, V, has_dt_bias)
    S_sym, S = _state_symbols(HV, K, V)
    new_S, outs = _token_update(spec, options, scale, S, tok, shared)
    xs = _flat([S_sym] + list(tok.values()) + list(shared.values()))
    ys = [e for m in new_S for e in m] + _flat(outs)
    jac = sp.Matrix(ys).jacobian(xs)
    fn = sp.lambdify([xs], ys + list(jac), modules="numpy", cse=True)
    layout = [("S", S_sym.shape)] + [(n, a.shape) for n, a in tok.items()] + \
             [(n, a.shape) for n, a in shared.items()]
    return fn, layout, len(ys), len(xs)


def _evaluate(fn, x):
    """Run a lambdified function; both Piecewise branches are evaluated by NumPy, so the
    unused one may overflow (exp of a large softplus argument): silence only that."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(fn(x), dtype=np.float64)


def _split(vec, layout):
    out, pos = {}, 0
    for name, shape in layout:
        size = int(np.prod(shape))
        out[name] = vec[pos:pos + size].reshape(shape)
        pos += size
    return out


def _sequence_steps(spec, options, scale, vals, h0, do, dht):
    """One sequence by chained token Jacobians. vals: raw token inputs [L, ..] and shared
    parameters; h0, dht [HV, K, V]; do [L, HV, V]. Returns (o, ht, grads by input name)."""
    L, H, K = vals["q"].shape
    HV, V = vals["v"].shape[1:]
    fn, layout, ny, nx = _compiled_step(spec, options, H, HV, K, V, scale, "dt_bias" in vals)
    S, o, jacs = h0, np.zeros((L, HV, V)), []
    for t in range(L):
        x = np.concatenate([np.ravel(S)] + [np.ravel(vals[n][t]) for n, _ in layout[1:]
                                            if n in TOKEN_INPUTS] +
                           [np.ravel(vals[n]) for n, _ in layout if n in SHARED_INPUTS])
        res = _evaluate(fn, x)
        S = res[:HV * K * V].reshape(HV, K, V)
        o[t] = res[HV * K * V:ny].reshape(HV, V)
        jacs.append(res[ny:].reshape(ny, nx))
    grads = {n: np.zeros((L,) + shape) if n in TOKEN_INPUTS else np.zeros(shape)
             for n, shape in layout[1:]}
    dS = np.array(dht, dtype=np.float64)
    for t in reversed(range(L)):
        gx = _split(jacs[t].T @ np.concatenate([dS.ravel(), do[t].ravel()]), layout)
        dS = gx.pop("S")
        for n, gval in gx.items():
            if n in TOKEN_INPUTS:
                grads[n][t] = gval
            else:
                grads[n] += gval
    grads["initial_state"] = dS
    return o, S, grads


# -- method "full": all of L as one expression ---------------------------------------------------

@functools.lru_cache(maxsize=None)
def _compiled_full(spec, options, L, H, HV, K, V, scale, has_dt_bias):
    toks = [_input_symbols(spec, H, HV, K, V, prefix=f"t{t}") for t in range(L)]
    shared = _shared_symbols(spec, options, HV, K, V, has_dt_bias)
    S_sym, S = _state_symbols(HV, K, V)
    do, dht = _sym_array("do", (L, HV, V)), _sym_array("dht", (HV, K, V))
    outs = []
    for t in range(L):
        S, o_t = _token_update(spec, options, scale, S, toks[t], shared)
        outs.append(o_t)
    ht = [e for m in S for e in m]
    loss = sum(a * b for a, b in zip(_flat(outs), do.ravel())) + \
        sum(a * b for a, b in zip(ht, dht.ravel()))
    names = [n for n in toks[0]]
    wrt = [S_sym] + [np.stack([tk[n] for tk in toks]) for n in names] + list(shared.values())
    exprs = _flat(outs) + ht + [sp.diff(loss, s) for s in _flat(wrt)]
    args = _flat(wrt) + list(do.ravel()) + list(dht.ravel())
    fn = sp.lambdify([args], exprs, modules="numpy", cse=True)
    layout = [("S", S_sym.shape)] + [(n, (L,) + toks[0][n].shape) for n in names] + \
             [(n, a.shape) for n, a in shared.items()]
    return fn, layout


def _sequence_full(spec, options, scale, vals, h0, do, dht):
    L, H, K = vals["q"].shape
    HV, V = vals["v"].shape[1:]
    if L > MAX_T_FULL:
        raise SpecError(f"method='full' is for T <= {MAX_T_FULL} per sequence, got {L}")
    fn, layout = _compiled_full(spec, options, L, H, HV, K, V, scale, "dt_bias" in vals)
    x = np.concatenate([np.ravel(h0)] + [np.ravel(vals[n]) for n, _ in layout[1:]] +
                       [np.ravel(do), np.ravel(dht)])
    res = _evaluate(fn, x)
    o = res[:L * HV * V].reshape(L, HV, V)
    ht = res[L * HV * V:L * HV * V + HV * K * V].reshape(HV, K, V)
    grads = _split(res[L * HV * V + HV * K * V:], layout)
    grads["initial_state"] = grads.pop("S")
    return o, ht, grads


# -- public entry ---------------------------------------------------------------------------

def symbolic_reference(spec: OpSpec, q, k, v, g=None, beta=None, *, do=None, dht=None,
                       options: Options = Options(), scale=None, initial_state=None,
                       cu_seqlens=None, A_log=None, dt_bias=None, method="steps") -> dict:
    """Sympy-derived forward and gradients for tiny sizes (arguments as recurrent_backward).

    Returns dict(o [B, T, HV, V], final_state (the options' layout), and, when do is
    given, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias w.r.t. the raw inputs, None where
    not applicable). Each sequence (batch row, or cu_seqlens segment) is evaluated apart.
    """
    if method not in ("steps", "full"):
        raise SpecError(f"method must be 'steps' or 'full', got {method!r}")
    if spec.rule.maths.vector_inputs:
        raise SpecError(f"{spec.name}: the symbolic reference takes the additive and delta "
                        f"rules; the {spec.rule.value} rule's are dsl.recurrent and "
                        "dsl.torch_reference")
    dims = check_call(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    if max(dims.K, dims.V) > MAX_DIM:
        raise SpecError(f"symbolic reference is for tiny sizes (K, V <= {MAX_DIM}), "
                        f"got K={dims.K}, V={dims.V}")
    B, T, HV, K, V = dims.B, dims.T, dims.HV, dims.K, dims.V
    s = spec.scale_for(K, scale)
    raw = {n: np.asarray(x, dtype=np.float64) for n, x in
           dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias).items()
           if x is not None}
    if not options.gate_in_kernel:
        raw.pop("A_log", None), raw.pop("dt_bias", None)
    h0 = np.zeros((dims.N, HV, K, V)) if initial_state is None else \
        state_to_k_first(options, initial_state)
    do_arr = np.zeros((B, T, HV, V)) if do is None else np.asarray(do, dtype=np.float64)
    dht_kv = np.zeros((dims.N, HV, K, V)) if dht is None else state_to_k_first(options, dht)
    o, final = np.zeros((B, T, HV, V)), np.array(h0, dtype=np.float64)
    grads = {n: np.zeros_like(x) for n, x in raw.items()}
    dh0 = np.array(dht_kv, dtype=np.float64)
    run = _sequence_steps if method == "steps" else _sequence_full
    for seg in dims.segments:
        if seg.end == seg.start:
            continue
        rows = (seg.b, slice(seg.start, seg.end))
        vals = {n: (x[rows] if n in TOKEN_INPUTS else x) for n, x in raw.items()}
        o[rows], final[seg.n], gs = run(spec, options, s, vals, h0[seg.n], do_arr[rows],
                                        dht_kv[seg.n])
        dh0[seg.n] = gs.pop("initial_state")
        for n, gval in gs.items():
            if n in TOKEN_INPUTS:
                grads[n][rows] = gval
            else:
                grads[n] += gval.reshape(grads[n].shape)
    out = dict(o=o, final_state=state_from_k_first(options, final))
    if do is not None:
        for n, gname in dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", A_log="dA_log",
                             dt_bias="ddt_bias").items():
            out[gname] = grads.get(n)
        out["dh0"] = None if initial_state is None else state_from_k_first(options, dh0)
    return out
