"""A learner: inner AdamW steps on its own shard; fragment deltas out, new global fragments in.

The inner loop never waits for the network. A publisher thread quantizes, chunks and sends deltas;
a fetcher thread follows the outer topic and brings announced versions from TensorStore. New global
values are applied at the next step boundary (`fragments.apply`). Only for synchronous DiLoCo
(`fragments.wait_for_merge`, the benchmark's baseline) does the loop stop, overlap_steps after a
send, until that fragment's merge arrives.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from kafka import TopicPartition
from kafka.errors import KafkaError

from diloco import messages, quantize
from diloco.config import Config
from diloco.fragments import fragments_due, syncs_through
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore, StoreError
from diloco.learners.data import Corpus, sample_batches
from diloco.learners.model import loss_fn
from diloco.learners.parallel import data_parallel, local_batch_size
from diloco.syncer.syncer import fragment_plan

log = logging.getLogger(__name__)


def inner_optimizer(cfg: Config, start_step: int = 0, steps: int | None = None) -> optax.GradientTransformation:
    """AdamW on warmup + cosine decay over `steps` (default inner.steps). A learner restarted at
    `start_step` continues the schedule from there, warming up again because its Adam moments start
    from zero."""
    warmup = max(cfg.inner.warmup_steps, 1)
    sched = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.inner.lr, warmup_steps=warmup,
        decay_steps=max(steps or cfg.inner.steps, warmup + 1), end_value=cfg.inner.lr * 0.1)
    if start_step:
        base = sched
        sched = lambda count: base(count + start_step) * jnp.minimum(1.0, (count + 1) / warmup)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(cfg.inner.grad_clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.inner.weight_decay))


def make_train_step(cfg: Config, opt: optax.GradientTransformation):
    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg.model)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


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

    def _send(self, fragment: int, base_version: int, tokens: int, steps: int, step_time: float, deltas) -> None:
        manifest, frames = messages.encode_contribution(
            run=self.run_id, learner=self.learner, region=self.region, fragment=fragment, base_version=base_version,
            tokens=tokens, steps=steps, step_time=step_time, deltas=deltas, scheme=self.cfg.fragments.quantization,
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
        try:
            while not self.stop.is_set():
                newest: dict[int, int] = {}
                for records in self.consumer.poll(timeout_ms=100).values():
                    for rec in records:
                        ev = messages.parse_event(rec.value)
                        if ev and ev["kind"] == "version" and ev.get("run") == self.run_id:
                            p, v = int(ev["fragment"]), int(ev["version"])
                            if 0 <= p < len(self.plan) and v > max(self.held.get(p, (-1,))[0], newest.get(p, -1)):
                                newest[p] = v
                for p, v in newest.items():
                    params, nbytes = self.fetch(p, v)
                    self.held[p] = (v, params)
                    with self.lock:
                        self.latest[p] = (v, params)
                    with self.counters.lock:
                        self.counters.bytes_fetched += nbytes
        except BaseException as err:
            self.error = err
            log.exception("fetch failed")
        finally:
            self.consumer.close()

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


class Learner:
    def __init__(self, cfg: Config, run_id: str, learner_id: str, corpus: Corpus, *, producer, outer_consumer,
                 store: FragmentStore, start_step: int = 0):
        self.cfg, self.run_id, self.id, self.start_step = cfg, run_id, learner_id, start_step
        self.incarnation = uuid.uuid4().hex[:8]
        self.region = cfg.region_of(learner_id)
        self.index = cfg.learner_ids().index(learner_id)
        self.topics = kafka_io.Topics.for_run(cfg, run_id)
        self.producer = producer
        _, self.plan = fragment_plan(cfg)
        self.counters = Counters()
        self.publisher = Publisher(cfg, run_id, learner_id, self.region.name, producer, self.topics, self.counters)
        self.fetcher = Fetcher(cfg, run_id, outer_consumer, store, self.topics, self.counters, self.plan)
        # A restarted learner draws other windows than before its crash, not the same ones again.
        self.dp = data_parallel(cfg.inner.batch_size)
        self.batches = sample_batches(corpus.train_tokens(self.index), batch_size=local_batch_size(cfg.inner.batch_size),
                                      seq_len=cfg.model.seq_len,
                                      seed=(cfg.data.seed, self.index, start_step, jax.process_index()))
        self.heartbeat = Heartbeat(self._heartbeat, cfg.run.heartbeat_s, kafka_io.BrokerWatch(cfg.transport, learner_id))
        self.stopping = False

    def _heartbeat(self, **fields) -> None:
        with self.counters.lock:
            c = {k: getattr(self.counters, k) for k in ("published", "bytes_sent", "bytes_fetched", "versions_applied")}
        self.producer.send(self.topics.events, messages.event(
            "heartbeat", run=self.run_id, source="learner", learner=self.id, region=self.region.name,
            incarnation=self.incarnation, start_step=self.start_step, **c, **fields), partition=0)

    def _wait_initial(self, timeout_s: float = 120.0) -> dict[int, tuple[int, dict[str, np.ndarray]]]:
        got: dict[int, tuple[int, dict]] = {}
        deadline = time.time() + timeout_s
        while len(got) < len(self.plan):
            if self.fetcher.error:
                raise self.fetcher.error
            if time.time() > deadline:
                raise TimeoutError(f"no global version announced for fragments "
                                   f"{sorted(set(range(len(self.plan))) - set(got))} on {self.topics.outer}")
            got |= self.fetcher.take()
            time.sleep(0.05)
        return got

    def run(self) -> dict:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        cfg = self.cfg
        leader = self.dp.is_leader  # the other hosts of a multi-host learner train, but do not publish
        if leader:
            self.publisher.start()
            self.heartbeat.start()
        self.fetcher.start()
        initial = self._wait_initial()
        base_version = {p: v for p, (v, _) in initial.items()}
        base = {p: fr for p, (_, fr) in initial.items()}
        params = self.dp.replicate({n: a for fr in base.values() for n, a in fr.items()})
        log.info("joined", extra={"learner": self.id, "versions": base_version, "shard": self.index,
                                  "devices": self.dp.devices})

        total_steps = cfg.learner_steps(self.id)
        opt = inner_optimizer(cfg, self.start_step, total_steps)
        opt_state = opt.init(params)
        batch = self.dp.shard_batch(next(self.batches))
        # Compile before the clock starts: step times feed the grace window and the time budget.
        train_step = make_train_step(cfg, opt).lower(params, opt_state, batch).compile()
        P, H = cfg.fragments.count, cfg.fragments.sync_every
        tokens_per_step = cfg.inner.batch_size * cfg.model.seq_len
        since = {p: {"tokens": 0, "steps": 0, "time": 0.0} for p in range(P)}
        waits: dict[int, tuple[int, int]] = {}  # fragment -> (step at which to wait, version to wait for)
        step = self.start_step
        tokens, loss, step_time, compute_s = step * tokens_per_step, None, 0.0, 0.0
        for step in range(self.start_step + 1, total_steps + 1):
            if self.stopping or (cfg.inner.max_seconds and compute_s >= cfg.inner.max_seconds):
                step -= 1
                break
            for err in (self.publisher.error, self.fetcher.error):
                if err:
                    raise err
            params = self._apply_arrivals(params, base, base_version)
            for p in [p for p, (at, _) in waits.items() if step >= at]:
                params = self._wait_for_merge(p, waits.pop(p)[1], params, base, base_version)
            t0 = time.perf_counter()
            params, opt_state, loss_arr = train_step(params, opt_state, batch)
            batch = self.dp.shard_batch(next(self.batches))
            loss = float(loss_arr)
            dt = time.perf_counter() - t0
            if self.region.speed < 1:  # stands for slower hardware in this region
                time.sleep(dt * (1 / self.region.speed - 1))
                dt = time.perf_counter() - t0
            step_time = dt if step_time == 0 else 0.9 * step_time + 0.1 * dt
            compute_s += dt
            tokens += tokens_per_step
            for s in since.values():
                s["tokens"] += tokens_per_step
                s["steps"] += 1
                s["time"] += dt
            for p in fragments_due(step, P, H):
                self._sync(p, params, base, base_version, since)
                if cfg.fragments.wait_for_merge:  # round n of p is merged once p reaches version n
                    waits[p] = (step + cfg.syncer.overlap_steps, syncs_through(step, p, P, H))
            self.heartbeat.status = {"step": step, "tokens": tokens, "loss": loss, "step_time": step_time,
                                     "compute_s": compute_s, "at": time.time(), "state": "running",
                                     "versions": dict(base_version)}
        for p in range(P):  # hand in the work done since each fragment's last sync
            if since[p]["steps"]:
                self._sync(p, params, base, base_version, since)
        if leader:
            self.publisher.queue.put(None)
            self.publisher.queue.join()
            self.heartbeat.stop.set()
            self.heartbeat.join(timeout=30)
        self.fetcher.stop.set()
        self.fetcher.join(timeout=30)  # a TensorStore read still running at exit aborts the process
        if self.publisher.error:
            raise self.publisher.error
        summary = {"step": step, "tokens": tokens, "loss": loss, "step_time": step_time, "compute_s": compute_s,
                   "versions": base_version}
        if leader:
            self._heartbeat(**summary, state="finished")
            self.producer.flush()
        log.info("finished", extra=summary)
        return summary

    def _sync(self, p: int, params, base, base_version, since) -> None:
        names = self.plan[p]
        local = {n: self.dp.to_host(params[n]) for n in names}
        scheme = self.cfg.fragments.quantization
        deltas = {n: quantize.roundtrip(base[p][n] - local[n], scheme) for n in names}  # global - local, as sent
        # The next delta starts from what was just sent, so that if the merged global value is slow
        # to arrive, two contributions never carry the same progress twice; what quantization left
        # out stays in the difference and travels with the next delta (error feedback).
        base[p] = {n: base[p][n] - deltas[n] for n in names}
        s = since[p]
        if self.dp.is_leader:
            self.publisher.queue.put({"fragment": p, "base_version": base_version[p], "tokens": s["tokens"],
                                      "steps": s["steps"], "step_time": s["time"] / max(s["steps"], 1),
                                      "deltas": deltas})
        since[p] = {"tokens": 0, "steps": 0, "time": 0.0}

    def _wait_for_merge(self, p: int, version: int, params, base, base_version):
        """Synchronous DiLoCo's barrier: no step until fragment p reaches `version`, the round this
        learner is in. Counted from its steps, not from what it sent, so that a restarted learner that
        re-sends a round already merged is not left waiting a round ahead of everyone else."""
        deadline = time.monotonic() + self.cfg.fragments.wait_timeout_s
        while base_version[p] < version and not self.stopping:
            if self.fetcher.error:
                raise self.fetcher.error
            if time.monotonic() > deadline:
                log.warning("no merge of fragment %d after %.0f s; training on", p, self.cfg.fragments.wait_timeout_s)
                break
            time.sleep(0.01)
            params = self._apply_arrivals(params, base, base_version)
        return params

    def _apply_arrivals(self, params, base, base_version):
        arrived = self.fetcher.take()
        if not arrived:
            return params
        params = dict(params)
        mode = self.cfg.fragments.apply
        alpha = self.cfg.fragments.mix_alpha if mode == "mix" else 1.0
        for p, (v, new) in arrived.items():
            if v <= base_version[p]:
                continue
            for n, a in new.items():
                if mode == "rebase":  # keep the steps taken since the last send: they are in no delta yet
                    a = a + (self.dp.to_host(params[n]) - base[p][n])
                elif alpha != 1.0:
                    a = alpha * a + (1 - alpha) * self.dp.to_host(params[n])
                params[n] = self.dp.replicate(a)
            base[p], base_version[p] = new, v
            with self.counters.lock:
                self.counters.versions_applied += 1
        return params


def main(cfg: Config, run_id: str, learner_id: str, corpus_dir: str, start_step: int = 0) -> dict:
    store = FragmentStore(cfg.store.url, run_id)
    producer = kafka_io.producer(cfg.transport)
    outer = kafka_io.consumer(cfg.transport)
    try:
        return Learner(cfg, run_id, learner_id, Corpus.open(corpus_dir), producer=producer, outer_consumer=outer,
                       store=store, start_step=start_step).run()
    finally:
        producer.close()
