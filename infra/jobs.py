"""Job backend: how the processes of a run are started, watched and stopped.

`LocalJobs` runs them as child processes of this machine. A backend for TPU VMs or GKE offers the
same four calls; orchestration code (run.py, flows/) never touches Popen directly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Job:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen


class LocalJobs:
    """`python -m diloco ARGV...` per job, output appended to a log file per job name."""

    def __init__(self, logs: Path, env: dict[str, str] | None = None):
        self.logs, self.env = logs, env or dict(os.environ)
        self.jobs: dict[str, Job] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Job:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen([sys.executable, "-m", "diloco", *argv], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**self.env, **(env or {})})
        self.jobs[name] = Job(name, argv, log, popen)
        return self.jobs[name]

    def poll(self, name: str) -> int | None:
        """None while running, else the exit code (negative: killed by that signal)."""
        return self.jobs[name].popen.poll()

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        if self.poll(name) is None:
            self.jobs[name].popen.send_signal(sig)

    def wait(self, name: str, timeout: float | None = None) -> int:
        return self.jobs[name].popen.wait(timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM everything still running, then SIGKILL what does not exit in time: no orphans."""
        for name in self.jobs:
            self.signal(name, signal.SIGTERM)
        for job in self.jobs.values():
            try:
                job.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                job.popen.kill()
                job.popen.wait()

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join(self.jobs[name].log.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, KeyError):
            return "(no log)"
