"""Kafka adapter: topic names, provisioning, and the log's writer and readers built from config.

Broker-agnostic: everything comes from `TransportConfig`, so the same code talks to the local
Tansu broker or to a production Kafka cluster with SASL/TLS.

The rest of the code sees one log interface and no client library: a partition is a plain
`(topic, partition)` tuple (`TP`), a record has `topic, partition, offset, timestamp, key, value`,
`LogWriter` sends, a `LogReader` (kafka-python) or `RdKafkaReader` (librdkafka) reads from offsets
the caller keeps, and every failure of a client call comes out as `LogError`.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from diloco import logs
from diloco.config import Config, TransportConfig, resolve_secret
from diloco.infra.log import TP, partitions_of  # noqa: F401 (partitions_of: part of this adapter's interface)
from diloco.infra.services import up_hint

log = logging.getLogger(__name__)
# kafka-python's own I/O loop times its steps and warns of any over 0.1 s, which a busy host makes
# routine; the slowness that matters shows in our own logs (lag, missed leases)
logs.quiet("kafka.net.selector", "blocking the event loop")


class TransportError(RuntimeError):
    """A client could not be set up (no broker answers, credentials refused) or a read did not finish."""


class LogError(RuntimeError):
    """A call of either log client failed. `kind` is the client's name for the error (e.g.
    `KafkaTimeoutError`); `retriable` whether the client holds that trying again may succeed."""

    def __init__(self, message: str, *, kind: str = "LogError", retriable: bool = False):
        super().__init__(message)
        self.kind, self.retriable = kind, retriable


def _log_error(err: KafkaError) -> LogError:
    return LogError(str(err), kind=type(err).__name__, retriable=bool(getattr(err, "retriable", False)))


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

    def partitions_of(self, fragment: int) -> list[TP]:
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


class Written(NamedTuple):
    """Where the broker put a record."""
    topic: str
    partition: int
    offset: int


class Sending:
    """A record on its way: `get` waits for the broker's acknowledgement."""

    __slots__ = ("_future",)

    def __init__(self, future):
        self._future = future

    def get(self, timeout: float | None = None) -> Written:
        try:
            m = self._future.get(timeout=timeout)
        except KafkaError as err:
            raise _log_error(err) from err
        return Written(m.topic, m.partition, m.offset)


