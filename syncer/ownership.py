"""Ownership of fragments among syncer shards: a shard's membership, the leases and fencing epochs of
the fragments it holds, and the lease keeper that renews them on a thread of its own. Which fragments
a shard wants is a pure function (syncer/shards.py); claiming, renewing and releasing are Redis
transactions (syncer/state.py); loading or forgetting a fragment's state is the syncer's."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from diloco.infra.state import ServiceError
from diloco.syncer import shards as shards_mod
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
        except (ServiceError, RuntimeError) as err:  # an outage (the main loop recovers) or epochs changed mid-copy
            log.debug("lease renewal skipped: %s", type(err).__name__)

    def halt(self) -> None:
        self._halt.set()


class Ownership:
    """One shard's place among the syncer shards: its membership (`member`, unique per process), the
    fencing epoch of each fragment it holds a lease on (`epochs`), and its lease keeper. `moves` asks
    Redis which shards are live and says what to drop, release and claim (syncer/shards.py)."""

    def __init__(self, state: SyncerState, shard: int, shards: int, fragments: int, ttl_s: float,
                 stuck_after_s: float, clock: Callable[[], float] = time.time):
        self.state, self.shard, self.shards, self.fragments, self.clock = state, shard, shards, fragments, clock
        self.member, self.ttl_s, self.stuck_after_s = f"{shard}:{uuid.uuid4().hex[:12]}", ttl_s, stuck_after_s
        self.epochs: dict[int, int] = {}
        self.started_at = clock()
        self.keeper = self._keeper()

    def _keeper(self) -> LeaseKeeper:
        return LeaseKeeper(self.state, self.shard, self.member, self.ttl_s, lambda: list(self.epochs),
                           self.stuck_after_s)

    def fence(self, p: int) -> dict[int, int]:
        """The fence of a Redis write about fragment p: it fails once another shard holds a newer epoch."""
        return {p: self.epochs[p]}

    def start(self, stopping: Callable[[], bool]) -> None:
        """Stand by while another live process is this shard, then renew on the keeper's thread."""
        self.epochs = {}
        self.stand_by(stopping)
        if not self.keeper.is_alive():
            self.keeper = self._keeper()
            self.keeper.start()
        self.started_at = self.clock()

    def stand_by(self, stopping: Callable[[], bool]) -> None:
        """Wait while another live process is this shard (two would take fragments from each other)."""
        said = False
        while (holder := self.state.join(self.shard, self.member, self.ttl_s)) is not None:
            if not said:
                log.warning("shard %d already runs as %s; standing by until it stops", self.shard, holder,
                            extra={"shard": self.shard, "holder": holder})
                said = True
            if stopping():
                raise SystemExit(0)
            time.sleep(self.ttl_s / 3)
        self.keeper.displaced = False

    def moves(self, *, claiming: bool) -> shards_mod.Moves | None:
        """Renew now, then what to drop, release and claim; None when another process took over this
        shard (this one stalled past its TTL): then everything held is to be handed back."""
        self.keeper.alive_at = time.monotonic()
        self.keeper.renew()                # the keeper's thread does the same between steps
        if self.keeper.displaced:
            return None
        lost, self.keeper.lost = self.keeper.lost, set()
        return shards_mod.moves(self.shard, self.fragments, self.shards, self.state.live_shards(self.shards),
                                set(self.epochs), lost, claiming=claiming,
                                settled=self.clock() - self.started_at >= self.ttl_s)

    def claim(self, candidates: list[int]) -> list[tuple[int, int, str | None]]:
        """(fragment, epoch, previous owner) of each of `candidates` whose lease was free: held now."""
        taken = [(p, *self.state.claim(p, self.shard, self.member, self.ttl_s)) for p in candidates]
        taken = [(p, epoch, previous) for p, epoch, previous in taken if epoch]
        self.epochs |= {p: epoch for p, epoch, _ in taken}
        return taken

    def release(self, p: int) -> None:
        self.state.release(p, self.member)

    def forget(self, p: int) -> None:
        self.epochs.pop(p, None)

    def leave(self, *, release: bool = False) -> None:
        """Stop renewing and leave the membership; with `release`, hand every lease over at once rather
        than after it times out. Redis away: the membership and leases lapse after their TTL."""
        self.keeper.halt()
        try:
            for p in list(self.epochs) if release else ():
                self.state.release(p, self.member)
            self.state.leave(self.shard, self.member)
        except ServiceError:
            if release:
                raise
