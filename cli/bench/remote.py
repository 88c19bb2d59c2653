"""Implementations that run in a child process with their own package path (worker.py):
TileOPs' release ("seed": tileops 0.1.0 on its own TileLang 0.1.12) and flashinfer (its
own tvm_ffi). The row's tensors are handed over as CUDA IPC handles (no copies), the
child checks nothing itself: it runs the call once (outputs come back the same way and
are checked here against the fp64 reference like every other implementation), then
times it with the same timer (timer.py) in its own process.

Package paths: ``--seed-path`` / ``--flashinfer-path`` of linattn-bench, or the
environment's LINATTN_SEED_PATH / LINATTN_FLASHINFER_PATH (SEED_PATH as the GPU
machine's prelude_both.sh sets it). A child that dies (a crash inside a kernel, an
illegal address) is reported with its exit status and the end of its log, and a new one
is started for the next row.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile

from . import worker as proto
from .gaps import NotImplementedImpl

HERE = os.path.dirname(os.path.abspath(__file__))
#: impl name -> (backend module file, environment variables naming its package path)
BACKENDS = {"seed": ("seed_calls.py", ("LINATTN_SEED_PATH", "SEED_PATH")),
            "flashinfer": ("flashinfer_calls.py", ("LINATTN_FLASHINFER_PATH",))}
#: seconds a child may take to answer one request (a first call compiles its kernels)
ANSWER_S = 600.0


class WorkerCrashed(RuntimeError):
    """The child process died or stopped answering."""


def package_path(impl: str) -> str | None:
    return next((os.environ[v] for v in BACKENDS[impl][1] if os.environ.get(v)), None)


class Remote:
    """One child process serving one implementation; started on first use and again
    after a crash."""

    def __init__(self, impl: str, backend_file: str, pythonpath: str, extra_env=None,
                 answer_s: float = ANSWER_S):
        self.impl, self.backend_file, self.pythonpath = impl, backend_file, pythonpath
        self.extra_env, self.answer_s = dict(extra_env or {}), answer_s
        self.proc = self.fd_in = self.fd_out = self.log = None
        self.hello = None

    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=self.pythonpath, PYTHONUNBUFFERED="1", **self.extra_env)
        return env

    def start(self) -> None:
        c_in, p_out = os.pipe()       # parent writes p_out, child reads c_in
        p_in, c_out = os.pipe()       # child writes c_out, parent reads p_in
        self.log = tempfile.TemporaryFile(mode="a+b")   # appends: the child writes at the end whatever the reader's offset
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "worker.py"), self.backend_file, str(c_in), str(c_out)],
            pass_fds=(c_in, c_out), env=self._env(), stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=self.log, cwd=HERE)
        os.close(c_in)
        os.close(c_out)
        self.fd_out, self.fd_in = p_out, p_in
        self.hello = self._answer()
        if "error" in self.hello:
            self.close()
            raise NotImplementedImpl(f"{self.impl} worker: {self.hello['error']}")

    def request(self, msg: dict) -> dict:
        if self.proc is None:
            self.start()
        try:
            proto.send(self.fd_out, msg)
        except (BrokenPipeError, OSError):
            self._died("the pipe broke")
        return self._answer()

    def _answer(self) -> dict:
        ready, _, _ = select.select([self.fd_in], [], [], self.answer_s)
        if not ready:
            self._died(f"no answer in {self.answer_s:.0f} s", kill=True)
        msg = proto.recv(self.fd_in)
        if msg is None:
            self._died("it exited")
        return msg

    def _died(self, why: str, kill: bool = False):
        if kill and self.proc is not None:
            self.proc.kill()
        rc = self.proc.wait(timeout=30) if self.proc is not None else None
        tail = self.log_tail()
        self.close()
        raise WorkerCrashed(f"{self.impl} worker died ({why}; exit status {rc}): {tail}")

    def log_tail(self, n: int = 600) -> str:
        if self.log is None:
            return ""
        self.log.seek(0, os.SEEK_END)
        size = self.log.tell()
        self.log.seek(max(0, size - n))
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-6:])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                proto.send(self.fd_out, {"cmd": "exit"})
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
        for fd in (self.fd_in, self.fd_out):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.proc = self.fd_in = self.fd_out = None


class RemoteCall:
    """The timed call of one row in the child: call it for the outputs, ``device_time``
    for the timing, ``close`` to free the child's side."""

    in_child = True     # a CUDA error in the child leaves this process's context intact

    def __init__(self, remote: Remote, row, x: dict):
        self.remote = remote
        ans = remote.request({"cmd": "prepare", "op": row.op, "options": dict(row.options),
                              "decode": row.is_decode, "x": x})
        _raise_for(ans, remote.impl)

    def __call__(self) -> dict:
        ans = self.remote.request({"cmd": "run"})
        _raise_for(ans, self.remote.impl)
        return ans["outputs"]

    def device_time(self, budget_ms: float) -> dict:
        ans = self.remote.request({"cmd": "time", "budget_ms": budget_ms})
        _raise_for(ans, self.remote.impl)
        return ans["timing"]

    def close(self) -> None:
        if self.remote.proc is not None:
            self.remote.request({"cmd": "release"})


def _raise_for(ans: dict, impl: str) -> None:
    if "refused" in ans:
        raise NotImplementedImpl(f"{impl} refused: {ans['refused']}")
    if "error" in ans:
        raise RuntimeError(f"{impl}: {ans['error']}")


_REMOTES: dict = {}


def remote_for(impl: str) -> Remote:
    """The (one, lazily started) child of an implementation; NotImplementedImpl when no
    package path is configured."""
    if impl not in _REMOTES:
        path = package_path(impl)
        if not path:
            raise NotImplementedImpl(
                f"no package path for {impl}: pass --{impl}-path or set {BACKENDS[impl][1][0]}")
        env = {}
        if impl == "seed" and os.environ.get("TILELANG_CACHE_DIR"):
            # its TileLang (0.1.12) keeps its compiled kernels apart from linattn's (0.1.15)
            env["TILELANG_CACHE_DIR"] = os.environ["TILELANG_CACHE_DIR"].rstrip("/") + "-seed"
        _REMOTES[impl] = Remote(impl, os.path.join(HERE, BACKENDS[impl][0]), path, env)
    return _REMOTES[impl]


def make(impl: str, row, x: dict):
    """(fn, outputs) for run.py: fn is a RemoteCall (its result is already the reference's
    names and layouts)."""
    return RemoteCall(remote_for(impl), row, x), (lambda res: res)


def close_all() -> None:
    for r in _REMOTES.values():
        r.close()
    _REMOTES.clear()
