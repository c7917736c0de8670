"""Redis adapter for the syncer's durable control state.

Keys, all under `<key_prefix>:{<run>}:` (run_prefix builds it; add a key as `self.k + name`):
    version          hash  fragment -> current global version
    round:<p>        hash  contribution id -> JSON meta of a pending contribution (arrival time, offsets...)
    status           hash  contribution id -> "pending:<p>" | "applied:<p>:<v>" | "rejected:<reason>"
    finished:<t>|<n> zset  finished ids from partition n of topic t by first offset (see prune_statuses)
    offsets          hash  "<topic>|<partition>" -> next offset to read on restart (fragment partitions)
    events_offset    hash  shard -> next offset of the events topic that shard reads
    lease:<p>        string "<shard>:<incarnation>" of the fragment's owner, with a TTL the owner renews
    owner:<p>        string the last owner to claim it (kept after its lease expires)
    epoch:<p>        int   the fragment's fencing token: bumped by every claim, checked by every write
    member:<shard>   string the shard's incarnation, with a TTL: the shard is live while it exists
    counters         hash  accepted, applied, late, rejected, rejected:<reason>, duplicates, merges
    merges           list  JSON record per merge (fragment, version, contribution ids, tokens)
    registry         hash  learner -> JSON (last heartbeat, step, tokens, step time)
    members          hash  learner -> JSON {region, shard, time} of each learner admitted after the start
    stats            hash  sync_time_s and other measured figures
    outbox           list  JSON {topic, partition, value} records to publish (transactional outbox)
    deadletter       list  outbox records the broker refused for good (newest 1000), with why

The braces are a Redis Cluster hash tag: only `<run>` is hashed, so all of a run's keys share one slot,
as MULTI/EXEC with WATCH, the multi-key scripts below and MGET need on a cluster (`state.cluster`).
A cluster spreads runs over its nodes; the keys of one run stay on one node.

Every state change that consumed Kafka records writes the replay offsets in the same MULTI/EXEC,
so a restarted syncer replays exactly the records whose effects are not yet durable. The events and
announcements a change produces go into the outbox in that same transaction and are relayed to
Kafka afterwards, so a crash can repeat them (readers dedupe) but never lose them.

Ownership: a syncer shard owns a fragment while it holds `lease:<p>`; claiming it bumps `epoch:<p>`.
Every write about a fragment WATCHes that epoch and checks it is still the writer's, so a stale
owner (one whose lease expired while it was paused, say) has its writes refused with `Fenced`; a
merge commit also WATCHes the fragment's version.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError, RedisClusterException, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from diloco.config import StateConfig, redact_url, resolve_secret
from diloco.infra.services import up_hint
from diloco.syncer.records import TP, Status, Where, parse_partition_key, partition_key, rejection_counter

log = logging.getLogger(__name__)


class StateError(RuntimeError):
    pass


class StaleVersion(StateError):
    """The fragment's version moved under us: another syncer committed first."""


class Fenced(StaleVersion):
    """This syncer no longer owns the fragment: another shard claimed it (a newer epoch)."""

    def __init__(self, fragment: int, detail: str):
        super().__init__(f"fragment {fragment}: {detail}")
        self.fragment = fragment


# Claim a fragment if its lease is free or held by an earlier incarnation of the same shard (which is
# dead or about to be fenced); returns {new epoch, previous owner}, or {0, holder} if another shard holds it.
_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur and string.match(cur, '^[^:]+') ~= ARGV[2] then return {0, cur} end
local previous = redis.call('GET', KEYS[3]) or ''
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[3], ARGV[1])
return {redis.call('INCR', KEYS[2]), previous}
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# A shard's membership: taken if free or already this process's, so two live processes of one shard
# do not take fragments from each other (the second stands by); returns the holder when refused.
_JOIN = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ''
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Several shards relay the one outbox: trim only if the head is still what this relayer sent, so a
# race repeats records (readers dedupe) and never drops one.
_TRIM_IF_HEAD = """
if redis.call('LINDEX', KEYS[1], 0) == ARGV[1] then redis.call('LTRIM', KEYS[1], tonumber(ARGV[2]), -1) return 1 end
return 0
"""


