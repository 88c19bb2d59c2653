"""GPU probe of the generalized delta rule families (Comba, GDN-2, DPLR, RWKV-7, IPLR):
linattn's chunk_* functions against fla's in the same process, per family and workload
(prefill B1 x T4096 / T16384 and B4 x T4096, training B4 x T4096, decode (one token from
a state, fused_recurrent_*) at batch 1 / 32 / 256; H 16, K = V = 128, bf16; and RWKV-7
1.5B's heads, H 32, K = V = 64, at B1 / B4 x T4096; fla's layer conventions: l2-normalised
keys, gates in (0, 1), decays in fla's ranges).

Each row is checked first: linattn's output on the row's inputs against the fp64
recurrence of the family's spec over the first CHECK_TOKENS tokens (o is causal: its
prefix is the prefix's; a decode row's o and final state) and against fla's output on
the whole row; a wrong row is
reported, not timed. Then linattn and fla are timed by linattn-bench's timer (CUPTI
kernel union per call, L2 flushed, median). A training row times forward + backward of
every input; a family linattn trains exactly in torch (no backward kernels yet:
ops/exact_train.py) has its training rows reported, not timed. Ratio = fla time /
linattn time. linattn's kernels of every row are compiled in parallel processes first.
--config KEY=VALUE (a plan config, codegen/arch/sm90 CONFIG_KEYS) runs the dplr rule's
families (dplr, rwkv7, iplr) through ops.chunk.run_chunk_forward with it: a probe's
variant (e.g. iplr_direct=1, prepare_threads=256), checked like the default.

    python3 bench/generalized_probe.py [--families comba,gdn2] [--rows GLOB] [--out FILE]
        [--steps N]

--steps N: for a profiler (ncu --launch-skip / --launch-count), only N of linattn's calls
of each selected row (a training row: forward and backward), nothing checked or timed.

Writes rows {"family", "workload", "gpu", "impls": {"linattn": {"ms", ...}, "fla":
{"ms", ...}}, "ratio"} to --out (default $OUT/generalized_h200.json).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import linattn
from linattn.cli.bench.timer import device_time
from linattn.dsl import Options
from linattn.dsl.torch_reference import recurrent_forward
from linattn.ops import library, runtime
from linattn.ops.registry import get_spec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_lib import device_times, parse_config  # noqa: E402  (each kernel's ms)

DEVICE = "cuda"
#: name -> (B, T, kind, H, K = V)
WORKLOADS = {"prefill-4k": (1, 4096, "prefill", 16, 128),
             "prefill-16k": (1, 16384, "prefill", 16, 128),
             "prefill-b4-4k": (4, 4096, "prefill", 16, 128), "train-4k": (4, 4096, "train", 16, 128),
             "prefill-4k-hd64": (1, 4096, "prefill", 32, 64),
             "prefill-b4-4k-hd64": (4, 4096, "prefill", 32, 64),
             "decode-b1": (1, 1, "decode", 16, 128), "decode-b32": (32, 1, "decode", 16, 128),
             "decode-b256": (256, 1, "decode", 16, 128)}
CHECK_TOKENS = 1024
#: a row is wrong past these (relative L2 of o): vs fp64 on the prefix (or twice fla's
#: own error there, whichever is larger), vs fla on the whole row (where fla's own prefix
#: error is within TOL_FP64)
TOL_FP64, TOL_FLA = 2e-2, 5e-2


def _gen(seed=0):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def inputs(family, B, T, grad=False, H=16, K=128):
    """The family's call inputs (name -> tensor), fla's argument names; V = K."""
    g, V = _gen(), K
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=g)  # noqa: E731
    bf = torch.bfloat16
    x = dict(q=r(B, T, H, K).to(bf), k=r(B, T, H, K).to(bf), v=r(B, T, H, V).to(bf))
    if family == "comba":
        x.update(p=r(B, T, H, K).to(bf), g=F.logsigmoid(r(B, T, H) + 4.0),
                 beta=torch.sigmoid(r(B, T, H)).to(bf))
    elif family == "gdn2":
        x.update(g=F.logsigmoid(r(B, T, H, K) + 4.0), b=torch.sigmoid(r(B, T, H, K)).to(bf),
                 w=torch.sigmoid(r(B, T, H, V)).to(bf))
    else:                       # DPLR / RWKV-7 / IPLR: a = -kk, b = kk * (a gate in (0, 1))
        kk = F.normalize(r(B, T, H, K), dim=-1)
        x.update(k=F.normalize(r(B, T, H, K), dim=-1).to(bf), a=(-kk).to(bf),
                 b=(kk * torch.sigmoid(r(B, T, H, 1))).to(bf))
        if family != "iplr":    # RWKV-7's decay range: -e^-0.5 sigmoid(x)
            x["gk"] = -math.exp(-0.5) * torch.sigmoid(r(B, T, H, K))
    if grad:
        x = {n: t.detach().requires_grad_(True) for n, t in x.items()}
    return x


def call(family, fn, x):
    """fn's call on x (fn: linattn's or fla's function of the family, fla's signature)."""
    if family == "comba":
        return fn(x["q"], x["k"], x["v"], x["p"], x["g"], x["beta"],
                  use_qk_l2norm_in_kernel=True)[0]
    if family == "gdn2":
        return fn(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"],
                  use_qk_l2norm_in_kernel=True)[0]
    if family == "dplr":
        return fn(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"])[0]
    if family == "rwkv7":
        return fn(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"])[0]
    return fn(x["q"], x["k"], x["v"], x["a"], x["b"])[0]


def decode_call(family, fn, x, h0):
    """fn's one-token call from the state h0 (fn: a fused_recurrent_* of either library,
    called by fla's keyword names): (o, final state)."""
    kw = dict(initial_state=h0, output_final_state=True)
    if family in ("comba", "gdn2"):
        kw["use_qk_l2norm_in_kernel"] = True
    names = {"comba": "q k v p g beta", "gdn2": "q k v g b w", "dplr": "q k v a b gk",
             "iplr": "q k v a b"}.get(family)
    if family == "rwkv7":
        return fn(r=x["q"], w=x["gk"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], scale=1.0,
                  **kw)     # (fused_recurrent_rwkv7's default is K^-0.5, chunk_rwkv7's 1)
    return fn(**{n: x[n] for n in names.split()}, **kw)


