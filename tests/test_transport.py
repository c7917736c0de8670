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
