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
# In this order (30 device minutes do not hold all; the first call also pays the start,
# ~3.5 min):
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh combo   # ~7 min: the fused walk, Mamba-2 train
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh walk    # ~7 min: split rows, value_split
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh ssdgen  # ~9 min: Mamba-2 and GDN-2 / Comba / DPLR rows (.whl)
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh dplr    # ~9 min: tests, IPLR direct, DPLR / IPLR per kernel
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh train   # ~5 min: GDN / DeltaNet training per kernel
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh ssddecode  # ~4 min: Mamba-2 decode tiles
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh gates   # ~9 min: the gates table, linattn vs fla
#   source .gpu/prelude.sh && bash bench/gpu_s39.sh tests   # ~9.5 min: GPU tests
#   source .gpu/prelude.sh && bash bench/probes_s32.sh decode   # ~4 min
#
# combo: the fused walk's GPU cases first, then walk_probe. s38-1 (H100): default 619.5 /
#   86.9 us at 8x8192 / tp4-8x1024, the inverse left out (inverse_stub=1) 406.5 / 57.0.
#   (Its k ring of three stages and the tf32 mma.sync inverse lost in s40-1 and were
#   deleted: bench/LOG.md.)
#   Then Mamba-2's training rows (s38-1: 3.71 / 7.21 ms vs mamba_ssm 1.64 / 3.11).
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
case ${1:?tests, walk, dplr, gates, train, models, ssdgen, ssddecode or combo} in
  combo)   # the fused walk (its cases, then timed), Mamba-2's training rows
    $T 200 python3 -m pytest -m gpu -p no:cacheprovider -n 6 -v --tb=short \
      tests/test_chunk_fwd_gpu.py > "$OUT/walk_tests.txt" 2>&1
    echo "walk tests rc=$?"
    gpu_tests 110 tests/test_chunk_dplr_gpu.py
    grep -E "FAILED|passed|failed|rc=" "$OUT/tests.txt" | tail -n 5
    $T 170 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      q35-2b-8x8192-trained --configs default inverse_in_walk=1,inverse_stub=1 \
      --out "$OUT/probe_walk.json" > "$OUT/probe_walk.log" 2>&1
    grep -E "FAILED|passed|failed" "$OUT/walk_tests.txt" | tail -n 9
    tail -n 12 "$OUT"/probe_walk.log ;;
  ssdgen)  # Mamba-2 vs mamba_ssm (kernels named per row), then the generalized rules vs fla
    $T 230 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --out "$OUT/ssd_h200.json" \
      > "$OUT/ssd_probe.txt" 2>&1
    echo "ssd rc=$?"
    $T 300 python3 bench/generalized_probe.py --out "$OUT/generalized_h200.json" \
      > "$OUT/generalized_probe.txt" 2>&1
    echo "generalized rc=$?"
    grep -v '^{' "$OUT/ssd_probe.txt" | tail -n 6; tail -n 8 "$OUT/generalized_probe.txt" ;;
  ssddecode)  # Mamba-2 decode's tile (s38-1: 0.76x mamba_ssm at b1, 7.2 vs 5.4 us; 0.94x at
              # b256): the arch's (b1: 1024 one-warp CTAs, 32 states a lane) against wider CTAs
    $T 280 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --rows 'decode-*' \
      --out "$OUT/ssd_decode_tiles.json" --decode-tiles \
      "block_v=8,threads=32,vec=4,warps_k=1" "block_v=8,threads=64,vec=4,warps_k=1" \
      "block_v=8,threads=128,vec=4,warps_k=1" "block_v=16,threads=64,vec=8,warps_k=1" \
      "block_v=16,threads=128,vec=4,warps_k=1" "block_v=32,threads=256,vec=4,warps_k=1" \
      > "$OUT/ssd_decode_tiles.txt" 2>&1
    echo "ssd decode tiles rc=$?"; grep -v '^{' "$OUT/ssd_decode_tiles.txt" | tail -n 4 ;;
  models)
    $T 280 python3 bench/models_bench.py --out "$OUT/models_gdn.json" --models fla_gdn \
      --tasks generate > "$OUT/models_gdn.txt" 2>&1
    echo "fla_gdn generate rc=$?"
    $T 250 python3 bench/models_bench.py --out "$OUT/models_kimi.json" --models kimi_linear \
      --tasks generate > "$OUT/models_kimi.txt" 2>&1
    echo "kimi_linear generate rc=$?"
    grep -h '^{' "$OUT"/models_gdn.txt "$OUT"/models_kimi.txt | cut -c1-400 ;;
  dplr)    # the chunked DPLR GPU tests (the prepare's gate loads; iplr_direct's stage), the
           # DPLR / IPLR prefill rows per kernel at 128 and 256 threads, IPLR with iplr_direct
           # (chunk_prepare_iplr: the pairs as four GEMMs, 88 KB, two CTAs an SM; model: the
           # prepare ~51 -> ~25 us a CTA, 4k ~0.58 -> ~0.30 ms against fla's 0.375)
    $T 110 python3 bench/generalized_probe.py --families iplr --rows '*/prefill-*' \
      --config iplr_direct=1 --out "$OUT/generalized_iplr_direct.json" \
      > "$OUT/generalized_iplr_direct.txt" 2>&1
    echo "iplr_direct rc=$?"; tail -n 3 "$OUT/generalized_iplr_direct.txt"
    for t in 128 256; do
      $T 140 python3 bench/generalized_probe.py --families dplr,iplr --rows '*/prefill-*4k*' \
        --config prepare_threads=$t --out "$OUT/generalized_dplr_$t.json" \
        > "$OUT/generalized_dplr_$t.txt" 2>&1
      echo "dplr threads $t rc=$?"; tail -n 3 "$OUT/generalized_dplr_$t.txt"
    done
    $T 150 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --rows 'train-*' \
      --out "$OUT/ssd_train.json" > "$OUT/ssd_probe.txt" 2>&1
    echo "ssd train rc=$?"; grep -v '^{' "$OUT/ssd_probe.txt" | tail -n 4 ;;
  gates)   # issue 45's gates table (trained-model gates, gate in the kernel, none): linattn vs fla
    $T 540 python3 -m linattn.cli.bench --workloads-json bench/workloads/gates.json --impl linattn,fla \
      --budget-s 500 --out "$OUT/gates_h200.json" > "$OUT/gates.txt" 2>&1
    echo "gates rc=$?"; tail -n 20 "$OUT/gates.txt" ;;
  train)   # GDN's training step against fla's, per kernel (the models' attention kernels
           # lose: fla_gdn 29.5 vs 21.0 ms, Qwen3.5 21.3 vs 15.6)
    $T 280 python3 bench/train_probe.py --ops GDNTrain DeltaNetTrain --workload '*-4k' \
      --budget-s 250 > "$OUT/train_probe.txt" 2>&1
    echo "train rc=$?"; tail -n 30 "$OUT/train_probe.txt" ;;
  tests)
    gpu_tests 100 tests/test_decode_gpu.py
    gpu_tests 80 tests/test_sm80_gpu.py
    gpu_tests 80 tests/test_mamba2_gpu.py tests/test_state_threads_gpu.py
    gpu_tests 100 tests/test_dplr_gpu.py tests/test_comba_gpu.py tests/test_gdn2_gpu.py
    gpu_tests 100 tests/test_chunk_fwd_gpu.py tests/test_chunk_additive_gpu.py
    gpu_tests 100 tests/test_chunk_bwd_gpu.py tests/test_autograd_gpu.py
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 40 ;;
  walk)   # the split rows; value_split once more
    $T 200 python3 bench/walk_probe.py --iters 10 --only q35-2b-16384 q35-397b-tp1-65536 \
      q35-397b-tp8-8192 prefill-4k deltanet-16k-k64 --configs default \
      --out "$OUT/probe_split.json" > "$OUT/probe_split.log" 2>&1
    $T 120 python3 -m pytest -m gpu -p no:cacheprovider -v --exhaustive --tb=short \
      tests/test_chunk_fwd_gpu.py -k value_split > "$OUT/vs_tests.txt" 2>&1
    echo "value_split tests rc=$?"
    $T 120 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      q35-2b-8x8192-trained --configs default value_split=1 \
      --out "$OUT/probe_vs.json" \
      > "$OUT/probe_vs.log" 2>&1
    grep -E "PASSED|FAILED|passed|failed" "$OUT/vs_tests.txt" | tail -n 10
    tail -n 10 "$OUT"/probe_split.log "$OUT"/probe_vs.log ;;
esac
cp -r /tmp/out_dir/. "$OUT/" 2>/dev/null   # (the tests' JSON summaries)
