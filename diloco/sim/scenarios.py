"""Two scenarios on the goodput simulator: scavenged compute, and two chip generations in one run.

- scavenge: the base run trains a token budget (merged productive chip-time, what goodput counts).
  Extra capacity, `extra` times the base chips, is there from the start and is reclaimed once a
  `share` of the budget has been merged (dp: checkpointed). Each scheme's time to the budget is
  divided by its own base run's on the same cluster. For diloco the extra capacity is extra learners
  the size of the base ones, which join after `join_s` from the latest merged version and, when
  reclaimed, lose the work they have not sent (unless the leave is graceful). dp runs one bigger job
  (more failures, more straggling) and re-forms it to shrink: a `reconfig_s` pause.
- mixed: half the learners (by default) on an older chip generation whose steps take `slow_factor`
  times as long, under K = M without grace, K = 1 without grace and K = 1 with grace.

The rounds close by `diloco.syncer.policy.decide` through goodput._EventSim, as in `simulate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from diloco.sim.checkpointing import best_checkpoint_interval
from diloco.sim.goodput import (
    SCHEMES,
    YEAR_S,
    Churn,
    Cluster,
    Diloco,
    Result,
    learner_slices,
    simulate_diloco,
)

# Decoupled DiLoCo (arXiv 2604.21428): wall-clock to the same budget with scavenged compute, against the
# run without it. Data-parallel: the paper gives +300% only.
PAPER_SCAVENGE = {"diloco": {0.25: 0.90, 0.5: 0.83, 1.0: 0.75, 3.0: 0.62}, "dp": {3.0: 0.80}}
SCAVENGE_SCHEMES = ("dp", "diloco")


def ideal_ratio(extra: float, share: float = 0.5) -> float:
    """Time to the budget of a lossless system whose capacity is 1 + extra until `share` of the budget
    is done, over its time without the extra: share / (1 + extra) + (1 - share). With share 0.5 this
    is 0.900, 0.833, 0.750 and 0.625 at +25, 50, 100 and 300%: the paper's four figures (our reading)."""
    return share / (1.0 + extra) + (1.0 - share)


@dataclass(frozen=True, kw_only=True)
class Scavenge:
    extra: float = 1.0          # extra chips, as a multiple of the base cluster's
    share: float = 0.5          # of the budget merged before the extra chips are reclaimed
    budget_hours: float = 24.0  # the token budget: the base cluster's chip-time over this many hours
    join_s: float = Diloco().spare_s  # a joining learner's start: measured for a spare taking over
    graceful_leave: bool = False      # reclaimed learners send their unsent work first

    def __post_init__(self):
        if self.extra < 0 or not 0 <= self.share <= 1 or self.budget_hours <= 0 or self.join_s < 0:
            raise ValueError("extra and join_s must be >= 0, share in [0, 1], budget_hours > 0")


@dataclass(frozen=True)
class ScavengeRow:
    scheme: str
    extra: float           # as asked
    extra_chips: int       # as simulated: whole learners of the base size
    base_hours: float      # time to the budget without the extra chips
    hours: float           # ... with them
    ratio: float           # hours / base_hours
    ideal: float           # ideal_ratio of the extra chips simulated
    paper: float | None
    base_failures: int
    failures: int

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("scheme", "extra", "extra_chips", "base_hours", "hours", "ratio",
                                              "ideal", "paper")}


def extra_learners(learners: int, extra: float) -> int:
    """Extra capacity as whole learners of the base size: +25% of 8 learners is 2."""
    return round(extra * learners)


def budget_chip_s(c: Cluster, s: Scavenge) -> float:
    return c.chips * s.budget_hours * 3600.0


def _rng(seed: int, scheme: str, c: Cluster) -> np.random.Generator:
    return np.random.default_rng([seed, SCHEMES.index(scheme), c.chips])


