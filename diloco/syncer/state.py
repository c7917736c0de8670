"""Redis adapter for the syncer's durable control state.

Keys, all under `<key_prefix>:<run>:`:
    version          hash  fragment -> current global version
    round:<p>        hash  contribution id -> JSON meta of a pending contribution (arrival time, offsets...)
    status           hash  contribution id -> "pending:<p>" | "applied:<p>:<v>" | "rejected:<reason>"
    offsets          hash  "<topic>|<partition>" -> next offset to read on restart
    counters         hash  accepted, applied, late, rejected, rejected:<reason>, duplicates, merges
    merges           list  JSON record per merge (fragment, version, contribution ids, tokens)
    registry         hash  learner -> JSON (last heartbeat, step, tokens, step time)
    stats            hash  sync_time_s and other measured figures
    outbox           list  JSON {topic, partition, value} records to publish (transactional outbox)

Every state change that consumed Kafka records writes the replay offsets in the same MULTI/EXEC,
so a restarted syncer replays exactly the records whose effects are not yet durable. The events and
announcements a change produces go into the outbox in that same transaction and are relayed to
Kafka afterwards, so a crash can repeat them (readers dedupe) but never lose them. A merge commit
WATCHes the fragment's version, so a second syncer holding a stale view cannot commit over it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import redis
from redis.exceptions import AuthenticationError, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from diloco.config import StateConfig, resolve_secret

log = logging.getLogger(__name__)


class StateError(RuntimeError):
    pass


class StaleVersion(StateError):
    """The fragment's version moved under us: another syncer committed first."""


@dataclass
class Snapshot:
    versions: dict[int, int]
    rounds: dict[int, dict[str, dict]]
    status: dict[str, str]
    offsets: dict[tuple[str, int], int]
    counters: dict[str, int]
    stats: dict[str, float] = field(default_factory=dict)


def connect(cfg: StateConfig, timeout_s: float = 20.0) -> redis.Redis:
    """A Redis client for the config's URL and ACL credentials, once the server answers."""
    r = redis.Redis.from_url(cfg.redis_url, username=cfg.username,
                             password=resolve_secret(cfg.password_env, "state.password_env"),
                             socket_timeout=10, socket_connect_timeout=5, decode_responses=True)
    wait_until_up(r, cfg.redis_url, timeout_s)
    return r


