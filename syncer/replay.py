"""Replay: where a restart (or a fragment's next owner) resumes reading, and what it must get back.

The replay offset of a partition never passes the first record of a contribution whose effect is not
durable yet (accepted into an open round, or still being assembled), so a replay from it brings back
every payload Redis counts on. `lost_payloads` names those it did not bring back; `GroupOffsets`
mirrors the replay offsets into the Kafka consumer group so Kafka's own tools show the lag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from diloco.infra.kafka import LogError
from diloco.syncer.records import TP, partition_key
from diloco.syncer.rounds import Pending

log = logging.getLogger(__name__)


def replay_offsets(consumed: Mapping[TP, int], rounds: Mapping[int, Mapping[str, Pending]],
                   tps: Callable[[int], Iterable[TP]], partial: Callable[[str], list[int]]) -> dict[TP, int]:
    """Per partition of the fragments in `rounds` (fragment -> its open round), the first offset whose
    effect is not yet durable: read up to `consumed`, held back by each pending contribution's first
    record and by the first offsets of the partial chunk sets (`partial`, by partition key)."""
    out = {tp: consumed[tp] for p in rounds for tp in tps(p) if tp in consumed}
    for contributions in rounds.values():
        for c in contributions.values():
            w = c.contribution.where
            if w.offset is not None and w.tp in out:
                out[w.tp] = min(out[w.tp], w.offset)
    for tp in out:
        if held := partial(partition_key(tp)):
            out[tp] = min(out[tp], min(held))
    return out


def lost_payloads(rounds: Mapping[int, Mapping[str, Pending]], consumer, *,
                  assembling: Callable[[str, str], bool]):
    """The accepted contributions a replay did not bring back, as (fragment, id, contribution, detail),
    and whether others may still come (a partial set at their place holds them (`assembling(id,
    partition key)`), or the reader is not past them yet).

    A payload is lost once no partial set holds it and the reader is past its first record or at the
    end of its partition (a truncated or recreated log): it was not in the log."""
    lost, waiting = [], False
    for p, contributions in rounds.items():
        for cid, c in contributions.items():
            if c.deltas is not None:
                continue
            w = c.contribution.where
            at = position(consumer, w.tp)
            if assembling(cid, partition_key(w.tp)) or (at <= w.offset and not read_to_end(consumer, w.tp)):
                waiting = True
                continue
            lost.append((p, cid, c, f"records from {partition_key(w.tp)}@{w.offset} are not in the log "
                                    f"(read to offset {at})"))
    return lost, waiting


def position(consumer, tp: TP) -> int:
    """Where the consumer reads partition `tp` next (0 if it is not assigned)."""
    return consumer.position(tp) if tp in consumer.assignment() else 0


def read_to_end(consumer, tp: TP) -> bool:
    """Whether the consumer read assigned partition `tp` up to its high watermark."""
    hw = consumer.highwater(tp)
    return hw is not None and tp in consumer.assignment() and consumer.position(tp) >= hw


def lags(consumer) -> dict[TP, int]:
    """Records not read yet, per assigned partition whose high watermark a fetch has told."""
    return {tp: hw - consumer.position(tp) for tp in consumer.assignment()
            if (hw := consumer.highwater(tp)) is not None}


def unread(consumer) -> dict[str, int]:
    """Records left to read per assigned partition ("topic|partition"), those with any."""
    return {partition_key(tp): n for tp, n in lags(consumer).items() if n > 0}


class GroupOffsets:
    """Commits replay offsets as the consumer group's offsets. Monitoring only: Redis stays the source
    of truth, and a failed commit is logged (once until one succeeds), never raised."""

    def __init__(self, consumer, broker):
        self.consumer, self.broker = consumer, broker
        self.failing = False

    def commit(self, offsets: Mapping[TP, int]) -> None:
        if self.consumer.group_id is None or not self.broker.up:
            return
        try:
            self.consumer.commit(offsets, timeout_ms=2000)
            self.failing = False
        except LogError as err:
            if not self.failing:
                log.warning("consumer group commit failed (monitoring only; Redis keeps the offsets)",
                            extra={"group": self.consumer.group_id, "error": f"{err.kind}: {err}"})
            self.failing = True
