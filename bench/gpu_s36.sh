#!/usr/bin/env bash
# Next session's device calls, back to back on one warm machine (it goes back after 30 s
# idle; a start may be refused: each refusal costs device time). Carry .gpu/site.tar.xz
# .gpu/prelude.sh .gpu/savecache.sh .gpu/mamba, for `tests` .gpu/xdist (pytest-xdist's two
# wheels) and the compile cache bench/cpu_cache.py built here for the six precompiling GPU
# test files (.gpu/cache.tar.xz.00 and .01, 15.3 MiB: 64 MiB in all with the tree), for
# `models` .whl instead of the cache (transformers, fla, kernels). prelude.sh restores the
# cache; rebuild it with --keep after a template change (only changed kernels compile):
#
#   PYTHONPATH=<dir holding linattn> python3 bench/cpu_cache.py -m gpu --keep \
#     tests/test_chunk_fwd_gpu.py tests/test_autograd_gpu.py tests/test_chunk_bwd_gpu.py \
#     tests/test_comba_gpu.py tests/test_gdn2_gpu.py tests/test_chunk_additive_gpu.py
#
# pytest runs 6 workers: each worker's module fixture starts its own compile pool even
# when every job is a cache hit.
#
#   source .gpu/prelude.sh && bash bench/gpu_s36.sh tests    # ~9 min: GPU tests s35 left
#   source .gpu/prelude.sh && bash bench/gpu_s36.sh walk     # ~4 min: the fused walk's k_ahead
#   source .gpu/prelude.sh && bash bench/gpu_s36.sh models   # ~9 min: models, tests and rows
#   source .gpu/prelude.sh && bash bench/probes_s32.sh decode   # ~4 min
#
# tests: every GPU test file that did not finish or failed in s35-1 (sm80 with retention's
#   fixed reference, Mamba-2's training and the two-warpgroup pass, DPLR / Comba / GDN-2,
#   the forward with walk-fused as the default and k_ahead's cases, additive, backward,
#   autograd), -v so a cut run still names what ran. walk: walk_probe of the batched rows
#   (walk-fused by default) against k_ahead (bench/LOG.md session 35: 617 -> ~430-460 us
#   expected at q35-2b-8x8192), and the split rows for the table. models: the models'
#   GPU tests s35-3 did not reach, then Kimi Linear, an fla GDN model and Qwen3-Next timed.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn
W=$(ls .whl/*.whl .gpu/xdist/*.whl 2>/dev/null)
[ -n "$W" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/whl \
  $W >/dev/null 2>&1
export PYTHONPATH=/tmp/lp:$PYTHONPATH:/tmp/whl
export OUT_DIR=/tmp/out_dir HF_HUB_OFFLINE=1 MAMBA_SRC=$PWD/.gpu/mamba; mkdir -p /tmp/out_dir
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
T="timeout -k 10"
gpu_tests() {  # seconds args...: PASSED / FAILED lines as they come, the summary, rc
  local s=$1; shift
  echo "== $* ($s s)" >> "$OUT/tests.txt"
  $T "$s" python3 -m pytest -m gpu -p no:cacheprovider -n 6 -v -rfE --tb=line "$@" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|^E |passed|failed|skipped|precompiled" >> "$OUT/tests.txt"
  echo "rc=${PIPESTATUS[0]}" >> "$OUT/tests.txt"
}
case ${1:?tests, walk or models} in
  tests)
    gpu_tests 90 tests/test_sm80_gpu.py
    gpu_tests 90 tests/test_mamba2_gpu.py tests/test_state_threads_gpu.py
    gpu_tests 110 tests/test_dplr_gpu.py tests/test_comba_gpu.py tests/test_gdn2_gpu.py
    gpu_tests 110 tests/test_chunk_fwd_gpu.py tests/test_chunk_additive_gpu.py
    gpu_tests 110 tests/test_chunk_bwd_gpu.py tests/test_autograd_gpu.py
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 40 ;;
  walk)
    $T 200 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      q35-2b-8x8192-trained --configs default inverse_in_walk=1,k_ahead=1 \
      --out "$OUT/probe_ahead.json" > "$OUT/probe_ahead.log" 2>&1
    $T 150 python3 bench/walk_probe.py --iters 10 --only prefill-4k q35-2b-16384 \
      q35-397b-tp8-8192 q35-397b-tp1-65536 deltanet-16k-k64 --out "$OUT/probe_split.json" \
      > "$OUT/probe_split.log" 2>&1
    tail -n 8 "$OUT"/probe_ahead.log "$OUT"/probe_split.log ;;
  models)   # the bench first (a third model for models_h200.json), then the tests it needs
    $T 250 python3 bench/models_bench.py --out "$OUT/models.json" --budget-s 170 \
      --models fla_gdn qwen3_next > "$OUT/models.txt" 2>&1
    echo "models bench rc=$?"
    $T 300 python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --tb=short -s \
      tests/test_models_gpu.py -k "kimi_linear or fla_gdn" > "$OUT/models_tests.txt" 2>&1
    echo "models tests rc=$?"
    grep -E "PASSED|FAILED|ERROR|passed|failed|precompiled" "$OUT/models_tests.txt" | tail -n 30
    tail -n 12 "$OUT/models.txt" ;;
esac
