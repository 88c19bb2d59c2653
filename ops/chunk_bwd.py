"""DeltaNet's chunked backward (the DeltaNetChunkBwd contract): four generated stages.

Two schemes for the reverse state-gradient recurrence (``SCHEME``), both exact:

"direct" (default, mirrors dsl/chunked_bwd.py):
    chunk_bwd_dv_local  grid (NC, B*H):       dv_local = tril_incl(q k^T)^T do
    chunk_bwd_dh        grid (V/BV, B*H):     reverse sequential pass: dh per chunk,
                                              dv2 = dv_local + k dh (gradient of v_new);
                                              three dependent GEMMs per chunk
"scan":
    chunk_bwd_transition grid (NC, B*H):      dv_local, nP = -w^T k, X = q^T do - w^T dv_local
    chunk_bwd_dh_scan   grid (V/BV, B*H):     dh <- dh + nP dh + X: one GEMM per chunk
                                              (dv2 = dv_local + k dh is formed in stage 3)
then, both:
    chunk_bwd_dqkw      grid (NC, B*H):       v_new = u - w S, dq, dk (output and state
                                              terms), dw = -dv2 S^T
    chunk_bwd_wy        grid (NC, B*H):       back through A, w = A beta k, u = A beta v:
                                              dk (complete), dv, dbeta

The kernels read the contract's head-first tensors [B, H, L, D] directly (no layout
conversion); L is dynamic and need not be a multiple of 64 (rows past L read as 0).

The scalar gate (Gated DeltaNet; ``g_cum`` given: the in-chunk cumulative log gate
[B, H, L] f32, L a multiple of 64) runs the same four stages of the direct scheme in their
gated form (each template's has_gate), which add the gradient of g_cum per token
(chunk_bwd_dqkw also adds its rows' state terms sum_i <k_i, dk_i> to the chunk's last
row, so that they cancel as computed, as dsl/chunked_bwd.py derives, and e^g_last
<dh, S_in>: g_last also scales the state the chunk enters with); the host takes the reverse
cumulative sum within the chunk: the gradient of g.

The per-key gate (KDA; :func:`key_recompute`, :func:`key_backward_stages`, the algorithm of
dsl/delta_key_bwd.py) runs the same four stages in their per-key form after a recompute
by the forward's own per-key prepare (rendered as chunk_bwd_wy_recompute, writing A too;
the states are the forward's): dv_local = A_qk^T do; the dh pass with qg, kg and
diag(e^g_last); dqkw and wy with the pair sums factored through 16-row blocks, the last
row's state terms and the reverse cumulative sum in the kernels, so that chunk_bwd_wy
returns the gradient of g itself ([B, H, L, K] f32).

Also here: :func:`chunk_forward_intermediates`, the contract's forward (o, S, Aw, Au, w,
u): A, w, u (:func:`compute_wy`: chunk_kkt_inverse and chunk_wu), then chunk_state and
chunk_output, as the arch's three-stage plan has them (:func:`contract_plan`), with each
(b, h) as one sequence; :func:`recompute_wy` (autograd) takes A, w, u the same way (the
states come from the training forward: ops/autograd.py).
"""
from __future__ import annotations

from ..codegen.arch import get_arch
from ..dsl import Options, SpecError
from . import chunk, runtime

#: the stages each scheme runs, in order
SCHEMES = {"direct": ("chunk_bwd_dv_local", "chunk_bwd_dh", "chunk_bwd_dqkw", "chunk_bwd_wy"),
           "scan": ("chunk_bwd_transition", "chunk_bwd_dh_scan", "chunk_bwd_dqkw",
                    "chunk_bwd_wy")}
#: the scheme run (tests and probes may set "scan")
SCHEME = "direct"
#: every stage of this module, in the plan's order
ALL_STAGES = ("chunk_bwd_gather", "chunk_bwd_dv_local",
              "chunk_bwd_dh", "chunk_bwd_transition", "chunk_bwd_dh_scan", "chunk_bwd_dqkw",
              "chunk_bwd_wy", "chunk_bwd_scatter")
