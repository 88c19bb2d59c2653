"""End-to-end numbers of real models on linattn against fla (issue 46).

Per model, a mid-sized random-weight config (0.37-0.75 B parameters, bf16; tests/_models.py
builds it with the real model's linear-attention geometry), the same weights on each side:
``generate`` (one prefill of PROMPT tokens and NEW greedily decoded ones, with the model's
cache: chunk_* then fused_recurrent_*) and ``train`` (one step: forward, backward, AdamW,
B x T tokens). transformers' models (Qwen3.5, Kimi Linear, Qwen3-Next, OLMo-hybrid) run on
fla's functions (their default) and on linattn (integrations.kernelize); fla's models
(GatedDeltaNet, KDA, GLA) as they are and under integrations.apply_linattn_to_fla.

Before timing, linattn must agree with fla, ``ok`` in linattn's entry records it: the
prefill's last logits of each side (bf16) are measured against the fp32 twin of fla's side
(the same weights, fla's functions at fp32), ``logits_err`` each, and linattn's must be
within twice fla's (+ 1e-3), as tests/test_models_gpu.py does. linattn against fla
directly (``vs_fla``) adds up both sides' bf16 drift from fp32 (which a deep model with MoE
routing amplifies over a long prompt) and has no scale of its own: run s34-1's Kimi Linear
reported it, 0.115, as both sides' error. train: the loss within 1% of fla's. Device time: per call, the union of its kernels' intervals (CUPTI via
torch.profiler, one profile per call, L2 flushed first), median; ``attn_ms`` the part in
the linear-attention kernels (linattn's TileLang stages, fla.ops' Triton kernels), per
kernel summed; ``wall_ms`` CUDA-event time around the call. Rows are written to --out
after each one, {"rows": [{model, task, params_m, shape, impls: {linattn: {ms, ok, ...},
fla: {...}}, gpu, commit}]}; a table is printed at the end.

    python3 bench/models_bench.py --out models.json [--models qwen3_5 kimi_linear fla_gdn]
        [--tasks generate train] [--budget-s 200]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import torch  # noqa: E402

import _models as M  # noqa: E402
from linattn import integrations  # noqa: E402
from linattn.cli.bench.timer import flush_l2, union_length  # noqa: E402

#: the order rows run in: the three models the issue needs first
MODELS = ("qwen3_5", "kimi_linear", "fla_gdn", "qwen3_next", "fla_kda", "fla_gla", "olmo_hybrid")
MID = {name: dict(M.GPU_DIMS[name], hidden=1024, layers=16, vocab=32000) for name in MODELS}
MID["fla_gla"] = dict(heads=4, head_dim=256, hidden=2048, layers=12, vocab=32000)  # GLA-1.3B's
PROMPT, NEW = 4096, 128          # generate: B = 1
TRAIN_B, TRAIN_T = 2, 4096       # train: 8192 tokens a step
ITERS = {"generate": (1, 3), "train": (2, 5)}      # (warm-up, timed) calls


def device_ms(fn, warmup, iters, attn=lambda name: False):
    """Median device ms of fn() (each call profiled on its own, L2 flushed before), the
    median ms of the kernels ``attn`` accepts, the mean CUDA-event ms, and the last call's
    heaviest kernels (:func:`top_kernels`: where two sides' times differ)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    totals, attns, walls = [], [], []
    for _ in range(iters):
        flush_l2()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = _kernels(prof)
        totals.append(union_length([(s, e) for s, e, _ in kernels]) / 1e6)
        attns.append(sum(e - s for s, e, n in kernels if attn(n)) / 1e6)
    for _ in range(2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        walls.append(a.elapsed_time(b))
    return (statistics.median(totals), statistics.median(attns), statistics.mean(walls),
            top_kernels(kernels))


def top_kernels(kernels, n=12) -> list:
    """[name (to its first "(", 60 characters), launches, total us] of the n kernels with
    the most device time."""
    per = {}
    for s, e, name in kernels:
        key = name.split("(")[0][:60]
        count, total = per.get(key, (0, 0.0))
        per[key] = (count + 1, total + (e - s) / 1e3)
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])[:n]
    return [[k, c, round(t, 1)] for k, (c, t) in ranked]


