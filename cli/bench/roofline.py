"""FLOP and byte counts per workload row, the seed's ceilings, SOL and bound.

Counts follow /work/shared/DESIGN.md "Measuring" and the seed's formulas
(reference/seed_system.md section 3). e = bytes per element of the row's dtype;
B, T, H, HV, K, V from the row's shapes; N = sequences (cu_seqlens) else B;
"seeded" = the row has an initial state.

    DeltaNetChunkFwd  flops 2 B H L K V
                      bytes B H L ((2K+V+1) + (V+2C+K+V)) e + B H (NC+1) K V 4
    DeltaNetChunkBwd  flops 4 B H L K V
                      bytes B H L ((3K+3V+1+2C) + (2K+V+1)) e + B H (NC+1) K V 4
    DeltaNetRecurrent flops 2 B H (3 K V + K);  bytes B H (2K+2V+1+2KV) e
    GLARecurrent      flops 2 B H (2 K V + K);  bytes B H (3K+2V+2KV) e
    DeltaNetFwd       flops B T H (6KV+2K) (+ 2 B T H (3K+2) with l2norm)
                      bytes B T H (2K+2V+1) e + N H K V 4 (1+seeded) + cu_seqlens bytes
    GDNFwd            flops 7 B T HV K V
                      bytes (2BTHK + 2BT HV V + 2BT HV) e + N HV K V 4 (1+seeded)
    KDAFwd            flops 7 B T HV K V
                      bytes (2BTHK + 2BT HV V + BT HV (K+1)) e + N HV K V 4 (1+seeded)
    GLAChunkFwd/GLAFwd  flops 2 B T H K V
                      bytes B T H (3K+2V) e + N H K V 4 (1+seeded)
    GLAChunkBwd       flops 4 B T H K V
                      bytes B T H ((3K+2V) e + (3K+V) 4) + B H K V (NC+2) 4
    decode (T == 1) inference rows use the same formulas with T = 1.
    training (GDNTrain, KDATrain, GLATrain, DeltaNetTrain: one forward + backward step)
                      flops 3 x the family's forward count above (GDN, KDA: 7 B T HV K V;
                      DeltaNet: B T H (6KV+2K) (+ l2norm); GLA: 2 B T H K V): the backward
                      does about twice the forward's products
                      bytes 3 I + 2 O + 2 N HV K V 4: each differentiable input (I: q, k,
                      v, gate, beta, initial state, in their own dtypes) read by the forward
                      and the backward and its gradient written; o written and do read
                      (O = B T HV V e); the final state written and its gradient read

Ceilings (the seed's effective H200 figures): HBM 4.50 TB/s; tensor core 700 TFLOP/s
bf16, 661 f16; fp32 CUDA core 57 TFLOP/s for the recurrent ops and GLAFwd decode. SOL = max(bytes/HBM,
flops/roof) / time. Bound: the larger term ("mem" on a tie); "lat" when the SOL time is
under LAT_SOL_US and the measured time under LAT_MEASURED_US (floors fitted to the seed
page's labels; the seed's own floor was not published).
"""
from __future__ import annotations

import math

HBM_BPS = 4.50e12
ROOF = {"bf16": 700e12, "f16": 661e12, "f32": 57e12}
FP32_CORE = 57e12
LAT_SOL_US = 3.0
LAT_MEASURED_US = 10.0
ESIZE = {"bf16": 2, "f16": 2, "f32": 4}


def _numel(shape):
    return math.prod(shape) if shape else 0


