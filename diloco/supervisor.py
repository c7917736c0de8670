"""The supervisor of a run (`diloco train`, `diloco chaos`, the Prefect flows): it reads the run's
events topic (checked: any learner may write it), says where a learner resumes (from the syncer's
records in Redis), carries out membership requests, and keeps the figures goodput (diloco.ledger) and
the coverage ledger are computed from. Its processes (starting them as jobs of a backend, restarts
with backoff, warm spares, outages) are its `procs` (diloco.processes). Its watch loop is a short pass
over hooks (diloco.hooks: the progress view, the chaos schedule, membership requests, the token
budget; the processes' reaping and restarts; the flows add their own), each with its own state and
cadence. The run's life cycle around it (provision, open, finish) is diloco.run.
"""

from __future__ import annotations

import functools
import logging
import math
import signal
import time
from pathlib import Path

import numpy as np

from diloco import chaos, coverage, hooks, membership, messages, resume
from diloco.config import BUILTIN_MODEL, Config
from diloco.infra import kafka as kafka_io
from diloco.infra.jobs import JobBackend
from diloco.infra.state import ServiceError
from diloco.infra.store import FragmentStore, StoreError
from diloco.learners.data import epochs_read
from diloco.ledger import RunLedger
from diloco.messages import WireError
from diloco.processes import Processes, RunError, outage_seconds
from diloco.progress import Progress, check_accepted_cursor, check_event_fields, check_heartbeat_claims
from diloco.syncer import state as state_mod
from diloco.syncer.records import partition_key

log = logging.getLogger(__name__)


