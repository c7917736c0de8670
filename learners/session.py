"""The learner's side of a run, around the user's own training loop: `Session`.

    with Session(cfg, learner="us-0") as session:
        params = session.join(params)                  # the run's global version, in your pytree
        for batch in batches:
            params, opt_state, loss = train_step(params, opt_state, batch)   # your jitted step
            params = session.step(params, tokens=n_tokens, loss=loss)       # sync and apply

The training loop never waits for the network, nor for its devices. At a fragment's sync point
`step` dispatches jitted functions that form the fragment's outer deltas (anchor - local),
quantize them on the devices and move the anchors (learners/outer.py); only the codes cross to the
host, copied asynchronously and read by a publisher thread, which frames and sends them. A fetcher
thread follows the outer topic and brings a fragment's newest version from TensorStore as one
update, when it is announced or only a few steps before the fragment's next sync
(`fragments.fetch`), and `step` applies it at the next call (`fragments.apply`: rebase, overwrite
or mix; jitted too). The loss is read when a heartbeat reports it, so the
next step queues while this one runs. Only synchronous DiLoCo (`fragments.wait_for_merge`, the
benchmark's baseline) stops, overlap_steps after a send, until that fragment's merge arrives.
Leaves outside the plan (RNG keys, counters, local statistics) are never touched. Values keep
their leaf's dtype and device placement (sharding). The anchors live in host memory by default
(`fragments.anchor`): the devices hold the user's state and one fragment's transients.

A learner may span many devices and hosts (learners/parallel.py). Then no host ever holds the
model: each host keeps its own shards of the anchors, at a sync codes the blocks it holds and sends
them itself, as its part of one contribution (nothing is gathered: the hosts agree on the
contribution's id and each part's CRC-32C in one small all-gather), and each host's fetcher reads
only its own blocks of a new version from TensorStore. The hosts of one learner act alike at every step: `step` agrees with the
others (one small all-gather) on which fetched versions to apply, whether to stop, and the compute
time, so they never diverge and all stop at the same step. Host memory per host is its share of
the anchors (with fragments.anchor=host) plus what is in flight: the codes of PUBLISH_QUEUE
contributions waiting to be sent and one being sent, and Fetcher.keep fetched versions of each
fragment's share. A learner in one process holding whole tensors keeps the fetcher's snapshot of
each fragment and its anchors as codes on top of it: one copy of the model.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from diloco import messages, metrics
from diloco.config import Config, ConfigError, load_config
from diloco.fragments import fragments_due, fragments_to_fetch, must_hold, syncs_through
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore, StoreError, array_digest
from diloco.learners.fetcher import Fetcher
from diloco.device_codec import DeviceCode
from diloco.learners.outer import Anchors, copy_as, outer_deltas, part_entries, rebase, version_on_devices
from diloco.learners.publisher import PUBLISH_QUEUE, Counters, Heartbeat, Publisher
from diloco.plan import Plan, Region, check_tree, flatten, is_whole, regions, with_leaves

log = logging.getLogger(__name__)

# How a learner script finds its run (set by `diloco learner` for model.script, or by a job backend).
ENV_CONFIG, ENV_LEARNER, ENV_START_STEP, ENV_CORPUS = ("DILOCO_CONFIG", "DILOCO_LEARNER", "DILOCO_START_STEP",
                                                       "DILOCO_CORPUS")


@dataclass
class FragmentState:
    """What a learner holds of one fragment between its syncs."""

    version: int | None = None       # the global version its parameters are on (None before the join)
    sent_from: int | None = None     # the version its last delta was trained from
    tokens: int = 0                  # trained since its last send: what its next delta claims
    steps: int = 0
    time: float = 0.0                # compute seconds of those steps
    held: bool = False               # due, but waiting for a new version (fragments.one_delta_per_version)
    wait: tuple[int, int] | None = None  # synchronous DiLoCo: (step at which to wait, version to wait for)

    def trained(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.time += seconds

    def forget_steps(self) -> None:
        """The steps since the send are gone (an overwrite): the next delta claims none of them."""
        self.tokens, self.steps, self.time = 0, 0, 0.0

    def sent(self) -> None:
        self.forget_steps()
        self.sent_from, self.held = self.version, False


class Session:
    """One learner of a run. See the module docstring; `docs/api.md` has the whole story.

    cfg: the run's config (`run.id` set, as in the run's config.yaml); learner: its id, e.g. `us-0`.
    start_step: steps this learner took before a restart (the schedule and the data go on from it).
    The Kafka clients and the store may be passed in (tests); by default they come from the config.
    """

    def __init__(self, cfg: Config, learner: str, *, run_id: str | None = None, start_step: int = 0,
                 store: FragmentStore | None = None, producer=None, outer_consumer=None):
        self.cfg, self.id = cfg, learner
        self.run_id = run_id or cfg.run.id
        if not self.run_id:
            raise ConfigError("run.id is not set: a learner joins a provisioned run (its RUN_DIR/config.yaml)")
        self.region = cfg.region_of(learner)
        self.index = cfg.shard_index(learner)  # raises ConfigError naming who may join
        self.start_step = self.steps = start_step
        self.incarnation = uuid.uuid4().hex[:8]
        self.topics = kafka_io.Topics.for_run(cfg, self.run_id)
        self._owns = producer is None
        self.store = store or FragmentStore(cfg.store.url, self.run_id)
        self.producer = producer or kafka_io.producer(cfg.transport)
        self._outer = outer_consumer
        self.plan: Plan = self.store.read_plan()
        self.leader = jax.process_index() == 0  # one host per learner beats and sends the manifests
        self.counters = Counters()
        self.metrics = metrics.LearnerMetrics(learner, self._metric_values)
        self._endpoint = None
        self.stopping = False
        self.tokens, self.step_time, self.compute_s = 0, 0.0, 0.0
        self._loss: float | None = None
        self._pending_loss: tuple[int, Any] | None = None  # (step, loss as given): read when reported
        self._loss_lock = threading.Lock()
        self._host_compute_s = 0.0  # this host's own compute_s (compute_s is the largest over the hosts)
        self._names = self.plan.fragment_names
        P = self.plan.fragments
        self._fragments = [FragmentState() for _ in range(P)]
        # the reference each next delta starts from (learners/outer.py), on the host or the devices
        self._base = Anchors(cfg.fragments.anchor, cfg.fragments.anchor_dtype)
        # what an int2 / ternary / topk delta left out, added to the next one (by name; by (name, block) over hosts)
        self._error: dict = {}
        self._last_t: float | None = None
        self._params = None
        configured = cfg.fragments.quantization
        self._schemes = {t.name: "bf16" if configured == "fp32" and t.dtype == "bfloat16" else configured
                         for t in self.plan.tensors}  # a bf16 tensor never travels wider than itself

    @staticmethod
    def from_env(**kwargs) -> Session:
        """The session of a learner script started by `diloco learner` (model.script) or by a job
        backend: DILOCO_CONFIG (the run's config.yaml), DILOCO_LEARNER, DILOCO_START_STEP, and
        optionally DILOCO_CORPUS (the prepared corpus directory)."""
        missing = [k for k in (ENV_CONFIG, ENV_LEARNER) if not os.environ.get(k)]
        if missing:
            raise ConfigError(f"{', '.join(missing)} not set: start the script with `diloco learner --config RUN_DIR/"
                              "config.yaml --learner ID` (model.script) or set them to the run's config and a learner id")
        cfg = load_config(os.environ[ENV_CONFIG])
        if os.environ.get(ENV_CORPUS):
            cfg = cfg.with_corpus(os.environ[ENV_CORPUS])
        return Session(cfg, os.environ[ENV_LEARNER], start_step=int(os.environ.get(ENV_START_STEP) or 0), **kwargs)

    @property
    def shard(self):
        """This learner's share of the data (diloco.DataShard), for `spec.batches(session.shard)`."""
        from diloco.spec import DataShard

        return DataShard(self.index, self.cfg.num_shards, self.start_step, self.cfg.data.seed, jax.process_index(),
                         jax.process_count())

    @property
    def total_steps(self) -> int:
        """This learner's step budget in the run's config (inner.steps, or its share by speed)."""
        return self.cfg.learner_steps(self.id)

    # --- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> Session:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(hand_in=exc_type is None)

    def open(self) -> None:
        """Start the publisher, heartbeat and fetcher threads (SIGTERM then asks the loop to stop)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self.publisher = Publisher(self.cfg, self.run_id, self.id, self.region.name, self.producer, self.topics,
                                   self.counters)
        self.heartbeat = Heartbeat(self._beat, self.cfg.run.heartbeat_s, kafka_io.BrokerWatch(self.cfg.transport, self.id))
        self.publisher.on_published = self.heartbeat.beat_now  # a restart resumes past what was handed in
        self.fetcher = Fetcher(self.cfg, self.run_id, self._outer or kafka_io.consumer(self.cfg.transport), self.store,
                               self.topics, self.counters, self.plan, keep=1 if jax.process_count() == 1 else 2)
        self.publisher.start()  # every host of a learner sends its share of each contribution
        if self.leader:
            self.heartbeat.start()
            if port := self.cfg.learner_port(self.id):
                self._endpoint = metrics.serve(self.metrics.registry, self.cfg.monitoring.host, port)
                log.info("metrics served", extra={"url": f"http://{self.cfg.monitoring.host}:{port}/metrics"})
        self.fetcher.start()

    def phase(self, name: str) -> None:
        """Tell the run what this learner does before its first step, one of messages.LEARNER_PHASES
        (`importing`, `compiling`, `joining`: `join` says the last itself): the live table shows it
        with its time until the learner's first heartbeat says it trains."""
        if name not in messages.LEARNER_PHASES:
            raise ValueError(f"phase {name!r} is not one of {messages.LEARNER_PHASES}")
        if not self.leader:
            return
        try:
            self.producer.send(self.topics.events, messages.event(
                "learner_phase", run=self.run_id, source="learner", learner=self.id, region=self.region.name,
                incarnation=self.incarnation, phase=name), partition=0)
        except kafka_io.LogError as err:  # only what the live view shows: the learner goes on
            log.warning("phase not sent", extra={"phase": name, "error": type(err).__name__})

    def join(self, params, timeout_s: float = 120.0):
        """`params` (your template pytree, on your devices) with the run's latest global values put
        into its synced leaves; waits until every fragment has a version. Raises PlanError naming the
        leaves if the tree does not match the run's plan. Join right before your loop, after anything
        slow (compiling your step on the template): steps trained from versions the run has left
        more than `syncer.max_staleness` behind are refused as stale, their tokens lost."""
        check_tree(params, self.plan)
        self.phase("joining")
        leaves = flatten(params, self.plan)
        if jax.process_count() == 1:
            self._start_from_template(leaves)
        self.fetcher.want({n: list(regions(leaf)) for n, leaf in leaves.items()})
        deadline = time.time() + timeout_s
        while True:
            self._raise_thread_errors()
            (late,), _, chosen = self._agree(time.time() > deadline)
            if len(chosen) == self.plan.fragments:
                break
            if late:
                raise TimeoutError(f"no global version announced for fragments "
                                   f"{sorted(set(range(self.plan.fragments)) - set(chosen))} on {self.topics.outer}")
            time.sleep(0.05)
        values, f32 = {}, self.cfg.fragments.anchor_dtype == "float32"
        for p, (v, got) in chosen.items():
            self.fetcher.release(p, v)
            self._fragments[p].version = v
            names = self._names[p]
            values.update(version_on_devices(got.made_of(), leaves, names, lambda rest: {n: got.blocks[n] for n in rest}))
            # arrays of their own: a sync donates the anchor's buffer to the next one
            self._base.keep({n: copy_as(values[n], np.float32 if f32 else None) for n in names}, got.made_of())
        self._params = with_leaves(params, self.plan, values)
        log.info("joined", extra={"learner": self.id, "start_step": self.start_step, "versions": self.versions,
                                  "shard": self.index, "incarnation": self.incarnation,
                                  "devices": jax.device_count(), "host": jax.process_index(),
                                  "hosts": jax.process_count()})
        return self._params

    def _start_from_template(self, leaves: dict) -> None:
        """Each fragment whose version 0 the template already is (the same model init as provisioning's,
        told by the digests stored with version 0) starts from the template: nothing is read for it,
        and later versions are caught up from it by their updates. Any difference reads as before."""
        for p, names in enumerate(self._names):
            try:
                digests = self.store.read_meta(p, 0).get("digests") or {}
            except (StoreError, ValueError):
                continue
            arrays = {}
            for n in names:
                leaf, t = leaves[n], self.plan.by_name[n]
                if not is_whole(list(regions(leaf)), t.shape):
                    break
                # a copy: on a CPU backend a view would keep the template's device buffers alive
                a = np.array(leaf, dtype=t.np_dtype)
                if array_digest(a) != digests.get(n):
                    break
                arrays[n] = a
            else:
                try:
                    newest = self.store.read_committed(p)
                except (StoreError, OSError, ValueError):
                    newest = None
                # joins at version 0 only while it is the newest (a restarted learner or a joiner
                # waits for the run's latest version, caught up from version 0 by its updates)
                self.fetcher.start_from(p, 0, arrays, ready=newest == 0)

    def step(self, params, *, tokens: int, loss=None, compute_s: float | None = None):
        """Count one inner step of `tokens` tokens; publish the fragments due now; return `params`
        with newly arrived global fragments applied (the same tree, dtypes and shardings)."""
        now = time.perf_counter()
        dt = 0.0 if self._last_t is None else now - self._last_t  # the first interval holds compilation
        self._last_t = now
        self._raise_thread_errors()
        if int(tokens) <= 0:  # the syncer would reject every delta of it (bad_metadata): say so here, at once
            raise ValueError(f"Session.step(tokens={tokens!r}): tokens must be the positive number of tokens this "
                             "step trained on (a contribution weighs tokens^2 / steps)")
        self.steps += 1
        self.tokens += int(tokens)
        if dt:
            self.step_time = dt if self.step_time == 0 else 0.9 * self.step_time + 0.1 * dt
        compute_s = compute_s if compute_s is not None else self._host_compute_s + dt
        # this step's compute, the one figure both sides of goodput count: a delta's time (merged
        # work) and the learner's compute_s (all work); wall time would add waits to the merged side
        step_compute, self._host_compute_s = compute_s - self._host_compute_s, compute_s
        if loss is not None:  # a device array is read when it is reported, not now: the next step queues
            with self._loss_lock:
                self._pending_loss = (self.steps, loss)
            if not isinstance(loss, jax.Array):  # a number: read at once
                self._read_loss()
        for f in self._fragments:
            f.trained(int(tokens), step_compute)
        # plan: what every host of this learner does now (stop on SIGTERM on any, the versions to apply)
        (self.stopping,), self.compute_s, chosen = self._agree(self.stopping, compute_s=compute_s)
        P, H = self.plan.fragments, self.cfg.fragments.sync_every
        held = [p for p, f in enumerate(self._fragments) if f.held]
        for p in dict.fromkeys([*fragments_to_fetch(self.steps, P, H, self.cfg.fragments.prefetch_steps), *held]):
            self.fetcher.need(p)  # the newest version before it syncs: its next delta starts from it
        # dispatch: syncs due now, the new versions, the held syncs a new version released
        for p in fragments_due(self.steps, P, H):
            if self._must_hold(p):
                self._fragments[p].held = True
                continue
            self._sync(p, params)
            if self.cfg.fragments.wait_for_merge:  # round n of p is merged once p reaches version n
                self._fragments[p].wait = (self.steps + self.cfg.syncer.overlap_steps, syncs_through(self.steps, p, P, H))
        self.heartbeat.status = {"step": self.steps, "tokens": self.tokens, "loss": self._loss,
                                 "step_time": self.step_time, "compute_s": self.compute_s, "at": time.time(),
                                 "state": "running", "versions": self.versions}
        if self.steps == self.start_step + 1:  # this incarnation trains: say so now
            self.heartbeat.beat_now()
        params = self._apply(params, chosen)
        for p in [p for p, f in enumerate(self._fragments) if f.held and not self._must_hold(p)]:
            self._sync(p, params)  # its version moved on: send, fresh
        for p, f in enumerate(self._fragments):
            if f.wait is not None and self.steps + 1 >= f.wait[0]:
                (_, version), f.wait = f.wait, None
                params = self._wait_for_merge(p, version, params)
        self._params = params
        return params

    @property
    def loss(self) -> float | None:
        """The latest loss given to `step` (None before one, or when it is not finite), read from the
        devices when asked: the heartbeat thread asks, the training loop never waits for it."""
        return self._read_loss()

    def _read_loss(self) -> float | None:
        with self._loss_lock:
            pending, self._pending_loss = self._pending_loss, None
        if pending is not None:
            step, given = pending
            value = float(given)  # waits for the step that made it: outside the lock, so `step` never waits
            if not math.isfinite(value) and (self._loss is None or math.isfinite(self._loss)):
                log.warning("loss is not finite", extra={"step": step, "loss": str(value)})
            # a heartbeat carries finite numbers only (the syncer refuses others, and would take the
            # learner for silent): a non-finite loss travels as none
            self._loss = value if math.isfinite(value) else None
        return self._loss

    @property
    def versions(self) -> dict[int, int]:
        """The global version of each fragment the parameters are on."""
        return {p: f.version for p, f in enumerate(self._fragments) if f.version is not None}

    def close(self, *, hand_in: bool = True) -> dict:
        """Hand in the work done since each fragment's last sync (unless `hand_in` is False, as after
        an error), wait for the publisher, stop the threads, say `finished` (or `left`, when SIGTERM
        stopped it before its step budget: the syncer stops waiting for it at once). Returns a summary."""
        if hand_in and self._params is not None:
            for p, f in enumerate(self._fragments):
                if f.steps:
                    self._sync(p, self._params)
        if self.publisher.is_alive():
            self.publisher.queue.put(None)
            self.publisher.queue.join()
        if self.leader and self.heartbeat.is_alive():
            self.heartbeat.stop.set()
            self.heartbeat.beat_now()  # wakes it to see the stop
            self.heartbeat.join(timeout=30)
        self.fetcher.stop.set()
        self.fetcher.join(timeout=30)  # a TensorStore read still running at exit aborts the process
        summary = {"step": self.steps, "tokens": self.tokens, "loss": self.loss, "step_time": self.step_time,
                   "compute_s": self.compute_s, "versions": self.versions}
        if jax.process_count() > 1 and self._params is not None:
            summary["blocks_digest"] = blocks_digest(self._params, self.plan)
        try:
            if self.publisher.error:
                raise self.publisher.error
            if self.leader and hand_in:  # asked to stop before its budget (SIGTERM): it leaves the live run
                left = self.stopping and self.steps < self.total_steps
                self._beat(**{k: v for k, v in summary.items() if k != "blocks_digest"}, state="left" if left else "finished")
                self.producer.flush()
        finally:
            if self._owns:
                self.producer.close()
            if self._endpoint is not None:
                self._endpoint.shutdown()
                self._endpoint.server_close()  # the port is free again once the session is closed
        log.info("finished", extra=summary)
        return summary

    # --- inside ----------------------------------------------------------------------------------
    def _raise_thread_errors(self) -> None:
        for err in (self.publisher.error, self.fetcher.error):
            if err:
                raise err

    def _metric_values(self) -> dict:
        """What /metrics shows, read when scraped (from the endpoint's thread)."""
        versions, announced = self.versions, dict(self.fetcher.announced)
        return {"step": self.steps, "tokens": self.tokens, "loss": self.loss, "step_time": self.step_time,
                "bytes_sent": self.counters.bytes_sent, "bytes_fetched": self.counters.bytes_fetched,
                "queue": self.publisher.queue.qsize(),
                "behind": {p: max(announced.get(p, v) - v, 0) for p, v in versions.items()}}

    def _beat(self, **fields) -> None:
        if "loss" in fields:  # the newest, read here on the heartbeat's thread
            fields["loss"] = self.loss
        with self.counters.lock:
            c = {k: getattr(self.counters, k) for k in ("published", "bytes_sent", "bytes_fetched", "versions_applied",
                                                         "handed_in_to", "handed_in_tokens")}
            c["fetched_by_fragment"] = {str(p): n for p, n in sorted(self.counters.fetched_by_fragment.items())}
        self.producer.send(self.topics.events, messages.event(
            "heartbeat", run=self.run_id, source="learner", learner=self.id, region=self.region.name,
            incarnation=self.incarnation, start_step=self.start_step, **c, **fields), partition=0)

    def _agree(self, *flags: bool, compute_s: float | None = None) -> tuple[list[bool], float, dict[int, tuple]]:
        """(each flag OR-ed over this learner's hosts, the largest compute time, per fragment the
        newest fetched version that every host holds, as (version, learners.fetcher.Fetched)). One host:
        its own flags and newest versions. Every host calls it at the same point of the loop (an
        all-gather of a few numbers)."""
        compute_s = self.compute_s if compute_s is None else compute_s
        ready = self.fetcher.ready_now()
        if jax.process_count() == 1:
            return list(flags), compute_s, {p: (max(r), r[max(r)]) for p, r in ready.items()}
        from jax.experimental import multihost_utils

        K, F = self.fetcher.keep, len(flags)
        row = np.full(F + 1 + self.plan.fragments * K, -1.0)
        row[:F], row[F] = flags, compute_s
        for p, r in ready.items():
            vs = sorted(r)[-K:]
            row[F + 1 + p * K:F + 1 + p * K + len(vs)] = vs
        rows = np.asarray(multihost_utils.process_allgather(row))  # (hosts, len(row))
        common = {}
        for p in range(self.plan.fragments):
            sets = [set(r[F + 1 + p * K:F + 1 + (p + 1) * K].tolist()) - {-1.0} for r in rows]
            if both := set.intersection(*sets):
                v = int(max(both))
                common[p] = (v, ready[p][v])
        return [bool(rows[:, i].max() > 0) for i in range(F)], float(rows[:, F].max()), common

    def _must_hold(self, p: int) -> bool:
        """Whether fragment p's delta waits for a new version (fragments.one_delta_per_version,
        fragments.must_hold)."""
        f = self._fragments[p]
        if not self.cfg.fragments.one_delta_per_version:
            return False
        hold = must_hold(sent_from=f.sent_from, version=f.version, steps_since_send=f.steps,
                         every=self.cfg.fragments.sync_every)
        if not hold and f.sent_from == f.version:
            log.info("held too long; sending anyway", extra={"fragment": p, "version": f.version, "steps": f.steps})
        return hold

    def _sync(self, p: int, params) -> None:
        names, f = self._names[p], self._fragments[p]
        leaves = flatten(params, self.plan)
        deltas = outer_deltas(self._base, leaves, names, self._schemes, self._error)  # codes
        job = {"fragment": p, "base_version": f.version, "tokens": f.tokens, "steps": f.steps,
               "step_time": f.time / max(f.steps, 1), "deltas": deltas,
               "schemes": {n: self._schemes[n] for n in names},
               "cursor": (self.steps - f.steps, self.steps)}  # the data-stream steps it trained on
        if jax.process_count() > 1:  # every host sends its blocks; the leader the manifest too
            job["part"], job["deltas"] = self._part(leaves, names, deltas), None
        if self.leader or "part" in job:
            if self.publisher.queue.full():
                log.warning("publisher %d contributions behind: waiting for the link", PUBLISH_QUEUE)
            while True:  # only this thread puts: wait for room, but not on a publisher that died
                self._raise_thread_errors()
                try:
                    self.publisher.queue.put(job, timeout=1.0)
                    break
                except queue.Full:
                    continue
        f.sent()

    def _part(self, leaves: dict, names: list[str], deltas: dict) -> dict:
        """This host's share of a contribution written by all of this learner's hosts (see
        messages.part_frames): its bytes, every host's entries and CRC-32C, and the contribution's
        id, agreed in one all-gather of a few numbers. Waits for this host's codes to reach the host."""
        specs = part_entries(leaves, names, self._schemes)
        me = jax.process_index()
        codes = {k: c.coded() if isinstance(c, DeviceCode) else c for k, c in deltas.items()}
        payload = messages.part_payload(specs[me], codes)
        nonce = uuid.uuid4().int
        rows = gather_ints([len(payload), messages.checksum(payload), nonce & _U48, nonce >> 48 & _U48, nonce >> 96])
        sizes = [sum(t.nbytes for t in mine) for mine in specs]
        if [r[0] for r in rows] != sizes:  # the hosts disagree on the plan: no contribution could assemble
            raise RuntimeError(f"hosts hold {[r[0] for r in rows]} bytes of fragment codes, their entries say {sizes}")
        cid = uuid.UUID(int=rows[0][2] | rows[0][3] << 48 | rows[0][4] << 96).hex  # the leader's id
        return {"cid": cid, "host": me, "specs": specs, "crcs": [r[1] for r in rows], "payload": payload}

    def _wait_for_merge(self, p: int, version: int, params):
        """Synchronous DiLoCo's barrier: no step until fragment p reaches `version`, the round this
        learner is in. Counted from its steps, not from what it sent, so that a restarted learner that
        re-sends a round already merged is not left waiting a round ahead of everyone else."""
        deadline = time.monotonic() + self.cfg.fragments.wait_timeout_s
        while self._fragments[p].version < version:
            self._raise_thread_errors()
            self.fetcher.need(p)
            (stop, late), _, chosen = self._agree(self.stopping, time.monotonic() > deadline)
            params = self._apply(params, chosen)
            self.stopping = stop
            if self._fragments[p].version >= version or stop:
                break
            if late:
                log.warning("no merge of fragment %d after %.0f s; training on", p, self.cfg.fragments.wait_timeout_s)
                break
            time.sleep(0.01)
        self._last_t = time.perf_counter()  # waiting is not a step
        return params

    def _apply(self, params, chosen: dict[int, tuple]):
        """`params` with the agreed new global versions applied (fragments.apply), on the devices."""
        chosen = {p: (v, got) for p, (v, got) in chosen.items() if v > self._fragments[p].version}
        if not chosen:
            return params
        mode = self.cfg.fragments.apply
        alpha = self.cfg.fragments.mix_alpha if mode == "mix" else 1.0
        leaves = flatten(params, self.plan)
        values = {}
        for p, (v, got) in chosen.items():
            self.fetcher.release(p, v)
            names = self._names[p]
            blocks = lambda rest: {n: self._blocks_for(p, v, n, leaves[n], got.blocks) for n in rest}  # noqa: E731
            values.update(rebase(self._base, leaves, names, got.made_of(), blocks, mode, alpha))
            f = self._fragments[p]
            f.version = v
            with self.counters.lock:
                self.counters.versions_applied += 1
            # the steps trained since p was last sent: how late merged versions reach this learner
            log.info("applied", extra={"fragment": p, "version": v, "steps_since_send": f.steps})
            if mode == "overwrite":  # those steps are gone: the next delta claims none of their tokens
                f.forget_steps()
        return with_leaves(params, self.plan, values)

    def _blocks_for(self, p: int, v: int, n: str, leaf, blocks) -> dict[Region, np.ndarray]:
        """The fetched blocks of tensor n, read again if the leaf's sharding changed since the join
        (a train step free to choose its output shardings did): then the fetcher follows the new one."""
        have, need = blocks[n], list(regions(leaf))
        if all(r in have for r in need):
            return have
        log.warning("tensor %s is placed differently than at the join; reading its new blocks", n)
        self.fetcher.want({**self.fetcher.blocks, n: need})
        return self.store.read_blocks(p, v, {n: need})[n]


_U48 = (1 << 48) - 1


def gather_ints(values: list[int]) -> list[list[int]]:
    """Each host's `values` (non-negative integers below 2^48), for every host, in one all-gather:
    sent as 16-bit pieces, exact whatever dtype the collective uses."""
    from jax.experimental import multihost_utils

    pieces = np.array([v >> s & 0xFFFF for v in values for s in (0, 16, 32)], np.int32)
    rows = np.asarray(multihost_utils.process_allgather(pieces)).reshape(jax.process_count(), -1)
    return [[int(r[3 * i]) | int(r[3 * i + 1]) << 16 | int(r[3 * i + 2]) << 32 for i in range(len(values))]
            for r in rows]


def blocks_digest(params, plan: Plan) -> str:
    """A digest of this host's blocks of every synced leaf: hosts holding the same blocks (replicas
    across hosts) must report the same digest."""
    h = hashlib.sha256()
    for n, leaf in sorted(flatten(params, plan).items()):
        for r, index in sorted(regions(leaf).items()):
            shard = next(s for s in leaf.addressable_shards if s.index == index) if isinstance(leaf, jax.Array) else None
            h.update(f"{n}{r}".encode())
            h.update(np.ascontiguousarray(np.asarray(shard.data if shard else leaf[index])).tobytes())
    return h.hexdigest()[:16]
