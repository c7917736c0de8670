"""The `decoupled-diloco` flow: a whole run as one Prefect flow run, and its `diloco-region` flow runs.

The run flow provisions the run, starts and watches the syncer, and submits one `diloco-region` flow
run per region to that region's work pool (regions[].work_pool, default `diloco-<region>`): that
pool's worker starts, watches, restarts (with backoff) and stops the region's learners through the
job backend (`RunSupervisor` restricted to the region). A region that fails for good is reported and the
run goes on with the others; the syncer stops once every region's flow run ended. Each time every
fragment gained `eval_every` versions the run flow emits a `diloco.version.committed` event, which
the `diloco-eval` deployment's trigger (prefect.yaml) turns into an eval flow run.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from prefect.deployments import run_deployment
from prefect.events import emit_event
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelling
from rich.console import Console

from diloco.config import Config, ConfigError, load_config
from diloco.flows import reports
from diloco.flows.evals import evaluate_checkpoint, record_eval, recorded_evals
from diloco.infra.jobs import JobBackend, backend_for, sigterm_raises
from diloco.periodic import Every
from diloco.pipelines.prepared import corpus_for
from diloco.run import RunError, RunSetup, child_env, events_from_start, finish, open_run, prepare
from diloco.spec import run_modules
from diloco.processes import outage_seconds
from diloco.supervisor import RunSupervisor

REGION_ENTRYPOINT = "diloco.flows.training.region_run"  # a module path: workers import the installed package
VERSION_EVENT = "diloco.version.committed"


def make_jobs(cfg: Config, cfg_path: Path, region: str | None) -> JobBackend:
    """The job backend of one region's learners, or of the syncer (region None): child processes here,
    or that region's cluster or TPU VMs (diloco.infra.tpu), so a region's runner only ever stops its own."""
    return backend_for(cfg, region, cfg_path, child_env(cfg), preload=run_modules(cfg))


def prefect_termination(signum: int) -> TerminationSignal:
    """SIGTERM as Prefect's engine raises it under a runner, for a flow run called as plain Python."""
    return TerminationSignal(signal=signum)


def run_tag(run_id: str) -> str:
    """The tag of a run's region flow runs: the run flow follows every flow run with it (a region restarted
    by hand too)."""
    return f"diloco-run:{run_id}"


# --- the region flow ---------------------------------------------------------------------------

class RestartLog:
    """A region runner's hook: each restart on the flow run's log as it happens."""

    def __init__(self, logger):
        self.logger, self.restarts = logger, {}

    def __call__(self, run: RunSupervisor) -> None:
        for name, n in run.procs.restarts.items():
            if n > self.restarts.get(name, 0):
                self.logger.warning(f"restarted {name} (restart {n} of at most {run.cfg.run.max_restarts})")
        self.restarts = dict(run.procs.restarts)


def region_report(run: RunSupervisor, region: str, state: str, error: str | None) -> dict:
    procs = run.procs
    learners = [{"learner": lid, "step": run.prog.learners.get(lid, {}).get("step", 0),
                 "restarts": procs.restarts.get(lid, 0), "finished": lid in procs.finished} for lid in run.members]
    return {"region": region, "state": state, "error": error, "learners": learners, "restarts": dict(procs.restarts),
            "outages_s": outage_seconds(procs.outages)}


@task(cache_policy=NO_CACHE)
def watch_region(run: RunSupervisor, t0: float) -> None:
    run.watch(progress=False, t0=t0, on_tick=RestartLog(get_run_logger()))


@flow(name="diloco-region")
def region_run(config: str, region: str) -> dict:
    """Run one region's learners of a provisioned run to their end: `config` is the run's own
    RUN_DIR/config.yaml, `region` one of its regions. Fails when a learner failed run.max_restarts + 1
    times; the region's report (learners, steps, restarts) goes to RUN_DIR/regions/<region>.json and an
    artifact either way."""
    cfg_path = Path(config)
    cfg = load_config(cfg_path)
    if region not in [r.name for r in cfg.regions]:
        raise ConfigError(f"region {region!r} is not one of the run's {[r.name for r in cfg.regions]} ({config})")
    t0 = time.time()
    run = RunSupervisor(cfg, cfg_path, corpus_for(cfg), make_jobs(cfg, cfg_path, region), events_from_start(cfg),
                   Console(quiet=True), [], regions=(region,), syncer=False)
    state, error = "failed", None
    with sigterm_raises(prefect_termination):
        try:
            watch_region(run, t0)
            state = "completed"
        except RunError as err:
            error = str(err).splitlines()[0]
            raise
        except BaseException:
            state = "cancelled"
            raise
        finally:
            run.jobs.stop_all()  # plain calls, not a task: this also runs while a cancellation unwinds
            run.events.close()
            report = region_report(run, region, state, error)
            (cfg_path.parent / "regions").mkdir(exist_ok=True)
            (cfg_path.parent / "regions" / f"{region}.json").write_text(json.dumps(report, indent=1))
            create_table_artifact(report["learners"], key=reports.artifact_key(cfg.run.id, f"region-{region}"),
                                  description=f"region {region} of {cfg.run.id}: {state}"
                                              + (f" ({error})" if error else ""))
    return report


# --- the run flow ------------------------------------------------------------------------------

