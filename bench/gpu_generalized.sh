#!/usr/bin/env bash
# The generalized delta rules on one GPU, one call (at most 7 minutes: 210 s + 210 s caps):
# the GPU tests of Comba and GDN-2 (their chunked kernels; kernels precompiled in parallel
# by each module's fixture),
# then linattn against fla side by side (bench/generalized_probe.py; its rows go to
# $OUT/generalized_h200.json, the file bench/results/generalized_h200.json takes):
#   source .gpu/prelude.sh && bash bench/gpu_generalized.sh
# carry: .gpu/site.tar.xz .gpu/prelude.sh (as bench/gpu_s34.sh).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
export OUT_DIR=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
T="timeout -k 10"
$T ${TESTS_S:-210} python3 -m pytest -q -m gpu -p no:cacheprovider -n 2 --dist loadfile -rfE \
  tests/test_comba_gpu.py tests/test_gdn2_gpu.py > "$OUT/tests_generalized.txt" 2>&1
echo "tests rc=$?"
$T ${PROBE_S:-210} python3 bench/generalized_probe.py --out "$OUT/generalized_h200.json" \
  > "$OUT/generalized_probe.txt" 2>&1
echo "probe rc=$?"
tail -n 20 "$OUT/tests_generalized.txt"; tail -n 20 "$OUT/generalized_probe.txt"
