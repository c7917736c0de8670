"""The coverage ledger: which of the tokens each learner trained reached the global model, once or more.

A contribution of fragment p says which steps of its learner's data stream it trained on (its
manifest's `cursor`, [first, end)); the merge records say which contributions reached the global
model. Every step trains every fragment once, so a learner's tokens count into the model per
fragment, and the figures below are averages over the fragments (as tokens are in `run.token_budget`):

- merged: tokens of the learner's merged contributions / fragments;
- twice: tokens of steps that more than one merged contribution of the same fragment covers (a
  restart that re-read windows it had handed in), the copies past the first, / fragments;
- missed: tokens of the steps of the learner's schedule that no merged contribution of a fragment
  covers (a kill before the fragment's next send, a rejected contribution, steps an `overwrite`
  apply threw away, steps a restart skipped), at the learner's mean tokens per step, / fragments:
  the part of its data stream the model never learned from. The schedule is the runner's own
  (from the step a joiner entered at to the schedule's end), never what an event claims; without
  one, the steps from 0 to the furthest merged cursor. Exact, from the merge records alone;
- handed_in: tokens of the contributions it published / fragments;
- lost: trained - merged (trained as the heartbeats say: the steps a killed learner took after its
  last beat are in no event, so this is a lower bound by at most a beat per kill), split into not handed in (killed before the fragment's next send, or
  left at the end unsent) and handed in but not merged (rejected, dropped by a round, or still
  pending when the run ended);
- epoch: how far through its shard the furthest merged cursor reached (1.5 = all of it once and
  half again), when the shard's size is known.

Pure functions of plain records: the run summary and `diloco report` compute it the same way.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable

from diloco.messages import is_count


def extra_coverage(intervals: list[tuple[int, int, float]]) -> float:
    """Tokens counted more than once by intervals (first, end, tokens per step): on each stretch of
    steps, every covering interval past the densest one counts as extra. A sweep over the interval
    ends: a run's thousands of contributions per fragment cost n log n, not n squared."""
    events = sorted([(a, 1, d) for a, b, d in intervals] + [(b, -1, d) for a, b, d in intervals])
    active: list[float] = []   # densities of the intervals covering the current stretch, ascending
    extra, at = 0.0, 0
    for x, kind, d in events:  # at one step, ends sort before starts: adjacent intervals do not overlap
        if len(active) > 1:
            extra += (x - at) * (sum(active) - active[-1])
        at = x
        if kind > 0:
            bisect.insort(active, d)
        else:
            active.remove(d)
    return extra


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 2**63


def is_cursor(v) -> bool:
    """None or a [first, end] pair of step numbers (a data-stream cursor as JSON holds it; first <= end unchecked)."""
    return v is None or (isinstance(v, list) and len(v) == 2 and all(is_count(x) and 0 <= x < 2**53 for x in v))


