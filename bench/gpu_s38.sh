#!/usr/bin/env bash
# Next session's device calls, back to back on one warm machine (it goes back after 30 s
# idle; a start may be refused: each refusal costs device time). Carry .gpu/site.tar.xz
# .gpu/prelude.sh .gpu/savecache.sh .gpu/mamba, and for `models` .whl (transformers, fla,
# kernels); for `tests` .gpu/xdist (pytest-xdist's two wheels) and the compile cache
# bench/cpu_cache.py built here for the six precompiling GPU test files
# (.gpu/cache.tar.xz.NN: with the tree under 64 MiB; .whl and the cache do not fit together).
# prelude.sh restores the cache; rebuild it with --keep after a template change:
#
#   PYTHONPATH=<dir holding linattn> python3 bench/cpu_cache.py -m gpu --keep \
#     tests/test_chunk_fwd_gpu.py tests/test_autograd_gpu.py tests/test_chunk_bwd_gpu.py \
#     tests/test_comba_gpu.py tests/test_gdn2_gpu.py tests/test_chunk_additive_gpu.py
#
# In this order (30 device minutes do not hold all; the first call also pays the start):
#   source .gpu/prelude.sh && bash bench/gpu_s38.sh combo   # ~8 min: the walk's inverse, Mamba-2
#   source .gpu/prelude.sh && bash bench/gpu_s38.sh walk    # ~6 min: batched rows, walk-vs
#   LINATTN_COMMIT=<sha> source .gpu/prelude.sh && bash bench/gpu_s38.sh models  # ~8 min
#   source .gpu/prelude.sh && bash bench/gpu_s38.sh ssdgen  # ~9 min: Mamba-2 and GDN-2 / Comba / DPLR rows (.whl)
#   source .gpu/prelude.sh && bash bench/gpu_s38.sh tests   # ~9.5 min: GPU tests s35/s36 left
#   source .gpu/prelude.sh && bash bench/probes_s32.sh decode   # ~4 min
#
# models: the two rows models_h200.json lacks under its ok rule: fla_gdn generate after the
#   recurrent kernel read A_log / dt_bias in their dtype (s36-3: 171.3 vs fla 167.8 ms;
#   expected ~166: two cast launches a decode call fewer) and Kimi Linear generate (s34-1's
#   row predates the ok rule). Cold, fla's autotuning takes ~110 s of a model's first call.
# tests: the decode kernel's tests first (bf16 / f16 A_log and dt_bias in the
#   gb_in_dtype cases), then every GPU test file that did not finish in s35-1, -v so a cut
#   run still names what ran. walk: the batched rows (one CTA a chain at block 128: 128 CTAs
#   on 132 SMs): walk-fused with its inverse left out (inverse_stub: X = I, a wrong answer;
#   ~420 us at 8x8192 would say the inverse's work is the step's excess over chunk_walk's
#   3.3 us, ~600 that the two-stage loads are), block 64, and the unfused walk; then the
#   value-split walk (chunk_walk_vs, plan config value_split): its GPU tests against fp64,
#   then timed (model: ~3.0 us a step, 8x8192 ~0.39-0.40 ms, tp4-8x1024 ~0.055).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn
W=$(ls .whl/*.whl 2>/dev/null || ls .gpu/xdist/*.whl 2>/dev/null)   # (.whl holds xdist too)
[ -n "$W" ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
  --target /tmp/whl $W > "$OUT/pip.txt" 2>&1
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
case ${1:?tests, walk, models, ssdgen, dplr or combo} in
  combo)   # one call when one is all there is: the walk's inverse split, k_first; Mamba-2 at HEAD
    $T 110 python3 -m pytest -m gpu -p no:cacheprovider -v --tb=short \
      tests/test_chunk_fwd_gpu.py -k "inverse_in_walk" > "$OUT/walk_tests.txt" 2>&1
    echo "walk tests rc=$?"
    $T 170 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      --configs default inverse_in_walk=1,k_first=1 inverse_in_walk=1,inverse_writeback=1 \
      inverse_in_walk=1,k_first=1,inverse_writeback=1 inverse_in_walk=1,inverse_stub=1 \
      inverse_in_walk=1,inverse_stub=2 inverse_in_walk=1,inverse_stub=3 \
      --out "$OUT/probe_walk.json" > "$OUT/probe_walk.log" 2>&1
    $T 230 python3 bench/ssd_probe.py --mamba-src .gpu/mamba \
      --out "$OUT/ssd_h200.json" > "$OUT/ssd_probe.txt" 2>&1
    echo "ssd rc=$?"
    grep -E "PASSED|FAILED|passed|failed" "$OUT/walk_tests.txt" | tail -n 9
    tail -n 12 "$OUT"/probe_walk.log; grep -v '^{' "$OUT/ssd_probe.txt" | tail -n 6 ;;
  ssdgen)  # Mamba-2 vs mamba_ssm (kernels named per row), then the generalized rules vs fla
    $T 230 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --out "$OUT/ssd_h200.json" \
      > "$OUT/ssd_probe.txt" 2>&1
    echo "ssd rc=$?"
    $T 300 python3 bench/generalized_probe.py --out "$OUT/generalized_h200.json" \
      > "$OUT/generalized_probe.txt" 2>&1
    echo "generalized rc=$?"
    grep -v '^{' "$OUT/ssd_probe.txt" | tail -n 6; tail -n 8 "$OUT/generalized_probe.txt" ;;
  models)
    $T 280 python3 bench/models_bench.py --out "$OUT/models_gdn.json" --models fla_gdn \
      --tasks generate > "$OUT/models_gdn.txt" 2>&1
    echo "fla_gdn generate rc=$?"
    $T 250 python3 bench/models_bench.py --out "$OUT/models_kimi.json" --models kimi_linear \
      --tasks generate > "$OUT/models_kimi.txt" 2>&1
    echo "kimi_linear generate rc=$?"
    grep -h '^{' "$OUT"/models_gdn.txt "$OUT"/models_kimi.txt | cut -c1-400 ;;
  dplr)   # the dplr rule's chunked forward: its GPU tests, then timed against fla; sm80 tests
    $T 150 python3 -m pytest -m gpu -p no:cacheprovider -n 4 -v --tb=short \
      tests/test_chunk_dplr_gpu.py > "$OUT/dplr_tests.txt" 2>&1
    echo "dplr tests rc=$?"
    $T 170 python3 bench/generalized_probe.py --families dplr,rwkv7,iplr --rows '*/prefill-*' \
      --out "$OUT/generalized_dplr.json" > "$OUT/generalized_dplr.txt" 2>&1
    echo "dplr probe rc=$?"
    gpu_tests 200 tests/test_sm80_gpu.py
    grep -E "PASSED|FAILED|passed|failed" "$OUT/dplr_tests.txt" | tail -n 12
    tail -n 4 "$OUT/generalized_dplr.txt"; grep -E "passed|failed|rc=" "$OUT/tests.txt" ;;
  tests)
    gpu_tests 100 tests/test_decode_gpu.py
    gpu_tests 80 tests/test_sm80_gpu.py
    gpu_tests 80 tests/test_mamba2_gpu.py tests/test_state_threads_gpu.py
    gpu_tests 100 tests/test_dplr_gpu.py tests/test_comba_gpu.py tests/test_gdn2_gpu.py
    gpu_tests 100 tests/test_chunk_fwd_gpu.py tests/test_chunk_additive_gpu.py
    gpu_tests 100 tests/test_chunk_bwd_gpu.py tests/test_autograd_gpu.py
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 40 ;;
  walk)   # the probes first; the value-split walk (never run on a GPU yet) after, its tests first
    $T 150 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      --configs default inverse_in_walk=1,inverse_stub=1 block_v=64 inverse_in_walk=0 \
      --out "$OUT/probe_blocks.json" > "$OUT/probe_blocks.log" 2>&1
    $T 120 python3 -m pytest -m gpu -p no:cacheprovider -v --exhaustive --tb=short \
      tests/test_chunk_fwd_gpu.py -k value_split > "$OUT/vs_tests.txt" 2>&1
    echo "value_split tests rc=$?"
    $T 120 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      q35-2b-8x8192-trained --configs value_split=1 --out "$OUT/probe_vs.json" \
      > "$OUT/probe_vs.log" 2>&1
    grep -E "PASSED|FAILED|passed|failed" "$OUT/vs_tests.txt" | tail -n 10
    tail -n 8 "$OUT"/probe_blocks.log "$OUT"/probe_vs.log ;;
esac
