"""Realistic inputs per workload row (never zeros), built on the target device.

    q, k        randn, l2-normalised for the delta-rule ops (DeltaNet*, GDN, KDA) unless
                use_qk_l2norm_in_kernel asks the kernel to do it (then raw randn);
                randn for GLA (its models do not normalise)
    v, do       randn (do: also the training rows' fixed output gradient)
    beta        sigmoid(randn) in (0, 1); raw randn with use_beta_sigmoid_in_kernel
    g, gk       logsigmoid(randn + 2): natural-log decays, mean about -0.13; raw randn
                with use_gate_in_kernel, plus A_log = log U(1, 16) and
                dt_bias = softplus^-1(dt), dt = exp U(log 1e-3, log 1e-1) (Mamba's init);
                options["gates"] = "trained": such a model's decays computed outside the
                kernel (-1e-3 .. -1e-1 a token), "none": g = 0 (see _gate)
    states      0.1 randn (f32, or the row dtype for the recurrent ops); dht 0.1 randn
    cu_seqlens  cumsum of options["seq_lens"] (B == 1, packed T), int64, plus a CPU copy
    S, Aw, Au, w, u (DeltaNetChunkBwd) and h (GLAChunkBwd): from the fp64 torch reference
                forward of these inputs, cast to the row's dtypes, contiguous as a forward
                returns them (h[:, 0] = 0.1 randn).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...dsl import Options
from ...dsl import torch_reference as tr

#: a row's fla option keyword -> the Options field
OPTION_FLAGS = {"use_qk_l2norm_in_kernel": "l2norm_qk", "use_beta_sigmoid_in_kernel": "beta_sigmoid",
                "allow_neg_eigval": "allow_neg_eigval", "use_gate_in_kernel": "gate_in_kernel",
                "state_v_first": "state_v_first"}


def row_options(row) -> Options:
    """The row's kernel options (its fla flags as an Options)."""
    return Options(**{OPTION_FLAGS[k]: bool(v) for k, v in row.options.items() if k in OPTION_FLAGS})

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i64": torch.int64}
DELTA_OPS = ("DeltaNetChunkFwd", "DeltaNetChunkBwd", "DeltaNetRecurrentFwd", "DeltaNetFwd",
             "GDNFwd", "KDAFwd", "GDNTrain", "KDATrain", "DeltaNetTrain")
DERIVED = ("S", "Aw", "Au", "w", "u", "h")


def _dt_bias(u):
    """softplus^-1(dt), dt = exp U(log 1e-3, log 1e-1) (Mamba's init) from u ~ U(0, 1)."""
    step = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * u)
    return step + torch.log(-torch.expm1(-step))


def _gate(o: dict, shape, randn, rand):
    """A log decay per token (and key channel): the raw input with use_gate_in_kernel;
    else by options["gates"]: "trained" (a trained model's -exp(A_log) softplus(a +
    dt_bias), A_log = log U(1, 16) per head, dt_bias as above per head (and channel), a ~
    N(0, 1): -1e-3 .. -1e-1 a token), "none" (no decay at all: g = 0), or the table's
    synthetic logsigmoid(N(2, 1)) (mean about -0.13)."""
    if o.get("use_gate_in_kernel"):
        return randn(shape)
    mode = o.get("gates", "synthetic")
    if mode == "none":
        return torch.zeros(shape, device=randn((1,)).device)
    if mode == "trained":
        heads, per = shape[2], (shape[3] if len(shape) == 4 else 1)
        A = 1 + 15 * rand((heads, 1))
        bias = _dt_bias(rand((heads, per)))
        a = randn((*shape[:3], per))
        return (-A * F.softplus(a + bias)).reshape(shape)
    if mode != "synthetic":
        raise ValueError(f"options['gates'] must be 'synthetic', 'trained' or 'none', got {mode!r}")
    return F.logsigmoid(randn(shape) + 2)


def tensor_dtype(row, name):
    return DTYPES[row.tensors[name]["dtype"] or row.dtype]


def build_inputs(row, device="cuda", seed: int = 0) -> dict:
    """name -> tensor for every tensor of the row, on device, in the row's dtypes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    o = row.options
    raw_qk = bool(o.get("use_qk_l2norm_in_kernel"))

    def randn(shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device)

    def rand(shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float32, device=device)

    out = {}
    for name, t in row.tensors.items():
        shape, dt = tuple(t["shape"]), tensor_dtype(row, name)
        if name in DERIVED or name.startswith("cu_seqlens"):
            continue
        if name in ("q", "k"):
            x = randn(shape)
            if row.op in DELTA_OPS and not raw_qk:
                x = tr.l2norm(x)
        elif name in ("v", "do"):
            x = randn(shape)
        elif name == "beta":
            x = randn(shape) if o.get("use_beta_sigmoid_in_kernel") else torch.sigmoid(randn(shape))
        elif name in ("g", "gk"):
            x = _gate(o, shape, randn, rand)
        elif name == "A_log":
            x = torch.log(1 + 15 * rand(shape))
        elif name == "dt_bias":
            x = _dt_bias(rand(shape))
        elif name in ("state", "initial_state", "dht"):
            x = 0.1 * randn(shape)
        else:
            raise ValueError(f"{row.op}/{row.workload}: no input rule for tensor {name!r}")
        out[name] = x.to(device=device, dtype=dt)
    if "seq_lens" in o:
        lens = [int(n) for n in o["seq_lens"]]
        T = row.shape("q")[1]
        if sum(lens) != T or row.shape("q")[0] != 1:
            raise ValueError(f"{row.workload}: seq_lens sum {sum(lens)} != T {T} (or B != 1)")
        cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
        out["cu_seqlens"] = cu.to(device)
        out["cu_seqlens_cpu"] = cu.clone()
    if row.op == "DeltaNetChunkBwd":
        _, S, Aw, Au, w, u = tr.deltanet_chunk_fwd(out["q"], out["k"], out["v"], out["beta"])
        dt = DTYPES[row.dtype]
        # contiguous, as the contract's forward returns them (the reference's are
        # token-major views; a copy inside the timed backward would be counted)
        out.update(S=S.float().contiguous(), Aw=Aw.to(dt).contiguous(),
                   Au=Au.to(dt).contiguous(), w=w.to(dt).contiguous(), u=u.to(dt).contiguous())
    if row.op == "GLAChunkBwd":
        B, T, H, K = row.shape("q")
        h0 = 0.1 * randn((B, H, K, row.shape("v")[3]))
        _, _, h = tr.gla_chunk_fwd(out["q"], out["k"], out["v"], out["g"], scale=row.options.get("scale"),
                                   initial_state=h0)
        out["h"] = h.float().contiguous()
    for name, t in row.tensors.items():
        if tuple(out[name].shape) != tuple(t["shape"]):
            raise ValueError(f"{row.workload}: built {name} {tuple(out[name].shape)} != {t['shape']}")
    return out
