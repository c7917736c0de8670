"""The run supervisor's hooks (diloco.supervisor): each duty of its watch loop, with the state and the
cadence that are its own. A hook is built on the supervisor it serves and called once per pass of the
loop with that pass's time, `hook(now)`; the supervisor keeps what several hooks share (its
processes, `run.procs` of diloco.processes; the members; whether the run is draining). Times come
from the loop, never from a clock of the hook's own, so tests drive a hook with made-up times and
no services.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from rich.live import Live
from rich.text import Text

from diloco import chaos, membership, messages
from diloco.periodic import Every
from diloco.progress import progress_line, progress_table

if TYPE_CHECKING:
    from diloco.supervisor import RunSupervisor

log = logging.getLogger(__name__)

Hook = Callable[[float], None]


class ProgressView:
    """What the operator sees: the live table (`live`), or without a terminal a progress line every
    `line_every_s`. `close()` shows the last figures."""

    def __init__(self, run: RunSupervisor, t0: float, *, live: bool, line_every_s: float = 10.0):
        self.run, self.t0 = run, t0
        self.live = Live(self._table(0.0), console=run.console, refresh_per_second=2) if live else None
        self.every_line = Every(line_every_s)
        if self.live:
            self.live.start()

    def _table(self, elapsed: float):
        return progress_table(self.run.cfg, self.run.prog, self.run.cfg.run.id, elapsed)

    def __call__(self, now: float) -> None:
        if self.live:
            self.live.update(self._table(now - self.t0))
        elif self.every_line.due(now):
            self.run.console.print(progress_line(self.run.prog, now - self.t0), soft_wrap=True)

    def close(self, now: float) -> None:
        if self.live:
            self.live.update(self._table(now - self.t0))
            self.live.stop()


class ChaosKills:
    """The chaos schedule (diloco.chaos) of this runner's processes: each kill once its own target's
    progress reached it. A lagging target (the syncer, whose progress is the mean over the learners)
    never holds back the others' kills; a target down (or the run draining) keeps its kill due."""

    def __init__(self, run: RunSupervisor, kills: list[chaos.Kill]):
        self.run = run
        self.kills = [k for k in kills if k.target in run.syncers or k.target in run.members]  # not done yet

    def __call__(self, now: float) -> None:
        run = self.run
        for kill in [k for k in self.kills if self.progress_of(k.target) >= k.at_progress]:
            if run.draining or kill.target in run.procs.restart_at:
                continue  # down right now (or draining): the kill stays due until it runs again
            self.kills.remove(kill)
            if kill.target not in run.procs.finished:
                run.procs.kill(kill.target, now)

    def progress_of(self, target: str) -> float:
        """A learner's share of its schedule done; a syncer shard's, the mean over this runner's learners."""
        run, cfg = self.run, self.run.cfg
        if target in run.syncers:
            return sum(run.prog.learners.get(lid, {}).get("step", 0) for lid in run.members) / sum(
                cfg.learner_steps(lid) for lid in run.members)
        return run.prog.learners.get(target, {}).get("step", 0) / cfg.learner_steps(target)


def request(run: RunSupervisor, op, now: float) -> dict:
    """Carry out one membership request; its answer, {"ok": True, ...} or {"ok": False, "error": why}."""
    try:
        result = {"ok": True, **run.carry_out(op, now)}
    except membership.RequestError as err:
        result = {"ok": False, "error": str(err)}
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a request of the wrong shape
        result = {"ok": False, "error": f"bad request {messages.short(op, 200)}: {type(err).__name__}: "
                                        f"{messages.bounded(str(err), 200)}"}
    run.console.print(Text(f"membership: {messages.short(op, 200)} -> {result}", style="cyan"))  # never markup
    return result


class MembershipRequests:
    """The operator's membership requests (`diloco learners add/remove`, diloco.membership), each
    answered once by the runner of the region it names (the syncer's runner refuses the rest); none
    once the run drains."""

    def __init__(self, run: RunSupervisor):
        self.run = run

    def __call__(self, now: float) -> None:
        run = self.run
        if run.draining:
            return
        for path, op in membership.pending(run.cfg_path.parent):
            try:
                owner = self.region_asked(op)
                if not (run.ours(owner) or (owner is None and run.syncers)):  # the syncer's runner refuses the rest
                    continue
                result = request(run, op, now)
            except Exception as err:  # whatever a request holds, it gets an answer and the run goes on
                log.exception("membership request failed", extra={"request": messages.short(op, 200)})
                result = {"ok": False, "error": f"request {messages.short(op, 200)} failed: {type(err).__name__}: "
                                                f"{messages.bounded(str(err), 200)}"}
            membership.answer(path, result)

    def region_asked(self, op: dict | None) -> str | None:
        """The region a request is for (its runner answers it); None for one that names none of the run's."""
        cfg = self.run.cfg
        if not isinstance(op, dict):
            return None
        if op.get("op") == "add":
            region = op.get("region")
            return region if isinstance(region, str) and region in {r.name for r in cfg.regions} else None
        lid = op.get("learner")
        return cfg.region_of(lid).name if isinstance(lid, str) and cfg.is_member_id(lid) else None


class TokenBudget:
    """run.token_budget: run.joins once their share of it is in the global model; once all of it is,
    every running learner is asked to stop (it hands in its last deltas and says left). Merged tokens,
    not the heartbeats' claims: one forged heartbeat must not end a run. Nothing once the run drains."""

    def __init__(self, run: RunSupervisor):
        self.run = run
        self.joins = [j for j in run.cfg.run.joins if run.ours(j.region)]  # not carried out yet

    def __call__(self, now: float) -> None:
        run = self.run
        budget = run.cfg.run.token_budget
        if budget is None or run.draining:
            return
        tokens = run.prog.merged_tokens(run.cfg.fragments.count)
        if tokens >= budget:
            self.joins.clear()  # nothing is left for them to train
            running = run.procs.running()
            if running:
                run.console.print(f"[cyan]token budget reached ({tokens:,} of {budget:,}): stopping {running}[/]")
            for lid in running:
                run.procs.ask_to_leave(lid)
            return
        for join in [j for j in self.joins if tokens >= j.at_tokens_fraction * budget]:
            self.joins.remove(join)
            request(run, {"op": "add", "region": join.region, "count": join.count}, now)
