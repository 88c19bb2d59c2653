"""The chunked (prefill) forward: the arch's plan for the call, run by ops.runtime.

    plan = forward_plan(spec, options, ...)       # codegen/arch/<arch>: stages, tiles, tensors
    print(plan)                                   # (also: linattn-gen --op gdn --plan ...)

Tokens live on one flat axis: a fixed-length batch [B, T] is viewed as B sequences of T
tokens laid end to end, exactly like a varlen batch with cu_seqlens = [0, T, 2T, ...].
Host-side tables (built from cu_seqlens_cpu when given, so no device sync) map each of
the NT chunks to its first token and valid length, each sequence to its chunks, and, for
a plan that splits sequences, each segment to its tokens and chunks. The plans
(codegen/arch/<arch>/forward.py, stages.py): the delta rule's walk (optionally split),
and the fused or three-stage prepare / state / output pipelines for the rest.

Supported: every rule x gate (DeltaNet, GDN, KDA, GLA and the other combinations); K, V
multiples of 16 up to 256 (V up to 512 with the additive rule: the arch's
chunk_head_limits); f16 / bf16 inputs.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections import OrderedDict

import numpy as np

from ..codegen.arch import DEFAULT_ARCH, get_arch
from ..codegen.pipeline import ForwardProblem
from ..dsl import Gate, OpSpec, Options, SpecError
from ..dsl.call_terms import terms_of
from . import runtime
from .chunk_split import build_segment_tables

SUPPORTED_GATES = (Gate.NONE, Gate.SCALAR, Gate.KEY, Gate.VALUE)


# -- host-side chunk tables ---------------------------------------------------------------

def build_chunk_tables(cu_seqlens, chunk_size: int = 64):
    """Chunk tables for sequences cu[n] .. cu[n+1] (a list or 1-D int array, cu[0] == 0).

    Returns int32 NumPy arrays:
      chunk_bos [NT]      first token (flat index) of each chunk
      chunk_len [NT]      valid tokens of each chunk, 1..chunk_size
      chunk_offsets [N+1] sequence n owns chunks chunk_offsets[n] .. chunk_offsets[n+1]
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise SpecError(f"cu_seqlens must start at 0 and be nondecreasing, got {cu.tolist()}")
    lens = np.diff(cu)
    counts = (lens + chunk_size - 1) // chunk_size
    offsets = np.concatenate([[0], np.cumsum(counts)])
    seq_of_chunk = np.repeat(np.arange(lens.size), counts)
    local = np.arange(offsets[-1]) - offsets[:-1][seq_of_chunk]
    bos = cu[:-1][seq_of_chunk] + local * chunk_size
    length = np.minimum(chunk_size, cu[1:][seq_of_chunk] - bos)
    return bos.astype(np.int32), length.astype(np.int32), offsets.astype(np.int32)


_TABLE_CACHE: OrderedDict = OrderedDict()
_TABLE_CACHE_SIZE = 64


def _cached(key, build):
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        _TABLE_CACHE.move_to_end(key)
        return hit
    out = build()
    _TABLE_CACHE[key] = out
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return out


def _to_device(named: dict, device) -> dict:
    """int32 NumPy arrays -> views of one device tensor (one copy, no sync)."""
    import torch
    host = np.concatenate([np.asarray(a, dtype=np.int32) for a in named.values()])
    dev = torch.from_numpy(host).to(device, non_blocking=True)
    out, at = {}, 0
    for name, a in named.items():
        out[name] = dev[at:at + len(a)]
        at += len(a)
    return out


def _device_tables(cu: tuple, chunk_size: int, device):
    """(cu32, chunk_bos, chunk_len, chunk_offsets) as int32 device tensors, cached by cu."""
    t = _tables(cu, chunk_size, device, 0)
    return t["cu_seqlens"], t["chunk_bos"], t["chunk_len"], t["chunk_offsets"]


