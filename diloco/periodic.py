"""The one helper for periodic work: the syncer's (saving offsets, pruning statuses, liveness, leases,
gauges), the run supervisor's hooks (the progress line, the flows' region states): each task asks its
own `Every` whether it is due."""

from __future__ import annotations


class Every:
    """A periodic task's clock: `due()` is true at most once per `period_s` of `clock`, or of the
    times the caller passes (the first call always), replacing a hand-kept "last time" per task."""

    def __init__(self, period_s: float, clock=None):
        self.period_s, self.clock = period_s, clock
        self.last: float | None = None

    def due(self, now: float | None = None, *, force: bool = False) -> bool:
        """`now`: the caller's time (a loop that reads the clock once per pass); None: read `clock`."""
        now = self.clock() if now is None else now
        if not force and self.last is not None and now - self.last < self.period_s:
            return False
        self.last = now
        return True

    def reset(self) -> None:
        self.last = None
