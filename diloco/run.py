"""A local multi-region run: provision, start the syncer and every learner as processes, watch the
events topic, stop cleanly, evaluate, and summarise.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kafka import TopicPartition
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from diloco import chaos, coverage, membership, messages
from diloco.checkpoint import read_global
from diloco.config import BUILTIN_MODEL, Config, ConfigError, dump_config
from diloco.infra import kafka as kafka_io
from diloco.infra.jobs import LocalJobs
from diloco.infra.store import FragmentStore, StoreError
from diloco.learners.data import Corpus, corpus_for, epochs_read
from diloco.messages import WireError
from diloco.plan import Plan, flatten, unflatten
from diloco.spec import ModelSpec, evaluate, import_roots, initial_plan, load_spec
from diloco.syncer import state as state_mod
from diloco.syncer.durability import EXIT_STATE_LOST
from diloco.syncer.provision import provision

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    pass


def new_run_id(cfg: Config) -> str:
    return cfg.run.id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def dp_allreduce_bytes(num_params: int, workers: int, steps: int, bytes_per_value: int = 4) -> int:
    """Bytes all workers together send for `steps` ring all-reduces of fp32 gradients.

    Per step each of M workers sends 2 (M - 1) / M of the gradient (reduce-scatter + all-gather);
    `steps` counts every learner's steps, i.e. the same tokens a data-parallel job would process.
    """
    if workers < 2:
        return 0
    return int(steps * 2 * (workers - 1) / workers * num_params * bytes_per_value)


REASON_CHARS = 64  # a rejection reason longer than this is no reason this code base gives


def check_event_fields(ev: dict) -> None:
    """ValueError unless the fields the runner reads have their types: a finite number `time` (if any), a short
    string rejection `reason`, integer fragments and versions of merges."""
    t = ev.get("time", 0.0)
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        raise ValueError(f"event time {messages.short(t, 40)} is not a number")
    kind = ev.get("kind")
    if kind == "contribution_rejected":
        reason = ev.get("reason")
        if not isinstance(reason, str) or not 0 < len(reason) <= REASON_CHARS:
            raise ValueError(f"rejection reason {messages.short(reason, 40)} is not a short string")
    elif kind == "merge":
        if not all(isinstance(ev.get(k), int) and not isinstance(ev.get(k), bool) and ev[k] >= 0
                   for k in ("fragment", "version")) or not isinstance(ev.get("ids"), list):
            raise ValueError("merge event without integer fragment and version and a list of ids")


def check_heartbeat_claims(cfg: Config, ev: dict) -> None:
    """ValueError unless a (typed) heartbeat's step is within its learner's schedule (what a restart or
    a spare resumes from: a forged step far ahead would have it train nothing), what it says it
    handed in is no further than that step, and its tokens within
    what that many steps can hold at syncer.max_tokens_per_step."""
    lid, step, tokens = ev["learner"], ev.get("step", 0), ev.get("tokens", 0)
    if step > cfg.learner_steps(lid):
        raise ValueError(f"heartbeat of {lid} at step {step}: its schedule ends at {cfg.learner_steps(lid)}")
    if ev.get("handed_in_to", 0) > step:
        raise ValueError(f"heartbeat of {lid} at step {step} says it handed in steps up to {ev['handed_in_to']}")
    if ev.get("handed_in_tokens", 0) > tokens * cfg.fragments.count:  # each token is in one delta per fragment
        raise ValueError(f"heartbeat of {lid} says it handed in {ev['handed_in_tokens']} tokens of {tokens} trained "
                         f"over {cfg.fragments.count} fragments")
    if tokens > max(step, 1) * cfg.syncer.max_tokens_per_step:
        raise ValueError(f"heartbeat of {lid} claims {tokens} tokens in {step} steps (syncer.max_tokens_per_step="
                         f"{cfg.syncer.max_tokens_per_step})")


def check_accepted_cursor(cfg: Config, ev: dict) -> None:
    """ValueError unless an acceptance's cursor is [first, end] steps within its learner's schedule
    (a restart resumes past it: a forged one far ahead would have the learner train nothing)."""
    lid, cur = ev.get("learner"), ev.get("cursor")
    if not isinstance(lid, str) or not cfg.is_member_id(lid):
        raise ValueError(f"acceptance of learner {messages.short(lid, 40)}, not one of this run's")
    if (not isinstance(cur, list) or len(cur) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in cur)
            or not 0 <= cur[0] <= cur[1] <= cfg.learner_steps(lid)):
        raise ValueError(f"acceptance of {lid} with cursor {messages.short(cur, 40)}: not [first, end] steps within "
                         f"its schedule of {cfg.learner_steps(lid)}")


@dataclass
class Progress:
    """What the events topic has told us so far."""
    learners: dict[str, dict] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    merges: int = 0
    accepted: int = 0
    rejected: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    merged_ids: list[str] = field(default_factory=list)
    kinds_seen: set[str] = field(default_factory=set)
    eids: set[str] = field(default_factory=set)
    fetched: dict[tuple[str, str], int] = field(default_factory=dict)  # per (learner, incarnation)
    fetched_by_fragment: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)  # the same, per fragment
    merged: dict[tuple[int, int], int] = field(default_factory=dict)  # (fragment, version) -> tokens, as stored
    trained: dict[tuple[str, str], int] = field(default_factory=dict)  # tokens per (learner, incarnation)
    membership: list[dict] = field(default_factory=list)  # learner_admitted, _left, _finished, ... events
    handed_in: dict[str, int] = field(default_factory=dict)  # learner -> furthest cursor end it handed in
    handed_in_tokens: dict[tuple[str, str], int] = field(default_factory=dict)  # per (learner, incarnation)

    def per_learner(self, counts: dict[tuple[str, str], int]) -> dict[str, int]:
        """A per-incarnation count summed per learner."""
        out: dict[str, int] = {}
        for (lid, _), n in counts.items():
            out[lid] = out.get(lid, 0) + n
        return out

    def resume_step(self, learner: str, default: int = 0) -> int:
        """Where a restarted learner (or the spare taking its place) resumes its data stream: past every
        step it handed in (so no window reaches the global model twice) and past its last beat."""
        return max(self.learners.get(learner, {}).get("step", default), self.handed_in.get(learner, 0))

    def tokens(self) -> int:
        """Tokens all learners trained: each incarnation counts from zero (a restarted learner resumes at
        its last heartbeat's step), so the latest beat of every incarnation is summed."""
        return sum(self.trained.values())

    def merged_tokens(self, fragments: int) -> int:
        """Tokens in the global model: the merges' tokens as the syncer stored them with each version
        (`merged`, filled by the runner once it checked a merge event against the store), over the
        fragments (every token trains each fragment once)."""
        return sum(self.merged.values()) // max(fragments, 1)

    def apply(self, ev: dict) -> None:
        """Take one event in; raises ValueError (the caller skips the event) on a field of the wrong
        type: the events topic is writable by every learner."""
        if ev.get("eid") in self.eids:  # at-least-once delivery: a restarted syncer may repeat events
            return
        check_event_fields(ev)
        self.eids.add(ev.get("eid"))
        if ev["kind"] == "heartbeat":  # a restarted learner counts from zero: keep every incarnation's
            key = (ev["learner"], ev.get("incarnation", ""))
            self.fetched[key] = max(self.fetched.get(key, 0), ev.get("bytes_fetched", 0))
            parts = self.fetched_by_fragment.setdefault(key, {})
            for p, n in (ev.get("fetched_by_fragment") or {}).items():
                parts[p] = max(parts.get(p, 0), n)
            self.trained[key] = max(self.trained.get(key, 0), ev.get("tokens", 0))
            self.handed_in[ev["learner"]] = max(self.handed_in.get(ev["learner"], 0), ev.get("handed_in_to", 0))
            self.handed_in_tokens[key] = max(self.handed_in_tokens.get(key, 0), ev.get("handed_in_tokens", 0))
        if ev["kind"] == "heartbeat" and ev.get("step", 0) < self.learners.get(ev["learner"], {}).get("step", 0):
            return  # a late beat of a killed incarnation: the restarted one resumed further on
        kind = ev["kind"]
        self.kinds_seen.add(kind)
        if kind == "heartbeat":
            self.learners[ev["learner"]] = ev
        elif kind == "merge":
            self.merges += 1
            self.versions[int(ev["fragment"])] = int(ev["version"])
            self.merged_ids.extend(ev["ids"])
        elif kind == "contribution_accepted":
            self.accepted += 1
            if ev.get("cursor") is not None:  # checked by the caller: the syncer took it, so it was handed in
                self.handed_in[ev["learner"]] = max(self.handed_in.get(ev["learner"], 0), ev["cursor"][1])
        elif kind == "contribution_rejected":
            self.rejected += 1
            self.rejections[ev["reason"]] = self.rejections.get(ev["reason"], 0) + 1
        elif kind == "syncer_started":
            self.versions |= {int(k): int(v) for k, v in ev["versions"].items()}
        elif kind in membership.CHANGES:
            self.membership.append(ev)


def progress_table(cfg: Config, prog: Progress, run_id: str, elapsed: float) -> Table:
    t = Table(title=f"run {run_id}  ({elapsed:.0f}s)", title_justify="left")
    for col in ("learner", "step", "tokens", "loss", "step ms", "sent", "state"):
        t.add_column(col, justify="right" if col not in ("learner", "state") else "left")
    for lid in sorted(set(cfg.learner_ids()) | set(prog.learners), key=cfg.shard_index):
        hb = prog.learners.get(lid)
        if hb is None:
            t.add_row(Text(lid), "-", "-", "-", "-", "-", "starting")
            continue
        t.add_row(*(Text(str(x)) for x in (
            lid, f"{hb.get('step', 0)}/{cfg.learner_steps(lid)}", f"{hb.get('tokens', 0):,}", _loss(hb),
            f"{1000 * hb.get('step_time', 0.0):.0f}", f"{hb.get('published', 0)} ({hb.get('bytes_sent', 0) / 1e6:.2f} MB)",
            hb.get("state", "?"))))
    versions = " ".join(f"p{p}:v{v}" for p, v in sorted(prog.versions.items()))
    rej = ", ".join(f"{k} {v}" for k, v in sorted(prog.rejections.items())) or "none"
    t.caption = Text(f"syncer: {versions} | merges {prog.merges} | accepted {prog.accepted} | rejected {prog.rejected} ({rej})")
    return t


def _child_env(cfg: Config) -> dict:
    n = cfg.run.threads_per_process
    flags = os.environ.get("XLA_FLAGS", "")
    if n == 1 and "multi_thread_eigen" not in flags:
        flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "OMP_NUM_THREADS": str(n), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(import_roots() + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    if cfg.run.id:  # JAX's persistent compilation cache, for every program however quick to compile: a
        # restarted learner or a spare taking over finds the steps compiled before in the run
        env |= {"JAX_COMPILATION_CACHE_DIR": str(Path(cfg.run.dir) / cfg.run.id / "jax-cache"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return env


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
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]run[/] {run_id}  dir {run_dir}  broker {cfg.transport.bootstrap_servers}  store {cfg.store.url}")

    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)  # fail fast
    corpus = corpus_for(cfg)
    console.print(f"corpus {corpus.dir}: {sum(s['tokens'] for s in corpus.manifest['shards']):,} train tokens "
                  f"in {corpus.num_shards} shards, {corpus.manifest['heldout']['tokens']:,} held out")
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"prepared": str(corpus.dir)})})
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(dump_config(cfg))
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
    kafka_io.assign_from(events, {TopicPartition(kafka_io.Topics.for_run(cfg, cfg.run.id).events, 0): 0})
    return events


