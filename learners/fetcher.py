"""The fetcher thread: a learner's new global versions, read from TensorStore as they are announced
on the outer topic (learners/session.py applies them)."""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np
from kafka import TopicPartition

from diloco import messages, quantize
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore, Link, StoreError
from diloco.learners.publisher import Counters
from diloco.plan import Plan, Region, is_whole, whole

log = logging.getLogger(__name__)


class Fetched:
    """A version of a fragment as the fetcher brought it, and the bytes read. A host holding whole
    tensors gets what the version is made of: `base`'s arrays (a version the fetcher holds, shared
    with it) with `update` (each tensor's code in `scheme`) applied, or `base` itself when `update`
    is None. A learner decodes the update on its devices and keeps its anchors as that
    (learners/outer.py); `whole` and `blocks` decode it on the host, once, for whoever needs the
    values there. A host holding parts of tensors gets its `blocks` as read."""

    def __init__(self, nbytes: int, *, blocks: dict[str, dict[Region, np.ndarray]] | None = None,
                 base: dict[str, np.ndarray] | None = None, update: dict[str, bytes] | None = None,
                 scheme: str | None = None, whole: dict[str, np.ndarray] | None = None):
        self.nbytes, self.base, self.update, self.scheme = nbytes, base, update, scheme
        self._blocks, self._whole = blocks, whole

    @property
    def whole(self) -> dict[str, np.ndarray] | None:
        """The version's whole arrays (None for a host holding parts), decoded on the host when asked."""
        if self._whole is None and self.base is not None:
            self._whole = self.base if self.update is None else quantize.apply_update(self.base, self.update, self.scheme)
        return self._whole

    @property
    def blocks(self) -> dict[str, dict[Region, np.ndarray]]:
        """This host's blocks of each tensor (plan.regions)."""
        if self._blocks is None:
            return {n: {whole(a.shape): a} for n, a in self.whole.items()}
        return self._blocks

    def made_of(self) -> dict[str, tuple[np.ndarray, quantize.Coded | None]]:
        """Per tensor (base array, update code or None); empty for a host holding parts."""
        if self.base is None:
            return {}
        if self.update is None:
            return {n: (a, None) for n, a in self.base.items()}
        return {n: (a, quantize.Coded(a.shape, self.scheme, self.update[n])) for n, a in self.base.items()}

    def held_nbytes(self, seen: set[int]) -> int:
        """Host bytes it holds, the arrays in `seen` (by id) not counted again; adds its own to `seen`."""
        total = sum(len(b) for b in (self.update or {}).values())
        for arrays in (self.base, self._whole, *(self._blocks or {}).values()):
            for a in (arrays or {}).values():
                if id(a) not in seen:
                    seen.add(id(a))
                    total += a.nbytes
        return total