class LogWriter:
    """Sends records (kafka-python's producer); a refusal, at once or when awaited, is a `LogError`."""

    def __init__(self, client: KafkaProducer):
        self._client = client

    @property
    def config(self) -> dict:
        """The client's settings as it took them."""
        return self._client.config

    def send(self, topic: str, value: bytes, *, key: bytes | None = None, partition: int | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> Sending:
        try:
            return Sending(self._client.send(topic, value, key=key, partition=partition, headers=headers))
        except KafkaError as err:
            raise _log_error(err) from err

    def flush(self, timeout: float | None = None) -> None:
        try:
            self._client.flush(timeout=timeout)
        except KafkaError as err:
            raise _log_error(err) from err

    def close(self, timeout: float | None = None) -> None:
        self._client.close(timeout=timeout)


def producer(t: TransportConfig) -> LogWriter:
    # Idempotence off: the local broker loses producer ids on restart; the syncer drops replays by id.
    return LogWriter(_connect(
        KafkaProducer, t, acks=t.acks, linger_ms=5, enable_idempotence=False, retries=5, max_block_ms=10_000,
        max_request_size=t.max_message_bytes + 65536,
        compression_type=None if t.compression == "none" else t.compression))


def _fetch_limits(t: TransportConfig) -> tuple[int, int]:
    """(bytes one partition may return per fetch, bytes one fetch may return), the same for either
    client: room for the largest message the run allows, plus its framing."""
    record = t.max_message_bytes + 65536
    return record, max(record, 52428800)


class LogReader:
    """Reads assigned partitions (kafka-python's consumer) from offsets the caller keeps: no
    subscription, no rebalance, no auto-commit. A `group_id` only names where `commit` puts offsets,
    for monitoring. Records come out as kafka-python makes them (they carry the fields every record
    has); a failed call is a `LogError`."""

    def __init__(self, client: KafkaConsumer):
        self._c = client

    @property
    def group_id(self) -> str | None:
        return self._c.config["group_id"]

    def assign(self, positions: Mapping[TP, int]) -> None:
        """Read exactly these partitions, each from its offset."""
        self._call(self._c.assign, [TopicPartition(*tp) for tp in positions])
        for tp, offset in positions.items():
            self.seek(tp, offset)

    def seek(self, tp: TP, offset: int) -> None:
        self._call(self._c.seek, TopicPartition(*tp), offset)

    def assignment(self) -> set[TP]:
        return {(tp.topic, tp.partition) for tp in self._c.assignment()}

    def position(self, tp: TP) -> int:
        return self._call(self._c.position, TopicPartition(*tp))

    def highwater(self, tp: TP) -> int | None:
        """The partition's end as the last fetch response said it (None before one came)."""
        return self._call(self._c.highwater, TopicPartition(*tp))

    def poll(self, timeout_ms: int = 0, max_records: int = 500) -> dict[TP, list]:
        batch = self._call(self._c.poll, timeout_ms=timeout_ms, max_records=max_records)
        return {(tp.topic, tp.partition): records for tp, records in batch.items()}

    def pause(self, *tps: TP) -> None:
        self._call(self._c.pause, *(TopicPartition(*tp) for tp in tps))

    def resume(self, *tps: TP) -> None:
        self._call(self._c.resume, *(TopicPartition(*tp) for tp in tps))

    def commit(self, offsets: Mapping[TP, int], timeout_ms: int | None = None) -> None:
        """Store `offsets` (the next offset to read, per partition) as the group's."""
        self._call(self._c.commit, {TopicPartition(*tp): OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()},
                   timeout_ms=timeout_ms)

    def committed(self, tp: TP) -> int | None:
        return self._call(self._c.committed, TopicPartition(*tp))

    def end_offsets(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The broker's ListOffsets answer (the local broker's is the start of the last batch: see `read_to_end`)."""
        ends = self._call(self._c.end_offsets, [TopicPartition(*tp) for tp in tps])
        return {(tp.topic, tp.partition): end for tp, end in ends.items()}

    def topics(self) -> set[str]:
        return self._call(self._c.topics)

    def close(self) -> None:
        self._c.close()

    @staticmethod
    def _call(fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except KafkaError as err:
            raise _log_error(err) from err


def consumer(t: TransportConfig, group_id: str | None = None, **kw) -> LogReader:
    """A reader on kafka-python; `kw` goes to its consumer."""
    record, fetch = _fetch_limits(t)
    return LogReader(_connect(
        KafkaConsumer, t, enable_auto_commit=False, auto_offset_reset="earliest", group_id=group_id,
        fetch_max_bytes=fetch, max_partition_fetch_bytes=record, receive_message_max_bytes=record + 65536, **kw))


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


def read_to_end(t: TransportConfig, tps: list[TP], timeout_s: float = 30.0, last: int | None = None) -> list:
    """Every record of the given partitions from offset 0 (or, with `last`, about the last `last`
    records of each) up to their high watermark.

    The end is taken from the high watermark of fetch responses: the local broker's end_offsets()
    reports the start of the last batch, not the end of the partition.
    """
    c = consumer(t)
    try:
        ends = c.end_offsets(tps) if last is not None else {}
        c.assign({tp: max(ends.get(tp, 0) - (last or 0), 0) for tp in tps})
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


def log_ends(t: TransportConfig, tps: list[TP], timeout_s: float = 5.0) -> dict[TP, int]:
    """Each partition's end offset now (the offset its next record will get), from the high watermark
    of a fetch: the local broker's end_offsets() reports the start of the last batch (read_to_end)."""
    c = consumer(t)
    try:
        start = c.end_offsets(tps)
        c.assign(start)
        deadline = time.time() + timeout_s
        while any(c.highwater(tp) is None for tp in tps):
            if time.time() > deadline:
                raise TransportError(f"no high watermark of {tps} in {timeout_s}s")
            c.poll(timeout_ms=100)
        return {tp: max(c.highwater(tp), start[tp]) for tp in tps}
    finally:
        c.close()


def group_lag(t: TransportConfig, group: str, tps: list[TP], timeout_s: float = 30.0) -> list[dict]:
    """Per partition: the group's committed offset (None if it committed none), the end offset and
    the lag between them (the end offset, from the start, where nothing is committed).

    The end is the high watermark of a fetch from the committed offset: the local broker's
    end_offsets() reports the start of the last batch, not the end of the partition.
    """
    c = consumer(t, group_id=group)
    try:
        committed = {tp: c.committed(tp) for tp in tps}
        c.assign({tp: off or 0 for tp, off in committed.items()})
        deadline = time.time() + timeout_s
        while any(c.highwater(tp) is None for tp in tps):
            if time.time() > deadline:
                raise TransportError(f"no high watermark for {[tp for tp in tps if c.highwater(tp) is None]} in {timeout_s}s")
            c.poll(timeout_ms=200, max_records=1)
        return [{"topic": topic, "partition": partition, "committed": committed[(topic, partition)],
                 "end": c.highwater((topic, partition)), "lag": c.highwater((topic, partition)) - (committed[(topic, partition)] or 0)}
                for topic, partition in tps]
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


class Record(NamedTuple):
    """A record as `RdKafkaReader` returns it: the fields every record of the log interface has."""
    topic: str
    partition: int
    offset: int
    timestamp: int | None
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]  # (name, value) pairs, as kafka-python's records carry them
    headers: list[tuple[str, bytes]]  # as kafka-python's ConsumerRecord.headers: (name, value) pairs


