"""Which syncer shard owns which fragment: a pure function of the shard count and the live shards.

Fragment p lives on partition p of every region topic, so owning a fragment means reading those
partitions. Its home is shard p % N; while the home is down, the live shards share its fragments
round-robin, and when it comes back the foster releases them (the load rebalances).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass


def check_layout(partitions: int, fragments: int, shard: int, shards: int) -> None:
    """ValueError unless each fragment has a partition of its own and `shard` is one of `shards`."""
    if partitions != fragments:  # ownership follows partitions one to one
        raise ValueError(f"{partitions} partitions per region topic for {fragments} fragments")
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not in 0..{shards - 1} (syncer.shards={shards})")


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


@dataclass(frozen=True)
class Moves:
    """What one shard does with its fragments at a rebalance."""
    drop: list[int]      # held, but the lease lapsed: another shard may have it already
    release: list[int]   # held, but another live shard should own them now
    claim: list[int]     # this shard should own them and does not hold them (taken if the lease is free)
    coordinator: bool    # the lowest live shard speaks for the learner registry


def moves(shard: int, fragments: int, shards: int, live: AbstractSet[int], held: AbstractSet[int],
          lost: AbstractSet[int], *, claiming: bool, settled: bool) -> Moves:
    """A rebalance's decision. A fragment this shard fosters is claimed only once `settled` (the other
    shards had a lease TTL to say they are live), so a starting shard does not grab another's home
    fragments; its own home fragments it claims at once. A stopping shard claims nothing."""
    live = set(live) | {shard}
    want = wanted(shard, fragments, shards, live)
    drop = sorted(set(held) & set(lost))
    kept = set(held) - set(drop)
    claim = [p for p in sorted(want - kept) if home_shard(p, shards) == shard or settled] if claiming else []
    return Moves(drop, sorted(kept - want), claim, coordinator=shard == min(live))