def gaps(intervals: list[tuple[int, int, float]], start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """The stretches of steps in [start, end) that no interval covers (end None: the furthest interval end)."""
    out, reach = [], start
    for a, b, _ in sorted(intervals):
        if end is not None and a >= end:
            break
        if a > reach:
            out.append((reach, a))
        reach = max(reach, b)
    if end is not None and reach < end:
        out.append((reach, end))
    return out


def mean_density(intervals: list[tuple[int, int, float]]) -> float:
    """Tokens per step over intervals (first, end, tokens per step), weighted by their lengths; 0 for none."""
    steps = sum(b - a for a, b, _ in intervals)
    return sum(d * (b - a) for a, b, d in intervals) / steps if steps else 0.0


def merged_contributions(merges: Iterable[dict]) -> Iterable[dict]:
    """Each merged contribution of the merge records as {learner, fragment, tokens, cursor}; records
    written before the ledger existed (no tokens_each) give tokens but no cursors. A record with a
    field of the wrong type (merge events come from a topic every learner may write) is skipped."""
    for m in merges:
        lids = m.get("learners")
        if not isinstance(lids, list) or not all(isinstance(x, str) for x in lids):
            continue
        n = len(lids)
        tokens = m.get("tokens_each") or ([m["tokens"] / n] * n if n and _number(m.get("tokens")) else [])
        cursors = m.get("cursors") or [None] * n
        if (not isinstance(m.get("fragment"), int) or not isinstance(tokens, list) or len(tokens) != n
                or not all(_number(t) for t in tokens) or not isinstance(cursors, list) or len(cursors) != n
                or not all(is_cursor(c) for c in cursors)):
            continue
        for lid, t, c in zip(lids, tokens, cursors):
            yield {"learner": lid, "fragment": m["fragment"], "tokens": t, "cursor": c}


def ledger(merges: Iterable[dict], *, fragments: int, trained: dict[str, int],
           handed_in: dict[str, int] | None = None, epochs: Callable[[str, int], float | None] | None = None,
           schedule: dict[str, tuple[int, int | None]] | None = None) -> dict:
    """The ledger per learner and in total. `trained`: tokens each learner trained (all its
    incarnations); `handed_in`: tokens of the contributions each published, summed over fragments;
    `epochs(learner, cursor_end)`: epochs of its shard that many steps read (None: unknown);
    `schedule`: per learner the steps [first, end) its data stream spans (end None: up to its
    furthest merged cursor, for one asked to stop early), each measured in full on every fragment."""
    P = max(fragments, 1)
    merged: dict[str, float] = defaultdict(float)
    spans: dict[tuple[str, int], list] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    uncursored: dict[str, int] = defaultdict(int)
    for c in merged_contributions(merges):
        lid = c["learner"]
        merged[lid] += c["tokens"]
        counts[lid] += 1
        cur = c["cursor"]
        if cur is None or cur[1] <= cur[0]:
            uncursored[lid] += 1
            continue
        spans[(lid, c["fragment"])].append((cur[0], cur[1], c["tokens"] / (cur[1] - cur[0])))
    twice: dict[str, float] = defaultdict(float)
    missed: dict[str, float] = defaultdict(float)
    reach: dict[str, int] = {}
    for (lid, _), iv in spans.items():
        twice[lid] += extra_coverage(iv)
        reach[lid] = max(reach.get(lid, 0), max(b for _, b, _ in iv))
    for (lid, _), iv in spans.items():
        if schedule is None or lid not in schedule:
            missed[lid] += mean_density(iv) * sum(b - a for a, b in gaps(iv))
    for lid, (first, end) in (schedule or {}).items():
        mine = [x for (who, _), iv in spans.items() if who == lid for x in iv]
        per_step = mean_density(mine or [x for iv in spans.values() for x in iv])
        for p in range(P):
            uncovered = gaps(spans.get((lid, p), []), first, reach.get(lid, first) if end is None else end)
            missed[lid] += per_step * sum(b - a for a, b in uncovered)
    rows = {}
    for lid in sorted(set(trained) | set(merged) | set(handed_in or {}) | set(schedule or {})):
        t, m = trained.get(lid, 0), merged.get(lid, 0.0) / P
        row = {"tokens_trained": t, "tokens_merged": round(m), "tokens_twice": round(twice.get(lid, 0.0) / P),
               "tokens_missed": round(missed.get(lid, 0.0) / P),
               "tokens_lost": round(t - m), "merged_contributions": counts.get(lid, 0),
               "without_cursor": uncursored.get(lid, 0), "cursor_end": reach.get(lid),
               "epoch": None if epochs is None or lid not in reach else epochs(lid, reach[lid])}
        if handed_in is not None:
            h = handed_in.get(lid, 0) / P
            row |= {"tokens_handed_in": round(h), "lost_not_handed_in": round(t - h), "lost_not_merged": round(h - m)}
        rows[lid] = row
    keys = [k for k in next(iter(rows.values()), {}) if k.startswith(("tokens_", "lost_"))]
    return {"learners": rows, "totals": {k: sum(r[k] for r in rows.values()) for k in keys},
            "fragments": fragments}
