"""Split a flat parameter dict into P fragments of balanced size, and the sync schedule: which
fragments a learner syncs, fetches and holds at each step (the learner's Session and the goodput
simulator both decide with these functions)."""

from __future__ import annotations

import math
from collections.abc import Mapping


def plan_fragments(shapes: Mapping[str, tuple[int, ...]], count: int) -> list[list[str]]:
    """Greedy largest-first bin packing of tensors into `count` fragments (deterministic).

    Each fragment's tensor names come back sorted, so every process derives the same plan.
    """
    if count < 1:
        raise ValueError("fragment count must be >= 1")
    if count > len(shapes):
        raise ValueError(f"{count} fragments requested but the model has only {len(shapes)} tensors")
    bins: list[list[str]] = [[] for _ in range(count)]
    sizes = [0] * count
    for name in sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n)):
        i = min(range(count), key=lambda b: (sizes[b], b))
        bins[i].append(name)
        sizes[i] += math.prod(shapes[name])
    return [sorted(b) for b in bins]


def sync_offset(fragment: int, count: int, every: int) -> int:
    """Step (1-based) within each period of `every` steps at which `fragment` syncs.

    Offsets are spread evenly so that about one fragment is in flight at a time (Streaming DiLoCo).
    """
    return (fragment + 1) * every // count or 1


def fragments_due(step: int, count: int, every: int) -> list[int]:
    """Fragments whose sync point falls after inner step `step` (1-based count of steps done)."""
    return [p for p in range(count) if step >= 1 and step % every == sync_offset(p, count, every) % every]


def syncs_through(step: int, fragment: int, count: int, every: int) -> int:
    """How many sync points `fragment` has had in steps 1..`step`: the round a learner is in."""
    off = sync_offset(fragment, count, every) % every
    first = off or every  # the first step t >= 1 with t % every == off
    return 0 if step < first else (step - first) // every + 1


HOLD_PERIODS = 4  # one_delta_per_version: a held fragment is sent anyway after this many sync periods of steps


def fragments_to_fetch(step: int, count: int, every: int, prefetch_steps: int) -> list[int]:
    """Fragments whose newest version a learner wants after inner step `step`: those due to sync
    within `prefetch_steps` (at most a period), so that their next delta starts from it."""
    return fragments_due(step + min(prefetch_steps, every), count, every)


def must_hold(*, sent_from: int | None, version: int | None, steps_since_send: int, every: int) -> bool:
    """fragments.one_delta_per_version: whether a fragment due to sync waits for a new version
    instead: the learner already sent a delta from the version it is on, and has held it for under
    HOLD_PERIODS periods (a syncer that is down does not keep unbounded work unsent)."""
    return sent_from == version and steps_since_send < HOLD_PERIODS * every