class Fetcher(threading.Thread):
    """Follows the outer topic; brings a fragment's newest announced version from TensorStore when
    the learner asks for it (`need`: with fragments.fetch=before_sync, shortly before it syncs the
    fragment), at the join, or, with every_version, each announced version. Only this host's blocks
    of each tensor are read (`want`). A host that holds whole tensors keeps the newest snapshot it
    reached: every update is relative to a snapshot (infra.store), so one update brings it to any
    later version until the next snapshot, and the path of fewest bytes (updates from what it holds,
    or a stored snapshot and its update) is read. The newest `keep` fetched versions of each fragment
    wait until the learner applies one (`ready_now`, `release`), each saying what it is made of (the
    snapshot and the update: the learner keeps its anchors as that, learners/outer.py). Host memory:
    the newest snapshot of each fragment and the versions waiting to be applied (and, with updates
    from the previous version (syncer.update_base=previous), the newest version's values, their base).
    """

    MAX_ATTEMPTS = 20  # reads of one announced version before the fetcher gives up on it
    MAX_LINKS = 64     # updates followed back from a version before reading a snapshot whole instead

    def __init__(self, cfg: Config, run_id: str, consumer, store: FragmentStore, topics: kafka_io.Topics,
                 counters: Counters, plan: Plan, keep: int = 1):
        super().__init__(daemon=True, name="fetcher")
        self.cfg, self.run_id, self.consumer, self.store = cfg, run_id, consumer, store
        self.topics, self.counters, self.plan, self.keep = topics, counters, plan, keep
        self.blocks: dict[str, list[Region]] = {}
        self.wanted = threading.Event()
        self.held: dict[int, tuple[int, dict[str, np.ndarray] | None]] = {}  # newest fetched (whole: its exact global)
        self.snapshots: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # newest snapshot reached (whole only)
        self.ready: dict[int, dict[int, Fetched]] = {}
        self.markers: dict[int, int] = {}  # fragment -> its commit marker, as last read
        self.announced: dict[int, int] = {}  # fragment -> the newest version announced (versions behind)
        self.newest: dict[int, int] = {}     # fragment -> the newest version that may be committed
        self.needed: set[int] = set()        # fragments the learner asked for: the newest, once
        # fragment -> (a version announced but not committed when fetched, when to look at the marker again)
        self.unconfirmed: dict[int, tuple[int, float]] = {}
        self.applied: set[int] = set()       # fragments the learner applied a version of (joined)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def want(self, blocks: dict[str, list[Region]]) -> None:
        """Read these blocks of each tensor (this host's); fetching starts once this is known."""
        self.blocks = blocks
        held = sum(math.prod(b - a for a, b in r) for rs in blocks.values() for r in rs)
        log.info("fetching this host's blocks", extra={"share": round(held / max(self.plan.num_params, 1), 4)})
        self.wanted.set()

    def need(self, p: int) -> None:
        """Fetch fragment p's newest version (if newer than the one held) for the learner to apply."""
        with self.lock:
            self.needed.add(p)

    def run(self) -> None:
        tp = TopicPartition(self.topics.outer, 0)
        kafka_io.assign_from(self.consumer, {tp: 0})  # the whole log: its last word per fragment wins
        tries: dict[int, list] = {}  # fragment -> [version, attempts, retry at] of a fetch that failed
        try:
            while not self.stop.is_set():
                for records in self.consumer.poll(timeout_ms=100).values():
                    for rec in records:
                        self._take(rec.value)
                now = time.monotonic()
                self._confirm(now)
                for p, v in self._due() if self.wanted.is_set() else ():
                    entry = tries.get(p)
                    if entry and entry[0] == v and entry[2] > now:
                        continue
                    try:
                        got = self.fetch(p, v)
                    except (StoreError, quantize.CodecError, OSError, ValueError, KeyError) as err:
                        if self._not_committed_yet(p, v):
                            continue  # the newest committed version now; v once the store commits it
                        # transient (the store is slow or away) or a version that is not there: try
                        # again with backoff; a newer announcement replaces it meanwhile
                        entry = tries[p] = entry if entry and entry[0] == v else [v, 0, 0.0]
                        entry[1] += 1
                        entry[2] = now + min(0.5 * 2 ** entry[1], 10.0)
                        log.warning("fetch of fragment %d v%d failed (attempt %d): %s", p, v, entry[1],
                                    messages.bounded(str(err), 200))
                        if entry[1] >= self.MAX_ATTEMPTS:
                            log.error("giving up on fragment %d v%d after %d attempts", p, v, entry[1])
                            self.newest[p] = self.held.get(p, (-1,))[0]  # until a newer one is announced
                            del tries[p]
                        continue
                    tries.pop(p, None)
                    # with updates from the snapshot the newest version's values are never a base again:
                    # hold its number, and its values only until the learner applies them (ready)
                    self.held[p] = (v, got.whole if self.cfg.syncer.updates_from == "previous" else None)
                    with self.lock:
                        self.needed.discard(p)
                        ready = self.ready.setdefault(p, {})
                        ready[v] = got
                        for old in sorted(ready)[:-self.keep]:
                            del ready[old]
                    with self.counters.lock:
                        self.counters.bytes_fetched += got.nbytes
                        self.counters.fetched_by_fragment[p] = self.counters.fetched_by_fragment.get(p, 0) + got.nbytes
        except BaseException as err:
            self.error = err
            log.exception("fetch failed")
        finally:
            self.consumer.close()

    def _take(self, raw: bytes) -> None:
        """Note one record of the outer topic: the newest version of its fragment."""
        p, v = self._announced(raw)
        if p is not None:
            self.announced[p] = max(self.announced.get(p, v), v)
            if v > self.newest.get(p, -1) and self._may_be_committed(p, v):
                self.newest[p] = v

    def _due(self) -> list[tuple[int, int]]:
        """(fragment, version) of each fetch to make now: the newest version of each fragment the
        learner will apply (fragments.fetch)."""
        out = []
        with self.lock:
            for p, v in sorted(self.newest.items()):
                held = self.held.get(p, (-1,))[0]
                if v <= held:
                    continue
                if (p not in self.applied or p in self.needed or self.cfg.fragments.fetch == "every_version"
                        or self.ready.get(p)):  # one fetched and not applied yet: the hosts must find a common one
                    out.append((p, v))
        return out

    def _announced(self, raw: bytes) -> tuple[int | None, int]:
        """(fragment, version) of a well-formed announcement of this run, else (None, -1): a bad
        record on the outer topic is skipped with a warning, never fatal."""
        ev = messages.parse_event(raw)
        if not ev or ev["kind"] != "version" or ev.get("run") != self.run_id:
            return None, -1
        p, v = ev.get("fragment"), ev.get("version")
        if not (messages.is_count(p) and messages.is_count(v) and 0 <= p < self.plan.fragments
                and 0 <= v < messages.MAX_COUNT):
            log.warning("announcement ignored: fragment %s version %s", messages.short(p, 40), messages.short(v, 40))
            return None, -1
        return p, v

    def _may_be_committed(self, p: int, v: int) -> bool:
        """Whether v can be a committed version of fragment p: at most one past the store's commit
        marker (the owner moves it right after Redis commits; the announcement may be relayed first).
        One beyond that (a forged or stray record) is ignored: waiting for it would hold back every
        real version of the fragment. The marker is read only when an announcement outruns it."""
        if v <= self.markers.get(p, -1) + 1:
            return True
        try:
            marker = self.store.read_committed(p)
        except (StoreError, OSError, ValueError):
            return True                        # cannot tell now: the fetch decides
        if marker is None:
            return True                        # not marked yet (provisioning marks version 0 before announcing it)
        self.markers[p] = marker
        if v <= marker + 1:
            return True
        log.warning("announcement ignored: fragment %d v%d is not committed (the store's commit marker says v%d)",
                    p, v, marker)
        return False

    def _not_committed_yet(self, p: int, v: int) -> bool:
        """After a failed fetch of v: whether the store's commit marker is below it (an announcement
        relayed before the marker moved, or a forged one at marker + 1). Then the fragment's newest
        committed version is fetched now instead of chasing v, and v is taken once the marker
        reaches it (_confirm): a joining learner never waits on a version that may never exist."""
        try:
            marker = self.store.read_committed(p)
        except (StoreError, OSError, ValueError):
            return False
        if marker is None or marker >= v:
            return False
        log.warning("fragment %d v%d is announced but not committed (the store's marker says v%d): "
                    "fetching v%d meanwhile", p, v, marker, marker)
        self.markers[p] = marker
        self.unconfirmed[p] = (max(self.unconfirmed.get(p, (v,))[0], v), 0.0)
        self.newest[p] = marker
        return True

    def _confirm(self, now: float) -> None:
        """Take each announced version that was not committed yet once the store's marker reaches it
        (checked once a second per fragment); a newer announcement makes it moot."""
        for p, (v, next_check) in list(self.unconfirmed.items()):
            if self.newest.get(p, -1) >= v:
                del self.unconfirmed[p]
            elif now >= next_check:
                try:
                    marker = self.store.read_committed(p)
                except (StoreError, OSError, ValueError):
                    marker = None
                if marker is not None and marker >= v:
                    self.newest[p] = v
                    del self.unconfirmed[p]
                else:
                    self.unconfirmed[p] = (v, now + 1.0)

    def fetch(self, p: int, v: int) -> Fetched:
        """This host's blocks of version v of fragment p."""
        names = self.plan.fragment_names[p]
        shapes = self.plan.shapes
        if not all(is_whole(self.blocks[n], shapes[n]) for n in names):
            blocks = self.store.read_blocks(p, v, {n: self.blocks[n] for n in names})
            return Fetched(sum(a.nbytes for b in blocks.values() for a in b.values()), blocks=blocks)
        return self._fetch_whole(p, v)

    def _fetch_whole(self, p: int, v: int) -> Fetched:
        """Version v's whole arrays by the path of fewest bytes: its chain of updates (each relative
        to a snapshot) back to a version this host holds, or a stored snapshot on that chain read
        whole and the updates after it. Says what the version is made of: its last link, which is
        left to the learner to decode unless the fetcher keeps the version's values (a snapshot, or
        updates from the previous version)."""
        have = {u: a for u, a in (self.held.get(p, (-1, None)), self.snapshots.get(p, (-1, None))) if a is not None}
        names = self.plan.fragment_names[p]
        whole_bytes = sum(self.plan.by_name[n].size * self.plan.by_name[n].np_dtype.itemsize for n in names)
        chain = self.store.path(p, v, held=have.keys(), limit=self.MAX_LINKS)  # from v back, none of them held
        u = chain[-1].base if chain else v  # the held version it starts from, if it reached one

        # choices: start from what is held (every link's update), or read chain[i] whole (a snapshot)
        # and apply the links after it
        options = []
        if u in have:
            options.append((sum(link.update_nbytes for link in chain), len(chain)))
        for i, link in enumerate(chain):
            if link.snapshot:
                options.append((whole_bytes + sum(later.update_nbytes for later in chain[:i]), i))
        if not options:  # nothing held nor stored whole within reach: the store walks it
            params, nbytes = self.store.read_params(p, v)
            return Fetched(nbytes, base=params)
        _, start = min(options)
        if start == len(chain):
            params, nbytes = have[u], 0
        else:
            params, nbytes = self.store.read_params(p, chain[start].version, chain[start].meta)
            self._reached(p, chain[start], params)
        got = Fetched(nbytes, base=params)
        for link in reversed(chain[:start]):
            scheme, update, read = self.store.read_update(p, link.version, link.meta)
            got = Fetched(got.nbytes + read, base=got.whole, update=update, scheme=scheme)
            if link.snapshot:  # the base of later versions: its values, decoded here
                self._reached(p, link, got.whole)
        return got

    def _reached(self, p: int, link: Link, arrays: dict[str, np.ndarray]) -> None:
        if link.snapshot and link.version > self.snapshots.get(p, (-1,))[0]:
            self.snapshots[p] = (link.version, arrays)

    def start_from(self, p: int, v: int, arrays: dict[str, np.ndarray], *, ready: bool = True) -> None:
        """Hold version v of fragment p (a snapshot: version 0) as `arrays` (whole, exact) without
        reading it, as the base newer versions are caught up from; with `ready`, offer it to the
        learner too. Call before `want`."""
        self.held[p] = self.snapshots[p] = (v, arrays)
        if ready:
            with self.lock:
                self.ready.setdefault(p, {})[v] = Fetched(0, base=arrays)

    def ready_now(self) -> dict[int, dict[int, Fetched]]:
        """The fetched versions of each fragment waiting to be applied, as they are now (a newer
        arrival may drop one from the fetcher meanwhile; this copy keeps it)."""
        with self.lock:
            return {p: dict(r) for p, r in self.ready.items() if r}

    def release(self, p: int, v: int) -> None:
        """Version v of fragment p was applied: drop it and every older one."""
        with self.lock:
            self.applied.add(p)
            ready = self.ready.get(p, {})
            for old in [u for u in ready if u <= v]:
                del ready[old]
