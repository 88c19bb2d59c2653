#!/usr/bin/env bash
# One batched GPU run (see /work/shared/gpu/README.md): correctness tests, probes and the
# benchmark, each under its own time limit, so the whole command ends inside the device
# tool's 10 minutes and always packs what it measured.
#
#   source .gpu/prelude.sh && bash bench/gpu_session.sh ; source .gpu/savecache.sh
#
# Steps are chosen with STEPS (default "decode chunk probe bench"; also dprobe, cbwd,
# cbprobe, kkt, split, autograd, additive, aprobe, glabwd, train, warm, bench2, ncu: see
# the case below), each with a limit
# <STEP>_S in seconds; probe (bench/walk_probe.py: the chunked forward's plans), decode
# probe and bench arguments with PROBE_ARGS (PROBE2_ARGS), DPROBE_ARGS and BENCH_ARGS
# (BENCH2_ARGS). Everything lands in
# $OUT/${TAG:-results}.tar.gz (logs, JSON), and the short summaries are printed last.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=/tmp/results; rm -rf "$R"; mkdir -p "$R"
# import the checkout as `linattn` without installing it
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/whl .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/whl
fi
export OUT_DIR=$R
STEPS=${STEPS:-"decode chunk probe bench"}
echo "${LINATTN_COMMIT:-unknown}" > "$R/commit.txt"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1

run_step() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
}

