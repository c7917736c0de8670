"""The owner of a run's processes (diloco.supervisor's `procs`): it starts the syncer shards, the
learners and the warm spares as jobs of a backend (diloco.infra.jobs), reaps those that exited,
restarts them after a backoff (or hands a dead learner's place to a warm spare), stops the ones asked
to leave, and records each process's outages. Two of its methods are hooks of the supervisor's watch
loop (`reap`, `restart_due`); like the other hooks (diloco.hooks), they take the pass's time.

What it needs of the run is handed in, and nothing else: the config, the job backend, the console,
the ledger, the heartbeat view, the syncer shards and the members (lists the supervisor keeps and
this owner reads), which shards are up and whether the run drains, and from the supervisor (which
reads the syncer's records in Redis) where a learner resumes.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.text import Text

from diloco.config import Config
from diloco.infra.jobs import JobBackend
from diloco.ledger import RunLedger
from diloco.progress import Progress
from diloco.syncer.durability import EXIT_STATE_LOST


class RunError(RuntimeError):
    """The run cannot go on (a process past its restarts, the syncer not starting or not finishing in time)."""


@dataclass
class Outage:
    """A process down: from its exit (or kill) until it is back (its next heartbeat, or syncer_started)."""
    name: str
    start: float
    end: float | None = None


def outage_seconds(outages: list[Outage]) -> dict[str, float]:
    """Each process's last ended outage, in seconds (what the summary and a region's report show)."""
    return {o.name: round(o.end - o.start, 2) for o in outages if o.end is not None}


ResumePoint = Callable[..., "int | None"]  # (learner, now, *, wait) -> its start step, None while unknown


class Processes:
    """The run's jobs: starts, restarts with backoff, warm spares and outages.

    `syncers`, `members` and `syncers_up` are the supervisor's own list and sets, read (and, for
    `syncers_up`, a shard's restart cleared) here; `draining()` says whether the syncer was asked to
    drain. `resume_point(name, now, wait=...)` is where a learner starts, None while that is not known;
    `went_down(name, now)` and `left(name)` tell the supervisor a learner died (its restart then waits
    for the syncer to read what it wrote) or was asked to leave (nothing is waited for any more).
    `spare_prefix` names the spares (`{prefix}spare-N`)."""

    def __init__(self, cfg: Config, cfg_path: Path, corpus, jobs: JobBackend, console: Console, ledger: RunLedger,
                 prog: Progress, *, syncers: list[str], members: list[str], syncers_up: set[str],
                 draining: Callable[[], bool], resume_point: ResumePoint, went_down: Callable[[str, float], None],
                 left: Callable[[str], None], spare_prefix: str = ""):
        self.cfg, self.cfg_path, self.corpus, self.jobs, self.console = cfg, cfg_path, corpus, jobs, console
        self.ledger, self.prog, self.syncers, self.members, self.syncers_up = ledger, prog, syncers, members, syncers_up
        self.draining, self.resume_point, self.went_down, self.left = draining, resume_point, went_down, left
        self.spare_prefix = spare_prefix
        self.finished: set[str] = set()
        self.restart_at: dict[str, float] = {}
        self.restarts: dict[str, int] = {}
        self.outages: list[Outage] = []
        self.removing: set[str] = set()          # asked to leave: not restarted, whatever their exit
        self.spares: list[str] = []             # warm spare jobs (run.spares), oldest first
        self.spares_started = 0
        self.spares_owed = 0                    # replacements to start once no handover is still warming up
        self.handovers: list[dict] = []          # each learner a spare took the place of
        self.replaced: dict[str, str | None] = {}  # learner -> the incarnation its spare replaced
        self.to_spare: dict[str, tuple[str, float]] = {}  # died, to be handed to a spare: (why, cold-restart delay)
        self.deferred_starts: set[str] = set()    # first starts put off until Redis answers (not restarts)

    def running(self) -> list[str]:
        return [m for m in self.members if m not in self.finished and m not in self.removing]

    # --- starts --------------------------------------------------------------------------------
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

    def start_spare(self) -> None:
        name = f"{self.spare_prefix}spare-{self.spares_started}"
        self.spares_started += 1
        self.jobs.start(name, ["learner", "--config", str(self.cfg_path), "--spare", "--corpus", str(self.corpus.dir)],
                        stdin_pipe=True)
        self.spares.append(name)

    # --- downs and restarts --------------------------------------------------------------------
    def _down(self, name: str, now: float, delay: float, why: str) -> None:
        self.outages.append(Outage(name, now))
        self.went_down(name, now)
        if name in self.members and self.spares:  # handed to a spare once its resume point is known (restart_due)
            self.to_spare[name] = (why, delay)
            self.restart_at[name] = now
            return
        self._restart_later(name, now, delay, why)

    def _restart_later(self, name: str, now: float, delay: float, why: str) -> None:
        self.restart_at[name] = now + delay
        self.console.print(Text(f"{name} {why}; restarting in {delay:.1f}s", style="yellow"))

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

    def kill(self, target: str, now: float) -> None:
        """SIGKILL `target` (a chaos kill): down until its restart, its compute since its last beat counted."""
        beat = None if target in self.syncers else self.prog.learners.get(target, {})
        self.jobs.signal(target, signal.SIGKILL)
        self.jobs.wait(target)
        self.ledger.killed(target, beat, now)
        self._down(target, now, self.cfg.chaos.restart_after_s, "killed by chaos (SIGKILL)")

    def ask_to_leave(self, lid: str) -> None:
        """Stop learner `lid` for good (the token budget, an operator's remove): it is not restarted."""
        self.removing.add(lid)
        self.restart_at.pop(lid, None)
        self.to_spare.pop(lid, None)
        self.left(lid)
        if self.jobs.poll(lid) is None:
            self.jobs.signal(lid, signal.SIGTERM)  # it hands in its last deltas and says it left

    def close_outage(self, name: str) -> None:
        """`name` is back (its heartbeat, or syncer_started): its outage ends, unless a restart is still
        due; the spares owed start once no learner a spare took the place of is still down."""
        for o in self.outages:
            if o.name == name and o.end is None and name not in self.restart_at:
                o.end = time.time()
        if self.spares_owed and not any(o.end is None and o.name in self.replaced for o in self.outages):
            for _ in range(self.spares_owed):
                self.start_spare()
            self.spares_owed = 0

    # --- the watch loop's hooks ----------------------------------------------------------------
    def reap(self, now: float) -> None:
        """Processes that exited: finished (a learner done, a syncer after the stop, one asked to leave),
        or down and due a restart after the backoff; RunError when no retry helps."""
        cfg = self.cfg
        for name in [*self.members, *self.syncers]:
            rc = self.jobs.poll(name) if self.jobs.has(name) else None
            if rc is None or name in self.restart_at or name in self.finished:
                continue
            if (rc == 0 and (name not in self.syncers or self.draining())) or name in self.removing:
                self.finished.add(name)
                if name in self.removing:  # its time in the run ends here, not with the run's
                    self.ledger.spans.setdefault(name, [None, None])[1] = now
                continue
            n = self.restarts.get(name, 0)
            if n >= cfg.run.max_restarts or (name in self.syncers and rc == EXIT_STATE_LOST):  # no retry helps
                raise RunError(f"{name} failed {n + 1} times (last exit {rc}); log {self.jobs.where_log(name)}:\n"
                               + self.jobs.tail(name))
            self._down(name, now, cfg.run.restart_backoff_s * 2 ** n, f"exited with {rc}")

    def restart_due(self, now: float) -> None:
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
