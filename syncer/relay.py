"""The outbox relay: what a Redis transaction committed to say, said on Kafka.

Announcements and events are written to the Redis outbox in the same MULTI/EXEC as the change they
describe (syncer/state.py); the relay publishes them and trims only what the broker acknowledged. A
crash between the two repeats records, never loses them (learners ignore versions they already
hold, event readers drop repeated eids). A record the broker refuses for good is dead-lettered, so
it cannot hold up every record behind it.
"""

from __future__ import annotations

import json
import logging
import time

from diloco import messages
from diloco.infra.kafka import LogError
from diloco.periodic import Every

log = logging.getLogger(__name__)


def _permanent(err: LogError) -> bool:
    return not err.retriable


class Events:
    """The syncer's events on the run's events topic: `send` now (what no Redis change stands behind),
    or `outbox`, the record a Redis transaction writes with the change it describes."""

    def __init__(self, producer, topic: str, run_id: str):
        self.producer, self.topic, self.run_id = producer, topic, run_id

    def outbox(self, kind: str, **fields) -> dict:
        value = messages.event(kind, run=self.run_id, source="syncer", **fields)
        return {"topic": self.topic, "partition": 0, "value": value.decode()}

    def send(self, kind: str, **fields) -> None:
        self.producer.send(self.topic, messages.event(kind, run=self.run_id, source="syncer", **fields), partition=0)


class OutboxRelay:
    def __init__(self, state, producer, broker, clock=time.monotonic):
        self.state, self.producer, self.broker = state, producer, broker
        self.broker_down = False   # said once per outage
        self.seen_empty_at = -1    # state.outbox_writes when the outbox was last seen empty
        self.every_look = Every(1.0, clock)

    def relay(self, *, only_if_written: bool = False) -> None:
        """Publish the outbox; while the broker is away the outbox waits and the next call tries again.

        `only_if_written` (the main loop's call, once per poll): skip the Redis round trip when this
        process wrote nothing to the outbox since it last saw it empty, but look once a second anyway,
        for what other shards or an outage left there."""
        writes, look_anyway = self.state.outbox_writes, self.every_look.due()
        if only_if_written and writes == self.seen_empty_at and not look_anyway:
            return
        while self.broker.up:  # no blocking flush while it is away
            if not (raw := self.state.outbox_peek()):
                self.seen_empty_at = writes
                return
            try:
                refused = self._send(raw)
            except LogError as err:
                if not self.broker_down:
                    log.warning("broker unavailable; keeping %d records in the outbox", len(raw),
                                extra={"error": f"{err.kind}: {err}"})
                self.broker_down = True
                return
            for text, why in refused:
                self.state.dead_letter(text, why)
                log.error("outbox record refused by the broker; dead-lettered",
                          extra={"error": messages.bounded(why, 200), "bytes": len(text)})
            if self.broker_down:
                log.warning("broker reachable again; outbox relayed")
                self.broker_down = False
            if not self.state.outbox_trim(raw):
                return  # another shard relayed the same records first: they went out twice, not zero times

    def _send(self, raw: list[str]) -> list[tuple[str, str]]:
        """Send and await `raw`; the (record, why) pairs the broker will never take. A retriable
        error raises: nothing is trimmed and the whole batch goes again."""
        refused, futures = [], []
        for text in raw:
            r = json.loads(text)
            try:
                futures.append((text, self.producer.send(r["topic"], r["value"].encode(), partition=r["partition"])))
            except LogError as err:  # refused before it left (too large for max_request_size)
                if not _permanent(err):
                    raise
                refused.append((text, f"{err.kind}: {err}"))
        self.producer.flush(timeout=10)
        for text, f in futures:
            try:
                f.get(timeout=10)
            except LogError as err:
                if not _permanent(err):
                    raise
                refused.append((text, f"{err.kind}: {err}"))
        return refused
