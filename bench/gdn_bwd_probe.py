"""GPU diagnosis of the Gated DeltaNet backward in bfloat16 vs float16 (issue 14, run s7-4).

For each case (the GPU test's shapes: >= 496 tokens, GVA, varlen, l2norm, h0 / dht, the
gate in the kernel) and each dtype, on the same fp64 random inputs:

1. end to end: ops.autograd.gated_backward (what chunk_gated_delta_rule's autograd node
   runs: the layout kernels, the recompute of A, w, u, the five generated stages, the
   host's reverse cumulative sum of dg; the states from the training forward,
   autograd.run_forward) against torch
   autograd of the fp64 chunked reference (dsl.torch_reference, on the GPU): ||x - ref|| /
   ||ref|| of dq, dk, dv, dg, dbeta, dh0 (and dA_log, ddt_bias with the gate in the
   kernel). The GPU tests' limits: 1e-2 bf16, 5e-3 f16 (5x for dA_log, ddt_bias).
2. stage by stage: every kernel's inputs and outputs are captured as it runs, and each
   output is compared with the fp64 math of that stage FED WITH THE GPU'S OWN INPUTS
   (the emulators of tests/test_chunk_bwd.py on the CPU): "exact" (no rounding inside the
   stage: the stage's own error) and "emul" (rounded to the input dtype where the template
   casts: what the kernel should produce bit for bit but for accumulation order). A stage
   whose "emul" error is not far below its "exact" error computes something else than its
   template says (a kernel bug); the forward's states h (the walk's, 16-bit) against the
   fp64 reference's. (The layout kernels, chunk_bwd_gather / chunk_bwd_scatter, are
   checked end to end only.)

    python3 bench/gdn_bwd_probe.py [--cases NAME ...] [--dtypes bfloat16 float16]
        [--seed N] [--out FILE]
Needs ~100-150 s on the H200 box with a cold compile cache (6 configurations x 6 kernels,
compiled in parallel first); JSON to --out (or $OUT_DIR / $OUT gdn_bwd_probe.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))   # the stage emulators
import test_chunk_bwd as emu  # noqa: E402
from _layout_fakes import forward_states  # noqa: E402

from linattn.dsl import Options  # noqa: E402
from linattn.dsl import torch_reference as tref  # noqa: E402
from linattn.ops import autograd, chunk_bwd, runtime  # noqa: E402
from linattn.ops.gdn import SPEC  # noqa: E402

F64 = torch.float64
C = chunk_bwd.CHUNK
DEV = "cuda"          # (a CPU dry run with tests/ fakes sets "cpu")
# name -> B, T, H, HV, K, V, cu_seqlens, h0, dht, l2norm, gate in kernel (the s7-4 failures)
CASES = {
    "2k-K128-dht": (2, 2048, 4, 4, 128, 128, None, False, True, False, False),
    "T1000-GVA2-K128-h0-dht-l2-gik": (1, 1000, 4, 8, 128, 128, None, True, True, True, True),
    "varlen496-GVA2-h0-dht-l2-gik": (1, 496, 2, 4, 64, 64, (0, 1, 130, 131, 195, 495, 496),
                                     True, True, True, True),
}
OUTPUTS = {"chunk_bwd_dv_local": ("dv_local",),
           "chunk_bwd_dh": ("dh_out", "dv2", "dh0"),
           "chunk_bwd_dqkw": ("dq", "dk_part", "dw", "dg_part"),
           "chunk_bwd_wy": ("dk", "dv", "dbeta", "dg")}
LIMIT = {"bfloat16": 1e-2, "float16": 5e-3}
SHORT = {"bfloat16": "bf16", "float16": "f16"}


def rel(x, ref):
    x, ref = x.to(F64), ref.to(F64).to(x.device)
    if torch.isnan(x).any():
        return float("nan")
    den = torch.linalg.norm(ref)
    return float(torch.linalg.norm(x - ref) / (den if den > 0 else 1.0))


def inputs(case, dtype, seed):
    """The GPU test's inputs (tests/test_autograd_gpu.py _gdn_inputs), fp64 then cast."""
    B, T, H, HV, K, V, cu, h0, dht, l2norm, gik = case
    N = B if cu is None else len(cu) - 1
    g = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=F64)  # noqa: E731
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not l2norm:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    dt = getattr(torch, dtype)
    xs = dict(q=q.to(dt), k=k.to(dt), v=rnd(B, T, HV, V).to(dt),
              beta=torch.sigmoid(rnd(B, T, HV)).to(dt))
    if gik:
        xs.update(g=rnd(B, T, HV).float(),
                  A_log=torch.log(torch.rand(HV, generator=g, device=DEV) * 4 + 0.5),
                  dt_bias=(rnd(HV) * 0.5).float())
    else:
        xs["g"] = (torch.nn.functional.logsigmoid(rnd(B, T, HV)) / 8).float()
    if h0:
        xs["initial_state"] = rnd(N, HV, K, V).float()
    return xs, rnd(B, T, HV, V).to(dt), (rnd(N, HV, K, V).float() if dht else None)


