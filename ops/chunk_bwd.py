"""The chunked delta-rule backward: generated stages over token-first packed tensors.

Every tensor the stages read or write is token-first and packed, [Ttot, heads, D], cut
into chunks by the forward's tables (ops.chunk._tables: chunk_bos / chunk_len per chunk,
cu_seqlens / chunk_offsets per sequence), so one set of kernels serves

  - training (ops/autograd.py): the call's own [B, T, H, D] tensors and packed varlen,
    no relayout and no padding; q, k read at key head h // (HV / H) (GVA); the per-value-
    head dq, dk are summed over a key head's value heads after the stages;
  - the DeltaNetChunkBwd contract: head-first [B, H, L, D] is token-first [B H L, 1, D]
    with one one-head sequence per (b, h) (:func:`one_head`).

The stages of the scalar and the per-key gate (grid):
    chunk_bwd_dv_local  (NT, HV)        dv_local = tril_incl(q k^T)^T do (gated forms: the
                                        decays; per-key: the recompute's A_qk^T do)
    chunk_bwd_dh        (N HV, V/BV)    the reverse sequential pass per sequence: dh per
                                        chunk, dv2 = dv_local + k dh (the gradient of v_new)
    chunk_bwd_dqkw      (NT, HV)        v_new = u - w S, dq, dk (output and state terms),
                                        dw = -dv2 S^T (S: the forward's states, chunk t's
                                        at S[state_row[t]])
    chunk_bwd_wy        (NT, HV)        back through A, w, u: dk (complete), dv, dbeta and,
                                        gated, dg (the reverse cumulative sum in the kernel)

Without a gate, the folded form (the arch's FOLD_STAGES): the dh pass's step is affine in
dh, so its dh-free parts (dh_local = q^T do - w^T dv_local, the operator -(w^T k)) are
formed per chunk by chunk_bwd_fold_local and the pass is one product a chunk
(chunk_bwd_fold_walk); dv2 = dv_local + k dh and every output are formed per chunk after
it by chunk_bwd_fold_tail (dqkw and wy in one kernel).

The none / scalar gate's training forward keeps the WY inverse A itself
(chunk_kkt_inverse_save); the backward forms the rest from it (:func:`rebuild`: the gate's
in-chunk cumulative sum and the l2-normalised q, k by chunk_bwd_kkt_rebuild, the row pass
of chunk_kkt_inverse without the inverse; w, u by the forward's chunk_wu). The scalar
gate (Gated DeltaNet) reads g_cum [HV, NT * 64] f32, the in-chunk cumulative log gate. The per-key gate (KDA;
dsl/delta_key_bwd.py) runs the same four stages in their per-key form after
:func:`key_rebuild_packed` (params: :func:`key_train_params`): the forward's per-key
prepare rendered as chunk_bwd_key_rebuild, which reads the WY inverse A the training
forward kept (chunk_prepare_save) instead of forming the pair sums and the inverse again,
and writes w, u, qg, kg, g_last, g_cum and the l2-normalised q, k.

Also here: :func:`chunk_forward_intermediates`, the contract's forward (o, S, Aw, Au, w,
u) over the chunked forward's stages (:func:`contract_plan`).
"""
from __future__ import annotations

from ..codegen.arch import DEFAULT_ARCH, get_arch
from ..codegen.pipeline import DeltaBackwardProblem
from ..dsl import Options, SpecError
from . import chunk, runtime

#: the gated backward's stages, in order (the arch's plan, delta_backward_plan)
STAGES = get_arch(DEFAULT_ARCH).DELTA_STAGES
#: without a gate: the folded form's
FOLD_STAGES = get_arch(DEFAULT_ARCH).FOLD_STAGES
#: the per-key gate's rebuild of w, u, qg, kg, G from the WY inverse A its training forward
#: kept
REBUILD = "chunk_bwd_key_rebuild"
#: the none / scalar gate's: the gate cumsum and qn, kn (run where the call has a gate or
#: l2norm), then chunk_wu forms w, u from the kept A
ROWS = "chunk_bwd_kkt_rebuild"
CHUNK = 64

