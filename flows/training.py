"""The `decoupled-diloco` flow: a whole run as one Prefect flow run.

Provision, start the syncer and every region's learners through the configured job backend, watch
heartbeats and restart failed processes with backoff (`LocalRun`), evaluate new checkpoints as they
appear, and tear everything down at the end, on failure and on cancellation.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from rich.console import Console

from diloco.config import Config, load_config
from diloco.flows import reports
from diloco.flows.evals import evaluate_checkpoint
from diloco.flows.tpu import RegionJobs
from diloco.infra.jobs import LocalJobs
from diloco.run import LocalRun, RunSetup, _child_env, finish, open_run, prepare


def make_jobs(setup: RunSetup):
    if setup.cfg.backend.kind != "local":  # the syncer's backend and each region's (flows/tpu.py)
        return RegionJobs.of(setup.cfg, setup.cfg_path, setup.run_dir / "logs")
    return LocalJobs(setup.run_dir / "logs", _child_env(setup.cfg))


@contextmanager
def sigterm_raises():
    """A process worker cancels with SIGTERM. Under a Prefect runner the engine already turns it into
    TerminationSignal; elsewhere (a plain `python` call) we do, so `finally` blocks still stop the jobs."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise TerminationSignal(signal=signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class EvalSchedule:
    """The watch loop's hook: an eval subflow every `every` versions (of the slowest fragment), and a
    record of each restart as it happens."""

    def __init__(self, every: int, logger):
        self.every, self.logger = every, logger
        self.evals: list[dict] = []
        self.done_at = 0
        self.restarts: dict[str, int] = {}

    def __call__(self, run: LocalRun) -> None:
        for name, n in run.restarts.items():
            if n > self.restarts.get(name, 0):
                self.logger.warning(f"restarted {name} (restart {n} of at most {run.cfg.run.max_restarts})")
        self.restarts = dict(run.restarts)
        versions = [run.prog.versions.get(p, 0) for p in range(run.cfg.fragments.count)]
        if self.every and min(versions) >= self.done_at + self.every:
            self.done_at = min(versions)
            self.evaluate(str(run.cfg_path), versions)

    def evaluate(self, cfg_path: str, versions: list[int]) -> None:
        """An eval subflow, unless the last one already saw exactly these versions."""
        if not self.evals or self.evals[-1]["versions"] != versions:
            self.evals.append(evaluate_checkpoint(cfg_path, versions))


@task(retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def provision_run(cfg: Config) -> RunSetup:
    return prepare(cfg, Console(quiet=True))


@task(cache_policy=NO_CACHE)
def watch_run(run: LocalRun, schedule: EvalSchedule, t0: float) -> None:
    run.watch(progress=False, t0=t0, on_tick=schedule)


@task(retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def summarise(setup: RunSetup, run: LocalRun) -> dict:
    return finish(setup, run, Console(quiet=True))


@task(cache_policy=NO_CACHE)
def publish(summary: dict, evals: list[dict]) -> None:
    reports.run_artifacts(summary, evals)


@flow(name="decoupled-diloco")
def decoupled_diloco(config: str | None = None, overrides: list[str] | None = None, eval_every: int = 4) -> dict:
    """Train one run to the end. `config`: a YAML file (None: defaults); `overrides`: `key=value` as with
    `diloco train --set`; `eval_every`: evaluate each time every fragment gained this many versions (0: only
    at the start and the end)."""
    cfg = load_config(config, overrides or [])
    setup = provision_run(cfg)
    schedule = EvalSchedule(eval_every, get_run_logger())
    schedule.evaluate(str(setup.cfg_path), [0] * cfg.fragments.count)
    run = open_run(setup, make_jobs(setup), Console(quiet=True), kills=[])
    with sigterm_raises():
        try:
            watch_run(run, schedule, setup.t_start)
        finally:
            # plain calls, not a task: this also runs while a cancellation unwinds the flow run
            run.jobs.stop_all()
            run.events.close()
    summary = summarise(setup, run)
    schedule.evaluate(str(setup.cfg_path), [int(v) for v in summary["versions"].values()])
    publish(summary, schedule.evals)
    return summary