def diloco_to_budget(c: Cluster, setup: Diloco, s: Scavenge, seed: int = 0) -> Result:
    """diloco to the budget with extra learners (none if s.extra rounds to 0 learners or s.share is 0).
    Each learner draws from its own stream, so the base learners fail alike with or without the extra."""
    added = extra_groups(c, setup, s.extra)
    extra = list(range(setup.learners, setup.learners + len(added)))
    groups = learner_slices(c, setup.learners) + added
    budget = budget_chip_s(c, s)
    churn = Churn(tuple(extra), s.join_s, tuple(extra), s.share * budget if extra else math.inf, s.graceful_leave)
    return simulate_diloco(c, setup, _rng(seed, "diloco", c), groups=groups, churn=churn, until_work=budget)


def dp_time_to_work(work: float, work_rate: float, c: Cluster, chips: float,
                    rng: np.random.Generator) -> tuple[float, int, float]:
    """(seconds, failures, work committed) of one synchronous job of `chips` committing `work` productive
    chip-seconds at `work_rate` of them per second while it runs: `simulate_dp`'s runs, restarts and
    checkpoint interval, run to a target instead of a horizon. Work counts once checkpointed, so the
    target is met at the checkpoint that crosses it (the work committed may pass it by that much)."""
    if work <= 0:
        return 0.0, 0, 0.0
    rate = chips / (c.mtbi_years * YEAR_S)
    if rate == 0:  # nothing is ever lost, so nothing needs a checkpoint
        return work / work_rate, 0, work
    restart = c.recovery_s + c.reconfig_s
    interval = best_checkpoint_interval(rate, restart, c.checkpoint_s)
    seg = interval + c.checkpoint_s
    done, failures, t = 0.0, 0, 0.0
    while True:
        runs = rng.exponential(1.0 / rate, 4096)
        kept = runs if interval == 0 else np.floor(runs / seg) * interval  # committed run-time of each run
        total = done + np.cumsum(kept) * work_rate
        k = int(np.searchsorted(total, work))  # the first run whose commits reach the target
        if k == len(runs):
            done, failures, t = float(total[-1]), failures + k, t + float(np.sum(runs + restart))
            continue
        before = float(total[k - 1]) if k else done
        start = t + float(np.sum(runs[:k] + restart))  # each earlier run ended by a failure and a restart
        need = (work - before) / work_rate  # committed run-time still needed, inside run k
        if interval == 0:
            return start + need, failures + k, work
        segments = max(1, math.ceil(need / interval - 1e-9))  # the tolerance absorbs rounding
        return start + segments * seg, failures + k, before + segments * interval * work_rate


def dp_to_budget(c: Cluster, extra_slices: int, s: Scavenge, seed: int = 0) -> tuple[float, int]:
    """(seconds, failures) of dp to the budget: one job over the cluster and `extra_slices` more until
    s.share of the budget is checkpointed, then a reconfig_s pause to re-form it on the base cluster.
    The reclaim comes right after a checkpoint, the cheapest moment for dp: nothing is recomputed."""
    slice_chips = c.chips / c.slices()
    budget = budget_chip_s(c, s)

    def work_rate(slices: int) -> float:  # productive chip-seconds per second of running: straggling costs
        return slices * slice_chips * c.step_s / c.mean_step_s(slices)

    base_stream, extra_stream = _rng(seed, "dp", c).spawn(2)
    first, failures, done = 0.0, 0, 0.0
    if extra_slices and s.share > 0:
        grown = c.slices() + extra_slices
        first, failures, done = dp_time_to_work(s.share * budget, work_rate(grown), c, grown * slice_chips,
                                                extra_stream)
        first += c.reconfig_s
    rest, more, _ = dp_time_to_work(budget - done, work_rate(c.slices()), c, c.chips, base_stream)
    return first + rest, failures + more


def extra_groups(c: Cluster, setup: Diloco, extra: float) -> list[int]:
    """The slices of each extra learner: whole learners the size of the base ones."""
    base = learner_slices(c, setup.learners)
    return [base[i % setup.learners] for i in range(extra_learners(setup.learners, extra))]


def extra_slices(c: Cluster, setup: Diloco, extra: float) -> int:
    """The slices of the extra learners: the same chips for dp, as one bigger job."""
    return sum(extra_groups(c, setup, extra))