#: the per-key gate's recompute of the forward's prepare (A written too); the other gates
#: recompute A, w, u by the forward's own chunk_kkt_inverse and chunk_wu (compute_wy)
RECOMPUTE = "chunk_bwd_wy_recompute"
ARCH = "sm90"
CHUNK = 64

#: pipeline depth of the reverse dh pass, either scheme (0: plain loop; >= 1: TMA producer
#: warps prefetch the next chunks' inputs). 0, 1 and 2 passed the GPU gradient checks
#: (run 2, direct scheme); 2, like the forward's state pass
DH_NUM_STAGES = 2
#: force the dh pass's value block (16 / 32 / 64; probing); None = the state pass's rule
DH_BLOCK_V_OVERRIDE = None
#: pipeline depth of the gated dh pass (0: plain loop; the pipelined form compiles for
#: sm_90a but is not yet GPU-checked)
GATED_DH_NUM_STAGES = 0


def is_gated(spec) -> bool:
    """Whether spec takes the gated backward (the delta rule with a scalar gate)."""
    return spec is not None and spec.gate.value == "scalar"


def default_spec():
    """The spec these stages are generated for: DeltaNet (the delta rule, no gate),
    looked up by name so the engine imports no family module."""
    from .registry import get_spec
    return get_spec("deltanet")


def compiled_stage(stage: str, spec=None, **params):
    """The compiled kernel of backward ``stage`` at ``params`` (memoised by ops.runtime)."""
    return runtime.compile_stage(spec or default_spec(), stage, ARCH, params)


def stage_params(*, H, K, V, dtype, B=1, use_dht=False, store_dh0=False, gated=False,
                 state_dtype=None) -> dict:
    """stage name -> build() params of the scheme's four backward stages (the recompute
    of A, w, u before them: wy_params). B sets the dh pass's value
    block (more value blocks, more CTAs for the sequential pass); use_dht / store_dh0: the
    dh pass starts from the final state's gradient / writes the initial state's; gated:
    the scalar gate's stages (the direct scheme); state_dtype: the states' dtype where it
    is not the input dtype (the contract's f32 S). Reads SCHEME, DH_NUM_STAGES (or
    GATED_DH_NUM_STAGES) and DH_BLOCK_V_OVERRIDE."""
    if SCHEME not in SCHEMES:
        raise SpecError(f"SCHEME must be one of {sorted(SCHEMES)}, got {SCHEME!r}")
    if gated and SCHEME != "direct":
        raise SpecError(f"the gated backward runs the 'direct' scheme, not {SCHEME!r}")
    common = dict(H=H, K=K, V=V, dtype=dtype)
    dh = _dh_params(common, GATED_DH_NUM_STAGES if gated else DH_NUM_STAGES, B * H,
                    use_dht, store_dh0)
    params = {"chunk_bwd_dqkw": dict(common, **({"dv2_from_dh": True} if SCHEME == "scan"
                                                else {}),
                                     **({"state_dtype": state_dtype} if state_dtype else {})),
              "chunk_bwd_wy": common}
    if SCHEME == "scan":
        params.update(chunk_bwd_transition=common, chunk_bwd_dh_scan=dh)
    else:
        params.update(chunk_bwd_dv_local=common, chunk_bwd_dh=dh)
    return params


def _dh_params(common: dict, num_stages: int, chains: int, use_dht: bool,
               store_dh0: bool) -> dict:
    """build() params of the dh pass (every gate's): its pipeline stages, the value block
    for this many chains (DH_BLOCK_V_OVERRIDE else the state pass's rule), the flags."""
    from ..codegen.arch.sm90.stages import state_block_v
    return dict(common, num_stages=num_stages,
                block_v=DH_BLOCK_V_OVERRIDE or state_block_v(common["V"], chains),
                **({"use_dht": True} if use_dht else {}),
                **({"store_dh0": True} if store_dh0 else {}))


