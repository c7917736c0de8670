"""The learner's side of a run, around the user's own training loop: `Session`.

    with Session(cfg, learner="us-0") as session:
        params = session.join(params)                  # the run's global version, in your pytree
        for batch in batches:
            params, opt_state, loss = train_step(params, opt_state, batch)   # your jitted step
            params = session.step(params, tokens=n_tokens, loss=loss)       # sync and apply

The training loop never waits for the network. At a fragment's sync point `step` hands the outer
delta (global - local, as host arrays) to a publisher thread, which quantizes, chunks and sends it;
a fetcher thread follows the outer topic and brings announced versions from TensorStore, and `step`
applies them at the next call (`fragments.apply`: rebase, overwrite or mix). Only synchronous
DiLoCo (`fragments.wait_for_merge`, the benchmark's baseline) stops, overlap_steps after a send,
until that fragment's merge arrives. Leaves outside the plan (RNG keys, counters, local statistics)
are never touched. Values keep their leaf's dtype and device placement (sharding).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import jax
import numpy as np
from kafka import TopicPartition
from kafka.errors import KafkaError

from diloco import messages, quantize
from diloco.config import Config, ConfigError, load_config
from diloco.fragments import fragments_due, syncs_through
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore, StoreError
from diloco.plan import Plan, check_tree, flatten, place, to_host, unflatten

log = logging.getLogger(__name__)

# How a learner script finds its run (set by `diloco learner` for model.script, or by a job backend).
ENV_CONFIG, ENV_LEARNER, ENV_START_STEP, ENV_CORPUS = ("DILOCO_CONFIG", "DILOCO_LEARNER", "DILOCO_START_STEP",
                                                       "DILOCO_CORPUS")


@dataclass
class Counters:
    published: int = 0
    bytes_sent: int = 0
    bytes_fetched: int = 0
    versions_applied: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Publisher(threading.Thread):
    """Sends contributions from a queue so that inner steps never wait on the broker."""

    def __init__(self, cfg: Config, run_id: str, learner: str, region: str, producer, topics: kafka_io.Topics,
                 counters: Counters):
        super().__init__(daemon=True, name=f"publisher-{learner}")
        self.cfg, self.run_id, self.learner, self.region = cfg, run_id, learner, region
        self.producer, self.topics, self.counters = producer, topics, counters
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self._send(**job)
            except BaseException as err:  # surfaced to the main loop, which fails loudly
                self.error = err
                log.exception("publish failed")
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _send(self, fragment: int, base_version: int, tokens: int, steps: int, step_time: float, deltas,
              schemes: dict[str, str] | None = None) -> None:
        manifest, frames = messages.encode_contribution(
            run=self.run_id, learner=self.learner, region=self.region, fragment=fragment, base_version=base_version,
            tokens=tokens, steps=steps, step_time=step_time, deltas=deltas,
            scheme=schemes or self.cfg.fragments.quantization,
            chunk_bytes=self.cfg.fragments.chunk_bytes)
        topic = self.topics.fragments[self.region]
        part = self.topics.partition_of(fragment)
        key = str(fragment).encode()
        # Emulated WAN: this thread holds the region's link for latency + bytes / its share of the bandwidth.
        time.sleep(self.cfg.transport.wan_delay_s(sum(len(f) + len(key) for f in frames),
                                                  sharers=self.cfg.region_of(self.learner).learners))
        delay = 0.5
        while True:  # resend the whole contribution until acked: the syncer drops repeats by id
            try:
                futures = [self.producer.send(topic, f, key=key, partition=part) for f in frames]
                self.producer.flush(timeout=30)
                for fut in futures:
                    fut.get(timeout=30)
                break
            except KafkaError as err:
                log.warning("broker unavailable; retrying contribution", extra={
                    "id": manifest.id, "fragment": fragment, "retry_in_s": delay, "error": type(err).__name__})
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        with self.counters.lock:
            self.counters.published += 1
            self.counters.bytes_sent += sum(len(f) + len(key) for f in frames)
        log.info("published", extra={"fragment": fragment, "base_version": base_version, "id": manifest.id,
                                     "bytes": manifest.total_bytes, "chunks": manifest.n_chunks})


class Heartbeat(threading.Thread):
    """Sends the learner's latest status every period; the inner loop only updates a dict."""

    def __init__(self, send, period_s: float, broker: kafka_io.BrokerWatch):
        super().__init__(daemon=True, name="heartbeat")
        self.send, self.period_s, self.broker = send, period_s, broker
        self.status: dict = {}
        self.stop = threading.Event()

    def run(self) -> None:
        self.broker.start()
        while not self.stop.wait(self.period_s):
            if self.broker.up and self.status:
                try:
                    self.send(**self.status)
                except KafkaError as err:  # the next beat will do; training goes on
                    log.warning("heartbeat not sent", extra={"error": type(err).__name__})


