#!/usr/bin/env bash
# Session 41's device calls, back to back on one warm machine (it goes back after 30 s
# idle; a start may be refused: each refusal costs device time; a call returns at most 8
# files). Carry .gpu/site.tar.xz .gpu/prelude.sh .gpu/savecache.sh .gpu/mamba .gpu/xdist,
# and for `verify` the compile cache bench/cpu_cache.py builds here (.gpu/cache.tar.xz.NN;
# without it a precompiling GPU test file does not finish in 9 min: run s40-3):
#
#   PYTHONPATH=<dir holding linattn> python3 bench/cpu_cache.py -m gpu tests/test_chunk_fwd_gpu.py
#
# In this order (the first call also pays the start, ~3.5 min):
#   source .gpu/prelude.sh && bash bench/gpu_s41.sh verify  # ~6 min: changed defaults' GPU tests
#   source .gpu/prelude.sh && bash bench/gpu_s41.sh decode  # ~5 min: decode tiles at b >= 64
#   source .gpu/prelude.sh && bash bench/gpu_s41.sh ncu     # ~4 min: the batched walk under ncu
#   source .gpu/prelude.sh && bash bench/gpu_s41.sh ssd     # ~8 min: Mamba-2 rows at HEAD
#   source .gpu/prelude.sh && bash bench/gpu_s41.sh gen     # ~8 min: generalized rules, decode too
#   source .gpu/prelude.sh && bash bench/gpu_s41.sh walk | train | gates | tests | models
#
# (.gpu/cache.tar.xz.00, 2.1 MiB, built at a1e3cb0 for test_chunk_fwd_gpu.py's 130 kernels;
# rebuild after a forward template change.)
# verify: the defaults changed since their last GPU test: the right-looking diagonal pass
#   in chunk_kkt_inverse (the split plans), Mamba-2's D read per head (skip_per_head), its
#   decode tile (16 value rows a CTA from batch 8) and dqkvg's GVA sums by atomic adds
#   (test_chunk_scan_combined_gradients, G = 1 and 8).
# decode: issue 45's copy ceiling (>= 95 % at batch >= 64; s32: GDN 93 %, the table's
#   q35-gva-decode-b64 83 %): decode_probe's K-first candidates of 16 state values a
#   thread beside the arch's tile (Mamba-2's value-first decode gained 7-14 % at 16, s40-6),
#   and session 32's never-timed DECODE_FULL_GRID rule (3 CTAs an SM; its ring of 4 tiles a
#   CTA was timed and deleted: bench/LOG.md).
# ncu: where the batched walk's step goes (8x8192: 606 us, 406 with X = I; the seed
#   release's step ~2.9 us against our ~4.7).
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
case ${1:?first, verify, decode, ncu, ssd, gen, tests, walk, gates, train or models} in
  first)   # verify's first file set and the fused walk's time with the inverse free, one call
    gpu_tests 290 tests/test_chunk_fwd_gpu.py tests/test_mamba2_gpu.py
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 12
    $T 170 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      --configs default inverse_stub=1 \
      --out "$OUT/probe_stub.json" > "$OUT/probe_stub.log" 2>&1
    echo "walk rc=$?"; tail -n 12 "$OUT/probe_stub.log" ;;
  second)  # Mamba-2's terms in dqkvg (gradients), then decode tiles at b >= 64
    gpu_tests 100 tests/test_mamba2_gpu.py -k gradients
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 8
    R="GDNFwd/q35-gva-decode-b64/bf16,GDNFwd/q35-gva-decode-b256/bf16"
    R="$R,KDAFwd/kda-tp1-decode-b64/bf16,KDAFwd/kda-tp8-decode-b256/bf16"
    $T 250 python3 bench/decode_probe.py --no-fla --rows "$R" --configs \
      "block_v=16,threads=128,vec=4,warps_k=4" "block_v=8,threads=64,vec=4,warps_k=2" \
      "ctas_per_sm=3" --out "$OUT/decode_tiles.json" > "$OUT/decode_tiles.txt" 2>&1
    echo "decode rc=$?"; tail -n 14 "$OUT/decode_tiles.txt" ;;
  verify)
    gpu_tests 330 tests/test_chunk_fwd_gpu.py tests/test_mamba2_gpu.py
    gpu_tests 100 tests/test_decode_gpu.py
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 20 ;;
  decode)
    R="GDNFwd/q35-gva-decode-b64/bf16,GDNFwd/q35-gva-decode-b256/bf16,GDNFwd/q35-gva-decode-b512/bf16"
    R="$R,KDAFwd/kda-tp1-decode-b64/bf16,KDAFwd/kda-tp8-decode-b256/bf16,DeltaNetFwd/deltanet-1.3b-decode-b32/bf16"
    $T 280 python3 bench/decode_probe.py --no-fla --rows "$R" --configs \
      "block_v=16,threads=128,vec=4,warps_k=4" "block_v=8,threads=64,vec=4,warps_k=2" \
      "block_v=32,threads=256,vec=4,warps_k=8" "block_v=32,threads=128,vec=4,warps_k=4" \
      "ctas_per_sm=3" --out "$OUT/decode_tiles.json" > "$OUT/decode_tiles.txt" 2>&1
    echo "decode rc=$?"; tail -n 16 "$OUT/decode_tiles.txt" ;;
  ncu)
    $T 250 ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section LaunchStats --section SchedulerStats --csv \
      --page details python3 bench/ncu_probe.py --only q35-2b-8x8192 \
      > "$OUT/ncu_walk.csv" 2> "$OUT/ncu_walk.err"
    echo "ncu rc=$?"; grep -E "Duration|Registers|Achieved Occupancy|Issue Slots|No Eligible" \
      "$OUT/ncu_walk.csv" | cut -c1-200 | head -n 12 ;;
  gen)     # the generalized rules' decode rows (new), then every row at HEAD (issue 49)
    $T 150 python3 bench/generalized_probe.py --rows '*/decode-*' \
      --out "$OUT/generalized_decode.json" > "$OUT/generalized_decode.txt" 2>&1
    echo "decode rc=$?"; tail -n 5 "$OUT/generalized_decode.txt"
    $T 330 python3 bench/generalized_probe.py --rows '*/[pt]*' --out "$OUT/generalized_h200.json" \
      > "$OUT/generalized.txt" 2>&1
    echo "generalized rc=$?"; tail -n 5 "$OUT/generalized.txt" ;;
  ssd)     # Mamba-2 vs mamba_ssm at HEAD (forward, training, decode): ssd_h200.json's rows
    $T 400 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --out "$OUT/ssd_h200.json" \
      > "$OUT/ssd_probe.txt" 2>&1
    echo "ssd rc=$?"; grep -v '^{' "$OUT/ssd_probe.txt" | tail -n 6 ;;
  models)
    $T 280 python3 bench/models_bench.py --out "$OUT/models_gdn.json" --models fla_gdn \
      --tasks generate > "$OUT/models_gdn.txt" 2>&1
    echo "fla_gdn generate rc=$?"
    $T 250 python3 bench/models_bench.py --out "$OUT/models_kimi.json" --models kimi_linear \
      --tasks generate > "$OUT/models_kimi.txt" 2>&1
    echo "kimi_linear generate rc=$?"
    grep -h '^{' "$OUT"/models_gdn.txt "$OUT"/models_kimi.txt | cut -c1-400 ;;
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
  walk)   # the split rows (the right-looking diagonal pass's time)
    $T 200 python3 bench/walk_probe.py --iters 10 --only q35-2b-16384 q35-397b-tp1-65536 \
      q35-397b-tp8-8192 prefill-4k deltanet-16k-k64 --configs default \
      --out "$OUT/probe_split.json" > "$OUT/probe_split.log" 2>&1
    tail -n 10 "$OUT"/probe_split.log ;;
esac
cp -r /tmp/out_dir/. "$OUT/" 2>/dev/null   # (the tests' JSON summaries)