class RdKafkaReader:
    """The part of `LogReader` the syncer uses, on librdkafka (confluent-kafka): its intake. librdkafka
    fetches and parses in its own C threads, so a record costs the syncer a fraction of kafka-python's
    parsing (docs/bench.md, the syncer's intake).

    Positions are kept here: the next offset of each assigned partition, moved by `seek` and by what
    `poll` returns, so that a record the syncer has not seen is never skipped. The high watermark is
    librdkafka's figure from a fetch response since the partition was last assigned or sought (None
    before one: a figure cached from an earlier assignment can be behind the log; the local broker's
    ListOffsets is wrong, as `read_to_end` explains). A fatal client error is a `LogError`; other client
    errors are logged (once a minute per kind) while librdkafka retries. Commits are asynchronous (the
    group is for monitoring: a broker away never blocks the caller); a refused one is a `LogError`
    at the next `commit`."""

    def __init__(self, t: TransportConfig, group_id: str | None = None):
        import confluent_kafka

        self._ck = confluent_kafka
        self.group_id = group_id
        self._commit_error: str | None = None
        self._said: dict[str, float] = {}       # error name -> when it was last logged
        settings = {**rdkafka_settings(t, group_id), "enable.partition.eof": True, "on_commit": self._committed}
        try:
            self._consumer = confluent_kafka.Consumer(settings)
        except confluent_kafka.KafkaException as err:
            raise TransportError(f"librdkafka consumer for {t.bootstrap_servers}: {err}") from None
        self._positions: dict[TP, int] = {}
        self._fetched: set[TP] = set()         # partitions a fetch answered since their assign or seek
        self._moved = False

    def assign(self, positions: Mapping[TP, int]) -> None:
        self._positions = dict(positions)
        self._fetched.clear()
        self._moved = True

    def seek(self, tp: TP, offset: int) -> None:
        self._positions[tp] = offset
        self._fetched.discard(tp)
        self._moved = True

    def assignment(self) -> set[TP]:
        return set(self._positions)

    def position(self, tp: TP) -> int:
        return self._positions[tp]

    def highwater(self, tp: TP) -> int | None:
        if tp not in self._fetched:
            return None
        _, high = self._consumer.get_watermark_offsets(self._ck.TopicPartition(*tp), cached=True)
        return high if high >= 0 else None

    def poll(self, timeout_ms: int = 0, max_records: int = 500) -> dict[TP, list[Record]]:
        ck = self._ck
        if self._moved:  # librdkafka starts each partition where `assign` says: the positions kept here
            self._consumer.assign([ck.TopicPartition(*tp, off) for tp, off in self._positions.items()])
            self._moved = False
        out: dict[TP, list[Record]] = {}
        for msg in self._consumer.consume(max_records, timeout_ms / 1000):
            err = msg.error()
            if err is not None:
                if err.code() == ck.KafkaError._PARTITION_EOF:  # a fetch answered: its watermark is current
                    self._fetched.add((msg.topic(), msg.partition()))
                    continue
                if err.fatal():
                    raise LogError(f"librdkafka: {err}", kind="KafkaException")
                self._say(err)  # transient (a broker away): librdkafka retries by itself
                continue
            tp = (msg.topic(), msg.partition())
            self._fetched.add(tp)
            if tp in self._positions and msg.offset() >= self._positions[tp]:
                out.setdefault(tp, []).append(Record(tp[0], tp[1], msg.offset(), msg.timestamp()[1], msg.key(), msg.value(),
                                                     msg.headers() or []))
                self._positions[tp] = msg.offset() + 1
        return out

    def commit(self, offsets: Mapping[TP, int], timeout_ms: int | None = None) -> None:
        """Send `offsets` as the group's, without waiting (`timeout_ms` is kafka-python's; nothing waits
        here); raises LogError if the commit before this one was refused."""
        refused, self._commit_error = self._commit_error, None
        try:
            self._consumer.commit(offsets=[self._ck.TopicPartition(*tp, off) for tp, off in offsets.items()],
                                  asynchronous=True)
        except self._ck.KafkaException as err:
            refused = refused or str(err)
        if refused:
            raise LogError(f"librdkafka commit: {refused}", kind="KafkaException")

    def _committed(self, err, partitions) -> None:  # librdkafka's on_commit, called inside consume()
        if err is not None:
            self._commit_error = str(err)

    def _say(self, err) -> None:
        now = time.monotonic()
        if now - self._said.get(err.name(), -math.inf) >= 60.0:
            self._said[err.name()] = now
            log.warning("librdkafka: %s (retrying)", err)

    def close(self) -> None:
        self._consumer.close()


def intake_consumer(t: TransportConfig, client: str, group_id: str | None = None) -> LogReader | RdKafkaReader:
    """The syncer's reader of contributions and events, on the client `syncer.consumer` names."""
    return RdKafkaReader(t, group_id) if client == "librdkafka" else consumer(t, group_id=group_id)
