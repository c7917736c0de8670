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

import logging
import time
from collections import deque

from diloco import messages, signing
from diloco import metrics as metrics_mod
from diloco.config import Config
from diloco.faults import crash_point
from diloco.infra import kafka as kafka_io
from diloco.infra.kafka import LogError
from diloco.infra.state import ServiceError
from diloco.infra.store import FragmentStore, StoreFenced
from diloco.messages import Assembled, Dropped, Manifest, Reason, WireError
from diloco.syncer import durability, fused, rebuild, replay, rounds
from diloco.syncer import merge as merge_math
from diloco.syncer import shards as shards_mod
from diloco.syncer.intake import Intake, read_frame
from diloco.syncer.ownership import Ownership
from diloco.periodic import Every
from diloco.syncer.policy import QuorumPolicy
from diloco.syncer.provision import announce, announcement
from diloco.syncer.records import (TP, Contribution, Status, Where, accepted_fields, parse_partition_key,
                                   partition_key, pending_fragment, rejection_fields, replay_mismatch)
from diloco.syncer.registry import LearnerRegistry
from diloco.syncer.rounds import FragmentState, Pending
from diloco.syncer.relay import Events, OutboxRelay
from diloco.syncer.state import Fenced, StaleVersion, SyncerState, wait_until_up

log = logging.getLogger(__name__)


