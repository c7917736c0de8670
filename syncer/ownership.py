"""Ownership of fragments among syncer shards: the lease keeper that renews a shard's membership and
leases on a thread of its own. Which fragments a shard wants (home shard, live shards) is
syncer/shards.py; claiming, fencing epochs and release are Redis transactions in syncer/state.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from diloco.syncer.state import SyncerState

log = logging.getLogger(__name__)


class LeaseKeeper(threading.Thread):
    """Renews a shard's membership and the leases of its fragments every third of the TTL, on a thread
    of its own, so that a long step (a big merge, a slow store write, a replay) does not lose them.

    It stops renewing once the main loop has shown no progress for `stuck_after_s`, so a wedged process
    still hands its fragments over; a paused process pauses this thread too. What it could not renew
    is in `lost`, which the main loop drops; `displaced` says another live process is this shard now.
    """

    def __init__(self, state: SyncerState, shard: int, member: str, ttl_s: float, owned: Callable[[], list[int]],
                 stuck_after_s: float):
        super().__init__(daemon=True, name=f"lease-keeper-{shard}")
        self.state, self.shard, self.member, self.ttl_s, self.owned = state, shard, member, ttl_s, owned
        self.stuck_after_s = stuck_after_s
        self.lost: set[int] = set()
        self.displaced = False
        self.alive_at = time.monotonic()   # the main loop's last sign of progress
        self._halt = threading.Event()
        self._stuck = False

    def run(self) -> None:
        while not self._halt.wait(self.ttl_s / 3):
            self.renew()

    def renew(self) -> None:
        stuck = time.monotonic() - self.alive_at > self.stuck_after_s
        if stuck != self._stuck:
            (log.error if stuck else log.warning)(
                "main loop stuck; leases left to expire" if stuck else "main loop moving again",
                extra={"shard": self.shard, "stuck_after_s": self.stuck_after_s})
        self._stuck = stuck
        if stuck:
            return
        try:
            if self.state.join(self.shard, self.member, self.ttl_s) is not None:
                self.displaced = True
            for p in self.owned():
                if not self.state.renew(p, self.member, self.ttl_s):
                    self.lost.add(p)
        except (RedisError, RuntimeError) as err:  # an outage (the main loop recovers) or epochs changed mid-copy
            log.debug("lease renewal skipped: %s", type(err).__name__)

    def halt(self) -> None:
        self._halt.set()
