"""The learner registry: who is a member of the run, who is alive, and which regions are short.

Every shard reads the same heartbeats in the same order and keeps its own view of liveness on its
own clock (injected, so the rules run under a fake clock in unit tests). One shard, the coordinator,
also keeps the shared registry in Redis and says what changed, through `emit` (an event kind and its
fields). Liveness decides whom a round waits for (`live`) and who still counts as in the run
(`present`); nothing here touches a round or a fragment.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from diloco import messages
from diloco.config import Config
from diloco.messages import WireError

log = logging.getLogger(__name__)

STATUSES = ("alive", "silent", "finished", "left", "dropped")
MAX_REFUSED = 10_000  # ids refused and said so, remembered per process (a bound on a forger's ids)


class LearnerRegistry(Mapping[str, dict]):
    """Learner id -> its last heartbeat, with `seen` (this shard's clock) and `status` added."""

    def __init__(self, cfg: Config, state, emit: Callable[..., None], clock=time.time):
        self.cfg, self.state, self.emit, self.clock = cfg, state, emit, clock
        self.members = set(cfg.learner_ids())    # the configured learners, and those admitted since
        self.refused: set[str] = set()
        self.below_min: dict[str, bool] = {}      # region -> fewer live learners than regions[].min_learners
        self.beats: dict[str, dict] = {}
        self.coordinator = False                  # set by the syncer's rebalance

    def __getitem__(self, lid: str) -> dict:
        return self.beats[lid]

    def __iter__(self) -> Iterator[str]:
        return iter(self.beats)

    def __len__(self) -> int:
        return len(self.beats)

    def resume(self, *, under_way: bool) -> None:
        """Reload members and beats from Redis after a (re)start; their clocks restart from now.

        Stored beats are checked again (Redis may hold what an older build let in). In a run under
        way a member never heard from gets a beat now, so it is not waited for forever."""
        now = self.clock()
        self.members |= {lid for lid in self.state.members() if self.cfg.is_member_id(lid)}
        self.beats = {}
        for lid, hb in self.state.registry().items():
            try:
                if lid in self.members:
                    self.beats[lid] = messages.clean_heartbeat(hb) | {"seen": now, "status": hb.get("status", "alive")}
            except WireError as err:
                log.warning("registry entry dropped", extra={"learner": lid[:64], "error": str(err)})
        if self.beats or under_way:
            for lid in self.members - set(self.beats):
                self.beats[lid] = {"kind": "heartbeat", "learner": lid, "seen": now, "status": "alive"}

    def heard(self, ev: dict) -> None:
        """A heartbeat event (already parsed): checked, admitted, recorded; changes said once."""
        try:
            ev = messages.clean_heartbeat(ev)
        except WireError as err:  # one bad beat: counted and logged, never stored or used
            self.state.count("bad_events")
            log.warning("heartbeat ignored", extra={"error": str(err)})
            return
        lid = ev["learner"]
        if not self.admit(lid):
            return
        before = self.beats.get(lid)
        ev["seen"] = self.clock()  # the syncer's clock decides liveness, not the learner's
        ev["status"] = {"finished": "finished", "left": "left"}.get(ev.get("state"), "alive")
        self.beats[lid] = ev
        if not self.coordinator:
            return
        self.state.heartbeat(lid, ev)
        if before is None or before.get("incarnation") != ev.get("incarnation") or before["status"] != ev["status"]:
            if ev["status"] == "alive":
                self.emit("learner_joined", learner=lid, incarnation=ev.get("incarnation"), step=ev.get("step"),
                          was=None if before is None else before["status"])
            else:  # finished its budget, or left early (SIGTERM): no round waits for it any more
                self.emit(f"learner_{ev['status']}", learner=lid, step=ev.get("step"), tokens=ev.get("tokens"))
                log.info(f"learner {ev['status']}", extra={"learner": lid, "step": ev.get("step")})

    def admit(self, lid: str) -> bool:
        """Whether `lid` is a member of the live run, admitting it if the config lets it join
        (`regions[].max_learners`). The rule depends on the id alone, so all shards agree without
        asking each other; the coordinator records the admission and says so."""
        if lid in self.members:
            return True
        if not self.cfg.is_member_id(lid):
            if self.coordinator and lid not in self.refused and len(self.refused) < MAX_REFUSED:
                self.refused.add(lid)
                self.state.count("refused_learners")
                self.emit("learner_refused", learner=lid[:64], reason=self.cfg.not_a_member(lid[:64]))
                log.warning("learner refused", extra={"learner": lid[:64]})
            return False
        self.members.add(lid)
        if self.coordinator:
            region, shard = self.cfg.region_of(lid).name, self.cfg.shard_index(lid)
            if self.state.admit(lid, {"region": region, "shard": shard, "time": time.time()}):
                self.emit("learner_admitted", learner=lid, region=region, shard=shard, members=len(self.members))
                log.info("learner admitted", extra={"learner": lid, "region": region, "members": len(self.members)})
        return True

    def check(self) -> None:
        """Heartbeats that stop mark a learner silent (not waited for), then drop it from the registry."""
        now = self.clock()
        sc = self.cfg.syncer
        for lid, hb in list(self.beats.items()):
            age = now - hb["seen"]
            if hb["status"] == "alive" and age > sc.silent_after_s:
                hb["status"] = "silent"
                if self.coordinator:
                    self.emit("learner_silent", learner=lid, last_step=hb.get("step"), silent_s=round(age, 1))
                    log.warning("learner silent", extra={"learner": lid, "silent_s": round(age, 1)})
            elif hb["status"] == "silent" and age > sc.drop_after_s:
                hb["status"] = "dropped"
                if self.coordinator:
                    self.state.drop_learner(lid, hb)
                    self.emit("learner_dropped", learner=lid, silent_s=round(age, 1))
                    log.warning("learner dropped from the registry", extra={"learner": lid})
        if self.coordinator:
            self.check_region_minimums()

    def check_region_minimums(self) -> None:
        """Say when a region has fewer live learners than regions[].min_learners, and when it is back."""
        live = Counter(self.cfg.region_of(lid).name for lid in self.live())
        for r in self.cfg.regions:
            n = live[r.name]
            below = n < r.min_learners
            if below != self.below_min.get(r.name, False):
                self.below_min[r.name] = below
                self.emit("region_below_min" if below else "region_at_min", region=r.name, live=n,
                          min_learners=r.min_learners)
                (log.warning if below else log.info)("region below min_learners" if below else "region back at min_learners",
                                                     extra={"region": r.name, "live": n, "min_learners": r.min_learners})

    def live(self) -> set[str]:
        """Learners worth waiting for: heard from recently and not finished, or not heard from yet."""
        return {lid for lid in self.members if lid not in self.beats or self.beats[lid]["status"] == "alive"}

    def present(self) -> set[str]:
        """Learners still in the run: all but those that left (SIGTERM) or were dropped. A silent one
        may come back; a finished one's last rounds close at the final flush."""
        return {lid for lid in self.members
                if lid not in self.beats or self.beats[lid]["status"] not in ("left", "dropped")}

    def step_time_s(self) -> float:
        """The median step time the live learners report (0 before any has said)."""
        times = [hb["step_time"] for hb in self.beats.values() if hb.get("step_time") and hb["status"] == "alive"]
        return float(np.median(times)) if times else 0.0

    def by_status(self) -> dict[str, int]:
        """How many learners are in each of STATUSES (zero included)."""
        return {s: 0 for s in STATUSES} | Counter(hb["status"] for hb in self.beats.values())
