#!/usr/bin/env bash
# GPU check of the DeltaNet chunk contracts (ops/chunk_bwd.py): correctness tests, then
# the timing probe vs fla.
#   bash bench/chunk_bwd_gpu_check.sh [tests|probe|all]     (default: all)
# Logs and JSON go to $OUT (default /tmp/chunk_bwd_gpu). Each part runs even if another fails.
set -u
OUT=${OUT:-/tmp/chunk_bwd_gpu}
export OUT
mkdir -p "$OUT"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/build/tilelang_cache}
what=${1:-all}
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -rfE --durations=8 tests/test_chunk_bwd_gpu.py \
    --junitxml="$OUT/chunk_bwd_gpu_junit.xml" > "$OUT/chunk_bwd_gpu_pytest.txt" 2>&1 || rc=1
  grep -E "precompiled|compile error" "$OUT/chunk_bwd_gpu_pytest.txt" | head -20
  tail -40 "$OUT/chunk_bwd_gpu_pytest.txt"
fi
if [[ $what == probe || $what == all ]]; then
  python3 bench/chunk_bwd_probe.py --iters 20 > "$OUT/chunk_bwd_probe.txt" 2>&1 || rc=1
  tail -60 "$OUT/chunk_bwd_probe.txt"
fi
exit $rc