def _kernels(prof) -> list:
    """(start ns, end ns, name) of the profile's GPU kernels (memcpy / memset left out),
    from the raw records (a decode of 128 tokens launches ~10^5 kernels: building
    torch.profiler's event tree for them would take longer than the decode)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
            if e.device_type() == cuda and not e.name().lower().startswith(("memcpy", "memset"))]


def linattn_kernel(name: str) -> bool:
    """A TileLang kernel of linattn's: named after one of its generated stages."""
    return name.startswith(_stages())


def _stages() -> tuple:
    if not hasattr(_stages, "names"):
        root = os.path.join(os.path.dirname(HERE), "generated", "sm90")
        _stages.names = tuple(sorted({f[:-3] for d in os.listdir(root)
                                      if os.path.isdir(os.path.join(root, d))
                                      for f in os.listdir(os.path.join(root, d))
                                      if f.endswith(".py") and f != "__init__.py"}))
    return _stages.names


def fla_kernel(name: str) -> bool:
    """A Triton kernel defined in fla.ops (the linear-attention operators)."""
    if not hasattr(fla_kernel, "names"):
        fla_kernel.names = frozenset(
            n for mod_name, mod in list(sys.modules.items())
            if mod_name.startswith("fla.ops") and mod is not None
            for n in map(_triton_name, vars(mod).values()) if n)
    return name.split("(")[0] in fla_kernel.names


def _triton_name(obj):
    """The kernel name of a Triton JITFunction, Autotuner or Heuristics, else None."""
    if not type(obj).__module__.startswith("triton"):
        return None
    while hasattr(obj, "fn"):
        obj = obj.fn
    return getattr(obj, "__name__", None)


def tokens(B, T, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (B, T), generator=g).cuda()


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def prefill_check(pair, x) -> dict:
    """The last position's prefill logits of each side (bf16) against the fp32 twin of
    fla's side (its weights exactly, fla's functions at fp32): {"linattn": error, "fla":
    error, "vs_fla": linattn against fla, "ok": linattn's error within 2 x fla's + 1e-3}."""
    got = {side: pair.logits(side, x)[:, -1] for side in ("linattn", "fla")}
    ref_model = M.twin(pair.fla).float()
    ref = M.last_logits(ref_model, x, pair.within("fla"))
    del ref_model
    errs = {side: rel(logits, ref) for side, logits in got.items()}
    return dict(errs, vs_fla=rel(got["linattn"], got["fla"]),
                ok=errs["linattn"] <= 2 * errs["fla"] + 1e-3)


def generate_row(pair, vocab):
    """Prefill logits checked (prefill_check), then each side's prefill + NEW-token decode
    timed."""
    x = tokens(1, PROMPT, vocab, seed=1)
    check = prefill_check(pair, x)
    torch.cuda.empty_cache()
    out = {}
    for side, attn in (("linattn", linattn_kernel), ("fla", fla_kernel)):
        model = getattr(pair, side)
        with pair.within(side)():
            ms, attn_ms, wall, top = device_ms(lambda: M.greedy(model, x, NEW),
                                               *ITERS["generate"], attn=attn)
        out[side] = dict(ms=round(ms, 3), attn_ms=round(attn_ms, 3), wall_ms=round(wall, 3),
                         logits_err=round(check[side], 5), kernels=top)
    out["linattn"].update(ok=check["ok"], vs_fla=round(check["vs_fla"], 5))
    return out


def train_row(pair, vocab):
    """The loss of the same weights agrees, then each side's step timed (its own AdamW)."""
    x = tokens(TRAIN_B, TRAIN_T, vocab, seed=2)
    losses = {}
    for side in ("linattn", "fla"):
        with pair.within(side)(), torch.no_grad():
            losses[side] = float(getattr(pair, side)(x, labels=x).loss)
    err = abs(losses["linattn"] - losses["fla"]) / losses["fla"]
    out = {}
    for side, attn in (("linattn", linattn_kernel), ("fla", fla_kernel)):
        model = getattr(pair, side).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with pair.within(side)():
            ms, attn_ms, wall, top = device_ms(step, *ITERS["train"], attn=attn)
        model.eval()
        del opt
        out[side] = dict(ms=round(ms, 3), attn_ms=round(attn_ms, 3), wall_ms=round(wall, 3),
                         loss=round(losses[side], 5), kernels=top)
    out["linattn"]["ok"] = err < 1e-2
    return out