def precompile(param_sets, workers=None, spec=None) -> list:
    """Compile every stage of each stage_params() dict in parallel processes
    (runtime.precompile; spec: the gated family's for its stages). Returns error strings
    (empty when all compiled)."""
    return runtime.precompile([(spec or default_spec(), stage, ARCH, params)
                               for ps in param_sets for stage, params in ps.items()], workers)


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
    # the grids put B * H (backward) and the B * H * NC chunks (forward's output stage) on
    # gridDim.y, which CUDA limits
    limit = get_arch(ARCH).hardware.MAX_GRID_YZ
    if B * H > limit or (forward and B * H * -(-L // CHUNK) > limit):
        raise SpecError(f"B * H = {B * H} sequences of {-(-L // CHUNK)} chunks: the chunked "
                        f"DeltaNet contract supports up to {limit} (batch, head) pairs and "
                        f"{limit} chunks in all per call")
    return B, H, L, K, V


def chunk_backward(do, q, k, v, beta, S, Aw, Au, w, u):
    """DeltaNetChunkBwd: the exact gradients of the chunked forward's o under sum(o * do).

    Head-first: do [B, H, L, DV]; q, k, w [B, H, L, DK]; v, u [B, H, L, DV]; beta
    [B, H, L]; S [B, H, NC+1, DK, DV] f32 (state entering each chunk; S[NC] unused);
    Aw = Au [B, H, L, 64] (Au is accepted for the signature; Aw == Au by definition and
    the kernels read Aw). One dtype (f16 or bf16) for all but S; no scale, no initial
    state (the contract's forward). Returns (dq, dk, dv, dbeta) shaped like q, k, v,
    beta in the input dtype (fp32 accumulation inside). Inputs are never modified.
    """
    import torch
    B, H, L, K, V = _dims(q, k, v, beta)
    NC = -(-L // CHUNK)
    dt = q.dtype
    _check("Au", Au, (B, H, L, CHUNK), dt)
    if S.shape[2] != NC + 1:
        raise SpecError(f"S must have NC+1 = {NC + 1} states, got shape {tuple(S.shape)}")
    _check("S", S, (B, H, NC + 1, K, V), torch.float32)
    return backward_stages(do, q, k, v, beta, S, Aw, w, u)[:4]


def backward_stages(do, q, k, v, beta, S, A, w, u, dht=None, want_dh0=False, g_cum=None,
                    spec=None, srow=None):
    """The scheme's four backward stages, with the state gradients.

    Shapes as :func:`chunk_backward`, but S the states entering the chunks, in the input
    dtype (the forward's or the recompute's) or f32 (the contract's): head-first
    [B, H, NS, DK, DV] with NS >= NC (only S[:, :, :NC] is read), or with srow [B, H, NC]
    int32 state rows [R, DK, DV] (chunk t of (b, h) enters with S[srow[b, h, t]]: the
    forward's own layout); dht [B, H, DK, DV] f32 or None
    (the gradient of the final state; None = 0). Returns (dq, dk, dv, dbeta, dh0): dh0
    [B, H, DK, DV] f32, the gradient of the initial state S[0], when want_dh0, else None.
    With g_cum [B, H, L] f32 (the scalar gate's in-chunk cumulative log gate, L a multiple
    of 64; spec: the gated spec, default the registry's "gdn") the result is
    (dq, dk, dv, dbeta, dh0, dg), dg [B, H, L] f32 the gradient of the per-token log
    gate g.
    """
    import torch
    B, H, L, K, V = _dims(q, k, v, beta)
    NC = -(-L // CHUNK)
    dt = q.dtype
    _check("do", do, (B, H, L, V), dt)
    _check("w", w, (B, H, L, K), dt)
    _check("u", u, (B, H, L, V), dt)
    _check("A", A, (B, H, L, CHUNK), dt)
    gated = g_cum is not None
    S, srow = _state_rows(S, srow, B, H, NC, K, V, dt)
    if dht is not None:
        _check("dht", dht, (B, H, K, V), torch.float32)
    if gated:
        _check_gate(g_cum, B, H, L)
        spec = spec or _gated_spec()
    spec = spec or default_spec()
    dq, dbeta = torch.empty_like(q), torch.empty_like(beta)
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=q.device)  # noqa: E731
    dh0 = f32(B, H, K, V) if want_dh0 else None
    dg = f32(B, H, L) if gated else None
    if L == 0 or B == 0:
        if dh0 is not None:
            dh0.copy_(dht if dht is not None else 0.0)
        return (dq, torch.empty_like(k), torch.empty_like(v), dbeta, dh0) + (
            (dg,) if gated else ())
    q, k, v, beta, do, w, u, A = (x.contiguous() for x in (q, k, v, beta, do, w, u, A))
    params = stage_params(H=H, K=K, V=V, dtype=str(dt).replace("torch.", ""), B=B,
                          use_dht=dht is not None, store_dh0=want_dh0, gated=gated,
                          state_dtype="float32" if S.dtype != dt else None)
    runtime.announce(spec, ARCH, params)     # recording(): every stage at once
    run = lambda stage, *xs: compiled_stage(stage, spec, **params[stage])(*xs)  # noqa: E731
    dht_in = dht.contiguous() if dht is not None else f32(1, H, K, V)   # placeholder
    dh0_out = dh0 if dh0 is not None else f32(1, H, K, V)
    gx = (g_cum.contiguous(),) if gated else ()     # the gated stages' extra input
    dv_local = torch.empty_like(v)
    dh = torch.empty(B, H, NC, K, V, dtype=dt, device=q.device)
    if "chunk_bwd_dh_scan" in params:
        nP = torch.empty(B, H, NC, K, K, dtype=dt, device=q.device)
        X = f32(B, H, NC, K, V)
        run("chunk_bwd_transition", q, k, w, do, dv_local, nP, X)
        run("chunk_bwd_dh_scan", nP, X, dh, dht_in, dh0_out)
        dv2 = dv_local                      # stage 3 turns it into dv2 in place
    else:
        run("chunk_bwd_dv_local", q, k, do, *gx, dv_local)
        dv2 = torch.empty_like(v)
        run("chunk_bwd_dh", q, k, w, do, *gx, dv_local, dh, dv2, dht_in, dh0_out)
        del dv_local                        # (its memory serves the next stages)
    dk_part = f32(B, H, L, K)
    dw = torch.empty_like(k)
    dg_part = (f32(B, H, L),) if gated else ()
    run("chunk_bwd_dqkw", q, k, w, u, do, *gx, dv2, S, srow, dh, dq, dk_part, dw, *dg_part)
    del dh          # dk, dv (written by the last stage only) take its memory, not the peak's
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    run("chunk_bwd_wy", k, v, beta, *gx, A, dw, dv2, dk_part, *dg_part, dk, dv, dbeta,
        *((dg,) if gated else ()))
    if gated:       # the reverse cumulative sum within each chunk (g_cum = cumsum(g))
        dg.copy_(dg.view(B, H, NC, CHUNK).flip(-1).cumsum(-1).flip(-1).view(B, H, L))
    return (dq, dk, dv, dbeta, dh0) + ((dg,) if gated else ())


def state_rows(S, NC: int):
    """Head-first S [B, H, NS, K, V] (NS >= NC) as chunk_bwd_dqkw reads states: (rows
    [B H NS, K, V], srow [B, H, NC] int32, chunk t of (b, h) at row (b H + h) NS + t)."""
    import torch
    B, H, NS = S.shape[:3]
    first = torch.arange(B * H, dtype=torch.int32, device=S.device).view(B, H, 1) * NS
    srow = first + torch.arange(NC, dtype=torch.int32, device=S.device)
    return S.contiguous().view(B * H * NS, *S.shape[3:]), srow


def _state_rows(S, srow, B, H, NC, K, V, dt) -> tuple:
    """(state rows, srow) of backward_stages' S (head-first, or rows with srow), checked
    (the input dtype or f32)."""
    import torch
    sdt = torch.float32 if S.dtype == torch.float32 else dt
    if srow is None:
        if S.dim() != 5 or S.shape[2] < NC:
            raise SpecError(f"S must be [B, H, NS >= {NC}, K, V], got shape {tuple(S.shape)}")
        _check("S", S, (B, H, S.shape[2], K, V), sdt)
        return state_rows(S, NC)
    if S.dim() != 3:
        raise SpecError(f"S with srow must be state rows [R, K, V], got {tuple(S.shape)}")
    _check("S", S, (S.shape[0], K, V), sdt)
    _check("srow", srow, (B, H, NC), torch.int32)
    return S.contiguous(), srow.contiguous()


def _check_gate(g_cum, B, H, L):
    import torch
    if L % CHUNK:
        raise SpecError(f"the gated backward needs L a multiple of {CHUNK}, got {L}")
    _check("g_cum", g_cum, (B, H, L), torch.float32)


def _gated_spec():
    """The gated stages' default spec: Gated DeltaNet, by name (no family import)."""
    from .registry import get_spec
    return get_spec("gdn")


# -- the training layout: token-first call tensors <-> the stages' head-first ones ---------

def layout_params(q, HV: int, V: int, l2norm: bool) -> dict:
    """build() params of chunk_bwd_gather / chunk_bwd_scatter for token-first q [B, T, H, K]
    and HV value heads of V channels."""
    return dict(H=q.shape[2], HV=HV, K=q.shape[3], V=V,
                dtype=str(q.dtype).replace("torch.", ""), l2norm=bool(l2norm))


def announce_layout(q, v, l2norm=False, spec=None) -> None:
    """Both layout kernels named at once (runtime.recording: one round for the pair)."""
    params = layout_params(q, v.shape[2], v.shape[3], l2norm)
    runtime.announce(spec or default_spec(), ARCH,
                     {"chunk_bwd_gather": params, "chunk_bwd_scatter": params})


def gather_inputs(q, k, v, do, row_map, scale, l2norm=False, spec=None):
    """Head-first qh, kh [N, HV, L, K], vh, doh [N, HV, L, V] (chunk_bwd_gather) from
    token-first q, k [B, T, H, K], v, do [B, T, HV, V] (one dtype; do None: zeros) and
    row_map [N, L] int32 (each head-first row's token of the packed B * T, -1: zero row):
    key heads expanded to the value heads, q, k l2-normalised with l2norm, do * scale."""
    import torch
    N, L = row_map.shape
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    do = torch.zeros_like(v) if do is None else do
    out = [q.new_empty(N, HV, L, D) for D in (K, K, V, V)]
    if row_map.numel() == 0:
        return tuple(out)
    flat = [x.reshape(1, B * T, *x.shape[2:]).contiguous() for x in (q, k, v, do)]
    params = layout_params(q, HV, V, l2norm)
    compiled_stage("chunk_bwd_gather", spec, **params)(*flat, row_map, float(scale), *out)
    return tuple(out)


def grad_buffers(q, v, covered=True) -> tuple:
    """dq, dk [B, T, H, K], dv [B, T, HV, V] in q's dtype for scatter_grads to fill (zeros
    unless every token has a head-first row: covered)."""
    import torch
    new = torch.empty if covered else torch.zeros
    kw = dict(dtype=q.dtype, device=q.device)
    return new(q.shape, **kw), new(q.shape, **kw), new(*v.shape[:3], v.shape[3], **kw)


def scatter_grads(dqh, dkh, dvh, q, k, row_map, out, l2norm=False, spec=None):
    """chunk_bwd_scatter: the stages' head-first gradients [N, HV, L, D] of the gathered
    rows into their tokens of out = (dq, dk [B, T, H, K], dv [B, T, HV, V], contiguous:
    grad_buffers), summed over each key head's value heads, through the l2norm (q, k: the
    call's raw inputs) with l2norm."""
    if row_map.numel() == 0:
        return out
    B, T, H, K = q.shape
    HV, V = dvh.shape[1], dvh.shape[3]
    flat = [x.reshape(1, B * T, H, K).contiguous() for x in (q, k)]
    dst = [x.view(1, B * T, *x.shape[2:]) for x in out]
    params = layout_params(q, HV, V, l2norm)
    compiled_stage("chunk_bwd_scatter", spec, **params)(
        dqh.contiguous(), dkh.contiguous(), dvh.contiguous(), *flat, row_map, *dst)
    return out


# -- the contract's forward over the chunked forward's stages ------------------------------

def contract_plan(*, K, V, dtype, B=1, H=1, L=64, has_initial_state=False, spec=None):
    """The arch's three-stage plan for B * H one-head sequences of L tokens (head-first
    [B, H, L, D] is token-first [B*H*L, 1, D] with one sequence per (b, h)): the
    DeltaNetChunkFwd contract (every chunk's state in f32 and the final one); its prepare
    is also the backward's recompute of A, w, u (and, for the per-key gate, the rest of
    what the prepare writes)."""
    NC = -(-L // CHUNK)
    return chunk.forward_plan(spec or default_spec(), Options(), H=1, HV=1, K=K, V=V,
                              dtype=dtype, beta_dtype=dtype, seq_chunks=(NC,) * (B * H),
                              Ttot=B * H * L, has_initial_state=has_initial_state,
                              output_final_state=True, return_states=True,
                              config={"fused": False})


def wy_params(*, H, K, V, dtype, B=1, L=64, spec=None) -> dict:
    """The plan's prepare stages for head-first A, w, u (spec's, default DeltaNet's; the
    scalar gate's take g): chunk_kkt_inverse writing A itself, chunk_wu applying beta
    (a_beta=False); the chunks on the grid's first index (one head: heads_fastest off)."""
    params = chunk.plan_params(contract_plan(K=K, V=V, dtype=dtype, B=B, H=H, L=L,
                                             spec=spec))
    one = dict(heads_fastest=False, a_beta=False)
    return {"chunk_kkt_inverse": dict(params["chunk_kkt_inverse"], **one),
            "chunk_wu": dict(params["chunk_wu"], **one, beta_dtype=dtype)}


def forward_params(*, H, K, V, dtype, B=1, L=64) -> dict:
    """Stage params the contract's forward runs (for chunk.precompile): the prepare
    (wy_params), then chunk_state (every chunk's state in f32), chunk_output."""
    params = chunk.plan_params(contract_plan(K=K, V=V, dtype=dtype, B=B, H=H, L=L))
    return {**wy_params(H=H, K=K, V=V, dtype=dtype, B=B, L=L),
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
    if wy is None:
        wy = wy_params(H=H, K=K, V=V, dtype=dtype, B=B, L=L, spec=spec)
    runtime.announce(spec, ARCH, wy)
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
        runtime.launch_kernel(spec, ARCH, stage, wy[stage], x)


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
    spec = default_spec()
    params = forward_params(H=H, K=K, V=V, dtype=str(dt).replace("torch.", ""), B=B, L=L)
    runtime.announce(spec, ARCH, params)                        # recording(): all at once
    tables = chunk._tables(tuple(range(0, Ttot + 1, L)), CHUNK, dev, 0)
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
        runtime.launch_kernel(spec, ARCH, stage, params[stage], x)
    return o, S, A, A, w, u


def recompute_wy(k, v, beta, g=None, spec=None):
    """What the backward needs from the forward besides its states (the training forward
    keeps those: ops/autograd.py), recomputed from its inputs: head-first k [B, H, L, DK],
    v [B, H, L, DV], beta [B, H, L] (f16 / bf16, one dtype) -> (A [B, H, L, 64], w
    [B, H, L, DK], u [B, H, L, DV]) in the input dtype, by the forward plan's prepare
    (:func:`compute_wy`); g [B, H, L] f32: the scalar gate's per-token log gate (L a
    multiple of 64; spec the gated spec, default the registry's "gdn")."""
    import torch
    B, H, L, K, V = _dims(k, k, v, beta)
    dt, dev = k.dtype, k.device
    A = torch.empty(B, H, L, CHUNK, dtype=dt, device=dev)
    w = torch.empty(B, H, L, K, dtype=dt, device=dev)
    u = torch.empty(B, H, L, V, dtype=dt, device=dev)
    if g is not None:
        _check_gate(g, B, H, L)
        spec = spec or _gated_spec()
    if B * H * L:
        compute_wy(k, v, beta, A, w, u, chunk._tables(tuple(range(0, B * H * L + 1, L)),
                                                      CHUNK, dev, 0), g=g, spec=spec)
    return A, w, u


# -- the per-key gate (KDA) ------------------------------------------------------------------

#: pipeline depth of the per-key dh pass (0: plain loop; the pipelined form is not yet
#: compiled nor GPU-checked for the key gate)
KEY_DH_NUM_STAGES = 0
#: the per-key backward's stages after the recompute, in order
KEY_STAGES = ("chunk_bwd_dv_local", "chunk_bwd_dh", "chunk_bwd_dqkw", "chunk_bwd_wy")


def is_key(spec) -> bool:
    """Whether spec takes the per-key backward (the delta rule with a per-key gate: KDA)."""
    return spec is not None and spec.rule.value == "delta" and spec.gate.value == "key"


def key_stage_params(*, H, K, V, dtype, B=1, use_dht=False, store_dh0=False) -> dict:
    """stage name -> build() params of the per-key backward's four stages (the direct
    scheme; B * H chains set the dh pass's value block as for the other gates)."""
    common = dict(H=H, K=K, V=V, dtype=dtype)
    dh = _dh_params(common, KEY_DH_NUM_STAGES, B * H, use_dht, store_dh0)
    return {"chunk_bwd_dv_local": common, "chunk_bwd_dh": dh, "chunk_bwd_dqkw": common,
            "chunk_bwd_wy": common}


def key_recompute_params(*, H, K, V, dtype, B=1, L=64, spec=None) -> dict:
    """{RECOMPUTE: the forward's per-key prepare params (the arch's plan; the recompute
    stage renders the same template with A written)} for B * H one-head sequences of L."""
    spec = spec or _key_spec()
    params = chunk.plan_params(contract_plan(K=K, V=V, dtype=dtype, B=B, H=H, L=L,
                                             spec=spec))
    return {RECOMPUTE: params["chunk_prepare"]}


def _key_spec():
    from .registry import get_spec
    return get_spec("kda")


def _check_key_gate(g, B, H, L, K, name="g"):
    import torch
    if L % CHUNK:
        raise SpecError(f"the per-key backward needs L a multiple of {CHUNK}, got {L}")
    _check(name, g, (B, H, L, K), torch.float32)


def key_recompute(q, k, v, beta, g, spec=None) -> dict:
    """What the per-key backward needs from the forward besides its states, recomputed:
    head-first q, k [B, H, L, DK], v [B, H, L, DV], beta [B, H, L] (f16 / bf16, one
    dtype), g [B, H, L, DK] f32 (the effective per-token log gate, L a multiple of 64).
    Runs the forward's per-key prepare (A written too) over the B * H one-head sequences.
    Returns dict(A, aqk [B, H, L, 64], w, qg, kg [B, H, L, DK], u [B, H, L, DV] (input
    dtype), g_last [B, H, NC, DK] f32); key_backward_stages takes it with the states."""
    import torch
    B, H, L, K, V = _dims(q, k, v, beta)
    _check_key_gate(g, B, H, L, K)
    spec = spec or _key_spec()
    dt, dev = q.dtype, q.device
    NC, N, Ttot = L // CHUNK, B * H, B * H * L
    e = lambda *s: torch.empty(*s, dtype=dt, device=dev)  # noqa: E731
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=dev)  # noqa: E731
    out = dict(A=e(B, H, L, CHUNK), aqk=e(B, H, L, CHUNK), w=e(B, H, L, K), qg=e(B, H, L, K),
               kg=e(B, H, L, K), u=e(B, H, L, V), g_last=f32(B, H, NC, K))
    if Ttot == 0:
        return out
    params = key_recompute_params(H=H, K=K, V=V, dtype=str(dt).replace("torch.", ""), B=B,
                                  L=L, spec=spec)
    runtime.announce(spec, ARCH, params)
    tok = lambda x: x.contiguous().view(Ttot, 1, x.shape[-1])  # noqa: E731
    x = dict(chunk._tables(tuple(range(0, Ttot + 1, L)), CHUNK, dev, 0),
             q=tok(q), k=tok(k), v=tok(v), g=tok(g), beta=beta.contiguous().view(Ttot, 1),
             A_log=f32(1), dt_bias=f32(K), aqk=tok(out["aqk"]), qg=tok(out["qg"]),
             kg=tok(out["kg"]), g_last=out["g_last"].view(N * NC, 1, K), w=tok(out["w"]),
             u=tok(out["u"]), A_out=tok(out["A"]))
    runtime.launch_kernel(spec, ARCH, RECOMPUTE, params[RECOMPUTE], x)
    return out


def key_backward_stages(do, q, k, v, beta, g_cum, rec: dict, dht=None, want_dh0=False,
                        spec=None):
    """The per-key backward's four stages (the direct scheme) after :func:`key_recompute`.

    Head-first do [B, H, L, DV], q, k [B, H, L, DK], v [B, H, L, DV], beta [B, H, L] (one
    dtype, f16 / bf16), g_cum [B, H, L, DK] f32 (the in-chunk cumulative log gate, L a
    multiple of 64), rec: key_recompute's dict with the states entering the chunks,
    rec["S"] (as backward_stages' S: head-first, or state rows with rec["srow"]), consumed:
    each recomputed tensor leaves it once its last stage is launched (its memory then
    serves the later stages'); dht
    [B, H, DK, DV] f32 or None. Returns (dq, dk, dv, dbeta (input dtype), dh0
    [B, H, DK, DV] f32 or None, dg [B, H, L, DK] f32: the gradient of the per-token log
    gate g)."""
    import torch
    B, H, L, K, V = _dims(q, k, v, beta)
    _check_key_gate(g_cum, B, H, L, K, "g_cum")
    NC = L // CHUNK
    dt = q.dtype
    _check("do", do, (B, H, L, V), dt)
    if dht is not None:
        _check("dht", dht, (B, H, K, V), torch.float32)
    spec = spec or _key_spec()
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=q.device)  # noqa: E731
    dq, dbeta, dg = torch.empty_like(q), torch.empty_like(beta), f32(B, H, L, K)
    dh0 = f32(B, H, K, V) if want_dh0 else None
    if L == 0 or B * H == 0:
        if dh0 is not None:
            dh0.copy_(dht if dht is not None else 0.0)
        return dq, torch.empty_like(k), torch.empty_like(v), dbeta, dh0, dg
    q, k, v, beta, do, g_cum = (x.contiguous() for x in (q, k, v, beta, do, g_cum))
    params = key_stage_params(H=H, K=K, V=V, dtype=str(dt).replace("torch.", ""), B=B,
                              use_dht=dht is not None, store_dh0=want_dh0)
    runtime.announce(spec, ARCH, params)
    run = lambda stage, *xs: compiled_stage(stage, spec, **params[stage])(*xs)  # noqa: E731
    dht_in = dht.contiguous() if dht is not None else f32(1, H, K, V)      # placeholder
    dh0_out = dh0 if dh0 is not None else f32(1, H, K, V)
    dv_local, dv2 = torch.empty_like(v), torch.empty_like(v)
    dh = torch.empty(B, H, NC, K, V, dtype=dt, device=q.device)
    run("chunk_bwd_dv_local", rec.pop("aqk"), do, dv_local)
    run("chunk_bwd_dh", rec.pop("qg"), rec.pop("kg"), rec["w"], do, rec.pop("g_last"),
        dv_local, dh, dv2, dht_in, dh0_out)
    del dv_local
    dk_part, dg_part, dw = f32(B, H, L, K), f32(B, H, L, K), torch.empty_like(k)
    S, srow = _state_rows(rec["S"], rec.get("srow"), B, H, NC, K, V, dt)
    run("chunk_bwd_dqkw", q, k, rec.pop("w"), rec.pop("u"), do, g_cum, dv2, S, srow, dh, dq,
        dk_part, dw, dg_part)
    del dh          # dk, dv (written by the last stage only) take its memory
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    run("chunk_bwd_wy", k, v, beta, g_cum, rec.pop("A"), dw, dv2, dk_part, dg_part, dk, dv,
        dbeta, dg)
    return dq, dk, dv, dbeta, dh0, dg