def call_of(case):
    B, T, H, HV, K, V, cu, h0, dht, l2norm, gik = case
    return autograd.DeltaRuleCall(spec=SPEC, scale=SPEC.scale_for(K, None), l2norm_qk=l2norm,
                                  output_final_state=True, gate_in_kernel=gik, cu=cu)


def param_set(case, dtype):
    """The backward stages one case runs, for precompiling (the forward's compile on its
    first call)."""
    B, T, H, HV, K, V, cu, h0, dht, l2norm, gik = case
    lens = [T] * B if cu is None else [b - a for a, b in zip(cu, cu[1:])]
    dims = dict(H=HV, K=K, V=V, dtype=dtype, B=len(lens))
    return chunk_bwd.stage_params(**dims, use_dht=dht, store_dh0=h0, gated=True)


class Capture:
    """Wraps chunk_bwd.compiled_stage: each stage's arguments (after the launch; no gated
    stage writes an input)."""

    def __init__(self):
        self.stages = []

    def __enter__(self):
        self.saved = real_stage = chunk_bwd.compiled_stage

        def compiled_stage(stage, spec=None, **params):
            kernel = real_stage(stage, spec, **params)
            names = runtime.stage_module(spec, stage, chunk_bwd.ARCH).args(**params)

            def run(*args):
                kernel(*args)
                torch.cuda.synchronize()
                if stage in OUTPUTS:            # (not the layout kernels)
                    self.stages.append((stage, params, {n: a.detach().clone()
                                                        for n, a in zip(names, args)}))
            return run
        chunk_bwd.compiled_stage = compiled_stage
        return self

    def __exit__(self, *exc):
        chunk_bwd.compiled_stage = self.saved


def emulate(stage, params, args, exact):
    """The stage's fp64 emulator on the CPU on the GPU's inputs; outputs fp64 (exact, no
    rounding inside) or in the kernel's dtypes (the emulator's roundings)."""
    cpu = {n: a.cpu() for n, a in args.items()}
    outs = {n: torch.zeros_like(cpu[n], dtype=F64 if exact else cpu[n].dtype)
            for n in OUTPUTS[stage] if n in cpu}
    cpu.update(outs)
    saved = emu._lp
    if exact:
        emu._lp = lambda x, dt: x
    try:
        emu.EMULATE_GATED[stage](*cpu.values(), **emu._bwd_flags(params))
    finally:
        emu._lp = saved
    return outs


def run_case(name, case, dtype, seed):
    xs, do, dht = inputs(case, dtype, seed)
    gik = case[-1]
    call = call_of(case)
    _, _, h = autograd.run_forward(call, xs["q"], xs["k"], xs["v"], xs["beta"],
                                   xs.get("initial_state"), xs["g"], xs.get("A_log"),
                                   xs.get("dt_bias"))
    with Capture() as cap:
        grads = autograd.gated_backward(call, xs["q"], xs["k"], xs["v"], xs["g"],
                                        xs["beta"], xs.get("initial_state"), xs.get("A_log"),
                                        xs.get("dt_bias"), do, dht, h)
        torch.cuda.synchronize()
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    ours = dict(zip(names, grads))
    # the fp64 reference: torch autograd of the chunked reference
    refs = {n: x.detach().to(F64).requires_grad_() for n, x in xs.items()}
    cu = case[6]
    o, ht = tref.chunked_forward(SPEC, **refs, options=Options(l2norm_qk=case[9],
                                                               gate_in_kernel=gik),
                                 cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    loss = (o * do.to(F64)).sum() + ((ht * dht.to(F64)).sum() if dht is not None else 0)
    loss.backward()
    e2e = {"d" + n: rel(ours[n], refs[n].grad) for n in xs}
    stages = []
    for stage, params, args in cap.stages:
        ex, em = emulate(stage, params, args, True), emulate(stage, params, args, False)
        for out in ex:
            if out == "dh0" and not params.get("store_dh0"):
                continue
            stages.append(dict(stage=stage, output=out, exact=rel(args[out], ex[out]),
                               emul=rel(args[out], em[out])))
    with torch.no_grad():       # the forward's states vs the fp64 reference's
        ref_h = tref.chunked_forward(
            SPEC, **{n: x.detach() for n, x in refs.items()}, intermediates=True,
            options=Options(l2norm_qk=case[9], gate_in_kernel=gik),
            cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))["h"]
    want = forward_states(ref_h, cu, case[1], F64)
    stages.insert(0, dict(stage="chunk_walk (forward)", output="h", exact=rel(h, want),
                          emul=None))
    return dict(case=name, dtype=dtype, seed=seed, e2e=e2e, stages=stages)