@task(retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def provision_run(cfg: Config) -> RunSetup:
    return prepare(cfg, Console(quiet=True))


@task(cache_policy=NO_CACHE)
def register_regions(cfg: Config) -> None:
    """A `diloco-region` deployment per work pool the run's regions name (created or updated), run in
    this flow run's working directory."""
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("diloco-region")
        for pool in sorted({r.pool for r in cfg.regions}):
            client.create_deployment(flow_id, pool, work_pool_name=pool, entrypoint=REGION_ENTRYPOINT,
                                     description="a run's learners of one region (flows/training.py:region_run)",
                                     # this flow run's directory: relative paths of the config mean the same there
                                     pull_steps=[{"prefect.deployments.steps.set_working_directory":
                                                  {"directory": os.getcwd()}}])


class Regions:
    """The run flow's hook on the syncer's watch loop: submits the region flow runs once the syncer is
    up, follows their states (a region whose latest flow run ended is done: the run waits for the
    others), and emits a version event each time every fragment gained `every` versions."""

    def __init__(self, setup: RunSetup, every: int, logger, clock=time.time):
        self.setup, self.every, self.logger = setup, every, logger
        self.flow_runs: dict[str, object] = {}  # region -> its latest flow run, as last read
        self.announced = [0] * setup.cfg.fragments.count
        self.every_follow = Every(2.0, clock)  # the Prefect API is asked at most this often

    @property
    def states(self) -> dict[str, str]:
        """Region -> the state name of its latest flow run."""
        return {region: fr.state.name for region, fr in self.flow_runs.items()}

    def submit(self) -> None:
        cfg = self.setup.cfg
        for r in cfg.regions:
            fr = run_deployment(f"diloco-region/{r.pool}", timeout=0, tags=[run_tag(cfg.run.id)],
                                flow_run_name=f"{cfg.run.id}-{r.name}",
                                parameters={"config": str(self.setup.cfg_path), "region": r.name})
            self.flow_runs[r.name] = fr
            self.logger.info(f"region {r.name}: flow run {fr.name} on work pool {r.pool}")

    def __call__(self, run: RunSupervisor) -> None:
        if not self.flow_runs:
            self.submit()
            run.elsewhere = set(self.states)
        if self.every_follow.due():
            self.follow(run)
        versions = [run.prog.versions.get(p, 0) for p in range(run.cfg.fragments.count)]
        if self.every and min(versions) >= min(self.announced) + self.every:
            self.announced = versions
            emit_event(VERSION_EVENT, resource={"prefect.resource.id": f"diloco.run.{run.cfg.run.id}"},
                       payload={"config": str(self.setup.cfg_path), "versions": versions})

    def follow(self, run: RunSupervisor) -> None:
        with get_client(sync_client=True) as client:
            latest = {}
            for fr in sorted(client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[run_tag(run.cfg.run.id)]))), key=lambda f: f.created):
                latest[fr.parameters.get("region")] = fr
        for region, fr in latest.items():
            if region not in self.flow_runs:
                continue
            if fr.state.is_final() and fr.state.name != self.flow_runs[region].state.name:
                log = self.logger.info if fr.state.is_completed() else self.logger.error
                log(f"region {region}: {fr.state.name}" + (f" ({fr.state.message})" if fr.state.message else ""))
            self.flow_runs[region] = fr
        run.elsewhere = {region for region, fr in self.flow_runs.items() if not fr.state.is_final()}

    def cancel_unfinished(self) -> None:
        with get_client(sync_client=True) as client:
            for fr in self.flow_runs.values():
                if not client.read_flow_run(fr.id).state.is_final():
                    client.set_flow_run_state(fr.id, Cancelling(), force=True)


@task(cache_policy=NO_CACHE)
def watch_run(run: RunSupervisor, regions: Regions, t0: float) -> None:
    run.watch(progress=False, t0=t0, on_tick=regions)


@task(retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def summarise(setup: RunSetup, run: RunSupervisor, regions: dict[str, str]) -> dict:
    summary = finish(setup, run, Console(quiet=True))
    reports_ = [json.loads(p.read_text()) for p in sorted((setup.run_dir / "regions").glob("*.json"))]
    summary["restarts"] = {k: v for rep in reports_ for k, v in rep["restarts"].items()}
    summary["members"] = [row["learner"] for rep in reports_ for row in rep["learners"]]
    summary["regions"] = regions
    (setup.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


@task(cache_policy=NO_CACHE)
def publish(summary: dict, evals: list[dict]) -> None:
    reports.run_artifacts(summary, evals)


@flow(name="decoupled-diloco")
def decoupled_diloco(config: str | None = None, overrides: list[str] | None = None, eval_every: int = 4) -> dict:
    """Train one run to the end. `config`: a YAML file (None: defaults); `overrides`: `key=value` as with
    `diloco train --set`; `eval_every`: a version event each time every fragment gained this many versions
    (0: none; the run is evaluated at the start and the end either way). Fails if every region failed."""
    cfg = load_config(config, overrides or [])
    setup = provision_run(cfg)
    record_eval(setup.cfg, {"version": 0, "versions": [0] * cfg.fragments.count, "tokens": 0,  # prepare measured it
                            "loss": setup.eval_start, "perplexity": math.exp(setup.eval_start)})
    register_regions(setup.cfg)
    regions = Regions(setup, eval_every, get_run_logger())
    run = open_run(setup, make_jobs(setup.cfg, setup.cfg_path, None), Console(quiet=True), kills=[], regions=())
    with sigterm_raises(prefect_termination):
        try:
            watch_run(run, regions, setup.t_start)
        finally:
            # plain calls, not a task: this also runs while a cancellation unwinds the flow run
            if regions.flow_runs:
                regions.cancel_unfinished()
            run.jobs.stop_all()
            run.events.close()
    if not any(state == "Completed" for state in regions.states.values()):
        raise RunError(f"every region failed: {regions.states}")
    summary = summarise(setup, run, regions.states)
    evaluate_checkpoint(str(setup.cfg_path), [int(v) for v in summary["versions"].values()])
    publish(summary, recorded_evals(setup.cfg))
    return summary
