"""GPU probe of Mamba-2 (SSD), linattn against mamba_ssm side by side in one run (issue
48): forward, training step (forward + backward of every input) and decode rows on
Nemotron-H-8B's layer (nheads 128, headdim 64, ngroups 8, dstate 128; D, dt_bias,
dt_softplus; z off as the model passes it, and on), T 4k-32k, decode batch 1-256.

Each row is checked first (linattn against the fp64 reference of the spec at T <= 4096
and against mamba_ssm where it loads; a wrong row is reported, not timed), then timed by
linattn-bench's timer (CUPTI kernel union per call, L2 flushed, median). Ratio = mamba_ssm
time / linattn time. mamba_ssm's Triton functions load from a source checkout without
its CUDA extensions (--mamba-src: the folder holding mamba_ssm/).

    python3 bench/ssd_probe.py [--mamba-src DIR] [--rows GLOB] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import types

import torch

import linattn
from linattn.cli.bench.timer import device_time
from linattn.dsl import Options, call_terms
from linattn.ops import mamba2

NEMOTRON = dict(HV=128, V=64, G=8, K=128)
ROWS = ([("fwd", T, z) for T in (4096, 8192, 16384, 32768) for z in (False, True)]
        + [("train", T, False) for T in (4096, 8192)]
        + [("decode", b, False) for b in (1, 8, 32, 64, 128, 256)])


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
    return float((a.double() - b.double()).norm() / b.double().norm())


def scan_call(fn, p):
    return lambda: fn(p["x"], p["dt"], p["A"], p["B"], p["C"], 256, D=p["D"], z=p["z"],
                      dt_bias=p["dt_bias"], dt_softplus=True)


def train_call(fn, p):
    def step():
        y = scan_call(fn, p)()
        y.backward(torch.ones_like(y))
    return step


def decode_call(fn, b):
    HV, V, G, K = (NEMOTRON[n] for n in ("HV", "V", "G", "K"))
    p = inputs(b, 1, True)
    state = 0.1 * torch.randn(b, HV, V, K, device="cuda")
    args = (p["x"][:, 0], p["dt"][:, 0, :, None].expand(b, HV, V),
            p["A"].view(HV, 1, 1).expand(HV, V, K), p["B"][:, 0], p["C"][:, 0])
    kw = dict(D=p["D"], z=p["z"][:, 0], dt_bias=p["dt_bias"].view(HV, 1).expand(HV, V),
              dt_softplus=True)
    return (lambda: fn(state, *args, **kw)), (p, state, args, kw)


def check(kind, size, z, ours, theirs):
    """Relative errors of the row: linattn vs fp64 (small rows) and vs mamba_ssm."""
    out = {}
    if kind == "fwd":
        p = inputs(1, size, z)
        y = scan_call(ours, p)()
        if size <= 4096:
            want, _ = call_terms.reference(
                mamba2.SPEC, p["C"], p["B"], p["x"], dt=p["dt"].double(),
                A=p["A"].double(), dt_bias=p["dt_bias"].double(), dt_softplus=True,
                dt_limit=(0.0, math.inf), D=p["D"].double(),
                z=None if p["z"] is None else p["z"].double(),
                options=Options(state_v_first=True))
            out["vs_fp64"] = rel(y, want)
        if theirs is not None:
            out["vs_mamba_ssm"] = rel(y, scan_call(theirs, p)())
    elif kind == "decode" and theirs is not None:
        _, (p, state, args, kw) = decode_call(ours, size)
        s1, s2 = state.clone(), state.clone()
        out["vs_mamba_ssm"] = rel(ours(s1, *args, **kw), theirs(s2, *args, **kw))
        out["state_vs_mamba_ssm"] = rel(s1, s2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mamba-src", default=os.environ.get("MAMBA_SRC"))
    ap.add_argument("--rows", default="*")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT_DIR") or
                                                  os.environ.get("OUT") or ".",
                                                  "ssd_probe.json"))
    a = ap.parse_args()
    m_scan, m_update = load_mamba(a.mamba_src)
    results = []
    for kind, size, z in ROWS:
        name = f"{kind}-{size}" + ("-z" if z else "")
        if not fnmatch.fnmatch(name, a.rows):
            continue
        row = dict(row=name, device=torch.cuda.get_device_name())
        try:
            theirs = m_update if kind == "decode" else m_scan
            ours = linattn.selective_state_update if kind == "decode" \
                else linattn.mamba_chunk_scan_combined
            row.update(check(kind, size, z, ours, theirs))
            bad = [k for k, v in row.items() if k.startswith(("vs_", "state_")) and
                   not v < 2e-2]
            if bad:
                row["error"] = f"wrong: {bad}"
            else:
                for who, fn in (("linattn", ours), ("mamba_ssm", theirs)):
                    if fn is None:
                        continue
                    if kind == "decode":
                        call = decode_call(fn, size)[0]
                    elif kind == "train":
                        call = train_call(fn, inputs(1, size, z, grad=True))
                    else:
                        call = scan_call(fn, inputs(1, size, z))
                    row[f"{who}_ms"] = device_time(call)["ms"]
                if "mamba_ssm_ms" in row:
                    row["ratio"] = row["mamba_ssm_ms"] / row["linattn_ms"]
        except Exception as e:      # noqa: BLE001 (one row never stops the rest)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row))
        results.append(row)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    ratios = [r["ratio"] for r in results if "ratio" in r]
    if ratios:
        print(f"geomean ratio (mamba_ssm / linattn): "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(ratios)} rows")


if __name__ == "__main__":
    main()
