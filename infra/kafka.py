"""Kafka adapter: topic names, provisioning, producers and consumers built from config.

Broker-agnostic: everything comes from `TransportConfig`, so the same code talks to the local
Tansu broker or to a production Kafka cluster with SASL/TLS.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from diloco.config import Config, TransportConfig, resolve_secret
from diloco.infra.services import up_hint

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
    pass


@dataclass(frozen=True)
class Topics:
    fragments: dict[str, str]   # region -> topic of outer deltas
    outer: str                  # announcements of new global fragment versions
    events: str                 # heartbeats, merges, rejections
    partitions: int             # partitions of each fragments topic (fragment p -> p % partitions)
    syncer_group: str           # consumer group the syncer commits its replay offsets to (monitoring only)

    @staticmethod
    def for_run(cfg: Config, run_id: str) -> Topics:
        prefix = f"{cfg.transport.topic_prefix}.{run_id}"
        return Topics(
            fragments={r.name: f"{prefix}.fragments.{r.name}" for r in cfg.regions},
            outer=f"{prefix}.outer",
            events=f"{prefix}.events",
            partitions=cfg.fragments.count,
            syncer_group=f"{prefix}.syncer",
        )

    def partition_of(self, fragment: int) -> int:
        return fragment % self.partitions

    def partitions_of(self, fragment: int) -> list[tuple[str, int]]:
        """(topic, partition) of the fragment in every region's topic."""
        return [(t, self.partition_of(fragment)) for t in self.fragments.values()]

    def all(self) -> dict[str, int]:
        return {**{t: self.partitions for t in self.fragments.values()}, self.outer: 1, self.events: 1}


def _common(t: TransportConfig) -> dict:
    # Reconnects back off exponentially from 100 ms to 5 s; kafka-python logs each lost connection.
    kw: dict = {"bootstrap_servers": t.bootstrap_servers.split(","), "security_protocol": t.security_protocol,
                "reconnect_backoff_ms": 100, "reconnect_backoff_max_ms": 5000}
    if t.sasl_mechanism:
        kw |= {"sasl_mechanism": t.sasl_mechanism, "sasl_plain_username": t.sasl_username,
               "sasl_plain_password": resolve_secret(t.sasl_password_env, "transport.sasl_password_env")}
    if t.ssl_cafile:
        kw["ssl_cafile"] = t.ssl_cafile
    return kw


class BrokerWatch(threading.Thread):
    """Says in the log when the bootstrap brokers stop and start answering.

    kafka-python reconnects by itself (with the backoff set in `_common`); this makes the outage and
    the recovery visible in our own structured logs, once each, rather than as client noise. It runs
    on its own thread because a client call can block for seconds while the broker is away.
    """

    def __init__(self, t: TransportConfig, who: str, period_s: float = 0.5):
        super().__init__(daemon=True, name="broker-watch")
        self.t, self.who, self.period_s = t, who, period_s
        self.up = True

    def run(self) -> None:
        while True:
            up = _answers(self.t)
            if up != self.up:
                log.warning("broker reachable again" if up else "broker unavailable; clients reconnect with backoff",
                            extra={"who": self.who, "bootstrap": self.t.bootstrap_servers.split(",")})
            self.up = up
            time.sleep(self.period_s)


def _answers(t: TransportConfig) -> bool:
    """Whether any bootstrap broker accepts a TCP connection (says nothing of its security handshake)."""
    for addr in t.bootstrap_servers.split(","):
        host, port = addr.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return True
        except OSError:
            pass
    return False


def ensure_topics(t: TransportConfig, topics: dict[str, int], timeout_s: float = 30.0) -> None:
    """Create topics with their final partition counts (the local broker cannot add partitions), replicated as
    transport.replication_factor / min_insync_replicas say; topics that exist are left as they are."""
    admin = _connect(KafkaAdminClient, t, timeout_s, request_timeout_ms=10_000)
    try:
        existing = set(admin.list_topics())
        configs = {} if t.min_insync_replicas is None else {"min.insync.replicas": str(t.min_insync_replicas)}
        new = [NewTopic(name, num_partitions=n, replication_factor=t.replication_factor, topic_configs=configs)
               for name, n in topics.items() if name not in existing]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
        deadline = time.time() + timeout_s
        while not set(topics) <= set(admin.list_topics()):
            if time.time() > deadline:
                raise TransportError(f"topics {sorted(set(topics) - set(admin.list_topics()))} did not appear")
            time.sleep(0.1)
    finally:
        admin.close()


def delete_topics(t: TransportConfig, names: list[str]) -> None:
    """Delete topics (those that do not exist are skipped): throwaway runs give their broker space back."""
    admin = _connect(KafkaAdminClient, t, request_timeout_ms=30_000)
    try:
        gone = [n for n in names if n in set(admin.list_topics())]
        if gone:
            admin.delete_topics(gone)
    finally:
        admin.close()


