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
  Contributions go to a simulated syncer whose rounds close by `diloco.syncer.rounds.due`, the
  code the real syncer runs, on its own record of each arrival: with quorum_of_fresh only those
  trained from the current version count towards K. A learner needs the merged value
  `overlap_steps` after sending and waits for it only if it has not come: with K = M and no grace
  this is synchronous DiLoCo. Without that wait (the runner's default, fragments.wait_for_merge =
  False) it applies each version as it is published and never idles, and a delta due before the
  version it last sent from has moved is held (fragments.one_delta_per_version) until one has, or
  HOLD_PERIODS periods.
  With spares (the local runner's `run.spares`), a failure kills the whole learner instead and a warm
  spare learner with its own slices takes its place after `spare_s`: no second pause when the slice
  comes back, but the steps since its last contribution are lost (the spare joins from the latest
  merged version). The spares' idle hardware is not charged.

Goodput is productive chip-time over total chip-time. A chip-step is worth its nominal `step_s`, so
straggling (a synchronous step waits for its slowest slice) costs goodput too; for diloco only steps
whose tokens entered a merge count. Every run stops gracefully at the horizon: dp checkpoints, the
learners send what they have and the syncer flushes its open round, as the real syncer does on stop.
Runs can also stop at a work target instead of a horizon, with learners that join late and leave
early and learners of different speeds: diloco/sim/scenarios.py builds the scavenging and the
mixed-hardware scenarios from them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from diloco.fragments import HOLD_PERIODS, must_hold
from diloco.sim.checkpointing import best_checkpoint_interval
from diloco.syncer import rounds
from diloco.syncer.policy import QuorumPolicy

SCHEMES = ("dp", "elastic-dp", "diloco")
YEAR_S = 365.25 * 24 * 3600
_EULER_GAMMA = 0.5772156649015329  # mean of the standard Gumbel distribution
_MIN_STEP = 0.5                    # a step never takes under half its nominal time (bounds the arrays)
_STEPS_CHUNK = 20_000              # work-target runs draw step times in chunks of this many, as they need them


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
    # a learner kill's outage until the spare's first heartbeat: the mean measured with run.spares = 2
    # on the local runner (docs/operations.md, "Learner failures")
    spare_s: float = 2.1
    quorum_of_fresh: bool = True  # only contributions trained from the current version count towards K
    wait_for_merge: bool = True   # the paper's learners: idle if no newer version overlap_steps after sending
    hold_deltas: bool = True      # fragments.one_delta_per_version: at most one delta per version

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
    contributions: int = 0     # diloco: merged contributions
    merged_share: float = 1.0  # diloco: share of the trained tokens that entered a merge
    seconds: float = 0.0       # wall-clock simulated: the horizon, or the time to reach a work target

    def row(self) -> dict:
        return {"scheme": self.scheme, "chips": self.chips, "learners": self.learners, "quorum": self.quorum,
                "goodput": self.goodput}


# --- dp: simulation (the closed form: diloco/sim/checkpointing.py) ----------------------------------------------------------------------

def simulate_dp(c: Cluster, rng: np.random.Generator) -> Result:
    """Alternating runs (exponential, at the whole cluster's failure rate) and restarts, vectorised."""
    rate = c.chips / (c.mtbi_years * YEAR_S)
    restart = c.recovery_s + c.reconfig_s
    interval = best_checkpoint_interval(rate, restart, c.checkpoint_s)
    pace = c.step_s / c.mean_step_s(c.slices())
    T = c.horizon_s
    if rate == 0:
        return Result("dp", c.chips, 1, 1, pace, 0, seconds=T)
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
    return Result("dp", c.chips, 1, 1, float(work * pace / T), failures, seconds=T)


# --- elastic jobs and the syncer: an event simulation ----------------------------------------------------

@dataclass
class _Job:
    """An elastic synchronous job over some slices: the elastic-dp cluster, or one diloco learner."""
    slices: int
    cum: np.ndarray           # cum[i]: time of steps [0, i) before the job's straggling term
    straggle: float           # jitter_scale: a step over n slices takes straggle * ln n longer
    slice_step_chip_s: float  # productive chip-time of one slice-step (slice chips * nominal step)
    nominal_step_s: float     # this job's chips' nominal step (slower chips, longer step)
    step: int = 0
    run_from: float | None = None  # start of the current run; None while paused, waiting or down
    target: int | None = None      # step at which the current run raises a milestone
    pause_end: float = 0.0
    waiting: bool = False          # for a merged value newer than `base`
    epoch: int = 0                 # bumped by each interruption, voiding the scheduled milestone
    fail_epoch: int = 0            # bumped whenever the failure rate changes, voiding the scheduled failure
    done: float = 0.0              # productive chip-seconds of all completed steps
    unsent: float = 0.0            # ... since the last contribution
    trained: float = 0.0           # tokens, as slice-steps, of all completed steps
    unsent_tokens: float = 0.0     # ... since the last contribution
    next_send: int = 0
    check_at: int | None = None    # step by which the outstanding contribution's merge is needed
    base: int = 0                  # version the last contribution started from
    adopted: int = 0               # version the parameters are on: the next contribution's base
    sent_from: int = -1            # hold_deltas: the version of the last send of this incarnation (-1: none)
    last_sent_step: int = 0
    held: bool = False             # a due delta waits for a new version
    left: bool = False             # reclaimed: no longer in the run

    def duration(self, k: int) -> float:
        return float(self.cum[self.step + k] - self.cum[self.step]) + k * self.straggle * math.log(self.slices)

    def steps_within(self, elapsed: float) -> int:
        """Whole steps finished `elapsed` seconds into a run; the step in flight does not count."""
        limit = len(self.cum) - 1 - self.step
        if self.target is not None:
            limit = min(limit, self.target - self.step)
        k = min(limit, int(elapsed / (_MIN_STEP * self.nominal_step_s)) + 1)
        ends = (self.cum[self.step + 1:self.step + k + 1] - self.cum[self.step]
                + self.straggle * math.log(self.slices) * np.arange(1, k + 1))
        return int(np.searchsorted(ends, elapsed, side="right"))

    def complete(self, k: int) -> None:
        chip_s = k * self.slices * self.slice_step_chip_s
        self.step += k
        self.done += chip_s
        self.unsent += chip_s
        self.trained += k * self.slices
        self.unsent_tokens += k * self.slices


@dataclass(frozen=True)
class Churn:
    """Learners that join late and leave once the syncer has merged some work (the scavenging scenario)."""
    joiners: tuple[int, ...] = ()   # learners that start join_s late, from the latest merged version
    join_s: float = 0.0
    leavers: tuple[int, ...] = ()   # learners reclaimed once `leave_at` productive chip-seconds are merged
    leave_at: float = math.inf
    graceful: bool = False          # a leaver sends its unsent work first; otherwise that work is lost


class Arrival(NamedTuple):
    """A contribution in the simulated syncer's open round: what `rounds.due` reads (learner, base
    version, arrival time) and what a merge counts (productive chip-seconds, tokens)."""
    learner: int
    arrival: float
    chip_s: float
    tokens: float
    base_version: int


@dataclass
class _Syncer:
    """One rolling round, as the real syncer keeps per fragment: late contributions join the next."""
    policy: QuorumPolicy
    step_time_s: float
    open: list[Arrival] = field(default_factory=list)  # the open round's contributions
    version: int = 0      # rounds closed
    published: int = 0    # latest version learners can read
    deadline: float | None = None
    batch_at: float | None = None
    merged: float = 0.0
    merged_tokens: float = 0.0
    rounds: int = 0
    late: int = 0
    contributions: int = 0


class _EventSim:
    """Events on one heap: slice failures and returns, ends of reconfigurations, learner milestones
    (send a contribution, need a merge), grace deadlines and publications of merged values.

    By default the run lasts the cluster's horizon and all jobs draw from `rng`. With `until_work` it
    stops once the syncer has merged that many productive chip-seconds (`done_at`), and each job draws
    its step times and failures from its own stream spawned from `rng`: a learner's hardware then
    fails at the same times whoever else is in the run, so two scenarios differ by the scenario alone."""

    def __init__(self, c: Cluster, groups: list[int], rng: np.random.Generator, setup: Diloco | None, *,
                 speeds: list[float] | None = None, churn: Churn | None = None, until_work: float | None = None):
        self.c, self.rng, self.setup = c, rng, setup
        self.churn, self.until_work = churn or Churn(), until_work
        self.T = c.horizon_s if until_work is None else math.inf
        base = setup.learners if setup else len(groups)  # the slices are cut for the base learners; extra
        self.rate = c.slice_rate(base)                     # learners (scavenging) bring slices of that size
        self.slice_chips = c.chips / c.slices(base)
        self.speeds = speeds or [1.0] * len(groups)
        self.rngs = [rng] * len(groups) if until_work is None else rng.spawn(len(groups))
        self.heap: list = []
        self.seq = itertools.count()  # ties break in push order, so runs are reproducible
        self.jobs = [self._job(j, n) for j, n in enumerate(groups)]
        # the real syncer reads the median step time the live learners report
        step_time = c.mean_step_s(groups[0]) * float(np.median(self.speeds))
        self.syncer = _Syncer(setup.policy(), step_time) if setup else None
        self.failures = 0
        self.done_at: float | None = None

    def _job(self, j: int, n: int) -> _Job:
        c, speed = self.c, self.speeds[j]
        nominal = c.step_s * speed
        length = int(self.T / (_MIN_STEP * nominal)) + 2 if self.until_work is None else _STEPS_CHUNK
        job = _Job(n, np.zeros(1), c.jitter_scale * speed, self.slice_chips * nominal, nominal,
                   next_send=self.setup.sync_every if self.setup else 0)
        self._draw_steps(j, job, length)
        return job

    def _draw_steps(self, j: int, job: _Job, count: int) -> None:
        """Append `count` step times: nominal plus Gumbel jitter, floored at half the nominal."""
        steps = job.nominal_step_s + job.straggle * (self.rngs[j].gumbel(size=count) - _EULER_GAMMA)
        job.cum = np.concatenate((job.cum, job.cum[-1] + np.cumsum(np.maximum(steps, _MIN_STEP * job.nominal_step_s))))

    def push(self, t: float, kind: str, j: int = 0, tag: int = 0) -> None:
        if t <= self.T:
            heapq.heappush(self.heap, (t, next(self.seq), kind, j, tag))

    def run(self) -> float:
        """Productive chip-seconds merged (diloco) or done (elastic-dp), by the horizon or by `done_at`."""
        if self.churn.leave_at <= 0:
            self.leave(0.0)
        for j in self.churn.joiners:
            self.jobs[j].pause_end = self.churn.join_s
            self.push(self.churn.join_s, "resume", j)
        for j in range(len(self.jobs)):
            self.schedule_failure(j, 0.0)
            self.try_run(j, 0.0)
        while self.heap:
            t, _, kind, j, tag = heapq.heappop(self.heap)
            getattr(self, "on_" + kind)(t, j, tag)
            if self.done_at is not None:
                return self.syncer.merged
        if self.until_work is not None:  # the target was never met (the heap empties only if nothing runs)
            self.done_at = math.inf
            return self.syncer.merged
        for j in range(len(self.jobs)):
            self.interrupt(j, self.T)
        if self.syncer is None:
            return sum(job.done for job in self.jobs)
        for j, job in enumerate(self.jobs):  # graceful stop: learners send, the syncer flushes
            if job.unsent and not job.left:
                self.arrive(self.T, j)
        self.evaluate(self.T, final=True)
        return self.syncer.merged

    # --- slices fail and come back ---
    def schedule_failure(self, j: int, t: float) -> None:
        job = self.jobs[j]
        job.fail_epoch += 1
        if job.slices and self.rate and not job.left:
            self.push(t + self.rngs[j].exponential(1.0 / (job.slices * self.rate)), "fail", j, job.fail_epoch)

    def interrupt(self, j: int, t: float) -> None:
        """Bank the steps finished by t; the step in flight is lost with its slice or the old mesh."""
        job = self.jobs[j]
        if job.run_from is not None:
            job.complete(job.steps_within(t - job.run_from))
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
        job.unsent = job.unsent_tokens = 0.0
        job.waiting, job.check_at, job.held, job.sent_from = False, None, False, -1
        job.adopted = self.syncer.published
        job.next_send = job.step + self.setup.sync_every
        job.pause_end = max(job.pause_end, t + self.setup.spare_s)
        self.push(job.pause_end, "resume", j)
        self.schedule_failure(j, t)

    def on_return(self, t: float, j: int, tag: int) -> None:
        job = self.jobs[j]
        if job.left:  # the slice comes back to a learner already reclaimed
            return
        self.interrupt(j, t)
        job.slices += 1
        self.pause(j, t)
        self.schedule_failure(j, t)
        if job.slices == 1 and self.syncer:
            self.evaluate(t)

    def on_resume(self, t: float, j: int, tag: int) -> None:
        self.try_run(j, t)

    # --- learners join and leave ---
    def leave(self, t: float) -> None:
        """The leavers are reclaimed at t: what they finished is sent if the leave is graceful, and
        lost otherwise; the step in flight is lost either way."""
        for j in self.churn.leavers:
            job = self.jobs[j]
            self.interrupt(j, t)
            if self.churn.graceful and job.unsent:
                self.arrive(t, j)
            job.left, job.waiting, job.held = True, False, False
            job.fail_epoch += 1  # no more failures of hardware no longer ours
        if self.syncer and t > 0:  # fewer learners to expect: the open round may be complete now
            self.push(t, "deadline")

    # --- learners run, send and wait ---
    def try_run(self, j: int, t: float, start: float | None = None) -> None:
        """Run job j from t, or from `start` when a step begun then goes on."""
        job = self.jobs[j]
        if job.run_from is not None or job.waiting or job.slices == 0 or t < job.pause_end or job.left:
            return
        if job.held and not self.must_hold(job):  # a new version came while it could not send
            self.send(j, t)
        job.run_from = t if start is None else start
        if self.syncer is not None:  # elastic-dp has no milestones: it runs until an event interrupts it
            targets = [job.next_send]
            if job.check_at is not None:
                targets.append(job.check_at)
            if job.held:
                targets.append(job.last_sent_step + HOLD_PERIODS * self.setup.sync_every)
            job.target = min(targets)
            if self.until_work is not None and job.target >= len(job.cum):
                self._draw_steps(j, job, max(_STEPS_CHUNK, job.target - len(job.cum) + 1))
        if job.target is not None and job.target < len(job.cum):
            self.push(job.run_from + job.duration(job.target - job.step), "milestone", j, job.epoch)

    def on_milestone(self, t: float, j: int, tag: int) -> None:
        job = self.jobs[j]
        if tag != job.epoch:
            return
        job.complete(job.target - job.step)
        job.run_from = None
        job.epoch += 1
        forced = job.held and job.step >= job.last_sent_step + HOLD_PERIODS * self.setup.sync_every
        if job.step == job.next_send or forced:
            if job.step == job.next_send:
                job.next_send += self.setup.sync_every
            if self.must_hold(job):
                job.held = True
            else:
                self.send(j, t)
        if job.step == job.check_at:
            job.check_at = None
            if self.syncer.published > job.base:  # a newer version (its round, or a later one) is here
                job.adopted = self.syncer.published
            else:
                job.waiting = True
        self.try_run(j, t)

    def must_hold(self, job: _Job) -> bool:
        """The learner's rule (diloco.fragments.must_hold): it already sent from the version it is on,
        and has held for under HOLD_PERIODS periods. A learner that waited for a newer version never holds."""
        return self.setup.hold_deltas and must_hold(sent_from=job.sent_from, version=job.adopted,
                                                    steps_since_send=job.step - job.last_sent_step,
                                                    every=self.setup.sync_every)

    def send(self, j: int, t: float) -> None:
        job = self.jobs[j]
        job.held = False
        job.sent_from, job.last_sent_step = job.adopted, job.step
        self.arrive(t, j)
        if self.setup.wait_for_merge:
            job.check_at = job.step + self.setup.overlap_steps

    def on_publish(self, t: float, j: int, version: int) -> None:
        self.syncer.published = max(self.syncer.published, version)
        for i, job in enumerate(self.jobs):
            if job.left:
                continue
            if not self.setup.wait_for_merge:  # every version is applied as it comes
                job.adopted = self.syncer.published
                if job.held and job.run_from is not None:  # send at the step boundary; the step in flight goes on
                    k = job.steps_within(t - job.run_from)
                    started = job.run_from + job.duration(k)
                    job.complete(k)
                    job.run_from = None
                    job.epoch += 1
                    self.send(i, t)
                    self.try_run(i, t, start=started)
            elif job.waiting and job.base < self.syncer.published:
                job.waiting = False
                job.adopted = self.syncer.published
                self.try_run(i, t)

    # --- the syncer ---
    def arrive(self, t: float, j: int) -> None:
        job, s = self.jobs[j], self.syncer
        chip_s, tokens, job.unsent, job.unsent_tokens = job.unsent, job.unsent_tokens, 0.0, 0.0
        job.base = job.adopted
        if job.base < s.version - self.setup.max_staleness:
            return  # rejected as stale, as the real syncer does: these tokens never enter a merge
        s.open.append(Arrival(j, t, chip_s, tokens, job.base))
        if s.batch_at != t:  # judge after everything that arrives at this instant, like a polled batch
            s.batch_at = t
            self.push(t, "deadline")

    def evaluate(self, t: float, final: bool = False) -> None:
        """Close the open round if syncer/rounds.py `due` says so (or this is the final flush), else
        wake up at the grace deadline it gives."""
        s = self.syncer
        live = {i for i, job in enumerate(self.jobs) if job.slices and not job.left}
        present = {i for i, job in enumerate(self.jobs) if not job.left}
        d = rounds.due(s.policy, s.version, s.open, live=live, present=present, now=t, step_time_s=s.step_time_s,
                       sync_time_s=self.setup.sync_s, quorum_of_fresh=self.setup.quorum_of_fresh)
        if d is None:
            return
        if d.close or final:
            s.late += sum(1 for a in s.open if a.base_version < s.version)
            s.contributions += len(s.open)
            s.merged += sum(a.chip_s for a in s.open)
            s.merged_tokens += sum(a.tokens for a in s.open)
            s.version += 1
            s.rounds += 1
            s.open, s.deadline = [], None
            self.push(t + self.setup.sync_s, "publish", tag=s.version)
            if self.until_work is not None and s.merged >= self.until_work and not final:
                self.done_at = t
            if s.merged >= self.churn.leave_at and not any(self.jobs[i].left for i in self.churn.leavers):
                self.leave(t)
        elif d.deadline is not None and d.deadline != s.deadline:
            s.deadline = d.deadline
            self.push(d.deadline, "deadline")

    def on_deadline(self, t: float, j: int, tag: int) -> None:  # also the end of a batch of arrivals
        self.evaluate(t)


# --- entry points --------------------------------------------------------------------------------------

def learner_slices(c: Cluster, learners: int) -> list[int]:
    """The cluster's slices dealt out to `learners` learners as evenly as whole slices allow."""
    n = c.slices(learners)
    return [n // learners + (i < n % learners) for i in range(learners)]


def simulate_diloco(c: Cluster, setup: Diloco, rng: np.random.Generator, *, groups: list[int] | None = None,
                    speeds: list[float] | None = None, churn: Churn | None = None,
                    until_work: float | None = None) -> Result:
    """diloco on `groups` (slices per learner; default the cluster dealt out to setup.learners), each
    learner's step `speeds` times the nominal, with `churn`; to the horizon, or to `until_work` merged
    productive chip-seconds (then `seconds` is the time it took, math.inf if never). Goodput is over the
    chips of `groups` for the time simulated."""
    given, groups = groups, groups or learner_slices(c, setup.learners)
    sim = _EventSim(c, groups, rng, setup, speeds=speeds, churn=churn, until_work=until_work)
    productive = sim.run()
    seconds = c.horizon_s if until_work is None else sim.done_at
    chips = c.chips if given is None else round(sum(groups) * sim.slice_chips)
    chip_s = chips * seconds
    trained = sum(job.trained for job in sim.jobs)
    return Result("diloco", chips, len(groups), setup.k,
                  productive / chip_s if 0 < chip_s < math.inf else 0.0, sim.failures, sim.syncer.rounds,
                  sim.syncer.late, sim.syncer.contributions, sim.syncer.merged_tokens / trained if trained else 1.0,
                  seconds)


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
        return Result(scheme, cluster.chips, 1, 1, sim.run() / total, sim.failures, seconds=cluster.horizon_s)
    return simulate_diloco(cluster, setup, rng)