def time_to_budget(scheme: str, c: Cluster, setup: Diloco, s: Scavenge, seed: int = 0) -> tuple[float, int]:
    """(seconds, failures) of one scheme to the budget with s.extra; s.extra = 0 is its base run."""
    if scheme == "diloco":
        r = diloco_to_budget(c, setup, s, seed)
        return r.seconds, r.failures
    if scheme == "dp":
        return dp_to_budget(c, extra_slices(c, setup, s.extra), s, seed)
    raise ValueError(f"scavenge compares {', '.join(SCAVENGE_SCHEMES)}, not {scheme!r}")


def scavenge_row(scheme: str, c: Cluster, setup: Diloco, s: Scavenge, base: tuple[float, int],
                 scavenged: tuple[float, int]) -> ScavengeRow:
    added = extra_slices(c, setup, s.extra)
    simulated = added / c.slices(setup.learners)
    paper = PAPER_SCAVENGE[scheme].get(s.extra) if s.share == 0.5 else None
    return ScavengeRow(scheme, s.extra, round(added * c.chips / c.slices(setup.learners)), base[0] / 3600,
                       scavenged[0] / 3600, scavenged[0] / base[0], ideal_ratio(simulated, s.share), paper,
                       base[1], scavenged[1])


def _serially(fn, cases: list[tuple]) -> list:
    return [fn(*case) for case in cases]


def scavenge(c: Cluster, setup: Diloco, levels: Sequence[Scavenge], seed: int = 0,
             schemes: Sequence[str] = SCAVENGE_SCHEMES, run_all=_serially) -> list[ScavengeRow]:
    """Each scheme's time to the budget at each level of extra chips against its base run (one per
    scheme: the first level's budget without the extra), level by level. `run_all(fn, cases)` runs
    the independent cases (the CLI spreads them over processes)."""
    if not levels:
        return []
    runs = [replace(levels[0], extra=0.0), *levels]
    times = run_all(time_to_budget, [(scheme, c, setup, s, seed) for scheme in schemes for s in runs])
    of = {scheme: times[k * len(runs):(k + 1) * len(runs)] for k, scheme in enumerate(schemes)}
    return [scavenge_row(scheme, c, setup, s, of[scheme][0], of[scheme][i])
            for i, s in enumerate(runs[1:], 1) for scheme in schemes]


# --- two chip generations --------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Mixed:
    slow_share: float = 0.5   # of the learners on the older generation
    slow_factor: float = 1.5  # its step time over the newer one's

    def __post_init__(self):
        if not 0 <= self.slow_share <= 1 or self.slow_factor <= 0:
            raise ValueError("slow_share must be in [0, 1] and slow_factor > 0")

    def speeds(self, learners: int) -> list[float]:
        slow = round(self.slow_share * learners)
        return [1.0] * (learners - slow) + [self.slow_factor] * slow


@dataclass(frozen=True)
class MixedRow:
    policy: str
    quorum: int
    grace_max_s: float
    goodput: float       # productive chip-time, each chip's step at its own nominal time, over all chip-time
    merged_share: float  # of the tokens trained
    late_share: float    # of the contributions merged: trained from an older version than their round's
    rounds: int

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("policy", "quorum", "grace_max_s", "goodput", "merged_share",
                                              "late_share")}


def mixed_policies(setup: Diloco) -> list[tuple[str, Diloco]]:
    """The three policies the paper compares on mixed hardware, the rest of `setup` kept."""
    m, grace = setup.learners, setup.grace_max_s
    return [(f"K = M = {m}, no grace", replace(setup, quorum=m, grace_max_s=0.0)),
            ("K = 1, no grace", replace(setup, quorum=1, grace_max_s=0.0)),
            (f"K = 1, grace <= {grace:g} s", replace(setup, quorum=1))]


def mixed(c: Cluster, setup: Diloco, mix: Mixed, seed: int = 0) -> list[MixedRow]:
    """Each policy on the same learners and the same failures (one stream per case, the same seed)."""
    rows = []
    for name, policy in mixed_policies(setup):
        r = simulate_diloco(c, policy, _rng(seed, "diloco", c), speeds=mix.speeds(setup.learners))
        rows.append(MixedRow(name, policy.k, policy.grace_max_s, r.goodput, r.merged_share,
                             r.late / r.contributions if r.contributions else 0.0, r.rounds))
    return rows
