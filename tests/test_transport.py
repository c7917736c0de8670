"""The Kafka adapter's production settings: replication of the topics it creates, producer acks, SASL."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType

from diloco.config import ConfigError, build_config
from diloco.infra import kafka as kafka_io
from diloco.infra import services
from diloco.infra.kafka import TransportError


def _transport(**kw):
    return build_config({"transport": kw}).transport


@pytest.mark.integration
def test_topics_are_created_replicated_as_configured(kafka_bootstrap):
    """Tansu (one node, no replication of its own) records both settings, so they can be read back; a
    real cluster refuses a replication factor above its broker count instead."""
    durable = _transport(bootstrap_servers=kafka_bootstrap, replication_factor=3, min_insync_replicas=2, acks="all")
    plain = _transport(bootstrap_servers=kafka_bootstrap)
    names = {f"repl-{time.time_ns()}-{k}": t for k, t in (("durable", durable), ("plain", plain))}
    for name, t in names.items():
        kafka_io.ensure_topics(t, {name: 2})
    admin = KafkaAdminClient(**kafka_io._common(plain))
    try:
        for name, t in names.items():
            (desc,) = admin.describe_topics([name])
            assert [len(p["replica_nodes"]) for p in desc["partitions"]] == [t.replication_factor] * 2
            configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)], config_filter="all")
            insync = configs["topic"][name].get("min.insync.replicas", {}).get("value")
            assert insync == (None if t.min_insync_replicas is None else str(t.min_insync_replicas))  # None: broker's
    finally:
        admin.close()
    p = kafka_io.producer(_transport(bootstrap_servers=kafka_bootstrap, acks=1))
    try:
        assert p.config["acks"] == 1
        assert p.send(next(iter(names)), b"x").get(timeout=10).offset == 0
    finally:
        p.close()


def test_a_missing_broker_is_reported_within_the_callers_timeout():
    """kafka-python's clients wait 30 s for a first broker by default; `diloco infra status` asks for 3."""
    t = _transport(bootstrap_servers=f"127.0.0.1:{services.free_port()}")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(TransportError, match="not reachable"):
        kafka_io.ensure_topics(t, {}, timeout_s=1)
    assert time.monotonic() - started < 10


def test_sasl_clients_get_mechanism_user_and_the_password_from_the_env_var(monkeypatch):
    t = _transport(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="diloco",
                   sasl_password_env="DILOCO_TEST_KAFKA_PW", ssl_cafile="/etc/ssl/kafka-ca.pem")
    monkeypatch.setenv("DILOCO_TEST_KAFKA_PW", "kafka-pw")
    kw = kafka_io._common(t)
    assert {k: kw[k] for k in ("security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
                               "ssl_cafile")} == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                                                  "sasl_plain_username": "diloco", "sasl_plain_password": "kafka-pw",
                                                  "ssl_cafile": "/etc/ssl/kafka-ca.pem"}
    monkeypatch.delenv("DILOCO_TEST_KAFKA_PW")
    with pytest.raises(ConfigError, match=r"transport.sasl_password_env names \$DILOCO_TEST_KAFKA_PW, which is not set"):
        kafka_io._common(t)
    assert "sasl_mechanism" not in kafka_io._common(_transport())


def test_the_librdkafka_intake_gets_the_same_broker_security_and_limits_as_kafka_python(monkeypatch):
    monkeypatch.setenv("KAFKA_PW", "s3cret")
    cfg = build_config({"transport": {"bootstrap_servers": "a:9093,b:9093", "security_protocol": "SASL_SSL",
                                      "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "syncer",
                                      "sasl_password_env": "KAFKA_PW", "ssl_cafile": "/etc/ca.pem",
                                      "max_message_bytes": 4 << 20}, "syncer": {"consumer": "librdkafka"}})
    s = kafka_io.rdkafka_settings(cfg.transport, group_id=None)
    assert s["bootstrap.servers"] == "a:9093,b:9093" and s["security.protocol"] == "sasl_ssl"
    assert (s["sasl.mechanism"], s["sasl.username"], s["sasl.password"]) == ("SCRAM-SHA-512", "syncer", "s3cret")
    assert s["ssl.ca.location"] == "/etc/ca.pem"
    assert s["max.partition.fetch.bytes"] == (4 << 20) + 65536 and s["enable.auto.commit"] is False
    with pytest.raises(ConfigError, match="syncer.consumer"):
        build_config({"syncer": {"consumer": "sarama"}})


