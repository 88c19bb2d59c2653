"""The byte-identity check of a template change, on the CPU: the CUDA source of every
kernel configuration linattn launches (TileLang lowers for sm_90a; nvcc is not run).

    python3 bench/cuda_hashes.py configs CONFIGS.json       # what is launched (seconds)
    python3 bench/cuda_hashes.py texts TEXTS.json           # each stage module's text (seconds)
    python3 bench/cuda_hashes.py hash CONFIGS.json CUDA.json [--changed BASE_TEXTS.json]
    python3 bench/cuda_hashes.py compare BASE.json NEW.json

``configs`` lists (spec, stage, build() params), a pairwise cover (:func:`pairwise`) of: every forward plan's launches (the
walk, walk-split, walk-fused, fused, three-stage and split pipelines, training's
save_states, the chunk contracts' return_states and a recompute's states_only) over
options, head dims, GVA, dtypes, lengths and flags; the delta rule's backward (the
rebuilds, the four stages, the key gradients; the DeltaNet contract's forward and
backward); the additive rule's backward plans (walk and scan, every gate and the value
gate's twin); the recurrent kernel (decode, varlen, state pools, in place, 16-bit
states) at the arch's tiles. Specs: the registered families and the specs rendered on
the fly (the six rule x gate combinations, the value gate and its twin, GLA's gv,
retention's fixed decay).

``texts`` hashes each (spec, stage) module as rendered now. Identical text lowers to
identical CUDA, so after a change ``hash --changed BASE_TEXTS.json`` lowers only the
configs whose module text differs from the base's; ``compare`` then reports each
config hashed in both files as equal or not. A change is byte-identical when every
config of a changed module is equal (and the rest kept their text).
"""
import hashlib
import itertools
import json
import os
import sys

os.environ.setdefault("LINATTN_GEN_DIR", "/tmp/linattn_cuda_hashes_gen")

from linattn.codegen.arch import get_arch  # noqa: E402
from linattn.codegen.pipeline import AdditiveBackwardProblem  # noqa: E402
from linattn.codegen.plan import plan  # noqa: E402
from linattn.codegen.render import render_stage  # noqa: E402
from linattn.dsl import Options, OpSpec, all_rule_gate_specs, value_gate_spec  # noqa: E402
from linattn.dsl.spec import key_twin  # noqa: E402
from linattn.ops import chunk, chunk_bwd  # noqa: E402
from linattn.ops.registry import is_registered, specs as registered  # noqa: E402

ARCH = "sm90"


def all_specs() -> list:
    """The registered families, then the specs rendered on the fly."""
    from linattn.ops import gla, retention
    fly = all_rule_gate_specs() + [value_gate_spec(), gla.SPEC_GV, retention.SPEC]
    fly += [key_twin(value_gate_spec()), key_twin(gla.SPEC_GV)]
    return list(registered().values()) + fly


def option_sets(spec) -> list:
    """No option, each option alone (allow_neg_eigval with beta_sigmoid), all of them."""
    sup = sorted(spec.supports)
    one = lambda n: {n: True, **({"beta_sigmoid": True} if n == "allow_neg_eigval" else {})}  # noqa: E731
    sets = [{}] + [one(n) for n in sup] + ([{n: True for n in sup}] if len(sup) > 1 else [])
    return [Options(**s) for s in {tuple(sorted(s.items())): s for s in sets}.values()]


#: (K, V) of the forward and backward: the common heads, narrow ones, and the wide ones
#: the per-key gate and the additive rule run
HEADS = [(64, 64), (128, 128)]
WIDE_HEADS = [(256, 256), (128, 48), (64, 208)]
DTYPES = [("bfloat16", "float32", "bfloat16"), ("float16", "float16", "float32")]
#: (sequence chunk counts, plan config): short and long sequences, many chains, ragged
#: varlen, and the forced forms the probes and contracts use
SHAPES = [((2,), {}), ((64,), {}), ((16,) * 8, {}), ((1, 3, 9), {}), ((4,) * 64, {}),
          ((64,), {"fused": True}), ((64,), {"fused": False}), ((16,) * 8, {"fused": False}),
          ((4,) * 8, {"inverse_in_walk": 1}), ((64,), {"segments": 4})]
FLAGS = [dict(), dict(has_initial_state=True, output_final_state=True),
         dict(output_final_state=True, return_states=True), dict(save_states=True),
         dict(has_initial_state=True, output_final_state=True, return_states=True,
              states_only=True)]


def forward_configs(spec, out: dict) -> None:
    heads = HEADS + (WIDE_HEADS if spec.gate.value == "key" or spec.rule.value == "additive"
                     else [])
    HH = [(2, 4), (4, 4)] if spec.gva else [(4, 4)]
    for (K, V), (H, HV), (dt, gdt, bdt), opts, (sc, cfg), fl in itertools.product(
            heads, HH, DTYPES, option_sets(spec), SHAPES, FLAGS):
        try:
            p = chunk.forward_plan(spec, opts, H=H, HV=HV, K=K, V=V, dtype=dt, g_dtype=gdt,
                                   beta_dtype=bdt, seq_chunks=sc, Ttot=64 * sum(sc),
                                   config=cfg, **fl)
        except Exception:       # (a combination no call makes: the plan refuses it)
            continue
        for la in p.launches:
            out[(spec.name, la.stage, la.params)] = spec


