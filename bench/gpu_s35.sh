#!/usr/bin/env bash
# Session 35's device calls, back to back on one warm machine (the machine goes back after
# 30 s idle). Carry .gpu/site.tar.xz .gpu/prelude.sh .gpu/savecache.sh .gpu/mamba
# .gpu/gfold.tar.xz .whl (~49 MiB):
#
#   source .gpu/prelude.sh && bash bench/gpu_s35.sh tests    # ~9 min: merged code's GPU tests
#   source .gpu/prelude.sh && bash bench/gpu_s35.sh prefill  # ~9 min: h-gfold A/B, probes_s32 prefill
#   source .gpu/prelude.sh && bash bench/gpu_s35.sh models   # ~9 min: test_models_gpu, 2 models timed
#   source .gpu/prelude.sh && bash bench/gpu_s35.sh probes   # ~5 min: ssd, generalized
#
# Compile caches built without a GPU: bench/cpu_cache.py -m gpu FILES writes .gpu/cache.tar.xz.NN
# (carry them too; prelude.sh unpacks them into TILELANG_CACHE_DIR before the tests run).
# .gpu/abtree.tar.xz is probes_s32's baseline tree (bench/ab_tree.sh 97bf4ed /tmp/abtree;
# tar -C /tmp -cJf .gpu/abtree.tar.xz abtree), unpacked here as abtree/.
# .gpu/gfold.tar.xz is branch h-gfold's package (bench/ab_tree.sh h-gfold /tmp/gf; tar -C /tmp
# -cJf .gpu/gfold.tar.xz gf), imported as linattn from /tmp/lp-gf.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn
BASE_PP=$PYTHONPATH
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/whl .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/lp:$BASE_PP:/tmp/whl
export OUT_DIR=/tmp/out_dir HF_HUB_OFFLINE=1 MAMBA_SRC=$PWD/.gpu/mamba; mkdir -p /tmp/out_dir
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
T="timeout -k 10"
gpu_tests() {  # log seconds args...
  local log=$1 s=$2; shift 2
  echo "== $* ($s s)" >> "$OUT/$log"
  $T "$s" python3 -m pytest -m gpu -p no:cacheprovider -n 8 -v -rfE --tb=short "$@" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|^E |passed|failed|skipped" >> "$OUT/$log"
  echo "rc=${PIPESTATUS[0]}" >> "$OUT/$log"
}
case ${1:?tests, models or probes} in
  tests)
    gpu_tests tests.txt 110 tests/test_sm80_gpu.py
    gpu_tests tests.txt 80 tests/test_dplr_gpu.py tests/test_comba_gpu.py tests/test_gdn2_gpu.py
    gpu_tests tests.txt 110 tests/test_mamba2_gpu.py tests/test_state_threads_gpu.py
    gpu_tests tests.txt 100 tests/test_chunk_fwd_gpu.py tests/test_chunk_additive_gpu.py
    gpu_tests tests.txt 100 tests/test_chunk_bwd_gpu.py tests/test_autograd_gpu.py
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 40 ;;
  models)
    $T 330 python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --tb=short -s \
      tests/test_models_gpu.py > "$OUT/models_tests.txt" 2>&1
    echo "models tests rc=$?"
    $T 200 python3 bench/models_bench.py --out "$OUT/models.json" --budget-s 120 \
      --models fla_gdn qwen3_next > "$OUT/models.txt" 2>&1
    echo "models bench rc=$?"
    grep -E "PASSED|FAILED|ERROR|passed|failed|precompiled" "$OUT/models_tests.txt" | tail -n 30
    tail -n 12 "$OUT/models.txt" ;;
  prefill)
    mkdir -p /tmp/lp-gf && tar -xJf .gpu/gfold.tar.xz -C /tmp && ln -sfn /tmp/gf /tmp/lp-gf/linattn
    (cd /tmp/gf && PYTHONPATH=/tmp/lp-gf:$BASE_PP:/tmp/whl $T 150 python3 -m pytest -m gpu \
      -p no:cacheprovider -n 8 -v -rfE --tb=short tests/test_autograd_gpu.py -k gdn 2>&1 \
      | grep -E "FAILED|ERROR|^E |passed|failed" > "$OUT/gfold_tests.txt")
    for tree in main gf; do
      pp=/tmp/lp; [ $tree = gf ] && pp=/tmp/lp-gf
      PYTHONPATH=$pp:$BASE_PP:/tmp/whl $T 90 python3 bench/train_probe.py --ops GDNTrain \
        --workload qwen3-next-4k --iters 10 --impls linattn > "$OUT/gfold_$tree.txt" 2>&1
    done
    tail -n 4 "$OUT/gfold_tests.txt"; tail -n 6 "$OUT"/gfold_main.txt "$OUT"/gfold_gf.txt
    rm -rf abtree && tar -xJf .gpu/abtree.tar.xz && OUT=$OUT bash bench/probes_s32.sh prefill
    ;;
  probes)
    $T 130 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --out "$OUT/ssd_h200.json" \
      > "$OUT/ssd_probe.txt" 2>&1
    $T 130 python3 bench/generalized_probe.py --out "$OUT/generalized_h200.json" \
      > "$OUT/generalized_probe.txt" 2>&1
    tail -n 12 "$OUT"/ssd_probe.txt "$OUT"/generalized_probe.txt ;;
esac
