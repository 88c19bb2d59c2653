#!/usr/bin/env bash
# Mamba-2 (SSD) on one GPU, one device call (~6 min): the GPU tests of ops/mamba2.py (the
# call terms inside the chunked kernels, every plan form; decode; gradients; mamba_ssm side
# by side), then bench/ssd_probe.py against mamba_ssm's Triton functions (.gpu/mamba),
# rows in the check's format to $OUT/ssd_h200.json (commit it as bench/results/ssd_h200.json).
#   source .gpu/prelude_both.sh && bash bench/gpu_ssd.sh
# carry (< 64 MiB): .gpu/prelude_both.sh .gpu/both.tar.xz .gpu/mamba and of .whl/ the
# einops (mamba_ssm's), execnet and pytest_xdist wheels (or .gpu/prelude.sh with
# .gpu/site.tar.xz, as bench/gpu_s34.sh)
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/lp && ln -sfn "$PWD" /tmp/lp/linattn && export PYTHONPATH=/tmp/lp:$PYTHONPATH
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/whl .whl/*.whl \
    >/dev/null 2>&1; export PYTHONPATH=$PYTHONPATH:/tmp/whl
fi
export OUT_DIR=$OUT HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
T="timeout -k 10"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
MAMBA_SRC=$PWD/.gpu/mamba $T ${TESTS_S:-180} python3 -m pytest -q -m gpu \
  -p no:cacheprovider $XDIST -rfE tests/test_mamba2_gpu.py tests/test_state_threads_gpu.py \
  > "$OUT/tests_ssd.txt" 2>&1
echo "tests rc=$?"
$T ${SSD_S:-240} python3 bench/ssd_probe.py --mamba-src .gpu/mamba \
  --out "$OUT/ssd_h200.json" > "$OUT/ssd_probe.txt" 2>&1
echo "ssd rc=$?"
tail -n 15 "$OUT/tests_ssd.txt"; grep -v '^{' "$OUT/ssd_probe.txt" | tail -n 8
python3 - "$OUT/ssd_h200.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    lin, mam = r["impls"].get("linattn", {}), r["impls"].get("mamba_ssm", {})
    top = sorted((lin.get("kernels") or {}).items(), key=lambda kv: -kv[1])[:3]
    print(f'{r["row"]:14s} lin {lin.get("ms", lin.get("error", "?"))!s:.8} mamba '
          f'{mam.get("ms", "-")!s:.8} ratio {r.get("ratio", 0):.2f} | '
          + "; ".join(f"{n[:40]} {ms:.3f}" for n, ms in top)
          + (f' | variants {lin["variants"]}' if "variants" in lin else ""))
PY