def _tables(cu: tuple, chunk_size: int, device, seg_chunks: int) -> dict:
    """The host tables a plan reads (codegen.pipeline.PROVIDED), int32 on the device,
    cached by (cu, chunk size, segment length)."""
    def build():
        bos, length, offsets = build_chunk_tables(cu, chunk_size)
        named = dict(cu_seqlens=cu, chunk_bos=bos, chunk_len=length, chunk_offsets=offsets,
                     final_row=np.arange(len(cu) - 1))
        if seg_chunks:
            seg_cu, seg_c0, seq_seg = build_segment_tables(cu, seg_chunks, chunk_size)
            last = seq_seg[1:] - 1                      # every sequence owns a segment
            final = np.full(seg_cu.size - 1, -1)
            final[last] = np.arange(last.size)
            seq_of = np.repeat(np.arange(len(cu) - 1), np.diff(seq_seg))
            named.update(seg_cu=seg_cu, seg_c0=seg_c0, seq_seg_offsets=seq_seg,
                         map_seg=np.setdiff1d(np.arange(seg_cu.size - 1), last),
                         seg_final_row=final, seg_seq=seq_of, seg_first=seq_seg[seq_of])
        return _to_device(named, device)
    return _cached((cu, chunk_size, seg_chunks, str(device)), build)


def check_supported(spec: OpSpec) -> None:
    if spec.gate not in SUPPORTED_GATES:
        raise SpecError(f"{spec.name}: the chunked forward supports gates "
                        f"{[g.value for g in SUPPORTED_GATES]}, not {spec.gate.value!r} (yet)")


def stage_module(spec: OpSpec, stage: str, arch: str = DEFAULT_ARCH) -> types.ModuleType:
    """The generated module of chunked-forward ``stage`` for ``spec`` (ops.runtime loads
    it: the checked-in file, refused when stale; specs outside the registry rendered)."""
    check_supported(spec)
    return runtime.stage_module(spec, stage, arch)


def compiled_stage(spec: OpSpec, stage: str, arch: str = DEFAULT_ARCH, **params):
    """The compiled TileLang kernel of ``stage`` at ``params`` (memoised by ops.runtime)."""
    check_supported(spec)
    return runtime.compile_stage(spec, stage, arch, params)


# -- the plan -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=512)
def _plan(arch: str, problem: ForwardProblem, config: tuple = ()):
    try:
        return get_arch(arch).forward_plan(problem, config)
    except ValueError as e:
        raise SpecError(str(e)) from None


def forward_problem(spec: OpSpec, options: Options, *, H, HV, K, V, dtype, seq_chunks,
                    Ttot, g_dtype="float32", beta_dtype="float32", has_initial_state=False,
                    output_final_state=False, return_states=False,
                    save_states=False, states_only=False, rule_dtypes=(), terms=()) -> ForwardProblem:
    """The problem the arch plans for (sizes, dtypes and flags of one call; rule_dtypes:
    the rule's vector gates' ("b_dtype", "float32") pairs; terms: the call terms' flags on)."""
    return ForwardProblem(
        rule=spec.rule.value, gate=spec.gate.value, H=H, HV=HV, K=K, V=V, dtype=dtype,
        g_dtype=g_dtype, beta_dtype=beta_dtype, Ttot=Ttot, seq_chunks=tuple(seq_chunks),
        l2norm_qk=options.l2norm_qk, beta_sigmoid=options.beta_sigmoid,
        allow_neg_eigval=options.allow_neg_eigval, gate_in_kernel=options.gate_in_kernel,
        state_v_first=options.state_v_first, has_initial_state=bool(has_initial_state),
        output_final_state=bool(output_final_state), return_states=bool(return_states),
        save_states=bool(save_states), states_only=bool(states_only),
        chunk_size=spec.chunk_size, rule_dtypes=tuple(rule_dtypes), terms=tuple(sorted(terms)))


def forward_plan(spec: OpSpec, options: Options, arch: str = DEFAULT_ARCH, config=None,
                 **sizes):
    """The arch's plan (codegen.pipeline.Plan) of a call: forward_problem's keywords;
    config: a dict forcing choices (a probe's or test's variant, e.g. {"segments": 4})."""
    return _plan(arch, forward_problem(spec, options, **sizes), _config(config))


def _config(config) -> tuple:
    return tuple(sorted((config or {}).items()))


def plan_params(plan) -> dict:
    """stage -> build() params of a plan's launches (probes, precompiles, the backward)."""
    return {la.stage: la.kwargs for la in plan.launches}


# -- the forward ---------------------------------------------------------------------------

def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _check_device(name, t):
    if not t.is_cuda:
        from .validate import device_error
        raise device_error(name, t.device)
    if name == "q":
        runtime.device_arch(t.device)      # clear error on a GPU without linattn kernels