def is_gated(spec) -> bool:
    """Whether spec takes the gated backward (the delta rule with a scalar gate)."""
    return spec is not None and spec.gate.value == "scalar"


def is_key(spec) -> bool:
    """Whether spec takes the per-key backward (the delta rule with a per-key gate)."""
    return spec is not None and spec.gate.value == "key"


def default_spec():
    """The spec these stages are generated for: DeltaNet (the delta rule, no gate),
    looked up by name so the engine imports no family module."""
    from .registry import get_spec
    return get_spec("deltanet")


def compiled_stage(stage: str, spec=None, arch: str = DEFAULT_ARCH, **params):
    """The compiled kernel of backward ``stage`` at ``params`` (memoised by ops.runtime)."""
    return runtime.compile_stage(spec or default_spec(), stage, arch, params)


def stage_params(*, H, K, V, dtype, HV=None, chains=1, use_dht=False, store_dh0=False,
                 state_dtype=None, dh=None, gate="none", arch: str = DEFAULT_ARCH) -> dict:
    """stage name -> build() params of the backward stages (the arch's
    delta_backward_params; the rebuild of w, u before them: :func:`rebuild_params`): H key
    heads, HV value heads (default H); chains: the dh pass's sequences x value heads (more
    value blocks for few chains); use_dht / store_dh0: the dh pass starts from the final
    state's gradient / writes the initial state's; a gated spec's stages take the same
    params (their gated forms read the spec); state_dtype: the states' dtype where it is
    not the input dtype (the contract's f32); dh: the dh pass's num_stages / block_v where
    a probe sets them (default: the arch's dh_config); gate: the spec's (none: the folded
    form's stages, the arch's delta_stages)."""
    return get_arch(arch).delta_backward_params(DeltaBackwardProblem(
        gate=gate, H=H, HV=HV or H, K=K, V=V, dtype=dtype, chains=chains,
        use_dht=use_dht, store_dh0=store_dh0, state_dtype=state_dtype or "",
        dh=tuple(sorted((dh or {}).items()))))


def stage_jobs(param_sets, spec=None, arch: str = DEFAULT_ARCH) -> list:
    """runtime.precompile's (spec, stage, arch, params) jobs of every stage of each
    stage_params() dict (spec: the gated family's for its stages)."""
    return [(spec or default_spec(), stage, arch, params)
            for ps in param_sets for stage, params in ps.items()]


def precompile(param_sets, workers=None, spec=None, arch: str = DEFAULT_ARCH) -> list:
    """Compile every stage of each stage_params() dict in parallel processes
    (runtime.precompile of :func:`stage_jobs`). Returns error strings (empty when all
    compiled)."""
    return runtime.precompile(stage_jobs(param_sets, spec, arch), workers)


def run_stages(spec, params: dict, x: dict) -> dict:
    """Run the backward stages at ``params`` (:func:`stage_params`) as the arch's plan
    (delta_backward_plan, runtime.run_plan) on the token-first packed tensors of x (by the
    kernels' argument names: q, k [Ttot, H, K]; v, do [Ttot, HV, V]; beta [Ttot, HV]; w,
    u, A (or the per-key rebuild's aqk, qg, kg, g_last, w, u, A); g_cum (spec's gate); S,
    state_row; the chunk tables; dht, dh0 [N or 1, HV, K, V] f32). Each intermediate is
    allocated when its stage needs it and dropped (with the recomputed tensors) after its
    last reader, so their memory serves the later stages. Adds dq, dk [Ttot, HV, K] (per
    value head), dv, dbeta and, gated, dg to x (where x holds no such output already: then
    the stages write into it); returns x."""
    arch = get_arch(runtime.arch_of(x["v"].device))
    p = params[arch.delta_stages(spec.gate.value)[0]]
    plan = arch.delta_backward_plan(DeltaBackwardProblem(
        gate=spec.gate.value, H=p["H"], HV=p["HV"], K=p["K"], V=p["V"], dtype=p["dtype"],
        Ttot=x["v"].shape[0], NT=x["chunk_bos"].numel()), params)
    return runtime.run_plan(spec, plan, x)