for s in $STEPS; do
  case $s in
    # decode cases compile one kernel each: spread them over processes (pytest-xdist from
    # .whl); the chunk tests precompile their kernels in parallel themselves
    # DECODE_K narrows it (a -k expression on the test ids, e.g. "state_v_first")
    decode) run_step decode "${DECODE_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -n 8 -rfE tests/test_decode_gpu.py -k "${DECODE_K:-}" --junitxml="$R/decode.xml" ;;
    # CHUNK_K narrows it (a -k expression on the test ids, e.g. "walk_plans")
    chunk) run_step chunk "${CHUNK_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -rfE --durations=8 tests/test_chunk_fwd_gpu.py -k "${CHUNK_K:-}" \
             --junitxml="$R/chunk.xml" ;;
    dprobe) run_step dprobe "${DPROBE_S:-240}" python3 bench/decode_probe.py --sweep ${DPROBE_ARGS:-} \
             --budget-s $(( ${DPROBE_S:-240} - 60 )) --out "$R/decode_probe.json" ;;
    # CBWD_K narrows it (e.g. "test_forward"; the module precompiles what it selects)
    cbwd) run_step cbwd "${CBWD_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -rfE --durations=8 tests/test_chunk_bwd_gpu.py -k "${CBWD_K:-}" \
             --junitxml="$R/chunk_bwd.xml" ;;
    # fla's drop-in arguments, torch.compile, CUDA graphs, pool decode, user specs, the fixed
    # decay (retention) and the value gate (issue 15/16)
    dropin) run_step dropin "${DROPIN_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -k "${DROPIN_K:-}" --tb=short \
             ${DROPIN_N:+-n $DROPIN_N} \
             -rfE --durations=8 tests/test_dropin_gpu.py tests/test_pool_gpu.py \
             tests/test_user_spec.py tests/test_retention.py tests/test_value_gate.py tests/test_value_gate_gpu.py \
             --junitxml="$R/dropin.xml" ;;
    # decode on a state pool against fla's (bench/pool_probe.py)
    pool) run_step pool "${POOL_S:-120}" python3 bench/pool_probe.py ${POOL_ARGS:-} --out "$R/pool_probe.json" ;;
    cbprobe) run_step cbprobe "${CBPROBE_S:-150}" python3 bench/chunk_bwd_probe.py ${CBPROBE_ARGS:-} ;;
    # chunk_kkt_inverse alone against fp64 (A_b, g_cum, chunk_norm, qn / kn; awkward cases)
    kkt) run_step kkt "${KKT_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -rfE --durations=8 -s tests/test_chunk_kkt_gpu.py --junitxml="$R/kkt.xml" ;;
    # the additive rule's backward (GLAChunkBwd, chunk_gla / chunk_simple_gla /
    # chunk_linear_attn training): GPU tests (GLABWD_K narrows them; "K256 or K192 or K144":
    # the key-block cases above K = 128), then the probe (GLAChunkBwd train-16k / train-2k vs
    # fla, scan variants, a training step; GLAPROBE_ARGS="--train-kv 256 512": GLA-1.3B's)
    glabwd) run_step glabwd "${GLABWD_S:-160}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -rfE --tb=short --durations=8 tests/test_additive_bwd_gpu.py -k "${GLABWD_K:-}" \
             --junitxml="$R/glabwd.xml"
            run_step glaprobe "${GLAPROBE_S:-80}" python3 bench/gla_bwd_probe.py ${GLAPROBE_ARGS:-} \
             --budget-s $(( ${GLAPROBE_S:-80} - 30 )) ;;
    # the walk's sequence split: forced segment lengths and the cost model's choice
    split) run_step split "${SPLIT_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -rfE --durations=8 tests/test_chunk_split_gpu.py --junitxml="$R/split.xml" ;;
    # the additive rule's state pass (issue 13: GLA / simple GLA / linear attention, the
    # sequence split): GPU tests vs fp64 (ADDITIVE_K narrows them), then the probe of the
    # plans' device time per kernel (APROBE_ARGS: e.g. "--only chunk-train-16k-bf16")
    additive) run_step additive "${ADDITIVE_S:-150}" python3 -m pytest -q -m gpu \
             -p no:cacheprovider -rfE --durations=8 tests/test_chunk_additive_gpu.py \
             -k "${ADDITIVE_K:-}" --junitxml="$R/additive.xml" ;;
    aprobe) run_step aprobe "${APROBE_S:-90}" python3 bench/additive_probe.py ${APROBE_ARGS:-} \
             --budget-s $(( ${APROBE_S:-90} - 15 )) --out "$R/additive_probe.json" ;;
    # AUTOGRAD_K narrows it (e.g. "gdn", "kda": the per-key backward)
    autograd) run_step autograd "${AUTOGRAD_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -rfE --tb=short --durations=8 tests/test_autograd_gpu.py -k "${AUTOGRAD_K:-}" \
             --junitxml="$R/autograd.xml" ;;
    # Nsight Compute on one call of ours and fla's per workload (bench/ncu_probe.py)
    ncu) run_step ncu "${NCU_S:-200}" bash -c 'N=$(command -v ncu || ls /usr/local/cuda*/bin/ncu \
             /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); [ -n "$N" ] || { echo "no ncu"; exit 3; }
             "$N" --profile-from-start off --section SpeedOfLight --section Occupancy \
             --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
             --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
             --csv --page details python3 bench/ncu_probe.py '"${NCU_ARGS:-}"' > "$OUT_DIR/ncu.csv"' ;;
    # the chunked forward's plans (PROBE_ARGS e.g. "--only prefill-4k --configs default
    # segments=8"): correctness vs fp64 and device time, JSON to walk_probe.json
    probe) run_step probe "${PROBE_S:-90}" python3 bench/walk_probe.py ${PROBE_ARGS:-} \
             --out "$R/walk_probe.json" ;;
    # a second probe with other arguments (other workloads or configs)
    probe2) run_step probe2 "${PROBE2_S:-90}" python3 bench/walk_probe.py ${PROBE2_ARGS:-} \
             --out "$R/walk_probe2.json" ;;
    # compile fla's autotuning configs and torch.compile's graphs for the selected rows in
    # WARM_P processes first (linattn-bench --warm-only); the bench steps then find them
    warm) run_step warm "${WARM_S:-240}" python3 -m linattn.cli.bench ${WARM_ARGS:-} --warm-only \
             --warm "${WARM_P:-12}" --budget-s $(( ${WARM_S:-240} - 20 )) ;;
    # the training rows (issue 14: GDN / KDA / GLA / DeltaNet forward + backward steps vs
    # fla, fp64 reference gradients, peak memory): TRAIN_OPS narrows the ops, TRAIN_ARGS
    # adds filters (e.g. "--workload '*-4k' --skip-timed bench/results/train_h200.json");
    # results to $R/train.json (copy or merge into bench/results/train_h200.json)
    train) run_step train "${TRAIN_S:-540}" python3 -m linattn.cli.bench \
             --op "${TRAIN_OPS:-GDNTrain,KDATrain,GLATrain,DeltaNetTrain}" --impl linattn,fla \
             ${TRAIN_ARGS:-} --budget-s $(( ${TRAIN_S:-540} - 40 )) --out "$R/train.json" \
             --table-md "$R/train.md" ;;
    # where a training step's device time goes, per kernel, ours vs fla (bench/train_probe.py;
    # TRAINPROBE_ARGS e.g. "--ops GDNTrain --workload '*-16k'")
    trainprobe) run_step trainprobe "${TRAINPROBE_S:-240}" python3 bench/train_probe.py \
             ${TRAINPROBE_ARGS:-} --budget-s $(( ${TRAINPROBE_S:-240} - 60 )) ;;
    # context parallelism on a multi-GPU kind (issue 17): 1 vs 2 ranks, GDN and KDA at
    # 128k / 512k / 1M tokens (bench/cp_bench.py; CP_ARGS), JSON to $R/cp.json (commit as
    # bench/results/cp_h200x2.json); then the CP GPU tests (forward and gradients)
    cp) run_step cp "${CP_S:-300}" python3 bench/cp_bench.py ${CP_ARGS:-} --out "$R/cp.json"
        run_step cptest "${CPTEST_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider \
             -rfE --tb=short tests/test_distributed.py --junitxml="$R/cptest.xml" ;;
    bench2) run_step bench2 "${BENCH2_S:-200}" python3 -m linattn.cli.bench ${BENCH2_ARGS:-} \
             --budget-s $(( ${BENCH2_S:-200} - 30 )) --out "$R/bench2.json" --table-md "$R/bench2.md" ;;
    bench) run_step bench "${BENCH_S:-200}" python3 -m linattn.cli.bench ${BENCH_ARGS:-} \
             --budget-s $(( ${BENCH_S:-200} - 30 )) --out "$R/bench.json" --table-md "$R/bench.md" ;;
  esac