def reference(family, x, T, h0=None):
    """fp64 recurrence of the family's spec over the first T tokens from h0 (None:
    zeros): (o [B, T, H, V], the final state)."""
    pre = {n: t[:, :T].detach() for n, t in x.items()}
    spec = get_spec({"rwkv7": "dplr"}.get(family, family))
    opts = Options(l2norm_qk=family in ("comba", "gdn2"))
    rule = {n: pre[n] for n in spec.rule.maths.vector_inputs}
    gate = pre.get("g", pre.get("gk"))
    scale = 1.0 if family == "rwkv7" else None
    return recurrent_forward(spec, pre["q"], pre["k"], pre["v"], gate, pre.get("beta"),
                             options=opts, scale=scale, initial_state=h0, **rule)


def functions(family, config=None, kind="chunk"):
    """(linattn's, fla's or None) chunk (kind "fused_recurrent": decode) function of the
    family (linattn's under the plan ``config`` for the dplr rule's families:
    :func:`with_config`)."""
    name = kind + "_" + {"comba": "comba", "gdn2": "gdn2", "dplr": "dplr_delta_rule",
                         "rwkv7": "rwkv7", "iplr": "iplr_delta_rule"}[family]
    module = {"comba": "fla.ops.comba", "gdn2": "fla.ops.gdn2",
              "dplr": "fla.ops.generalized_delta_rule", "rwkv7": "fla.ops.rwkv7",
              "iplr": "fla.ops.generalized_delta_rule"}[family]
    try:
        import importlib
        theirs = getattr(importlib.import_module(module), name)
    except Exception as e:      # noqa: BLE001 (reported; the rows time linattn alone)
        print(f"fla's {name} not loaded: {type(e).__name__}: {e}")
        theirs = None
    if config and kind == "chunk" and family in ("dplr", "rwkv7", "iplr"):
        return with_config(family, config), theirs
    return getattr(linattn, name), theirs


def with_config(family, config):
    """linattn's function of a dplr-rule family (fla's signature) run through
    ops.chunk.run_chunk_forward under the plan ``config``."""
    from linattn.ops import chunk
    spec = get_spec("iplr" if family == "iplr" else "dplr")
    scale = 1.0 if family == "rwkv7" else None

    def fn(*args):
        if family == "rwkv7":
            q, gk, k, v, a, b = args
        else:
            q, k, v, a, b, gk = args + (None,) * (6 - len(args))
        return chunk.run_chunk_forward(spec, q, k, v, gk, None, scale, None, False,
                                       Options(), None, None, config=config,
                                       rule_inputs={"a": a, "b": b})
    return fn


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def step(family, fn, x):
    """A training step: forward, then backward of every input."""
    def run():
        o = call(family, fn, x)
        o.backward(torch.ones_like(o))
    return run