def open_run(setup: RunSetup, jobs, console: Console, kills: list[chaos.Kill], **which) -> LocalRun:
    """A LocalRun on `jobs` that reads the run's events topic from its start; `which`: its regions and
    syncer (LocalRun)."""
    return LocalRun(setup.cfg, setup.cfg_path, setup.corpus, jobs, events_from_start(setup.cfg), console, kills, **which)


def finish(setup: RunSetup, run: LocalRun, console: Console, summary_json: str | Path | None = None) -> dict:
    """Evaluate the last versions and write the summary (the run's processes have stopped)."""
    cfg = setup.cfg
    eval_end = setup.evaluate(setup.state.versions())
    summary = build_summary(cfg, cfg.run.id, setup.state, run.prog, setup.eval_start, eval_end,
                            time.time() - setup.t_start)
    summary |= run.resilience(setup.state)
    summary["coverage"] = run.coverage(setup.state)
    summary["membership"] = membership.timeline(cfg.learner_ids(), run.prog.membership, start=run.first_beat)
    summary["members"] = list(run.members)
    summary["run_dir"] = str(setup.run_dir)
    summary["bad_events"] = run.bad_events  # skipped: malformed, or claims nothing in the run backs
    warning = loss_warning(summary)
    summary["warnings"] = [warning] if warning else []
    (setup.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary_json:
        Path(summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_json).write_text(json.dumps(summary, indent=1))
    console.print(summary_table(summary))
    if warning:
        log.warning(warning, extra={"run_id": cfg.run.id})
        console.print(Text(f"WARNING: {warning}", style="bold red"))
    return summary


def train(cfg: Config, *, summary_json: str | Path | None = None, progress: bool = True,
          console: Console | None = None, with_chaos: bool = False) -> dict:
    """Run to the end and return the summary; with_chaos kills processes on the seeded schedule."""
    console = console or Console(stderr=True)
    setup = prepare(cfg, console)
    jobs = LocalJobs(setup.run_dir / "logs", _child_env(setup.cfg))
    run = open_run(setup, jobs, console, chaos.schedule(setup.cfg) if with_chaos else [])
    try:
        run.watch(progress, setup.t_start)
    finally:
        jobs.stop_all()
        run.events.close()
    return finish(setup, run, console, summary_json)


class LocalRun:
    """Watches a run's processes and events: restarts what fails, applies the chaos schedule, and
    records the outages and compute time that goodput is computed from.

    `regions`: the regions whose learners this runner starts and watches (None: all of them; a
    `diloco-region` flow run has one, the `decoupled-diloco` flow run none); `syncer`: whether it runs
    the syncer shards. A runner with the syncer but not every region's learners stops the syncer once
    its own learners are done and `elsewhere` (the other runners it waits for) is empty."""

    def __init__(self, cfg: Config, cfg_path: Path, corpus, jobs: LocalJobs, events, console,
                 kills: list[chaos.Kill], regions: tuple[str, ...] | None = None, syncer: bool = True):
        self.cfg, self.cfg_path, self.corpus, self.jobs, self.events = cfg, cfg_path, corpus, jobs, events
        self.console, self.regions = console, regions
        self.elsewhere: set[str] = set()
        self.syncers = cfg.syncer_ids() if syncer else []
        # the learners this runner starts (and restarts), in order; joiners are appended
        self.members = [lid for lid in cfg.learner_ids() if self._ours(cfg.region_of(lid).name)]
        self.kills = [k for k in kills if k.target in self.syncers or k.target in self.members]
        self.prog = Progress()
        self.finished: set[str] = set()
        self.restart_at: dict[str, float] = {}
        self.restarts: dict[str, int] = {}
        self.kill_counts: dict[str, int] = {}
        self.outages: list[list] = []          # [name, start, end or None]
        self.compute: dict[tuple[str, str], dict] = {}   # (learner, incarnation) -> last heartbeat figures
        self.tails_s: dict[str, float] = {}     # compute after a killed incarnation's last heartbeat
        self.removing: set[str] = set()          # asked to leave: not restarted, whatever their exit
        self.joins = [j for j in cfg.run.joins if self._ours(j.region)]  # run.joins not carried out yet
        self.join_step: dict[str, int] = {}       # joiner -> the step it entered the schedule at
        self.spans: dict[str, list] = {}         # learner -> [since, until]: added or removed ones (wall clock)
        self.bad_events = 0  # events skipped as malformed (the topic is writable by every learner)
        self.syncers_up: set[str] = set()       # shards that said syncer_started since their last start
        self.takeovers: list[dict] = []        # fragments claimed by a shard from another one
        self.first_beat: float | None = None
        self.learners_done_at: float | None = None
        self.spares: list[str] = []             # warm spare jobs (run.spares), oldest first
        self.spares_started = 0
        self.spares_owed = 0                    # replacements to start once no handover is still warming up
        self.handovers: list[dict] = []          # each learner a spare took the place of
        self.replaced: dict[str, str | None] = {}  # learner -> the incarnation its spare replaced

    @functools.cached_property
    def store(self) -> FragmentStore:
        """The run's store, read for the merges that count towards run.token_budget."""
        return FragmentStore(self.cfg.store.url, self.cfg.run.id)

    def _ours(self, region: str | None) -> bool:
        return self.regions is None or region in self.regions

    # --- processes -----------------------------------------------------------------------------
    def start(self, name: str) -> None:
        conf = ["--config", str(self.cfg_path)]
        if name in self.syncers:
            self.syncers_up.discard(name)
            self.jobs.start(name, ["syncer", *conf, "--shard", str(self.syncers.index(name))])
            return
        # resume past what it handed in and its last beat (a joiner: where the run was when it joined)
        step = self.prog.resume_step(name, self.join_step.get(name, 0))
        self.jobs.start(name, ["learner", *conf, "--learner", name, "--corpus", str(self.corpus.dir),
                               "--start-step", str(step)], processes=self.cfg.parallel.processes)

    def _down(self, name: str, now: float, delay: float, why: str) -> None:
        self.outages.append([name, now, None])
        if name in self.members and self._hand_to_spare(name, why):
            return
        self.restart_at[name] = now + delay
        self.console.print(Text(f"{name} {why}; restarting in {delay:.1f}s", style="yellow"))

    # --- warm spares ---------------------------------------------------------------------------
    def _start_spare(self) -> None:
        name = f"{self.regions[0]}-spare-{self.spares_started}" if self.regions else f"spare-{self.spares_started}"
        self.spares_started += 1
        self.jobs.start(name, ["learner", "--config", str(self.cfg_path), "--spare", "--corpus", str(self.corpus.dir)],
                        stdin_pipe=True)
        self.spares.append(name)

    def _hand_to_spare(self, name: str, why: str) -> bool:
        """Learner `name` died: the oldest live spare becomes it at once (a new spare starts behind it).
        False when no spare is left; spares that died are dropped."""
        while self.spares:
            spare = self.spares.pop(0)
            hb, at = self.prog.learners.get(name, {}), self.prog.resume_step(name)
            try:
                if self.jobs.poll(spare) is not None:
                    raise OSError(f"exited with {self.jobs.poll(spare)}")
                self.jobs.tell(spare, json.dumps({"learner": name, "start_step": at}))
            except OSError as err:
                self.console.print(Text(f"{spare} cannot take over ({err}); log {self.jobs.jobs[spare].log}:\n",
                                        style="red") + Text(self.jobs.tail(spare)))
                continue
            self.jobs.rename(spare, name)
            self.replaced[name] = hb.get("incarnation")
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self.handovers.append({"learner": name, "spare": spare, "start_step": at})
            self.console.print(Text(f"{name} {why}; {spare} takes its place at step {at}", style="yellow"))
            self.spares_owed += 1  # started once it trains: a spare warming up beside it would take its cores
            return True
        return False

    def _kill(self, kill: chaos.Kill, now: float) -> None:
        if kill.target not in self.syncers:
            hb = self.prog.learners.get(kill.target, {})
            key = (kill.target, hb.get("incarnation"))
            if key in self.compute and hb.get("state") == "running":
                # wall time since the beat's figures were taken: at least the compute it did since
                self.tails_s[kill.target] = self.tails_s.get(kill.target, 0.0) + now - self.compute[key]["at"]
        self.jobs.signal(kill.target, signal.SIGKILL)
        self.jobs.wait(kill.target)
        self.kill_counts[kill.target] = self.kill_counts.get(kill.target, 0) + 1
        self._down(kill.target, now, self.cfg.chaos.restart_after_s, "killed by chaos (SIGKILL)")

    def _apply_due_kills(self, now: float, stop_sent: bool) -> None:
        # Each kill waits on its own target's progress: a lagging target (say the syncer, whose
        # progress is the mean over learners) must not hold back the others until they finish.
        for kill in [k for k in self.kills if self._progress_of(k.target) >= k.at_progress]:
            if stop_sent or kill.target in self.restart_at:
                continue  # down right now (or draining): the kill stays due until it runs again
            self.kills.remove(kill)
            if kill.target not in self.finished:
                self._kill(kill, now)

    def _progress_of(self, target: str) -> float:
        cfg = self.cfg
        if target in self.syncers:
            return sum(self.prog.learners.get(lid, {}).get("step", 0) for lid in self.members) / sum(
                cfg.learner_steps(lid) for lid in self.members)
        return self.prog.learners.get(target, {}).get("step", 0) / cfg.learner_steps(target)

    # --- events --------------------------------------------------------------------------------
    def _pump(self, timeout_ms: int = 250) -> None:
        for records in self.events.poll(timeout_ms=timeout_ms).values():
            for rec in records:
                ev = messages.parse_event(rec.value)
                if not ev or ev.get("eid") in self.prog.eids:
                    continue
                try:
                    self._apply_event(ev)
                except (WireError, KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
                    # the events topic is writable by every learner: a bad record is skipped, never fatal
                    self.bad_events += 1
                    log.warning("event ignored", extra={"kind": messages.short(ev.get("kind"), 40),
                                                        "error": messages.bounded(f"{type(err).__name__}: {err}", 200)})

    def _apply_event(self, ev: dict) -> None:
        if ev["kind"] == "heartbeat":
            if not isinstance(ev.get("learner"), str) or not self.cfg.is_member_id(ev["learner"]):
                raise KeyError(f"learner {messages.short(ev.get('learner'), 40)} is not in this run")
            messages.clean_heartbeat(ev)  # raises on a field of the wrong type or range; the beat is kept whole
            check_heartbeat_claims(self.cfg, ev)
        if ev["kind"] == "contribution_accepted" and ev.get("cursor") is not None:
            check_accepted_cursor(self.cfg, ev)
        tokens = self._stored_merge(ev) if ev["kind"] == "merge" else None
        if ev["kind"] == "syncer_started":
            self._check_stored_versions(ev.get("versions"))
        self.prog.apply(ev)
        if tokens is not None:
            self.prog.merged[(ev["fragment"], ev["version"])] = tokens
        if ev["kind"] == "heartbeat":
            self.first_beat = self.first_beat or time.time()
            self.compute[(ev["learner"], ev.get("incarnation"))] = {"compute_s": ev.get("compute_s", 0.0),
                                                                     "at": ev.get("at", ev["time"])}
            if ev.get("incarnation") != self.replaced.get(ev["learner"]):  # not a late beat of the one replaced
                self._close_outage(ev["learner"])
        elif ev["kind"] == "syncer_started":
            shard = ev.get("shard", 0)
            if not isinstance(shard, int) or not 0 <= shard < len(self.syncers):
                raise IndexError(f"shard {messages.short(shard, 40)} is not one of this run's {len(self.syncers)}")
            name = self.syncers[shard]
            self.syncers_up.add(name)
            self._close_outage(name)
        elif ev["kind"] == "fragment_claimed" and ev.get("previous") \
                and not ev["previous"].startswith(f"{ev['shard']}:"):
            self.takeovers.append(ev)

    def _stored_merge(self, ev: dict) -> int:
        """The tokens of the version a merge event announces, as the syncer stored them with it; KeyError
        for a merge the store does not hold (any learner may write the events topic: only what the
        syncer wrote to the store counts towards run.token_budget)."""
        check_event_fields(ev)
        p, v = ev["fragment"], ev["version"]
        if not 0 <= p < self.cfg.fragments.count:
            raise KeyError(f"merge of fragment {p}: the run has {self.cfg.fragments.count}")
        for attempt in range(3):  # the syncer wrote the version before it said so: only a slow store fails here
            try:
                meta = self.store.read_meta(p, v)
                break
            except StoreError as err:  # no such version
                raise KeyError(f"merge of fragment {p} v{v} is not in the store: {messages.bounded(str(err), 120)}") from None
            except (OSError, ValueError) as err:
                if attempt == 2:
                    raise KeyError(f"merge of fragment {p} v{v}: the store did not answer: "
                                   f"{messages.bounded(str(err), 120)}") from None
                time.sleep(0.2 * 2 ** attempt)
        tokens = meta.get("tokens")
        if meta.get("ids") != ev["ids"] or not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise KeyError(f"merge event of fragment {p} v{v} does not match the stored version")
        return tokens

    def _check_stored_versions(self, versions) -> None:
        """KeyError unless a syncer_started event's versions are ones the store holds (the evals and
        the progress table follow them)."""
        if not isinstance(versions, dict):
            raise KeyError("syncer_started without a versions object")
        for p, v in versions.items():
            if not (isinstance(v, int) and not isinstance(v, bool) and str(p).isdigit()
                    and int(p) < self.cfg.fragments.count and v >= 0 and (v == 0 or self.store.has(int(p), v))):
                raise KeyError(f"syncer_started names fragment {messages.short(p, 20)} v{messages.short(v, 20)}, "
                               "which the store does not hold")

    def serve_requests(self, now: float) -> None:
        """Carry out the operator's membership requests (`diloco learners add/remove`, diloco.membership)."""
        for path, op in membership.pending(self.cfg_path.parent):
            try:
                owner = self._region_asked(op)
                if not (self._ours(owner) or (owner is None and self.syncers)):  # the syncer's runner refuses the rest
                    continue
                result = self._request(op, now)
            except Exception as err:  # whatever a request holds, it gets an answer and the run goes on
                log.exception("membership request failed", extra={"request": messages.short(op, 200)})
                result = {"ok": False, "error": f"request {messages.short(op, 200)} failed: {type(err).__name__}: "
                                                f"{messages.bounded(str(err), 200)}"}
            membership.answer(path, result)

    def _region_asked(self, op: dict | None) -> str | None:
        """The region a request is for (its runner answers it); None for one that names none of the run's."""
        if not isinstance(op, dict):
            return None
        if op.get("op") == "add":
            region = op.get("region")
            return region if isinstance(region, str) and region in {r.name for r in self.cfg.regions} else None
        lid = op.get("learner")
        return self.cfg.region_of(lid).name if isinstance(lid, str) and self.cfg.is_member_id(lid) else None

    def _request(self, op: dict | None, now: float) -> dict:
        """Carry out one membership request; its answer, {"ok": True, ...} or {"ok": False, "error": why}."""
        try:
            result = {"ok": True, **self._carry_out(op, now)}
        except membership.RequestError as err:
            result = {"ok": False, "error": str(err)}
        except (TypeError, ValueError, KeyError, AttributeError) as err:  # a request of the wrong shape
            result = {"ok": False, "error": f"bad request {messages.short(op, 200)}: {type(err).__name__}: "
                                            f"{messages.bounded(str(err), 200)}"}
        self.console.print(Text(f"membership: {messages.short(op, 200)} -> {result}", style="cyan"))  # never markup
        return result

    def follow_budget(self, now: float) -> None:
        """run.joins once their share of run.token_budget is in the global model; once all of it is,
        every running learner is asked to stop (it hands in its last deltas and says left). Merged
        tokens, not the heartbeats' claims: one forged heartbeat must not end a run."""
        budget = self.cfg.run.token_budget
        if budget is None:
            return
        tokens = self.prog.merged_tokens(self.cfg.fragments.count)
        if tokens >= budget:
            self.joins.clear()  # nothing is left for them to train
            running = self._running()
            if running:
                self.console.print(f"[cyan]token budget reached ({tokens:,} of {budget:,}): stopping {running}[/]")
            for lid in running:
                self._ask_to_leave(lid)
            return
        for join in [j for j in self.joins if tokens >= j.at_tokens_fraction * budget]:
            self.joins.remove(join)
            self._request({"op": "add", "region": join.region, "count": join.count}, now)

    def _running(self) -> list[str]:
        return [m for m in self.members if m not in self.finished and m not in self.removing]

    def _ask_to_leave(self, lid: str) -> None:
        self.removing.add(lid)
        self.restart_at.pop(lid, None)
        if self.jobs.poll(lid) is None:
            self.jobs.signal(lid, signal.SIGTERM)  # it hands in its last deltas and says it left

    def _carry_out(self, op: dict | None, now: float) -> dict:
        if op is None or op.get("op") not in ("add", "remove"):
            raise membership.RequestError(f"a request is {{'op': 'add', 'region': R, 'count': N}} or "
                                          f"{{'op': 'remove', 'learner': ID}}, got {messages.short(op, 120)}")
        if op["op"] == "add":
            region = next((r for r in self.cfg.regions if r.name == op.get("region")), None)
            count = op.get("count", 1)
            if region is None:
                raise membership.RequestError(f"region {messages.short(op.get('region'), 40)} is not one of "
                                              f"{[r.name for r in self.cfg.regions]}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise membership.RequestError(f"count must be a positive integer, got {messages.short(count, 40)}")
            free = membership.free_ids(region, self.members)
            if len(free) < count:
                raise membership.RequestError(
                    f"region {region.name} may have {region.capacity} learners (regions[].max_learners) and has "
                    f"{region.capacity - len(free)}: {count} more do not fit")
            # a joiner enters the inner schedule where the run is (as a restarted learner resumes, with
            # a new warm-up): the median step of the learners training now, not a fresh warm-up and peak
            steps = sorted(self.prog.learners.get(m, {}).get("step", 0) for m in self._running())
            at = steps[len(steps) // 2] if steps else 0
            for lid in free[:count]:
                self.members.append(lid)
                self.spans[lid] = [now, None]
                self.join_step[lid] = min(at, self.cfg.learner_steps(lid) - 1)
                self.start(lid)
            return {"added": free[:count], "start_step": at}
        lid = op.get("learner")
        running = self._running()
        if lid not in running:
            raise membership.RequestError(f"learner {messages.short(lid, 40)} is not running in this run "
                                          f"(running: {running})")
        region = self.cfg.region_of(lid)
        left = sum(1 for m in running if m != lid and self.cfg.region_of(m).name == region.name)
        if left < region.min_learners:
            raise membership.RequestError(f"region {region.name} keeps at least {region.min_learners} learners "
                                          f"(regions[].min_learners); removing {lid} would leave {left}")
        self._ask_to_leave(lid)
        return {"removed": lid}

    def _close_outage(self, name: str) -> None:
        for o in self.outages:
            if o[0] == name and o[2] is None and name not in self.restart_at:
                o[2] = time.time()
        if self.spares_owed and not any(o[2] is None and o[0] in self.replaced for o in self.outages):
            for _ in range(self.spares_owed):
                self._start_spare()
            self.spares_owed = 0

    def _catch_up(self, t0: float) -> None:
        """Read the events topic to its end, so that a runner joining a live run (a region flow run
        started again by hand) resumes its learners where their last heartbeats left off, not at step 0."""
        while True:
            self._pump(200)
            tps = self.events.assignment()
            if all((hw := self.events.highwater(tp)) is not None and self.events.position(tp) >= hw for tp in tps):
                return
            if time.time() - t0 > self.cfg.run.timeout_s:
                raise RunError(f"the events topic {sorted(tp.topic for tp in tps)} was not read to its end in time")

    def _resume_membership(self) -> None:
        """After catching up on a live run's events (a region flow run started again by hand): this
        runner's learners that left or finished stay down, and those admitted at run time are its
        own too (started, or left down if they are done). A dropped learner (silent too long: its
        process likely went with the runner before) is started again; so is one with no news."""
        done: dict[str, bool] = {}
        for ev in sorted(self.prog.membership, key=lambda e: e.get("time", 0.0)):
            lid = ev.get("learner")
            if isinstance(lid, str) and self.cfg.is_member_id(lid) and self._ours(self.cfg.region_of(lid).name):
                done[lid] = ev["kind"] in ("learner_left", "learner_finished")
        for lid in [*self.members, *done]:
            if self.prog.learners.get(lid, {}).get("state") in ("left", "finished"):  # its last heartbeat said so
                done[lid] = True
        for lid, finished in done.items():
            if lid not in self.members:
                self.members.append(lid)
            if finished:
                self.finished.add(lid)

    # --- the loop ------------------------------------------------------------------------------
    def watch(self, progress: bool, t0: float, on_tick=None) -> None:
        """Until the syncer drained; `on_tick(self)` runs once per loop (evals, reports) and may take a while."""
        cfg = self.cfg
        for name in self.syncers:
            self.start(name)
        with self.console.status("starting the syncer" + (f" ({len(self.syncers)} shards)" if len(self.syncers) > 1 else "")):
            while self.syncers_up != set(self.syncers):
                for name in self.syncers:
                    if self.jobs.poll(name) is not None:
                        raise RunError(f"{name} exited with {self.jobs.poll(name)}:\n" + self.jobs.tail(name))
                if time.time() - t0 > cfg.run.timeout_s:
                    raise RunError("the syncer did not start in time:\n" + self.jobs.tail(self.syncers[0]))
                self._pump(200)
        if self.members:
            self._catch_up(t0)
            self._resume_membership()
        for lid in self.members:  # learners start once the syncer consumes: deltas would only pile up
            if lid not in self.finished:
                self.start(lid)
        for _ in range(cfg.run.spares if self.members else 0):  # spares stand in for this runner's learners
            self._start_spare()
        deadline = t0 + cfg.run.timeout_s
        stop_sent, last_line = False, 0.0
        live = Live(progress_table(cfg, self.prog, cfg.run.id, 0), console=self.console,
                    refresh_per_second=2) if progress else None
        if live:
            live.start()
        try:
            while True:
                self._pump()
                now = time.time()
                if live:
                    live.update(progress_table(cfg, self.prog, cfg.run.id, now - t0))
                elif now - last_line > 10:
                    self.console.print(progress_line(self.prog, now - t0), soft_wrap=True)
                    last_line = now
                self._apply_due_kills(now, stop_sent)
                if not stop_sent:
                    self.serve_requests(now)
                    self.follow_budget(now)
                for name in [*self.members, *self.syncers]:
                    rc = self.jobs.poll(name) if name in self.jobs.jobs else None
                    if rc is None or name in self.restart_at or name in self.finished:
                        continue
                    if (rc == 0 and (name not in self.syncers or stop_sent)) or name in self.removing:
                        self.finished.add(name)
                        if name in self.removing:  # its time in the run ends here, not with the run's
                            self.spans.setdefault(name, [None, None])[1] = now
                        continue
                    n = self.restarts.get(name, 0)
                    if n >= cfg.run.max_restarts or (name in self.syncers and rc == EXIT_STATE_LOST):  # no retry helps
                        raise RunError(f"{name} failed {n + 1} times (last exit {rc}); log {self.jobs.jobs[name].log}:\n"
                                       + self.jobs.tail(name))
                    self._down(name, now, cfg.run.restart_backoff_s * 2 ** n, f"exited with {rc}")
                for name, at in list(self.restart_at.items()):
                    if now >= at:
                        del self.restart_at[name]
                        self.restarts[name] = self.restarts.get(name, 0) + 1
                        self.start(name)
                if on_tick:
                    on_tick(self)
                learners_done = all(lid in self.finished for lid in self.members) and not self.elsewhere
                if learners_done and self.learners_done_at is None:
                    self.learners_done_at = now
                if learners_done and not stop_sent and self.syncers_up == set(self.syncers) \
                        and not set(self.syncers) & set(self.restart_at):
                    for name in self.syncers:
                        self.jobs.signal(name, signal.SIGTERM)  # drain, flush open rounds, exit
                    stop_sent = True
                    deadline = min(deadline, now + 180)
                if stop_sent and set(self.syncers) <= self.finished:
                    self._pump(500)  # the syncer's last events
                    return
                if now > deadline:
                    raise RunError(f"run did not finish within run.timeout_s={cfg.run.timeout_s:.0f}s")
        finally:
            if live:
                live.update(progress_table(cfg, self.prog, cfg.run.id, time.time() - t0))
                live.stop()

    def resilience(self, state: state_mod.SyncerState) -> dict:
        """Goodput, kills, restarts and outages of the run (all zero-loss figures for a healthy run)."""
        P = self.cfg.fragments.count
        productive: dict[str, float] = {}
        for m in state.merges():
            for lid, c in zip(m["learners"], m.get("compute_s", [])):
                productive[lid] = productive.get(lid, 0.0) + c / P  # every step is in one delta per fragment
        compute: dict[str, float] = dict(self.tails_s)
        for (lid, _), figures in self.compute.items():
            compute[lid] = compute.get(lid, 0.0) + figures["compute_s"]
        total_compute = sum(compute.values())
        step_time = np.median([hb.get("step_time", 0.0) for hb in self.prog.learners.values()] or [0.0])
        spans = [o[1:] for o in self.outages if o[2] is not None]
        end = self.learners_done_at or time.time()
        span = end - (self.first_beat or end)
        chip_time = sum(self._time_in_run(lid, end) for lid in self.members)
        return {
            "goodput": chaos.goodput(sum(productive.values()), total_compute),
            "goodput_wall": chaos.goodput(sum(productive.values()), chip_time),
            "goodput_per_learner": {lid: chaos.goodput(productive.get(lid, 0.0), compute.get(lid, 0.0))
                                    for lid in self.members},
            "goodput_sync_equivalent": chaos.sync_equivalent_goodput(
                span_s=span, outages=spans, kills=sum(self.kill_counts.values()),
                lost_per_kill_s=self.cfg.fragments.sync_every / 2 * float(step_time)),
            "kills": dict(self.kill_counts),
            "restarts": dict(self.restarts),
            "outages_s": {o[0]: round(o[2] - o[1], 2) for o in self.outages if o[2] is not None},
            "takeovers": self.takeover_times(),
            "spare_handovers": list(self.handovers),
        }

    def coverage(self, state: state_mod.SyncerState) -> dict:
        """The coverage ledger (diloco.coverage) from the merge records and the learners' beats; the
        epoch each shard reached when the built-in model reads it (shard_batches, one window per sequence)."""
        cfg = self.cfg
        epochs = None
        if cfg.model.entry == BUILTIN_MODEL:
            span = cfg.model.transformer.seq_len + 1

            def epochs(lid: str, end: int) -> float | None:
                if not cfg.is_member_id(lid):
                    return None
                i = cfg.shard_index(lid)
                n = int(self.corpus.manifest["shards"][i]["tokens"])
                return round(epochs_read(n, cfg.data.seed, i, end * cfg.inner.batch_size, span), 4)
        return coverage.ledger(state.merges(), fragments=cfg.fragments.count,
                               trained=self.prog.per_learner(self.prog.trained),
                               handed_in=self.prog.per_learner(self.prog.handed_in_tokens), epochs=epochs)

    def _time_in_run(self, lid: str, end: float) -> float:
        """Seconds `lid` was a member: from the first heartbeat of the run (a starting learner) or
        its addition, until it was asked to leave or the run's learners were done."""
        since, until = self.spans.get(lid, (None, None))
        return (until or end) - (since or self.first_beat or end)

    def takeover_times(self) -> list[dict]:
        """Each fragment another shard claimed from a shard that went down: seconds from the outage."""
        out = []
        for ev in self.takeovers:
            down = self.syncers[int(ev["previous"].split(":", 1)[0])]
            starts = [o[1] for o in self.outages  # the outage it was claimed in (not a hand-back)
                      if o[0] == down and o[1] <= ev["time"] and (o[2] is None or o[2] >= ev["time"])]
            if starts:
                out.append({"fragment": ev["fragment"], "from": down, "to": self.syncers[ev["shard"]],
                            "after_s": round(ev["time"] - max(starts), 2)})
        return out


def _loss(hb: dict) -> str:
    return "-" if hb.get("loss") is None else f"{hb['loss']:.3f}"


def progress_line(prog: Progress, elapsed: float) -> str:
    lrn = " ".join(f"{k} step {v.get('step', 0)} loss {_loss(v)};" for k, v in sorted(prog.learners.items()))
    vers = " ".join(f"p{p}:v{v}" for p, v in sorted(prog.versions.items()))
    return (f"[{elapsed:4.0f}s] {lrn or 'learners starting;'} syncer {vers} merges {prog.merges} "
            f"accepted {prog.accepted} rejected {prog.rejected}")


def published_on_broker(cfg: Config, run_id: str) -> tuple[int, int, dict[tuple[str, str, int], int]]:
    """Contributions (distinct manifest ids), bytes (values + keys) on the region topics, and those
    bytes by (learner, region, fragment) as the contributions' manifests name them (("?", topic's
    region, partition) for records of no contribution with a manifest).

    Counted from the log itself, so that learners killed between two heartbeats are counted too.
    """
    topics = kafka_io.Topics.for_run(cfg, run_id)
    region_of_topic = {t: r for r, t in topics.fragments.items()}
    tps = [tp for t in topics.fragments.values() for tp in kafka_io.partitions_of(t, topics.partitions)]
    total, by_id, owner, loose = 0, {}, {}, {}
    for rec in kafka_io.read_to_end(cfg.transport, tps):
        n = len(rec.value or b"") + len(rec.key or b"")
        total += n
        try:
            header, _ = messages.parse_frame(rec.value)
            cid = header.get("id")
        except messages.WireError:
            header, cid = {}, None
        if not isinstance(cid, str):
            where = ("?", region_of_topic.get(rec.topic, "?"), rec.partition)
            loose[where] = loose.get(where, 0) + n
            continue
        by_id[cid] = by_id.get(cid, 0) + n
        if header.get("kind") == "manifest" and cid not in owner:
            name = lambda v: v if isinstance(v, str) and 0 < len(v) <= 64 else "?"  # noqa: E731  (from outside)
            fragment = header.get("fragment")
            owner[cid] = (name(header.get("learner")), name(header.get("region")),
                          fragment if isinstance(fragment, int) and not isinstance(fragment, bool) else -1)
    up = dict(loose)
    for cid, n in by_id.items():
        where = owner.get(cid, ("?", "?", -1))
        up[where] = up.get(where, 0) + n
    return len(owner), total, up


def traffic_ledger(cfg: Config, up: dict[tuple[str, str, int], int], prog: Progress) -> dict:
    """Bytes up (deltas over Kafka, from the log) and down (reads from the store, from the learners'
    last heartbeats of each incarnation) per learner, per region and per fragment."""
    def add(table: dict, key, direction: str, n: int) -> None:
        row = table.setdefault(str(key), {"up": 0, "down": 0})
        row[direction] += n
    by_learner: dict = {}
    by_region: dict = {}
    by_fragment: dict = {}
    for (learner, region, fragment), n in up.items():
        add(by_learner, learner, "up", n)
        add(by_region, region, "up", n)
        add(by_fragment, fragment, "up", n)
    for (learner, _), n in prog.fetched.items():
        add(by_learner, learner, "down", n)
        region = cfg.region_of(learner).name if cfg.is_member_id(learner) else "?"
        add(by_region, region, "down", n)
    for parts in prog.fetched_by_fragment.values():
        for p, n in parts.items():
            add(by_fragment, p, "down", n)
    order = lambda t: dict(sorted(t.items()))  # noqa: E731
    return {"by_learner": order(by_learner), "by_region": order(by_region), "by_fragment": order(by_fragment)}


def build_summary(cfg: Config, run_id: str, state: state_mod.SyncerState, prog: Progress, eval_start: float,
                  eval_end: float, wall_s: float) -> dict:
    counters = state.counters()
    statuses = state.status_counts()
    merges = state.merges()
    seen: dict[str, int] = {}
    for m in merges:
        for cid in m["ids"]:
            seen[cid] = seen.get(cid, 0) + 1
    learners = {lid: {k: hb.get(k) for k in ("step", "tokens", "loss", "published", "bytes_sent", "bytes_fetched",
                                              "state")} for lid, hb in sorted(prog.learners.items())}
    steps = sum(hb.get("step", 0) for hb in prog.learners.values())
    num_params = FragmentStore(cfg.store.url, run_id).read_plan().num_params
    published, bytes_sent, up = published_on_broker(cfg, run_id)
    bytes_dp = dp_allreduce_bytes(num_params, cfg.num_learners, steps)
    bytes_fetched = sum(prog.fetched.values())
    across = bytes_sent + bytes_fetched
    versions = {str(p): v for p, v in sorted(state.versions().items())}
    return {
        "run_id": run_id,
        "wall_s": round(wall_s, 1),
        "eval_loss_start": eval_start,
        "eval_loss_end": eval_end,
        "eval_loss_drop": (eval_start - eval_end) / eval_start if eval_start else math.nan,
        "tokens": prog.tokens(),
        "inner_steps": steps,
        "params": num_params,
        "bytes_sent": bytes_sent,
        "bytes_fetched": bytes_fetched,
        "bytes_across": across,
        "bytes_dp_equivalent": bytes_dp,
        "bytes_ratio": bytes_dp / across if across else math.inf,
        "bytes_ratio_sent": bytes_dp / bytes_sent if bytes_sent else math.inf,
        "contributions": {
            "published": published,
            "accepted": counters.get("accepted", 0),
            "applied": counters.get("applied", 0),
            "rejected": counters.get("rejected", 0),
            "late": counters.get("late", 0),
            "pending": statuses.get("pending", 0),
            "applied_twice": sum(1 for n in seen.values() if n > 1),
            "duplicate_records": counters.get("duplicate_records", 0),
            "rejected_records": counters.get("rejected_records", 0),
        },
        "rejections": {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("rejected:")},
        "versions": versions,
        "merges": {str(p): sum(1 for m in merges if m["fragment"] == p) for p in range(cfg.fragments.count)},
        "learners": learners,
        "traffic": traffic_ledger(cfg, up, prog),
    }


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """The summary's figures as (what, value) rows: the CLI's table and the flow's report show the same."""
    c = s["contributions"]
    drop = s["eval_loss_drop"]
    rows = [
        ("held-out loss start -> end", f"{s['eval_loss_start']:.4f} -> {s['eval_loss_end']:.4f} "
                                       + (f"({100 * drop:.1f}% lower)" if drop >= 0 else
                                          f"(ROSE {-100 * drop:.1f}%: the global model got worse)")),
        ("tokens (all learners)", f"{s['tokens']:,}"),
        ("versions per fragment", " ".join(f"p{p}:v{v}" for p, v in s["versions"].items())),
        ("merges per fragment", " ".join(f"p{p}:{n}" for p, n in s["merges"].items())),
        ("contributions published", str(c["published"])),
        ("  applied / late / rejected / pending", f"{c['applied']} / {c['late']} / {c['rejected']} / {c['pending']}"),
        ("  applied twice", str(c["applied_twice"])),
        ("bytes across regions (up + down)", f"{s['bytes_across'] / 1e6:,.2f} MB"),
        ("  up: deltas over Kafka", f"{s['bytes_sent'] / 1e6:,.2f} MB"),
        ("  down: globals from TensorStore", f"{s['bytes_fetched'] / 1e6:,.2f} MB"),
        ("bytes a data-parallel all-reduce sends", f"{s['bytes_dp_equivalent'] / 1e6:,.1f} MB"),
        ("  ratio (up only)", f"{s['bytes_ratio']:,.0f}x fewer ({s['bytes_ratio_sent']:,.0f}x)"),
    ]
    if s.get("traffic"):
        rows.append(("  per region (up / down)", "  ".join(
            f"{r} {t['up'] / 1e6:,.2f} / {t['down'] / 1e6:,.2f} MB" for r, t in s["traffic"]["by_region"].items())))
    if s.get("coverage"):
        t = s["coverage"]["totals"]
        rows.append(("tokens into the global model", f"{t['tokens_merged']:,} of {t['tokens_trained']:,} trained; "
                                                     f"twice {t['tokens_twice']:,}, lost {t['tokens_lost']:,}"))
    if s["rejections"]:
        rows.append(("rejections by reason", ", ".join(f"{k} {v}" for k, v in s["rejections"].items())))
    return rows


def loss_warning(s: dict) -> str | None:
    """What to tell an operator whose run made the global model worse than it started, or None."""
    if not s["eval_loss_end"] > s["eval_loss_start"]:
        return None
    return (f"the held-out loss ROSE from {s['eval_loss_start']:.4f} to {s['eval_loss_end']:.4f}: the run made the "
            "global model worse. Check the merge settings (preset, outer.lr, syncer.merge) and the inner "
            "learning rate; docs/bench.md lists the measured ones")


def summary_table(s: dict) -> Table:
    t = Table(title=f"summary of {s['run_id']} ({s['wall_s']:.0f}s)", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    for row in summary_rows(s):
        t.add_row(*row)
    return t