@pytest.mark.integration
@pytest.mark.parametrize("client", ["kafka-python", "librdkafka"])
def test_the_syncers_consumer_reads_on_from_where_it_is_sought_on_either_client(kafka_bootstrap, client):
    """What the syncer relies on after a restart, a takeover or a lost payload: a seek back reads every
    record again in order, even those the client already fetched ahead; a seek forward skips to
    there; position and high watermark say where it is."""
    t = _transport(bootstrap_servers=kafka_bootstrap)
    topic = f"seek-{client}-{time.time_ns()}"
    kafka_io.ensure_topics(t, {topic: 1})
    p = kafka_io.producer(t)
    for i in range(200):
        p.send(topic, str(i).encode(), partition=0)
    p.flush()
    p.close()
    c = kafka_io.intake_consumer(t, client)
    tp = (topic, 0)

    def read(n: int, batch: int = 500) -> list[tuple[int, bytes]]:
        out: list = []
        deadline = time.time() + 30
        while len(out) < n and time.time() < deadline:
            for records in c.poll(timeout_ms=200, max_records=min(batch, n - len(out))).values():
                out += [(r.offset, r.value) for r in records]
        return out

    try:
        c.assign({tp: 0})
        assert read(60, batch=7) == [(i, str(i).encode()) for i in range(60)]
        time.sleep(0.5)                                   # the client fetches ahead meanwhile
        c.seek(tp, 10)
        assert [o for o, _ in read(190)] == list(range(10, 200))
        assert c.position(tp) == c.highwater(tp) == 200 and c.assignment() == {tp}
        c.seek(tp, 150)
        assert [o for o, _ in read(50)] == list(range(150, 200))
    finally:
        c.close()
        kafka_io.delete_topics(t, [topic])


@pytest.mark.integration
@pytest.mark.parametrize("client", ["kafka-python", "librdkafka"])
def test_a_reassigned_partition_has_no_high_watermark_until_a_fetch_answers(kafka_bootstrap, client):
    """Issue 53 M5: librdkafka kept the watermark of an earlier assignment; on a re-claim it said a
    partition was read to its end before the first fetch (records written meanwhile unread), and the
    syncer gave up a pending contribution still in the log as lost_payload."""
    t = _transport(bootstrap_servers=kafka_bootstrap)
    topic = f"rewatch-{client}-{time.time_ns()}"
    kafka_io.ensure_topics(t, {topic: 1})
    p = kafka_io.producer(t)

    def write(n):
        for i in range(n):
            p.send(topic, b"x", partition=0)
        p.flush()

    c = kafka_io.intake_consumer(t, client)
    tp = (topic, 0)
    try:
        write(20)
        c.assign({tp: 0})
        deadline = time.time() + 30
        while c.highwater(tp) != 20 or c.position(tp) < 20:
            assert time.time() < deadline, (c.highwater(tp), c.position(tp))
            c.poll(timeout_ms=200)
        c.assign({})                                      # the fragment goes to another shard...
        write(5)
        c.assign({tp: 20})                                # ...and comes back
        assert c.highwater(tp) is None or c.highwater(tp) == 25   # never the old 20, read as "at the end"
        while c.highwater(tp) != 25:
            assert time.time() < deadline
            c.poll(timeout_ms=200)
    finally:
        c.close()
        p.close()
        kafka_io.delete_topics(t, [topic])


@pytest.mark.integration
def test_a_librdkafka_commit_never_waits_for_a_broker_that_is_away(tmp_path):
    """Issue 53 M6: the commit blocked the syncer's loop for the whole outage (past 45 s)."""
    port = services.free_port()
    services.start_broker(tmp_path / "kafka", port)
    t = _transport(bootstrap_servers=f"127.0.0.1:{port}")
    topic = f"commit-{time.time_ns()}"
    kafka_io.ensure_topics(t, {topic: 1})
    c = kafka_io.intake_consumer(t, "librdkafka", group_id=f"g-{topic}")
    try:
        c.assign({(topic, 0): 0})
        c.poll(timeout_ms=500)
        services.stop("kafka", tmp_path / "kafka")
        t0 = time.monotonic()
        for _ in range(3):
            try:
                c.commit({(topic, 0): 0})
            except kafka_io.LogError:
                pass                                      # refused: said at once, not waited for
            c.poll(timeout_ms=100)
        assert time.monotonic() - t0 < 5.0
        services.start_broker(tmp_path / "kafka", port)   # back: close delivers what is outstanding at once
    finally:
        c.close()
        services.stop("kafka", tmp_path / "kafka")


@pytest.mark.integration
def test_a_broker_that_requires_sasl_refuses_unknown_credentials_with_a_clear_error(tmp_path, monkeypatch):
    """Tansu with --authentication negotiates SCRAM, but its memory engine keeps no users, so every
    login is refused (services.start_broker): this is the refusal, and what the error tells the operator."""
    port = services.free_port()
    services.start_broker(tmp_path, port, authentication=True)
    monkeypatch.setenv("DILOCO_TEST_KAFKA_PW", "wrong-pw")
    try:
        t = _transport(bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SASL_PLAINTEXT",
                       sasl_mechanism="SCRAM-SHA-512", sasl_username="diloco", sasl_password_env="DILOCO_TEST_KAFKA_PW")
        with pytest.raises(TransportError) as err:
            kafka_io.ensure_topics(t, {"never-created": 1}, timeout_s=1)
        msg = str(err.value)
        assert "answers but the SASL_PLAINTEXT connection failed" in msg and "sasl_username" in msg
        assert "wrong-pw" not in msg and "diloco infra up" not in msg
    finally:
        services.stop("kafka", tmp_path)
