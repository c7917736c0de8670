"""Which syncer shard owns which fragment: a pure function of the shard count and the live shards.

Fragment p lives on partition p of every region topic, so owning a fragment means reading those
partitions. Its home is shard p % N; while the home is down, the live shards share its fragments
round-robin, and when it comes back the foster releases them (the load rebalances).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet


def home_shard(fragment: int, shards: int) -> int:
    return fragment % shards


def owner_of(fragment: int, shards: int, live: AbstractSet[int]) -> int:
    """The shard that should own `fragment` when `live` shards are up (its home if none is)."""
    home = home_shard(fragment, shards)
    if home in live or not live:
        return home
    fosters = sorted(live)
    return fosters[fragment % len(fosters)]


def wanted(shard: int, fragments: int, shards: int, live: AbstractSet[int]) -> set[int]:
    return {p for p in range(fragments) if owner_of(p, shards, live | {shard}) == shard}
