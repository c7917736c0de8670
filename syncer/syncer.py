"""The streaming syncer: region topics in, merged fragment versions out.

Commit protocol for one fragment round (what makes a SIGKILL at any point safe):
  1. contributions are accepted into the round in Redis (ids, arrival times) together with the replay
     offsets; their payloads stay in Kafka, and the replay offset never passes the first record of a
     contribution that is not yet applied or rejected;
  2. the round closes (quorum + grace), the merge and outer step run in memory;
  3. the new version is written to TensorStore (meta.json last). A crash here leaves an orphan
     version that nobody was told about; the next merge of the fragment overwrites it;
  4. one Redis MULTI/EXEC bumps the version (WATCHed), marks the ids applied, removes them from the
     round and moves the replay offsets: the merge is now durable, exactly once;
  5. the announcement and the merge event were written to the Redis outbox in that same transaction;
     the relay publishes them and trims the outbox once Kafka acknowledged them. A crash repeats
     them at most (learners ignore versions they already have; event readers drop repeated eids);
  6. the store's commit marker moves to the new version: readers (evals, ckpt) count only committed
     versions. A crash before it leaves the marker one behind until the next merge or claim.
Acceptances and rejections go the same way: state, replay offsets and their event in one MULTI/EXEC.
On restart the syncer reads Redis, checks each fragment's Redis version against the store (a Redis
that lost acknowledged writes is refused: syncer/durability.py), reloads it from TensorStore, and
replays Kafka from the stored offsets: ids already applied or rejected are dropped, pending ids get
their payloads back, and new ids are handled as usual.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import uuid
from collections import Counter, deque

import numpy as np
from kafka import OffsetAndMetadata, TopicPartition
from kafka.errors import KafkaError
from redis.exceptions import ClusterDownError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from diloco import messages
from diloco import metrics as metrics_mod
from diloco import status as status_mod
from diloco.config import Config
from diloco.faults import crash_point
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore, StoreFenced
from diloco.messages import Assembled, ChunkAssembler, Dropped, Manifest, WireError
from diloco.syncer import durability, fused, rounds
from diloco.syncer import merge as merge_math
from diloco.syncer import shards as shards_mod
from diloco.syncer.intake import Intake
from diloco.syncer.ownership import LeaseKeeper
from diloco.syncer.periodic import Every
from diloco.syncer.policy import QuorumPolicy
from diloco.syncer.provision import announce, announcement
from diloco.syncer.rebuild import rebuild
from diloco.syncer.records import (TP, FragmentState, Pending, Reason, Status, parse_partition_key, partition_key,
                                   pending_fragment)
from diloco.syncer.state import Fenced, StaleVersion, SyncerState, wait_until_up

log = logging.getLogger(__name__)

DRAIN_SETTLE_S = 1.0  # on stop: how long the syncer must stay caught up before it believes it


class Syncer:
    """One syncer shard: merges the fragments it holds leases on (all of them when it runs alone)."""

    def __init__(self, cfg: Config, run_id: str, *, state: SyncerState, store: FragmentStore, producer, consumer,
                 shard: int = 0, clock=time.time):
        self.cfg, self.run_id, self.state, self.store = cfg, run_id, state, store
        self.producer, self.consumer, self.clock = producer, consumer, clock
        self.topics = kafka_io.Topics.for_run(cfg, run_id)
        self.run_plan = store.read_plan()      # what the run syncs; no model code needed
        self.plan = self.run_plan.fragment_names
        if self.topics.partitions != len(self.plan):  # ownership follows partitions one to one
            raise ValueError(f"{self.topics.partitions} partitions per region topic for {len(self.plan)} fragments")
        if not 0 <= shard < cfg.syncer.shards:
            raise ValueError(f"shard {shard} is not in 0..{cfg.syncer.shards - 1} (syncer.shards={cfg.syncer.shards})")
        self.shard, self.member = shard, f"{shard}:{uuid.uuid4().hex[:12]}"
        self.ttl_s = cfg.syncer.lease_ttl_s
        self.shapes = self.run_plan.shapes
        self.opt = merge_math.outer_optimizer(cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
        self.policy = QuorumPolicy(cfg.syncer.quorum, cfg.syncer.overlap_steps, cfg.syncer.grace_gamma,
                                   cfg.syncer.grace_max_s)
        self.events_tp: TP = (self.topics.events, 0)
        self.region_of_topic = {topic: region for region, topic in self.topics.fragments.items()}
        self.learners = set(cfg.learner_ids())  # members: these, and those admitted since (members hash)
        self.refused: set[str] = set()           # ids already refused (and said so) by this process
        self.below_min: dict[str, bool] = {}     # region -> fewer live learners than regions[].min_learners
        self.stopping = False
        self._broker_down = self._commit_failed = False
        self.broker = kafka_io.BrokerWatch(cfg.transport, f"syncer-{shard}")
        self.keeper = self._lease_keeper()
        self.intake = Intake(cfg, run_id, self.run_plan)
        self.metrics = metrics_mod.SyncerMetrics(shard)
        self.recent: deque[dict] = deque(maxlen=200)  # the newest events other than heartbeats (status page)
        self._reset()

    def _lease_keeper(self) -> LeaseKeeper:
        return LeaseKeeper(self.state, self.shard, self.member, self.ttl_s, lambda: list(self.epochs),
                           self.cfg.syncer.stuck_after_s)

    def _reset(self) -> None:
        """Forget everything held in memory: what start() rebuilds from Redis, TensorStore and Kafka."""
        self.fragments: dict[int, FragmentState] = {}   # the fragments this shard owns
        self.epochs: dict[int, int] = {}                # their fencing epochs
        self.status: dict[str, str] = {}
        self.consumed: dict[TP, int] = {}
        self.registry: dict[str, dict] = {}
        sc = self.cfg.syncer
        self.assembler = ChunkAssembler(max_bytes=sc.max_contribution_bytes, timeout_s=sc.incomplete_timeout_s,
                                        after_bytes=sc.incomplete_after_bytes, max_sets=sc.max_partial_sets,
                                        max_buffered=sc.max_buffered_bytes, check=self._check_manifest)
        self.sync_time_s = 0.0
        self.coordinator = False
        self._replaying = False
        # periodic work, each on its own cadence
        self.every_offsets_save, self.every_prune = Every(1.0, self.clock), Every(10.0, self.clock)
        self.every_registry_check, self.every_observe = Every(0.5, self.clock), Every(1.0, self.clock)
        self.every_lease = Every(self.ttl_s / 3, self.clock)

    # --- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.broker.is_alive():
            self.broker.start()
        fused.warm_up()  # the merge kernels compile (or load from cache) now, not during the first rounds
        self.stand_by()
        if not self.keeper.is_alive():
            self.keeper = self._lease_keeper()
            self.keeper.start()
        try:
            self._resume()
        except BaseException:  # a refused start must not leave its membership renewed behind it
            self.close()
            raise

    def _resume(self) -> None:
        """Reload what Redis holds, claim this shard's fragments and say the syncer started."""
        versions = self.state.versions()
        if len(versions) != len(self.plan):
            if held := durability.committed_in_store(self.store, len(self.plan)):
                raise durability.lost(self.run_id, f"Redis holds versions {versions}, the store committed {held}")
            raise RuntimeError(f"run {self.run_id} is not provisioned in Redis (versions: {versions}); "
                               "`diloco train` provisions it")
        self.sync_time_s = self.state.stats().get("sync_time_s", 0.0)
        now = self.clock()  # the registry survives a restart; its clocks restart from now
        self.learners |= {lid for lid in self.state.members() if self.cfg.is_member_id(lid)}
        self.registry = {}
        for lid, hb in self.state.registry().items():  # checked again: Redis may hold what an older build let in
            try:
                if lid in self.learners:
                    self.registry[lid] = messages.clean_heartbeat(hb) | {"seen": now, "status": hb.get("status", "alive")}
            except WireError as err:
                log.warning("registry entry dropped", extra={"learner": lid[:64], "error": str(err)})
        if self.registry or any(versions.values()):
            # a run under way: a member never heard from is not waited for forever, its clock starts now
            for lid in self.learners - set(self.registry):
                self.registry[lid] = {"kind": "heartbeat", "learner": lid, "seen": now, "status": "alive"}
        self.consumed = {self.events_tp: self.state.events_offset(self.shard)}
        self.started_at = now
        self.rebalance(force=True)
        self.relay()  # what a crashed predecessor committed but did not get to publish
        self._event("syncer_started", shard=self.shard, fragments=sorted(self.fragments),
                    versions={p: f.version for p, f in self.fragments.items()},
                    pending=sum(len(f.round) for f in self.fragments.values()))
        log.info("syncer started", extra={"run": self.run_id, "shard": self.shard, "fragments": sorted(self.fragments),
                                          "replay_from": {partition_key(tp): o for tp, o in self.consumed.items()}})

    def stand_by(self) -> None:
        """Wait while another live process is this shard (two would take fragments from each other)."""
        said = False
        while (holder := self.state.join(self.shard, self.member, self.ttl_s)) is not None:
            if not said:
                log.warning("shard %d already runs as %s; standing by until it stops", self.shard, holder,
                            extra={"shard": self.shard, "holder": holder})
                said = True
            if self.stopping:
                raise SystemExit(0)
            time.sleep(self.ttl_s / 3)
        self.keeper.displaced = False

    def close(self) -> None:
        """Stop renewing and leave the membership (leases lapse or go to this shard's next process)."""
        self.keeper.halt()
        try:
            self.state.leave(self.shard, self.member)
        except RedisError:  # Redis is away: the membership lapses after its TTL instead
            pass

    def run(self, *, drain_timeout_s: float = 30.0) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self.start()
        stop_at = settled_at = None
        try:
            while True:
                try:
                    self.step()
                except (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError) as err:
                    # (a cluster mid-failover says CLUSTERDOWN / TRYAGAIN: the same wait, then a reload)
                    self.recover_from_redis_outage(err)
                if self.stopping:
                    # Caught up by the high watermark of a fetch that may predate the last records
                    # (a learner's final hand-in just before the stop): trust it only once it held
                    # over several fetches, for DRAIN_SETTLE_S.
                    now = self.clock()
                    stop_at = stop_at or now + drain_timeout_s
                    settled_at = (settled_at or now) if self.caught_up() else None
                    if (settled_at is not None and now - settled_at >= DRAIN_SETTLE_S) or now > stop_at:
                        break
            if self.cfg.syncer.flush_on_stop:
                for p in list(self.fragments):
                    self._guarded(p, lambda p=p: self.maybe_close(p, final=True))
            self.relay()
            self.save_offsets(force=True)
            self._event("syncer_stopped", shard=self.shard,
                        versions={p: f.version for p, f in self.fragments.items()})
            self.keeper.halt()
            for p in list(self.fragments):  # hand over at once rather than after the lease times out
                self.state.release(p, self.member)
            self.state.leave(self.shard, self.member)
        finally:
            self.keeper.halt()
            self.producer.flush()
            self.consumer.close()

    def recover_from_redis_outage(self, err: Exception) -> None:
        """Redis went away mid-change: wait for it, then rebuild everything from durable state.

        Whether the interrupted MULTI/EXEC was applied is unknown, so nothing is retried blindly: the
        syncer reloads Redis and replays Kafka from the stored offsets, as after a crash.
        """
        log.warning("redis connection lost; waiting for it, then resuming from durable state",
                    extra={"error": f"{type(err).__name__}: {err}"})
        wait_until_up(self.state.r.ping, self.cfg.state, timeout_s=self.cfg.run.timeout_s)
        log.warning("redis is back; reloading state and replaying from the stored offsets")
        self._reset()
        self.start()

    def step(self) -> None:
        """One poll: handle records, expire partial chunk sets, close the rounds that are due."""
        self.keeper.alive_at = time.monotonic()
        batch = self.consumer.poll(timeout_ms=self.cfg.syncer.poll_ms, max_records=500)
        for tp, records in batch.items():
            key = (tp.topic, tp.partition)
            for rec in records:
                if key not in self.consumed:
                    break                         # the partition went with its fragment meanwhile
                self._guarded(self._fragment_of(key), lambda k=key, r=rec: self._handle(k, r))
        now = self.clock()
        for d in self.assembler.expire(now, caught_up=self._read_to_end):
            self._reject_dropped(d)
        self._give_up_lost_payloads()
        self.update_registry()
        for p in list(self.fragments):
            self._guarded(p, lambda p=p: self.maybe_close(p))
        self.relay()
        self.save_offsets()
        self.rebalance()
        self.observe()

    def _handle(self, key: TP, rec) -> None:
        try:
            if key == self.events_tp:
                self.consumed[key] = rec.offset + 1
                self.handle_event(rec.value)
            else:
                self.handle_record(rec.value, key, rec.offset)
        except (RedisError, KafkaError, Fenced):
            raise                     # the service or the ownership, not the record: handled above
        except Exception as err:  # one bad record must never stop the syncer
            log.exception("record handling failed", extra={"topic": key[0], "offset": rec.offset})
            self._reject(None, Reason.INTERNAL_ERROR, f"{type(err).__name__}: {err}", where=(*key, rec.offset))

    # --- ownership -----------------------------------------------------------------------------
    def rebalance(self, *, force: bool = False) -> None:
        """Renew leases and membership; hand back fragments whose home shard is live again; claim
        the fragments this shard should own that nobody holds. Runs every third of the lease TTL."""
        if not self.every_lease.due(force=force):
            return
        now = self.clock()
        self.keeper.alive_at = time.monotonic()
        self.keeper.renew()                # the keeper's thread does the same between steps
        if self.keeper.displaced:  # this process stalled past its TTL and another one is this shard now
            log.error("another process took over shard %d; handing everything back and standing by", self.shard)
            self._reset()
            self.start()
            return
        changed = False
        lost, self.keeper.lost = self.keeper.lost, set()
        for p in sorted(lost & set(self.fragments)):
            self.drop(p, "lease lost (this shard stalled past the lease TTL)")
            changed = True
        live = self.state.live_shards(self.cfg.syncer.shards) | {self.shard}
        self.coordinator = self.shard == min(live)
        want = shards_mod.wanted(self.shard, len(self.plan), self.cfg.syncer.shards, live)
        for p in sorted(set(self.fragments) - want):
            self.release(p)
            changed = True
        if not self.stopping or force:  # force: a (re)start, also one after a Redis outage during the stop
            settled = now - self.started_at >= self.ttl_s  # the other shards had time to say they are live
            changed |= self.claim([p for p in sorted(want - set(self.fragments))
                                   if shards_mod.home_shard(p, self.cfg.syncer.shards) == self.shard or settled])
        if changed or force:
            self._assign()

    def claim(self, candidates: list[int]) -> bool:
        """Take those of `candidates` whose lease is free; load each one's version, open round and
        replay offsets (statuses and offsets read once for all of them). True if any was taken."""
        taken = [(p, *self.state.claim(p, self.shard, self.member, self.ttl_s)) for p in candidates]
        taken = [(p, epoch, previous) for p, epoch, previous in taken if epoch]
        if taken:
            self.status.update(self.state.statuses())
            offsets = self.state.offsets()
            for p, epoch, previous in taken:
                self._load(p, epoch, previous, offsets)
        return bool(taken)

    def _load(self, p: int, epoch: int, previous: str | None, offsets: dict[TP, int]) -> None:
        v = self.state.version(p)
        durability.check_fragment(self.state, self.store, self.run_id, p, v)
        st = self.rebuild_fragment(p, v)
        for cid, meta in self.state.round(p).items():
            st.round[cid] = Pending(meta, meta["arrival"], (meta["topic"], meta["partition"]), meta["offset"])
        for tp in self._tps(p):
            self.consumed[tp] = offsets.get(tp, 0)
        self.fragments[p], self.epochs[p] = st, epoch
        self._replaying |= bool(st.round)  # their payloads come back from the log
        self.store.mark_committed(p, v)   # Redis's version is committed: after a crash the marker may lag
        announce(self.producer, self.topics, self.cfg, self.run_id, p, v)  # at least once: learners dedupe
        self._event("fragment_claimed", fragment=p, shard=self.shard, epoch=epoch, version=v,
                    pending=len(st.round), previous=previous)
        log.info("fragment claimed", extra={"fragment": p, "shard": self.shard, "epoch": epoch, "version": v,
                                            "previous_owner": previous, "pending": len(st.round)})

    def rebuild_fragment(self, p: int, v: int) -> FragmentState:
        """Fragment p's exact state at version v (syncer/rebuild.py); an approximate one (exact
        parameters, the snapshot's outer state) is said loudly, in the log and an event."""
        st, approximate = rebuild(self.cfg, self.run_id, self.run_plan, self.opt, self.store, self.state.merges(), p, v)
        if approximate is None:
            if st.snapshot_at != v:
                log.info("fragment rebuilt from its snapshot", extra={"fragment": p, "snapshot": st.snapshot_at,
                                                                      "version": v})
            return st
        log.error("fragment %d: outer state not rebuilt exactly since snapshot v%d (%s); parameters are exact, "
                  "momentum and residual restart from the snapshot", p, st.snapshot_at, approximate)
        self._event("fragment_state_approximate", fragment=p, snapshot=st.snapshot_at, version=v,
                    reason=messages.bounded(approximate, messages.DETAIL_CHARS))
        return st

    def release(self, p: int) -> None:
        """Hand fragment p back: its replay offsets first, so the next owner resumes where this one was."""
        try:
            self.state.save_offsets(self.replay_offsets([p]), fence={p: self.epochs[p]})
        except Fenced:
            pass
        self.state.release(p, self.member)
        self.drop(p, "handed to its home shard")

    def drop(self, p: int, why: str) -> None:
        """Forget fragment p here; what was accepted for it is in Redis for its next owner."""
        if self.fragments.pop(p, None) is None:
            return
        self.epochs.pop(p, None)
        for tp in self._tps(p):
            self.consumed.pop(tp, None)
            self.assembler.discard_where(partition_key(tp))
        self._event("fragment_released", fragment=p, shard=self.shard, reason=why)
        log.warning("fragment released", extra={"fragment": p, "shard": self.shard, "reason": why})

    def _guarded(self, p: int, fn) -> None:
        """Run fn; if it finds that another shard took fragment p (fenced), let the fragment go."""
        try:
            fn()
        except Fenced as err:
            self.drop(err.fragment, f"fenced: {err}")
            self._assign()

    def _assign(self) -> None:
        """Read exactly the partitions of the owned fragments (and the events), each from where it was."""
        kafka_io.assign_from(self.consumer, {TopicPartition(*tp): off for tp, off in self.consumed.items()})

    def _tps(self, p: int) -> list[TP]:
        return [(t, self.topics.partition_of(p)) for t in self.topics.fragments.values()]

    def _fragment_of(self, tp: TP) -> int:
        return tp[1]  # one partition per fragment (checked in __init__)

    def relay(self) -> None:
        """Publish the outbox to Kafka; trim only what the broker acknowledged.

        While the broker is away the outbox waits in Redis and the next step tries again.
        """
        while self.broker.up and (raw := self.state.outbox_peek()):  # no blocking flush while it is away
            records = [json.loads(r) for r in raw]
            refused: list[tuple[str, str]] = []   # (record, why): the broker will never take these
            try:
                futures = []
                for text, r in zip(raw, records):
                    try:
                        futures.append((text, self.producer.send(r["topic"], r["value"].encode(),
                                                                 partition=r["partition"])))
                    except KafkaError as err:  # refused before it left (too large for max_request_size)
                        if getattr(err, "retriable", False):
                            raise
                        refused.append((text, f"{type(err).__name__}: {err}"))
                self.producer.flush(timeout=10)
                for text, f in futures:
                    try:
                        f.get(timeout=10)
                    except KafkaError as err:
                        if getattr(err, "retriable", False):
                            raise
                        refused.append((text, f"{type(err).__name__}: {err}"))
            except KafkaError as err:
                if not self._broker_down:
                    log.warning("broker unavailable; keeping %d records in the outbox", len(records),
                                extra={"error": f"{type(err).__name__}: {err}"})
                self._broker_down = True
                return
            for text, why in refused:  # a record refused for good must not hold up every later one
                self.state.dead_letter(text, why)
                log.error("outbox record refused by the broker; dead-lettered",
                          extra={"error": messages.bounded(why, 200), "bytes": len(text)})
            if self._broker_down:
                log.warning("broker reachable again; outbox relayed")
                self._broker_down = False
            if not self.state.outbox_trim(raw):
                return  # another shard relayed the same records first: they went out twice, not zero times

    def observe(self) -> None:
        """Set the gauges that describe what this shard holds now (once a second): versions, leases,
        open rounds, consumer lag, outbox, learners by liveness. Fragments it no longer owns leave."""
        if not self.every_observe.due():
            return
        m, owned = self.metrics, self.fragments
        for p in range(len(self.plan)):
            m.lease.labels(p).set(p in owned)
        metrics_mod.set_all(m.version, {(p,): st.version for p, st in owned.items()})
        metrics_mod.set_all(m.pending, {(p,): len(st.round) for p, st in owned.items()})
        metrics_mod.set_all(m.epoch, {(p,): self.epochs[p] for p in owned})
        metrics_mod.set_all(m.lag, {(tp.topic, tp.partition): hw - self.consumer.position(tp)
                                    for tp in self.consumer.assignment()
                                    if (hw := self.consumer.highwater(tp)) is not None})
        m.outbox.set(self.state.outbox_depth())
        by_status = Counter(hb["status"] for hb in self.registry.values())
        for s in ("alive", "silent", "finished", "left", "dropped"):
            m.learners.labels(s).set(by_status[s])

    def live_status(self) -> dict:
        """The run's live status (diloco/status.py) as this shard sees it: Redis and its recent events."""
        snap = status_mod.snapshot(self.state, len(self.plan))
        return status_mod.build(self.cfg, self.run_id, snap, list(self.recent), time.time())

    def caught_up(self) -> bool:
        for tp in self.consumer.assignment():
            hw = self.consumer.highwater(tp)
            if hw is None or self.consumer.position(tp) < hw:
                return False
        return len(self.assembler) == 0

    # --- records -------------------------------------------------------------------------------
    def handle_event(self, raw: bytes) -> None:
        ev = messages.parse_event(raw)
        if ev and ev["kind"] != "heartbeat":
            self.recent.append(ev)
        if not (ev and ev["kind"] == "heartbeat" and isinstance(ev.get("learner"), str)):
            return
        try:
            ev = messages.clean_heartbeat(ev)
        except WireError as err:  # one bad beat: counted and logged, never stored or used
            self.state.count("bad_events")
            log.warning("heartbeat ignored", extra={"error": str(err)})
            return
        lid = ev["learner"]
        if not self._admit(lid):
            return
        before = self.registry.get(lid)
        ev["seen"] = self.clock()  # the syncer's clock decides liveness, not the learner's
        ev["status"] = {"finished": "finished", "left": "left"}.get(ev.get("state"), "alive")
        self.registry[lid] = ev
        if not self.coordinator:  # every shard tracks liveness; one keeps the shared registry and says so
            return
        self.state.heartbeat(lid, ev)
        if before is None or before.get("incarnation") != ev.get("incarnation") or before["status"] != ev["status"]:
            if ev["status"] == "alive":
                self._event("learner_joined", learner=lid, incarnation=ev.get("incarnation"), step=ev.get("step"),
                            was=None if before is None else before["status"])
            else:  # finished its budget, or left early (SIGTERM): no round waits for it any more
                self._event(f"learner_{ev['status']}", learner=lid, step=ev.get("step"), tokens=ev.get("tokens"))
                log.info(f"learner {ev['status']}", extra={"learner": lid, "step": ev.get("step")})

    def _admit(self, lid: str) -> bool:
        """Whether `lid` is a member of the live run, admitting it if the config lets it join
        (`regions[].max_learners`). Every shard reads the same heartbeats in the same order and the
        rule depends on the id alone, so all shards agree without asking each other; the
        coordinator records the admission and says so (learner_admitted / learner_refused)."""
        if lid in self.learners:
            return True
        if not self.cfg.is_member_id(lid):
            if self.coordinator and lid not in self.refused and len(self.refused) < 10_000:
                self.refused.add(lid)
                self.state.count("refused_learners")
                self._event("learner_refused", learner=lid[:64], reason=self.cfg._not_a_member(lid[:64]))
                log.warning("learner refused", extra={"learner": lid[:64]})
            return False
        self.learners.add(lid)
        if self.coordinator:
            region = self.cfg.region_of(lid).name
            if self.state.admit(lid, {"region": region, "shard": self.cfg.shard_index(lid), "time": time.time()}):
                self._event("learner_admitted", learner=lid, region=region, shard=self.cfg.shard_index(lid),
                            members=len(self.learners))
                log.info("learner admitted", extra={"learner": lid, "region": region, "members": len(self.learners)})
        return True

    def update_registry(self) -> None:
        """Heartbeats that stop mark a learner silent (not waited for), then drop it from the registry."""
        if not self.every_registry_check.due():
            return
        now = self.clock()
        for lid, hb in list(self.registry.items()):
            age = now - hb["seen"]
            if hb["status"] == "alive" and age > self.cfg.syncer.silent_after_s:
                hb["status"] = "silent"
                if not self.coordinator:
                    continue
                self._event("learner_silent", learner=lid, last_step=hb.get("step"), silent_s=round(age, 1))
                log.warning("learner silent", extra={"learner": lid, "silent_s": round(age, 1)})
            elif hb["status"] == "silent" and age > self.cfg.syncer.drop_after_s:
                hb["status"] = "dropped"
                if not self.coordinator:
                    continue
                self.state.drop_learner(lid, hb)
                self._event("learner_dropped", learner=lid, silent_s=round(age, 1))
                log.warning("learner dropped from the registry", extra={"learner": lid})
        if self.coordinator:
            self._check_region_minimums()

    def _check_region_minimums(self) -> None:
        """Say when a region has fewer live learners than regions[].min_learners, and when it is back."""
        live = Counter(self.cfg.region_of(lid).name for lid in self.live_learners())
        for r in self.cfg.regions:
            n = live[r.name]
            below = n < r.min_learners
            if below != self.below_min.get(r.name, False):
                self.below_min[r.name] = below
                self._event("region_below_min" if below else "region_at_min", region=r.name, live=n,
                            min_learners=r.min_learners)
                (log.warning if below else log.info)("region below min_learners" if below else "region back at min_learners",
                                                     extra={"region": r.name, "live": n, "min_learners": r.min_learners})

    def handle_record(self, raw: bytes, tp: TP, offset: int) -> None:
        self.consumed[tp] = offset + 1
        self.assembler.read(partition_key(tp), len(raw))
        try:
            header, payload = messages.parse_frame(raw)
            cid = header.get("id")
            if not isinstance(cid, str) or not 0 < len(cid) <= 64:
                raise WireError(f"frame header needs a contribution id of 1-64 characters, got {messages.short(cid, 40)}")
        except WireError as err:
            self._reject(None, Reason.MALFORMED, str(err), where=(*tp, offset))
            return
        status = self.status.get(cid, "")
        if status and pending_fragment(status) is None:
            self.state.count("duplicate_records")
            return
        if status and self._pending(cid) is not None and self._pending(cid).deltas is not None:
            self.state.count("duplicate_records")
            return
        crash_point("record_received")
        try:
            result = self.assembler.add(header, payload, now=self.clock(), offset=offset, where=partition_key(tp))
        except WireError as err:
            self.assembler.discard(cid)
            self._reject(cid, Reason.MALFORMED, str(err), where=(*tp, offset))
            return
        if isinstance(result, Dropped):
            self._reject_dropped(result)
        elif isinstance(result, Assembled):
            self.on_complete(result, tp)

    def on_complete(self, a: Assembled, tp: TP) -> None:
        m = a.manifest
        pending = self._pending(m.id)
        if 0 <= m.fragment < len(self.plan) and m.fragment != self._fragment_of(tp):
            self._reject(m.id, Reason.MISROUTED, f"fragment {m.fragment} on partition {tp[1]}, which carries fragment "
                         f"{self._fragment_of(tp)}", manifest=m, where=(*tp, a.first_offset))
            return
        region = self.region_of_topic.get(tp[0])
        if region is not None and m.region != region:  # the broker's ACLs bind a writer to its region's topic
            self._reject(m.id, Reason.MISROUTED, f"a contribution of region {messages.short(m.region, 40)} on region "
                         f"{region}'s topic {tp[0]}", manifest=m, where=(*tp, a.first_offset))
            return
        verdict = self.validate(m, a.payload, replay=pending is not None)
        if isinstance(verdict, tuple):
            self._reject(m.id, *verdict, manifest=m, where=(*tp, a.first_offset))
            return
        if pending is not None:  # replay after a restart: the round already counts it
            pending.deltas = verdict
            return
        self._admit(m.learner)  # a joiner whose delta came before its first heartbeat is a member now
        meta = {"id": m.id, "learner": m.learner, "region": m.region, "fragment": m.fragment,
                "base_version": m.base_version, "tokens": m.tokens, "steps": m.steps, "step_time": m.step_time,
                "bytes": m.total_bytes, "arrival": self.clock(), "topic": tp[0], "partition": tp[1],
                "offset": a.first_offset, "created": m.created, "cursor": None if m.cursor is None else list(m.cursor)}
        st = self.fragments[m.fragment]
        st.round[m.id] = Pending(meta, meta["arrival"], tp, a.first_offset, verdict)
        self.status[m.id] = Status.pending(m.fragment)
        self.state.accept(m.fragment, m.id, meta, self.replay_offsets([m.fragment]), outbox=[self._outbox_event(
            "contribution_accepted", id=m.id, learner=m.learner, region=m.region, fragment=m.fragment,
            base_version=m.base_version, version=st.version, tokens=m.tokens, bytes=m.total_bytes,
            cursor=meta["cursor"])],
            fence={m.fragment: self.epochs[m.fragment]})

    def _check_manifest(self, m: Manifest):
        """(reason, detail) if the manifest alone rules the contribution out: judged before its chunks
        are buffered. A replayed contribution was judged on arrival."""
        return None if self._pending(m.id) is not None else self._check_claims(m, replay=False)

    def validate(self, m: Manifest, payload: bytes, *, replay: bool = False):
        """Decoded deltas, or (reason, detail) saying why the contribution cannot enter a merge (syncer/intake.py)."""
        return self.intake.check(m, payload, members=self.learners, fragment=self.fragments.get(m.fragment),
                                 replay=replay)

    def _check_claims(self, m: Manifest, *, replay: bool):
        return self.intake.check_claims(m, members=self.learners, fragment=self.fragments.get(m.fragment),
                                        replay=replay)

    # --- rounds --------------------------------------------------------------------------------
    def live_learners(self) -> set[str]:
        """Learners worth waiting for: heard from recently and not finished, or not heard from yet."""
        return {lid for lid in self.learners if lid not in self.registry or self.registry[lid]["status"] == "alive"}

    def present_learners(self) -> set[str]:
        """Learners still in the run: all but those that left (SIGTERM) or were dropped. A silent one
        may come back; a finished one's last rounds close at the final flush, as before joins existed."""
        return {lid for lid in self.learners
                if lid not in self.registry or self.registry[lid]["status"] not in ("left", "dropped")}

    def step_time_s(self) -> float:
        times = [hb.get("step_time", 0.0) for hb in self.registry.values()
                 if hb.get("step_time") and hb["status"] == "alive"]
        return float(np.median(times)) if times else 0.0

    def maybe_close(self, p: int, *, final: bool = False) -> None:
        st = self.fragments[p]
        d = rounds.due(self.policy, st, live=self.live_learners(), present=self.present_learners(), now=self.clock(),
                       step_time_s=self.step_time_s(), sync_time_s=self.sync_time_s,
                       quorum_of_fresh=self.cfg.syncer.quorum_of_fresh)
        if d is not None and (d.close or final):
            self.merge(p, reason=d.reason if d.close else "final_flush")

    def merge(self, p: int, *, reason: str) -> None:
        t0 = time.perf_counter()
        st = self.fragments[p]
        contribs = self._drop_norm_outliers(p, rounds.in_canonical_order(st.round.values()))
        if not contribs:
            return
        metas = [c.manifest_meta for c in contribs]
        sc = self.cfg.syncer
        live, contributors = self.live_learners(), {m["learner"] for m in metas}
        members = rounds.members(live, contributors, self.registry)
        share = merge_math.round_share(len(contribs), len(members)) if sc.scale_partial_rounds else 1.0
        try:
            closed = rounds.close_round(self.cfg, self.run_plan, st, p, contribs, share)
        except Exception as err:  # never write, announce or crash on what a round holds: reject it, say why
            log.exception("merge failed; rejecting the round", extra={"fragment": p, "ids": [m["id"] for m in metas]})
            for m in metas:
                self._reject(m["id"], Reason.MERGE_FAILED, f"fragment {p} round of {len(metas)}: {type(err).__name__}: {err}")
            return
        crash_point("merge_computed")
        ids = [m["id"] for m in metas]
        late = sum(1 for m in metas if m["base_version"] < st.version)
        record = {"fragment": p, "version": st.version + 1, "ids": ids, "learners": [m["learner"] for m in metas],
                  "tokens": sum(m["tokens"] for m in metas), "weights": [round(float(w), 6) for w in closed.weights],
                  # each contribution's tokens and data-stream cursor: the coverage ledger's input
                  "tokens_each": [m["tokens"] for m in metas], "cursors": [m.get("cursor") for m in metas],
                  "compute_s": [round(m["steps"] * m["step_time"], 4) for m in metas],
                  "base_versions": [m["base_version"] for m in metas], "late": late, "reason": reason,
                  "share": share,  # exact, with "where": what a rebuild since the last snapshot replays
                  "where": [[m["topic"], m["partition"], m["offset"]] for m in metas],
                  "missing": sorted(live - contributors), "time": self.clock(),
                  "waited_s": round(self.clock() - min(c.arrival for c in contribs), 4)}  # quorum and grace
        version = st.version + 1
        snapshot = version if version % self.cfg.store.snapshot_every == 0 else st.snapshot_at
        try:
            self.store.write(p, version, closed.params, merge_math.flatten_state(closed.opt_state), record,
                             epoch=self.epochs[p], residual=closed.residual, update=closed.update,
                             update_scheme=sc.broadcast, update_packing=sc.broadcast_packing, snapshot_at=snapshot,
                             update_from=st.update_from())
        except StoreFenced as err:
            raise Fenced(p, str(err)) from None
        crash_point("store_written")
        for cid in ids:
            del st.round[cid]
        sync_time = time.perf_counter() - t0
        ema = sync_time if self.sync_time_s == 0 else 0.8 * self.sync_time_s + 0.2 * sync_time
        try:
            merge_event = self._outbox_event("merge", fragment=p, version=st.version + 1, ids=ids,
                                             learners=record["learners"], tokens=record["tokens"], late=late,
                                             tokens_each=record["tokens_each"], cursors=record["cursors"],
                                             reason=reason, missing=record["missing"], seconds=round(sync_time, 4))
            self.state.commit_merge(p, from_version=st.version, ids=ids, late=late, record=record,
                                    offsets=self.replay_offsets([p]), sync_time_s=ema, outbox=[
                                        announcement(self.topics, self.cfg, self.run_id, p, st.version + 1), merge_event],
                                    fence={p: self.epochs[p]})
        except Fenced:
            raise
        except StaleVersion:
            log.error("merge lost a race for fragment %d; reloading", p)
            raise
        crash_point("merge_committed")
        st.version += 1
        st.params, st.opt_state, st.residual, st._scale = closed.params, closed.opt_state, closed.residual, None
        if snapshot != st.snapshot_at and sc.updates_from == "snapshot":  # the base of every next update
            st.snapshot = closed.params
        st.snapshot_at = snapshot
        self.sync_time_s = ema
        for cid in ids:
            self.status[cid] = Status.applied(p, st.version)
        self.store.mark_committed(p, st.version)
        m, committed_at = self.metrics, self.clock()
        m.round_size.labels(p).set(len(ids))
        m.merges.labels(p).inc()
        m.merge_seconds.labels(p).observe(sync_time)
        for c in contribs:
            m.accept_to_merge.labels(p).observe(max(committed_at - c.arrival, 0.0))
        log.info("merged", extra={"shard": self.shard, "fragment": p, "version": st.version, "contributions": len(ids), "late": late,
                                  "reason": reason, "seconds": round(sync_time, 4)})

    def _drop_norm_outliers(self, p: int, contribs: list[Pending]) -> list[Pending]:
        outliers = rounds.norm_outliers(contribs, self.cfg.syncer.norm_outlier_factor)
        for c, n, median in outliers:
            self._reject(c.manifest_meta["id"], Reason.NORM_OUTLIER,
                         f"norm {n:.3g} > {self.cfg.syncer.norm_outlier_factor} x median {median:.3g}")
        dropped = {id(c) for c, _, _ in outliers}
        return [c for c in contribs if id(c) not in dropped]

    # --- offsets and bookkeeping ---------------------------------------------------------------
    def replay_offsets(self, fragments=None) -> dict[TP, int]:
        """Per partition of the given owned fragments (default all), the first offset whose effect is
        not yet durable (where a restart or the next owner resumes)."""
        frags = sorted(self.fragments) if fragments is None else fragments
        out = {tp: self.consumed[tp] for p in frags for tp in self._tps(p) if tp in self.consumed}
        for p in frags:
            for c in self.fragments[p].round.values():
                if c.first_offset is not None and c.tp in out:
                    out[c.tp] = min(out[c.tp], c.first_offset)
        for tp in out:
            partial = self.assembler.pending_offsets(partition_key(tp))
            if partial:
                out[tp] = min(out[tp], min(partial))
        return out

    def save_offsets(self, force: bool = False) -> None:
        if not self.every_offsets_save.due(force=force):
            return
        self.state.save_events_offset(self.shard, self.consumed[self.events_tp])
        for p in list(self.fragments):
            self._guarded(p, lambda p=p: self.state.save_offsets(self.replay_offsets([p]), fence={p: self.epochs[p]}))
        self.commit_group_offsets()
        if self.every_prune.due():
            for p in list(self.fragments):
                self._guarded(p, lambda p=p: self.prune_statuses(p))

    def commit_group_offsets(self) -> None:
        """Commit the replay offsets just saved in Redis (those of the fragments still owned) as the
        consumer group's offsets, so Kafka's own tools show the syncer's lag. Monitoring only: Redis
        stays the source of truth, and a failed commit is logged (once until one succeeds), never raised."""
        if self.consumer.config["group_id"] is None or not self.broker.up:
            return
        offsets = {TopicPartition(*tp): OffsetAndMetadata(off, "", -1) for tp, off in self.replay_offsets().items()}
        try:
            self.consumer.commit(offsets, timeout_ms=2000)
            self._commit_failed = False
        except KafkaError as err:
            if not self._commit_failed:
                log.warning("consumer group commit failed (monitoring only; Redis keeps the offsets)",
                            extra={"group": self.consumer.config["group_id"], "error": f"{type(err).__name__}: {err}"})
            self._commit_failed = True

    def prune_statuses(self, p: int) -> None:
        """Forget what finished ids of fragment p replay will never meet again (bounded status)."""
        for tp, below in self.replay_offsets([p]).items():
            for cid in self.state.prune_statuses(tp, below, self.cfg.syncer.status_keep, fence={p: self.epochs[p]}):
                self.status.pop(cid, None)

    def _pending(self, cid: str) -> Pending | None:
        p = pending_fragment(self.status.get(cid, ""))
        st = self.fragments.get(p) if p is not None else None
        return st.round.get(cid) if st else None

    def _read_to_end(self, where: str) -> bool:
        """Whether partition `where` ("topic|partition") was read up to its high watermark."""
        tp = TopicPartition(*parse_partition_key(where))
        hw = self.consumer.highwater(tp)
        return hw is not None and tp in self.consumer.assignment() and self.consumer.position(tp) >= hw

    def _give_up_lost_payloads(self) -> None:
        """An accepted contribution whose payload a replay does not bring back cannot be merged.

        Its payload is lost once no partial set holds it and the reader is past its first record or
        at the end of its partition (a truncated or recreated log): it was not in the log. A set of it
        that expires is lost too (`_reject_dropped`). Either way it is rejected as lost_payload, logged
        as an error and announced as a `payload_lost` event: its round waited for it until then.
        """
        if not self._replaying:
            return
        waiting = False
        for p, st in list(self.fragments.items()):
            for cid, c in list(st.round.items()):
                if c.deltas is not None:
                    continue
                where = partition_key(c.tp)
                tp = TopicPartition(*c.tp)
                position = self.consumer.position(tp) if tp in self.consumer.assignment() else 0
                if cid in self.assembler or (position <= c.first_offset and not self._read_to_end(where)):
                    waiting = True
                    continue
                detail = f"records from {where}@{c.first_offset} are not in the log (read to offset {position})"
                self._guarded(p, lambda cid=cid, c=c, d=detail: self._lose(cid, c, d))
        self._replaying = waiting

    def _lose(self, cid: str, c: Pending, detail: str) -> None:
        p = self._fragment_of(c.tp)
        log.error("accepted contribution lost: its payload is not in the log",
                  extra={"id": cid, "fragment": p, "detail": detail})
        self._reject(cid, Reason.LOST_PAYLOAD, detail)
        self._event("payload_lost", id=cid, fragment=p, learner=c.manifest_meta.get("learner"), detail=detail)

    def _reject_dropped(self, d: Dropped) -> None:
        where = tuple(d.where.rsplit("|", 1)) + (d.first_offset,) if d.where else None
        p = int(where[1]) if where else (d.manifest.fragment if d.manifest else -1)
        if (pending := self._pending(d.id)) is not None:  # accepted before: its replay came back short
            self._guarded(p, lambda: self._lose(d.id, pending, f"{d.reason} on replay: {d.detail}"))
            return
        self._guarded(p, lambda: self._reject(d.id, d.reason, d.detail, manifest=d.manifest, where=where))

    def _reject(self, cid: str | None, reason: str, detail: str, *, manifest: Manifest | None = None,
                where=None) -> None:
        fragment = None
        if cid is not None and (fragment := pending_fragment(self.status.get(cid, ""))) is not None:
            # it leaves its round, in memory and in Redis
            if fragment in self.fragments and (c := self.fragments[fragment].round.pop(cid, None)) is not None:
                where = where or (*c.tp, c.first_offset)
        # the fragment whose partition the record came from: only its owner may say anything about it
        about = fragment if fragment is not None else (int(where[1]) if where is not None else None)
        fence = {about: self.epochs[about]} if about in self.epochs else None
        fields = {"id": cid if cid is None else cid[:64], "reason": reason, "detail": messages.bounded(detail)}
        if manifest is not None:
            fields |= {"learner": manifest.learner, "region": manifest.region, "fragment": manifest.fragment,
                       "base_version": manifest.base_version}
        if where is not None:
            fields["where"] = {"topic": where[0], "partition": int(where[1]), "offset": where[2]}
        self.state.reject(cid, reason, self.replay_offsets([about] if fence else []), fragment=fragment,
                          outbox=[self._outbox_event("contribution_rejected", **fields)], fence=fence,
                          where=(where[0], int(where[1]), where[2]) if where is not None else None)
        if cid is not None:
            self.status[cid] = Status.rejected(reason)
        self.metrics.rejections.labels("-" if about is None else about, reason).inc()
        log.warning("rejected contribution", extra=fields)

    def _outbox_event(self, kind: str, **fields) -> dict:
        value = messages.event(kind, run=self.run_id, source="syncer", **fields)
        return {"topic": self.topics.events, "partition": 0, "value": value.decode()}

    def _event(self, kind: str, **fields) -> None:
        self.producer.send(self.topics.events, messages.event(kind, run=self.run_id, source="syncer", **fields),
                           partition=0)