def connect(cfg: StateConfig, timeout_s: float | None = None) -> redis.Redis | RedisCluster:
    """A client for the config's URL and ACL credentials, once the server answers (within `timeout_s`,
    default state.connect_timeout_s). With state.cluster it is a cluster client: the URL names any one
    node and the client finds the others."""
    kind = RedisCluster if cfg.cluster else redis.Redis
    password = resolve_secret(cfg.password_env, "state.password_env")

    def attempt():
        r = kind.from_url(cfg.redis_url, username=cfg.username, password=password,
                          socket_timeout=10, socket_connect_timeout=5, decode_responses=True)
        r.ping()
        return r
    return wait_until_up(attempt, cfg, cfg.connect_timeout_s if timeout_s is None else timeout_s)


def wait_until_up(attempt, cfg: StateConfig, timeout_s: float):
    """attempt() (a ping, say) once Redis answers it, retried with backoff for up to timeout_s."""
    url = redact_url(cfg.redis_url)  # only for the messages
    deadline = time.time() + timeout_s
    delay = 0.2
    while True:
        try:
            return attempt()
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException) as err:
            # the cluster client raises its own exception, caused by what the nodes it tried said
            why = err.__cause__ if isinstance(err, RedisClusterException) else err
            if isinstance(why, AuthenticationError):  # redis-py says the same for a missing and for a wrong password
                if cfg.password_env is None:
                    raise StateError(f"Redis at {url} requires a password: set state.password_env") from None
                raise StateError(f"Redis at {url} refused the credentials (state.username / state.password_env)") from None
            if not isinstance(why, (RedisConnectionError, RedisTimeoutError)):
                raise StateError(f"state.redis_url {url} (state.cluster: {cfg.cluster}): {err}") from None
            if time.time() > deadline:
                raise StateError(f"Redis not reachable at {url} ({why.__class__.__name__}); "
                                 + up_hint("state.redis_url")) from None
            log.warning("redis not reachable, retrying", extra={"url": url, "retry_in_s": delay})
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


Fence = Mapping[int, int] | None  # fragment -> the epoch the writer holds


def run_prefix(key_prefix: str, run_id: str) -> str:
    """What every key of the run starts with: `<key_prefix>:{<run>}:`, the run as the hash tag."""
    return f"{key_prefix}:{{{run_id}}}:"


