"""Where a restarted learner (or the spare taking its place) resumes its data stream: from the
syncer's own records only, never from what a writer of the events topic claims.

Every contribution the syncer accepted carries its data-stream cursor ([first, end) steps), kept in
Redis while it is pending (`round:<p>`) and in the merge record once it is applied. A contribution
accepted but not merged yet is still going to be merged, so both count: the restart resumes at the
end of the furthest accepted cursor. Every step before it is in the global model (or on its way)
at most once per fragment, and every step from it on is trained again: none is trained into the
model twice, and none is skipped on a claim.

A contribution the dead learner published just before it died may still be unread by the syncer
when the restart is decided: the runner takes the end offsets of the learner's region topic once it
knows the learner is gone, and reads the records only after the syncer has handled every partition
up to them (the syncer's `read_to` positions, written after its acceptances). Whatever the learner
wrote is then accepted (and counted) or refused for good, and cannot be accepted after the restart
began at a point short of it.

Heartbeats and acceptance events stay advisory: what a beat says it handed in only makes the
runner wait a bounded while for the syncer's records to catch up (a contribution the learner saw
acked may not be accepted yet); it never moves the resume point.

Pure functions of plain records: the runner (diloco.supervisor) reads the records from Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from diloco import coverage

log = logging.getLogger(__name__)

SETTLE_S = 5.0  # how long a restart waits for the syncer's records to reach what the beats claim
READ_UP_S = 60.0  # how long it waits for the syncer to read what a dead learner wrote (then resumes, warned)


def furthest_ends(contributions: Iterable[dict], into: dict[str, int] | None = None) -> dict[str, int]:
    """Per learner, the end of the furthest cursor among `contributions` ({learner, cursor} each: a
    pending contribution's meta as Redis keeps it, or one of coverage.merged_contributions), folded
    into `into` (a running maximum over records read before). A record without a cursor, or with one
    that is not [first, end] steps, moves nothing (logged: the syncer writes none such)."""
    out = {} if into is None else into
    for c in contributions:
        lid, cur = c.get("learner"), c.get("cursor")
        if cur is None:
            continue
        if not isinstance(lid, str) or not coverage.is_cursor(cur) or cur[0] > cur[1]:
            log.warning("accepted contribution skipped for the resume point: no learner and [first, end] cursor",
                        extra={"learner": str(lid)[:40], "cursor": str(cur)[:40]})
            continue
        out[lid] = max(out.get(lid, 0), cur[1])
    return out


def resume_step(accepted_end: int | None, *, default: int = 0, schedule_end: int) -> int:
    """Where a restart resumes: past the furthest cursor the syncer accepted (`accepted_end`, None
    for none), at least `default` (a joiner: the step it entered the schedule at), within the
    schedule (a record past its end would leave it nothing to train: it ends there)."""
    return min(max(default, accepted_end or 0), schedule_end)


def settled(accepted_end: int | None, claimed: int) -> bool:
    """Whether the syncer's records reach what the learner's beats (or acceptance events) say it
    handed in: then nothing it saw acked is still on its way to the syncer."""
    return (accepted_end or 0) >= claimed


def read_up_to(positions: Mapping[tuple[str, int], int], ends: Mapping[tuple[str, int], int]) -> bool:
    """Whether the syncer has handled every partition in `ends` up to its end offset there
    (`positions`: (topic, partition) -> the offset after the last record handled). A partition it
    has no position for counts as read only where nothing was written (end offset 0)."""
    return all(positions.get(tp, 0) >= end for tp, end in ends.items())
