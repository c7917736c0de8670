"""Split a flat parameter dict into P fragments of balanced size, and the sync schedule."""

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