done
# TAG names the archive (several invocations in one device command keep theirs apart)
tar -czf "$OUT/${TAG:-results}.tar.gz" -C /tmp results
# keep the carried compile cache small (the device tool carries 64 MiB in all): what a
# cache hit loads is TileLang's per-kernel folder (executable.so, sources, params) and
# Triton's cubin + JSON (autotuning picks included); TileLang's nvcc cubin cache and
# Triton's intermediate IR are only read when compiling again
rm -rf /tmp/gpu-cache/tilelang/*/cuda-binaries
# Triton's compiled configs are dropped by default, its autotuning picks (*.autotune.json)
# and launchers kept: a later machine compiles the picked config only, and the carried cache
# stays one ~15 MB part beside the 35 MB site archive (the device tool carries 64 MiB in
# all; session 12's untrimmed cache, 27 MB, was refused). TRIM_TRITON=0 keeps them, for a
# run that another follows on the same warm machine (idle release is ~30 s).
if [ "${TRIM_TRITON:-1}" = 1 ]; then
  for d in /tmp/gpu-cache/triton/*/; do ls "$d"*.cubin >/dev/null 2>&1 && rm -rf "$d"; done
fi
find /tmp/gpu-cache/triton -type f \( -name '*.llir' -o -name '*.ttir' -o -name '*.ttgir' \
  -o -name '*.ptx' -o -name '*.source' \) -delete 2>/dev/null
echo "===== steps"; cat "$R/steps.txt"
echo "===== decode (tail)"; tail -n 30 "$R/decode.log" 2>/dev/null
echo "===== chunk (tail)"; tail -n 40 "$R/chunk.log" 2>/dev/null
echo "===== decode probe (tail)"; tail -n 70 "$R/dprobe.log" 2>/dev/null
echo "===== chunk bwd (tail)"; tail -n 30 "$R/cbwd.log" 2>/dev/null
echo "===== chunk bwd probe (tail)"; tail -n 50 "$R/cbprobe.log" 2>/dev/null
for s in kkt dropin pool split autograd ncu additive aprobe glabwd glaprobe trainprobe cp cptest; do [ -f "$R/$s.log" ] && { echo "===== $s (tail)"; tail -n 25 "$R/$s.log"; }; done
for s in probe probe2; do [ -f "$R/$s.log" ] && { echo "===== $s (tail)"; tail -n 25 "$R/$s.log"; }; done
[ -f "$R/warm.log" ] && { echo "===== warm (tail)"; tail -n 30 "$R/warm.log"; }
echo "===== bench (tail)"; tail -n 45 "$R/bench.log" 2>/dev/null
[ -f "$R/bench2.log" ] && { echo "===== bench2 (tail)"; tail -n 45 "$R/bench2.log"; }
[ -f "$R/train.log" ] && { echo "===== train (tail)"; tail -n 40 "$R/train.log"; }
