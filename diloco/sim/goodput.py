"""Goodput of synchronous, elastic and Decoupled-DiLoCo training when chips keep failing.

A cluster of `chips` accelerators is cut into slices of `slice_chips`; one bad chip takes its whole
slice out. Every chip fails as a Poisson process with mean time between interruptions `mtbi_years`,
so a group of n slices fails at rate n * slice_chips / MTBI: no chip is ever an object, which is
what lets a day of 1.2M chips run in about a second.

- dp: one synchronous job. Any failure stops it; it resumes once the slice (or a spare standing in)
  is back and the job is re-formed (recovery_s + reconfig_s), from the last checkpoint. The
  checkpoint interval maximises the closed form below.
- elastic-dp: one synchronous job that re-forms (reconfig_s, everyone paused) without a failed
  slice, runs smaller, and re-forms again when the slice is back after recovery_s.
- diloco: M learners, each an elastic job over its own slices, so a failure pauses only its learner.
  Contributions go to a simulated syncer whose rounds close by `diloco.syncer.policy.decide`, the
  code the real syncer runs. A learner needs the merged value `overlap_steps` after sending and
  waits for it only if it has not come: with K = M and no grace this is synchronous DiLoCo.
  With spares (the local runner's `run.spares`), a failure kills the whole learner instead and a warm
  spare learner with its own slices takes its place after `spare_s`: no second pause when the slice
  comes back, but the steps since its last contribution are lost (the spare joins from the latest
  merged version). The spares' idle hardware is not charged.

Goodput is productive chip-time over total chip-time. A chip-step is worth its nominal `step_s`, so
straggling (a synchronous step waits for its slowest slice) costs goodput too; for diloco only steps
whose tokens entered a merge count. Every run stops gracefully at the horizon: dp checkpoints, the
learners send what they have and the syncer flushes its open round, as the real syncer does on stop.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from diloco.syncer.policy import QuorumPolicy, decide

SCHEMES = ("dp", "elastic-dp", "diloco")
YEAR_S = 365.25 * 24 * 3600
_EULER_GAMMA = 0.5772156649015329  # mean of the standard Gumbel distribution
_MIN_STEP = 0.5                    # a step never takes under half its nominal time (bounds the arrays)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The hardware and how it fails. Defaults are the paper setting; docs/simulate.md says why."""
    chips: int = 1_200_000
    slice_chips: int = 1024     # one bad chip takes this many out
    mtbi_years: float = 1.0     # per chip; math.inf for no failures
    recovery_s: float = 30.0    # until a failed slice, or the hot spare replacing it, serves again
    reconfig_s: float = 10.0    # to re-form an SPMD job on a changed set of slices, state kept in memory
    checkpoint_s: float = 1.0   # dp: to snapshot the training state to host memory
    step_s: float = 2.0         # nominal inner step on every slice
    step_cv: float = 0.01       # per-slice, per-step jitter of the step time (std / mean)
    hours: float = 24.0

    def __post_init__(self):
        for name in ("chips", "slice_chips", "mtbi_years", "step_s", "hours"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("recovery_s", "reconfig_s", "checkpoint_s", "step_cv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def horizon_s(self) -> float:
        return self.hours * 3600.0

    def slices(self, groups: int = 1) -> int:
        """Slices in the cluster; at least one per group so that every learner has hardware."""
        return max(groups, round(self.chips / self.slice_chips))

    def slice_rate(self, groups: int = 1) -> float:
        """Failures per second of one slice: the Poisson processes of its chips add up."""
        return self.chips / self.slices(groups) / (self.mtbi_years * YEAR_S)

    @property
    def jitter_scale(self) -> float:
        """Gumbel scale of one slice's step time (std = pi * scale / sqrt 6). Gumbel because the max of
        n Gumbels is Gumbel again, shifted by scale * ln n: a synchronous job's step is one exact draw."""
        return self.step_cv * self.step_s * math.sqrt(6) / math.pi

    def mean_step_s(self, n_slices: int) -> float:
        """Expected step time of a synchronous job over n slices (it waits for the slowest)."""
        return self.step_s + self.jitter_scale * math.log(max(n_slices, 1))


@dataclass(frozen=True, kw_only=True)
class Diloco:
    """Learner and syncer settings; the policy fields mean what they mean in `SyncerConfig`."""
    learners: int = 8
    quorum: int | None = None    # None: half the learners, rounded up
    sync_every: int = 100        # inner steps between two contributions of a learner (H / fragments)
    overlap_steps: int = 8       # tau: the merged value is needed this many steps after sending
    grace_gamma: float = 0.5
    grace_max_s: float = 3.0
    sync_s: float = 5.0          # from a round's close to its merged value being readable
    max_staleness: int = 4
    spares: bool = False         # a failed learner is replaced whole by a warm spare learner
    # Outage of a learner kill until the spare's first heartbeat with run.spares = 2 on the local
    # runner: mean of 1.79, 2.06, 2.15 and 2.43 s (docs/operations.md, "Learner failures": diloco chaos
    # on configs/local.yaml, 300 steps, seed 0, a 2-core machine, 2026-12-01).
    spare_s: float = 2.1

    def __post_init__(self):
        if self.spare_s < 0:
            raise ValueError(f"spare_s must be >= 0, got {self.spare_s}")
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if not 1 <= self.k <= self.learners:
            raise ValueError(f"quorum must be in [1, {self.learners}], got {self.quorum}")
        if not 0 <= self.overlap_steps < self.sync_every:
            raise ValueError("overlap_steps must be in [0, sync_every): one contribution in flight per learner")

    @property
    def k(self) -> int:
        return self.quorum if self.quorum is not None else math.ceil(self.learners / 2)

    def policy(self) -> QuorumPolicy:
        return QuorumPolicy(self.k, self.overlap_steps, self.grace_gamma, self.grace_max_s)


@dataclass(frozen=True)
class Result:
    scheme: str
    chips: int
    learners: int      # 1 for the single-job schemes
    quorum: int        # 1 for the single-job schemes: the job needs itself
    goodput: float     # productive chip-time / total chip-time
    failures: int      # slice failures seen during the horizon
    rounds: int = 0    # diloco: merges
    late: int = 0      # diloco: merged contributions that started from an older version than their round's

    def row(self) -> dict:
        return {"scheme": self.scheme, "chips": self.chips, "learners": self.learners, "quorum": self.quorum,
                "goodput": self.goodput}


# --- dp: closed form and simulation ----------------------------------------------------------------------

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


def simulate_dp(c: Cluster, rng: np.random.Generator) -> Result:
    """Alternating runs (exponential, at the whole cluster's failure rate) and restarts, vectorised."""
    rate = c.chips / (c.mtbi_years * YEAR_S)
    restart = c.recovery_s + c.reconfig_s
    interval = best_checkpoint_interval(rate, restart, c.checkpoint_s)
    pace = c.step_s / c.mean_step_s(c.slices())
    T = c.horizon_s
    if rate == 0:
        return Result("dp", c.chips, 1, 1, pace, 0)
    seg = interval + c.checkpoint_s

    def committed(run: np.ndarray) -> np.ndarray:
        return run if interval == 0 else np.floor(run / seg) * interval

    work, failures, t = 0.0, 0, 0.0
    while True:
        runs = rng.exponential(1.0 / rate, int(T * rate) + 16)
        starts = t + np.concatenate(([0.0], np.cumsum(runs + restart)[:-1]))
        k = int(np.searchsorted(starts + runs, T, side="right"))  # runs ended by a failure before T
        work += float(committed(runs[:k]).sum())
        failures += k
        if k < len(runs):
            if starts[k] < T:  # the run cut by the horizon: a graceful stop checkpoints what it did
                tail = T - starts[k]
                work += float(committed(np.array([tail]))[0]) + (0.0 if interval == 0 else min(tail % seg, interval))
            break
        t = starts[-1] + runs[-1] + restart
    return Result("dp", c.chips, 1, 1, float(work * pace / T), failures)


# --- elastic jobs and the syncer: an event simulation ----------------------------------------------------

@dataclass
class _Job:
    """An elastic synchronous job over some slices: the elastic-dp cluster, or one diloco learner."""
    slices: int
    cum: np.ndarray           # cum[i]: time of steps [0, i) before the job's straggling term
    straggle: float           # jitter_scale: a step over n slices takes straggle * ln n longer
    slice_step_chip_s: float  # productive chip-time of one slice-step (slice chips * nominal step)
    step: int = 0
    run_from: float | None = None  # start of the current run; None while paused, waiting or down
    target: int | None = None      # step at which the current run raises a milestone
    pause_end: float = 0.0
    waiting: bool = False          # for a merged value newer than `base`
    epoch: int = 0                 # bumped by each interruption, voiding the scheduled milestone
    fail_epoch: int = 0            # bumped whenever the failure rate changes, voiding the scheduled failure
    done: float = 0.0              # productive chip-seconds of all completed steps
    unsent: float = 0.0            # ... since the last contribution
    next_send: int = 0
    check_at: int | None = None    # step by which the outstanding contribution's merge is needed
    base: int = 0                  # version the last contribution started from
    adopted: int = 0               # version taken at the last need for a merge: the next contribution's base

    def duration(self, k: int) -> float:
        return float(self.cum[self.step + k] - self.cum[self.step]) + k * self.straggle * math.log(self.slices)

    def steps_within(self, elapsed: float, nominal_step: float) -> int:
        """Whole steps finished `elapsed` seconds into a run; the step in flight does not count."""
        limit = len(self.cum) - 1 - self.step
        if self.target is not None:
            limit = min(limit, self.target - self.step)
        k = min(limit, int(elapsed / (_MIN_STEP * nominal_step)) + 1)
        ends = (self.cum[self.step + 1:self.step + k + 1] - self.cum[self.step]
                + self.straggle * math.log(self.slices) * np.arange(1, k + 1))
        return int(np.searchsorted(ends, elapsed, side="right"))

    def complete(self, k: int) -> None:
        chip_s = k * self.slices * self.slice_step_chip_s
        self.step += k
        self.done += chip_s
        self.unsent += chip_s


@dataclass
class _Syncer:
    """One rolling round, as the real syncer keeps per fragment: late contributions join the next."""
    policy: QuorumPolicy
    step_time_s: float
    open: list[tuple[int, float, float, int]] = field(default_factory=list)  # learner, arrival, chip-s, base
    version: int = 0      # rounds closed
    published: int = 0    # latest version learners can read
    deadline: float | None = None
    batch_at: float | None = None
    merged: float = 0.0
    rounds: int = 0
    late: int = 0


class _EventSim:
    """Events on one heap: slice failures and returns, ends of reconfigurations, learner milestones
    (send a contribution, need a merge), grace deadlines and publications of merged values."""

    def __init__(self, c: Cluster, groups: list[int], rng: np.random.Generator, setup: Diloco | None):
        self.c, self.rng, self.setup = c, rng, setup
        self.T = c.horizon_s
        self.rate = c.slice_rate(len(groups))
        self.slice_step_chip_s = c.chips / c.slices(len(groups)) * c.step_s
        self.heap: list = []
        self.seq = itertools.count()  # ties break in push order, so runs are reproducible
        self.jobs = [self._job(n) for n in groups]
        self.syncer = _Syncer(setup.policy(), c.mean_step_s(groups[0])) if setup else None
        self.failures = 0

    def _job(self, n: int) -> _Job:
        c = self.c
        length = int(self.T / (_MIN_STEP * c.step_s)) + 2  # more steps than fit in the horizon
        steps = c.step_s + c.jitter_scale * (self.rng.gumbel(size=length) - _EULER_GAMMA)
        cum = np.concatenate(([0.0], np.cumsum(np.maximum(steps, _MIN_STEP * c.step_s))))
        return _Job(n, cum, c.jitter_scale, self.slice_step_chip_s,
                    next_send=self.setup.sync_every if self.setup else 0)

    def push(self, t: float, kind: str, j: int = 0, tag: int = 0) -> None:
        if t <= self.T:
            heapq.heappush(self.heap, (t, next(self.seq), kind, j, tag))

    def run(self) -> float:
        """Productive chip-seconds over the horizon."""
        for j in range(len(self.jobs)):
            self.schedule_failure(j, 0.0)
            self.try_run(j, 0.0)
        while self.heap:
            t, _, kind, j, tag = heapq.heappop(self.heap)
            getattr(self, "on_" + kind)(t, j, tag)
        for j in range(len(self.jobs)):
            self.interrupt(j, self.T)
        if self.syncer is None:
            return sum(job.done for job in self.jobs)
        for j, job in enumerate(self.jobs):  # graceful stop: learners send, the syncer flushes
            if job.unsent:
                self.arrive(self.T, j)
        self.evaluate(self.T, final=True)
        return self.syncer.merged

    # --- slices fail and come back ---
    def schedule_failure(self, j: int, t: float) -> None:
        job = self.jobs[j]
        job.fail_epoch += 1
        if job.slices and self.rate:
            self.push(t + self.rng.exponential(1.0 / (job.slices * self.rate)), "fail", j, job.fail_epoch)

    def interrupt(self, j: int, t: float) -> None:
        """Bank the steps finished by t; the step in flight is lost with its slice or the old mesh."""
        job = self.jobs[j]
        if job.run_from is not None:
            job.complete(job.steps_within(t - job.run_from, self.c.step_s))
            job.run_from = None
            job.epoch += 1

    def pause(self, j: int, t: float) -> None:
        job = self.jobs[j]
        if t >= job.pause_end:  # an event during a reconfiguration is folded into it
            job.pause_end = t + self.c.reconfig_s
            self.push(job.pause_end, "resume", j)

    def on_fail(self, t: float, j: int, tag: int) -> None:
        job = self.jobs[j]
        if tag != job.fail_epoch:
            return
        self.failures += 1
        self.interrupt(j, t)
        if self.setup and self.setup.spares:
            self.replace(j, t)
            return
        job.slices -= 1
        self.push(t + self.c.recovery_s, "return", j)
        self.pause(j, t)
        self.schedule_failure(j, t)
        if job.slices == 0 and self.syncer:  # one learner fewer that the round can expect
            self.evaluate(t)

    def replace(self, j: int, t: float) -> None:
        """A warm spare becomes learner j after spare_s, from the latest merged version: the steps
        since its last contribution are lost, and it sends its next one sync_every steps on."""
        job = self.jobs[j]
        job.unsent = 0.0
        job.waiting, job.check_at = False, None
        job.adopted = self.syncer.published
        job.next_send = job.step + self.setup.sync_every
        job.pause_end = max(job.pause_end, t + self.setup.spare_s)
        self.push(job.pause_end, "resume", j)
        self.schedule_failure(j, t)

    def on_return(self, t: float, j: int, tag: int) -> None:
        job = self.jobs[j]
        self.interrupt(j, t)
        job.slices += 1
        self.pause(j, t)
        self.schedule_failure(j, t)
        if job.slices == 1 and self.syncer:
            self.evaluate(t)

    def on_resume(self, t: float, j: int, tag: int) -> None:
        self.try_run(j, t)

    # --- learners run, send and wait ---
    def try_run(self, j: int, t: float) -> None:
        job = self.jobs[j]
        if job.run_from is not None or job.waiting or job.slices == 0 or t < job.pause_end:
            return
        job.run_from = t
        if self.syncer is not None:  # elastic-dp has no milestones: it runs until an event interrupts it
            job.target = job.next_send if job.check_at is None else min(job.next_send, job.check_at)
        if job.target is not None and job.target < len(job.cum):
            self.push(t + job.duration(job.target - job.step), "milestone", j, job.epoch)

    def on_milestone(self, t: float, j: int, tag: int) -> None:
        job = self.jobs[j]
        if tag != job.epoch:
            return
        job.complete(job.target - job.step)
        job.run_from = None
        job.epoch += 1
        if job.step == job.next_send:
            self.arrive(t, j)
            job.next_send += self.setup.sync_every
            job.check_at = job.step + self.setup.overlap_steps
        if job.step == job.check_at:
            job.check_at = None
            if self.syncer.published > job.base:  # a newer version (its round, or a later one) is here
                job.adopted = self.syncer.published
            else:
                job.waiting = True
        self.try_run(j, t)

    def on_publish(self, t: float, j: int, version: int) -> None:
        self.syncer.published = max(self.syncer.published, version)
        for i, job in enumerate(self.jobs):
            if job.waiting and job.base < self.syncer.published:
                job.waiting = False
                job.adopted = self.syncer.published
                self.try_run(i, t)

    # --- the syncer ---
    def arrive(self, t: float, j: int) -> None:
        job, s = self.jobs[j], self.syncer
        chip_s, job.unsent = job.unsent, 0.0
        job.base = job.adopted
        if job.base < s.version - self.setup.max_staleness:
            return  # rejected as stale, as the real syncer does: these tokens never enter a merge
        s.open.append((j, t, chip_s, job.base))
        if s.batch_at != t:  # judge after everything that arrives at this instant, like a polled batch
            s.batch_at = t
            self.push(t, "deadline")

    def evaluate(self, t: float, final: bool = False) -> None:
        s = self.syncer
        if not s.open:
            return
        first: dict[int, float] = {}
        for j, at, _, _ in s.open:  # in arrival order, so setdefault keeps each learner's first
            first.setdefault(j, at)
        live = sum(1 for job in self.jobs if job.slices)
        d = decide(s.policy, list(first.values()), now=t, expected=live, step_time_s=s.step_time_s,
                   sync_time_s=self.setup.sync_s)
        if d.close or final:
            s.late += sum(1 for *_, base in s.open if base < s.version)
            s.merged += sum(chip_s for _, _, chip_s, _ in s.open)
            s.version += 1
            s.rounds += 1
            s.open, s.deadline = [], None
            self.push(t + self.setup.sync_s, "publish", tag=s.version)
        elif d.deadline is not None and d.deadline != s.deadline:
            s.deadline = d.deadline
            self.push(d.deadline, "deadline")

    def on_deadline(self, t: float, j: int, tag: int) -> None:  # also the end of a batch of arrivals
        self.evaluate(t)


# --- entry point ---------------------------------------------------------------------------------------

def simulate(scheme: str, cluster: Cluster, setup: Diloco = Diloco(), seed: int = 0) -> Result:
    """One scheme on one cluster. The stream depends on (seed, scheme, chips) only, so a sweep gives
    the same numbers whatever order or process its cases run in."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    rng = np.random.default_rng([seed, SCHEMES.index(scheme), cluster.chips])
    if scheme == "dp":
        return simulate_dp(cluster, rng)
    total = cluster.chips * cluster.horizon_s
    if scheme == "elastic-dp":
        sim = _EventSim(cluster, [cluster.slices()], rng, None)
        return Result(scheme, cluster.chips, 1, 1, sim.run() / total, sim.failures)
    n, m = cluster.slices(setup.learners), setup.learners
    sim = _EventSim(cluster, [n // m + (i < n % m) for i in range(m)], rng, setup)
    productive = sim.run()
    return Result(scheme, cluster.chips, m, setup.k, productive / total, sim.failures, sim.syncer.rounds,
                  sim.syncer.late)