def _check_inputs(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu,
                  A_log, dt_bias):
    """The chunked forward's checks of a direct call (ops/validate.py); returns (dims, N)."""
    from . import validate as val
    dims = val.check_qkv(spec, q, k, v, dtypes=val.CHUNK_DTYPES)
    _, v_max = get_arch(runtime.arch_of(q.device)).chunk_head_limits(spec.rule.value,
                                                                       spec.gate.value)
    val.check_head_dims(dims.K, dims.V, k_multiple=16, k_max=256, v_multiple=16, v_max=v_max,
                        what="the chunked forward")
    val.check_gate(spec, g, dims, q)
    val.check_beta(spec, beta, dims, q)
    val.check_gate_params(spec, options, A_log, dt_bias, dims, q)
    N = val.check_cu_seqlens(cu_seqlens, dims.B, dims.T, cu_seqlens_cpu, q)
    if initial_state is not None:
        val.check_state("initial_state", initial_state, N, dims, options.state_v_first,
                        initial_state.dtype, q)
        if not initial_state.is_floating_point():
            raise SpecError(f"initial_state must be floating point, got {initial_state.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):      # the device check last
        _check_device(name, t)
    return dims, N


def chunk_forward(spec: OpSpec, q, k, v, g=None, beta=None, scale=None, initial_state=None,
                  output_final_state=False, options: Options = Options(), cu_seqlens=None,
                  cu_seqlens_cpu=None, A_log=None, dt_bias=None, return_states=False,
                  config=None, save_states=False):
    """Chunked forward of ``spec`` (fla's chunk_gated_delta_rule semantics).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (scalar gate, natural log; raw when
    options.gate_in_kernel), [B, T, HV, K] (per-key gate) or [B, T, HV, V] (per-value
    gate, additive rule); beta [B, T, HV] (delta rule);
    scale (default K^-0.5); initial_state [N, HV, K, V] ([N, HV, V, K] with
    state_v_first), any float dtype, read as f32; cu_seqlens [N+1] (B == 1) and
    cu_seqlens_cpu its CPU copy; A_log [HV], dt_bias [HV] ([HV * K] per-key gate,
    [HV * V] per-value gate).
    Returns (o [B, T, HV, V] in q's dtype, final_state f32 in the state layout or None).
    return_states=True (the GLAChunkFwd contract): a third result, states f32 [NT + N, HV,
    K, V] (or [..., V, K] with state_v_first): per sequence, the state entering each of its
    chunks, in order, then its final state (sequence n's rows start at chunk_offsets[n] +
    n); the final state returned is taken from those rows. save_states=True (training):
    a third result, the dict of what the plan keeps for the backward (Plan.saved): h
    [NT, HV, K, V] in q's dtype, K-first in either state layout: the state entering each
    chunk, sequence n's at rows chunk_offsets[n] .. (its chunks in order), as the kernels
    read it; the per-key gate's delta rule also A (the WY inverse) and aqk [Ttot, HV, 64]
    (input dtype). Inputs are never modified.
    config: forces plan choices (probes and tests; see codegen.arch.<arch> CONFIG_KEYS).
    Checks every argument (ops/validate.py), then :func:`run_chunk_forward`.
    """
    check_supported(spec)
    spec.check_options(options)
    _check_inputs(spec, options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu,
                  A_log, dt_bias)
    return run_chunk_forward(spec, q, k, v, g, beta, scale, initial_state, output_final_state,
                             options, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias,
                             return_states, config, save_states)


def run_chunk_forward(spec: OpSpec, q, k, v, g=None, beta=None, scale=None,
                      initial_state=None, output_final_state=False,
                      options: Options = Options(), cu_seqlens=None, cu_seqlens_cpu=None,
                      A_log=None, dt_bias=None, return_states=False, config=None,
                      save_states=False, rule_inputs=None, terms=None):
    """:func:`chunk_forward` on arguments already checked (its own checks, or the public
    call's ops/validate.py check_call: torch.library's chunk op, the training forward), so
    that a call is checked once. rule_inputs: the rule's vector inputs (GDN-2's b, w),
    name -> [B, T, H or HV, K or V], as ops/inputs.py kernel_inputs gives them. ``terms``: a
    spec's call terms formed in the kernels (dsl/call_terms.py), as
    recurrent.run_recurrent's: {"flags": the build() flags on, "tensors": step_A,
    step_bias, step_limit, skip_D, gate_z as the kernels read them}; g is then the raw
    step dt [B, T, HV] f32."""
    (B, T, H, K), (HV, V) = q.shape, v.shape[2:]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    arch = runtime.arch_of(q.device)
    Kk = get_arch(arch).chunk_k(spec.rule.value, spec.gate.value, K)
    if Kk != K:     # the kernels' K: zero channels up to it, the states cut back
        q, k, g, initial_state, dt_bias = _pad_k(spec, Kk, q, k, g, initial_state, dt_bias,
                                                 options.state_v_first)
        out = run_chunk_forward(spec, q, k, v, g, beta, spec.scale_for(K, scale),
                                initial_state, output_final_state, options, cu_seqlens,
                                cu_seqlens_cpu, A_log, dt_bias, return_states, config,
                                save_states, _pad_rule_inputs(spec, Kk, rule_inputs), terms)
        v_first = [options.state_v_first] * (1 + return_states)
        cut = tuple(_cut_k(t, K, vf) for t, vf in zip(out[1:], v_first))
        if save_states:
            cut += (dict(out[-1], h=_cut_k(out[-1]["h"], K, False)),)
        return (out[0],) + cut
    cu = _cu_tuple(B, T, cu_seqlens, cu_seqlens_cpu)
    x = _flat_inputs(spec, options, q, k, v, g, beta, A_log, dt_bias, B * T, HV, K)
    x.update({f"{n}_in": t.reshape(B * T, *t.shape[2:]).contiguous()
              for n, t in (rule_inputs or {}).items()})       # (the kernels' <input>_in)
    x.update(_term_tensors(spec, terms, q.device))
    C = spec.chunk_size
    problem = forward_problem(
        spec, options, H=H, HV=HV, K=K, V=V, dtype=_dtype_name(q), Ttot=B * T,
        seq_chunks=tuple(-(-(e - b) // C) for b, e in zip(cu, cu[1:])),
        g_dtype=_dtype_name(x["g"]), beta_dtype=_dtype_name(x["beta"]),
        has_initial_state=initial_state is not None,
        output_final_state=output_final_state, return_states=return_states,
        save_states=save_states, rule_dtypes=tuple(
            (f"{n}_dtype", _dtype_name(rule_inputs[n])) for n in spec.rule.maths.dtype_inputs),
        terms=[f for f, on in (terms or {}).get("flags", {}).items() if on])
    state_shape = (HV, V, K) if options.state_v_first else (HV, K, V)
    if B * T == 0:
        return _empty_result(q, B, T, HV, V, N, state_shape, initial_state,
                             output_final_state, return_states) + (
            ({"h": q.new_empty(0, HV, K, V)},) if save_states else ())
    plan = _plan(arch, problem, _config(config))
    x.update(_tables(cu, C, q.device, plan.segments))
    x["scale"] = float(spec.scale_for(K, scale))
    x["h0"] = (initial_state.to(torch_f32()).contiguous() if initial_state is not None
               else q.new_empty((1,) + state_shape, dtype=torch_f32()))
    NT = problem.NT
    rows = NT + N if return_states else N if output_final_state else 1
    x["ht"] = q.new_empty((rows,) + state_shape, dtype=torch_f32())
    x["o"] = q.new_empty(B * T, HV, V)
    runtime.run_plan(spec, plan, x)
    o = x["o"].reshape(B, T, HV, V)
    saved = ({n: x[n] for n in plan.saved},) if save_states else ()
    if not return_states:
        return (o, x["ht"] if output_final_state else None) + saved
    states = x["ht"]
    final = None
    if output_final_state:      # sequence n's last row: chunk_offsets[n + 1] + n (device side)
        import torch
        last = x["chunk_offsets"][1:].long() + torch.arange(N, device=q.device)
        final = states.index_select(0, last)
    return (o, final, states) + saved


def kernel_k(spec: OpSpec, K: int, device) -> int:
    """The head dim K the chunked kernels run a call of head dim K at on ``device`` (the
    arch's chunk_k): the public call pads to it once (ops/api.py); :func:`run_chunk_forward`
    pads a direct call's."""
    arch = runtime.arch_of(device)
    return get_arch(arch).chunk_k(spec.rule.value, spec.gate.value, K)


def _pad_k(spec, Kk, q, k, g, initial_state, dt_bias, v_first):
    """q, k, the per-key gate (and its dt_bias) and the initial state with zero channels
    K .. Kk: zero query / key channels leave the output, the l2norm and the state's real
    rows unchanged (the padded rows stay zero whatever their decay)."""
    import torch.nn.functional as F
    K = q.shape[-1]
    pad = (0, Kk - K)
    q, k = F.pad(q, pad), F.pad(k, pad)
    if spec.gate is Gate.KEY:
        g = F.pad(g, pad)
        if dt_bias is not None:
            dt_bias = F.pad(dt_bias.reshape(-1, K), pad).reshape(-1)
    if initial_state is not None:
        initial_state = F.pad(initial_state, pad if v_first else (0, 0) + pad)
    return q, k, g, initial_state, dt_bias


def _pad_rule_inputs(spec, Kk, rule_inputs):
    """The rule's vector inputs along K (GDN-2's b) with zero channels up to Kk."""
    import torch.nn.functional as F
    axes = spec.rule.maths.vector_axes
    return rule_inputs and {n: F.pad(t, (0, Kk - t.shape[-1])) if axes[n][1] == "K" else t
                            for n, t in rule_inputs.items()}


def _cut_k(t, K, v_first):
    """A state result of the padded call back to K channels."""
    return None if t is None else (t[..., :K] if v_first else t[..., :K, :]).contiguous()


def torch_f32():
    import torch
    return torch.float32


def _cu_tuple(B, T, cu_seqlens, cu_seqlens_cpu) -> tuple:
    if cu_seqlens is not None:   # values checked (on cu_seqlens_cpu when given)
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        return tuple(int(x) for x in host.tolist())
    return tuple(range(0, (B + 1) * T, T)) if T > 0 else (0,) * (B + 1)


def _flat_inputs(spec, options, q, k, v, g, beta, A_log, dt_bias, Ttot, HV, K) -> dict:
    """The call's inputs as the kernels read them: flat [Ttot, ...] views (copies only when
    not contiguous), placeholders of the right shape for what the spec lacks."""
    import torch
    f32 = dict(dtype=torch.float32, device=q.device)
    flat = lambda t, *tail: t.reshape(Ttot, *tail).contiguous()  # noqa: E731
    channels = spec.gate.n_channels(K, v.shape[3])      # g's last axis: 1, K or V
    x = dict(q=flat(q, q.shape[2], K), k=flat(k, k.shape[2], K), v=flat(v, HV, v.shape[3]))
    x["g"] = ((flat(g, HV, channels) if spec.gate.channels else flat(g, HV)) if spec.has_gate
              else torch.empty(Ttot, HV, **f32))
    x["beta"] = flat(beta, HV) if spec.has_beta else torch.empty(Ttot, HV, **f32)
    dt_len = HV * channels
    if options.gate_in_kernel:
        x["A_log"], x["dt_bias"] = A_log, dt_bias.reshape(dt_len)
    else:
        x["A_log"], x["dt_bias"] = torch.empty(HV, **f32), torch.empty(dt_len, **f32)
    return x


def _term_tensors(spec: OpSpec, terms, device) -> dict:
    """The call terms' kernel tensors (dsl/call_terms.py TermsMaths.chunk_params) of a
    spec that has them: the call's, runtime.placeholder for the rest."""
    import torch
    given = (terms or {}).get("tensors", {})
    return {n: given[n] if n in given else runtime.placeholder(device, torch.float32)
            for n in terms_of(spec).chunk_params}


def _empty_result(q, B, T, HV, V, N, state_shape, initial_state, output_final_state,
                  return_states):
    """No tokens: o is empty and each sequence's final state is its initial state."""
    import torch
    o = q.new_empty(B, T, HV, V)
    final = (initial_state.float().clone() if initial_state is not None
             else torch.zeros((N,) + state_shape, dtype=torch.float32, device=q.device))
    out = (o, final if output_final_state else None)
    return out + (final,) if return_states else out


# -- compiling ahead of time, in parallel (the GPU tests and the probe use it) ------------

def stage_jobs(jobs, arch: str = DEFAULT_ARCH) -> list:
    """(spec, stage, params) jobs as runtime.precompile's (spec, stage, arch, params)."""
    return [(spec, stage, arch, params) for spec, stage, params in jobs]


def precompile(jobs, workers=None, arch: str = DEFAULT_ARCH) -> list:
    """Compile (spec, stage, params) jobs in parallel processes (runtime.precompile of
    :func:`stage_jobs`); returns the error strings (empty when every job compiled)."""
    return runtime.precompile(stage_jobs(jobs, arch), workers)