def wait_until_up(r: redis.Redis, url: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    delay = 0.2
    while True:
        try:
            r.ping()
            return
        except AuthenticationError:  # redis-py says the same for a missing and for a wrong password
            if r.connection_pool.connection_kwargs.get("password") is None:
                raise StateError(f"Redis at {url} requires a password: set state.password_env") from None
            raise StateError(f"Redis at {url} refused the credentials (state.username / state.password_env)") from None
        except (RedisConnectionError, RedisTimeoutError) as err:
            if time.time() > deadline:
                raise StateError(f"Redis not reachable at {url} ({err.__class__.__name__}); "
                                 "start the local stack with `diloco infra up` or set state.redis_url") from None
            log.warning("redis not reachable, retrying", extra={"url": url, "retry_in_s": delay})
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _offset_key(tp: tuple[str, int]) -> str:
    return f"{tp[0]}|{tp[1]}"


class SyncerState:
    def __init__(self, r: redis.Redis, key_prefix: str, run_id: str):
        self.r = r
        self.k = f"{key_prefix}:{run_id}:"

    # --- reads -------------------------------------------------------------------------------
    def snapshot(self, fragments: int) -> Snapshot:
        versions = {int(p): int(v) for p, v in self.r.hgetall(self.k + "version").items()}
        rounds = {p: {cid: json.loads(m) for cid, m in self.r.hgetall(f"{self.k}round:{p}").items()}
                  for p in range(fragments)}
        offsets = {}
        for key, off in self.r.hgetall(self.k + "offsets").items():
            topic, part = key.rsplit("|", 1)
            offsets[(topic, int(part))] = int(off)
        return Snapshot(versions, rounds, self.r.hgetall(self.k + "status"), offsets, self.counters(),
                        {k: float(v) for k, v in self.r.hgetall(self.k + "stats").items()})

    def versions(self) -> dict[int, int]:
        return {int(p): int(v) for p, v in self.r.hgetall(self.k + "version").items()}

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.r.hgetall(self.k + "counters").items()}

    def merges(self) -> list[dict]:
        return [json.loads(m) for m in self.r.lrange(self.k + "merges", 0, -1)]

    def registry(self) -> dict[str, dict]:
        return {k: json.loads(v) for k, v in self.r.hgetall(self.k + "registry").items()}

    def status_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.r.hvals(self.k + "status"):
            kind = s.split(":", 1)[0]
            out[kind] = out.get(kind, 0) + 1
        return out

    # --- writes ------------------------------------------------------------------------------
    def init_versions(self, fragments: int) -> bool:
        """Set every fragment to version 0 unless the run already exists. True if it was new."""
        created = [self.r.hsetnx(self.k + "version", str(p), 0) for p in range(fragments)]
        return all(created)

    def accept(self, fragment: int, cid: str, meta: dict, offsets: dict[tuple[str, int], int],
               outbox: list[dict] = ()) -> None:
        with self.r.pipeline(transaction=True) as p:
            p.hset(f"{self.k}round:{fragment}", cid, json.dumps(meta))
            p.hset(self.k + "status", cid, f"pending:{fragment}")
            p.hincrby(self.k + "counters", "accepted", 1)
            self._offsets(p, offsets)
            self._outbox(p, outbox)
            p.execute()

    def reject(self, cid: str | None, reason: str, offsets: dict[tuple[str, int], int],
               fragment: int | None = None, outbox: list[dict] = ()) -> None:
        """Record a rejection; `cid` None for a record that names no contribution."""
        with self.r.pipeline(transaction=True) as p:
            if cid is not None:
                p.hset(self.k + "status", cid, f"rejected:{reason}")
                if fragment is not None:
                    p.hdel(f"{self.k}round:{fragment}", cid)
            p.hincrby(self.k + "counters", "rejected" if cid is not None else "rejected_records", 1)
            p.hincrby(self.k + "counters", f"rejected:{reason}", 1)
            self._offsets(p, offsets)
            self._outbox(p, outbox)
            p.execute()

    def count(self, name: str, n: int = 1) -> None:
        self.r.hincrby(self.k + "counters", name, n)

    def save_offsets(self, offsets: dict[tuple[str, int], int]) -> None:
        if offsets:
            with self.r.pipeline(transaction=True) as p:
                self._offsets(p, offsets)
                p.execute()

    def commit_merge(self, fragment: int, *, from_version: int, ids: list[str], late: int, record: dict,
                     offsets: dict[tuple[str, int], int], sync_time_s: float, outbox: list[dict] = ()) -> None:
        """Atomically: bump the version, mark ids applied, clear them from the round, store offsets."""
        vkey = self.k + "version"
        with self.r.pipeline(transaction=True) as p:
            try:
                p.watch(vkey)
                current = int(p.hget(vkey, str(fragment)))
                if current != from_version:
                    raise StaleVersion(f"fragment {fragment} is at version {current}, merge was built on {from_version}")
                p.multi()
                p.hset(vkey, str(fragment), from_version + 1)
                if ids:
                    p.hdel(f"{self.k}round:{fragment}", *ids)
                    p.hset(self.k + "status", mapping={cid: f"applied:{fragment}:{from_version + 1}" for cid in ids})
                p.hincrby(self.k + "counters", "applied", len(ids))
                p.hincrby(self.k + "counters", "late", late)
                p.hincrby(self.k + "counters", "merges", 1)
                p.rpush(self.k + "merges", json.dumps(record))
                p.hset(self.k + "stats", "sync_time_s", sync_time_s)
                self._offsets(p, offsets)
                self._outbox(p, outbox)
                p.execute()
            except WatchError:
                raise StaleVersion(f"fragment {fragment} changed during the merge commit") from None

    def heartbeat(self, learner: str, info: dict) -> None:
        self.r.hset(self.k + "registry", learner, json.dumps(info))

    def drop_learner(self, learner: str) -> None:
        self.r.hdel(self.k + "registry", learner)

    def outbox_peek(self, n: int = 500) -> list[dict]:
        return [json.loads(e) for e in self.r.lrange(self.k + "outbox", 0, n - 1)]

    def outbox_trim(self, n: int) -> None:
        """Drop the first n outbox records once Kafka acknowledged them."""
        self.r.ltrim(self.k + "outbox", n, -1)

    def _outbox(self, p, records: list[dict]) -> None:
        if records:
            p.rpush(self.k + "outbox", *(json.dumps(r) for r in records))

    def _offsets(self, p, offsets: dict[tuple[str, int], int]) -> None:
        if offsets:
            p.hset(self.k + "offsets", mapping={_offset_key(tp): off for tp, off in offsets.items()})