class Syncer:
    """One syncer shard: merges the fragments it holds leases on (all of them when it runs alone)."""

    def __init__(self, cfg: Config, run_id: str, *, state: SyncerState, store: FragmentStore, producer, consumer,
                 shard: int = 0, clock=time.time):
        self.cfg, self.run_id, self.state, self.store = cfg, run_id, state, store
        self.producer, self.consumer, self.clock = producer, consumer, clock
        self.topics = kafka_io.Topics.for_run(cfg, run_id)
        self.run_plan = store.read_plan()      # what the run syncs; no model code needed
        self.plan, self.shard = self.run_plan.fragment_names, shard
        shards_mod.check_layout(self.topics.partitions, len(self.plan), shard, cfg.syncer.shards)
        self.events = Events(producer, self.topics.events, run_id)
        self.opt = merge_math.outer_optimizer(cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
        self.policy = QuorumPolicy(cfg.syncer.quorum, cfg.syncer.overlap_steps, cfg.syncer.grace_gamma,
                                   cfg.syncer.grace_max_s)
        self.events_tp: TP = (self.topics.events, 0)
        self.region_of_topic = {topic: region for region, topic in self.topics.fragments.items()}
        self.registry = LearnerRegistry(cfg, state, self.events.send, clock)
        self.broker = kafka_io.BrokerWatch(cfg.transport, f"syncer-{shard}")
        self.outbox = OutboxRelay(state, producer, self.broker)
        self.group_offsets = replay.GroupOffsets(consumer, self.broker)
        self.ownership = Ownership(state, shard, cfg.syncer.shards, len(self.plan), cfg.syncer.lease_ttl_s,
                                   cfg.syncer.stuck_after_s, clock)
        self.intake = Intake(cfg, run_id, self.run_plan)
        self.metrics = metrics_mod.SyncerMetrics(shard)
        self.stopping, self.recent = False, deque(maxlen=200)  # recent: newest events but beats (status page)
        self._reset()

    def _reset(self) -> None:
        """Forget everything held in memory: what start() rebuilds from Redis, TensorStore and Kafka."""
        self.fragments: dict[int, FragmentState] = {}   # the fragments this shard owns (epochs: self.ownership)
        self.status: dict[str, str] = {}
        self.consumed: dict[TP, int] = {}
        self.assembler = self.intake.assembler(check=self._check_manifest)
        self.sync_time_s = 0.0
        self.registry.coordinator = False
        self._replaying = False
        # periodic work, each on its own cadence
        self.every_offsets_save, self.every_prune = Every(1.0, self.clock), Every(10.0, self.clock)
        self.every_registry_check, self.every_observe = Every(0.5, self.clock), Every(1.0, self.clock)
        self.every_lease = Every(self.cfg.syncer.lease_ttl_s / 3, self.clock)

    # --- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.broker.is_alive():
            self.broker.start()
        fused.warm_up()  # the merge kernels compile (or load from cache) now, not during the first rounds
        self.ownership.start(stopping=lambda: self.stopping)
        try:
            self._resume()
        except BaseException:  # a refused start must not leave its membership renewed behind it
            self.close()
            raise

    def _resume(self) -> None:
        """Reload what Redis holds, claim this shard's fragments and say the syncer started."""
        versions = durability.provisioned_versions(self.state, self.store, self.run_id, len(self.plan))
        self.sync_time_s = self.state.stats().get("sync_time_s", 0.0)
        self.registry.resume(under_way=any(versions.values()))  # the registry survives a restart
        self.consumed = {self.events_tp: self.state.events_offset(self.shard)}
        self.rebalance(force=True)
        self.outbox.relay()  # what a crashed predecessor committed but did not get to publish
        self.events.send("syncer_started", shard=self.shard, fragments=sorted(self.fragments),
                         versions={p: f.version for p, f in self.fragments.items()},
                         pending=sum(len(f.round) for f in self.fragments.values()))
        log.info("syncer started", extra={"run": self.run_id, "shard": self.shard, "fragments": sorted(self.fragments),
                                          "replay_from": {partition_key(tp): o for tp, o in self.consumed.items()}})

    def close(self) -> None:
        """Stop renewing and leave the membership (leases lapse or go to this shard's next process)."""
        self.ownership.leave()

    def finish(self, *, caught_up: bool = True) -> None:
        """A clean stop: the final flush, outbox and offsets out, leases handed over, what was left unread said."""
        if unread := {} if caught_up else replay.unread(self.consumer):
            log.error("stopped before catching up: records left unread", extra={"shard": self.shard, "unread": unread})
        if self.cfg.syncer.flush_on_stop:
            for p in list(self.fragments):
                self._guarded(p, lambda p=p: self.maybe_close(p, final=True))
        self.outbox.relay()
        self.save_offsets(force=True)
        versions = {p: f.version for p, f in self.fragments.items()}
        self.events.send("syncer_stopped", shard=self.shard, versions=versions, unread=unread)
        self.ownership.leave(release=True)

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
        self.ownership.keeper.alive_at = time.monotonic()
        batch = self.consumer.poll(timeout_ms=self.cfg.syncer.poll_ms, max_records=500)
        for key, records in batch.items():
            for rec in records:
                if key not in self.consumed:
                    break                         # the partition went with its fragment meanwhile
                self._guarded(key[1], lambda k=key, r=rec: self._handle(k, r))  # partition p: fragment p
        now = self.clock()
        for d in self.assembler.expire(now, caught_up=lambda where: replay.read_to_end(self.consumer,
                                                                                      parse_partition_key(where))):
            self._reject_dropped(d)
        self._give_up_lost_payloads()
        if self.every_registry_check.due():
            self.registry.check()
        for p in list(self.fragments):
            self._guarded(p, lambda p=p: self.maybe_close(p))
        self.outbox.relay(only_if_written=True)
        self.save_offsets()
        self.rebalance()
        self.observe()

    def _handle(self, key: TP, rec) -> None:
        try:
            if key == self.events_tp:
                self.consumed[key] = rec.offset + 1
                self.handle_event(rec.value)
            else:
                self.handle_record(rec.value, key, rec.offset, rec.headers)
        except (ServiceError, LogError, Fenced):
            raise                     # the service or the ownership, not the record: handled above
        except Exception as err:  # one bad record must never stop the syncer
            log.exception("record handling failed", extra={"topic": key[0], "offset": rec.offset})
            self._reject(None, Reason.INTERNAL_ERROR, f"{type(err).__name__}: {err}", where=Where(*key, rec.offset))

    # --- ownership -----------------------------------------------------------------------------
    def rebalance(self, *, force: bool = False) -> None:
        """Renew leases and membership; hand back fragments whose home shard is live again; claim
        the fragments this shard should own that nobody holds. Runs every third of the lease TTL."""
        if not self.every_lease.due(force=force):
            return
        # force: a (re)start, also one after a Redis outage during the stop
        moves = self.ownership.moves(claiming=not self.stopping or force)
        if moves is None:  # this process stalled past its TTL and another one is this shard now
            log.error("another process took over shard %d; handing everything back and standing by", self.shard)
            self._reset()
            self.start()
            return
        self.registry.coordinator = moves.coordinator
        for p in moves.drop:
            self.drop(p, "lease lost (this shard stalled past the lease TTL)")
        for p in moves.release:
            self.release(p)
        taken = self.ownership.claim(moves.claim)
        if taken:  # load each one's version, open round and replay offsets (statuses and offsets read once)
            self.status.update(self.state.statuses())
            offsets = self.state.offsets()
            for p, epoch, previous in taken:
                self._load(p, epoch, previous, offsets)
        if moves.drop or moves.release or taken or force:
            self._assign()

    def _load(self, p: int, epoch: int, previous: str | None, offsets: dict[TP, int]) -> None:
        v = self.state.version(p)
        durability.check_fragment(self.state, self.store, self.run_id, p, v)
        st = self.rebuild_fragment(p, v)
        st.round.update({cid: Pending(Contribution.from_meta(meta)) for cid, meta in self.state.round(p).items()})
        for tp in self.topics.partitions_of(p):
            self.consumed[tp] = offsets.get(tp, 0)
        self.fragments[p] = st
        self._replaying |= bool(st.round)  # their payloads come back from the log
        self.store.mark_committed(p, v)   # Redis's version is committed: after a crash the marker may lag
        announce(self.producer, self.topics, self.cfg, self.run_id, p, v)  # at least once: learners dedupe
        self.events.send("fragment_claimed", fragment=p, shard=self.shard, epoch=epoch, version=v,
                         pending=len(st.round), previous=previous)
        log.info("fragment claimed", extra={"fragment": p, "shard": self.shard, "epoch": epoch, "version": v,
                                            "previous_owner": previous, "pending": len(st.round)})

    def rebuild_fragment(self, p: int, v: int) -> FragmentState:
        """Fragment p's state at version v, exact or said to be approximate (syncer/rebuild.py)."""
        return rebuild.load(self.cfg, self.run_id, self.run_plan, self.opt, self.store, self.state.merges(), p, v,
                            emit=self.events.send)

    def release(self, p: int) -> None:
        """Hand fragment p back: its replay offsets first, so the next owner resumes where this one was."""
        try:
            self.state.save_offsets(self.replay_offsets([p]), fence=self.ownership.fence(p))
        except Fenced:
            pass
        self.ownership.release(p)
        self.drop(p, "handed to its home shard")

    def drop(self, p: int, why: str) -> None:
        """Forget fragment p here; what was accepted for it is in Redis for its next owner."""
        if self.fragments.pop(p, None) is None:
            return
        self.ownership.forget(p)
        for tp in self.topics.partitions_of(p):
            self.consumed.pop(tp, None)
            self.assembler.discard_where(partition_key(tp))
        self.events.send("fragment_released", fragment=p, shard=self.shard, reason=why)
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
        self.consumer.assign(self.consumed)

    def observe(self) -> None:
        """Set the gauges that describe what this shard holds now (once a second): versions, leases,
        open rounds, consumer lag, outbox, learners by liveness. Fragments it no longer owns leave."""
        if not self.every_observe.due():
            return
        self.metrics.held(len(self.plan), self.fragments, dict(self.ownership.epochs), replay.lags(self.consumer),
                          self.state.outbox_depth(), self.registry.by_status())

    def caught_up(self) -> bool:
        """Every owned partition read to its high watermark, and no chunk set waiting for more."""
        c = self.consumer
        return all(replay.read_to_end(c, tp) for tp in c.assignment()) and not len(self.assembler)

    # --- records -------------------------------------------------------------------------------
    def handle_event(self, raw: bytes) -> None:
        ev = messages.parse_event(raw)
        if ev and ev["kind"] != "heartbeat":
            self.recent.append(ev)
        elif ev and isinstance(ev.get("learner"), str):
            self.registry.heard(ev)

    def handle_record(self, raw: bytes, tp: TP, offset: int, headers=None) -> None:
        self.consumed[tp] = offset + 1
        self.assembler.read(partition_key(tp), len(raw))
        try:  # a signed run's frame is judged by its signature before anything in it is read
            signer = self.intake.signer(raw, headers)
        except signing.SigningError as err:
            self._reject(None, Reason.BAD_SIGNATURE, str(err), where=Where(*tp, offset))
            return
        try:
            typed, header, payload = read_frame(raw)
        except WireError as err:
            self._reject(None, Reason.MALFORMED, str(err), where=Where(*tp, offset))
            return
        cid = typed.id
        if signer is not None and (why := self.intake.not_the_signers(typed, signer,
                                                                      self.assembler.signer(cid, partition_key(tp)))):
            self._reject(cid, *why, where=Where(*tp, offset), settles=False)  # this frame alone: the set is not its
            return
        status, pending = self.status.get(cid, ""), self._pending(cid)
        if status and (pending_fragment(status) is None or (pending is not None and pending.deltas is not None)):
            self.state.count("duplicate_records")  # finished, or accepted with its payload in hand already
            return
        crash_point("record_received")
        try:
            result = self.assembler.add(header, payload, now=self.clock(), offset=offset, where=partition_key(tp),
                                        signer=signer)
        except WireError as err:
            self.assembler.discard(cid, partition_key(tp))
            self._reject_set(cid, Reason.MALFORMED, str(err), where=Where(*tp, offset))
            return
        if isinstance(result, Dropped):
            self._reject_dropped(result)
        elif isinstance(result, Assembled):
            self.on_complete(result, tp)

    def on_complete(self, a: Assembled, tp: TP) -> None:
        m, where = a.manifest, Where(*tp, a.first_offset)
        pending = self._pending(m.id)
        why = (replay_mismatch(pending.contribution, m, where) if pending is not None else  # not the record accepted
               self._taken(m.id, a.started))
        if why:
            self._reject_set(m.id, Reason.DUPLICATE_ID, why, manifest=m, where=where)
            return
        verdict = self.intake.check_route(m, tp, self.region_of_topic.get(tp[0])) or self.intake.check(
            m, a.payload, members=self.registry.members, fragment=self.fragments.get(m.fragment))
        if isinstance(verdict, tuple):
            conflicts = f" ({a.conflicts} repeated chunks with other bytes ignored)" if a.conflicts else ""
            self._reject_set(m.id, verdict.reason, verdict.detail + conflicts, manifest=m, where=where)
            return
        if pending is not None:  # replay after a restart: the round already counts it
            pending.deltas = verdict
        elif why := self.intake.check_budget(m, self.fragments[m.fragment]):
            self._reject_set(m.id, why.reason, why.detail, manifest=m, where=where)
            return
        else:
            self._accept(m, where, verdict)
        self._drop_other_sets(m.id, where)

    def _accept(self, m: Manifest, where: Where, deltas) -> None:
        self.registry.admit(m.learner)  # a joiner whose delta came before its first heartbeat is a member now
        c = Contribution.accepted(m, where, arrival=self.clock())
        st = self.fragments[m.fragment]
        st.round[m.id] = Pending(c, deltas)
        self.status[m.id] = Status.pending(m.fragment)
        accepted = self.events.outbox("contribution_accepted", **accepted_fields(c, st.version))
        self.state.accept(m.fragment, m.id, c.meta(), self.replay_offsets([m.fragment]), outbox=[accepted],
                          fence=self.ownership.fence(m.fragment))

    def _check_manifest(self, m: Manifest):
        """(reason, detail) if the manifest alone rules the contribution out: judged before its chunks
        are buffered, on replay too (what the log gives back may not be what was accepted)."""
        return self.intake.check_claims(m, members=self.registry.members, fragment=self.fragments.get(m.fragment))

    def _own_set(self, cid: str, where: Where) -> bool:
        """Whether the set of `cid` read from `where` is the one its id stands for, so that its outcome
        settles the id: the pending record's own place and first offset, or, for an id nothing was
        decided of yet, no other set of it is being assembled elsewhere. A contribution's frames share
        one partition, so a set anywhere else is another writer's (docs/wire-format.md)."""
        pending = self._pending(cid)
        if pending is not None:
            return where == pending.contribution.where
        if self.status.get(cid):
            return False
        return not [w for w in self.assembler.places(cid) if w != partition_key(where.tp)]

    def _taken(self, cid: str, started: int) -> str | None:
        """Why a complete set of an id nothing was decided of may not take it: a set of that id with a
        manifest was under way at another place before it began (the writer who learnt the id from the
        log wrote after the one who chose it; that one completes or fails by itself)."""
        if rivals := self.assembler.rivals(cid, started):
            return f"id {cid} is being assembled at {rivals[0]}, begun before this set"
        return None

    def _drop_other_sets(self, cid: str, where: Where) -> None:
        """The id's own set completed at `where` and counts: sets of it elsewhere are rejected now, each
        by itself (the id's status stays the one its own set gave it)."""
        taken = f"id {cid} is taken by the contribution at {partition_key(where.tp)}@{where.offset}"
        for other in self.assembler.places(cid):
            self._reject_dropped(self.assembler.drop(cid, other, Reason.DUPLICATE_ID, taken))

    # --- rounds --------------------------------------------------------------------------------
    def maybe_close(self, p: int, *, final: bool = False) -> None:
        st = self.fragments[p]
        if st.awaiting_payloads():
            return
        d = rounds.due(self.policy, st.version, st.arrivals(), live=self.registry.live(),
                       present=self.registry.present(), now=self.clock(), step_time_s=self.registry.step_time_s(),
                       sync_time_s=self.sync_time_s, quorum_of_fresh=self.cfg.syncer.quorum_of_fresh)
        if d is not None and (d.close or final):
            self.merge(p, reason=d.reason if d.close else "final_flush")

    def merge(self, p: int, *, reason: str) -> None:
        """Close fragment p's round: merge and outer step, store write, one Redis commit (the protocol's
        steps 2-6, in the module docstring), each crash point between two of them."""
        t0 = time.perf_counter()
        st, sc, live = self.fragments[p], self.cfg.syncer, self.registry.live()
        outcome = rounds.close(self.cfg, self.run_plan, st, p, live=live, registry=self.registry)
        for c, norm, median in outcome.outliers:
            self._reject(c.contribution.id, Reason.NORM_OUTLIER,
                         f"norm {norm:.3g} > {sc.norm_outlier_factor} x median {median:.3g}")
        contribs, share, closed = outcome.merged, outcome.share, outcome.closed
        if not contribs:
            return
        ids = [c.contribution.id for c in contribs]
        if closed is None:  # never write, announce or crash on what a round holds: reject it, say why
            err = outcome.failure
            log.error("merge failed; rejecting the round", extra={"fragment": p, "ids": ids}, exc_info=err)
            for cid in ids:
                self._reject(cid, Reason.MERGE_FAILED, f"fragment {p} round of {len(ids)}: {type(err).__name__}: {err}")
            return
        crash_point("merge_computed")
        record = rounds.merge_record(p, st.version, contribs, closed.weights, reason=reason, share=share, live=live,
                                     now=self.clock())
        version, late = st.version + 1, record["late"]
        snapshot = version if version % self.cfg.store.snapshot_every == 0 else st.snapshot_at
        try:
            self.store.write(p, version, closed.params, merge_math.flatten_state(closed.opt_state), record,
                             epoch=self.ownership.epochs[p], residual=closed.residual, update=closed.update,
                             update_scheme=sc.broadcast, update_packing=sc.broadcast_packing, snapshot_at=snapshot,
                             update_from=st.update_from())
        except StoreFenced as err:
            raise Fenced(p, str(err)) from None
        crash_point("store_written")
        for cid in ids:
            del st.round[cid]
        sync_time = time.perf_counter() - t0
        ema = sync_time if self.sync_time_s == 0 else 0.8 * self.sync_time_s + 0.2 * sync_time
        merge_event = self.events.outbox("merge", **rounds.merge_event_fields(record, sync_time))
        try:
            self.state.commit_merge(p, from_version=st.version, ids=ids, late=late, record=record,
                                    offsets=self.replay_offsets([p]), sync_time_s=ema, outbox=[
                                        announcement(self.topics, self.cfg, self.run_id, p, version), merge_event],
                                    fence=self.ownership.fence(p))
        except StaleVersion:
            log.error("merge lost a race for fragment %d; reloading", p)
            raise
        crash_point("merge_committed")
        st.advance(version, closed.params, closed.opt_state, closed.residual, snapshot_at=snapshot,
                   keep_snapshot=sc.updates_from == "snapshot", tokens=record["tokens"])
        self.sync_time_s = ema
        for cid in ids:
            self.status[cid] = Status.applied(p, version)
        self.store.mark_committed(p, version)
        committed_at = self.clock()
        self.metrics.merged(p, len(ids), sync_time, [committed_at - c.contribution.arrival for c in contribs])
        log.info("merged", extra={"shard": self.shard, "fragment": p, "version": version, "contributions": len(ids),
                                  "late": late, "reason": reason, "seconds": round(sync_time, 4)})

    # --- offsets and bookkeeping ---------------------------------------------------------------
    def replay_offsets(self, fragments=None) -> dict[TP, int]:
        """Per partition of the given owned fragments (default all), the first offset whose effect is
        not yet durable (where a restart or the next owner resumes): syncer/replay.py."""
        frags = sorted(self.fragments) if fragments is None else fragments
        return replay.replay_offsets(self.consumed, {p: self.fragments[p].round for p in frags},
                                     self.topics.partitions_of, self.assembler.pending_offsets)

    def save_offsets(self, force: bool = False) -> None:
        if not self.every_offsets_save.due(force=force):
            return
        self.state.save_events_offset(self.shard, self.consumed[self.events_tp])
        self.state.save_read_to(self.shard, {tp: off for tp, off in self.consumed.items() if tp != self.events_tp})
        for p in list(self.fragments):
            self._guarded(p, lambda p=p: self.state.save_offsets(self.replay_offsets([p]),
                                                                 fence=self.ownership.fence(p)))
        self.group_offsets.commit(self.replay_offsets())  # Kafka's own tools show the syncer's lag
        if self.every_prune.due():
            for p in list(self.fragments):
                self._guarded(p, lambda p=p: self.prune_statuses(p))

    def prune_statuses(self, p: int) -> None:
        """Forget what finished ids of fragment p replay will never meet again (bounded status)."""
        for tp, below in self.replay_offsets([p]).items():
            for cid in self.state.prune_statuses(tp, below, self.cfg.syncer.status_keep, fence=self.ownership.fence(p)):
                self.status.pop(cid, None)

    def _pending(self, cid: str) -> Pending | None:
        p = pending_fragment(self.status.get(cid, ""))
        st = self.fragments.get(p) if p is not None else None
        return st.round.get(cid) if st else None

    def _give_up_lost_payloads(self) -> None:
        """An accepted contribution whose payload a replay does not bring back cannot be merged: it is
        rejected as lost_payload, logged as an error and announced as a `payload_lost` event (its round
        waited for it until then). A set of it that expires is lost too (`_reject_dropped`)."""
        if not self._replaying:
            return
        lost, self._replaying = replay.lost_payloads({p: st.round for p, st in self.fragments.items()}, self.consumer,
                                                     assembling=self.assembler.holds)
        for p, cid, pending, detail in lost:
            if p in self.fragments:
                self._guarded(p, lambda cid=cid, c=pending, d=detail: self._lose(cid, c, d))

    def _lose(self, cid: str, c: Pending, detail: str) -> None:
        p = c.contribution.where.partition
        log.error("accepted contribution lost: its payload is not in the log",
                  extra={"id": cid, "fragment": p, "detail": detail})
        self._reject(cid, Reason.LOST_PAYLOAD, detail)
        self.events.send("payload_lost", id=cid, fragment=p, learner=c.contribution.learner, detail=detail)

    def _reject_dropped(self, d: Dropped) -> None:
        where = Where(*parse_partition_key(d.where), d.first_offset) if d.where else None
        p = where.partition if where else (d.manifest.fragment if d.manifest else -1)
        own = where is None or self._own_set(d.id, where)
        if own and (pending := self._pending(d.id)) is not None:  # accepted before: its replay came back short
            self._guarded(p, lambda: self._lose(d.id, pending, f"{d.reason} on replay: {d.detail}"))
            return
        self._guarded(p, lambda: self._reject(d.id, d.reason, d.detail, manifest=d.manifest, where=where, settles=own))

    def _reject_set(self, cid: str, reason: Reason, detail: str, *, where: Where,
                    manifest: Manifest | None = None) -> None:
        """Reject a set of `cid` read from `where`: the id with it where the set is the id's own
        (`_own_set`), else that record alone, said with its id, and the id's status untouched."""
        self._reject(cid, reason, detail, manifest=manifest, where=where, settles=self._own_set(cid, where))

    def _reject(self, cid: str | None, reason: Reason, detail: str, *, manifest: Manifest | None = None,
                where: Where | None = None, settles: bool = True) -> None:
        """Reject contribution `cid` (None: a record naming none) and say why; with `settles` False only
        a record that names it (a set of it from another place), leaving the id's status as it is."""
        settled = cid if settles else None
        fragment = None
        if settled is not None and (fragment := pending_fragment(self.status.get(settled, ""))) is not None:
            # it leaves its round, in memory and in Redis
            if fragment in self.fragments and (c := self.fragments[fragment].round.pop(cid, None)) is not None:
                where = where or c.contribution.where
        # the fragment whose partition the record came from: only its owner may say anything about it
        about = fragment if fragment is not None else (where.partition if where is not None else None)
        fence = self.ownership.fence(about) if about in self.ownership.epochs else None
        fields = rejection_fields(cid, reason, detail, manifest, where)
        self.state.reject(settled, reason, self.replay_offsets([about] if fence else []), fragment=fragment,
                          outbox=[self.events.outbox("contribution_rejected", **fields)], fence=fence, where=where)
        if settled is not None:
            self.status[settled] = Status.rejected(reason)
        self.metrics.rejections.labels("-" if about is None else about, reason).inc()
        log.warning("rejected contribution", extra=fields)


__all__ = ["Syncer"]
