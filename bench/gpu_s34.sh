#!/usr/bin/env bash
# Session 34's device calls, one script (PART=1|2|3), each under the tool's 10 minutes:
#   source .gpu/prelude.sh && PART=1 bash bench/gpu_s34.sh
# carry: .gpu/site.tar.xz .gpu/prelude.sh .gpu/savecache.sh .gpu/mamba .whl (abtree/ is
# untracked and travels with the tree: bash bench/ab_tree.sh a8a44fe abtree).
# 1: the GPU tests never run on a GPU (Mamba-2, Comba, GDN-2, DPLR, sm80 plans on sm90),
#    then Mamba-2 against mamba_ssm side by side (bench/ssd_probe.py).
# 2: the chunked backward's fold probes (bench/probes_s33_bwd.sh).
# 3: the models not yet timed (bench/models_bench.py).
# 4: the walk's variants (value_major, depth, value block) on three DeltaNetChunkBwd rows,
#    then the GPU tests named in TESTS4 (the helpers' fixes).
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/whl .whl/*.whl \
  >/dev/null 2>&1; export PYTHONPATH=$PYTHONPATH:/tmp/whl
export OUT_DIR=/tmp/out_dir HF_HUB_OFFLINE=1; mkdir -p /tmp/out_dir   # (per-worker JSON stays there: 8 files come back)
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
T="timeout -k 10"
ROWS4="train-2k-bf16 train-16k-bf16 deltanet-1.3b-train-bf16"
case ${PART:-1} in
1)
  $T ${TESTS_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 -rfE \
    tests/test_mamba2_gpu.py tests/test_comba_gpu.py tests/test_gdn2_gpu.py \
    tests/test_dplr_gpu.py tests/test_sm80_gpu.py > "$OUT/tests_new.txt" 2>&1
  echo "tests rc=$?"
  $T ${SSD_S:-240} python3 bench/ssd_probe.py --mamba-src .gpu/mamba \
    --out "$OUT/ssd_h200.json" > "$OUT/ssd_probe.txt" 2>&1
  echo "ssd rc=$?"
  tail -n 25 "$OUT/tests_new.txt"; tail -n 30 "$OUT/ssd_probe.txt" ;;
2) bash bench/probes_s33_bwd.sh ;;
3) $T 560 python3 bench/models_bench.py --out "$OUT/models.json" --budget-s 420 \
     --models ${MODELS:-kimi_linear fla_gdn qwen3_next fla_kda} > "$OUT/models.txt" 2>&1
   echo "models rc=$?"; tail -n 30 "$OUT/models.txt" ;;
4) $T ${SWEEP_S:-110} python3 bench/chunk_bwd_probe.py --iters 20 --no-fla --precompile \
     --only $ROWS4 --sweep-on $ROWS4 > "$OUT/walk_sweep.txt" 2>&1
   echo "sweep rc=$?"
   $T ${TESTS4_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
     ${TESTS4:-tests/test_dplr_gpu.py} > "$OUT/tests4.txt" 2>&1
   echo "tests4 rc=$?"
   grep -A12 "^train\|^deltanet" "$OUT/walk_sweep.txt" | grep -v "ours fwd"; tail -n 15 "$OUT/tests4.txt" ;;
esac
[ -n "${SAVE:-}" ] && source .gpu/savecache.sh
