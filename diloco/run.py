"""A local multi-region run's life cycle: provision it, open a RunSupervisor on its processes
(diloco.supervisor), stop cleanly, evaluate, and summarise (diloco.summary).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.text import Text

from diloco import chaos, membership, signing
from diloco.checkpoint import read_global
from diloco.config import Config, ConfigError, dump_config
from diloco.infra import kafka as kafka_io
from diloco.infra import services
from diloco.infra.jobs import JobBackend, LocalJobs, Terminated, sigterm_raises
from diloco.infra.store import FragmentStore
from diloco.pipelines.prepared import corpus_for
from diloco.plan import Plan, flatten, unflatten
from diloco.shard_format import Corpus
from diloco.spec import ModelSpec, evaluate, import_roots, initial_plan, load_spec, run_modules
from diloco.summary import build_summary, run_warnings, summary_table
from diloco.supervisor import RunError, RunSupervisor
from diloco.syncer import state as state_mod
from diloco.syncer.provision import provision
from diloco.textout import labelled

log = logging.getLogger(__name__)

__all__ = ["RunError", "RunSetup", "RunSupervisor", "child_env", "events_from_start", "finish", "local_jobs", "new_run_id",
           "open_run", "prepare", "provision_run", "train"]


def new_run_id(cfg: Config) -> str:
    return cfg.run.id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def child_env(cfg: Config) -> dict:
    n = cfg.run.threads_per_process
    flags = os.environ.get("XLA_FLAGS", "")
    if n == 1 and "multi_thread_eigen" not in flags:
        flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "OMP_NUM_THREADS": str(n), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(import_roots() + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    if cfg.run.id:  # JAX's persistent compilation cache, for every program however quick to compile: a
        # restarted learner or a spare taking over finds the steps compiled before in the run. A cache
        # the caller set (JAX_COMPILATION_CACHE_DIR) wins: runs of one model then share it.
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(cfg.run.dir) / cfg.run.id / "jax-cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return env


def local_jobs(cfg: Config, logs: Path) -> LocalJobs:
    """The run's processes as children of this machine, forked (run.warm_starts) from a server that
    imported the library and the run's own modules once."""
    return LocalJobs.for_run(cfg, logs, child_env(cfg), run_modules(cfg))


def foreign_stack(cfg: Config, state_dir: Path = services.STATE_DIR) -> str | None:
    """For a run on the embedded defaults' broker and Redis (127.0.0.1:9092 and :6379), what answered
    there if this user's `diloco infra up` (in this directory) did not start it: on a shared machine it
    may be anyone's. None when the config names other services, or they are this user's."""
    fields = type(cfg.transport).model_fields["bootstrap_servers"], type(cfg.state).model_fields["redis_url"]
    defaults = services.stack_addresses(*(f.default for f in fields))
    used = services.stack_addresses(cfg.transport.bootstrap_servers, cfg.state.redis_url)
    found = [f"{name} on {h}:{p}: {why}" for name, (h, p) in used.items()
             if (h, p) == defaults[name] and (why := services.not_ours(name, p, state_dir))]
    if not found:
        return None
    return ("the config uses the embedded defaults' broker and Redis, and what answered was not started by your "
            f"`diloco infra up` here ({'; '.join(found)}). For a stack of your own, put free ports in "
            "transport.bootstrap_servers and state.redis_url, then `diloco infra up --config FILE` and "
            "`diloco train --config FILE`")


@dataclass
class RunSetup:
    """A provisioned run: what starting, watching and summarising it need."""
    cfg: Config
    run_dir: Path
    cfg_path: Path
    corpus: Corpus
    state: state_mod.SyncerState
    store: FragmentStore
    spec: ModelSpec
    plan: Plan
    template: object          # the model's initial pytree: what global versions are put into
    eval_start: float
    t_start: float

    def evaluate(self, versions: dict[int, int]) -> float:
        """Held-out loss of the global model at these versions."""
        return evaluate(self.spec, unflatten(self.template, self.plan, read_global(self.store, self.plan, versions)))


def prepare(cfg: Config, console: Console) -> RunSetup:
    """Give the run an id and a directory, prepare the corpus, provision topics, Redis and version 0."""
    t_start = time.time()
    run_id = new_run_id(cfg)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})
    run_dir = Path(cfg.run.dir) / run_id
    created = not run_dir.exists()  # a resumed run's folder stays whatever happens
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    try:
        return _prepare(cfg, console, run_dir, t_start)
    except BaseException:
        if created:  # a start that failed leaves no folder for `diloco topics` and others to take as the newest run
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _prepare(cfg: Config, console: Console, run_dir: Path, t_start: float) -> RunSetup:
    run_id = cfg.run.id
    console.print(Text.assemble(("run", "bold"), f" {run_id}  dir {run_dir}  broker {cfg.transport.bootstrap_servers}  "
                                f"store {cfg.store.url}"))
    if notice := foreign_stack(cfg):  # once, on the console (a log line would repeat it there)
        console.print(Text(f"note: {notice}", style="yellow"))

    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)  # fail fast
    corpus = corpus_for(cfg)
    console.print(Text(f"corpus {corpus.dir}: {sum(s['tokens'] for s in corpus.manifest['shards']):,} train tokens "
                       f"in {corpus.num_shards} shards, {corpus.manifest['heldout']['tokens']:,} held out"))
    cfg = cfg.with_corpus(corpus.dir)
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(dump_config(cfg))
    if (secret := cfg.signing_secret()) is not None:  # each learner signs with its own key (diloco.signing)
        signing.write_keys(secret, run_id, cfg.member_ids(), cfg.keys_dir(run_id))
    store = FragmentStore(cfg.store.url, run_id)
    spec, plan, template = provision_run(cfg, run_id, state=state, store=store, corpus=corpus)
    console.print(f"model {cfg.model.entry}: {plan.num_params:,} parameters in {len(plan.tensors)} tensors, "
                  f"{plan.fragments} fragments")
    setup = RunSetup(cfg, run_dir, cfg_path, corpus, state, store, spec, plan, template, math.nan, t_start)
    setup.eval_start = setup.evaluate({p: 0 for p in range(plan.fragments)})
    console.print(f"held-out loss at start: {setup.eval_start:.4f}")
    return setup


