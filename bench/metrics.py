"""Pure figures computed from curves, clocks and event records."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np


def time_to_target(times: Sequence[float], losses: Sequence[float], target: float) -> float:
    """First time the loss curve reaches `target`, linearly interpolated between eval points; inf if never."""
    for i, (t, loss) in enumerate(zip(times, losses)):
        if loss <= target:
            if i == 0:
                return float(t)
            t0, l0 = times[i - 1], losses[i - 1]
            return float(t0 + (t - t0) * (l0 - target) / (l0 - loss))
    return math.inf


def gap_percent(loss: float, reference: float) -> float:
    return 100.0 * (loss - reference) / reference


def percentiles(values: Iterable[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    v = np.asarray(list(values), np.float64)
    return {f"p{q}": float(np.percentile(v, q)) if len(v) else math.nan for q in qs}


def dp_clock(steps: int, step_s, comm_s, stalls: Mapping[int, float]) -> np.ndarray:
    """Wall-clock after each data-parallel step: every step waits for the slowest worker (step_s)
    and the all-reduce (comm_s), each one figure or one per step (the worker count may change at a
    step); a failure before step s stalls everyone for stalls[s] seconds."""
    per_step = np.broadcast_to(np.asarray(step_s, np.float64) + np.asarray(comm_s, np.float64), (steps,)).copy()
    for s, seconds in stalls.items():
        per_step[min(max(s, 0), steps - 1)] += seconds
    return np.cumsum(per_step)


def dp_comm_s(allreduce_bytes_per_worker: float, bandwidth_mbps: float | None, latency_ms: float,
              sharers: int) -> float:
    """One all-reduce on the WAN: each worker's bytes over its share of the region's link, plus latency."""
    transfer = 0.0 if bandwidth_mbps is None else allreduce_bytes_per_worker * 8 * sharers / (bandwidth_mbps * 1e6)
    return latency_ms / 1000 + transfer


def merge_stats(events: Sequence[Mapping]) -> dict:
    """Syncer throughput and latency from a run's events: MB of accepted contributions merged per
    second of merge work, merge durations, the wait from acceptance to the merge that applied it,
    and the rounds' mean size and share of late contributions."""
    accepted = {e["id"]: e for e in events if e["kind"] == "contribution_accepted"}
    merges = [e for e in events if e["kind"] == "merge"]
    merged_bytes = sum(accepted[i]["bytes"] for m in merges for i in m["ids"] if i in accepted)
    seconds = [float(m["seconds"]) for m in merges]
    waits = [m["time"] - accepted[i]["time"] for m in merges for i in m["ids"] if i in accepted]
    busy = sum(seconds)
    merged = sum(len(m["ids"]) for m in merges)
    return {"merges": len(merges), "merged_mb": merged_bytes / 1e6,
            # how full and how fresh the rounds were: contributions per merge, and the share merged
            # onto a newer version than their base (late)
            "round_size": merged / len(merges) if merges else math.nan,
            "late_share": sum(m.get("late", 0) for m in merges) / merged if merged else math.nan,
            "merge_mb_per_s": merged_bytes / 1e6 / busy if busy else math.nan,
            "merge_s": percentiles(seconds), "accept_to_merge_s": percentiles(waits)}


def dedupe(events: Iterable[Mapping]) -> list[dict]:
    """Events in order with repeats (same eid, at-least-once delivery) dropped."""
    seen, out = set(), []
    for e in events:
        if e.get("eid") not in seen:
            seen.add(e.get("eid"))
            out.append(dict(e))
    return out


def learner_time(events: Sequence[Mapping], learners: Sequence[str]) -> dict:
    """Origin of the run's clock (first learner step) and, per learner, compute and wall seconds and
    the mean step time over the whole run (the heartbeats' own step_time is a recent average, which
    moves as other processes on the machine start and finish).

    compute_s restarts with each incarnation, so the last beat of every incarnation is summed."""
    beats = [e for e in events if e["kind"] == "heartbeat" and e.get("learner") in learners]
    if not beats:
        return {"origin": math.nan, "compute_s": {}, "wall_s": {}, "step_s": {}}
    origin = min(e["time"] - e.get("compute_s", 0.0) for e in beats)
    last: dict[tuple[str, str], dict] = {}
    for e in beats:
        last[(e["learner"], e.get("incarnation"))] = e
    compute: dict[str, float] = {}
    end: dict[str, float] = {}
    for (lid, _), e in last.items():
        compute[lid] = compute.get(lid, 0.0) + e.get("compute_s", 0.0)
        end[lid] = max(end.get(lid, origin), e["time"])
    steps = {lid: max(e.get("step", 0) for e in beats if e["learner"] == lid) for lid in compute}
    return {"origin": origin, "compute_s": compute, "wall_s": {lid: end[lid] - origin for lid in end},
            "step_s": {lid: compute[lid] / steps[lid] for lid in compute if steps[lid]}}


def tokens_at(events: Sequence[Mapping], t: float) -> int:
    """Tokens all learners had processed by time t: the latest heartbeat at or before t of each
    incarnation (a restarted learner counts from zero again), summed."""
    latest: dict[tuple[str, str], int] = {}
    for e in events:
        if e["kind"] == "heartbeat" and e["time"] <= t:
            key = (e["learner"], e.get("incarnation", ""))
            latest[key] = max(latest.get(key, 0), int(e.get("tokens", 0)))
    return sum(latest.values())


def time_at_tokens(events: Sequence[Mapping], tokens: float) -> float:
    """First heartbeat time at which all learners together had processed `tokens` (every incarnation's
    latest beat, summed); inf if never."""
    latest: dict[tuple[str, str], int] = {}
    for e in sorted((e for e in events if e["kind"] == "heartbeat"), key=lambda e: e["time"]):
        key = (e["learner"], e.get("incarnation", ""))
        latest[key] = max(latest.get(key, 0), int(e.get("tokens", 0)))
        if sum(latest.values()) >= tokens:
            return float(e["time"])
    return math.inf


def step_s_between(events: Sequence[Mapping], t0: float, t1: float) -> dict[str, float]:
    """Per learner, its compute seconds per step between its heartbeats in [t0, t1] (each incarnation's
    first and last beat there; compute_s restarts with an incarnation)."""
    spans: dict[tuple[str, str], list[dict]] = {}
    for e in events:
        if e["kind"] == "heartbeat" and t0 <= e["time"] <= t1:
            spans.setdefault((e["learner"], e.get("incarnation")), []).append(e)
    compute: dict[str, float] = {}
    steps: dict[str, int] = {}
    for (lid, _), beats in spans.items():
        first, last = min(beats, key=lambda e: e["time"]), max(beats, key=lambda e: e["time"])
        compute[lid] = compute.get(lid, 0.0) + last.get("compute_s", 0.0) - first.get("compute_s", 0.0)
        steps[lid] = steps.get(lid, 0) + last.get("step", 0) - first.get("step", 0)
    return {lid: compute[lid] / steps[lid] for lid in compute if steps[lid] > 0}
