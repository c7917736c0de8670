"""Seeded fault schedules and the goodput they leave, as pure functions.

A chaos run kills each learner `learner_kills` times at inner steps drawn uniformly from the
configured window, and the syncer `syncer_kills` times at points of overall progress drawn the same
way. Three figures come out:
- goodput: the share of learner compute time whose tokens entered a merge;
- goodput_wall: productive compute over learner wall-clock time (learners x span of the run), which
  also charges the time a killed learner is down;
- goodput_sync_equivalent: the share of learner wall-clock time a synchronous run would keep under
  the same failures (compare it with goodput_wall).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from diloco.config import Config


@dataclass(frozen=True)
class Kill:
    target: str          # a learner id or a syncer shard ("syncer", or "syncer-<i>" when sharded)
    at_progress: float   # learner: its inner step / steps; syncer: the mean over learners


def schedule(cfg: Config) -> list[Kill]:
    rng = random.Random(cfg.chaos.seed)
    lo, hi = cfg.chaos.window
    kills = [Kill(lid, rng.uniform(lo, hi)) for lid in cfg.learner_ids() for _ in range(cfg.chaos.learner_kills)]
    syncers = cfg.syncer_ids()
    kills += [Kill(syncers[0] if len(syncers) == 1 else rng.choice(syncers), rng.uniform(lo, hi))
              for _ in range(cfg.chaos.syncer_kills)]
    return sorted(kills, key=lambda k: (k.at_progress, k.target))


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def goodput(productive_s: float, compute_s: float) -> float:
    return productive_s / compute_s if compute_s > 0 else 0.0


def sync_equivalent_goodput(*, span_s: float, outages: Sequence[tuple[float, float]], kills: int,
                            lost_per_kill_s: float) -> float:
    """The share of time a synchronous run keeps under the same failures.

    Every outage (a killed process until its replacement runs again) stalls all learners, and each
    kill throws away the work since the last synchronisation (on average half a sync period).
    """
    if span_s <= 0:
        return 0.0
    kept = span_s - union_length(outages) - kills * lost_per_kill_s
    return max(kept, 0.0) / span_s
