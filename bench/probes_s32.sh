#!/usr/bin/env bash
# The experiments session 32 prepared on the CPU and could not run (its device time went to
# the side-by-side table): one device call each, H200 preferred, carry .gpu (site.tar.xz,
# prelude.sh, savecache.sh) and, for `prefill`, the baseline tree abtree/ made here first:
#
#   bash bench/ab_tree.sh 97bf4ed abtree          # main before the kkt fix: the A/B baseline
#   bash bench/models_wheels.sh                    # .whl/ (carry it): pytest-xdist for -n
#   source .gpu/prelude.sh && bash bench/probes_s32.sh prefill     # ~5 min
#   source .gpu/prelude.sh && bash bench/probes_s32.sh decode      # ~4 min
#
# prefill: the walk-fused GPU tests (inverse_in_walk), the kkt's GPU tests after its load
# batching, walk_probe of the batched rows (default vs inverse_in_walk=1 when its tests
# pass), of the split rows (default vs exact_maps=1, trained-model gates), and of the
# baseline tree. decode: decode_probe / pool_probe with the ctas_per_sm and stream knobs
# against the copy floor of the same run, and their GPU tests. Expectations: bench/LOG.md,
# session 32. Everything is checked against fp64 (or fla for the pool) before it is timed.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
T="timeout -k 10"
case ${1:?prefill or decode} in
  prefill)
    $T 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_chunk_fwd_gpu.py \
      -k inverse_in_walk > "$OUT/fused_tests.log" 2>&1; F=$?
    $T 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_chunk_kkt_gpu.py \
      -k "K48 or K256 or varlen32 or c32 or c16 or varlen6" > "$OUT/kkt_tests.log" 2>&1
    C=default; [ $F = 0 ] && C="default inverse_in_walk=1"
    $T 150 python3 bench/walk_probe.py --iters 10 --only q35-2b-8x8192 q35-397b-tp4-8x1024 \
      q35-2b-8x8192-trained --configs $C --out "$OUT/probe_batched.json" > "$OUT/probe_batched.log" 2>&1
    $T 200 python3 bench/walk_probe.py --iters 10 --only prefill-4k prefill-4k-trained q35-2b-16384 \
      q35-2b-16384-trained q35-397b-tp8-8192 q35-397b-tp1-65536 deltanet-16k-k64 \
      --configs default exact_maps=1 --out "$OUT/probe_split.json" > "$OUT/probe_split.log" 2>&1
    (cd abtree && ln -sfn "$PWD" /tmp/lp/linattn && $T 150 python3 bench/walk_probe.py --iters 10 \
      --only q35-2b-8x8192 q35-397b-tp4-8x1024 prefill-4k q35-2b-16384 deltanet-16k-k64 \
      --out "$OUT/probe_main.json" > "$OUT/probe_main.log" 2>&1)
    ln -sfn "$PWD" /tmp/lp/linattn
    tail -n 12 "$OUT"/*.log ;;
  decode)
    R="GDNFwd/q35-gva-decode-b1/bf16,GDNFwd/q35-gva-decode-b8/bf16,GDNFwd/q35-gva-decode-b64/bf16"
    R="$R,GDNFwd/q35-gva-decode-b256/bf16,GDNFwd/q35-gva-decode-b512/bf16,KDAFwd/kda-tp1-decode-b64/bf16"
    R="$R,KDAFwd/kda-tp1-decode-b256/bf16,KDAFwd/kda-tp8-decode-b256/bf16"
    STREAM="block_v=32,threads=128,vec=4,warps_k=4,items=4"
    STEPS="dprobe pool decode dropin" DPROBE_S=170 \
      DPROBE_ARGS="--no-fla --rows $R --configs ctas_per_sm=3 $STREAM,ahead=1" \
      POOL_S=150 POOL_ARGS="--knobs ctas_per_sm=3 $STREAM,ahead=1 $STREAM,ahead=2" \
      DECODE_S=150 DECODE_K="items or ctas_per_sm" DROPIN_S=150 DROPIN_N=8 DROPIN_K="stream_matches" \
      bash bench/gpu_session.sh ;;
esac
