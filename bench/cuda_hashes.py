"""CUDA-source hashes of the stage configurations the chunked forward's plans launch, to
show that a template change leaves the kernels byte-identical (CPU only: TileLang lowers
for sm_90a, nothing is compiled by nvcc).

    python3 bench/cuda_hashes.py before.json               # configs from the plans now
    (change the templates / plans, linattn-gen)
    python3 bench/cuda_hashes.py after.json before.json [DROPPED_PARAM ...]
        # the same configs (params a change removed are dropped), then compare the files

The walk's four stages are left out (their CUDA is what a kernel change changes)."""
import hashlib
import itertools
import json
import sys

import tilelang
from tilelang import tvm
from linattn.ops import chunk, chunk_bwd
from linattn.ops.registry import get_spec
from linattn.dsl import Options, all_rule_gate_specs
SIX = {s.name: s for s in all_rule_gate_specs()}
WALK = {"chunk_kkt_inverse", "chunk_walk", "chunk_walk_map", "chunk_segment_combine"}
def configs():
    out = {}
    specs = [get_spec(n) for n in ("gdn", "deltanet", "kda", "gla")] + list(SIX.values())
    for spec in specs:
        sup = sorted(spec.supports)
        optsets = [Options(), Options(**{o: True for o in sup if o != "allow_neg_eigval" or "beta_sigmoid" in sup})]
        if "l2norm_qk" in sup: optsets.append(Options(l2norm_qk=True))
        HHs = [(2, 4)] if spec.gva else [(4, 4)]
        for (K, V), (H, HV), dt, opts, sc, init, fin, rs, cfg in itertools.product(
                [(64, 64), (128, 128)], HHs, ["bfloat16"], optsets,
                [(2,), (16,) * 8], [False, True], [True], [False, True],
                [{}, {"fused": True}, {"fused": False}]):
            if spec.gate.value == "key" and K > 128: continue
            try:
                p = chunk.forward_plan(spec, opts, H=H, HV=HV, K=K, V=V, dtype=dt, seq_chunks=sc,
                                       Ttot=sum(sc) * 64, beta_dtype=dt, has_initial_state=init,
                                       output_final_state=fin, return_states=rs, config=cfg)
            except Exception as e:
                continue
            for la in p.launches:
                if la.stage in WALK: continue
                out[(spec.name, la.stage, la.params)] = spec
    for K, V in [(64, 64), (128, 128)]:
        for dt in ("bfloat16", "float16"):
            for st, pr in chunk_bwd.forward_params(H=4, K=K, V=V, dtype=dt, B=2, L=300).items():
                if st in WALK: continue
                out[("deltanet", st, tuple(sorted(pr.items())))] = get_spec("deltanet")
    return out
def one(item):
    (name, stage, params), spec, drop = item
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    p = {k: v for k, v in params if k not in drop}
    mod = chunk.stage_module(spec, stage)
    with target:
        src = tilelang.lower(mod.build(**p), target=target).kernel_source
    return f"{name}|{stage}|{sorted(params)}", hashlib.sha1(src.encode()).hexdigest()
def from_json(path):
    import ast
    out = {}
    for key in json.load(open(path)):
        name, stage, params = key.split("|", 2)
        spec = SIX[name] if name in SIX else get_spec(name)
        out[(name, stage, tuple(ast.literal_eval(params)))] = spec
    return out
def main():
    import multiprocessing as mp
    args = sys.argv[2:]
    cfgs = from_json(args.pop(0)) if args and args[0].endswith(".json") else configs()
    drop = set(args)
    print(len(cfgs), "configs", flush=True)
    items = [(k, v, drop) for k, v in sorted(cfgs.items(), key=lambda x: str(x[0]))]
    with mp.get_context("spawn").Pool(2) as pool:
        res = dict(pool.map(one, items))
    json.dump(res, open(sys.argv[1], "w"), indent=0, sort_keys=True)
    print("done", len(res))
if __name__ == "__main__":
    main()
