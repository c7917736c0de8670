"""The Kafka adapter's production settings: replication of the topics it creates, producer acks, SASL."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType

from diloco.config import build_config
from diloco.infra import kafka as kafka_io


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
