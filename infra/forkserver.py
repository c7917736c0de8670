"""Warm starts: a process that imports the learner's and the syncer's code once, then forks each job.

`python -m diloco` spends 1.3-1.7 CPU-seconds importing JAX, TensorStore, numba and the rest before it
does anything, and a run starts one such process per learner and shard, and again at every restart.
A fork server pays that once per run: `LocalJobs` starts one with the run's environment, and a job
whose environment is exactly that is forked from it, ready in milliseconds, and then runs
`python -m diloco ARGV...` as a fresh process would (same `sys.argv`, environment, working directory,
signal dispositions, output file; atexit handlers run at its exit).

Only the environment read at import must match, so the server is started with the run's environment
and a job that asks for another one (a learner over several CPU devices or hosts) is started the
usual way. Nothing is initialised before the fork that is not safe across it: the JAX backends, the
TensorStore contexts and every client are made in the child.

The server also imports the run's own modules (`model.entry`'s module and `run.preload`), so a model
library that takes seconds to import (TensorFlow under a tokenizer, Flax, a model zoo) is imported
once per run, not once per learner and restart. One that fails to import there, or that starts JAX's
backend at import (which a fork cannot carry), is left to the jobs, which import it themselves: the
server says so before it is ready (`not-preloaded` lines, which the runner logs), and in the second
case starts again without the run's modules.

The protocol, over a Unix socket, one connection per job:
  server -> runner: "not-preloaded <module>: <why>\n" for each of the run's modules it left to the jobs,
                    then "ready\n" once it listens
  runner -> server: JSON {"module": "diloco", "argv": [...], "cwd": "..."}, with the child's stdin and output descriptors
  server -> runner: "<pid>\\n" once forked, with a pidfd of the job where the system has them (Linux 5.3+),
  runner -> server: "ok\\n" once it holds the pid (it tracks the job from then on),
                    "<exit code>\\n" when it ends (negative: killed by that signal)
The runner signals a job through its pidfd, never by number: the server reaps a job before it sends
the exit code, and init reaps it once the server is gone, so its pid may already name another process.
The server stops when its standard input closes (the runner closed it, or the runner died).
The server forks one job at a time, so a client that sends no request within `request_timeout_s` of
connecting is dropped rather than waited on.
Every job has a runner to stop it and read its exit code: if the runner hangs up before it has
acknowledged the pid (it was stopped or died mid-spawn, before or after the pid was sent), the server
SIGKILLs the job it just forked instead of leaving it to train untracked, and serves on; if the server dies, the runner SIGKILLs the
jobs it forked (their exit codes are lost with it). Jobs outlive a runner that dies, as cold ones do.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import setproctitle

PRELOAD = ("diloco.cli", "diloco.learners.learner", "diloco.syncer.service")
READY = b"ready\n"
NOT_PRELOADED = b"not-preloaded "
ACK = b"ok\n"  # the runner holds the pid: the job is tracked
# The runner sends its request as soon as it connects: a client that has sent none after this long is
# dropped, since the server is single-threaded and every spawn behind it would wait.
REQUEST_TIMEOUT_S = 10.0


class ForkedProcess:
    """A job forked by the server, with the part of `subprocess.Popen` the job backend uses."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, pending: bytes = b"",
                 pidfd: int | None = None):
        """`pending`: what the server sent after the pid line (a job that ended at once: its exit code);
        `pidfd`: the job's, which this object owns (None: signal it by pid)."""
        self.args, self.pid, self.returncode, self.pidfd = args, pid, None, pidfd
        self.stdin = None  # the writing end of a spare's stdin pipe, set by the job backend
        self._conn, self._pending = conn, pending
        if pending.endswith(b"\n"):
            self._ended(int(pending))

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        while self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self) -> None:
        try:
            data = self._conn.recv(64)
        except ConnectionResetError:  # the server died with our acknowledgement unread: as an end of stream
            data = b""
        self._pending += data
        if data and not self._pending.endswith(b"\n"):
            return
        if data:
            self._ended(int(self._pending))
        else:  # the server died before the child ended: nobody can read its exit code, so end it
            self._signal(signal.SIGKILL)
            self._ended(-signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        """Signal the job, through its pidfd where there is one: by then its pid may name another process."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:  # exited, its code not read yet
            pass

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.stdin is not None:
            self.stdin.close()


def read_pid(conn: socket.socket) -> tuple[int, bytes, int | None]:
    """(the forked job's pid, what came after its line, its pidfd or None): a job that ends at once has
    its exit code line arrive in the same read."""
    reply, pidfds = b"", []
    try:
        while b"\n" not in reply:
            data, fds, _, _ = socket.recv_fds(conn, 64, 1, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
            pidfds += fds
            if not data:
                raise OSError("the fork server closed the connection before forking")
            reply += data
        line, _, rest = reply.partition(b"\n")
        pid = int(line)
    except BaseException:
        for fd in pidfds:
            os.close(fd)
        raise
    for fd in pidfds[1:]:
        os.close(fd)
    return pid, rest, (pidfds[0] if pidfds else None)


class ForkServer:
    """The runner's side: start the server with `env`, then `spawn` jobs from it."""

    def __init__(self, env: dict[str, str], log: Path, ready_timeout_s: float = 120.0,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, preload: Sequence[str] = ()):
        """preload: the run's own modules to import once in the server (model.entry's, run.preload)."""
        self.ready_timeout_s = ready_timeout_s
        self.not_preloaded: list[str] = []  # "<module>: <why>" for each of `preload` the jobs import themselves
        self.dir = tempfile.mkdtemp(prefix="diloco-fork-")  # short: a socket path has 107 bytes at most
        self.path = os.path.join(self.dir, "socket")
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "diloco.infra.forkserver", self.path,
                                          str(request_timeout_s), *preload], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out)
        self._ready: bool | None = None

    def ready(self) -> bool:
        """Whether the server has loaded and listens (waits for it the first time); False if it failed."""
        if self._ready is None:
            deadline, line = time.monotonic() + self.ready_timeout_s, b""
            while select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
                line = self.proc.stdout.readline()
                if not line.startswith(NOT_PRELOADED):
                    break
                self.not_preloaded.append(line[len(NOT_PRELOADED):].decode(errors="replace").strip())
            self._ready = line == READY
            if not self._ready:
                self.close()
        return self._ready

    def spawn(self, argv: list[str], stdin: int, out: int, module: str = "diloco") -> ForkedProcess:
        """Fork `python -m MODULE ARGV...` reading `stdin` and writing to `out` (descriptors, kept open)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps({"module": module, "argv": argv, "cwd": os.getcwd()}).encode()], [stdin, out])
            pid, rest, pidfd = read_pid(conn)
            try:
                conn.sendall(ACK)  # from now on the job is this runner's to stop
            except OSError:  # a job that ended at once: the server sent its exit code and hung up
                pass
        except BaseException:
            conn.close()
            raise
        return ForkedProcess([sys.executable, "-m", module, *argv], conn, pid, rest, pidfd)

    def close(self) -> None:
        """Stop the server (the jobs it forked run on); idempotent."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