def producer(t: TransportConfig) -> KafkaProducer:
    # Idempotence off: the local broker loses producer ids on restart; the syncer drops replays by id.
    return _connect(
        KafkaProducer, t, acks=t.acks, linger_ms=5, enable_idempotence=False, retries=5, max_block_ms=10_000,
        max_request_size=t.max_message_bytes + 65536,
        compression_type=None if t.compression == "none" else t.compression)


def _fetch_limits(t: TransportConfig) -> tuple[int, int]:
    """(bytes one partition may return per fetch, bytes one fetch may return), the same for either
    client: room for the largest message the run allows, plus its framing."""
    record = t.max_message_bytes + 65536
    return record, max(record, 52428800)


def consumer(t: TransportConfig, group_id: str | None = None, **kw) -> KafkaConsumer:
    """A consumer with no auto-commit: callers assign partitions and keep offsets. A `group_id` only
    names where `commit()` puts offsets for monitoring; the group never subscribes or rebalances."""
    record, fetch = _fetch_limits(t)
    return _connect(
        KafkaConsumer, t, enable_auto_commit=False, auto_offset_reset="earliest", group_id=group_id,
        fetch_max_bytes=fetch, max_partition_fetch_bytes=record, receive_message_max_bytes=record + 65536, **kw)


def assign_from(c: KafkaConsumer, positions: dict[TopicPartition, int]) -> None:
    """Assign partitions and start each at a stored offset (0 where none is stored)."""
    c.assign(list(positions))
    for tp, offset in positions.items():
        c.seek(tp, offset)


def partitions_of(topic: str, n: int) -> list[TopicPartition]:
    return [TopicPartition(topic, p) for p in range(n)]