def precompile(rows, config=None):
    """linattn's kernels of every forward and decode row, compiled in parallel processes."""
    with runtime.recording() as jobs:
        for family, (B, T, kind, H, K) in rows:
            try:
                with torch.no_grad():
                    if kind == "prefill":
                        call(family, functions(family, config)[0], inputs(family, B, T, H=H, K=K))
                    elif kind == "decode":
                        decode_call(family, functions(family, kind="fused_recurrent")[0],
                                    inputs(family, B, 1, H=H, K=K), decode_state(B, H, K))
            except Exception:   # noqa: BLE001 (KernelRequested; the run reports others)
                pass
    errors = runtime.precompile(jobs)
    print(f"precompiled {len(jobs)} kernels; {len(errors)} errors")
    for e in errors:
        print("  ", e)


def decode_state(B, H, K):
    """A decode row's state [B, H, K, V] f32 (V = K), the same for both libraries."""
    return 0.1 * torch.randn(B, H, K, K, device=DEVICE, generator=_gen(1))


def check(family, ours, theirs, x, T):
    """{impl: {vs_fp64}}, linattn's vs_fla, and the error string of a wrong row or None."""
    Tc = min(T, CHECK_TOKENS)
    want = reference(family, x, Tc)[0]
    out, fo = {}, None
    with torch.no_grad():
        o = call(family, ours, x)
        try:
            fo = call(family, theirs, x) if theirs is not None else None
        except Exception as e:      # noqa: BLE001 (fla's failure: reported, linattn timed)
            out["fla"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    out["linattn"] = {"vs_fp64": rel(o[:, :Tc], want)}
    if fo is not None:
        out["fla"] = {"vs_fp64": rel(fo[:, :Tc], want)}
    fla_err = out.get("fla", {}).get("vs_fp64")
    bound = max(TOL_FP64, 2 * (fla_err or 0.0))
    vs_fla = rel(o, fo) if fo is not None else None
    credible = fla_err is not None and fla_err <= TOL_FP64     # (fla right on the prefix)
    bad = [f"vs fp64 {out['linattn']['vs_fp64']:.2e} > {bound:.1e}"
           if not out["linattn"]["vs_fp64"] <= bound else "",
           f"vs fla {vs_fla:.2e} > {TOL_FLA}" if credible and not vs_fla <= TOL_FLA else ""]
    return out, vs_fla, "; ".join(b for b in bad if b) or None


def grads(family, fn, B, T, H, K):
    """Each input's gradient after one training step of fn (fresh inputs)."""
    x = inputs(family, B, T, True, H, K)
    step(family, fn, x)()
    return {n: t.grad for n, t in x.items()}


def train_row(row, family, ours, theirs, B, T, H, K):
    """Time a training step of both libraries, unless linattn trains exactly in torch;
    linattn's gradients are checked against fla's first (relative L2, TOL_FLA)."""
    from linattn.ops import exact_train
    try:
        mine = grads(family, ours, B, T, H, K)
    except Exception as e:      # noqa: BLE001 (linattn's failure: reported)
        row["error"] = f"linattn's training of {family} failed: {str(e)[:200]}"
        return
    if get_spec({"rwkv7": "dplr"}.get(family, family)).name in exact_train._NOTED:
        row["error"] = f"linattn trains {family} exactly in torch (no backward kernels)"
        return
    try:
        fla = grads(family, theirs, B, T, H, K) if theirs is not None else None
    except Exception as e:      # noqa: BLE001 (fla's failure: reported, linattn timed)
        fla, row["fla_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    if fla is not None:
        row["grad_vs_fla"] = {n: rel(mine[n], fla[n]) for n in mine}
        bad = {n: e for n, e in row["grad_vs_fla"].items() if not e <= TOL_FLA}
        if bad:
            row["error"] = f"gradients off fla's past {TOL_FLA}: {bad}"
            return
    for who, fn in (("linattn", ours), ("fla", theirs if fla is not None else None)):
        if fn is not None:
            run = step(family, fn, inputs(family, B, T, True, H, K))
            row["impls"][who] = device_time(run)
            row["impls"][who]["split"] = device_times(run, iters=5)[1]


def decode_row(row, family, B, H, K):
    """One token from a state: o and the final state of each library against fp64, then
    both timed (fla's function only if it is right: TOL_FP64 on o and the state)."""
    ours, theirs = functions(family, kind="fused_recurrent")
    x, h0 = inputs(family, B, 1, H=H, K=K), decode_state(B, H, K)
    want_o, want_h = reference(family, x, 1, h0)
    with torch.no_grad():
        for who, fn in (("linattn", ours), ("fla", theirs)):
            if fn is None:
                continue
            try:
                o, ht = decode_call(family, fn, x, h0)
                errs = {"vs_fp64": rel(o, want_o), "state_vs_fp64": rel(ht, want_h)}
            except Exception as e:      # noqa: BLE001 (fla's failure: reported)
                row["impls"][who] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            row["impls"][who] = errs
            if max(errs.values()) > TOL_FP64:
                row["impls"][who]["error"] = f"wrong: {errs}"
                continue
            row["impls"][who].update(device_time(lambda: decode_call(family, fn, x, h0)))
    if "error" in row["impls"].get("linattn", {}):
        row["error"] = "linattn: " + row["impls"]["linattn"]["error"]


def prefill_row(row, family, ours, theirs, x, T, paths):
    """Check the row (check()), then time both libraries, each kernel too."""
    paths.clear()
    row["impls"], row["vs_fla"], err = check(family, ours, theirs, x, T)
    row["linattn_path"] = paths[0] if paths else None
    if err:
        row["error"] = f"wrong: {err}"
        return
    with torch.no_grad():
        for who, fn in (("linattn", ours), ("fla", theirs)):
            if fn is not None and "error" not in row["impls"].get(who, {}):
                row["impls"][who].update(device_time(lambda: call(family, fn, x)))
                row["impls"][who]["split"] = device_times(lambda: call(family, fn, x),
                                                          iters=10)[1]


def run_row(family, workload, paths, config=None):
    B, T, kind, H, K = WORKLOADS[workload]
    row = dict(family=family, workload=workload, gpu=torch.cuda.get_device_name(),
               shape=dict(B=B, T=T, H=H, K=K, V=K, dtype="bfloat16"), impls={},
               **({"config": dict(config)} if config else {}))
    if kind == "decode":
        decode_row(row, family, B, H, K)
    else:
        ours, theirs = functions(family, config)
        if kind == "train":
            train_row(row, family, ours, theirs, B, T, H, K)
        else:
            prefill_row(row, family, ours, theirs, inputs(family, B, T, H=H, K=K), T, paths)
    if "ms" in row["impls"].get("fla", {}) and "ms" in row["impls"].get("linattn", {}):
        row["ratio"] = row["impls"]["fla"]["ms"] / row["impls"]["linattn"]["ms"]
    return row


def just_steps(rows, n, config):
    """n of linattn's calls of each row (a training row's: forward and backward of every
    input; a prefill's: the forward), for a profiler; nothing checked or timed."""
    for family, workload in rows:
        B, T, kind, H, K = WORKLOADS[workload]
        if kind == "decode":
            continue
        ours = functions(family, config)[0]
        x = inputs(family, B, T, kind == "train", H=H, K=K)
        run = step(family, ours, x) if kind == "train" else (lambda: call(family, ours, x))
        for _ in range(n):
            run()
        torch.cuda.synchronize()
        print(f"{family}/{workload}: {n} calls")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="comba,gdn2,dplr,rwkv7,iplr")
    ap.add_argument("--rows", default="*", help="glob on family/workload")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT_DIR") or
                                                  os.environ.get("OUT") or ".",
                                                  "generalized_h200.json"))
    ap.add_argument("--steps", type=int, default=0,
                    help="only N of linattn's calls a row (for a profiler): no check, no time")
    ap.add_argument("--config", nargs="*", default=[],
                    help="probe: plan config KEY=VALUE for the dplr rule's families")
    a = ap.parse_args()
    config = parse_config(a.config)
    rows = [(f, w) for f in a.families.split(",") for w in WORKLOADS
            if fnmatch.fnmatch(f"{f}/{w}", a.rows)]
    precompile([(f, WORKLOADS[w]) for f, w in rows], config)
    if a.steps:
        return just_steps(rows, a.steps, config)
    paths, real_run = [], library.run

    def run(spec, path, *args, **kw):     # (which kernels linattn's call took)
        paths.append(path)
        return real_run(spec, path, *args, **kw)
    library.run = run
    results = []
    for family, workload in rows:
        try:
            row = run_row(family, workload, paths, config)
        except Exception as e:      # noqa: BLE001 (one row never stops the rest)
            row = dict(family=family, workload=workload, gpu=torch.cuda.get_device_name(),
                       impls={}, error=f"{type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(row))
        results.append(row)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    for family in dict.fromkeys(f for f, _ in rows):
        ratios = [r["ratio"] for r in results if r["family"] == family and "ratio" in r]
        if ratios:
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
            print(f"{family}: geomean fla / linattn {gm:.3f} over {len(ratios)} rows, "
                  f"{sum(r < 1 for r in ratios)} slower")


if __name__ == "__main__":
    main()