# The server's side.

def serve(path: str, request_timeout_s: float = REQUEST_TIMEOUT_S, preload: Sequence[str] = ()) -> dict:
    """Load, listen and fork until standard input closes. Returns only in a forked child: its request.
    A client that sends no request within `request_timeout_s` of connecting is dropped. `preload`:
    the run's own modules, imported after the library's (see the module docstring)."""
    # a Ctrl-C, or a SIGTERM to the whole process group (timeout, systemd, scancel), reaches the runner,
    # which stops the jobs cleanly and then closes the server: dying first would end every warm job
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as err:  # an optional part: the children import it (and fail) if they need it
            print(f"fork server: not preloaded: {err}", file=sys.stderr, flush=True)
    _preload_run_modules(path, request_timeout_s, preload)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    gc.collect()
    gc.freeze()  # what is loaded now is shared with every child: collections in it would copy its pages
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    unacknowledged: dict[int, socket.socket] = {}  # jobs whose runner has not said it holds the pid yet
    while True:
        readable = select.select([sys.stdin, listener, wake_r, *unacknowledged.values()], [], [])[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            raise SystemExit(0)
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(children)
            unacknowledged = {pid: c for pid, c in unacknowledged.items() if pid in children}
        for pid, conn in list(unacknowledged.items()):
            if conn in readable:
                del unacknowledged[pid]
                if not _acknowledged(conn):  # the runner left with the pid unread: nobody tracks the job
                    print(f"fork server: the runner left during a spawn; ending job {pid}", file=sys.stderr, flush=True)
                    os.kill(pid, signal.SIGKILL)  # in `children`, so not reaped yet: the pid is still this job's
        if listener in readable:
            conn, fds = listener.accept()[0], []
            try:
                conn.settimeout(request_timeout_s)  # TimeoutError: one silent client must not stall every spawn
                message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
                request = json.loads(message)
                pid = os.fork()
            except Exception as err:  # a request it cannot serve fails that job, not the server
                print(f"fork server: could not fork a job: {err!r}", file=sys.stderr, flush=True)
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for other in (listener, conn, *children.values()):  # the runner must see EOF if the server dies
                    other.close()
                request["fds"] = fds
                return request
            for fd in fds:
                os.close(fd)
            try:
                _send_pid(conn, pid)
            except OSError:  # the runner hung up while it was forked: nobody tracks the job, so end it
                print(f"fork server: the runner left during a spawn; ending job {pid}", file=sys.stderr, flush=True)
                os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still this job's
                conn.close()
                continue
            children[pid] = unacknowledged[pid] = conn


def _preload_run_modules(path: str, request_timeout_s: float, modules: Sequence[str]) -> None:
    """Import the run's modules; one that fails is left to the jobs. One that started JAX's backend
    (its threads and device handles do not survive a fork) taints this process: it starts again
    without the run's modules, having told the runner which one did it."""
    for name in modules:
        try:  # the import statement's own machinery (as diloco.spec.load_entry): `-X importtime` lists it
            __import__(name)
        except BaseException as err:  # the user's code: whatever it raises, the jobs import it and say so
            _not_preloaded(name, f"{type(err).__name__}: {err}")
            continue
        if _jax_backend_started():
            _not_preloaded(name, "it starts JAX's backend at import, which a fork cannot carry")
            for other in modules[modules.index(name) + 1:]:
                _not_preloaded(other, "the fork server started again without the run's modules")
            os.execv(sys.executable, [sys.executable, "-m", "diloco.infra.forkserver", path, str(request_timeout_s)])


def _not_preloaded(module: str, why: str) -> None:
    line = " ".join(f"{module}: {why}".split())  # one line, whatever the error said
    sys.stdout.buffer.write(NOT_PRELOADED + line.encode(errors="replace")[:1000] + b"\n")
    sys.stdout.flush()
    print(f"fork server: not preloaded: {line}; each job imports it itself", file=sys.stderr, flush=True)


def _jax_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # another JAX: assume the worst only if it has backends
        return bool(getattr(sys.modules.get("jax._src.xla_bridge"), "_backends", None))


def _acknowledged(conn: socket.socket) -> bool:
    """Whether what the runner sent after the pid is its acknowledgement (else it hung up)."""
    try:
        return conn.recv(len(ACK)) == ACK
    except OSError:
        return False


def _send_pid(conn: socket.socket, pid: int) -> None:
    """The pid line, with a pidfd of the job where the system has them. The job is not reaped yet (only
    `_reap` waits), so the pidfd is surely of this job."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here (before Linux 5.3, or not Linux)
        conn.sendall(f"{pid}\n".encode())
        return
    try:
        socket.send_fds(conn, [f"{pid}\n".encode()], [pidfd])
    finally:
        os.close(pidfd)


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the runner went away
                pass
            conn.close()


def become(request: dict) -> None:
    """In the child: the descriptors, signals, directory and arguments of `python -m MODULE ARGV...`."""
    stdin, out = request["fds"]
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(stdin)
    os.close(out)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    sys.argv = [request["module"], *request["argv"]]
    # ps, top and kill scripts (and the runner's tests) tell a run's processes apart by their command lines
    setproctitle.setproctitle(shlex.join([sys.executable, "-m", request["module"], *request["argv"]]))
    if "numpy" in sys.modules:  # random reseeds itself at a fork; NumPy's global generator does not
        sys.modules["numpy"].random.seed()


if __name__ == "__main__":
    request = serve(sys.argv[1], float(sys.argv[2]), sys.argv[3:])
    become(request)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