def main(cfg: Config, run_id: str, shard: int = 0) -> None:
    """Entry point of one syncer shard's process."""
    from diloco.syncer import state as state_mod

    r = state_mod.connect(cfg.state)
    st = SyncerState(r, cfg.state.key_prefix, run_id)
    store = FragmentStore(cfg.store.url, run_id)
    producer = kafka_io.producer(cfg.transport)
    consumer = kafka_io.consumer(cfg.transport, group_id=kafka_io.Topics.for_run(cfg, run_id).syncer_group)
    syncer = Syncer(cfg, run_id, state=st, store=store, producer=producer, consumer=consumer, shard=shard)
    if port := cfg.syncer_port(shard):
        serve(syncer, cfg.monitoring.host, port)
    syncer.run()
    producer.close()


def serve(syncer: Syncer, host: str, port: int):
    """The shard's endpoint: /metrics, the status page at / and /status.json (diloco/status.py)."""
    server = metrics_mod.serve(syncer.metrics.registry, host, port, pages={
        "/": ("text/html", lambda: status_mod.html(syncer.live_status())),
        "/status.json": ("application/json", lambda: status_mod.to_json(syncer.live_status()))})
    log.info("metrics and status page served", extra={"url": f"http://{host}:{port}/", "shard": syncer.shard})
    return server


__all__ = ["Syncer", "provision", "announce", "main", "TopicPartition"]
