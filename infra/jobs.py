"""Job backends: how the processes of a run are started, watched and stopped.

`JobBackend` is what the run supervisor (diloco.supervisor) drives, whoever started it (`diloco
train`, `diloco chaos`, the Prefect flows); `backend_for` picks one for a runner from the config.
`LocalJobs` (here) runs the jobs as child processes of this machine; `GkeJobs` and `TpuVmJobs`
(diloco.infra.tpu) run them as JobSets or on TPU VM slices. Orchestration code (run.py, flows/)
never touches Popen, kubectl or gcloud directly.

Jobs are forked from a process that has imported the learner's and syncer's code already
(infra/forkserver.py: a warm start costs milliseconds, not 1.3-1.7 CPU-seconds of imports, at every
start and restart); a job whose environment differs from the run's is started from scratch.

A job may be several processes: a learner over several hosts (`parallel.processes`) is one JAX
program, so its processes live and die together. They find each other through JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID; when one of them fails, the others are killed at once (they
would only wait in a collective for it) and the job reports the failure, so it restarts as a whole.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from diloco.infra.forkserver import ForkedProcess, ForkServer
from diloco.infra.services import free_port

if TYPE_CHECKING:
    from diloco.config import Config

log = logging.getLogger(__name__)


class JobBackend(Protocol):
    """Named jobs, each one learner or syncer shard: `diloco ARGV...` wherever the backend runs it."""

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, processes: int = 1) -> object:
        """Start job `name` (again, for a restart); `env` and `processes` mean something locally only."""

    def has(self, name: str) -> bool:
        """Whether job `name` was started here."""

    def poll(self, name: str) -> int | None:
        """None while it runs (or is still being set up), else its exit code."""

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: stop gracefully (a learner hands in and says it left); SIGKILL: at once."""

    def wait(self, name: str, timeout: float | None = None) -> int:
        """Until it exited; its exit code."""

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every job of this backend: no orphans."""

    def tail(self, name: str, lines: int = 20) -> str:
        """The last lines of its log, for an error message."""

    def where_log(self, name: str) -> str:
        """Where its whole log is: a path, or the command that reads it."""


class SpareJobs(JobBackend, Protocol):
    """A backend that keeps warm spares (run.spares; the config allows them on the local backend only)."""

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, processes: int = 1,
              stdin_pipe: bool = False) -> object:
        """stdin_pipe: the job reads what `tell` writes (a spare's assignment)."""

    def has(self, name: str) -> bool:
        return name in self.jobs

    def where_log(self, name: str) -> str:
        return str(self.jobs[name].log)

    def tell(self, name: str, line: str) -> None:
        """One line to a job started with stdin_pipe."""

    def rename(self, old: str, new: str) -> None:
        """Job `old` goes on as `new` (a spare that became a learner)."""


def backend_for(cfg: Config, region: str | None, config_file: Path, env: dict[str, str] | None = None,
                preload: Sequence[str] = ()) -> JobBackend:
    """The backend of one runner of the run whose config is `config_file` (logs beside it): with
    backend.kind local every job on this machine (`env` theirs, `preload` imported once for them);
    else region `region`'s learners on its cluster or TPU VMs, or (None) the syncer's home cluster
    (diloco.infra.tpu)."""
    if cfg.backend.kind == "local":
        return LocalJobs.for_run(cfg, config_file.parent / "logs", env, preload)
    from diloco.infra.tpu import jobs_for

    return jobs_for(cfg, region, config_file, config_file.parent / "logs")


@dataclass
class Job:
    name: str
    argv: list[str]
    log: Path                       # process 0's; process i > 0 logs to <name>.p<i>.log beside it
    procs: list[subprocess.Popen | ForkedProcess]

    @property
    def popen(self) -> subprocess.Popen | ForkedProcess:
        return self.procs[0]

    @property
    def logs(self) -> list[Path]:
        return [self.log] + [self.log.with_name(f"{self.name}.p{i}.log") for i in range(1, len(self.procs))]


class LocalJobs:
    """`python -m diloco ARGV...` per job (per process of a job), output appended to a log file.
    warm: fork the jobs that run in `env` from a fork server, started with the first (its log:
    forkserver.log) and stopped by `stop_all`; it also imports `preload` (the run's model entry
    module and `run.preload`) once for all of them."""

    def __init__(self, logs: Path, env: dict[str, str] | None = None, warm: bool = True, preload: Sequence[str] = ()):
        self.logs, self.env, self.preload = logs, env or dict(os.environ), tuple(preload)
        self.jobs: dict[str, Job] = {}
        logs.mkdir(parents=True, exist_ok=True)
        self.warm, self.forks = warm, None
        self.told_not_preloaded = False

    @classmethod
    def for_run(cls, cfg: Config, logs: Path, env: dict[str, str] | None, preload: Sequence[str] = ()) -> LocalJobs:
        """A run's jobs on this machine, warm-started as run.warm_starts says, from a server that imported
        `preload` (the run's own modules: diloco.spec.run_modules) once."""
        return cls(logs, env, warm=cfg.run.warm_starts, preload=preload)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, processes: int = 1,
              stdin_pipe: bool = False) -> Job:
        """stdin_pipe: process 0 reads what `tell` writes (a spare's assignment); else stdin is empty."""
        base = {**self.env, **(env or {})}
        if processes > 1:
            base |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": str(processes)}
        job = Job(name, argv, self.logs / f"{name}.log", [])
        if processes == 1 and not env and (forked := self._fork(argv, job.log, stdin_pipe)):
            job.procs.append(forked)
            self.jobs[name] = job
            return job
        for i, log in enumerate(Job(name, argv, job.log, [None] * processes).logs):
            with open(log, "ab") as out:
                job.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "diloco", *argv], stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.PIPE if stdin_pipe and i == 0 else subprocess.DEVNULL,
                    env={**base, "JAX_PROCESS_ID": str(i)} if processes > 1 else base))
        self.jobs[name] = job
        return job

    def _fork(self, argv: list[str], log_path: Path, stdin_pipe: bool) -> ForkedProcess | None:
        """The job forked from the server, or None where there is none (then it starts from scratch)."""
        if self.warm and self.forks is None:
            self.forks = ForkServer(self.env, self.logs / "forkserver.log", preload=self.preload)
        if self.forks is None:
            return None
        if not self.forks.ready():
            return self._cold("the fork server did not start")
        if not self.told_not_preloaded:
            self.told_not_preloaded = True
            for line in self.forks.not_preloaded:
                log.warning("the fork server did not import %s; each job imports it itself", line)
        read, write = os.pipe() if stdin_pipe else (os.open(os.devnull, os.O_RDONLY), None)
        try:
            with open(log_path, "ab") as out:
                forked = self.forks.spawn(argv, read, out.fileno())
        except OSError as err:
            if write is not None:
                os.close(write)
            if self.forks.proc.poll() is None:  # one fork failed (EAGAIN, ENOMEM, EMFILE): this job starts
                log.warning("fork server could not fork %s (%s): starting it from scratch", argv[:1], err)
                return None                      # cold; the jobs it forked keep their server
            return self._cold(f"fork server failed ({err})")
        finally:
            os.close(read)
        if write is not None:
            forked.stdin = open(write, "wb")
        return forked

    def _cold(self, why: str) -> None:
        """From now on every job starts from scratch (the server is gone or never started: no job
        depends on it)."""
        log.warning("%s: starting jobs from scratch; its log: %s", why, self.logs / "forkserver.log")
        self.forks.close()
        self.forks, self.warm = None, False

    def has(self, name: str) -> bool:
        return name in self.jobs

    def where_log(self, name: str) -> str:
        return str(self.jobs[name].log)

    def tell(self, name: str, line: str) -> None:
        """One line to process 0 of a job started with stdin_pipe."""
        stdin = self.jobs[name].popen.stdin
        stdin.write(line.encode() + b"\n")
        stdin.flush()

    def rename(self, old: str, new: str) -> None:
        """The job `old` goes on as `new` (a spare that became a learner); its log keeps its name."""
        self.jobs[new] = self.jobs.pop(old)

    def poll(self, name: str) -> int | None:
        """None while running, else the exit code (negative: killed by that signal). The first
        process to fail fails the job: its siblings are killed."""
        procs = self.jobs[name].procs
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return failed[0]
        return None if None in codes else 0

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        for p in self.jobs[name].procs:
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self, name: str, timeout: float | None = None) -> int:
        for p in self.jobs[name].procs:
            p.wait(timeout)
        return self.poll(name)

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM everything still running, then SIGKILL what does not exit in time: no orphans."""
        for name in self.jobs:
            self.signal(name, signal.SIGTERM)
        for job in self.jobs.values():
            for p in job.procs:
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.forks is not None:
            self.forks.close()
            self.forks = None

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            job = self.jobs[name]
        except KeyError:
            return "(no log)"
        out = []
        for log in job.logs:
            try:
                text = "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            except OSError:
                text = "(no log)"
            out.append(text if len(job.logs) == 1 else f"--- {log.name}\n{text}")
        return "\n".join(out)


class Terminated(SystemExit):
    """SIGTERM, raised where the process can still clean up; exits with 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)


@contextmanager
def sigterm_raises(error: Callable[[int], BaseException] = Terminated) -> Iterator[None]:
    """Within the block, SIGTERM raises `error(signum)` instead of ending the process on the spot, so the
    `finally` that stops a run's jobs still runs (`kill`, a scheduler's stop or a CI timeout would
    otherwise leave its learners and syncer training on). A no-op off the main thread, or where a
    handler is installed already (a Prefect worker's engine turns SIGTERM into its own exception)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise error(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
