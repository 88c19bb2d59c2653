"""What the GPU probes share: inputs like the benchmark's (never zeros), device time per
call and per kernel (CUPTI through torch.profiler, L2 flushed before every call), and fla's
call of the same forward."""
from __future__ import annotations

import statistics

import torch

from linattn.cli.bench.timer import flush_l2, union_length
from linattn.dsl import Options
from linattn.dsl import torch_reference as tref
from linattn.ops.registry import get_spec


def parse_knobs(text):
    """"threads=64,block_v=16" -> {"threads": 64, "block_v": 16} (integer values)."""
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def parse_config(items):
    """A probe's --config KEY=VALUE ... (["iplr_direct=1", "scan_stages=2"]) -> the
    plan config {"iplr_direct": 1, ...} (integer values)."""
    return parse_knobs(",".join(items)) if items else {}


def device_times(fn, iters=30, warmup=5):
    """Median device ms per call (union of kernels) and per kernel name."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    evs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    calls, cur = [], None
    for s, e, name in evs:
        if "bitwise_not" in name.lower():
            if cur is not None:
                calls.append(cur)
            cur = []
        elif cur is not None and not name.lower().startswith(("memcpy", "memset")):
            cur.append((s, e, name))
    if cur is not None:
        calls.append(cur)
    calls = [c for c in calls if c]
    if not calls:
        raise RuntimeError("profiler recorded no kernels")
    total = statistics.median(union_length([(s, e) for s, e, _ in c]) for c in calls) / 1e3
    per = {}
    for c in calls:
        seen = {}
        for s, e, name in c:
            short = name.split("(")[0][:60]
            seen[short] = seen.get(short, 0.0) + (e - s)
        for k, v in seen.items():
            per.setdefault(k, []).append(v)
    return total, {k: statistics.median(v) / 1e3 for k, v in per.items()}, max(map(len, calls))


def make_inputs(op, B, T, H, HV, K, V, opts, lens, dtype=torch.bfloat16, seed=0):
    spec = get_spec(op)
    options = Options(**{n: True for n in opts})
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64)
        T = int(cu[-1])
    N = B if cu is None else len(lens)
    rn = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    q, k = rn(B, T, H, K), rn(B, T, H, K)
    if not options.l2norm_qk:
        q, k = tref.l2norm(q), tref.l2norm(k)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=rn(B, T, HV, V).to(dtype), g=None, beta=None,
             A_log=None, dt_bias=None, initial_state=0.1 * rn(N, HV, K, V))
    if spec.has_beta:
        b = rn(B, T, HV)
        x["beta"] = (b if options.beta_sigmoid else torch.sigmoid(b)).to(dtype)
    if spec.has_gate:
        gshape = spec.gate_shape(B, T, HV, K)
        if options.gate_in_kernel:
            x["g"] = rn(*gshape)
            x["A_log"] = torch.log(torch.rand(HV, device=dev, generator=g) * 15 + 1)
            n_dt = HV * K if len(gshape) == 4 else HV
            dt = torch.exp(torch.rand(n_dt, device=dev, generator=g) * 4.6 - 6.9)
            x["dt_bias"] = dt + torch.log(-torch.expm1(-dt))
        else:
            x["g"] = torch.nn.functional.logsigmoid(rn(*gshape) + 2.0)
    return spec, options, x, cu


def fla_call(spec, options, x, cu):
    """fla's chunked forward of the same call (a closure)."""
    if spec.name == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        kw = dict(g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=options.l2norm_qk)
        if options.beta_sigmoid:
            kw["use_beta_sigmoid_in_kernel"] = True
        if options.gate_in_kernel:
            kw.update(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    elif spec.name == "kda":
        from fla.ops.kda import chunk_kda as fn
        kw = dict(g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=options.l2norm_qk)
    elif spec.name == "gla":
        from fla.ops.gla import chunk_gla as fn
        kw = dict(g=x["g"])
    else:
        from fla.ops.delta_rule import chunk_delta_rule as fn
        kw = dict(beta=x["beta"], use_qk_l2norm_in_kernel=options.l2norm_qk)
    return lambda: fn(x["q"], x["k"], x["v"], initial_state=x["initial_state"],
                      output_final_state=True, cu_seqlens=cu, **kw)
