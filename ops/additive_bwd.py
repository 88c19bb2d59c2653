"""The additive rule's chunked backward (GLA, simple GLA, linear attention): the
GLAChunkBwd contract and training through chunk_gla / chunk_simple_gla /
chunk_linear_attn.

The kernels read the call's token-first tensors directly ([B, T, H, D] viewed as
[B * T, H, D]; a varlen batch is B == 1 with cu_seqlens, no padding): the arch's plan
(codegen/arch/<arch>/backward.py) runs

    chunk_bwd_dstate_local   X = scale (q e^G)^T do per chunk, into dstate
    chunk_bwd_dstate_scan    dh leaving each chunk = decay (.) dh leaving the next + X
    chunk_bwd_dqkvg          dq, dk, dv, dg per chunk (and key block above K = 128: dv,
                             a scalar gate's dg as f32 partials, summed here; dv
                             summed over the key blocks in f32 by the kernel; GVA:
                             dq, dk summed over a key head's value heads by the
                             kernel (a CTA walking the group, or f32 atomic
                             adds: see GVA below), dg per value head; a
                             spec's call terms: v' = x s formed where v is read, dx,
                             ds and dD's partials: dqkvg_terms)

over the states entering each chunk, laid out as GLAChunkFwd's h: per sequence n, row
offset_n + n + t holds the state entering its chunk t and row offset_n + n + NC_n its
final state (offset_n = the chunks of the sequences before it); dstate uses the same
rows. Host table: state_row [NT], the row of the state entering chunk c.

Training (:class:`AdditiveCall`, :func:`train`): the forward saves its inputs (q, k, v,
g, initial_state: references, no copies) and, where the arch's rule says so
(codegen/arch/<arch>/backward.py save_states: K V <= 64 x 64), the states entering its
chunks, which the three-stage forward writes in f32 anyway; otherwise the backward
recomputes them (the forward plan of the states alone, K-first: ForwardProblem.
states_only). Then the backward stages.

Memory. Held from forward to backward: the inputs, plus the states where saved,
(NT + N) x HV x K x V x 4 bytes (4 K V / 64 bytes a token and head: at K = V = 64 what
fla's chunk_gla keeps there, its A: f32, 4 x 64 bytes a token and head; fla also keeps
the gate's cumulative sum in g's place for an f32 g). During the backward: the states
(recomputed where not saved) and their gradients, f32, (NT + N) x HV x K x V x 4 bytes
each; the decays NT x HV x K x 4; the gradients (dg in f32; above K = 128 dv first in
f32, summed over the key blocks by atomic adds, 4 V bytes a token and head); and, only while states
are recomputed, that plan's buffers (per-key gate: k e^(G_l - G), w and h in the input
dtype, g_last in f32; h is not written). At [2, 16384, 4, 64] bf16: 34 MB of states kept,
34 MB of their gradients in the backward.

GVA (HV = group x H, group > 1) without a per-key gate (Mamba-2's): the plan's group
loop (codegen/arch/<arch>/backward.py _group_loop; :func:`group_sums` False): dqkvg's
CTA per (chunk, key head, key block) walks the group's value heads, sums dq, dk on chip
and stores them once in grad_dtype: no zeros, no cast, no atomic adds. Measured against
the atomic adds below in run s43-1 (H100, Mamba-2 training at the Nemotron-H-8B layer,
bench/ssd_probe.py): train-4096 2.020 -> 1.854 ms, train-8192 3.867 -> 3.590 ms.

GVA with a per-key gate, or where the loop's shared memory does not fit one CTA (sm80
at K = 128 with 16-bit states): dqkvg adds each value head's dq, dk into f32 [Ttot, H,
K] (zeroed here, cast to grad_dtype after; TileLang vectorizes the adds of the scalar /
no gate's fragments as pairs, AtomicAddx2, of the per-key gate's shared tiles as fours).
Bytes at Mamba-2's Nemotron-H layer (Ttot 4096, H 8, HV 128, K 128), the model that
first replaced torch's sum: before, dqkvg wrote dq, dk per value head in f32 (2 x 268
MB) and torch summed the group (those 537 MB read, 34 MB of f32 sums written and read,
17 MB of bf16 written: ~0.6 GB, reduce_kernel 0.20 ms in run s38); the adds: 34 MB of
zeros, the same 2 x 67 M f32 adds landing in L2 (a chunk's value heads are adjacent
CTAs, heads_fastest) with ~34 MB written back, and the cast (34 MB read, 17 written):
~0.12 GB instead of ~1.1 GB.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import numpy as np

from ..codegen.arch import DEFAULT_ARCH, get_arch
from ..codegen.pipeline import AdditiveBackwardProblem
from ..dsl import Gate, Options, SpecError, key_twin
from ..dsl.call_terms import terms_of
from . import chunk, exact_train, padding, runtime, split, validate
from .validate import needs_grad  # noqa: F401 (the families' test: additive_bwd.needs_grad)

CHUNK = 64
#: head dims the backward is generated and checked for (the chunked kernels' multiples
#: of 16, as the additive forward's; above K = 128 dqkvg runs in key blocks)
K_MAX, V_MAX = 256, 512


def state_rows(cu: tuple, device):
    """int32 [NT] on device: the row of the state entering each chunk (c + its sequence)."""
    def build():
        _, _, offsets = chunk.build_chunk_tables(cu, CHUNK)
        seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        return chunk._to_device({"state_row": np.arange(offsets[-1]) + seq}, device)
    return chunk._cached(("state_row", cu, str(device)), build)["state_row"]


@functools.lru_cache(maxsize=256)
def _plan(problem: AdditiveBackwardProblem, config: tuple, arch: str):
    try:
        return get_arch(arch).additive_backward_plan(problem, config)
    except ValueError as e:
        raise SpecError(str(e)) from None


def backward_plan(problem: AdditiveBackwardProblem, config=None, arch: str = DEFAULT_ARCH):
    """The arch's plan (codegen.pipeline.Plan) of a backward; config: a dict forcing
    choices (a probe's variant, e.g. {"scan_stages": 2}; None: :func:`backward_config`'s)."""
    return _plan(problem, tuple(sorted((config or _CONFIG).items())), arch)


#: the plan config of backwards called without one (probes: see backward_config)
_CONFIG: dict = {}


@contextlib.contextmanager
def backward_config(**config):
    """Within the block, backwards that pass no ``config`` (training through autograd:
    Mamba-2's, the additive families') take this plan config (the arch's
    BACKWARD_CONFIG_KEYS): lets a probe time a plan form on the public functions."""
    with runtime.overriding(_CONFIG, config):
        yield


def _name(dtype) -> str:
    return runtime.dtype_name(dtype)


def key_blocks(plan) -> int:
    """dqkvg's CTAs a chunk and head: > 1 when it sums dv over them in f32 (atomic adds into
    a zeroed buffer) and writes a scalar gate's dg as f32 partials per key block, [K /
    block_k, ...], which the host sums."""
    kw = _dqkvg_params(plan)
    return kw["K"] // kw.get("block_k", kw["K"])


def group_sums(plan) -> bool:
    """Whether dqkvg adds a GVA group's dq, dk by f32 atomic adds (into zeros the host
    allocates and casts after: a per-key gate's GVA, or where the plan's group loop does
    not fit); else it stores them in grad_dtype, per value head (HV == H) or the group's
    sums once (group_loop, the plan's choice for GVA otherwise: a CTA per key head walks
    its group)."""
    kw = _dqkvg_params(plan)
    return kw["HV"] > kw["H"] and not kw.get("group_loop")


def _dqkvg_params(plan) -> dict:
    return next(la.kwargs for la in plan.launches if la.stage == "chunk_bwd_dqkvg")


def run_backward(spec, q, k, v, g, states, do, dht, *, scale: float, cu: tuple,
                 want_dh0: bool, grad_dtype, config=None, raw_dv=False, terms=None):
    """The three stages on flat token-first tensors: q, k [Ttot, H, K], v, do
    [Ttot, HV, V] (f16 / bf16), g [Ttot, HV, K] (per-key gate) / [Ttot, HV] (scalar) /
    None, states [NT + N, HV, K, V] f32 or q's dtype (rows as the module docstring; dstate
    and the GEMMs' state operands follow), dht [N, HV, K, V]
    f32 or None (zero); cu the sequences' token bounds; config: the plan's (probes).
    Returns (dq, dk [Ttot, H, K], dv [Ttot, HV, V] in grad_dtype (raw_dv: as the kernel
    wrote it, f32 where the key blocks add it), dg f32 like g or None, dh0 [N, HV, K, V]
    f32 or None). terms: the call terms dqkvg forms ({"flags": the names on (value_scale,
    skip, skip_per_head), "tensors": dt_tok [Ttot, HV] f32, skip_D [HV] or [HV, V] f32}):
    v is then the raw value x, dv x's gradient (s dv' + D do), and the result has two
    more, ds [Ttot, HV] f32 (the value scale's) and dD [HV, V] f32 (do x summed over the
    tokens; None without skip)."""
    import torch
    Ttot, H, K = q.shape
    HV, V = v.shape[1:]
    arch = runtime.arch_of(q.device)
    if get_arch(arch).backward_dims(K, V) != (K, V):
        return _padded_backward(spec, q, k, v, g, states, do, dht, scale=scale, cu=cu,
                                want_dh0=want_dh0, grad_dtype=grad_dtype, config=config,
                                raw_dv=raw_dv, terms=terms)
    seq_chunks = tuple(-(-(e - b) // CHUNK) for b, e in zip(cu, cu[1:]))
    gated, scalar = spec.gate is not Gate.NONE, spec.gate is Gate.SCALAR
    problem = AdditiveBackwardProblem(
        gate=spec.gate.value, H=H, HV=HV, K=K, V=V, dtype=_name(q.dtype),
        g_dtype=_name(g.dtype) if gated else "float32", grad_dtype=_name(grad_dtype),
        seq_chunks=seq_chunks, use_dht=dht is not None, store_dh0=want_dh0,
        state_dtype=_name(states.dtype), terms=tuple(sorted((terms or {}).get("flags", ()))))
    plan = backward_plan(problem, config, arch)
    N, nkb = len(seq_chunks), key_blocks(plan)
    part = (nkb,) if nkb > 1 else ()            # a scalar gate's dg: partials
    f32 = dict(dtype=torch.float32, device=q.device)
    sums = group_sums(plan)     # dq, dk added by the kernel into zeroed f32 (else stored)
    dqk = dict(dtype=torch.float32 if sums else grad_dtype, device=q.device)
    new = torch.zeros if sums else torch.empty
    x = dict(chunk._tables(cu, CHUNK, q.device, 0), q=q, k=k, v=v, do=do, states=states,
             state_row=state_rows(cu, q.device), scale=float(scale),
             dht=dht if dht is not None else torch.empty(1, HV, K, V, **f32),
             dh0=torch.empty(N if want_dh0 else 1, HV, K, V, **f32),
             dq=new(Ttot, H, K, **dqk), dk=new(Ttot, H, K, **dqk),
             dv=(torch.zeros if part else torch.empty)(       # (key blocks: atomic adds)
                 Ttot, HV, V, dtype=torch.float32 if part else grad_dtype, device=q.device))
    if gated:
        x["g"] = g
        x["dg"] = torch.empty(*(part if scalar else ()), *g.shape, **f32)
    x.update(_dqkvg_terms(spec, problem, terms, nkb, q.device))
    if Ttot:
        runtime.run_plan(spec, plan, x)
    elif want_dh0:
        x["dh0"].copy_(dht if dht is not None else 0.0)
    dq, dk, dv, dg = x["dq"], x["dk"], x["dv"], x.get("dg")
    if part and scalar:
        dg = dg.sum(0)
    out = (dq.to(grad_dtype), dk.to(grad_dtype), dv if raw_dv else dv.to(grad_dtype), dg,
           x["dh0"] if want_dh0 else None)
    if terms is None:
        return out
    return out + (x["ds_part"].sum(0) if "value_scale" in problem.terms else None,
                  x["dD_part"].sum(0) if "skip" in problem.terms else None)


def _dqkvg_terms(spec, p: AdditiveBackwardProblem, terms, nkb: int, device) -> dict:
    """dqkvg's call-term tensors of a spec that has them (dsl/call_terms.py
    backward_params): the call's dt_tok and skip_D, its outputs ds_part [key blocks,
    Ttot, HV] and dD_part [NT, HV, V] (f32, every element written), placeholders for the
    terms off."""
    import torch
    given = (terms or {}).get("tensors", {})
    x = {n: runtime.placeholder(device, torch.float32)
         for n in terms_of(spec).backward_params}
    x.update({n: t for n, t in given.items() if n in x})
    f32 = dict(dtype=torch.float32, device=device)
    if "value_scale" in p.terms:
        x["ds_part"] = torch.empty(nkb, given["dt_tok"].shape[0], p.HV, **f32)
    if "skip" in p.terms:
        x["dD_part"] = torch.empty(p.NT, p.HV, p.V, **f32)
    return x


def _padded_backward(spec, q, k, v, g, states, do, dht, **kw):
    """run_backward at the kernels' head dims (the arch's backward_dims): zero channels in
    q, k, the per-key gate, v, do, the states and dht (exact: they add nothing to A, dA,
    the states' real rows or the real gradients), the gradients cut back to K, V."""
    import torch.nn.functional as F
    K, V = q.shape[-1], v.shape[-1]
    Kb, Vb = get_arch(runtime.arch_of(q.device)).backward_dims(K, V)
    q, k, g, _, _ = chunk._pad_k(spec, Kb, q, k, g, None, None, False)
    v, do = F.pad(v, (0, Vb - V)), F.pad(do, (0, Vb - V))
    grow = (0, Vb - V, 0, Kb - K)               # [.., K, V]: zero rows and columns
    states, dht = F.pad(states, grow), None if dht is None else F.pad(dht, grow)
    terms = kw.get("terms")
    if terms is not None and terms["tensors"].get("skip_D", v).dim() == 2:    # (D [HV, V])
        tensors = dict(terms["tensors"], skip_D=F.pad(terms["tensors"]["skip_D"], (0, Vb - V)))
        kw["terms"] = dict(terms, tensors=tensors)
    dq, dk, dv, dg, dh0, *more = run_backward(spec, q, k, v, g, states, do, dht, **kw)
    cut = lambda x: x[..., :K].contiguous()  # noqa: E731
    dg = cut(dg) if spec.gate is Gate.KEY else dg
    if more and more[1] is not None:
        more[1] = more[1][..., :V].contiguous()
    return (cut(dq), cut(dk), dv[..., :V].contiguous(), dg,
            None if dh0 is None else dh0[..., :K, :V].contiguous(), *more)


def check_backward(spec, q, k, v, what: str, multiple: int = 16) -> None:
    """One-line errors for what the backward kernels do not take (multiple: of K and V;
    training takes 1: its calls run zero-padded, :func:`train`)."""
    import torch
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or \
            v.dtype != q.dtype:
        raise SpecError(f"{what} needs q, k, v in one of float16 / bfloat16, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    K, V = q.shape[-1], v.shape[-1]
    if K % multiple or V % multiple or not (multiple <= K <= K_MAX and multiple <= V <= V_MAX):
        mult = f"a multiple of {multiple} " if multiple > 1 else ""
        raise SpecError(f"{what} is generated for K {mult}up to {K_MAX} and V {mult}up to "
                        f"{V_MAX}, got K={K}, V={V}")


def recompute_states(spec, q, k, v, g, h0, cu: tuple, scale: float, terms=None):
    """The states entering each chunk and the final ones, [NT + N, HV, K, V] K-first in
    q's dtype (the backward's GEMMs take them rounded so; fla keeps them so too),
    from flat q, k [Ttot, H, K], v [Ttot, HV, V], g (flat, or None), h0 [N, HV, K, V] f32
    K-first or None: the forward plan of the states alone (ForwardProblem.states_only: its
    prepare and state stages; no output, no per-chunk h of its own; the per-key gate's prepare
    forms kg and g_last only). terms: the step and the value scale formed in its kernels
    (chunk.run_chunk_forward's form; v the raw value x, g the raw step dt f32), or None."""
    import torch
    Ttot, H, K = q.shape
    HV, V = v.shape[1:]
    arch = runtime.arch_of(q.device)
    Kk = get_arch(arch).chunk_k(spec.rule.value, spec.gate.value, K)
    if Kk != K:     # the state pass's K: zero channels, cut back (as ops.chunk does)
        q, k, g, h0, _ = chunk._pad_k(spec, Kk, q, k, g, h0, None, False)
        return recompute_states(spec, q, k, v, g, h0, cu, scale, terms)[:, :, :K].contiguous()
    seq_chunks = tuple(-(-(e - b) // CHUNK) for b, e in zip(cu, cu[1:]))
    N, NT = len(seq_chunks), sum(seq_chunks)
    f32 = dict(dtype=torch.float32, device=q.device)
    key = spec.gate is Gate.KEY
    x = dict(q=q, k=k, v=v, g=g if g is not None else torch.empty(Ttot, HV, **f32),
             beta=torch.empty(Ttot, HV, **f32), A_log=torch.empty(HV, **f32),   # (unused)
             dt_bias=torch.empty(HV * K if key else HV, **f32))
    x.update(chunk._term_tensors(spec, terms, q.device))    # (a spec's call terms)
    problem = chunk.forward_problem(
        spec, Options(), H=H, HV=HV, K=K, V=V, dtype=_name(q.dtype), Ttot=Ttot,
        seq_chunks=seq_chunks, g_dtype=_name(x["g"].dtype), has_initial_state=h0 is not None,
        output_final_state=True, return_states=True, states_only=True,
        terms=[f for f, on in (terms or {}).get("flags", {}).items() if on])
    plan = chunk._plan(arch, problem, chunk._config({"fused": False}))
    x.update(chunk._tables(cu, CHUNK, q.device, 0), scale=float(scale),
             h0=h0 if h0 is not None else torch.empty(1, HV, K, V, **f32),
             ht=torch.empty(NT + N, HV, K, V, dtype=q.dtype, device=q.device))
    if Ttot == 0:
        return x["ht"].copy_(h0 if h0 is not None else 0.0)
    return runtime.run_plan(spec, plan, x)["ht"]


def _check(name, x, shape, dtype=None):
    if tuple(x.shape) != tuple(shape):
        raise SpecError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise SpecError(f"{name} must have dtype {dtype}, got {x.dtype}")


def _check_device(name, x):
    if not x.is_cuda:
        raise SpecError(f"{name} must be on a CUDA device, got {x.device}")


def gla_chunk_bwd(q, k, v, g, h, do, dht=None, scale=None, initial_state=None, config=None):
    """GLAChunkBwd: the gradients of sum(o * do) + sum(final_state * dht) for GLA's
    chunked forward started from the state h[:, 0].

    q, k, g [B, T, H, K] (g: natural-log decay per key channel, any float dtype), v, do
    [B, T, H, V] (q, k, v, do one dtype: f16 / bf16); h [B, NC + 1, H, K, V] f32 as
    GLAChunkFwd returns it (the state entering each chunk of 64, then the final state);
    dht [B, H, K, V] f32 or None (zero); scale None meaning K^-0.5. Returns (dq, dk, dg
    [B, T, H, K], dv [B, T, H, V]) as (dq, dk, dv, dg), all f32 (fla's float32 gradients),
    then dh0 [B, H, K, V] f32 when initial_state (the forward's, h[:, 0]) is given.
    Inputs are never modified. config: the backward plan's (probes)."""
    import torch
    from .registry import get_spec
    spec = get_spec("gla")        # (by name: the engine imports no family module)
    if q.dim() != 4:
        raise SpecError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = -(-T // CHUNK)
    check_backward(spec, q, k, v, "GLAChunkBwd")
    for name, x, shape in (("k", k, q.shape), ("g", g, q.shape), ("v", v, (B, T, H, V)),
                           ("do", do, (B, T, H, V))):
        _check(name, x, shape)
    _check("do", do, (B, T, H, V), q.dtype)
    _check("h", h, (B, NC + 1, H, K, V), torch.float32)
    if dht is not None:
        _check("dht", dht, (B, H, K, V), torch.float32)
    if initial_state is not None:
        _check("initial_state", initial_state, (B, H, K, V))
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("h", h), ("do", do)):
        _check_device(name, x)
    flat = lambda x: x.reshape(B * T, *x.shape[2:]).contiguous()  # noqa: E731
    cu = tuple(range(0, (B + 1) * T, T)) if T else (0,) * (B + 1)
    dq, dk, dv, dg, dh0 = run_backward(
        spec, flat(q), flat(k), flat(v), flat(g), h.contiguous().view(B * (NC + 1), H, K, V),
        flat(do), None if dht is None else dht.contiguous(),
        scale=spec.scale_for(K, scale), cu=cu, want_dh0=initial_state is not None,
        grad_dtype=torch.float32, config=config)
    out = tuple(x.view(B, T, *x.shape[1:]) for x in (dq, dk, dv, dg))
    return out + ((dh0,) if initial_state is not None else ())


# -- training ------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdditiveCall:
    """The non-tensor arguments of one differentiable chunk call of an additive-rule spec
    (chunk_gla, chunk_simple_gla, chunk_linear_attn)."""
    spec: object
    scale: float
    output_final_state: bool = False
    state_v_first: bool = False
    cu: tuple | None = None                 # host cu_seqlens (varlen) or None
    cu_seqlens: object = field(default=None, compare=False)      # device copy (forward)
    cu_seqlens_cpu: object = field(default=None, compare=False)
    save_states: bool = False       # the forward keeps its states (else the backward recomputes)


def run_forward(call: AdditiveCall, q, k, v, g, initial_state, terms=None):
    """(o, final_state or None, states or None) from the chunked forward; with
    call.save_states the three-stage plan's states, f32 [NT + N, HV, K, V] K-first (the
    forward runs K-first; a v-first initial / final state is transposed around it).
    terms: the spec's call terms formed in the kernels (chunk.run_chunk_forward's; v is
    then the raw value x, g the raw step dt [B, T, HV] f32, the states those of dt x).
    Tests replace this on the CPU."""
    import torch
    kw = dict(scale=call.scale, output_final_state=call.output_final_state,
              cu_seqlens=call.cu_seqlens, cu_seqlens_cpu=call.cu_seqlens_cpu)
    if not call.save_states:
        from . import api
        opts = Options(state_v_first=call.state_v_first)
        if terms is not None:
            return chunk.run_chunk_forward(call.spec, q, k, v, g, initial_state=initial_state,
                                           options=opts, terms=terms, **kw) + (None,)
        o, final = api.forward(call.spec, q, k, v, g, None, initial_state=initial_state,
                               options=opts, **kw)
        return o, final, None
    vf = call.state_v_first
    h0 = (initial_state.transpose(-1, -2).contiguous() if vf and initial_state is not None
          else initial_state)                # (the forward checks it is contiguous)
    if g is not None and g.dtype not in (torch.float32, q.dtype):
        g = g.float()
    run = chunk.chunk_forward if terms is None else functools.partial(
        chunk.run_chunk_forward, terms=terms)       # (terms: the call's checks done)
    o, final, states = run(call.spec, q, k, v, g, None, initial_state=h0,
                           return_states=True, **kw)
    if final is not None and vf:
        final = final.transpose(-1, -2).contiguous()
    return o, final, states


class ChunkAdditiveFunction:
    """Namespace of the autograd Function (built lazily so importing needs no torch)."""
    _fn = None

    @classmethod
    def apply(cls, call, q, k, v, g, initial_state):
        """q, k, v, g made contiguous here, once (differentiable copies where they are
        views): the Function keeps them for its backward, which would copy them again."""
        if cls._fn is None:
            cls._fn = _make_function()
        q, k, v = (x.contiguous() for x in (q, k, v))
        return cls._fn.apply(call, q, k, v, None if g is None else g.contiguous(),
                             initial_state)


def _make_function():
    import torch

    class _ChunkAdditive(torch.autograd.Function):
        @staticmethod
        def forward(ctx, call, q, k, v, g, initial_state):
            o, final, states = run_forward(call, q, k, v, g, initial_state)
            ctx.call = call
            ctx.save_for_backward(q, k, v, g, initial_state, states)  # inputs (+ states)
            ctx.set_materialize_grads(False)
            return o, final

        @staticmethod
        def backward(ctx, do, dht):
            grads = additive_backward(ctx.call, *ctx.saved_tensors, do, dht)
            return (None, *(x if need else None
                            for x, need in zip(grads, ctx.needs_input_grad[1:])))

    return _ChunkAdditive


def additive_backward(call: AdditiveCall, q, k, v, g, initial_state, states, do, dht,
                      raw_dv=False, terms=None):
    """Gradients of a chunk call under sum(o * do) + sum(final_state * dht): q, k
    [B, T, H, K], v [B, T, HV, V] (f16 / bf16), g as the spec's gate or None,
    initial_state [N, HV, K, V] ([N, HV, V, K] with state_v_first) or None; states the
    forward's (f32 [NT + N, HV, K, V] K-first) or None (recomputed); do like v (any float
    dtype) or None, dht like the final state or None (zero). Returns (dq, dk, dv, dg,
    dh0) in the inputs' shapes and dtypes (None for an input not given); raw_dv: dv as
    the kernels leave it (f32 where dqkvg's key blocks add it: no cast; ops/terms.py's
    call reads it so). terms: the call terms dqkvg forms (:func:`dqkvg_terms`; v the raw
    value x, the states' recompute scaling it by torch): dv is x's gradient, and ds
    [B * T, HV], dD [HV, V] (or None) f32 follow dh0 (run_backward's)."""
    import torch
    if call.spec.gate.per_value:
        return value_gate_backward(call, q, k, v, g, initial_state, do, dht)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    cu = call.cu or (tuple(range(0, (B + 1) * T, T)) if T else (0,) * (B + 1))
    flat = lambda x: x.detach().reshape(B * T, *x.shape[2:]).contiguous()  # noqa: E731
    k_first = lambda s: s.transpose(-1, -2) if call.state_v_first else s  # noqa: E731
    gk = None
    if g is not None:
        gk = flat(g if g.dtype in (torch.float32, q.dtype) else g.float())
    h0 = None if initial_state is None else k_first(initial_state.detach()).float().contiguous()
    qf, kf, vf = flat(q), flat(k), flat(v)
    if states is None:
        states = _recompute(call, qf, kf, vf, gk, h0, cu, terms, flat)
    dof = torch.zeros_like(vf) if do is None else flat(do.to(q.dtype))
    dhtk = None if dht is None else k_first(dht.detach()).float().contiguous()
    dq, dk, dv, dg, dh0, *more = run_backward(
        call.spec, qf, kf, vf, gk, states, dof, dhtk, scale=call.scale, cu=cu,
        want_dh0=h0 is not None, grad_dtype=q.dtype, raw_dv=raw_dv, terms=terms)
    shaped = lambda x, like: x.view(like.shape).to(like.dtype)  # noqa: E731
    dg = None if g is None else shaped(dg, g)
    if dh0 is not None:
        dh0 = (dh0.transpose(-1, -2) if call.state_v_first else dh0).to(initial_state.dtype)
    dv = dv.view(v.shape) if raw_dv else shaped(dv, v)
    return (shaped(dq, q), shaped(dk, k), dv, dg, dh0, *more)


def _recompute(call: AdditiveCall, q, k, v, g, h0, cu: tuple, terms, flat):
    """recompute_states for additive_backward: with dqkvg's terms v is x, so v' = x s is
    formed by the recompute's kernels from the raw step (terms["recompute"]: the forward's
    formed terms and the raw dt, as run_forward took them), or is the forward's own
    (terms["value"], where kept), else formed by torch."""
    import torch
    rec = (terms or {}).get("recompute")
    if rec is not None:
        return recompute_states(call.spec, q, k, v, flat(rec[1]), h0, cu, call.scale, rec[0])
    if (terms or {}).get("value") is not None:
        return recompute_states(call.spec, q, k, flat(terms["value"]), g, h0, cu, call.scale)
    if terms is not None and "value_scale" in terms["flags"]:
        v = torch.mul(v, terms["tensors"]["dt_tok"].unsqueeze(-1), out=torch.empty_like(v))
    return recompute_states(call.spec, q, k, v, g, h0, cu, call.scale)


def dqkvg_terms(call: AdditiveCall, q, s, D, formed=None):
    """The call terms dqkvg forms in a training backward (run_backward's ``terms``): the
    value scale by s [B, T, HV] f32 (None: none), the skip term by D [HV] or [HV, V]
    (None: none); None where the arch's dqkvg does not form them (its DQKVG_TERMS), the
    spec's kernels take no terms or its gate is per value (the twin's backward). formed:
    (the forward kernels' terms, the raw dt) where run_forward formed them: the states'
    recompute forms the step and v' = x s from them too (its "recompute")."""
    arch = get_arch(runtime.arch_of(q.device))
    flags, tensors = [], {}
    if s is not None:
        flags.append("value_scale")
        tensors["dt_tok"] = s.detach().float().reshape(-1, s.shape[-1]).contiguous()
    if D is not None:
        Dm = D.detach().float().reshape(D.shape[0], -1)
        flags += ["skip"] + (["skip_per_head"] if Dm.shape[1] == 1 else [])
        tensors["skip_D"] = (Dm[:, 0] if Dm.shape[1] == 1 else Dm).contiguous()
    if (not flags or set(flags) - set(getattr(arch, "DQKVG_TERMS", ()))
            or not terms_of(call.spec).backward_params or call.spec.gate.per_value):
        return None
    out = {"flags": tuple(sorted(flags)), "tensors": tensors}
    if formed is not None:      # (the output's terms dropped: the recompute has no output)
        off = ("skip", "skip_per_head", "output_gate")
        out["recompute"] = ({"flags": {f: on for f, on in formed[0]["flags"].items()
                                       if f not in off},
                             "tensors": {n: t for n, t in formed[0]["tensors"].items()
                                         if n not in ("skip_D", "gate_z")}}, formed[1])
    return out


def value_gate_backward(call: AdditiveCall, q, k, v, g, initial_state, do, dht):
    """additive_backward of a value-gated spec through its key-gated twin
    (dsl.spec.key_twin; dsl/additive_bwd.py value_gate_backward): the twin's chunked
    forward of (q', k', v') = (do, v, k) from h0 is dq and writes the states (the value
    gate's, transposed: the twin's K-first state is the value gate's V-first one), then
    the twin's backward of do' = q over them gives dv, dk, dg, dh0 as its dk', dv', dg,
    dh0'. q, k are taken at HV heads (the twin has no GVA) and their gradients summed
    over each group. Arguments and result as additive_backward."""
    import torch
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    group, twin = HV // H, key_twin(call.spec)
    cu = call.cu or (tuple(range(0, (B + 1) * T, T)) if T else (0,) * (B + 1))
    wide = lambda x: x.detach().repeat_interleave(group, dim=2)  # noqa: E731
    flat = lambda x: x.reshape(B * T, *x.shape[2:]).contiguous()  # noqa: E731
    twin_first = lambda s: s if call.state_v_first else s.transpose(-1, -2)  # noqa: E731
    gv = g.detach() if g.dtype in (torch.float32, q.dtype) else g.detach().float()
    h0 = (None if initial_state is None
          else twin_first(initial_state.detach()).float().contiguous())
    dof = torch.zeros_like(v) if do is None else do.detach().to(q.dtype)
    qw, kw = wide(q), wide(k)
    dq, _, states = chunk.chunk_forward(
        twin, dof, v.detach(), kw, gv, None, scale=call.scale, initial_state=h0,
        cu_seqlens=call.cu_seqlens, cu_seqlens_cpu=call.cu_seqlens_cpu, return_states=True)
    dht_t = None if dht is None else twin_first(dht.detach()).float().contiguous()
    _, dv, dk, dg, dh0 = run_backward(twin, flat(dof), flat(v.detach()), flat(kw), flat(gv),
                                      states, flat(qw), dht_t, scale=call.scale, cu=cu,
                                      want_dh0=h0 is not None, grad_dtype=q.dtype)
    fold = lambda x: x.float().view(B, T, H, group, K).sum(3).to(q.dtype)  # noqa: E731
    if dh0 is not None:
        dh0 = twin_first(dh0).to(initial_state.dtype)
    return (fold(dq), fold(dk.view(B, T, HV, K)), dv.view(v.shape).to(v.dtype),
            dg.view(g.shape).to(g.dtype), dh0)


def check_trainable(spec, options: Options, q, k, v, g, initial_state, cu_seqlens,
                    A_log=None) -> None:
    """Raise SpecError for what the backward does not support (never a wrong gradient)."""
    what = f"the {spec.name} backward"
    spec.check_options(options)
    if options.gate_in_kernel and A_log is None:
        raise SpecError("use_gate_in_kernel=True needs A_log")
    if q.dim() != 4 or v.dim() != 4 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise SpecError(f"{what} needs q, k [B, T, H, K] and v [B, T, HV, V], got "
                        f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, H, K = q.shape
    spec.check_heads(H, v.shape[2])
    check_backward(spec, q, k, v, what, multiple=1)
    if spec.gate.per_value and v.shape[-1] > K_MAX:
        raise SpecError(f"{what} (its key-gated twin's K is V) is generated for V up to "
                        f"{K_MAX}, got V={v.shape[-1]}")
    want = spec.gate_shape(B, T, v.shape[2], K, v.shape[-1])
    if (g is None) != (not want) or (g is not None and tuple(g.shape) != want):
        raise SpecError(f"{what} needs g {list(want) or 'None'}, got "
                        f"{None if g is None else tuple(g.shape)}")
    if cu_seqlens is not None and B != 1:
        raise SpecError(f"cu_seqlens needs B == 1, got B={B}")
    runtime.check_training(q.device, spec.rule.value, spec.gate.value, what)


def _effective(spec, options: Options, q, k, g, A_log, dt_bias):
    """The l2norm of q, k and the gate's activation -exp(A_log) softplus(g + dt_bias)
    (f32), by torch, so that torch.autograd differentiates them (a user spec's options;
    the kernels then run without them)."""
    from ..dsl.torch_reference import l2norm
    from . import gates
    if options.l2norm_qk:
        q, k = (l2norm(x.float()).to(x.dtype) for x in (q, k))
    if options.gate_in_kernel:
        g = gates.activate(g, A_log, dt_bias, per_channel=bool(spec.gate.channels))
    return q, k, g


def train(spec, options: Options, q, k, v, g, scale, initial_state, output_final_state,
          cu_seqlens, cu_seqlens_cpu, A_log=None, dt_bias=None):
    """A differentiable chunk call of an additive-rule spec: checked, then the autograd
    Function (l2norm and the gate activation, where the spec has them, by torch before
    it). Returns (o, final_state or None)."""
    if exact_train.is_float32(q):
        return exact_train.train(spec, options, q, k, v, g, None, scale=scale,
                                 initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias)
    if split.wide_keys(spec, options, q):      # (every argument checked before the blocks)
        validate.check_call(spec, options, q, k, v, g, None, initial_state=initial_state,
                            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                            scale=scale, values=validate.host_checks())

        def block(q, k, g, initial_state, scale):
            return train(spec, options, q, k, v, g, scale, initial_state, output_final_state,
                         cu_seqlens, cu_seqlens_cpu)
        return split.by_key_blocks(spec, block, q, k, g, initial_state, scale,
                                   options.state_v_first)
    check_trainable(spec, options, q, k, v, g, initial_state, cu_seqlens, A_log)
    q, k, g = _effective(spec, options, q, k, g, A_log, dt_bias)
    K, V, vf = q.shape[-1], v.shape[-1], options.state_v_first
    scale = spec.scale_for(K, scale)
    Kp, Vp = (padding.round_up(d, 16) for d in (K, V))    # (zero channels: exact)
    q, k, v, g, _, initial_state = padding.pad_heads(spec.gate.channels, vf, K, V, Kp, Vp,
                                                     q, k, v, g, None, initial_state)
    call = _call(spec, vf, q, v, scale, output_final_state, cu_seqlens, cu_seqlens_cpu)
    return padding.unpad(vf, K, V, *ChunkAdditiveFunction.apply(call, q, k, v, g,
                                                                initial_state))


def _call(spec, v_first, q, v, scale, output_final_state, cu_seqlens, cu_seqlens_cpu):
    """The AdditiveCall of a checked call (q, v at the kernels' head dims; scale the
    spec's resolved one)."""
    cu = None
    if cu_seqlens is not None:
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        cu = tuple(int(x) for x in host.tolist())
    return AdditiveCall(spec=spec, scale=scale, output_final_state=bool(output_final_state),
                        state_v_first=v_first, cu=cu, cu_seqlens=cu_seqlens,
                        cu_seqlens_cpu=cu_seqlens_cpu,
                        save_states=get_arch(runtime.arch_of(q.device)).save_states(
                            q.shape[-1], v.shape[-1])
                        and not spec.gate.per_value)    # (its twin's forward writes them)


def training_call(spec, options: Options, q, k, v, g, scale, initial_state,
                  output_final_state, cu_seqlens, cu_seqlens_cpu=None):
    """The checked AdditiveCall of a call the kernels take as it is (16-bit q, k, v; K up
    to the key block, K and V multiples of 16; no l2norm or gate activation in torch),
    for an autograd Function that runs run_forward / additive_backward between terms of
    its own (ops/terms.py); None where :func:`train`'s other forms are needed."""
    K, V = q.shape[-1], v.shape[-1]
    if (exact_train.is_float32(q) or split.wide_keys(spec, options, q) or K % 16 or V % 16
            or options.l2norm_qk or options.gate_in_kernel):
        return None
    check_trainable(spec, options, q, k, v, g, initial_state, cu_seqlens)
    return _call(spec, options.state_v_first, q, v, spec.scale_for(K, scale),
                 output_final_state, cu_seqlens, cu_seqlens_cpu)
