"""The syncer's records: an accepted contribution, where a record is in the log, a contribution's
status and a partition's key. Plain data with the one spelling of each, so that nothing builds or
splits these strings inline, and nothing reads a contribution by string key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import NamedTuple

from diloco import messages
from diloco.infra.log import TP
from diloco.messages import Manifest, Reason


def partition_key(tp: TP) -> str:
    """`topic|partition`: how a partition is named in Redis keys, the chunk assembler and logs."""
    return f"{tp[0]}|{tp[1]}"


def parse_partition_key(key: str) -> TP:
    topic, partition = key.rsplit("|", 1)
    return topic, int(partition)


class Where(NamedTuple):
    """Where a record is in the log: its topic, partition and offset (a contribution's: of its first
    record; None where no offset is known). A merge record keeps it as a JSON list."""
    topic: str
    partition: int
    offset: int | None

    @property
    def tp(self) -> TP:
        return self.topic, self.partition


@dataclass(frozen=True)
class Status:
    """A contribution's status as Redis keeps it: `pending:<p>`, `applied:<p>:<v>` or `rejected:<reason>`."""
    kind: str                   # pending | applied | rejected
    fragment: int | None = None
    version: int | None = None
    reason: str | None = None

    @staticmethod
    def pending(fragment: int) -> str:
        return f"pending:{fragment}"

    @staticmethod
    def applied(fragment: int, version: int) -> str:
        return f"applied:{fragment}:{version}"

    @staticmethod
    def rejected(reason: str) -> str:
        return f"rejected:{reason}"

    @staticmethod
    def kind_of(text: str) -> str:
        """The kind a status text names (`pending`, `applied`, `rejected`), whatever follows it."""
        return text.partition(":")[0]

    @classmethod
    def parse(cls, text: str) -> Status | None:
        """The status `text` spells, or None for an empty or unknown one."""
        kind, _, rest = (text or "").partition(":")
        if kind == "pending" and rest.isdigit():
            return cls(kind, fragment=int(rest))
        if kind == "applied":
            p, _, v = rest.partition(":")
            if p.isdigit() and v.isdigit():
                return cls(kind, fragment=int(p), version=int(v))
        if kind == "rejected" and rest:
            return cls(kind, reason=rest)
        return None


def rejection_counter(reason: str) -> str:
    """The counter of rejections for `reason`: `rejected:<reason>` in the run's `counters`."""
    return f"rejected:{reason}"


def rejections_by_reason(counters: Mapping[str, int]) -> dict[str, int]:
    """The rejection counters among a run's `counters`, by reason."""
    return {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("rejected:")}


def pending_fragment(text: str) -> int | None:
    """The fragment whose open round holds a contribution of this status, or None if it is not pending."""
    s = Status.parse(text)
    return s.fragment if s is not None and s.kind == "pending" else None


@dataclass(frozen=True)
class Contribution:
    """A contribution accepted into a round: what its manifest claimed, when it arrived and where its
    first record is in the log. Redis keeps it as `meta()` (`round:<p>`): the round's, the merge
    record's and the rebuild's input."""
    id: str
    learner: str
    region: str
    fragment: int
    base_version: int
    tokens: int
    steps: int
    step_time: float
    total_bytes: int
    created: float
    cursor: tuple[int, int] | None
    arrival: float
    where: Where

    @classmethod
    def accepted(cls, m: Manifest, where: Where, arrival: float) -> Contribution:
        """Manifest `m`, read from `where` (its first record), accepted at `arrival`."""
        return cls(m.id, m.learner, m.region, m.fragment, m.base_version, m.tokens, m.steps, m.step_time,
                   m.total_bytes, m.created, m.cursor, arrival, where)

    @classmethod
    def from_meta(cls, meta: dict) -> Contribution:
        """A contribution as Redis keeps it (`meta()`); one kept before cursors existed has none."""
        cursor = meta.get("cursor")
        return cls(meta["id"], meta["learner"], meta["region"], meta["fragment"], meta["base_version"],
                   meta["tokens"], meta["steps"], meta["step_time"], meta["bytes"], meta["created"],
                   None if cursor is None else tuple(cursor), meta["arrival"],
                   Where(meta["topic"], meta["partition"], meta["offset"]))

    def meta(self) -> dict:
        """What Redis keeps of it, keys in this order (the JSON text stays as it always was)."""
        return {"id": self.id, "learner": self.learner, "region": self.region, "fragment": self.fragment,
                "base_version": self.base_version, "tokens": self.tokens, "steps": self.steps,
                "step_time": self.step_time, "bytes": self.total_bytes, "arrival": self.arrival,
                "topic": self.where.topic, "partition": self.where.partition, "offset": self.where.offset,
                "created": self.created, "cursor": self.cursor_list}

    @property
    def cursor_list(self) -> list[int] | None:
        """The data-stream cursor as JSON holds it: [first, end) steps, or None."""
        return None if self.cursor is None else list(self.cursor)


def replay_mismatch(recorded: Contribution, m: Manifest, where: Where) -> str | None:
    """Why a contribution assembled on replay is not the record Redis accepted under its id, or None
    when it is: the same place and first offset in the log (a log never changes what it holds there)
    and the same claims. Another writer who knows the id may put a set of it anywhere else."""
    if where != recorded.where:
        return (f"id {recorded.id} was accepted from {partition_key(recorded.where.tp)}@{recorded.where.offset}; "
                f"this set is at {partition_key(where.tp)}@{where.offset}")
    got = Contribution.accepted(m, where, recorded.arrival)
    differ = [f.name for f in fields(Contribution) if getattr(got, f.name) != getattr(recorded, f.name)]
    return f"its manifest differs from the one accepted under id {recorded.id} in {differ}" if differ else None


def accepted_fields(c: Contribution, version: int) -> dict:
    """The `contribution_accepted` event's fields: contribution `c` taken into the round of `version`."""
    return {"id": c.id, "learner": c.learner, "region": c.region, "fragment": c.fragment,
            "base_version": c.base_version, "version": version, "tokens": c.tokens, "bytes": c.total_bytes,
            "cursor": c.cursor_list}


def rejection_fields(cid: str | None, reason: Reason, detail: str, manifest: Manifest | None = None,
                     where: Where | None = None) -> dict:
    """The `contribution_rejected` event's fields (docs/wire-format.md): whose, why, and from where in
    the log (`where`: topic, partition, offset), each bounded."""
    fields = {"id": cid if cid is None else cid[:64], "reason": reason, "detail": messages.bounded(detail)}
    if manifest is not None:
        fields |= {"learner": manifest.learner, "region": manifest.region, "fragment": manifest.fragment,
                   "base_version": manifest.base_version}
    if where is not None:
        fields["where"] = {"topic": where.topic, "partition": where.partition, "offset": where.offset}
    return fields