def provision_run(cfg: Config, run_id: str, *, state: state_mod.SyncerState, store: FragmentStore | None = None,
                  corpus: Corpus | None = None):
    """Load the model spec, make the run's plan from its initial parameters (errors name the leaf or
    pattern), check the corpus vocabulary against the model's, and provision topics, Redis, the plan
    and version 0. Returns (spec, plan, initial tree)."""
    spec = load_spec(cfg)
    plan, template = initial_plan(cfg, spec)
    vocab = None if corpus is None else corpus.manifest.get("vocab_size", 256)
    if vocab and spec.vocab_size and vocab > spec.vocab_size:
        raise ConfigError(f"the corpus {corpus.dir} has a vocabulary of {vocab:,} tokens, larger than the model's "
                          f"{spec.vocab_size:,} ({cfg.model.entry}): ids past it would index out of range")
    producer = kafka_io.producer(cfg.transport)
    try:
        provision(cfg, run_id, state=state, store=store or FragmentStore(cfg.store.url, run_id), producer=producer, plan=plan,
                  initial={n: np.asarray(a) for n, a in flatten(template, plan).items()})
    finally:
        producer.close()
    return spec, plan, template


def events_from_start(cfg: Config):
    """A consumer of the run's events topic from its first record."""
    events = kafka_io.consumer(cfg.transport)
    events.assign({(kafka_io.Topics.for_run(cfg, cfg.run.id).events, 0): 0})
    return events


def open_run(setup: RunSetup, jobs: JobBackend, console: Console, kills: list[chaos.Kill], **which) -> RunSupervisor:
    """A RunSupervisor on `jobs` that reads the run's events topic from its start; `which`: its regions
    and syncer (RunSupervisor)."""
    return RunSupervisor(setup.cfg, setup.cfg_path, setup.corpus, jobs, events_from_start(setup.cfg), console, kills,
                         state=setup.state, **which)


def finish(setup: RunSetup, run: RunSupervisor, console: Console, summary_json: str | Path | None = None) -> dict:
    """Evaluate the last versions and write the summary (the run's processes have stopped)."""
    cfg = setup.cfg
    eval_end = setup.evaluate(setup.state.versions())
    summary = build_summary(cfg, cfg.run.id, setup.state, run.prog, setup.eval_start, eval_end,
                            time.time() - setup.t_start)
    summary |= run.resilience(setup.state)
    summary["coverage"] = run.coverage(setup.state)
    summary["membership"] = membership.timeline(cfg.learner_ids(), run.prog.membership, start=run.ledger.first_beat)
    summary["members"] = list(run.members)
    summary["run_dir"] = str(setup.run_dir)
    summary["bad_events"] = run.bad_events  # skipped: malformed, or claims nothing in the run backs
    summary["warnings"] = run_warnings(summary)
    (setup.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary_json:
        Path(summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_json).write_text(json.dumps(summary, indent=1))
    console.print(summary_table(summary))
    for warning in summary["warnings"]:
        log.warning(warning, extra={"run_id": cfg.run.id})
        console.print(Text(f"WARNING: {warning}", style="bold red"))
    return summary


def train(cfg: Config, *, summary_json: str | Path | None = None, progress: bool = True,
          console: Console | None = None, with_chaos: bool = False) -> dict:
    """Run to the end and return the summary; with_chaos kills processes on the seeded schedule."""
    console = console or Console(stderr=True)
    setup = prepare(cfg, console)
    jobs = local_jobs(setup.cfg, setup.run_dir / "logs")
    with sigterm_raises():  # a SIGTERM (exit status 143) stops the jobs first
        run = open_run(setup, jobs, console, chaos.schedule(setup.cfg) if with_chaos else [])
        try:
            run.watch(progress, setup.t_start)
        except Terminated:
            console.print(labelled("run stopped by SIGTERM:", f"stopping its learners and syncer; logs in {setup.run_dir / 'logs'}"))
            raise
        finally:
            jobs.stop_all()
            run.events.close()
    return finish(setup, run, console, summary_json)
