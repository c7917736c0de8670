"""The log's plain vocabulary, with no client library behind it: a partition is a `(topic, partition)`
tuple. The syncer's records and the adapters (infra/kafka.py) both name partitions by it."""

from __future__ import annotations

TP = tuple[str, int]  # (topic, partition)


def partitions_of(topic: str, n: int) -> list[TP]:
    """The partitions 0..n-1 of `topic`."""
    return [(topic, p) for p in range(n)]
