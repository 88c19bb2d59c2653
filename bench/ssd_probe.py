"""GPU probe of Mamba-2 (SSD), linattn against mamba_ssm side by side in one run (issue
48): forward, training step (forward + backward of every input) and decode rows on
Nemotron-H-8B's layer (nheads 128, headdim 64, ngroups 8, dstate 128; D, dt_bias,
dt_softplus; z off as the model passes it, and on), T 4k-32k, decode batch 1-256.

Each row is checked first (a wrong row is reported with ok false, not timed): the forward
against the fp64 reference of the spec at T <= 4096 and against mamba_ssm; the training
step's gradients of every input against mamba_ssm's; the decode's output and state
against the fp64 recurrence and mamba_ssm's selective_state_update (its D is [nheads,
headdim], as Mamba-2's module passes it). Then timed by linattn-bench's timer (CUPTI
kernel union per call, L2 flushed, median). Each row of linattn also records the
median time of each kernel of a call (``kernels``: name -> ms) and, for the forward at
4k and 16k without z, the chunked forward's plan forms (``variants``: plan config ->
ms, from ops/chunk.py run_chunk_forward with the same call terms), so a run shows where
the time goes and which plan the arch's rules should pick. --config KEY=VALUE ... (a
backward plan config, codegen/arch/sm90/backward.py BACKWARD_CONFIG_KEYS, e.g.
scan_stages=2) times each training row again under it (``config``: its gradients
checked against mamba_ssm's, ms, kernels), beside the default in the same run.

mamba_ssm's Triton functions load from a source checkout without its CUDA extensions
(--mamba-src: the folder holding mamba_ssm/). Rows go to --out as a JSON list of
{"row", "workload", "gpu", "impls": {"linattn": {"ms", "ok", ...}, "mamba_ssm": {...}},
"ratio"} (the project's check reads bench/results/ssd_h200.json).

    python3 bench/ssd_probe.py [--mamba-src DIR] [--rows GLOB] [--out FILE.json]
                               [--config KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import statistics
import sys
import types

import torch

import linattn
from linattn.cli.bench.timer import device_time, flush_l2
from linattn.dsl import Options, call_terms
from linattn.ops import additive_bwd, chunk, mamba2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_lib import parse_config  # noqa: E402

NEMOTRON = dict(HV=128, V=64, G=8, K=128)
WORKLOAD = "nemotron-h-8b layer: nheads 128, headdim 64, ngroups 8, dstate 128, bf16"
ROWS = ([("fwd", T, z) for T in (4096, 8192, 16384, 32768) for z in (False, True)]
        + [("train", T, False) for T in (4096, 8192)]
        + [("decode", b, False) for b in (1, 8, 32, 64, 128, 256)])
#: the chunked forward's plan forms timed beside the default (config -> its name)
VARIANTS = {"state_threads=256": {"state_threads": 256},
            "aqk_per_key_head": {"aqk_per_key_head": True},
            "both": {"state_threads": 256, "aqk_per_key_head": True},
            "block_v=32": {"block_v": 32},
            "three-stage": {"fused": False},
            "three-stage, 256 threads": {"fused": False, "state_threads": 256},
            "segments=8": {"segments": 8}}
VARIANT_ROWS = ("fwd-4096", "fwd-16384")
VARIANTS_ON = False     # --variants
#: --decode-tiles: the decode kernel's tiles to time beside the arch's on the decode rows
#: ("block_v=16,threads=64,vec=4,warps_k=1"; ops/recurrent.py tuning_override)
DECODE_TILES: list = []
#: --config: the backward plan config the training rows are timed under again
BACKWARD_CONFIG: dict = {}
TOL = 2e-2
V_FIRST = Options(state_v_first=True)


def load_mamba(src):
    """(mamba_chunk_scan_combined, selective_state_update) of mamba_ssm, or Nones: the
    installed package, else the Triton modules of a checkout (its __init__ skipped)."""
    if src and "mamba_ssm" not in sys.modules:
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = [os.path.join(src, "mamba_ssm")]
        sys.modules["mamba_ssm"] = pkg
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return mamba_chunk_scan_combined, selective_state_update
    except Exception as e:      # noqa: BLE001 (reported, the rows run linattn alone)
        print(f"mamba_ssm not loaded: {type(e).__name__}: {e}")
        return None, None


def inputs(Bn, T, z, grad=False):
    HV, V, G, K = (NEMOTRON[n] for n in ("HV", "V", "G", "K"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    p = dict(x=r(Bn, T, HV, V).bfloat16(), dt=r(Bn, T, HV) - 2.0,
             A=-torch.rand(HV, device="cuda", generator=gen) * 4 - 0.5,
             B=(r(Bn, T, G, K) / math.sqrt(K)).bfloat16(),
             C=(r(Bn, T, G, K) / math.sqrt(K)).bfloat16(), D=r(HV), dt_bias=r(HV) * 0.5,
             z=r(Bn, T, HV, V).bfloat16() if z else None)
    if grad:
        p = {n: t if t is None else t.requires_grad_(True) for n, t in p.items()}
    return p


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def scan_call(fn, p):
    return lambda: fn(p["x"], p["dt"], p["A"], p["B"], p["C"], 256, D=p["D"], z=p["z"],
                      dt_bias=p["dt_bias"], dt_softplus=True)


def train_call(fn, p):
    def step():
        y = scan_call(fn, p)()
        y.backward(torch.ones_like(y))
    return step


def decode_call(fn, b):
    """selective_state_update's call at batch b, Mamba-2's form (dt, A, dt_bias, D tied
    along headdim / dstate, as mamba_ssm's Mamba2 module passes them); the state is
    updated in place, so each call gets the args' own state."""
    HV, V, G, K = (NEMOTRON[n] for n in ("HV", "V", "G", "K"))
    p = inputs(b, 1, True)
    state = 0.1 * torch.randn(b, HV, V, K, device="cuda")
    args = (p["x"][:, 0], p["dt"][:, 0, :, None].expand(b, HV, V),
            p["A"].view(HV, 1, 1).expand(HV, V, K), p["B"][:, 0], p["C"][:, 0])
    kw = dict(D=p["D"].view(HV, 1).expand(HV, V), z=p["z"][:, 0],
              dt_bias=p["dt_bias"].view(HV, 1).expand(HV, V), dt_softplus=True)
    return (lambda: fn(state, *args, **kw)), (p, state, args, kw)


def _fwd_errors(size, z, ours, theirs):
    p = inputs(1, size, z)
    y = scan_call(ours, p)()
    out = {}
    if size <= 4096:
        want, _ = call_terms.reference(
            mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"].double(), A=p["A"].double(),
            dt_bias=p["dt_bias"].double(), dt_softplus=True, dt_limit=(0.0, math.inf),
            D=p["D"].double(), z=None if p["z"] is None else p["z"].double(),
            options=V_FIRST)
        out["vs_fp64"] = rel(y, want)
    if theirs is not None:
        out["vs_mamba_ssm"] = rel(y, scan_call(theirs, p)())
    return out


def _train_errors(size, ours, theirs):
    """Gradients of every input against mamba_ssm's (the same inputs, the same upstream
    gradient); nothing to compare without mamba_ssm."""
    if theirs is None:
        return {}
    grads = []
    for fn in (ours, theirs):
        p = inputs(1, size, False, grad=True)
        train_call(fn, p)()
        grads.append({n: t.grad for n, t in p.items() if t is not None})
    return {f"grad_{n}_vs_mamba_ssm": rel(grads[0][n], grads[1][n]) for n in grads[1]}


def _decode_errors(size, ours, theirs):
    _, (p, state, args, kw) = decode_call(ours, size)
    s1 = state.clone()
    y = ours(s1, *args, **kw)
    want, wh = call_terms.reference(
        mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"].double(), A=p["A"].double(),
        dt_bias=p["dt_bias"].double(), dt_softplus=True, D=p["D"].double(),
        z=p["z"].double(), initial_state=state.double(), options=V_FIRST, recurrent=True)
    out = {"vs_fp64": rel(y, want[:, 0]), "state_vs_fp64": rel(s1, wh)}
    if theirs is not None:
        s2 = state.clone()
        out["vs_mamba_ssm"] = rel(y, theirs(s2, *args, **kw))
        out["state_vs_mamba_ssm"] = rel(s1, s2)
    return out


def check(kind, size, z, ours, theirs) -> dict:
    """Relative errors of the row (see the module docstring)."""
    if kind == "fwd":
        return _fwd_errors(size, z, ours, theirs)
    if kind == "train":
        return _train_errors(size, ours, theirs)
    return _decode_errors(size, ours, theirs)


def kernel_split(call, iters=20) -> dict:
    """Median device ms of each kernel (by name) over `iters` calls, L2 flushed before
    each: where one call's time goes."""
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush_l2()
            call()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or "bitwise_not" in e.name.lower():
            continue
        per.setdefault(e.name[:80], []).append((e.time_range.end - e.time_range.start) / 1e3)
    return {n: statistics.median(ts) * len(ts) / iters for n, ts in
            sorted(per.items(), key=lambda kv: -sum(kv[1]))}


def variant_call(size, config):
    """The chunked forward at plan config ``config`` (None: the arch's choice) on the
    fwd row's inputs (z off), with the call terms mamba_chunk_scan_combined forms."""
    p = inputs(1, size, False)
    terms = mamba2.kernel_terms(p["A"], p["D"], None, p["dt_bias"], True, (0.0, math.inf))
    return lambda: chunk.run_chunk_forward(
        mamba2.SPEC, p["C"], p["B"], p["x"], p["dt"], None, 1.0, None, True, mamba2._OPTS,
        None, None, config=config, terms=terms)[0]


def variants(size) -> dict:
    """Device ms of the chunked forward's plan forms (VARIANTS), each checked against
    the default plan's output first."""
    base = variant_call(size, None)()
    out = {}
    for name, config in VARIANTS.items():
        try:
            call = variant_call(size, config)
            err = rel(call(), base)
            out[name] = device_time(call)["ms"] if err < TOL else f"wrong: {err:.3g}"
        except Exception as e:      # noqa: BLE001 (one variant never stops the row)
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def decode_tiles(size) -> dict:
    """Device ms of selective_state_update at each of DECODE_TILES (the in-place state
    starts from the same values each call), each checked against the arch's tile first."""
    from linattn.ops.recurrent import tuning_override
    call, (p, state, args, kw) = decode_call(linattn.selective_state_update, size)
    start = state.clone()

    def run():
        state.copy_(start)
        return call()
    base = run().clone()
    out = {}
    for text in DECODE_TILES:
        knobs = {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
        try:
            with tuning_override(**knobs):
                err = rel(run(), base)
                out[text] = device_time(call)["ms"] if err < TOL else f"wrong: {err:.3g}"
        except Exception as e:      # noqa: BLE001 (an invalid tile is reported)
            out[text] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def call_of(kind, size, z, fn):
    if kind == "decode":
        return decode_call(fn, size)[0]
    if kind == "train":
        return train_call(fn, inputs(1, size, z, grad=True))
    return scan_call(fn, inputs(1, size, z))


def run_row(kind, size, z, name, m_scan, m_update) -> dict:
    theirs = m_update if kind == "decode" else m_scan
    ours = linattn.selective_state_update if kind == "decode" \
        else linattn.mamba_chunk_scan_combined
    row = dict(row=name, workload=f"{WORKLOAD}, " + (f"batch {size}" if kind == "decode"
                                                     else f"T {size}, z {'on' if z else 'off'}"),
               gpu=torch.cuda.get_device_name(), impls={})
    lin = row["impls"]["linattn"] = {}
    try:
        errs = check(kind, size, z, ours, theirs)
        lin["rel_err"] = errs
        lin["ok"] = all(v < TOL for v in errs.values())
        if not errs:
            lin["note"] = "not checked: no mamba_ssm to compare the gradients with"
        if not lin["ok"]:
            lin["error"] = "wrong: " + ", ".join(k for k, v in errs.items() if not v < TOL)
            return row
        for who, fn in (("linattn", ours), ("mamba_ssm", theirs)):
            if fn is not None:
                t = device_time(call_of(kind, size, z, fn))
                row["impls"].setdefault(who, {}).update(ms=t["ms"], p10=t["p10"],
                                                        p90=t["p90"], ok=True)
        lin["kernels"] = kernel_split(call_of(kind, size, z, ours))
        if VARIANTS_ON and name in VARIANT_ROWS:
            lin["variants"] = variants(size)
        if DECODE_TILES and kind == "decode":
            lin["tiles"] = decode_tiles(size)
        if BACKWARD_CONFIG and kind == "train":
            lin["config"] = configured(kind, size, z, ours, theirs)
        if "mamba_ssm" in row["impls"]:
            row["ratio"] = row["impls"]["mamba_ssm"]["ms"] / lin["ms"]
    except Exception as e:      # noqa: BLE001 (one row never stops the rest)
        lin.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


def configured(kind, size, z, ours, theirs) -> dict:
    """The row again under BACKWARD_CONFIG (additive_bwd.backward_config): checked, then
    timed and split by kernel, as the default."""
    out = {"plan_config": dict(BACKWARD_CONFIG)}
    try:
        with additive_bwd.backward_config(**BACKWARD_CONFIG):
            out["rel_err"] = check(kind, size, z, ours, theirs)
            out["ok"] = all(v < TOL for v in out["rel_err"].values())
            if out["ok"]:
                t = device_time(call_of(kind, size, z, ours))
                out.update(ms=t["ms"], p10=t["p10"], p90=t["p90"],
                           kernels=kernel_split(call_of(kind, size, z, ours)))
    except Exception as e:      # noqa: BLE001 (reported beside the default's row)
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return out


def warm(rows):
    """Compile every linattn kernel the rows and the variants call, in parallel processes
    (integrations/warm.py)."""
    from linattn.integrations.warm import precompile
    steps = [call_of(k, s, z, linattn.selective_state_update if k == "decode"
                     else linattn.mamba_chunk_scan_combined) for k, s, z in rows]
    steps += [variant_call(s, c) for k, s, z in rows if VARIANTS_ON
              and f"{k}-{s}" in VARIANT_ROWS and not z for c in VARIANTS.values()]           # (the plan's tiles follow T)
    steps += [_under_config(call_of(k, s, z, linattn.mamba_chunk_scan_combined))
              for k, s, z in rows if BACKWARD_CONFIG and k == "train"]
    print("precompile:", precompile(*steps), flush=True)


def _under_config(step):
    """step run under BACKWARD_CONFIG (warm's: its backward's kernels)."""
    def run():
        with additive_bwd.backward_config(**BACKWARD_CONFIG):
            step()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mamba-src", default=os.environ.get("MAMBA_SRC"))
    ap.add_argument("--rows", default="*")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "ssd_h200.json")
                    if os.environ.get("OUT") else "bench/results/ssd_h200.json")
    ap.add_argument("--variants", action="store_true",
                    help="also time the plan forms of VARIANTS on VARIANT_ROWS")
    ap.add_argument("--decode-tiles", nargs="*", default=[],
                    help="decode tiles to time beside the arch's (knobs k=v,...)")
    ap.add_argument("--config", nargs="*", default=[],
                    help="backward plan config KEY=VALUE the training rows are timed under "
                         "again (e.g. scan_stages=2)")
    a = ap.parse_args()
    BACKWARD_CONFIG.update(parse_config(a.config))
    global VARIANTS_ON
    VARIANTS_ON = a.variants
    DECODE_TILES.extend(a.decode_tiles)
    m_scan, m_update = load_mamba(a.mamba_src)
    rows = [(k, s, z, f"{k}-{s}" + ("-z" if z else "")) for k, s, z in ROWS]
    rows = [r for r in rows if fnmatch.fnmatch(r[3], a.rows)]
    warm([r[:3] for r in rows])
    results = []
    for kind, size, z, name in rows:
        row = run_row(kind, size, z, name, m_scan, m_update)
        print(json.dumps(row), flush=True)
        results.append(row)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    ratios = [r["ratio"] for r in results if "ratio" in r]
    if ratios:
        print(f"geomean ratio (mamba_ssm / linattn): "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(ratios)} "
              f"rows, min {min(ratios):.3f}")


if __name__ == "__main__":
    main()
