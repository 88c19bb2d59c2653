#!/usr/bin/env bash
# Session 44's device calls, back to back on one warm machine (it goes back after 30 s
# idle; a start may be refused: each refusal costs ~90 s or more of device time; a call
# returns at most 8 files; never let a helper call the device). Carry .gpu/site.tar.xz
# .gpu/prelude.sh .gpu/savecache.sh .gpu/mamba .gpu/xdist and .gpu/cache.tar.xz.00 (copy
# .gpu/s44/cache.tar.xz.00 there: bench/cpu_cache.py built it from test_rule_bwd_gpu,
# test_dplr_bwd_gpu and test_mamba2_gpu's gradients).
#
# In this order (the first call also pays the start, ~3.5 min):
#   verify: the GPU tests not run since their fixes: Comba / GDN-2's backward (Comba on
#     since s43-1's gradients against fla), DPLR's 16-bit gradient stores, Mamba-2's group loop
#   final | ssdab | gen2 | side | ncu | ssd | gen | gates | train | tests | walk | models | decode
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
case ${1:?verify, ssdab, gen2, side, ncu, fwd, ssd, gen, decode, tests, walk, gates, train or models} in
  side)    # (source .gpu/prelude_both.sh instead) issue 45's rows side by side at HEAD:
           # linattn, fla, the seed release (and flashinfer where .gpu/fi_bundle.tar.xz came)
    I=linattn,fla,seed; [ -f .gpu/fi_bundle.tar.xz ] && I=$I,flashinfer
    IMPLS=$I BUDGET=420 WARM=14 RUN=2026-12-07-s42-side LINATTN_COMMIT=${LINATTN_COMMIT:?the commit} \
      bash bench/table_run.sh side --dtype bf16 --op GDNFwd,KDAFwd,DeltaNetFwd,GLAFwd,DeltaNetChunkBwd \
      --workload 'prefill-4k,q35-2b-16384,q35-397b-tp1-65536,q35-397b-tp8-8192,q35-2b-8x8192,q35-397b-tp4-8x1024,decode-b8,q35-gva-decode-b256,kda-tp1-4096,kda-tp8-16384,prefill-16k,prefill-8k,train-2k'
    cp /tmp/table/* "$OUT/" ;;
  verify)
    gpu_tests 200 tests/test_rule_bwd_gpu.py tests/test_dplr_bwd_gpu.py
    gpu_tests 200 tests/test_mamba2_gpu.py -k gradients
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 24 ;;
  wyab)    # branch wy2 (chunk_bwd_wy without bv_s: Comba 1 -> 2 CTAs an SM) in abtree/ (bash
           # bench/ab_tree.sh wy2) against the working tree: Comba's and GDN's training rows,
           # alternating trees, then abtree's backward GPU tests for gdn and comba
    mkdir -p /tmp/lpab && ln -sfn "$PWD/abtree" /tmp/lpab/linattn
    AB="env PYTHONPATH=/tmp/lpab:$PYTHONPATH"
    for t in base ab base ab; do
      if [ $t = base ]; then P=env; D=.; else P=$AB; D=abtree; fi
      (cd $D && $T 150 $P python3 bench/generalized_probe.py --families comba --rows '*/train-*' \
        --out "$OUT/wy_${t}_comba.json" >> "$OUT/wy_${t}.txt" 2>&1)
      (cd $D && $T 150 $P python3 bench/train_probe.py --ops GDNTrain --workload 'train-4k' \
        --budget-s 120 >> "$OUT/wy_${t}.txt" 2>&1)
      echo "$t rc=$?"
    done
    tail -n 3 "$OUT"/wy_base.txt "$OUT"/wy_ab.txt | cut -c1-300
    (cd abtree && PYTHONPATH=/tmp/lpab:$PYTHONPATH gpu_tests 150 tests/test_rule_bwd_gpu.py \
      -k comba tests/test_chunk_bwd_gpu.py)
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 12 ;;
  ssdab)
    $T 330 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --rows 'train-*' \
      --out "$OUT/ssd_loop.json" > "$OUT/ssd_loop.txt" 2>&1
    echo "ssdab rc=$?"; grep -v '^{' "$OUT/ssd_loop.txt" | tail -n 8
    # the small-batch decode tiles (decode-1 0.81x mamba_ssm at block_v 8, 32 threads, vec 8)
    $T 120 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --rows 'decode-[18]' \
      --decode-tiles block_v=16,threads=64,vec=8,warps_k=1 block_v=16,threads=128,vec=4,warps_k=1 \
      block_v=8,threads=64,vec=4,warps_k=1 block_v=32,threads=128,vec=8,warps_k=1 \
      --out "$OUT/ssd_dtiles.json" > "$OUT/ssd_dtiles.txt" 2>&1
    echo "dtiles rc=$?"; grep -v '^{' "$OUT/ssd_dtiles.txt" | tail -n 6 ;;
  final)   # one call for all (device time short): every family's training row (five
           # parallel passes: compiles and each family's gradients against fla's), then
           # timed one at a time; then Mamba-2's training rows (run s43-1: default and the
           # plan config dqkvg_group_loop, since removed: the loop is the plan's choice)
    for f in comba gdn2 dplr rwkv7 iplr; do
      $T 200 python3 bench/generalized_probe.py --families $f --rows '*/train-*' \
        --out /tmp/warm_$f.json > /tmp/warm_$f.txt 2>&1 &
    done; wait; tail -qn 1 /tmp/warm_*.txt; cat /tmp/warm_*.json > "$OUT/generalized_warm.json"
    $T 110 python3 bench/generalized_probe.py --rows '*/train-*' \
      --out "$OUT/generalized_train.json" > "$OUT/generalized_train.txt" 2>&1
    echo "train rc=$?"; tail -n 6 "$OUT/generalized_train.txt"
    $T 240 python3 bench/ssd_probe.py --mamba-src .gpu/mamba --rows 'train-*' \
      --out "$OUT/ssd_loop.json" > "$OUT/ssd_loop.txt" 2>&1
    echo "ssdab rc=$?"; grep -v '^{' "$OUT/ssd_loop.txt" | tail -n 4 ;;
  gen2)    # every family's training row (backward kernels compiled by five parallel untimed
           # passes first: the probe's own precompile covers forward and decode only), then
           # timed one at a time; then every decode row
    for f in comba gdn2 dplr rwkv7 iplr; do
      $T 260 python3 bench/generalized_probe.py --families $f --rows '*/train-*' \
        --out /tmp/warm_$f.json > /tmp/warm_$f.txt 2>&1 &
    done; wait; tail -n 2 /tmp/warm_*.txt
    $T 150 python3 bench/generalized_probe.py --rows '*/train-*' \
      --out "$OUT/generalized_train.json" > "$OUT/generalized_train.txt" 2>&1
    echo "train rc=$?"; tail -n 6 "$OUT/generalized_train.txt"
    $T 100 python3 bench/generalized_probe.py --rows '*/decode-*' \
      --out "$OUT/generalized_decode.json" > "$OUT/generalized_decode.txt" 2>&1
    echo "decode rc=$?"; tail -n 4 "$OUT/generalized_decode.txt" ;;
  ncu)
    $T 240 ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section SourceCounters \
      --section MemoryWorkloadAnalysis --csv --page details python3 bench/ncu_probe.py \
      --no-fla --only q35-2b-8x8192 > "$OUT/ncu_walk.csv" 2> "$OUT/ncu_walk.err"
    echo "ncu walk rc=$?"
    $T 200 ncu --kernel-name regex:chunk_bwd_dqkvg --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --csv --page details python3 bench/ssd_probe.py \
      --mamba-src .gpu/mamba --rows train-4096 --out "$OUT/ssd_ncu.json" \
      > "$OUT/ncu_dqkvg.csv" 2> "$OUT/ncu_dqkvg.err"
    echo "ncu dqkvg rc=$?"; grep -hE "Duration|Achieved Occupancy|Memory Throughput|No Eligible" \
      "$OUT"/ncu_walk.csv "$OUT"/ncu_dqkvg.csv | cut -c1-200 | head -n 16 ;;
  fwd)     # the forward and decode GPU tests
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
# a call returns at most 8 files: everything in one archive, gpu.txt beside it
(cd "$OUT" && tar czf /tmp/all.tar.gz --exclude=gpu.txt . && find . -mindepth 1 ! -name gpu.txt -delete \
  && mv /tmp/all.tar.gz .)
