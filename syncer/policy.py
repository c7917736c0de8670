"""When does a fragment round close? Minimum quorum plus an adaptive grace window.

Pure functions of arrival times and measured timings, so the syncer and the goodput simulator run
the same policy. Times are seconds on any one clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QuorumPolicy:
    quorum: int              # K: a round may close once K learners contributed
    overlap_steps: int       # tau: inner steps a learner runs while its sync is in flight
    grace_gamma: float       # fraction of the overlap slack spent waiting for stragglers
    grace_max_s: float       # hard cap on the grace window


@dataclass(frozen=True)
class Decision:
    close: bool
    reason: str                  # "waiting_for_quorum" | "grace" | "grace_expired" | "all_arrived"
    deadline: float | None = None  # when the round will close if nothing else arrives


def grace_window(policy: QuorumPolicy, *, step_time_s: float, time_to_quorum_s: float, sync_time_s: float) -> float:
    """grace = clamp(gamma * (tau * step_time - time_to_quorum - sync_time), 0, max).

    The overlap leaves tau * step_time of slack before a learner would wait for the merged value;
    what quorum and the merge itself already used of it is not available to stragglers.
    """
    slack = policy.overlap_steps * step_time_s - time_to_quorum_s - sync_time_s
    return min(max(policy.grace_gamma * slack, 0.0), policy.grace_max_s)


def decide(policy: QuorumPolicy, arrivals: Sequence[float], *, now: float, expected: int,
           step_time_s: float, sync_time_s: float, members: int | None = None) -> Decision:
    """Decide whether the round with these (one per learner) arrival times closes at `now`.

    `expected` is how many learners could contribute (the live ones); when all of them are in,
    waiting longer gains nothing. `members` is how many are still in the run at all (not left or
    dropped): the quorum is K, or all of them when fewer than K remain, so a round never waits for
    learners that left. A silent learner may come back: K still waits for it.
    """
    if not arrivals:
        return Decision(False, "waiting_for_quorum")
    times = sorted(arrivals)
    quorum = policy.quorum if members is None else max(1, min(policy.quorum, members))
    if len(times) < quorum:
        return Decision(False, "waiting_for_quorum")
    if len(times) >= expected:
        return Decision(True, "all_arrived")
    quorum_at = times[quorum - 1]
    grace = grace_window(policy, step_time_s=step_time_s, time_to_quorum_s=quorum_at - times[0],
                         sync_time_s=sync_time_s)
    deadline = quorum_at + grace
    if now >= deadline:
        return Decision(True, "grace_expired", deadline)
    return Decision(False, "grace", deadline)
