#!/usr/bin/env bash
# Session 32's decode experiment, prepared on the CPU and not yet run (its prefill part ran
# in s35-2: bench/LOG.md). One device call, H200 preferred, carry .gpu (site.tar.xz,
# prelude.sh, savecache.sh) and .whl (bench/models_wheels.sh: pytest-xdist):
#
#   source .gpu/prelude.sh && bash bench/probes_s32.sh decode      # ~4 min
#
# decode_probe / pool_probe with the ctas_per_sm and stream knobs against the copy floor of
# the same run, and their GPU tests. Expectations: bench/LOG.md, session 32. Everything is
# checked against fp64 (or fla for the pool) before it is timed.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
T="timeout -k 10"
case ${1:?decode} in
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
