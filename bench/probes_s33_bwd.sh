#!/usr/bin/env bash
# The chunked backward's experiments session 33's helper (issue 45 item 1, branch h-bwd)
# prepared on the CPU: one device call (H100 or H200; compare only within the call),
# carry .gpu (site.tar.xz, prelude.sh, savecache.sh) and the baseline tree made here first:
#
#   bash bench/ab_tree.sh a8a44fe abtree          # main before this branch: the A/B baseline
#   source .gpu/prelude.sh && bash bench/probes_s33_bwd.sh      # ~4-5 min
#
# 1. the folded backward's GPU tests (test_backward_fold: both forms, split and fused,
#    every contract case, fp64 reference, outputs poisoned) and the default form's;
# 2. A/B, DeltaNetChunkBwd rows (bf16, the benchmark table's shapes): this tree's default
#    plan and the folded forms that passed (--configs default split fused: per-kernel
#    split, each config's difference from the default's gradients), then the baseline
#    tree's default (7 kernels there: the three state-row kernels this branch removes);
# 3. where the GDN training step's backward goes, per kernel (GDNTrain qwen3-next-4k:
#    B 4, T 4096, H 16, HV 32, K = V = 128, l2norm; twice the tokens of the Qwen3.5 370M
#    step's layer), linattn only (fla's first training call autotunes for minutes).
# Expectations: the helper's report (bench/LOG.md, session 33). Everything is checked
# against fp64 before it is timed.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
T="timeout -k 10"
ROWS="train-2k-bf16 train-4k-bf16 train-8k-bf16 train-16k-bf16 deltanet-1.3b-train-bf16"
$T 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rfEp tests/test_chunk_bwd_gpu.py \
  -k "test_backward_fold or (test_backward and train and not variants)" \
  > "$OUT/fold_tests.log" 2>&1
C=default              # a folded form is timed where its tests ran and none failed
for f in split fused; do
  grep -q "PASSED.*fold.*-$f\]" "$OUT/fold_tests.log" && \
    ! grep -Eq "(FAILED|ERROR).*fold.*-$f\]" "$OUT/fold_tests.log" && C="$C $f"
done
$T 110 python3 bench/chunk_bwd_probe.py --iters 20 --sweep-on '' --no-fla --configs $C \
  --precompile --only $ROWS > "$OUT/probe_bwd.log" 2>&1
cp "$OUT/chunk_bwd_probe.json" "$OUT/probe_bwd.json" 2>/dev/null
(cd abtree && ln -sfn "$PWD" /tmp/lp/linattn && $T 60 python3 ../bench/chunk_bwd_probe.py \
  --iters 20 --sweep-on '' --no-fla --only $ROWS > "$OUT/probe_bwd_main.log" 2>&1)
cp "$OUT/chunk_bwd_probe.json" "$OUT/probe_bwd_main.json" 2>/dev/null
ln -sfn "$PWD" /tmp/lp/linattn
$T 110 python3 bench/train_probe.py --ops GDNTrain --workload 'qwen3-next-4k' --iters 5 \
  --impls linattn > "$OUT/train_gdn.log" 2>&1
cp "$OUT/train_probe.json" "$OUT/train_gdn.json" 2>/dev/null
tail -n 30 "$OUT"/fold_tests.log; tail -n 60 "$OUT"/probe_bwd*.log; tail -n 8 "$OUT"/train_gdn.log