def counts(row) -> tuple[int, int]:
    """(flops, bytes) of one row."""
    e = ESIZE[row.dtype]
    op, o = row.op, row.options
    if row.is_train:
        return _train_counts(row)
    q, v = row.shape("q"), row.shape("v")
    seeded = 1 if row.shape("initial_state") else 0
    cu_bytes = 8 * (_numel(row.shape("cu_seqlens")) + _numel(row.shape("cu_seqlens_cpu")))
    if op in ("DeltaNetChunkFwd", "DeltaNetChunkBwd"):
        B, H, L, K = q
        V, C = v[3], 64
        NC = L // C
        state = B * H * (NC + 1) * K * V * 4
        if op == "DeltaNetChunkFwd":
            return 2 * B * H * L * K * V, B * H * L * ((2 * K + V + 1) + (V + 2 * C + K + V)) * e + state
        per_tok = (3 * K + 3 * V + 1 + 2 * C) + (2 * K + V + 1)
        return 4 * B * H * L * K * V, B * H * L * per_tok * e + state
    if op in ("DeltaNetRecurrentFwd", "GLARecurrentFwd"):
        B, H, K = q
        V = v[2]
        if op == "DeltaNetRecurrentFwd":
            return 2 * B * H * (3 * K * V + K), B * H * (2 * K + 2 * V + 1 + 2 * K * V) * e
        return 2 * B * H * (2 * K * V + K), B * H * (3 * K + 2 * V + 2 * K * V) * e
    B, T, H, K = q
    HV, V = v[2], v[3]
    N = len(o["seq_lens"]) if "seq_lens" in o else B
    if op == "DeltaNetFwd":
        fl = B * T * H * (6 * K * V + 2 * K)
        if o.get("use_qk_l2norm_in_kernel"):
            fl += 2 * B * T * H * (3 * K + 2)
        return fl, B * T * H * (2 * K + 2 * V + 1) * e + N * H * K * V * 4 * (1 + seeded) + cu_bytes
    if op in ("GDNFwd", "KDAFwd"):
        gate = 2 * B * T * HV if op == "GDNFwd" else B * T * HV * (K + 1)
        by = (2 * B * T * H * K + 2 * B * T * HV * V + gate) * e + N * HV * K * V * 4 * (1 + seeded)
        return 7 * B * T * HV * K * V, by
    if op in ("GLAChunkFwd", "GLAFwd"):
        return 2 * B * T * H * K * V, B * T * H * (3 * K + 2 * V) * e + N * H * K * V * 4 * (1 + seeded)
    if op == "GLAChunkBwd":
        NC = T // 64
        by = B * T * H * ((3 * K + 2 * V) * e + (3 * K + V) * 4) + B * H * K * V * (NC + 2) * 4
        return 4 * B * T * H * K * V, by
    raise ValueError(f"no FLOP/byte formula for op {op!r}")


FORWARD_OF = {"GDNTrain": "GDNFwd", "KDATrain": "KDAFwd", "GLATrain": "GLAFwd",
              "DeltaNetTrain": "DeltaNetFwd"}
TENSOR_ESIZE = {**ESIZE, "f32": 4, "i64": 8}
TRAINED = ("q", "k", "v", "g", "beta", "initial_state")


def _train_counts(row) -> tuple[int, int]:
    """(flops, bytes) of a training step (the formulas in the module docstring)."""
    from dataclasses import replace
    fwd_flops, _ = counts(replace(row, op=FORWARD_OF[row.op]))
    size = lambda n: _numel(row.shape(n)) * TENSOR_ESIZE[row.tensors[n]["dtype"] or row.dtype]  # noqa: E731
    inputs = sum(size(n) for n in TRAINED if n in row.tensors)
    B, T, HV, V = row.shape("v")
    N, _, K, _ = row.shape("dht")
    return 3 * fwd_flops, 3 * inputs + 2 * B * T * HV * V * ESIZE[row.dtype] + 2 * N * HV * K * V * 4


def compute_roof(row) -> float:
    """The seed's roof key: fp32 CUDA core for the two recurrent ops and GLAFwd decode,
    the dtype's tensor-core roof for everything else (GDN/KDA/DeltaNetFwd decode too)."""
    if row.op.endswith("RecurrentFwd") or (row.op == "GLAFwd" and row.is_decode):
        return FP32_CORE
    return ROOF[row.dtype]


def sol(row, ms: float) -> dict:
    """Throughput figures for a measured time: tflops, sol_pct, bound."""
    flops, nbytes = counts(row)
    t_mem, t_comp = nbytes / HBM_BPS, flops / compute_roof(row)
    t_sol = max(t_mem, t_comp)
    bound = "mem" if t_mem >= t_comp else "comp"
    if t_sol * 1e6 < LAT_SOL_US and ms * 1e3 < LAT_MEASURED_US:
        bound = "lat"
    return {"flops": flops, "bytes": nbytes, "tflops": flops / (ms * 1e-3) / 1e12,
            "tbps": nbytes / (ms * 1e-3) / 1e12, "sol_pct": 100.0 * t_sol / (ms * 1e-3),
            "bound": bound}
