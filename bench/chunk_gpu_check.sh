#!/usr/bin/env bash
# GPU check of the chunked forward: correctness tests, then the timing probe.
#   bash bench/chunk_gpu_check.sh [tests|probe|sweep|all]     (default: all)
# Logs and JSON go to $OUT (default /tmp/chunk_gpu). Each part runs even if another fails.
set -u
OUT=${OUT:-/tmp/chunk_gpu}
mkdir -p "$OUT"
# compiled kernels under build/ (git-ignored) survive between runs on a warm machine
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/build/tilelang_cache}
what=${1:-all}
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -rfE --durations=8 tests/test_chunk_fwd_gpu.py \
    --junitxml="$OUT/chunk_gpu_junit.xml" > "$OUT/chunk_gpu_pytest.txt" 2>&1 || rc=1
  grep -E "precompiled|compile error" "$OUT/chunk_gpu_pytest.txt" | head -20
  tail -45 "$OUT/chunk_gpu_pytest.txt"
fi
if [[ $what == probe || $what == all ]]; then
  python3 bench/chunk_probe.py --iters 30 > "$OUT/chunk_probe.txt" 2>&1 || rc=1
  tail -12 "$OUT/chunk_probe.txt"
fi
if [[ $what == sweep ]]; then
  python3 bench/chunk_probe.py --iters 30 --sweep --only prefill-4k q35-397b-tp8-8192 \
    > "$OUT/chunk_probe_sweep.txt" 2>&1 || rc=1
  grep -E "bv|column|blocked|fragment" "$OUT/chunk_probe_sweep.txt" | cut -c1-200
  tail -6 "$OUT/chunk_probe_sweep.txt"
fi
exit $rc
