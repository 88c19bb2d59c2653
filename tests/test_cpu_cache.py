"""bench/cpu_cache.py's archive: unpacked into /tmp on the GPU machine, the cache must land
where .gpu/prelude.sh points TILELANG_CACHE_DIR (/tmp/gpu-cache/tilelang), whatever
--cache directory it was built in here."""
import importlib.util
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_cache():
    spec = importlib.util.spec_from_file_location("cpu_cache", ROOT / "bench" / "cpu_cache.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pack_stores_the_cache_where_the_prelude_reads_it(tmp_path):
    cache = tmp_path / "built-elsewhere" / "tl"
    entry = cache / "0.1.15" / "kernels" / "abc"
    entry.mkdir(parents=True)
    (entry / "kernel.cu").write_text("// a kernel")
    parts = _cpu_cache().pack(tmp_path / "out", cache)
    assert [p.name for p, _ in parts] == ["cache.tar.xz.00"]
    with tarfile.open(parts[0][0], "r:xz") as t:
        names = t.getnames()
    assert "gpu-cache/tilelang/0.1.15/kernels/abc/kernel.cu" in names
    assert all(n.startswith("gpu-cache/tilelang") for n in names), names