def warm(pair, vocab, tasks):
    """Compile linattn's kernels for the tasks at the rows' own shapes, in parallel
    (integrations.precompile): a kernel's plan depends on the shape (Gated DeltaNet at B
    1, T 256 plans the walk, at 4096 tokens the walk split into segments; the backward's
    stages follow the sequences x heads), so a warm-up at another shape left the rows to
    compile their kernels one by one. Returns precompile's report (per round: seconds
    running the steps, seconds compiling)."""
    steps = []
    if "train" in tasks:               # (train_row: the loss without grad, then the steps)
        x = tokens(TRAIN_B, TRAIN_T, vocab, seed=3)

        def step():
            with pair.within("linattn")():
                pair.linattn.train()
                pair.linattn(x, labels=x).loss.backward()
        steps += [lambda: pair.logits("linattn", x), step]
    if "generate" in tasks:            # (generate_row: the prefill's logits, then greedy)
        prompt = tokens(1, PROMPT, vocab, seed=3)
        steps += [lambda: pair.logits("linattn", prompt),
                  lambda: M.greedy(pair.linattn, prompt, 2, pair.within("linattn"))]
    res = integrations.precompile(*steps)
    pair.linattn.zero_grad(set_to_none=True)
    pair.linattn.eval()
    return res


def run_model(name, tasks, emit):
    dims = MID[name]
    t0 = time.monotonic()
    pair = M.Pair(name, dtype=torch.bfloat16, device="cuda", **dims)
    params = round(sum(p.numel() for p in pair.fla.parameters()) / 1e6)
    t1 = time.monotonic()
    pre = warm(pair, dims["vocab"], tasks)
    print(f"{name}: {params} M parameters, built in {t1 - t0:.0f} s; precompile {pre} "
          f"({time.monotonic() - t1:.0f} s)", flush=True)
    for task in tasks:
        t1 = time.monotonic()
        shape = (f"B1 prompt {PROMPT} + {NEW} new" if task == "generate"
                 else f"B{TRAIN_B} T{TRAIN_T}")
        try:
            impls = (generate_row if task == "generate" else train_row)(pair, dims["vocab"])
        except Exception as e:
            traceback.print_exc()
            impls = {"error": f"{type(e).__name__}: {e}"[:300]}
        emit(dict(model=name, task=task, params_m=params, shape=shape, impls=impls,
                  s=round(time.monotonic() - t1, 1)))
    del pair
    gc.collect()
    torch.cuda.empty_cache()


def table(rows) -> str:
    out = ["model        task      linattn ms   fla ms   ratio  attn ms (linattn / fla)  ok"]
    for r in rows:
        i = r["impls"]
        if "error" in i:
            out.append(f"{r['model']:<12} {r['task']:<9} ERROR {i['error'][:90]}")
            continue
        la, fl = i["linattn"], i["fla"]
        out.append(f"{r['model']:<12} {r['task']:<9} {la['ms']:>10.2f} {fl['ms']:>8.2f} "
                   f"{fl['ms'] / la['ms']:>6.2f}x {la['attn_ms']:>10.2f} / {fl['attn_ms']:<9.2f}"
                   f"  {la['ok']}")
    return "\n".join(out)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=HERE).stdout.strip()
    except OSError:          # no git (the GPU machine gets the files, not the repository)
        out = ""
    return out or "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--tasks", nargs="*", default=["generate", "train"])
    ap.add_argument("--budget-s", type=float, default=0, help="start no model after this")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    commit = os.environ.get("LINATTN_COMMIT") or _git_commit()
    doc = {"gpu": gpu, "commit": commit, "rows": []}

    def emit(row):
        doc["rows"].append(dict(row, gpu=gpu, commit=commit))
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(json.dumps(row), flush=True)
    t0 = time.monotonic()
    for name in args.models:
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: {name} and later models not run", flush=True)
            break
        run_model(name, args.tasks, emit)
    print(f"\n{gpu}, commit {commit}\n{table(doc['rows'])}", flush=True)


if __name__ == "__main__":
    main()