class RunSupervisor:
    """Watches a run's events and runs its hooks (the chaos schedule, membership, the budget, its
    processes' reaping and restarts: `procs`), and records in its ledger the compute time that goodput
    is computed from.

    `regions`: the regions whose learners this runner starts and watches (None: all of them; a
    `diloco-region` flow run has one, the `decoupled-diloco` flow run none); `syncer`: whether it runs
    the syncer shards. A runner with the syncer but not every region's learners stops the syncer once
    its own learners are done and `elsewhere` (the other runners it waits for) is empty."""

    def __init__(self, cfg: Config, cfg_path: Path, corpus, jobs: JobBackend, events, console,
                 kills: list[chaos.Kill], regions: tuple[str, ...] | None = None, syncer: bool = True,
                 state: state_mod.SyncerState | None = None):
        self.cfg, self.cfg_path, self.corpus, self.jobs, self.events = cfg, cfg_path, corpus, jobs, events
        if state is not None:
            self.state = state
        self.console, self.regions = console, regions
        self.elsewhere: set[str] = set()
        self.syncers = cfg.syncer_ids() if syncer else []
        # the learners this runner starts (and restarts), in order; joiners are appended
        self.members = [lid for lid in cfg.learner_ids() if self.ours(cfg.region_of(lid).name)]
        self.prog = Progress()
        self.join_step: dict[str, int] = {}       # joiner -> the step it entered the schedule at
        self.bad_events = 0  # events skipped as malformed (the topic is writable by every learner)
        self.syncers_up: set[str] = set()       # shards that said syncer_started since their last start
        self.ledger = RunLedger()               # the accounting: compute, kills, members' spans, takeovers
        # where restarts resume (diloco.resume): from the syncer's records in Redis, never from an event
        self.merged_ends: dict[str, int] = {}     # learner -> furthest cursor end of its merged contributions
        self._merges_read = 0                     # merge records folded into merged_ends
        self.settling: dict[str, float] = {}      # learner -> until when its restart waits for the records
        # learner -> (its region topic's end offsets when it went down, until when its restart waits for
        # the syncer to have read up to them)
        self.read_up: dict[str, tuple[dict[tuple[str, int], int], float]] = {}
        # merge events are checked against the store (_stored_merge): what each real version holds, and
        # per fragment the commit marker as last read and when
        self._merge_metas: dict[tuple[int, int], dict] = {}
        self._markers: dict[int, tuple[int | None, float]] = {}
        self.draining = False                     # the syncer was asked to drain: no kills, joins or requests
        # the processes: jobs, restarts, spares, outages (where a learner resumes is asked of this runner)
        self.procs = Processes(cfg, cfg_path, corpus, jobs, console, self.ledger, self.prog, syncers=self.syncers,
                               members=self.members, syncers_up=self.syncers_up, draining=lambda: self.draining,
                               resume_point=self.resume_point, went_down=self.went_down,
                               left=lambda lid: self.settling.pop(lid, None),
                               spare_prefix=f"{regions[0]}-" if regions else "")
        # the watch loop's hooks of its own (diloco.hooks); tests call each on its own
        self.chaos = hooks.ChaosKills(self, kills)
        self.serve_requests = hooks.MembershipRequests(self)
        self.follow_budget = hooks.TokenBudget(self)

    @property
    def kills(self) -> list[chaos.Kill]:
        """The chaos kills not carried out yet (the chaos hook's)."""
        return self.chaos.kills

    @functools.cached_property
    def state(self) -> state_mod.SyncerState:
        """The run's syncer state in Redis: the records restarts resume from."""
        return state_mod.SyncerState(state_mod.connect(self.cfg.state), self.cfg.state.key_prefix, self.cfg.run.id)

    @functools.cached_property
    def store(self) -> FragmentStore:
        """The run's store, read for the merges that count towards run.token_budget."""
        return FragmentStore(self.cfg.store.url, self.cfg.run.id)

    def ours(self, region: str | None) -> bool:
        return self.regions is None or region in self.regions

    # --- resume points (procs asks for them: resume_point, went_down) --------------------------
    def accepted_end(self, name: str) -> int | None:
        """The end of the furthest data-stream cursor the syncer accepted for learner `name`, pending or
        merged, from Redis (ServiceError or StateError when it does not answer). Pending ones are read first: one
        merged between the two reads is then seen in the merge records."""
        pending = self.state.pending(self.cfg.fragments.count)
        new = self.state.merges_since(self._merges_read)
        self._merges_read += len(new)
        resume.furthest_ends(coverage.merged_contributions(new), into=self.merged_ends)
        return resume.furthest_ends(pending, into=dict(self.merged_ends)).get(name)

    def resume_point(self, name: str, now: float, *, wait: bool) -> int | None:
        """Where learner `name` resumes (diloco.resume): past the furthest cursor the syncer accepted for
        it, never where an event says. None while that is not known yet: Redis does not answer, or
        (`wait`) its beats say it handed in more than the records hold while a syncer shard is down,
        or for up to resume.SETTLE_S after (a contribution it saw acked may not be read yet; a forged
        claim costs that wait and moves nothing); and after a death (`wait`), until the syncer has read
        what the learner wrote before it (_read_up)."""
        if wait and not self._read_up(name, now):
            return None
        try:
            accepted = self.accepted_end(name)
        except (ServiceError, state_mod.StateError, OSError) as err:
            log.warning("resume point unknown: redis did not answer", extra={"learner": name, "error": str(err)[:200]})
            return None
        claimed = self.prog.handed_in.get(name, 0)
        if wait and not resume.settled(accepted, claimed):
            if set(self.syncers) - self.syncers_up:
                return None
            if now < self.settling.setdefault(name, now + resume.SETTLE_S):
                return None
            log.warning("resuming at the syncer's records, short of what the events say was handed in",
                        extra={"learner": name, "accepted_end": accepted, "claimed": claimed})
        self.settling.pop(name, None)
        self.read_up.pop(name, None)
        return resume.resume_step(accepted, default=self.join_step.get(name, 0), schedule_end=self.cfg.learner_steps(name))

    def _read_up(self, name: str, now: float) -> bool:
        """Whether the syncer has handled every record learner `name` wrote before it went down (the end
        offsets taken then, against the syncer's read_to positions in Redis), or has been waited for
        resume.READ_UP_S; read before the records, so an acceptance between the two reads is seen."""
        if name not in self.read_up:
            return True
        ends, until = self.read_up[name]
        try:
            if resume.read_up_to(self.state.read_to(), ends):
                return True
        except (ServiceError, state_mod.StateError, OSError) as err:
            log.warning("syncer positions unknown: redis did not answer", extra={"learner": name, "error": str(err)[:200]})
            return False
        if now < until:
            return False
        log.warning("resuming before the syncer read all the dead learner wrote: a contribution it reads later may "
                    "repeat steps", extra={"learner": name, "ends": {partition_key(tp): o for tp, o in ends.items()}})
        return True

    def went_down(self, name: str, now: float) -> None:
        """Process `name` went down: a learner's restart waits for the syncer to read what it wrote before (_read_up)."""
        if name not in self.syncers and (ends := self._written_before(name)):
            self.read_up[name] = (ends, now + resume.READ_UP_S)

    def _written_before(self, name: str) -> dict[tuple[str, int], int]:
        """The end offsets, now, of the partitions learner `name` writes (its region's fragments topic);
        empty when there is no log to ask (a unit test's runner) or it does not answer (then logged)."""
        if self.events is None or name not in self.members:
            return {}
        topic = kafka_io.Topics.for_run(self.cfg, self.cfg.run.id).fragments[self.cfg.region_of(name).name]
        try:
            ends = kafka_io.log_ends(self.cfg.transport, kafka_io.partitions_of(topic, self.cfg.fragments.count))
        except (kafka_io.LogError, kafka_io.TransportError, OSError) as err:
            log.warning("end offsets unknown: the restart will not wait for the syncer to read them",
                        extra={"learner": name, "error": str(err)[:200]})
            return {}
        return {tp: int(off) for tp, off in ends.items()}

    # --- events --------------------------------------------------------------------------------
    def _pump(self, timeout_ms: int = 250) -> None:
        for records in self.events.poll(timeout_ms=timeout_ms).values():
            for rec in records:
                ev = messages.parse_event(rec.value)
                if not ev or ev.get("eid") in self.prog.eids:
                    continue
                try:
                    self.apply_event(ev)
                except (WireError, KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
                    # the events topic is writable by every learner: a bad record is skipped, never fatal
                    self.bad_events += 1
                    log.warning("event ignored", extra={"kind": messages.short(ev.get("kind"), 40),
                                                        "error": messages.bounded(f"{type(err).__name__}: {err}", 200)})

    def apply_event(self, ev: dict) -> None:
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
            self.ledger.beat(ev, time.time())
            if ev.get("incarnation") != self.procs.replaced.get(ev["learner"]):  # not a late beat of the one replaced
                self.procs.close_outage(ev["learner"])
        elif ev["kind"] == "syncer_started":
            shard = ev.get("shard", 0)
            if not isinstance(shard, int) or not 0 <= shard < len(self.syncers):
                raise IndexError(f"shard {messages.short(shard, 40)} is not one of this run's {len(self.syncers)}")
            name = self.syncers[shard]
            self.syncers_up.add(name)
            self.procs.close_outage(name)
        elif ev["kind"] == "fragment_claimed" and ev.get("previous") \
                and not ev["previous"].startswith(f"{ev['shard']}:"):
            self.ledger.takeovers.append(ev)

    def _stored_merge(self, ev: dict) -> int:
        """The tokens of the version a merge event announces, as the syncer stored them with it; KeyError
        for a merge the store does not hold (any learner may write the events topic: only what the
        syncer wrote to the store counts towards run.token_budget)."""
        check_event_fields(ev)
        p, v = ev["fragment"], ev["version"]
        if not 0 <= p < self.cfg.fragments.count:
            raise KeyError(f"merge of fragment {p}: the run has {self.cfg.fragments.count}")
        meta = self._merge_metas.get((p, v)) or self._read_merge_meta(p, v)
        tokens = meta.get("tokens")
        if meta.get("ids") != ev["ids"] or not messages.is_count(tokens) or tokens < 0:
            raise KeyError(f"merge event of fragment {p} v{v} does not match the stored version")
        marker, read_at = self._markers.get(p, (None, -math.inf))
        self._markers[p] = (max(v, -1 if marker is None else marker), read_at)  # a merge the store backs is committed
        return tokens

    def _read_merge_meta(self, p: int, v: int) -> dict:
        """What the syncer stored with version v of fragment p (its ids and tokens), read once per real
        version: a forged event naming a version past the store's commit marker costs no read of it,
        and one repeating a real version no second read (issue 53 L6: each cost the loop a store read)."""
        marker, read_at = self._markers.get(p, (None, -math.inf))
        if (marker is None or v > marker + 1) and time.monotonic() - read_at >= 1.0:
            try:
                marker = self.store.read_committed(p)
            except (StoreError, OSError, ValueError):
                marker = None          # cannot tell: the read below decides
            self._markers[p] = (marker, time.monotonic())
        if marker is not None and v > marker + 1:
            raise KeyError(f"merge of fragment {p} v{v} is past the store's commit marker (v{marker})")
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
        self._merge_metas[(p, v)] = {"ids": meta.get("ids"), "tokens": meta.get("tokens")}  # never changes
        return self._merge_metas[(p, v)]

    def _check_stored_versions(self, versions) -> None:
        """KeyError unless a syncer_started event's versions are ones the store holds (the evals and
        the progress table follow them)."""
        if not isinstance(versions, dict):
            raise KeyError("syncer_started without a versions object")
        for p, v in versions.items():
            if not (messages.is_count(v) and str(p).isdigit()
                    and int(p) < self.cfg.fragments.count and v >= 0 and (v == 0 or self.store.has(int(p), v))):
                raise KeyError(f"syncer_started names fragment {messages.short(p, 20)} v{messages.short(v, 20)}, "
                               "which the store does not hold")

    def carry_out(self, op: dict | None, now: float) -> dict:
        """Add learners to a region or remove one (a membership request, diloco.hooks); RequestError why not."""
        if op is None or op.get("op") not in ("add", "remove"):
            raise membership.RequestError(f"a request is {{'op': 'add', 'region': R, 'count': N}} or "
                                          f"{{'op': 'remove', 'learner': ID}}, got {messages.short(op, 120)}")
        if op["op"] == "add":
            region = next((r for r in self.cfg.regions if r.name == op.get("region")), None)
            count = op.get("count", 1)
            if region is None:
                raise membership.RequestError(f"region {messages.short(op.get('region'), 40)} is not one of "
                                              f"{[r.name for r in self.cfg.regions]}")
            if not messages.is_count(count) or count < 1:
                raise membership.RequestError(f"count must be a positive integer, got {messages.short(count, 40)}")
            free = membership.free_ids(region, self.members)
            if len(free) < count:
                raise membership.RequestError(
                    f"region {region.name} may have {region.capacity} learners (regions[].max_learners) and has "
                    f"{region.capacity - len(free)}: {count} more do not fit")
            # a joiner enters the inner schedule where the run is (as a restarted learner resumes, with
            # a new warm-up): the median step of the learners training now, not a fresh warm-up and peak
            steps = sorted(self.prog.learners.get(m, {}).get("step", 0) for m in self.procs.running())
            at = steps[len(steps) // 2] if steps else 0
            for lid in free[:count]:
                self.members.append(lid)
                self.ledger.spans[lid] = [now, None]
                self.join_step[lid] = min(at, self.cfg.learner_steps(lid) - 1)
                self.procs.start(lid)
            return {"added": free[:count], "start_step": at}
        lid = op.get("learner")
        running = self.procs.running()
        if lid not in running:
            raise membership.RequestError(f"learner {messages.short(lid, 40)} is not running in this run "
                                          f"(running: {running})")
        region = self.cfg.region_of(lid)
        left = sum(1 for m in running if m != lid and self.cfg.region_of(m).name == region.name)
        if left < region.min_learners:
            raise membership.RequestError(f"region {region.name} keeps at least {region.min_learners} learners "
                                          f"(regions[].min_learners); removing {lid} would leave {left}")
        self.procs.ask_to_leave(lid)
        return {"removed": lid}

    def _catch_up(self, t0: float) -> None:
        """Read the events topic to its end, so that a runner joining a live run (a region flow run
        started again by hand) resumes its learners where their last heartbeats left off, not at step 0."""
        while True:
            self._pump(200)
            tps = self.events.assignment()
            if all((hw := self.events.highwater(tp)) is not None and self.events.position(tp) >= hw for tp in tps):
                return
            if time.time() - t0 > self.cfg.run.timeout_s:
                raise RunError(f"the events topic {sorted(topic for topic, _ in tps)} was not read to its end in time")

    def resume_membership(self) -> None:
        """After catching up on a live run's events (a region flow run started again by hand): this
        runner's learners that left or finished stay down, and those admitted at run time are its
        own too (started, or left down if they are done). A dropped learner (silent too long: its
        process likely went with the runner before) is started again; so is one with no news."""
        done: dict[str, bool] = {}
        for ev in sorted(self.prog.membership, key=lambda e: e.get("time", 0.0)):
            lid = ev.get("learner")
            if isinstance(lid, str) and self.cfg.is_member_id(lid) and self.ours(self.cfg.region_of(lid).name):
                done[lid] = ev["kind"] in ("learner_left", "learner_finished")
        for lid in [*self.members, *done]:
            if self.prog.learners.get(lid, {}).get("state") in ("left", "finished"):  # its last heartbeat said so
                done[lid] = True
        for lid, finished in done.items():
            if lid not in self.members:
                self.members.append(lid)
            if finished:
                self.procs.finished.add(lid)

    # --- the loop ------------------------------------------------------------------------------
    def watch(self, progress: bool, t0: float, on_tick=None) -> None:
        """Until the syncer drained. Each pass reads the events, then runs every hook once with the
        pass's time: the view, the chaos kills, membership requests, the token budget, reaping exited
        processes, restarting those due, `on_tick(self)` (the flows' evals and regions; it may take a
        while), and the drain (diloco.hooks; Drain here)."""
        for name in self.syncers:
            self.procs.start(name)
        self._start_learners(t0)
        self._await_syncers(t0)
        view, drain = hooks.ProgressView(self, t0, live=progress), Drain(self, t0 + self.cfg.run.timeout_s)
        passes: list[hooks.Hook] = [view, self.chaos, self.serve_requests, self.follow_budget, self.procs.reap,
                                    self.procs.restart_due, *([lambda now: on_tick(self)] if on_tick else []), drain]
        try:
            while not drain.over:
                self._pump()
                now = time.time()
                for hook in passes:
                    hook(now)
            self._pump(500)  # the syncer's last events
        finally:
            view.close(time.time())

    def _await_syncers(self, t0: float) -> None:
        """Until every syncer shard said syncer_started; a shard that exits first fails the run with its log."""
        shards = f" ({len(self.syncers)} shards)" if len(self.syncers) > 1 else ""
        with self.console.status("starting the syncer" + shards):
            while self.syncers_up != set(self.syncers):
                for name in self.syncers:
                    if self.jobs.poll(name) is not None:
                        raise RunError(f"{name} exited with {self.jobs.poll(name)}:\n" + self.jobs.tail(name))
                if time.time() - t0 > self.cfg.run.timeout_s:
                    raise RunError("the syncer did not start in time:\n" + self.jobs.tail(self.syncers[0]))
                self._pump(200)

    def _start_learners(self, t0: float) -> None:
        """This runner's learners, where a resumed run left them, and its warm spares. They start with
        the syncer, not after it: both take seconds to import and set up, and a delta or a heartbeat
        sent before the syncer reads waits in Kafka for it (intake takes the two topics in any order)."""
        if self.members:
            self._catch_up(t0)
            self.resume_membership()
        for lid in self.members:
            if lid not in self.procs.finished:
                self.procs.start(lid)
        for _ in range(self.cfg.run.spares if self.members else 0):  # spares stand in for this runner's learners
            self.procs.start_spare()

    def resilience(self, state: state_mod.SyncerState) -> dict:
        """Goodput, kills, restarts and outages of the run (all zero-loss figures for a healthy run)."""
        step_time = np.median([hb.get("step_time", 0.0) for hb in self.prog.learners.values()] or [0.0])
        return {
            **self.ledger.goodput(state.merges(), fragments=self.cfg.fragments.count, members=self.members,
                                  outages=self.procs.outages, step_time_s=float(step_time),
                                  sync_every=self.cfg.fragments.sync_every, now=time.time()),
            "restarts": dict(self.procs.restarts),
            "outages_s": outage_seconds(self.procs.outages),
            "takeovers": self.ledger.takeover_times(self.syncers, self.procs.outages),
            "spare_handovers": list(self.procs.handovers),
        }

    def coverage(self, state: state_mod.SyncerState) -> dict:
        """The coverage ledger (diloco.coverage) from the merge records, measured against each learner's
        schedule, and the learners' beats (trained and handed-in tokens); the epoch each shard reached when the built-in model reads it (shard_batches, one window per sequence)."""
        cfg = self.cfg
        epochs = None
        if cfg.model.entry == BUILTIN_MODEL:
            span = cfg.model.transformer.seq_len + 1

            def shard_epochs(lid: str, end: int) -> float | None:
                if not cfg.is_member_id(lid):
                    return None
                i = cfg.shard_index(lid)
                n = int(self.corpus.manifest["shards"][i]["tokens"])
                return round(epochs_read(n, cfg.data.seed, i, end * cfg.inner.batch_size, span), 4)
            epochs = shard_epochs
        return coverage.ledger(state.merges(), fragments=cfg.fragments.count,
                               trained=self.prog.per_learner(self.prog.trained),
                               handed_in=self.prog.per_learner(self.prog.handed_in_tokens), epochs=epochs,
                               schedule=self.schedules())

    def schedules(self) -> dict[str, tuple[int, int | None]]:
        """Per learner of this runner, the steps its data stream was to span, as the runner set them (never
        as an event says): from its join step to its schedule's end; up to what it handed in for one the
        runner asked to stop (the token budget, an operator's remove) or one on a time budget
        (inner.max_seconds), which stops on its own."""
        early = set(self.procs.removing) if not self.cfg.inner.max_seconds else set(self.members)
        return {lid: (self.join_step.get(lid, 0), None if lid in early else self.cfg.learner_steps(lid))
                for lid in self.members}


class Drain:
    """The watch loop's end: once this runner's learners are done (and no other runner is waited for)
    and the syncer shards are up, the shards are asked to drain (SIGTERM: they flush their open rounds
    and exit), and the loop is `over` once they all finished. RunError past run.timeout_s, or past
    syncer.drain_timeout_s (and a minute) after the drain was asked for."""

    def __init__(self, run: RunSupervisor, deadline: float):
        self.run, self.deadline, self.over = run, deadline, False

    def __call__(self, now: float) -> None:
        run = self.run
        if not run.draining and self.learners_done(now):
            for name in run.syncers:
                run.jobs.signal(name, signal.SIGTERM)
            run.draining, self.deadline = True, min(self.deadline, now + run.cfg.syncer.drain_timeout_s + 60)
        if run.draining and set(run.syncers) <= run.procs.finished:
            self.over = True
        elif now > self.deadline:
            raise RunError(f"run did not finish within run.timeout_s={run.cfg.run.timeout_s:.0f}s")

    def learners_done(self, now: float) -> bool:
        """Whether the syncer may be asked to drain: this runner's learners are done, no other runner is
        waited for, and every shard is up (none down or restarting); the first time they are done counts."""
        run = self.run
        done = all(lid in run.procs.finished for lid in run.members) and not run.elsewhere
        if done and run.ledger.learners_done_at is None:
            run.ledger.learners_done_at = now
        return done and run.syncers_up == set(run.syncers) and not set(run.syncers) & set(run.procs.restart_at)
