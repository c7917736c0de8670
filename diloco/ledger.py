"""The run ledger: what the run supervisor (diloco.supervisor) saw of its learners' compute and of its
processes' failures, and the goodput figures of the summary computed from it (diloco.chaos has the
formulas). The supervisor writes it as events and kills happen; nothing here reads a clock, a
process or a service, so the accounting is tested on records made up by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diloco import chaos

if TYPE_CHECKING:
    from diloco.processes import Outage


@dataclass
class RunLedger:
    compute: dict[tuple[str, str | None], dict] = field(default_factory=dict)  # (learner, incarnation) -> last beat's figures
    tails_s: dict[str, float] = field(default_factory=dict)   # compute after a killed incarnation's last beat
    kill_counts: dict[str, int] = field(default_factory=dict)
    spans: dict[str, list] = field(default_factory=dict)      # learner -> [since, until]: added or removed ones
    takeovers: list[dict] = field(default_factory=list)       # fragment_claimed events: one shard took another's
    first_beat: float | None = None                           # when the run's learners started training
    learners_done_at: float | None = None                     # when this runner's learners were all done

    def beat(self, ev: dict, now: float) -> None:
        """A heartbeat (checked already): its incarnation's compute so far."""
        self.first_beat = self.first_beat or now
        self.compute[(ev["learner"], ev.get("incarnation"))] = {"compute_s": ev.get("compute_s", 0.0),
                                                                "at": ev.get("at", ev["time"])}

    def killed(self, target: str, beat: dict | None, now: float) -> None:
        """`target` was SIGKILLed at `now`; `beat` its last heartbeat (None for a syncer shard). A running
        learner's wall time since its beat's figures were taken is at least the compute it did since."""
        if beat is not None:
            key = (target, beat.get("incarnation"))
            if key in self.compute and beat.get("state") == "running":
                self.tails_s[target] = self.tails_s.get(target, 0.0) + now - self.compute[key]["at"]
        self.kill_counts[target] = self.kill_counts.get(target, 0) + 1

    def time_in_run(self, lid: str, end: float) -> float:
        """Seconds `lid` was a member: from the first heartbeat of the run (a starting learner) or
        its addition, until it was asked to leave or the run's learners were done."""
        since, until = self.spans.get(lid, (None, None))
        return (until or end) - (since or self.first_beat or end)

    def goodput(self, merges: Sequence[dict], *, fragments: int, members: Sequence[str], outages: Sequence[Outage],
                step_time_s: float, sync_every: int, now: float) -> dict:
        """Goodput over compute and over wall-clock chip time (a learner's merged compute over what it
        spent), per learner, and what a synchronous run would keep under the same outages and kills."""
        productive: dict[str, float] = {}
        for m in merges:
            for lid, c in zip(m["learners"], m.get("compute_s", [])):
                productive[lid] = productive.get(lid, 0.0) + c / fragments  # every step is in one delta per fragment
        compute: dict[str, float] = dict(self.tails_s)
        for (lid, _), figures in self.compute.items():
            compute[lid] = compute.get(lid, 0.0) + figures["compute_s"]
        end = self.learners_done_at or now
        return {
            "goodput": chaos.goodput(sum(productive.values()), sum(compute.values())),
            "goodput_wall": chaos.goodput(sum(productive.values()), sum(self.time_in_run(lid, end) for lid in members)),
            "goodput_per_learner": {lid: chaos.goodput(productive.get(lid, 0.0), compute.get(lid, 0.0))
                                    for lid in members},
            "goodput_sync_equivalent": chaos.sync_equivalent_goodput(
                span_s=end - (self.first_beat or end), outages=[(o.start, o.end) for o in outages if o.end is not None],
                kills=sum(self.kill_counts.values()), lost_per_kill_s=sync_every / 2 * step_time_s),
            "kills": dict(self.kill_counts),
        }

    def takeover_times(self, syncers: Sequence[str], outages: Sequence[Outage]) -> list[dict]:
        """Each fragment another shard claimed from a shard that went down: seconds from the outage."""
        out = []
        for ev in self.takeovers:
            down = syncers[int(ev["previous"].split(":", 1)[0])]
            starts = [o.start for o in outages  # the outage it was claimed in (not a hand-back)
                      if o.name == down and o.start <= ev["time"] and (o.end is None or o.end >= ev["time"])]
            if starts:
                out.append({"fragment": ev["fragment"], "from": down, "to": syncers[ev["shard"]],
                            "after_s": round(ev["time"] - max(starts), 2)})
        return out