class Fetcher(threading.Thread):
    """Follows the outer topic; brings each newer announced version of a fragment from TensorStore:
    the compact updates from the version it holds when there are few, else the whole fragment."""

    CHAIN_MAX = 4  # beyond this many updates, one fp32 read is about as cheap
    MAX_ATTEMPTS = 20  # reads of one announced version before the fetcher gives up on it

    def __init__(self, cfg: Config, run_id: str, consumer, store: FragmentStore, topics: kafka_io.Topics,
                 counters: Counters, plan: list[list[str]]):
        super().__init__(daemon=True, name="fetcher")
        self.cfg, self.run_id, self.consumer, self.store = cfg, run_id, consumer, store
        self.topics, self.counters, self.plan = topics, counters, plan
        self.held: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # the exact global, per fragment
        self.latest: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        tp = TopicPartition(self.topics.outer, 0)
        kafka_io.assign_from(self.consumer, {tp: 0})  # the whole log: its last word per fragment wins
        due: dict[int, list] = {}  # fragment -> [version, attempts, retry at]: announced, not fetched yet
        try:
            while not self.stop.is_set():
                for records in self.consumer.poll(timeout_ms=100).values():
                    for rec in records:
                        p, v = self._announced(rec.value)
                        if p is not None and v > max(self.held.get(p, (-1,))[0], due.get(p, [-1])[0]):
                            due[p] = [v, 0, 0.0]
                now = time.monotonic()
                for p, entry in sorted(due.items()):
                    if entry[2] > now:
                        continue
                    try:
                        params, nbytes = self.fetch(p, entry[0])
                    except (StoreError, quantize.CodecError, OSError, ValueError) as err:
                        # transient (the store is slow or away) or a version that is not there: try
                        # again with backoff; a newer announcement replaces it meanwhile
                        entry[1] += 1
                        entry[2] = now + min(0.5 * 2 ** entry[1], 10.0)
                        log.warning("fetch of fragment %d v%d failed (attempt %d): %s", p, entry[0], entry[1],
                                    messages.bounded(str(err), 200))
                        if entry[1] >= self.MAX_ATTEMPTS:
                            log.error("giving up on fragment %d v%d after %d attempts", p, entry[0], entry[1])
                            del due[p]
                        continue
                    del due[p]
                    self.held[p] = (entry[0], params)
                    with self.lock:
                        self.latest[p] = (entry[0], params)
                    with self.counters.lock:
                        self.counters.bytes_fetched += nbytes
        except BaseException as err:
            self.error = err
            log.exception("fetch failed")
        finally:
            self.consumer.close()

    def _announced(self, raw: bytes) -> tuple[int | None, int]:
        """(fragment, version) of a well-formed announcement of this run, else (None, -1): a bad
        record on the outer topic is skipped with a warning, never fatal."""
        ev = messages.parse_event(raw)
        if not ev or ev["kind"] != "version" or ev.get("run") != self.run_id:
            return None, -1
        p, v = ev.get("fragment"), ev.get("version")
        ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (p, v))
        if not ok or not 0 <= p < len(self.plan) or not 0 <= v < messages.MAX_COUNT:
            log.warning("announcement ignored: fragment %s version %s", messages.short(p, 40), messages.short(v, 40))
            return None, -1
        return p, v

    def fetch(self, p: int, v: int) -> tuple[dict[str, np.ndarray], int]:
        """(params of version v of fragment p, bytes read)."""
        held = self.held.get(p)
        if held and 0 < v - held[0] <= self.CHAIN_MAX:
            params, nbytes = held[1], 0
            try:
                for u in range(held[0] + 1, v + 1):
                    scheme, update = self.store.read_update(p, u)
                    params = quantize.apply_update(params, update, scheme)
                    nbytes += sum(len(b) for b in update.values())
                return params, nbytes
            except (StoreError, quantize.CodecError) as err:  # e.g. written before updates existed
                log.warning("fetching fragment %d v%d whole: %s", p, v, err)
        fv = self.store.read(p, v, with_opt=False)
        return fv.params, sum(a.nbytes for a in fv.params.values())

    def take(self) -> dict[int, tuple[int, dict[str, np.ndarray]]]:
        with self.lock:
            out, self.latest = self.latest, {}
        return out


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
        self.index = cfg.learner_ids().index(learner)
        self.start_step = self.steps = start_step
        self.incarnation = uuid.uuid4().hex[:8]
        self.topics = kafka_io.Topics.for_run(cfg, self.run_id)
        self._owns = producer is None
        self.store = store or FragmentStore(cfg.store.url, self.run_id)
        self.producer = producer or kafka_io.producer(cfg.transport)
        self._outer = outer_consumer
        self.plan: Plan = self.store.read_plan()
        self.leader = jax.process_index() == 0  # one host per learner publishes and beats, not one per host
        self.counters = Counters()
        self.stopping = False
        self.tokens, self.loss, self.step_time, self.compute_s = 0, None, 0.0, 0.0
        self._names = self.plan.fragment_names
        P = self.plan.fragments
        self._since = {p: {"tokens": 0, "steps": 0, "time": 0.0} for p in range(P)}
        self._waits: dict[int, tuple[int, int]] = {}  # fragment -> (step at which to wait, version to wait for)
        self._base: dict[int, dict[str, np.ndarray]] = {}  # float32 host reference each next delta starts from
        self._version: dict[int, int] = {}
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
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"prepared": os.environ[ENV_CORPUS]})})
        return Session(cfg, os.environ[ENV_LEARNER], start_step=int(os.environ.get(ENV_START_STEP) or 0), **kwargs)

    @property
    def shard(self):
        """This learner's share of the data (diloco.DataShard), for `spec.batches(session.shard)`."""
        from diloco.spec import DataShard

        return DataShard(self.index, self.cfg.num_learners, self.start_step, self.cfg.data.seed, jax.process_index(),
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
        self.fetcher = Fetcher(self.cfg, self.run_id, self._outer or kafka_io.consumer(self.cfg.transport), self.store,
                               self.topics, self.counters, self._names)
        if self.leader:
            self.publisher.start()
            self.heartbeat.start()
        self.fetcher.start()

    def join(self, params, timeout_s: float = 120.0):
        """`params` (your template pytree, on your devices) with the run's latest global values put
        into its synced leaves; waits until every fragment has a version. Raises PlanError naming the
        leaves if the tree does not match the run's plan."""
        check_tree(params, self.plan)
        got: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        deadline = time.time() + timeout_s
        while len(got) < self.plan.fragments:
            self._raise_thread_errors()
            if time.time() > deadline:
                raise TimeoutError(f"no global version announced for fragments "
                                   f"{sorted(set(range(self.plan.fragments)) - set(got))} on {self.topics.outer}")
            got |= self.fetcher.take()
            time.sleep(0.05)
        values = {}
        for p, (v, arrays) in got.items():
            self._version[p], self._base[p] = v, {n: np.asarray(a, np.float32) for n, a in arrays.items()}
            values |= arrays
        self._params = unflatten(params, self.plan, values, place=place)
        log.info("joined", extra={"learner": self.id, "versions": dict(self._version), "shard": self.index,
                                  "devices": len(jax.devices())})
        return self._params

    def step(self, params, *, tokens: int, loss=None, compute_s: float | None = None):
        """Count one inner step of `tokens` tokens; publish the fragments due now; return `params`
        with newly arrived global fragments applied (the same tree, dtypes and shardings)."""
        now = time.perf_counter()
        dt = 0.0 if self._last_t is None else now - self._last_t  # the first interval holds compilation
        self._last_t = now
        self._raise_thread_errors()
        self.steps += 1
        self.tokens += int(tokens)
        if dt:
            self.step_time = dt if self.step_time == 0 else 0.9 * self.step_time + 0.1 * dt
        self.compute_s = compute_s if compute_s is not None else self.compute_s + dt
        if loss is not None:
            self.loss = float(loss)
        for s in self._since.values():
            s["tokens"] += int(tokens)
            s["steps"] += 1
            s["time"] += dt or self.step_time
        P, H = self.plan.fragments, self.cfg.fragments.sync_every
        for p in fragments_due(self.steps, P, H):
            self._sync(p, params)
            if self.cfg.fragments.wait_for_merge:  # round n of p is merged once p reaches version n
                self._waits[p] = (self.steps + self.cfg.syncer.overlap_steps, syncs_through(self.steps, p, P, H))
        self.heartbeat.status = {"step": self.steps, "tokens": self.tokens, "loss": self.loss,
                                 "step_time": self.step_time, "compute_s": self.compute_s, "at": time.time(),
                                 "state": "running", "versions": dict(self._version)}
        params = self._apply_arrivals(params)
        for p in [p for p, (at, _) in self._waits.items() if self.steps + 1 >= at]:
            params = self._wait_for_merge(p, self._waits.pop(p)[1], params)
        self._params = params
        return params

    @property
    def versions(self) -> dict[int, int]:
        """The global version of each fragment the parameters are on."""
        return dict(self._version)

    def close(self, *, hand_in: bool = True) -> dict:
        """Hand in the work done since each fragment's last sync (unless `hand_in` is False, as after
        an error), wait for the publisher, stop the threads, say `finished`. Returns a summary."""
        if hand_in and self._params is not None:
            for p in range(self.plan.fragments):
                if self._since[p]["steps"]:
                    self._sync(p, self._params)
        if self.leader and self.publisher.is_alive():
            self.publisher.queue.put(None)
            self.publisher.queue.join()
            self.heartbeat.stop.set()
            self.heartbeat.join(timeout=30)
        self.fetcher.stop.set()
        self.fetcher.join(timeout=30)  # a TensorStore read still running at exit aborts the process
        summary = {"step": self.steps, "tokens": self.tokens, "loss": self.loss, "step_time": self.step_time,
                   "compute_s": self.compute_s, "versions": dict(self._version)}
        try:
            if self.publisher.error:
                raise self.publisher.error
            if self.leader and hand_in:
                self._beat(**summary, state="finished")
                self.producer.flush()
        finally:
            if self._owns:
                self.producer.close()
        log.info("finished", extra=summary)
        return summary

    # --- inside ----------------------------------------------------------------------------------
    def _raise_thread_errors(self) -> None:
        for err in (self.publisher.error, self.fetcher.error):
            if err:
                raise err

    def _beat(self, **fields) -> None:
        with self.counters.lock:
            c = {k: getattr(self.counters, k) for k in ("published", "bytes_sent", "bytes_fetched", "versions_applied")}
        self.producer.send(self.topics.events, messages.event(
            "heartbeat", run=self.run_id, source="learner", learner=self.id, region=self.region.name,
            incarnation=self.incarnation, start_step=self.start_step, **c, **fields), partition=0)

    def _sync(self, p: int, params) -> None:
        names = self._names[p]
        leaves = flatten(params, self.plan)
        base = self._base[p]
        deltas = {n: quantize.roundtrip(base[n] - to_host(leaves[n]).astype(np.float32), self._schemes[n])
                  for n in names}  # global - local, as the syncer will decode it
        # The next delta starts from what was just sent, so that if the merged global value is slow
        # to arrive, two contributions never carry the same progress twice; what quantization left
        # out stays in the difference and travels with the next delta (error feedback).
        self._base[p] = {n: base[n] - deltas[n] for n in names}
        s = self._since[p]
        if self.leader:
            self.publisher.queue.put({"fragment": p, "base_version": self._version[p], "tokens": s["tokens"],
                                      "steps": s["steps"], "step_time": s["time"] / max(s["steps"], 1),
                                      "deltas": deltas, "schemes": {n: self._schemes[n] for n in names}})
        self._since[p] = {"tokens": 0, "steps": 0, "time": 0.0}

    def _wait_for_merge(self, p: int, version: int, params):
        """Synchronous DiLoCo's barrier: no step until fragment p reaches `version`, the round this
        learner is in. Counted from its steps, not from what it sent, so that a restarted learner that
        re-sends a round already merged is not left waiting a round ahead of everyone else."""
        deadline = time.monotonic() + self.cfg.fragments.wait_timeout_s
        while self._version[p] < version and not self.stopping:
            self._raise_thread_errors()
            if time.monotonic() > deadline:
                log.warning("no merge of fragment %d after %.0f s; training on", p, self.cfg.fragments.wait_timeout_s)
                break
            time.sleep(0.01)
            params = self._apply_arrivals(params)
        self._last_t = time.perf_counter()  # waiting is not a step
        return params

    def _apply_arrivals(self, params):
        arrived = self.fetcher.take()
        if not arrived:
            return params
        mode = self.cfg.fragments.apply
        alpha = self.cfg.fragments.mix_alpha if mode == "mix" else 1.0
        leaves = flatten(params, self.plan)
        values = {}
        for p, (v, new) in arrived.items():
            if v <= self._version[p]:
                continue
            new32 = {n: np.asarray(a, np.float32) for n, a in new.items()}
            for n, a in new32.items():
                if mode == "rebase":  # keep the steps taken since the last send: they are in no delta yet
                    a = a + (to_host(leaves[n]).astype(np.float32) - self._base[p][n])
                elif alpha != 1.0:
                    a = alpha * a + (1 - alpha) * to_host(leaves[n]).astype(np.float32)
                values[n] = a if mode in ("rebase", "mix") else new[n]
            self._base[p], self._version[p] = new32, v
            with self.counters.lock:
                self.counters.versions_applied += 1
        if not values:
            return params
        return unflatten(params, self.plan, values, place=place, partial=True)
