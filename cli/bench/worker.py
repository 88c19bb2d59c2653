"""A benchmark implementation in a process of its own (run as a script, never imported by
the package): another project's kernels (TileOPs' release with its own TileLang,
flashinfer with its own tvm_ffi) cannot share a process with linattn's TileLang.

    python3 worker.py BACKEND_FILE FD_IN FD_OUT

BACKEND_FILE is a module file (seed_calls.py, flashinfer_calls.py) with
``make(op, options, decode, x) -> (fn, convert)``: fn() is the timed call, convert(result)
maps its result to the reference's names and layouts (outside timing); it raises
``NotImplementedError`` for a call it does not serve (a refusal) and may raise
``backend.REFUSALS`` (a tuple of exception types) from fn() for the same.

Protocol (remote.py is the other end): length-prefixed pickles on FD_IN / FD_OUT, CUDA
tensors passed as CUDA IPC handles (no copies), others by value. Requests and answers:

    {"cmd": "prepare", "op", "options", "decode", "x"}  -> {"ok": True} | {"refused": msg}
    {"cmd": "run"}                  -> {"outputs": {name: tensor}} | {"refused"} | {"error"}
    {"cmd": "time", "budget_ms"}    -> {"timing": {...}} | {"error": msg}
    {"cmd": "release"}              -> {"ok": True}   (drops the call, its inputs, outputs)
    {"cmd": "exit"}                 -> (the process ends)

Every answer also carries "log": what the backend printed since the last answer is in
the worker's own stderr, which the parent keeps for crash reports.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import struct
import sys
import traceback

HEADER = struct.Struct("<Q")


def load_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class TensorPickler(pickle.Pickler):
    """CUDA tensors as IPC handles (the receiver maps the sender's memory), others as usual."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor
            return reduce_tensor(obj.detach())
        return NotImplemented


def dumps(obj) -> bytes:
    import io
    buf = io.BytesIO()
    TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def send(fd: int, obj) -> None:
    data = dumps(obj)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def recv(fd: int):
    """The next message, or None at end of stream."""
    head = _read_exact(fd, HEADER.size)
    if head is None:
        return None
    body = _read_exact(fd, HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _brief(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:800]


class Worker:
    """The child's state: the backend module, the prepared call, its last outputs."""

    def __init__(self, backend):
        self.backend = backend
        self.refusals = tuple(getattr(backend, "REFUSALS", ())) + (NotImplementedError,)
        self.fn = self.convert = self.x = self.outputs = None
        self._timer = None

    def handle(self, msg: dict) -> dict:
        method = getattr(self, "cmd_" + str(msg.get("cmd")), None)
        if method is None:
            return {"error": f"unknown command {msg.get('cmd')!r}"}
        try:
            return method(msg)
        except self.refusals as e:
            return {"refused": _brief(e)}
        except Exception as e:
            return {"error": _brief(e), "traceback": traceback.format_exc(limit=6)}

    def cmd_prepare(self, msg):
        self.cmd_release(msg)
        self.x = msg["x"]
        self.fn, self.convert = self.backend.make(msg["op"], msg["options"], msg["decode"], self.x)
        return {"ok": True}

    def cmd_run(self, msg):
        if self.fn is None:
            return {"error": "run before prepare"}
        res = self.fn()
        _sync()
        self.outputs = self.convert(res)
        return {"outputs": self.outputs}

    def cmd_time(self, msg):
        if self.fn is None:
            return {"error": "time before prepare"}
        if self._timer is None:
            self._timer = load_file("linattn_bench_timer",
                                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "timer.py"))
        self.outputs = None
        return {"timing": self._timer.device_time(self.fn, budget_ms=float(msg.get("budget_ms", 100.0)))}

    def cmd_release(self, msg):
        self.fn = self.convert = self.x = self.outputs = None
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"ok": True}


def _sync():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def main(argv) -> int:
    backend_file, fd_in, fd_out = argv[1], int(argv[2]), int(argv[3])
    # whatever the backend prints goes to stderr: fd_out carries the protocol alone
    sys.stdout = sys.stderr
    try:
        backend = load_file("linattn_bench_backend", backend_file)
        hello = {"ok": True, "backend": getattr(backend, "describe", lambda: {})()}
    except Exception as e:
        backend, hello = None, {"error": "backend import failed: " + _brief(e),
                                "traceback": traceback.format_exc(limit=6)}
    send(fd_out, hello)
    if backend is None:
        return 2
    worker = Worker(backend)
    while True:
        msg = recv(fd_in)
        if msg is None or msg.get("cmd") == "exit":
            return 0
        send(fd_out, worker.handle(msg))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
