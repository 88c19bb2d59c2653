#!/usr/bin/env bash
# Session 45's device calls, back to back on one warm machine (it goes back after 30 s
# idle; a start may be refused: each refusal costs ~90 s or more of device time; a call
# returns at most 8 files, so everything comes back in one archive; never let a helper
# call the device). Carry .gpu/site.tar.xz .gpu/prelude.sh .gpu/savecache.sh .gpu/mamba
# .gpu/xdist and .gpu/cache.tar.xz.00 (copy .gpu/s45/cache.tar.xz.00 there: bench/cpu_cache.py
# built it from test_chunk_bwd_gpu, test_rule_bwd_gpu, test_dplr_bwd_gpu at 85ed957 and
# test_mamba2_gpu's gradients at dqkvg-sync, plus GDN's qwen3-next-4k and Comba's train-4k
# training kernels at main and ceaa6db: 293 kernels, 6.3 MiB).
#
# In this order (the first call also pays the start, ~3.5 min):
#   A / B trees live under .gpu/ (git-ignored: a call carries only the one it names):
#   `bash bench/ab_tree.sh COMMIT .gpu/ab_X && rm -rf .gpu/ab_X/bench/results .gpu/ab_X/generated/sm80`
#   first: carry .gpu/ab_wy (= ceaa6db): GDN's training row (qwen3-next-4k) with chunk_bwd_wy's
#     in-place beta v (HEAD) against without (ceaa6db)
#   dq: carry .gpu/ab_dq (= branch dqkvg-sync): Mamba-2's training rows, HEAD against the
#     branch (dqkvg with 36 barriers a value head, not 64; its Mamba-2 gradient tests passed in
#     s44-6), then its GLA-family backward tests (simple GLA / retention / lightning's dqkvg)
#   ncu2: source-level stall samples (SASS) of chunk_walk_fused (8x8192), Mamba-2's
#     chunk_bwd_dqkvg and Comba's chunk_bwd_wy / chunk_bwd_dqkw
#   rest: GDN's backward tests (wy in place), the rules' vs-fla and DPLR's backward tests
#   then as time allows: ssd | gen | gates | train | tests | walk | models | decode | side
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
  $T "$s" python3 -m pytest -m gpu -p no:cacheprovider -n 6 -v -rfE --tb=line --durations=12 \
    "$@" 2>&1 | grep -E "PASSED|FAILED|ERROR|^E |passed|failed|skipped|precompiled|[0-9]s (call|setup)" \
    >> "$OUT/tests.txt"
  echo "rc=${PIPESTATUS[0]}" >> "$OUT/tests.txt"
}
ab_tree() {  # DIR: the A / B tree carried there, importable as linattn by in_tree ab
  D=$1; mkdir -p /tmp/lpab && ln -sfn "$PWD/$D" /tmp/lpab/linattn
}
in_tree() {  # base|ab command...: the command in the working tree, or in $D with its package
  local t=$1; shift
  if [ "$t" = base ]; then "$@"; else (cd "$D" && env PYTHONPATH="/tmp/lpab:$PYTHONPATH" "$@"); fi
}
case ${1:?first, dq, ncu2, rest, side, ssd, gen, decode, tests, walk, gates, train or models} in
  side)    # (source .gpu/prelude_both.sh instead) issue 45's rows side by side at HEAD:
           # linattn, fla, the seed release (and flashinfer where .gpu/fi_bundle.tar.xz came)
    I=linattn,fla,seed; [ -f .gpu/fi_bundle.tar.xz ] && I=$I,flashinfer
    IMPLS=$I BUDGET=420 WARM=14 RUN=2026-12-07-s42-side LINATTN_COMMIT=${LINATTN_COMMIT:?the commit} \
      bash bench/table_run.sh side --dtype bf16 --op GDNFwd,KDAFwd,DeltaNetFwd,GLAFwd,DeltaNetChunkBwd \
      --workload 'prefill-4k,q35-2b-16384,q35-397b-tp1-65536,q35-397b-tp8-8192,q35-2b-8x8192,q35-397b-tp4-8x1024,decode-b8,q35-gva-decode-b256,kda-tp1-4096,kda-tp8-16384,prefill-16k,prefill-8k,train-2k'
    cp /tmp/table/* "$OUT/" ;;
  first)   # GDNTrain qwen3-next-4k, HEAD (wy in place) against .gpu/ab_wy (ceaa6db): both
           # trees compile in parallel untimed passes, then timed passes alternate
    ab_tree .gpu/ab_wy
    for t in base ab; do
      in_tree $t $T 240 python3 bench/train_probe.py --ops GDNTrain --workload qwen3-next-4k \
        --iters 2 --impls linattn > /tmp/warm_$t.txt 2>&1 &
    done
    wait; tail -qn 1 /tmp/warm_base.txt /tmp/warm_ab.txt | cut -c1-200
    I="linattn fla"             # (fla's time once: its first pass autotunes)
    for t in base ab base ab; do
      in_tree $t env OUT_DIR=/tmp/od_$t $T 120 python3 bench/train_probe.py --ops GDNTrain \
        --workload qwen3-next-4k --impls $I >> "$OUT/gdn_train_$t.txt" 2>&1
      echo "$t rc=$?"; I=linattn
    done
    grep -h "GDNTrain" "$OUT"/gdn_train_*.txt | cut -c1-240 ;;
  dq)      # Mamba-2's dqkvg with fewer barriers (branch dqkvg-sync in .gpu/ab_dq) against HEAD
    ab_tree .gpu/ab_dq
    (cd $D && PYTHONPATH=/tmp/lpab:$PYTHONPATH gpu_tests 150 tests/test_additive_bwd_gpu.py)
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 6
    for t in base ab base ab; do
      in_tree $t $T 150 python3 bench/ssd_probe.py --mamba-src "$MAMBA_SRC" --rows 'train-*' \
        --out "$OUT/ssd_$t.json" >> "$OUT/ssd_$t.txt" 2>&1
      echo "$t rc=$?"
    done
    grep -h "geomean" "$OUT"/ssd_base.txt "$OUT"/ssd_ab.txt ;;
  ncu2)    # per-instruction stall samples: one launch of each kernel, full set, SASS source page
    prof() {  # name regex command...
      local n=$1 k=$2; shift 2
      $T 140 ncu --kernel-name "regex:$k" --launch-skip 2 --launch-count 1 --set full \
        --import-source yes -f -o "/tmp/$n" "$@" > "$OUT/ncu_$n.log" 2>&1
      echo "ncu $n rc=$?"
      ncu -i "/tmp/$n.ncu-rep" --page source --csv --print-source sass > "/tmp/${n}_sass.csv" 2>/dev/null
      ncu -i "/tmp/$n.ncu-rep" --page details --csv > "$OUT/ncu_${n}_details.csv" 2>/dev/null
      xz -9 -c "/tmp/${n}_sass.csv" > "$OUT/ncu_${n}_sass.csv.xz"
    }
    prof walk chunk_walk_fused python3 bench/ncu_probe.py --no-fla --only q35-2b-8x8192
    prof dqkvg chunk_bwd_dqkvg python3 bench/ssd_probe.py --mamba-src .gpu/mamba --rows train-4096 \
      --out /tmp/ssd_ncu.json
    prof wy chunk_bwd_wy python3 bench/generalized_probe.py --families comba --rows '*/train-*' \
      --steps 3
    prof dqkw chunk_bwd_dqkw python3 bench/generalized_probe.py --families comba --rows '*/train-*' \
      --steps 3
    ls -la "$OUT" | tail -n 12 ;;
  rest)    # GDN's backward with wy in place (not run since), and the GPU tests s44-1 did not
           # reach: the rules' vs-fla cases and DPLR's backward
    gpu_tests 190 tests/test_chunk_bwd_gpu.py
    gpu_tests 180 tests/test_rule_bwd_gpu.py -k vs_fla
    gpu_tests 180 tests/test_dplr_bwd_gpu.py
    grep -E "^==|FAILED|ERROR|passed|failed|rc=" "$OUT/tests.txt" | tail -n 12 ;;
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