def one_head(*xs):
    """Head-first [B, H, L, ...] tensors as token-first one-head ones [B H L, 1, ...]
    (contiguous views)."""
    return [x.contiguous().view(-1, 1, *x.shape[3:]) for x in xs]


def one_head_tables(B, H, L, device) -> dict:
    """The chunk tables of B * H one-head sequences of L tokens (head-first [B, H, L])."""
    return chunk._tables(tuple(range(0, B * H * L + 1, L)), CHUNK, device, 0)


def state_rows(NT: int, NC: int, device):
    """Chunk t's row of the forward's states, int32 on the device, cached (no kernel a
    call): t + t // NC where each sequence's NC chunk states are followed by its final one
    (the contract's S [B, H, NC+1, K, V]), t with NC = 0 (training's h [NT, HV, K, V])."""
    import numpy as np

    def build():
        t = np.arange(NT)
        return chunk._to_device(dict(state_row=t + (t // NC if NC else 0)), device)
    return chunk._cached(("state_row", NT, NC, str(device)), build)["state_row"]


def _check(name, x, shape, dtype=None):
    if tuple(x.shape) != tuple(shape):
        raise SpecError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise SpecError(f"{name} must have dtype {dtype}, got {x.dtype}")
    _check_device(name, x)


def _check_device(name, x):
    if not x.is_cuda:
        raise SpecError(f"{name} must be on a CUDA device, got {x.device}")


def _dims(q, k, v, beta, forward=False):
    import torch
    if q.dim() != 4:
        raise SpecError(f"q must be [B, H, L, DK], got {tuple(q.shape)}")
    B, H, L, K = q.shape
    V = v.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise SpecError(f"q must be float16 or bfloat16, got {q.dtype}")
    _check("q", q, (B, H, L, K))
    _check("k", k, (B, H, L, K), q.dtype)
    _check("v", v, (B, H, L, V), q.dtype)
    _check("beta", beta, (B, H, L), q.dtype)
    if K not in (64, 128) or V not in (64, 128):
        raise SpecError(f"the chunked DeltaNet contract supports DK, DV in (64, 128), "
                        f"got DK={K}, DV={V}")
    # the forward's output stage puts the B * H * NC chunks on gridDim.y, which CUDA
    # limits (the backward's stages put sequences and chunks on gridDim.x)
    limit = get_arch(runtime.arch_of(q.device)).hardware.MAX_GRID_YZ
    if forward and B * H * -(-L // CHUNK) > limit:
        raise SpecError(f"B * H = {B * H} sequences of {-(-L // CHUNK)} chunks: the chunked "
                        f"DeltaNet contract's forward supports up to {limit} chunks in all "
                        f"per call")
    return B, H, L, K, V


def backward_params(*, H, K, V, dtype, B=1, dh=None, arch: str = DEFAULT_ARCH) -> dict:
    """The contract backward's stage params (:func:`chunk_backward`): the B * H one-head
    sequences, the forward's f32 states (dh: as :func:`stage_params`)."""
    return stage_params(H=1, K=K, V=V, dtype=dtype, chains=B * H, state_dtype="float32",
                        dh=dh, arch=arch)


def chunk_backward(do, q, k, v, beta, S, Aw, Au, w, u, dh=None):
    """DeltaNetChunkBwd: the exact gradients of the chunked forward's o under sum(o * do).

    Head-first: do [B, H, L, DV]; q, k, w [B, H, L, DK]; v, u [B, H, L, DV]; beta
    [B, H, L]; S [B, H, NC+1, DK, DV] f32 (state entering each chunk; S[NC] unused);
    Aw = Au [B, H, L, 64] (Au is accepted for the signature; Aw == Au by definition and
    the kernels read Aw). One dtype (f16 or bf16) for all but S; no scale, no initial
    state (the contract's forward). Returns (dq, dk, dv, dbeta) shaped like q, k, v,
    beta in the input dtype (fp32 accumulation inside). Inputs are never modified. The
    stages run on the (b, h) one-head sequences (:func:`one_head`): chunk t of sequence
    n reads S's row n (NC + 1) + t. dh: the dh pass's tuning (a probe's).
    """
    import torch
    B, H, L, K, V = _dims(q, k, v, beta)
    NC = -(-L // CHUNK)
    dt = q.dtype
    for name, x, D in (("do", do, V), ("w", w, K), ("u", u, V), ("Aw", Aw, CHUNK),
                       ("Au", Au, CHUNK)):
        _check(name, x, (B, H, L, D), dt)
    if S.shape[2] != NC + 1:
        raise SpecError(f"S must have NC+1 = {NC + 1} states, got shape {tuple(S.shape)}")
    _check("S", S, (B, H, NC + 1, K, V), torch.float32)
    outs = [torch.empty_like(x) for x in (q, k, v, beta)]
    if B * H * L == 0:
        return tuple(outs)
    spec, dev = default_spec(), q.device
    arch = runtime.arch_of(dev)
    params = backward_params(H=H, K=K, V=V, dtype=str(dt).replace("torch.", ""), B=B, dh=dh,
                             arch=arch)
    runtime.announce(spec, arch, params)     # recording(): every stage at once
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=dev)  # noqa: E731
    qf, kf, vf, dof, wf, uf, Af = one_head(q, k, v, do, w, u, Aw)
    x = dict(one_head_tables(B, H, L, dev), q=qf, k=kf, v=vf, do=dof, w=wf, u=uf, A=Af,
             beta=beta.contiguous().view(-1, 1), S=S.contiguous().view(-1, 1, K, V),
             state_row=state_rows(B * H * NC, NC, dev), dht=f32(1, 1, K, V),
             dh0=f32(1, 1, K, V),
             **{name: out.view(-1, 1, *out.shape[3:])
                for name, out in zip(("dq", "dk", "dv", "dbeta"), outs)})
    run_stages(spec, params, x)
    return tuple(outs)


def _gated_spec():
    """The gated stages' default spec: Gated DeltaNet, by name (no family import)."""
    from .registry import get_spec
    return get_spec("gdn")


# -- the contract's forward over the chunked forward's stages ------------------------------

def contract_plan(*, K, V, dtype, B=1, H=1, L=64, has_initial_state=False, spec=None,
                  arch: str = DEFAULT_ARCH):
    """The arch's three-stage plan for B * H one-head sequences of L tokens (head-first
    [B, H, L, D] is token-first [B*H*L, 1, D] with one sequence per (b, h)): the
    DeltaNetChunkFwd contract (every chunk's state in f32 and the final one); its prepare
    is also the backward's recompute of A, w, u (and, for the per-key gate, the rest of
    what the prepare writes)."""
    NC = -(-L // CHUNK)
    return chunk.forward_plan(spec or default_spec(), Options(), arch, H=1, HV=1, K=K, V=V,
                              dtype=dtype, beta_dtype=dtype, seq_chunks=(NC,) * (B * H),
                              Ttot=B * H * L, has_initial_state=has_initial_state,
                              output_final_state=True, return_states=True,
                              config={"fused": False})


def wy_params(*, H, K, V, dtype, B=1, L=64, spec=None, arch: str = DEFAULT_ARCH) -> dict:
    """The plan's prepare stages for head-first A, w, u (spec's, default DeltaNet's; the
    scalar gate's take g): chunk_kkt_inverse writing A itself, chunk_wu applying beta
    (a_beta=False); the chunks on the grid's first index (one head: heads_fastest off)."""
    params = chunk.plan_params(contract_plan(K=K, V=V, dtype=dtype, B=B, H=H, L=L,
                                             spec=spec, arch=arch))
    one = dict(heads_fastest=False, a_beta=False)
    return {"chunk_kkt_inverse": dict(params["chunk_kkt_inverse"], **one),
            "chunk_wu": dict(params["chunk_wu"], **one, beta_dtype=dtype)}


def forward_params(*, H, K, V, dtype, B=1, L=64, arch: str = DEFAULT_ARCH) -> dict:
    """Stage params the contract's forward runs (for chunk.precompile): the prepare
    (wy_params), then chunk_state (every chunk's state in f32), chunk_output."""
    params = chunk.plan_params(contract_plan(K=K, V=V, dtype=dtype, B=B, H=H, L=L, arch=arch))
    return {**wy_params(H=H, K=K, V=V, dtype=dtype, B=B, L=L, arch=arch),
            **{s: params[s] for s in ("chunk_state", "chunk_output")}}


def compute_wy(k, v, beta, A, w, u, tables, wy=None, g=None, spec=None):
    """A, w, u of head-first k, v [B, H, L, D], beta [B, H, L] into A [B, H, L, 64], w, u
    (contiguous, the input dtype): the plan's two prepare kernels over the B * H one-head
    sequences (tables: their chunk tables, ops.chunk._tables; wy: their wy_params). g
    [B, H, L] f32 (spec a scalar gate's, L a multiple of 64): the per-token log gate, whose
    in-chunk cumulative sum the first kernel takes: A = (I + strict_tril(beta_i k_i.k_j
    e^(g_cum_i - g_cum_j)))^-1, w = A (beta e^g_cum k), u = A (beta v)."""
    import torch
    B, H, L, K = k.shape
    V = v.shape[-1]
    Ttot = B * H * L
    dtype = str(k.dtype).replace("torch.", "")
    spec = spec or default_spec()
    arch = runtime.arch_of(k.device)
    if wy is None:
        wy = wy_params(H=H, K=K, V=V, dtype=dtype, B=B, L=L, spec=spec, arch=arch)
    runtime.announce(spec, arch, wy)
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=k.device)  # noqa: E731
    NT = tables["chunk_bos"].numel()
    kf = k.contiguous().view(Ttot, 1, K)
    x = dict(tables, q=kf, k=kf, qn=kf, kn=kf, v=v.contiguous().view(Ttot, 1, V),
             beta=beta.contiguous().view(Ttot, 1),
             g=f32(Ttot, 1) if g is None else g.contiguous().view(Ttot, 1),
             g_cum=f32(Ttot, 1) if g is None else f32(1, NT * CHUNK),
             A_log=f32(1), dt_bias=f32(1), A=A.view(Ttot, 1, CHUNK),
             chunk_norm=f32(1, NT), w=w.view(Ttot, 1, K), u=u.view(Ttot, 1, V))
    for stage in ("chunk_kkt_inverse", "chunk_wu"):
        runtime.launch_kernel(spec, arch, stage, wy[stage], x)


def chunk_forward_intermediates(q, k, v, beta):
    """DeltaNetChunkFwd: (o, S, Aw, Au, w, u) for head-first q, k [B, H, L, DK], v
    [B, H, L, DV], beta [B, H, L] (f16 / bf16), no scale, zero initial state.

    o [B, H, L, DV], w [B, H, L, DK], u [B, H, L, DV], Aw = Au [B, H, L, 64] in the input
    dtype; S [B, H, NC+1, DK, DV] f32 (S[0] = 0, S[t] the state entering chunk t, S[NC]
    the final state), written by the state pass from its f32 registers (the output reads
    the states rounded to the input dtype; no conversion pass). Aw and Au are the same
    tensor (equal by definition; no copy is made).
    """
    import torch
    B, H, L, K, V = _dims(q, k, v, beta, forward=True)
    dt, dev = q.dtype, q.device
    NC = -(-L // CHUNK)
    if B * H * L == 0:
        e = lambda *s: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
        S = torch.zeros(B, H, NC + 1, K, V, dtype=torch.float32, device=dev)
        return (e(B, H, L, V), S, e(B, H, L, CHUNK), e(B, H, L, CHUNK), e(B, H, L, K),
                e(B, H, L, V))
    N, Ttot = B * H, B * H * L
    spec, arch = default_spec(), runtime.arch_of(dev)
    params = forward_params(H=H, K=K, V=V, dtype=str(dt).replace("torch.", ""), B=B, L=L,
                            arch=arch)
    runtime.announce(spec, arch, params)                        # recording(): all at once
    tables = one_head_tables(B, H, L, dev)
    A = torch.empty(B, H, L, CHUNK, dtype=dt, device=dev)
    w = torch.empty(B, H, L, K, dtype=dt, device=dev)
    u = torch.empty(B, H, L, V, dtype=dt, device=dev)
    compute_wy(k, v, beta, A, w, u, tables, wy={s: params[s] for s in
                                                 ("chunk_kkt_inverse", "chunk_wu")})
    # sequence n = (b, h) owns chunks n NC .. n NC + NC - 1: its states land at rows
    # n (NC + 1) + t of S, its final state at n (NC + 1) + NC (states_out)
    S = torch.empty(B, H, NC + 1, K, V, dtype=torch.float32, device=dev)
    o = torch.empty(B, H, L, V, dtype=dt, device=dev)
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=dev)  # noqa: E731
    x = dict(tables, q=q.contiguous().view(Ttot, 1, K), k=k.contiguous().view(Ttot, 1, K),
             w=w.view(Ttot, 1, K), u=u.view(Ttot, 1, V), g_cum=f32(Ttot, 1),
             h0=f32(1, 1, K, V), h=torch.empty(N * NC, 1, K, V, dtype=dt, device=dev),
             v_new=torch.empty(Ttot, 1, V, dtype=dt, device=dev),
             ht=S.view(N * (NC + 1), 1, K, V), o=o.view(Ttot, 1, V), scale=1.0)
    for stage in ("chunk_state", "chunk_output"):
        runtime.launch_kernel(spec, arch, stage, params[stage], x)
    return o, S, A, A, w, u


def rebuild_params(*, H, HV, K, V, dtype, l2norm=False, spec=None,
                   arch: str = DEFAULT_ARCH) -> dict:
    """The backward's rebuild from the kept A on token-first packed inputs (H key heads,
    HV value heads): ROWS at chunk_kkt_inverse's params (qn, kn with l2norm; the scalar
    gate's g_cum; not run for neither), then chunk_wu applying beta (a_beta=False)."""
    base = wy_params(H=1, K=K, V=V, dtype=dtype, spec=spec, arch=arch)
    rows = {ROWS: dict(base["chunk_kkt_inverse"], H=H, HV=HV, l2norm_qk=bool(l2norm))}
    return {**(rows if l2norm or is_gated(spec) else {}),
            "chunk_wu": dict(base["chunk_wu"], H=H, HV=HV)}


def train_params(*, H, HV, K, V, dtype, chains, l2norm=False, use_dht=False,
                 store_dh0=False, spec=None, arch: str = DEFAULT_ARCH) -> dict:
    """Every kernel the none / scalar gate's training backward runs (ops/autograd.py
    packed_backward), stage name -> build() params: the rebuild (:func:`rebuild_params`),
    the spec's gate's stages (:func:`stage_params`; chains: sequences x value heads) and
    chunk_bwd_key_grads."""
    sizes = dict(H=H, HV=HV, K=K, V=V, dtype=dtype)
    return dict(rebuild_params(**sizes, l2norm=l2norm, spec=spec, arch=arch),
                **stage_params(**sizes, chains=chains, use_dht=use_dht, store_dh0=store_dh0,
                               gate=(spec or default_spec()).gate.value, arch=arch),
                chunk_bwd_key_grads=dict(H=H, HV=HV, K=K, dtype=dtype, l2norm=bool(l2norm)))


def rebuild(q, k, v, beta, g, A, tables: dict, params: dict, spec=None, erase=None) -> dict:
    """What the none / scalar gate's stages need from the forward besides its states and
    the WY inverse A [Ttot, HV, 64] it kept (chunk_kkt_inverse_save: A itself, input
    dtype), formed by ROWS and chunk_wu (params: :func:`rebuild_params`) on token-first
    packed q, k [Ttot, H, K], v [Ttot, HV, V], beta [Ttot, HV] (input dtype; the effective
    beta), g [Ttot, HV] f32 (the effective log gate) or None, the chunk tables. Returns
    dict(q, k: q, k l2-normalised with l2norm (else the inputs), A, w [Ttot, HV, K], u
    [Ttot, HV, V] (input dtype) and, with g, g_cum [HV, NT * 64] f32: the in-chunk
    cumulative log gate the stages read). erase: the rule's erase key of its own
    [Ttot, H, K] (RuleMaths.erase_key, e.g. Comba's p: ROWS l2-normalises it with q, k,
    chunk_wu forms w from it); then also {name: it (normalised), "d" + name: the
    chunk_bwd_wy's gradient buffer [Ttot, HV, K]}."""
    import torch
    Ttot, H, K = k.shape
    HV, V = v.shape[1:]
    NT = tables["chunk_bos"].numel()
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=k.device)  # noqa: E731
    l2norm = ROWS in params and params[ROWS]["l2norm_qk"]
    x = dict(tables, q=q, k=k, v=v, beta=beta, A_log=f32(HV), dt_bias=f32(HV),
             qn=torch.empty_like(q) if l2norm else q, kn=torch.empty_like(k) if l2norm else k,
             g=f32(Ttot, HV) if g is None else g,
             g_cum=f32(Ttot, HV) if g is None else f32(HV, NT * CHUNK),
             A=A, w=v.new_empty(Ttot, HV, K), u=v.new_empty(Ttot, HV, V))
    name = spec.rule.maths.erase_key if erase is not None else ""
    if name:            # (the kernels' <name>_in and its normalised <name>n)
        x.update({f"{name}_in": erase, f"{name}n": torch.empty_like(erase) if l2norm else erase})
    if ROWS in params:
        runtime.launch_kernel(spec, runtime.arch_of(k.device), ROWS, params[ROWS], x)
    runtime.launch_kernel(spec, runtime.arch_of(k.device), "chunk_wu", params["chunk_wu"], x,
                          lambda n: (f"{name}n" if name else "kn") if n == "k" else n)
    out = dict(q=x["qn"], k=x["kn"], A=x["A"], w=x["w"], u=x["u"])
    if name:
        out.update({name: x[f"{name}n"], f"d{name}": v.new_empty(Ttot, HV, K)})
    if g is not None:
        out["g_cum"] = x["g_cum"]
    return out


def key_grads(x: dict, q, k, scale, params: dict, spec=None):
    """chunk_bwd_key_grads: the call's dq, dk [Ttot, H, K] (q's dtype) from the stages'
    per-value-head x["dq"], x["dk"] [Ttot, HV, K] (run_stages): summed over each key
    head's value heads, dq times scale, through the l2norm's backward of the raw q, k
    with the params' l2norm."""
    import torch
    y = dict(x, q=q, k=k, scale=float(scale), dq_out=torch.empty_like(q),
             dk_out=torch.empty_like(k))
    runtime.launch_kernel(spec, runtime.arch_of(k.device), "chunk_bwd_key_grads", params["chunk_bwd_key_grads"], y)
    return y["dq_out"], y["dk_out"]


def rule_grads(x: dict, name: str, t, params: dict, spec):
    """The call's gradient of the rule's vector input ``name`` (t: as the stages read it)
    from chunk_bwd_wy's: a key of its own (Comba's erase key p [Ttot, H, K], x["d" +
    name] per value head) through chunk_bwd_key_grads as :func:`key_grads` takes q's and
    k's (the GVA sum, the l2norm's backward; factor 1); a gate per value head (GDN-2's b,
    w: x["d" + name + "_in"], f32) as the stage wrote it."""
    if spec.rule.maths.vector_axes[name][0] != "H":
        return x[f"d{name}_in"]
    d = x[f"d{name}"]
    return key_grads(dict(x, dq=d, dk=d), t, t, 1.0, params, spec)[0]


# -- the per-key gate (KDA) ------------------------------------------------------------------

def key_rebuild_params(*, H, K, V, dtype, B=1, L=64, spec=None,
                       arch: str = DEFAULT_ARCH) -> dict:
    """{REBUILD: the forward's per-key prepare params (the arch's plan; the rebuild renders
    the same template reading A)} for B * H one-head sequences of L."""
    spec = spec or _key_spec()
    params = chunk.plan_params(contract_plan(K=K, V=V, dtype=dtype, B=B, H=H, L=L,
                                             spec=spec, arch=arch))
    return {REBUILD: params["chunk_prepare"]}


def _key_spec():
    from .registry import get_spec
    return get_spec("kda")


def key_train_params(*, H, HV, K, V, dtype, chains, l2norm=False, use_dht=False,
                     store_dh0=False, spec=None, arch: str = DEFAULT_ARCH) -> dict:
    """Every kernel the per-key gate's token-first training backward runs, stage name ->
    build() params: the rebuild (REBUILD: the forward's per-key prepare at the arch
    plan's params, :func:`key_rebuild_params`, with H key heads, HV value heads and the
    call's l2norm_qk), the four stages in their gated form (:func:`stage_params`; chains:
    sequences x value heads) and chunk_bwd_key_grads (as :func:`train_params`)."""
    rec = key_rebuild_params(H=1, K=K, V=V, dtype=dtype, spec=spec, arch=arch)[REBUILD]
    sizes = dict(H=H, HV=HV, K=K, V=V, dtype=dtype)
    return {REBUILD: dict(rec, H=H, HV=HV, l2norm_qk=bool(l2norm)),
            **stage_params(**sizes, chains=chains, use_dht=use_dht, store_dh0=store_dh0,
                           gate="key", arch=arch),
            "chunk_bwd_key_grads": dict(H=H, HV=HV, K=K, dtype=dtype, l2norm=bool(l2norm))}


def key_rebuild_packed(q, k, v, beta, g, A, aqk, tables: dict, params: dict,
                       spec=None, rule=None) -> dict:
    """What the per-key stages need from the forward besides its states: rebuilt
    (REBUILD, params: :func:`key_train_params`) from the WY inverse A and taken with A_qk
    as the training forward kept them (chunk_prepare_save; A, aqk [Ttot, HV, 64], input
    dtype), on token-first packed q, k [Ttot, H, K], v [Ttot, HV, V], beta [Ttot, HV]
    (input dtype; the effective beta), g [Ttot, HV, K] f32 (the activated log gate) and
    the chunk tables (ops.chunk._tables), varlen as it comes (a chunk shorter than 64
    rows: its rows only). q is taken unscaled (aqk and qg are formed from it): the scale
    goes into do (o = scale f(q)), and :func:`key_grads` then takes scale 1.
    Returns the dict run_stages takes: q, k (l2-normalised with the params'
    l2norm_qk, else the inputs themselves), A, aqk, qg, kg, w [Ttot, HV, K], u
    [Ttot, HV, V] (input dtype), g_last [NT, HV, K] and g_cum [Ttot, HV, K] f32 (the
    in-chunk cumulative log gate per key channel, the chunk's rows). rule: the rule's
    gates per value head by name (GDN-2's b [Ttot, HV, K], w [Ttot, HV, V], f32): read by
    the rebuild and chunk_bwd_wy as <name>_in, which writes their gradients into the
    returned d<name>_in (f32)."""
    import torch
    Ttot, H, K = k.shape
    HV, V = v.shape[1:]
    NT = tables["chunk_bos"].numel()
    p = params[REBUILD]
    l2norm = p["l2norm_qk"]
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=k.device)  # noqa: E731
    e = lambda D: v.new_empty(Ttot, HV, D)  # noqa: E731
    x = dict(tables, q=q, k=k, v=v, g=g, beta=beta, A_log=f32(HV), dt_bias=f32(HV * K),
             A=A, qg=e(K), kg=e(K), g_last=f32(NT, HV, K), w=e(K), u=e(V),
             g_cum=f32(Ttot, HV, K),
             qn=torch.empty_like(q) if l2norm else q, kn=torch.empty_like(k) if l2norm else k)
    ins = {f"{n}_in": t for n, t in (rule or {}).items()}
    x.update(ins)
    if NT:
        runtime.launch_kernel(spec or _key_spec(), runtime.arch_of(k.device), REBUILD, p, x)
    out = dict(q=x["qn"], k=x["kn"], aqk=aqk, **ins)
    out.update((n, x[n]) for n in ("A", "qg", "kg", "g_last", "w", "u", "g_cum"))
    out.update((f"d{n}", torch.empty_like(t)) for n, t in ins.items())
    return out