def _connect(client: type, t: TransportConfig, timeout_s: float = 20.0, **kw):
    """A kafka-python client, retried with backoff until `timeout_s`. Each try's bootstrap is bounded by
    what is left of it (at most 10 s): the client's own bound is 30 s, so a missing broker would
    otherwise hold the caller for 30 s whatever it asked for."""
    deadline = time.time() + timeout_s
    delay = 0.2
    while True:
        try:
            bootstrap_s = min(max(deadline - time.time(), 0.5), 10.0)
            return client(**_common(t), bootstrap_timeout_ms=int(bootstrap_s * 1000), **kw)
        except KafkaError as err:
            if time.time() > deadline:
                if t.security_protocol != "PLAINTEXT" and _answers(t):  # e.g. SASL refused: kafka-python says timeout
                    raise TransportError(
                        f"Kafka broker at {t.bootstrap_servers} answers but the {t.security_protocol} connection "
                        f"failed ({type(err).__name__}): check transport.security_protocol, sasl_mechanism, "
                        "sasl_username, the password in the env var transport.sasl_password_env names, and ssl_cafile"
                    ) from None
                raise TransportError(
                    f"Kafka broker not reachable at {t.bootstrap_servers} ({type(err).__name__}); "
                    + up_hint("transport.bootstrap_servers")) from None
            log.warning("kafka connect failed (%s), retrying in %.1fs", type(err).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def read_to_end(t: TransportConfig, tps: list[TopicPartition], timeout_s: float = 30.0, last: int | None = None) -> list:
    """Every record of the given partitions from offset 0 (or, with `last`, about the last `last`
    records of each) up to their high watermark.

    The end is taken from the high watermark of fetch responses: the local broker's end_offsets()
    reports the start of the last batch, not the end of the partition.
    """
    c = consumer(t)
    try:
        ends = c.end_offsets(tps) if last is not None else {}
        assign_from(c, {tp: max(ends.get(tp, 0) - (last or 0), 0) for tp in tps})
        out, deadline = [], time.time() + timeout_s
        while True:
            for records in c.poll(timeout_ms=200).values():
                out.extend(records)
            hws = {tp: c.highwater(tp) for tp in tps}
            if all(hw is not None and c.position(tp) >= hw for tp, hw in hws.items()):
                return out
            if time.time() > deadline:
                raise TransportError(f"reading {tps} did not reach the high watermark in {timeout_s}s")
    finally:
        c.close()


def group_lag(t: TransportConfig, group: str, tps: list[TopicPartition], timeout_s: float = 30.0) -> list[dict]:
    """Per partition: the group's committed offset (None if it committed none), the end offset and
    the lag between them (the end offset, from the start, where nothing is committed).

    The end is the high watermark of a fetch from the committed offset: the local broker's
    end_offsets() reports the start of the last batch, not the end of the partition.
    """
    c = consumer(t, group_id=group)
    try:
        committed = {tp: c.committed(tp) for tp in tps}
        assign_from(c, {tp: off or 0 for tp, off in committed.items()})
        deadline = time.time() + timeout_s
        while any(c.highwater(tp) is None for tp in tps):
            if time.time() > deadline:
                raise TransportError(f"no high watermark for {[tp for tp in tps if c.highwater(tp) is None]} in {timeout_s}s")
            c.poll(timeout_ms=200, max_records=1)
        return [{"topic": tp.topic, "partition": tp.partition, "committed": committed[tp], "end": c.highwater(tp),
                 "lag": c.highwater(tp) - (committed[tp] or 0)} for tp in tps]
    finally:
        c.close()


def rdkafka_settings(t: TransportConfig, group_id: str | None) -> dict:
    """librdkafka's names for what `consumer` sets: the same broker, security and size limits."""
    record, fetch = _fetch_limits(t)
    kw = {"bootstrap.servers": t.bootstrap_servers, "security.protocol": t.security_protocol.lower(),
          "group.id": group_id or "diloco-unnamed", "enable.auto.commit": False, "auto.offset.reset": "earliest",
          "fetch.max.bytes": fetch, "max.partition.fetch.bytes": record,
          "receive.message.max.bytes": fetch + 65536,
          "reconnect.backoff.ms": 100, "reconnect.backoff.max.ms": 5000}
    if t.sasl_mechanism:
        kw |= {"sasl.mechanism": t.sasl_mechanism, "sasl.username": t.sasl_username,
               "sasl.password": resolve_secret(t.sasl_password_env, "transport.sasl_password_env")}
    if t.ssl_cafile:
        kw["ssl.ca.location"] = t.ssl_cafile
    return kw


class _Record(NamedTuple):
    offset: int
    value: bytes


class RdKafkaConsumer:
    """The syncer's intake on librdkafka (confluent-kafka), behind the part of kafka-python's
    `KafkaConsumer` the syncer uses: assign and seek, poll into {partition: records}, position,
    high watermark, commit. librdkafka fetches and parses in its own C threads, so a record costs the
    syncer a fraction of kafka-python's parsing (docs/bench.md, the syncer's intake).

    Positions are kept here: the next offset of each assigned partition, moved by `seek` and by what
    `poll` returns, so that a record the syncer has not seen is never skipped. The high watermark is
    librdkafka's figure from its last fetch response (the local broker's ListOffsets is wrong, as
    `read_to_end` explains). Errors come out as kafka-python's `KafkaError`, as the syncer expects."""

    def __init__(self, t: TransportConfig, group_id: str | None = None):
        import confluent_kafka

        self._ck = confluent_kafka
        self.config = {"group_id": group_id}
        try:
            self._consumer = confluent_kafka.Consumer(rdkafka_settings(t, group_id))
        except confluent_kafka.KafkaException as err:
            raise TransportError(f"librdkafka consumer for {t.bootstrap_servers}: {err}") from None
        self._positions: dict[TopicPartition, int] = {}
        self._moved = False

    def assign(self, partitions) -> None:
        self._positions = {tp: self._positions.get(tp, 0) for tp in partitions}
        self._moved = True

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._positions[tp] = offset
        self._moved = True

    def assignment(self) -> set[TopicPartition]:
        return set(self._positions)

    def position(self, tp: TopicPartition) -> int:
        return self._positions[tp]

    def highwater(self, tp: TopicPartition) -> int | None:
        _, high = self._consumer.get_watermark_offsets(self._ck.TopicPartition(tp.topic, tp.partition), cached=True)
        return high if high >= 0 else None

    def poll(self, timeout_ms: int = 0, max_records: int = 500) -> dict[TopicPartition, list[_Record]]:
        ck = self._ck
        if self._moved:  # librdkafka starts each partition where `assign` says: the positions kept here
            self._consumer.assign([ck.TopicPartition(tp.topic, tp.partition, off) for tp, off in self._positions.items()])
            self._moved = False
        out: dict[TopicPartition, list[_Record]] = {}
        for msg in self._consumer.consume(max_records, timeout_ms / 1000):
            if msg.error() is not None:
                if msg.error().fatal():
                    raise KafkaError(f"librdkafka: {msg.error()}")
                continue  # transient (a broker away, a partition's end): librdkafka retries by itself
            tp = TopicPartition(msg.topic(), msg.partition())
            if tp in self._positions and msg.offset() >= self._positions[tp]:
                out.setdefault(tp, []).append(_Record(msg.offset(), msg.value()))
                self._positions[tp] = msg.offset() + 1
        return out

    def commit(self, offsets, timeout_ms: int | None = None) -> None:
        try:
            self._consumer.commit(offsets=[self._ck.TopicPartition(tp.topic, tp.partition, meta.offset)
                                           for tp, meta in offsets.items()], asynchronous=False)
        except self._ck.KafkaException as err:
            raise KafkaError(f"librdkafka commit: {err}") from None

    def close(self) -> None:
        self._consumer.close()


def intake_consumer(t: TransportConfig, client: str, group_id: str | None = None):
    """The syncer's consumer of contributions and events, on the client `syncer.consumer` names."""
    return RdKafkaConsumer(t, group_id) if client == "librdkafka" else consumer(t, group_id=group_id)
