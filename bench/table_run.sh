#!/usr/bin/env bash
# The benchmark table side by side on the GPU machine: linattn, fla, TileOPs' release
# ("seed") and flashinfer on every row they run, one device call a part. Parts run on one
# warm machine at one commit share the run id, the compile caches and /tmp/table, where
# every part is merged into all.json; a part skips the rows all.json already has timed, so
# a part cut by its budget is resumed by calling it again.
#
#   source .gpu/prelude_both.sh && LINATTN_COMMIT=<sha> RUN=<id> bash bench/table_run.sh NAME \
#       [linattn-bench filters, e.g. --op GDNFwd --dtype bf16] ; cp /tmp/table/* $OUT/
#
# Needs .gpu/both.tar.xz + prelude_both.sh (../shared/gpu/pack_both.sh: linattn's and the
# release's packages) and .gpu/fi_bundle.tar.xz (../shared/gpu/flashinfer). BUDGET (s,
# default 480), WARM (processes compiling fla / the release / torch.compile first,
# default 12), IMPLS, VERIFY=1 (the timer's self-check and the copy bandwidth), ALL (the
# merged file's name, default all) tune it; WARM_ONLY=1 compiles every implementation's
# kernels for the selected rows and times nothing (the whole table's compiles take about
# 8 minutes on 15 processes: the seed release compiles every shape anew, ~15 s a row).
# GPUS=n (a multi-GPU machine): n processes, one a GPU, each on every n-th row
# (--shard i/n) with its share of the cores for the warm step; all merged into all.json.
set -u
name=$1; shift
T=/tmp/table; mkdir -p "$T" "${OUT:-/tmp/out}"
GPUS=${GPUS:-1}
if [ ! -d /tmp/fisite/flashinfer ]; then
  mkdir -p /tmp/fisite && tar -xJf .gpu/fi_bundle.tar.xz -C /tmp/fisite
fi
if [ "$GPUS" -gt 1 ]; then
  per=$(( $(nproc) / GPUS - 1 )); [ "$per" -ge 1 ] || per=1
  for i in $(seq 0 $((GPUS - 1))); do
    CUDA_VISIBLE_DEVICES=$i GPUS=1 SHARD=$i/$GPUS WARM=${WARM:-$per} bash "$0" "$name.$i" "$@" \
      > "$T/$name.$i.out" 2>&1 &
  done
  wait
  tail -n 4 "$T/$name".*.out; exit 0
fi
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:${PYTHONPATH:-}
BUDGET=${BUDGET:-480}
args=(--impl "${IMPLS:-linattn,fla,seed,flashinfer,torch,torch-compile}" --seed-path "$SEED_PATH"
      --flashinfer-path /tmp/fisite --run-id "${RUN:?RUN names the run}" --row-budget-ms 60
      --budget-s "$BUDGET" --warm "${WARM:-12}" --out "$T/$name.json" --table-md "$T/$name.md")
ALL=$T/${ALL:-all}.json     # the merged file of this table (ALL=gates for another table)
[ -f "$ALL" ] && args+=(--skip-timed "$ALL")
[ "${VERIFY:-0}" = 1 ] && args+=(--verify-timer)
shard=(); [ -n "${SHARD:-}" ] && shard=(--shard "$SHARD")
t0=$SECONDS
if [ "${WARM_ONLY:-0}" = 1 ]; then   # compile every implementation's kernels for the rows, time nothing
  timeout -k 20 $((BUDGET + 60)) python3 -m linattn.cli.bench --warm-only --warm "${WARM:-15}" \
    --impl "${IMPLS:-linattn,fla,seed,flashinfer,torch-compile}" --seed-path "$SEED_PATH" \
    --flashinfer-path /tmp/fisite --budget-s "$BUDGET" ${shard[@]+"${shard[@]}"} "$@" > "$T/$name.log" 2>&1
  echo "$name (warm only): rc=$? in $((SECONDS - t0)) s" | tee -a "$T/parts.txt"
  tail -c 1500 "$T/$name.log"; exit 0
fi
timeout -k 20 $((BUDGET + 90)) python3 -m linattn.cli.bench "${args[@]}" ${shard[@]+"${shard[@]}"} "$@" > "$T/$name.log" 2>&1
echo "$name: rc=$? in $((SECONDS - t0)) s" | tee -a "$T/parts.txt"
flock "$ALL.lock" python3 - "$T/$name.json" "$ALL" <<'PY'
import json, os, sys
from linattn.cli.bench import report
if os.path.exists(sys.argv[1]):
    doc = json.load(open(sys.argv[1]))
    merged = report.merge_into(sys.argv[2], doc)
    print(f"{len(doc['rows'])} rows this part, {len(merged['rows'])} in {sys.argv[2]}, "
          f"{len(doc.get('skipped_for_budget') or [])} skipped for budget")
    print(report.summary(merged["rows"], generated_matches=lambda c: None))
PY
grep -E "warmed|precompiled|timer check|took|aborted|Error" "$T/$name.log" | tail -20
