"""A learner's links to the run's topics: the publisher thread that sends its contributions, the
heartbeat thread, and the counters of what crossed (learners/session.py uses them)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field


from diloco import messages, signing
from diloco.config import Config
from diloco.device_codec import DeviceCode
from diloco.infra import kafka as kafka_io
from diloco.infra.kafka import LogError

log = logging.getLogger(__name__)


@dataclass
class Counters:
    published: int = 0
    bytes_sent: int = 0
    bytes_fetched: int = 0
    fetched_by_fragment: dict[int, int] = field(default_factory=dict)  # bytes read from the store, per fragment
    versions_applied: int = 0
    handed_in_to: int = 0   # the end of the furthest data-stream cursor published: where a restart resumes
    handed_in_tokens: int = 0  # tokens of the contributions published, summed over fragments (coverage ledger)
    lock: threading.Lock = field(default_factory=threading.Lock)


PUBLISH_QUEUE = 2  # contributions waiting to be sent; one more means the link is behind and the loop waits


class Publisher(threading.Thread):
    """Sends contributions from a bounded queue so that inner steps do not wait on the broker (unless
    it falls PUBLISH_QUEUE contributions behind: then the loop waits rather than host memory growing).
    A queued contribution holds its codes (learners/outer.py), not decoded values."""

    def __init__(self, cfg: Config, run_id: str, learner: str, region: str, producer, topics: kafka_io.Topics,
                 counters: Counters):
        super().__init__(daemon=True, name=f"publisher-{learner}")
        self.cfg, self.run_id, self.learner, self.region = cfg, run_id, learner, region
        self.producer, self.topics, self.counters = producer, topics, counters
        self.queue: queue.Queue = queue.Queue(maxsize=PUBLISH_QUEUE)
        self.error: BaseException | None = None
        self.on_published = None   # called after each contribution is acked (the heartbeat says so at once)
        # with run.signing_secret_env set, each frame is signed with this learner's own key (diloco.signing)
        self.key = (signing.read_key(signing.key_path(cfg.keys_dir(run_id), learner))
                    if cfg.run.signing_secret_env else None)

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

    def _send(self, fragment: int, base_version: int, tokens: int, steps: int, step_time: float, deltas=None,
              schemes: dict[str, str] | None = None, cursor: tuple[int, int] | None = None,
              part: dict | None = None) -> None:
        claims = dict(run=self.run_id, learner=self.learner, region=self.region, fragment=fragment,
                      base_version=base_version, tokens=tokens, steps=steps, step_time=step_time, cursor=cursor)
        if part is not None:  # this host's share of a contribution written by several (messages.part_frames)
            manifest, frames = messages.part_frames(**part, chunk_bytes=self.cfg.fragments.chunk_bytes, **claims)
        else:
            # codes made on the devices: their copies to the host were started at dispatch; read them here
            deltas = {n: d.coded() if isinstance(d, DeviceCode) else d for n, d in deltas.items()}
            manifest, frames = messages.encode_contribution(
                **claims, deltas=deltas, scheme=schemes or self.cfg.fragments.quantization,
                chunk_bytes=self.cfg.fragments.chunk_bytes, packing=self.cfg.fragments.packing)
        topic = self.topics.fragments[self.region]
        partition = self.topics.partition_of(fragment)
        key = str(fragment).encode()
        # Emulated WAN: this thread holds the region's link for latency + bytes / its share of the bandwidth.
        time.sleep(self.cfg.transport.wan_delay_s(sum(len(f) + len(key) for f in frames),
                                                  sharers=self.cfg.region_of(self.learner).learners))
        delay = 0.5
        while True:  # resend the whole contribution until acked: the syncer drops repeats by id
            try:
                futures = [self.producer.send(topic, f, key=key, partition=partition, headers=self._headers(f))
                           for f in frames]
                self.producer.flush(timeout=30)
                for fut in futures:
                    fut.get(timeout=30)
                break
            except LogError as err:
                log.warning("broker unavailable; retrying contribution", extra={
                    "id": part["cid"] if part else manifest.id, "fragment": fragment, "retry_in_s": delay,
                    "error": err.kind})
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        with self.counters.lock:
            self.counters.published += 1
            self.counters.bytes_sent += sum(len(f) + len(key) for f in frames)
            self.counters.handed_in_tokens += tokens
            if cursor is not None:
                self.counters.handed_in_to = max(self.counters.handed_in_to, cursor[1])
        if part is not None:  # which chunks this host wrote (tests/test_sharded.py reads them)
            heads = [messages.FrameHeader.from_header(messages.parse_frame(f)[0]) for f in frames]
            log.info("published part", extra={"fragment": fragment, "id": part["cid"], "host": part["host"], "chunks": [
                h.index for h in heads if h.kind == "chunk"], "bytes": len(part["payload"])})
        if manifest is None:
            return
        log.info("published", extra={"fragment": fragment, "base_version": base_version, "id": manifest.id,
                                     "bytes": manifest.total_bytes, "chunks": manifest.n_chunks, "tokens": tokens,
                                     "cursor": None if cursor is None else list(cursor)})
        if self.on_published is not None:
            self.on_published()

    def _headers(self, frame: bytes) -> list[tuple[str, bytes]] | None:
        return None if self.key is None else signing.headers(self.learner, self.key, frame)


class Heartbeat(threading.Thread):
    """Sends the learner's latest status every period, or at once when asked (`beat_now`: a new
    incarnation's first step, so a restarted learner's outage ends when it trains, not a period
    later); the inner loop only updates a dict."""

    def __init__(self, send, period_s: float, broker: kafka_io.BrokerWatch):
        super().__init__(daemon=True, name="heartbeat")
        self.send, self.period_s, self.broker = send, period_s, broker
        self.status: dict = {}
        self.stop = threading.Event()
        self._wake = threading.Event()

    def beat_now(self) -> None:
        self._wake.set()

    def run(self) -> None:
        self.broker.start()
        while not self.stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self.stop.is_set():
                break
            if self.broker.up and self.status:
                try:
                    self.send(**self.status)
                except LogError as err:  # the next beat will do; training goes on
                    log.warning("heartbeat not sent", extra={"error": err.kind})