def delta_backward_configs(spec, out: dict) -> None:
    """The delta rule's training backward (every gate) and, for DeltaNet, the contracts."""
    HH = [(2, 4), (4, 4)] if spec.gva else [(4, 4)]
    train = chunk_bwd.key_train_params if spec.gate.value == "key" else chunk_bwd.train_params
    for (K, V), (H, HV), (dt, _, _), chains, l2, dht, dh0 in itertools.product(
            HEADS + [(256, 256)], HH, DTYPES, (8, 512), (False, True), (False, True),
            (False, True)):
        for stage, params in train(H=H, HV=HV, K=K, V=V, dtype=dt, chains=chains, l2norm=l2,
                                   use_dht=dht, store_dh0=dh0, spec=spec).items():
            out[(spec.name, stage, tuple(sorted(params.items())))] = spec
    if spec.name not in ("deltanet", "gdn"):
        return
    for (K, V), (dt, _, _), B in itertools.product(HEADS, DTYPES, (1, 8)):
        made = chunk_bwd.wy_params(H=4, K=K, V=V, dtype=dt, B=B, L=300, spec=spec)
        if spec.name == "deltanet":
            made.update(chunk_bwd.forward_params(H=4, K=K, V=V, dtype=dt, B=B, L=300))
            made.update(chunk_bwd.backward_params(H=4, K=K, V=V, dtype=dt, B=B))
        for stage, params in made.items():
            out[(spec.name, stage, tuple(sorted(params.items())))] = spec


def additive_backward_configs(spec, out: dict) -> None:
    from linattn.ops.additive_bwd import backward_plan
    HH = [(2, 4), (4, 4)] if spec.gva else [(4, 4)]
    gate = spec.gate.value
    for (K, V), (H, HV), (dt, gdt, _), sc, grad, dht, dh0, st, cfg in itertools.product(
            HEADS + [(256, 512)], HH, DTYPES, [(4,) * 2, (64,) * 4, (16,) * 64],
            ("float32", "input"), (False, True), (False, True), ("float32", "input"),
            [{}, {"dstate_pass": "walk"}, {"dstate_pass": "scan"}]):
        p = AdditiveBackwardProblem(
            gate=gate, H=H, HV=HV, K=K, V=V, dtype=dt,
            g_dtype=gdt if gate != "none" else "float32",
            grad_dtype=dt if grad == "input" else grad, seq_chunks=sc, use_dht=dht,
            store_dh0=dh0, state_dtype=dt if st == "input" else st)
        try:
            bp = backward_plan(p, cfg)
        except Exception:
            continue
        for la in bp.launches:
            out[(spec.name, la.stage, la.params)] = spec


def recurrent_configs(spec, out: dict) -> None:
    HH = [(2, 4), (4, 4)] if spec.gva else [(4, 4)]
    pools = [{}, dict(state_pool=True, slot_dtype="int32", slots_per_token=False,
                      accepted_tokens=False),
             dict(state_pool=True, slot_dtype="int64", slots_per_token=True,
                  accepted_tokens=True, inplace=True)]
    for (K, V), (H, HV), (dt, gdt, bdt), opts, sdt, init, varlen, pool, N in itertools.product(
            HEADS + [(96, 96), (256, 128)], HH, DTYPES, option_sets(spec),
            ("float32", "bfloat16"), (False, True), (False, True), pools, (1, 16, 1024)):
        if pool and not init:
            continue
        problem = dict(H=H, HV=HV, K=K, V=V, dtype=dt, state_dtype=sdt,
                       l2norm_qk=opts.l2norm_qk, beta_sigmoid=opts.beta_sigmoid,
                       allow_neg_eigval=opts.allow_neg_eigval,
                       gate_in_kernel=opts.gate_in_kernel, state_v_first=opts.state_v_first,
                       has_initial_state=init, output_final_state=not pool.get("inplace"),
                       varlen=varlen, index_dtype="int32", **pool)
        if init and sdt != "float32":
            problem["h0_dtype"] = "float32"
        if spec.has_gate:
            problem["g_dtype"] = gdt
        if spec.has_beta:
            problem["beta_dtype"] = bdt
        params = {**get_arch(ARCH).tuning("recurrent", problem, {"N": N}), **problem}
        out[(spec.name, "recurrent", tuple(sorted(params.items())))] = spec