class SyncerState:
    def __init__(self, r: redis.Redis | RedisCluster, key_prefix: str, run_id: str):
        self.r = r
        self.outbox_writes = 0   # transactions of this process that wrote to the outbox
        self.k = run_prefix(key_prefix, run_id)

    # --- reads -------------------------------------------------------------------------------
    def version(self, fragment: int) -> int:
        return int(self.r.hget(self.k + "version", str(fragment)))

    def round(self, fragment: int) -> dict[str, dict]:
        return {cid: json.loads(m) for cid, m in self.r.hgetall(f"{self.k}round:{fragment}").items()}

    def statuses(self) -> dict[str, str]:
        return self.r.hgetall(self.k + "status")

    def offsets(self) -> dict[TP, int]:
        return {parse_partition_key(key): int(off) for key, off in self.r.hgetall(self.k + "offsets").items()}

    def events_offset(self, shard: int) -> int:
        return int(self.r.hget(self.k + "events_offset", str(shard)) or 0)

    def committed(self, events_topic: str) -> dict[TP, int]:
        """Where the syncer resumes on every partition it reads; for the events topic, the shard furthest behind."""
        out = self.offsets()
        if shards := self.r.hvals(self.k + "events_offset"):
            out[(events_topic, 0)] = min(int(v) for v in shards)
        return out

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.r.hgetall(self.k + "stats").items()}

    def versions(self) -> dict[int, int]:
        return {int(p): int(v) for p, v in self.r.hgetall(self.k + "version").items()}

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.r.hgetall(self.k + "counters").items()}

    def merges(self, last: int | None = None) -> list[dict]:
        """Every merge record, oldest first; with `last`, only the newest `last` of them."""
        return [json.loads(m) for m in self.r.lrange(self.k + "merges", -last if last else 0, -1)]

    def merges_since(self, start: int) -> list[dict]:
        """The merge records from the `start`-th on (0 = the oldest): what a reader that has seen
        `start` of them has not."""
        return [json.loads(m) for m in self.r.lrange(self.k + "merges", start, -1)]

    def pending(self, fragments: int) -> list[dict]:
        """The metas of every contribution accepted into an open round (not merged or rejected yet)."""
        return [json.loads(m) for p in range(fragments) for m in self.r.hvals(f"{self.k}round:{p}")]

    def registry(self) -> dict[str, dict]:
        return {k: json.loads(v) for k, v in self.r.hgetall(self.k + "registry").items()}

    def status_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.r.hvals(self.k + "status"):
            kind = Status.kind_of(s)
            out[kind] = out.get(kind, 0) + 1
        return out

    # --- writes ------------------------------------------------------------------------------
    def init_versions(self, fragments: int) -> bool:
        """Set every fragment to version 0 unless the run already exists. True if it was new."""
        created = [self.r.hsetnx(self.k + "version", str(p), 0) for p in range(fragments)]
        return all(created)

    def accept(self, fragment: int, cid: str, meta: dict, offsets: dict[TP, int],
               outbox: list[dict] = (), *, fence: Fence = None) -> None:
        def build(p):
            p.hset(f"{self.k}round:{fragment}", cid, json.dumps(meta))
            p.hset(self.k + "status", cid, Status.pending(fragment))
            p.hincrby(self.k + "counters", "accepted", 1)
            self._offsets(p, offsets)
            self._outbox(p, outbox)
        self._transact(fence, build)

    def reject(self, cid: str | None, reason: str, offsets: dict[TP, int],
               fragment: int | None = None, outbox: list[dict] = (), *, fence: Fence = None,
               where: Where | None = None) -> None:
        """Record a rejection; `cid` None for a record that names no contribution. `where` (of its first
        record) lets the status be forgotten once replay is past it."""
        def build(p):
            if cid is not None:
                p.hset(self.k + "status", cid, Status.rejected(reason))
                if where is not None and where.offset is not None:
                    p.zadd(self._finished(where.tp), {cid: int(where.offset)})
                if fragment is not None:
                    p.hdel(f"{self.k}round:{fragment}", cid)
            p.hincrby(self.k + "counters", "rejected" if cid is not None else "rejected_records", 1)
            p.hincrby(self.k + "counters", rejection_counter(reason), 1)
            self._offsets(p, offsets)
            self._outbox(p, outbox)
        self._transact(fence, build)

    def count(self, name: str, n: int = 1) -> None:
        self.r.hincrby(self.k + "counters", name, n)

    def save_offsets(self, offsets: dict[TP, int], *, fence: Fence = None) -> None:
        if offsets:
            self._transact(fence, lambda p: self._offsets(p, offsets))

    def prune_statuses(self, tp: TP, below: int, keep: int, *, fence: Fence = None) -> list[str]:
        """Forget the statuses of ids finished from partition `tp` whose records all lie before offset
        `below` (the replay offset: never read again), keeping the newest `keep`. Returns the ids."""
        key = self._finished(tp)
        extra = self.r.zcard(key) - keep
        if extra <= 0:
            return []
        old = self.r.zrangebyscore(key, "-inf", f"({below}", start=0, num=min(extra, 10_000))
        if old:
            def build(p):
                p.hdel(self.k + "status", *old)
                p.zrem(key, *old)
            self._transact(fence, build)
        return old

    def save_events_offset(self, shard: int, offset: int) -> None:
        self.r.hset(self.k + "events_offset", str(shard), offset)

    def commit_merge(self, fragment: int, *, from_version: int, ids: list[str], late: int, record: dict,
                     offsets: dict[TP, int], sync_time_s: float, outbox: list[dict] = (),
                     fence: Fence = None) -> None:
        """Atomically: bump the version, mark ids applied, clear them from the round, store offsets."""
        vkey = self.k + "version"

        def check(p):
            current = int(p.hget(vkey, str(fragment)))
            if current != from_version:
                raise StaleVersion(f"fragment {fragment} is at version {current}, merge was built on {from_version}")

        def build(p):
            p.hset(vkey, str(fragment), from_version + 1)
            if ids:
                p.hdel(f"{self.k}round:{fragment}", *ids)
                p.hset(self.k + "status", mapping={cid: Status.applied(fragment, from_version + 1) for cid in ids})
                for cid, where in zip(ids, record.get("where", ())):  # a JSON list each: Where's fields
                    where = Where(*where)
                    p.zadd(self._finished(where.tp), {cid: int(where.offset)})
            p.hincrby(self.k + "counters", "applied", len(ids))
            p.hincrby(self.k + "counters", "late", late)
            p.hincrby(self.k + "counters", "merges", 1)
            p.rpush(self.k + "merges", json.dumps(record))
            p.hset(self.k + "stats", "sync_time_s", sync_time_s)
            self._offsets(p, offsets)
            self._outbox(p, outbox)
        self._transact(fence, build, watch=(vkey,), check=check)

    def _transact(self, fence: Fence, build, *, watch: tuple[str, ...] = (), check=None, attempts: int = 20) -> None:
        """One MULTI/EXEC of `build`, refused with Fenced unless every fragment in `fence` still has
        the given epoch (WATCHed, so a claim between the check and EXEC also refuses it).

        The watched version hash is shared by all fragments, so another shard's commit also aborts
        EXEC: then the checks run again on the new values and the transaction is retried."""
        fence = dict(fence or {})
        keys = [self.k + f"epoch:{f}" for f in fence] + list(watch)
        for _ in range(attempts):
            with self.r.pipeline(transaction=True) as p:
                try:
                    if keys:
                        p.watch(*keys)
                    self._check_fence(p, fence)  # reads on a WATCHing pipeline run at once
                    if check:
                        check(p)
                    p.multi()
                    build(p)
                    p.execute()
                    return
                except WatchError:
                    continue
        raise StaleVersion(f"the commit kept losing races on {keys} ({attempts} attempts)")

    def _check_fence(self, p, fence: dict[int, int]) -> None:
        for frag, epoch in fence.items():
            now = p.get(self.k + f"epoch:{frag}")
            if now is None or int(now) != epoch:
                raise Fenced(frag, f"epoch is {now}, this writer holds {epoch}: another shard owns it now")

    # --- ownership ---------------------------------------------------------------------------
    def claim(self, fragment: int, shard: int, member: str, ttl_s: float) -> tuple[int, str | None]:
        """(new epoch, previous owner) if this shard now owns the fragment, else (0, current holder)."""
        epoch, who = self.r.eval(_CLAIM, 3, self.k + f"lease:{fragment}", self.k + f"epoch:{fragment}",
                                 self.k + f"owner:{fragment}", member, str(shard), int(ttl_s * 1000))
        return int(epoch), who or None

    def renew(self, fragment: int, member: str, ttl_s: float) -> bool:
        return bool(self.r.eval(_RENEW, 1, self.k + f"lease:{fragment}", member, int(ttl_s * 1000)))

    def release(self, fragment: int, member: str) -> None:
        self.r.eval(_RELEASE, 1, self.k + f"lease:{fragment}", member)

    def lease_holder(self, fragment: int) -> str | None:
        return self.r.get(self.k + f"lease:{fragment}")

    def join(self, shard: int, member: str, ttl_s: float) -> str | None:
        """Say this shard is live for another ttl_s seconds: None, or the other live process that
        already is this shard (then nothing changes)."""
        holder = self.r.eval(_JOIN, 1, self.k + f"member:{shard}", member, int(ttl_s * 1000))
        return holder or None

    def leave(self, shard: int, member: str) -> None:
        self.r.eval(_RELEASE, 1, self.k + f"member:{shard}", member)

    def live_shards(self, shards: int) -> set[int]:
        found = self.r.mget([self.k + f"member:{i}" for i in range(shards)])
        return {i for i, m in enumerate(found) if m is not None}

    def heartbeat(self, learner: str, info: dict) -> None:
        self.r.hset(self.k + "registry", learner, json.dumps(info))

    def drop_learner(self, learner: str, info: dict) -> None:
        """Keep the learner's last entry marked dropped: a reload must not take a dropped member for one
        not heard from yet (which counts as live) and wait for it for good."""
        self.r.hset(self.k + "registry", learner, json.dumps({**info, "status": "dropped"}))

    def admit(self, learner: str, info: dict) -> bool:
        """Record a learner admitted to the live run; False if it already was."""
        return bool(self.r.hsetnx(self.k + "members", learner, json.dumps(info)))

    def members(self) -> dict[str, dict]:
        return {k: json.loads(v) for k, v in self.r.hgetall(self.k + "members").items()}

    def outbox_depth(self) -> int:
        return self.r.llen(self.k + "outbox")

    def pending_counts(self, fragments: int) -> dict[int, int]:
        """Contributions in each fragment's open round."""
        p = self.r.pipeline(transaction=False)
        for f in range(fragments):
            p.hlen(f"{self.k}round:{f}")
        return dict(enumerate(p.execute()))

    def lease_holders(self, fragments: int) -> dict[int, str | None]:
        return dict(enumerate(self.r.mget([self.k + f"lease:{f}" for f in range(fragments)]))) if fragments else {}

    def outbox_peek(self, n: int = 500) -> list[str]:
        """The first n outbox records as stored (JSON text): the trim below matches on that text."""
        return self.r.lrange(self.k + "outbox", 0, n - 1)

    def dead_letter(self, record: str, why: str, keep: int = 1000) -> None:
        """Keep a record the broker refused for good (the newest `keep` of them), and count it."""
        p = self.r.pipeline()
        p.rpush(self.k + "deadletter", json.dumps({"why": why[:500], "record": record[:1 << 20]}))
        p.ltrim(self.k + "deadletter", -keep, -1)
        p.hincrby(self.k + "counters", "dead_letters", 1)
        p.execute()

    def outbox_trim(self, sent: list[str]) -> bool:
        """Drop the records just relayed, unless another relayer already did (False then)."""
        if not sent:
            return True
        return bool(self.r.eval(_TRIM_IF_HEAD, 1, self.k + "outbox", sent[0], len(sent)))

    def _outbox(self, p, records: list[dict]) -> None:
        if records:
            p.rpush(self.k + "outbox", *(json.dumps(r) for r in records))
            self.outbox_writes += 1  # tells the relay there may be something new (a failed EXEC: one idle look)

    def _finished(self, tp: TP) -> str:
        return self.k + f"finished:{partition_key(tp)}"

    def _offsets(self, p, offsets: dict[TP, int]) -> None:
        if offsets:
            p.hset(self.k + "offsets", mapping={partition_key(tp): off for tp, off in offsets.items()})

    # --- lost writes (syncer/durability.py, `diloco state repair`) ------------------------------
    def merge_record(self, fragment: int, version: int, page: int = 64) -> dict | None:
        """The merge record of one version, searched from the newest (where a fragment's current
        version is), a page at a time."""
        n = self.r.llen(self.k + "merges")
        for end in range(n - 1, -1, -page):
            for raw in reversed(self.r.lrange(self.k + "merges", max(end - page + 1, 0), end)):
                rec = json.loads(raw)
                if rec["fragment"] == fragment and rec["version"] == version:
                    return rec
        return None

    def epoch(self, fragment: int) -> int:
        return int(self.r.get(self.k + f"epoch:{fragment}") or 0)

    def restore(self, *, versions: dict[int, int], statuses: dict[str, str], merges: list[dict],
                epochs: dict[int, int], counters: dict[str, int]) -> None:
        """Replace the run's committed state in one MULTI/EXEC: versions, statuses and merge records as
        given, fencing epochs and counters set, every open round, replay offset, lease and outbox record
        dropped (the syncer then replays the fragment topics from their start)."""
        p = self.r.pipeline(transaction=True)
        frags = list(versions)
        p.delete(self.k + "version", self.k + "status", self.k + "merges", self.k + "offsets", self.k + "outbox",
                 *(f"{self.k}round:{f}" for f in frags), *(f"{self.k}lease:{f}" for f in frags))
        p.hset(self.k + "version", mapping={str(f): v for f, v in versions.items()})
        if statuses:
            p.hset(self.k + "status", mapping=statuses)
        if merges:
            p.rpush(self.k + "merges", *(json.dumps(m) for m in merges))
        for f, e in epochs.items():
            p.set(self.k + f"epoch:{f}", e)
        p.hset(self.k + "counters", mapping=counters)
        p.execute()