def print_tables(results):
    cols = dict(dq="dq", dk="dk", dv="dv", dg="dg", dbeta="dbeta", dinitial_state="dh0",
                dA_log="dA_log", ddt_bias="ddt_bias")
    print(f"\nend to end (rel. error vs fp64 autograd; limits 1e-2 bf16, 5e-3 f16, x5 for "
          f"dA_log / ddt_bias)\n{'case':32s} {'dtype':5s} "
          + " ".join(f"{c:>9s}" for c in cols.values()))
    for r in results:
        cells = [f"{r['e2e'][c]:9.1e}" if c in r["e2e"] else f"{'-':>9s}" for c in cols]
        print(f"{r['case']:32s} {SHORT[r['dtype']]:5s} " + " ".join(cells))
    print("\nstage-isolated, the worst case of each row (GPU output vs the stage's fp64 on "
          "the GPU's inputs: exact | with the template's roundings)")
    by = {}
    for r in results:
        for s in r["stages"]:
            row = by.setdefault((s["stage"], s["output"]), {}).setdefault(r["dtype"], [0, -1])
            row[0] = max(row[0], s["exact"])
            row[1] = max(row[1], s["emul"] if s["emul"] is not None else -1)
    dts = sorted({r["dtype"] for r in results})
    print(f"{'stage':24s} {'out':9s} " + " ".join(f"{d:>21s}" for d in dts))
    for (stage, out), d in by.items():
        cells = [f"{'-':>21s}" if dt not in d else f"{d[dt][0]:9.1e} | "
                 + (f"{d[dt][1]:9.1e}" if d[dt][1] >= 0 else f"{'-':>9s}") for dt in dts]
        print(f"{stage[:24]:24s} {out:9s} " + " ".join(cells))
    print("suspect stages (emulator error > max(exact / 2, limit / 10)):",
          [f"{r['case']} {r['dtype']} {s['stage']} {s['output']}" for r in results
           for s in r["stages"] if suspect(s, r["dtype"])] or "none")


def suspect(s, dtype):
    """A stage output the GPU computes unlike its template (see the module docstring)."""
    return s["emul"] is not None and not s["emul"] <= max(s["exact"] / 2, LIMIT[dtype] / 10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    errors = chunk_bwd.precompile([param_set(CASES[c], dt) for c in a.cases for dt in a.dtypes],
                                  spec=SPEC)
    print(f"precompiled in {time.time() - t0:.0f} s; {len(errors)} errors", flush=True)
    for e in errors:
        print("  compile error:", e)
    results = []
    for c in a.cases:
        for dt in a.dtypes:
            t1 = time.time()
            r = run_case(c, CASES[c], dt, a.seed)
            results.append(r)
            bad = {n: e for n, e in r["e2e"].items()
                   if not e < LIMIT[dt] * (5 if n in ("dA_log", "ddt_bias") else 1)}
            print(f"{c} {dt}: {time.time() - t1:.1f} s, over the limit: {bad or 'none'}",
                  flush=True)
    print_tables(results)
    out = a.out or (os.path.join(os.environ.get("OUT_DIR") or os.environ.get("OUT", ""),
                                 "gdn_bwd_probe.json")
                    if os.environ.get("OUT_DIR") or os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(seed=a.seed, compile_errors=errors, results=results), f, indent=1)
    print(f"total {time.time() - t0:.0f} s (seed {a.seed})")


if __name__ == "__main__":
    main()
