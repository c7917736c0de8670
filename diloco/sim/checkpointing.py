"""Goodput of one synchronous job that checkpoints and restarts after every failure, in closed form
(Daly 2006), and the checkpoint interval that maximises it. Pure functions of rates and durations."""

from __future__ import annotations

import math

import numpy as np


def dp_goodput(rate: float, restart_s: float, checkpoint_s: float, interval_s: float) -> float:
    """Closed-form goodput of one synchronous job checkpointing every `interval_s` (before straggling).

    A segment of interval + checkpoint seconds is redone after any failure inside it, so the expected
    wall time per committed segment is (1/rate + restart)(exp(rate (interval + checkpoint)) - 1)
    (Daly 2006). Failures during a restart are absorbed by it, which keeps the restart outside the
    exponential. interval 0 means free continuous checkpoints: only restarts cost.
    """
    if rate == 0:
        return 1.0 if math.isinf(interval_s) else interval_s / (interval_s + checkpoint_s)
    if interval_s == 0:
        return 1.0 / (1.0 + rate * restart_s)
    return interval_s / ((1.0 / rate + restart_s) * math.expm1(rate * (interval_s + checkpoint_s)))


def best_checkpoint_interval(rate: float, restart_s: float, checkpoint_s: float) -> float:
    """The interval maximising `dp_goodput`, searched around Young-Daly sqrt(2 C / rate): that
    first-order rule overshoots when a failure comes every few tens of seconds."""
    if rate == 0:
        return math.inf
    if checkpoint_s == 0:
        return 0.0
    grid = math.sqrt(2 * checkpoint_s / rate) * np.geomspace(1e-2, 1e2, 4001)
    with np.errstate(over="ignore"):
        g = grid / ((1.0 / rate + restart_s) * np.expm1(rate * (grid + checkpoint_s)))
    return float(grid[np.argmax(g)])
