#!/usr/bin/env bash
# The wheels the GPU machine lacks for the model tests and benchmark (issue 46:
# tests/test_models_gpu.py, bench/models_bench.py), downloaded here into .whl/ (git-ignored)
# for python3.12 on x86_64 Linux. The GPU machine has torch, triton, numpy, einops, jinja2,
# click, pytest, packaging, filelock, fsspec, typing_extensions, and fla-core 0.6.0 in
# .gpu/site.tar.xz; added here: transformers (its import, the four models, generation),
# kernels (the mapping), huggingface_hub and what their imports need, and
# flash-linear-attention (fla.layers / fla.models, which fla-core lacks; fla is a pkgutil
# namespace, so the two halves may sit in different folders of the path). Found by importing
# the tests and models with only these on the path (python3 -S).
#
#   bash bench/models_wheels.sh          # from the project root; prints the total size
#
# transformers' wheel (14 MB) is slimmed to the model folders used here (auto, qwen3_next,
# qwen3_5, olmo_hybrid, kimi_linear; llama for the CPU tests), about 2 MB, marked as such:
# version 5.25.0+slim.
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=$PYTHONPATH:/tmp/site HF_HUB_OFFLINE=1
set -euo pipefail
root=$(git rev-parse --show-toplevel)
dst="$root/.whl"
PINS=(transformers==5.25.0 kernels==0.19.1 huggingface_hub==2.4.0 safetensors==0.8.0
      tokenizers==0.23.3 regex==2026.12.2 pyyaml==6.0.4 tqdm==4.70.1 httpx2==2.17.0
      httpcore2==2.17.0 h11==0.16.0 idna==3.21 truststore==0.10.5 tomlkit==0.15.3
      flash-linear-attention==0.6.0 pytest-xdist==3.8.0 execnet==2.1.2)   # xdist: gpu_session's -n
KEEP_MODELS="auto qwen3_next qwen3_5 olmo_hybrid kimi_linear llama"
mkdir -p "$dst"
rm -f "$dst"/transformers-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dst" "${PINS[@]}"

python3 - "$dst" $KEEP_MODELS <<'PY'
"""Rewrite transformers' wheel with only the model folders named: version +slim, RECORD
rehashed."""
import base64, glob, hashlib, os, sys, zipfile
dst, keep = sys.argv[1], set(sys.argv[2:])
src = glob.glob(os.path.join(dst, "transformers-5.25.0-py3-none-any.whl"))[0]
old_info, new_info = "transformers-5.25.0.dist-info/", "transformers-5.25.0+slim.dist-info/"
out = os.path.join(dst, "transformers-5.25.0+slim-py3-none-any.whl")
records = []
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for item in zin.infolist():
        parts = item.filename.split("/")
        if parts[:2] == ["transformers", "models"] and len(parts) > 3 and parts[2] not in keep:
            continue
        name = item.filename.replace(old_info, new_info)
        if name == new_info + "RECORD":
            continue
        data = zin.read(item)
        if name == new_info + "METADATA":
            data = data.replace(b"\nVersion: 5.25.0\n", b"\nVersion: 5.25.0+slim\n", 1)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        records.append(f"{name},sha256={digest},{len(data)}")
        zout.writestr(name, data)
    records.append(new_info + "RECORD,,")
    zout.writestr(new_info + "RECORD", "\n".join(records) + "\n")
os.remove(src)
print(f"transformers slimmed: {os.path.getsize(out) / 2**20:.1f} MiB (models: {' '.join(sorted(keep))})")
PY
ls -la "$dst"
echo "total: $(du -cm "$dst"/*.whl | tail -1 | cut -f1) MiB in $(ls "$dst"/*.whl | wc -l) wheels"
