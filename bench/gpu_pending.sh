#!/usr/bin/env bash
# What merged code still needs from a GPU (written at the end of session 34), one device
# call a part, in priority order. Carry .gpu/site.tar.xz .gpu/prelude.sh .gpu/savecache.sh
# .gpu/mamba .whl (48 MiB); start each call immediately after the last (the machine goes
# back after 30 s idle):
#
#   source .gpu/prelude.sh && bash bench/gpu_pending.sh tests      # ~9 min, correctness
#   source .gpu/prelude.sh && bash bench/gpu_pending.sh probes     # ~8 min, speed
#   source .gpu/prelude.sh && bash bench/gpu_pending.sh models     # ~9 min
#
# tests: every GPU test file whose code changed since its last GPU pass (sm80 kernels on
#   this card, DPLR / IPLR, Comba's and GDN-2's chunked prefill, Mamba-2's call terms in
#   the kernels, the fused pass at two warpgroups, the additive forward whose templates
#   took the terms, DeltaNet's folded backward at walk depth 3, training), each file under
#   its own limit, -v so a cut run still names what failed.
# probes: the walk's variants on deltanet-1.3b-train (not reached in s34-3), Mamba-2 vs
#   mamba_ssm with the plan variants (state_threads, aqk_per_key_head), the generalized
#   families vs fla.
# models: Kimi Linear, an fla GDN model, Qwen3-Next (bench/models_bench.py).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/whl .whl/*.whl \
  >/dev/null 2>&1; export PYTHONPATH=$PYTHONPATH:/tmp/whl
# per-worker JSON summaries stay off $OUT (8 files come back)
export OUT_DIR=/tmp/out_dir HF_HUB_OFFLINE=1 MAMBA_SRC=$PWD/.gpu/mamba; mkdir -p /tmp/out_dir
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
T="timeout -k 10"
gpu_tests() {  # seconds files...
  local s=$1; shift
  $T "$s" python3 -m pytest -m gpu -p no:cacheprovider -n 8 -v -rfE --tb=short "$@" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|^E |passed|failed" >> "$OUT/tests.txt"
}
case ${1:?tests, probes or models} in
  tests)
    gpu_tests 100 tests/test_sm80_gpu.py tests/test_dplr_gpu.py
    gpu_tests 100 tests/test_comba_gpu.py tests/test_gdn2_gpu.py
    gpu_tests 120 tests/test_mamba2_gpu.py tests/test_state_threads_gpu.py
    gpu_tests 120 tests/test_chunk_fwd_gpu.py tests/test_chunk_additive_gpu.py
    gpu_tests 100 tests/test_chunk_bwd_gpu.py tests/test_autograd_gpu.py
    grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.txt" | tail -n 40 ;;
  probes)
    $T 100 python3 bench/chunk_bwd_probe.py --iters 20 --no-fla --precompile \
      --only deltanet-1.3b-train-bf16 train-4k-bf16 --sweep-on deltanet-1.3b-train-bf16 \
      train-4k-bf16 > "$OUT/walk_sweep.txt" 2>&1
    $T 200 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --out "$OUT/ssd_h200.json" \
      > "$OUT/ssd_probe.txt" 2>&1
    $T 200 python3 bench/generalized_probe.py --out "$OUT/generalized_h200.json" \
      > "$OUT/generalized_probe.txt" 2>&1
    tail -n 12 "$OUT"/walk_sweep.txt "$OUT"/ssd_probe.txt "$OUT"/generalized_probe.txt ;;
  models)
    $T 560 python3 bench/models_bench.py --out "$OUT/models.json" --budget-s 400 \
      --models kimi_linear fla_gdn qwen3_next > "$OUT/models.txt" 2>&1
    tail -n 20 "$OUT/models.txt" ;;
esac
[ -n "${SAVE:-}" ] && source .gpu/savecache.sh