def configs() -> dict:
    """(spec name, stage, params) -> spec, every configuration the enumeration reaches
    (tens of thousands; :func:`pairwise` picks the ones lowered)."""
    out = {}
    for spec in all_specs():
        stages = {s.name for s in plan(spec, None, ARCH)}
        if spec.chunk_size == 64 and stages & {s.name for s in plan(spec, "fwd", ARCH)}:
            forward_configs(spec, out)
        if spec.rule.value == "delta" and spec.gate.value != "value":
            delta_backward_configs(spec, out)
        elif "chunk_bwd_dqkvg" in stages:
            additive_backward_configs(spec, out)
        recurrent_configs(spec, out)
    return out


def _pairs(params: tuple) -> set:
    items = sorted((k, json.dumps(v)) for k, v in params)
    return set(items) | set(itertools.combinations(items, 2))


def pairwise(cfgs: dict) -> dict:
    """Per (spec, stage), greedily the fewest configs in which every value of every
    build() param, and every pair of values of two params, that any config of the stage
    has occurs at least once (a few thousand configs instead of tens of thousands)."""
    groups = {}
    for key in sorted(cfgs, key=str):
        groups.setdefault(key[:2], []).append(key)
    out = {}
    for keys in groups.values():
        cand = [_pairs(k[2]) for k in keys]
        need = set().union(*cand)
        while need:
            best = max(range(len(keys)), key=lambda i: len(cand[i] & need))
            need -= cand[best]
            out[keys[best]] = cfgs[keys[best]]
    return out


def texts() -> dict:
    """"spec/stage" -> sha1 of the module as rendered now."""
    out = {}
    for spec in all_specs():
        for stage in plan(spec, None, ARCH):
            text = render_stage(spec, stage, ARCH, shipped=is_registered(spec))
            out[f"{spec.name}/{stage.name}"] = hashlib.sha1(text.encode()).hexdigest()
    return out


def _key(name, stage, params) -> str:
    return f"{name}|{stage}|{json.dumps(params, sort_keys=True)}"


def save_configs(path: str) -> None:
    every = configs()
    cfgs = pairwise(every)
    specs = {s.name: s.as_dict() for s in cfgs.values()}
    rows = [[n, st, dict(p)] for n, st, p in sorted(cfgs, key=str)]
    json.dump({"specs": specs, "configs": rows}, open(path, "w"), indent=0, sort_keys=True)
    print(f"{len(rows)} configs (pairwise of {len(every)}) of {len(specs)} specs -> {path}")


def lower_one(item):
    """(key, sha1 of the CUDA source) of one config (a worker process)."""
    import tilelang
    from tilelang import tvm
    from linattn.ops import runtime
    spec_dict, name, stage, params = item
    try:
        mod = runtime.stage_module(OpSpec(**spec_dict), stage, ARCH)
        target = tvm.target.Target(get_arch(ARCH).TARGET)
        with target, tvm.transform.PassContext(config=mod.pass_configs(**params) or {}):
            src = tilelang.lower(mod.build(**params), target=target).kernel_source
    except Exception as e:      # (recorded: an error is a result to compare too)
        src = f"error {type(e).__name__}: {e}"
    return _key(name, stage, params), hashlib.sha1(src.encode()).hexdigest()


def hash_configs(cfg_path: str, out_path: str, base_texts: str | None) -> None:
    import multiprocessing as mp
    data = json.load(open(cfg_path))
    rows = data["configs"]
    if base_texts:
        base, now = json.load(open(base_texts)), texts()
        changed = {k for k in now if base.get(k) != now[k]}
        print("modules whose text changed:", sorted(changed) or "none", flush=True)
        rows = [r for r in rows if f"{r[0]}/{r[1]}" in changed]
    print(len(rows), "configs to lower", flush=True)
    items = [(data["specs"][n], n, st, p) for n, st, p in rows]
    res = {}
    with mp.get_context("spawn").Pool(int(os.environ.get("HASH_WORKERS", "2"))) as pool:
        for key, digest in pool.imap_unordered(lower_one, items, chunksize=4):
            res[key] = digest
            if len(res) % 100 == 0:
                print(len(res), "lowered", flush=True)
    json.dump(res, open(out_path, "w"), indent=0, sort_keys=True)
    print("hashed", len(res), "->", out_path)


def compare(a_path: str, b_path: str) -> int:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    both = sorted(set(a) & set(b))
    differ = [k for k in both if a[k] != b[k]]
    for k in differ:
        print("DIFFERS", k)
    print(f"{len(both)} configs in both: {len(both) - len(differ)} equal, {len(differ)} "
          f"differ ({len(set(b) - set(a))} only in {b_path}, {len(set(a) - set(b))} only "
          f"in {a_path})")
    return 1 if differ else 0


def main(argv):
    cmd, args = argv[0], argv[1:]
    if cmd == "configs":
        save_configs(args[0])
    elif cmd == "texts":
        json.dump(texts(), open(args[0], "w"), indent=0, sort_keys=True)
    elif cmd == "hash":
        base = args[args.index("--changed") + 1] if "--changed" in args else None
        hash_configs(args[0], args[1], base)
    elif cmd == "compare":
        sys.exit(compare(args[0], args[1]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:] or ["help"])
