"""The supervisor of a run's processes (`diloco train`, `diloco chaos`, the Prefect flows): it starts
the syncer shards and the learners as processes, reads the run's events topic, restarts what fails
(or hands a dead learner's place to a warm spare), applies the chaos schedule, carries out
membership requests, follows the token budget, and keeps the figures goodput and the coverage
ledger are computed from. The run's life cycle around it (provision, open, finish) is diloco.run.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import time
from pathlib import Path

import numpy as np
from redis.exceptions import RedisError
from rich.live import Live
from rich.text import Text

from diloco import chaos, coverage, membership, messages, resume
from diloco.config import BUILTIN_MODEL, Config
from diloco.infra.jobs import JobBackend
from diloco.infra.store import FragmentStore, StoreError
from diloco.learners.data import epochs_read
from diloco.messages import WireError
from diloco.progress import (
    Progress,
    check_accepted_cursor,
    check_event_fields,
    check_heartbeat_claims,
    progress_line,
    progress_table,
)
from diloco.syncer import state as state_mod
from diloco.syncer.durability import EXIT_STATE_LOST

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    pass


class RunSupervisor:
    """Watches a run's processes and events: restarts what fails, applies the chaos schedule, and
    records the outages and compute time that goodput is computed from.

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
        self._last_line = 0.0                    # when the last progress line was printed (no live table)
        # where restarts resume (diloco.resume): from the syncer's records in Redis, never from an event
        self.merged_ends: dict[str, int] = {}     # learner -> furthest cursor end of its merged contributions
        self._merges_read = 0                     # merge records folded into merged_ends
        self.settling: dict[str, float] = {}      # learner -> until when its restart waits for the records
        self.to_spare: dict[str, tuple[str, float]] = {}  # died, to be handed to a spare: (why, cold-restart delay)
        self.deferred_starts: set[str] = set()    # first starts put off until Redis answers (not restarts)

    @functools.cached_property
    def state(self) -> state_mod.SyncerState:
        """The run's syncer state in Redis: the records restarts resume from."""
        return state_mod.SyncerState(state_mod.connect(self.cfg.state), self.cfg.state.key_prefix, self.cfg.run.id)

    @functools.cached_property
    def store(self) -> FragmentStore:
        """The run's store, read for the merges that count towards run.token_budget."""
        return FragmentStore(self.cfg.store.url, self.cfg.run.id)

    def _ours(self, region: str | None) -> bool:
        return self.regions is None or region in self.regions

    # --- processes -----------------------------------------------------------------------------
    def start(self, name: str, step: int | None = None) -> None:
        """Start `name`; a learner at `step` of its data stream (None: where the syncer's records say)."""
        conf = ["--config", str(self.cfg_path)]
        if name in self.syncers:
            self.syncers_up.discard(name)
            self.jobs.start(name, ["syncer", *conf, "--shard", str(self.syncers.index(name))])
            return
        if step is None:
            step = self.resume_point(name, time.time(), wait=False)
        if step is None:  # Redis did not answer: started by the loop once it does
            self.deferred_starts.add(name)
            self.restart_at[name] = time.time()
            return
        self.jobs.start(name, ["learner", *conf, "--learner", name, "--corpus", str(self.corpus.dir),
                               "--start-step", str(step)], processes=self.cfg.parallel.processes)

    def accepted_end(self, name: str) -> int | None:
        """The end of the furthest data-stream cursor the syncer accepted for learner `name`, pending or
        merged, from Redis (RedisError or StateError when it does not answer). Pending ones are read first: one
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
        claim costs that wait and moves nothing)."""
        try:
            accepted = self.accepted_end(name)
        except (RedisError, state_mod.StateError, OSError) as err:
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
        return resume.resume_step(accepted, default=self.join_step.get(name, 0), schedule_end=self.cfg.learner_steps(name))

    def _down(self, name: str, now: float, delay: float, why: str) -> None:
        self.outages.append([name, now, None])
        if name in self.members and self.spares:  # handed to a spare once its resume point is known (_restart_due)
            self.to_spare[name] = (why, delay)
            self.restart_at[name] = now
            return
        self._restart_later(name, now, delay, why)

    def _restart_later(self, name: str, now: float, delay: float, why: str) -> None:
        self.restart_at[name] = now + delay
        self.console.print(Text(f"{name} {why}; restarting in {delay:.1f}s", style="yellow"))

    # --- warm spares ---------------------------------------------------------------------------
    def _start_spare(self) -> None:
        name = f"{self.regions[0]}-spare-{self.spares_started}" if self.regions else f"spare-{self.spares_started}"
        self.spares_started += 1
        self.jobs.start(name, ["learner", "--config", str(self.cfg_path), "--spare", "--corpus", str(self.corpus.dir)],
                        stdin_pipe=True)
        self.spares.append(name)

    def _hand_to_spare(self, name: str, why: str, at: int) -> bool:
        """Learner `name` died: the oldest live spare becomes it at once, at step `at` (a new spare starts
        behind it). False when no spare is left; spares that died are dropped."""
        while self.spares:
            spare = self.spares.pop(0)
            hb = self.prog.learners.get(name, {})
            try:
                if self.jobs.poll(spare) is not None:
                    raise OSError(f"exited with {self.jobs.poll(spare)}")
                self.jobs.tell(spare, json.dumps({"learner": name, "start_step": at}))
            except OSError as err:
                self.console.print(Text(f"{spare} cannot take over ({err}); log {self.jobs.where_log(spare)}:\n",
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
        if meta.get("ids") != ev["ids"] or not messages.is_count(tokens) or tokens < 0:
            raise KeyError(f"merge event of fragment {p} v{v} does not match the stored version")
        return tokens

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
            result = {"ok": True, **self.carry_out(op, now)}
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
        self.to_spare.pop(lid, None)
        self.settling.pop(lid, None)
        if self.jobs.poll(lid) is None:
            self.jobs.signal(lid, signal.SIGTERM)  # it hands in its last deltas and says it left

    def carry_out(self, op: dict | None, now: float) -> dict:
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

    def resume_membership(self) -> None:
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
        """Until the syncer drained; `on_tick(self)` runs once per loop (evals, reports) and may take a while.

        Each pass of the loop: read events, show them, apply due chaos kills, serve membership
        requests and follow the token budget (until the stop), reap exited processes (finished,
        or down and due a restart), restart those due, then stop the syncer once the learners are done."""
        for name in self.syncers:
            self.start(name)
        self._start_learners(t0)
        self._await_syncers(t0)
        deadline = t0 + self.cfg.run.timeout_s
        stop_sent = False
        live = Live(progress_table(self.cfg, self.prog, self.cfg.run.id, 0), console=self.console,
                    refresh_per_second=2) if progress else None
        if live:
            live.start()
        try:
            while True:
                self._pump()
                now = time.time()
                self._show(live, now, t0)
                self._apply_due_kills(now, stop_sent)
                if not stop_sent:
                    self.serve_requests(now)
                    self.follow_budget(now)
                self._reap(now, stop_sent)
                self._restart_due(now)
                if on_tick:
                    on_tick(self)
                if not stop_sent and self._learners_done(now):
                    stop_sent, deadline = True, min(deadline, now + self.cfg.syncer.drain_timeout_s + 60)
                if stop_sent and set(self.syncers) <= self.finished:
                    self._pump(500)  # the syncer's last events
                    return
                if now > deadline:
                    raise RunError(f"run did not finish within run.timeout_s={self.cfg.run.timeout_s:.0f}s")
        finally:
            if live:
                live.update(progress_table(self.cfg, self.prog, self.cfg.run.id, time.time() - t0))
                live.stop()

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
            if lid not in self.finished:
                self.start(lid)
        for _ in range(self.cfg.run.spares if self.members else 0):  # spares stand in for this runner's learners
            self._start_spare()

    def _show(self, live: Live | None, now: float, t0: float) -> None:
        """The live table, or without a terminal a progress line every 10 s."""
        if live:
            live.update(progress_table(self.cfg, self.prog, self.cfg.run.id, now - t0))
        elif now - self._last_line > 10:
            self.console.print(progress_line(self.prog, now - t0), soft_wrap=True)
            self._last_line = now

    def _reap(self, now: float, stop_sent: bool) -> None:
        """Processes that exited: finished (a learner done, a syncer after the stop, one asked to leave),
        or down and due a restart after the backoff; RunError when no retry helps."""
        cfg = self.cfg
        for name in [*self.members, *self.syncers]:
            rc = self.jobs.poll(name) if self.jobs.has(name) else None
            if rc is None or name in self.restart_at or name in self.finished:
                continue
            if (rc == 0 and (name not in self.syncers or stop_sent)) or name in self.removing:
                self.finished.add(name)
                if name in self.removing:  # its time in the run ends here, not with the run's
                    self.spans.setdefault(name, [None, None])[1] = now
                continue
            n = self.restarts.get(name, 0)
            if n >= cfg.run.max_restarts or (name in self.syncers and rc == EXIT_STATE_LOST):  # no retry helps
                raise RunError(f"{name} failed {n + 1} times (last exit {rc}); log {self.jobs.where_log(name)}:\n"
                               + self.jobs.tail(name))
            self._down(name, now, cfg.run.restart_backoff_s * 2 ** n, f"exited with {rc}")

    def _restart_due(self, now: float) -> None:
        """Start again (or hand to a spare) each process due, a learner once its resume point is known."""
        for name, at in list(self.restart_at.items()):
            if now < at:
                continue
            step = None
            if name not in self.syncers:
                step = self.resume_point(name, now, wait=name not in self.deferred_starts)
                if step is None:
                    continue  # asked again on the next pass
            del self.restart_at[name]
            if name in self.to_spare:
                why, delay = self.to_spare.pop(name)
                if not self._hand_to_spare(name, why, step):
                    self._restart_later(name, now, delay, why)
                continue
            if name in self.deferred_starts:
                self.deferred_starts.discard(name)
            else:
                self.restarts[name] = self.restarts.get(name, 0) + 1
            self.start(name, step)

    def _learners_done(self, now: float) -> bool:
        """True once this runner's learners are done (and no other runner is waited for) and the syncer
        shards are up: then they are asked to drain, flush their open rounds and exit."""
        done = all(lid in self.finished for lid in self.members) and not self.elsewhere
        if done and self.learners_done_at is None:
            self.learners_done_at = now
        if not done or self.syncers_up != set(self.syncers) or set(self.syncers) & set(self.restart_at):
            return False
        for name in self.syncers:
            self.jobs.signal(name, signal.SIGTERM)
        return True

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
        early = set(self.removing) if not self.cfg.inner.max_seconds else set(self.members)
        return {lid: (self.join_step.get(lid, 0), None if lid in early else self.cfg.learner_steps(lid))
                for lid in self.members}

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
