"""The syncer's records: a contribution's status, a partition's key, a rejection's reason, and what a
shard holds of a fragment. Plain data with the one spelling of each, so that nothing builds or
splits these strings inline."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from diloco import messages
from diloco.messages import Reason  # noqa: F401 (the wire contract owns it; the syncer imports it from here)
from diloco.syncer import fused

TP = tuple[str, int]  # (topic, partition)


def partition_key(tp: TP) -> str:
    """`topic|partition`: how a partition is named in Redis keys, the chunk assembler and logs."""
    return f"{tp[0]}|{tp[1]}"


def parse_partition_key(key: str) -> TP:
    topic, partition = key.rsplit("|", 1)
    return topic, int(partition)


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


def pending_fragment(text: str) -> int | None:
    """The fragment whose open round holds a contribution of this status, or None if it is not pending."""
    s = Status.parse(text)
    return s.fragment if s is not None and s.kind == "pending" else None


@dataclass
class Pending:
    """A contribution accepted into an open round, kept encoded as it arrived (int8: a quarter of its
    float32 size) with its norms; `deltas` is None until a replay brings it back."""
    manifest_meta: dict
    arrival: float
    tp: TP
    first_offset: int
    deltas: fused.EncodedDelta | None = None

    @classmethod
    def from_meta(cls, meta: dict) -> Pending:
        """An accepted contribution as Redis keeps it (`contribution_meta`), its payload not read yet."""
        return cls(meta, meta["arrival"], (meta["topic"], meta["partition"]), meta["offset"])


@dataclass
class FragmentState:
    """What a shard holds of one fragment it owns: its version, parameters and outer state, the open round."""
    version: int
    params: dict[str, np.ndarray]
    opt_state: object
    round: dict[str, Pending] = field(default_factory=dict)
    residual: dict[str, np.ndarray] = field(default_factory=dict)  # broadcast error not yet published
    snapshot_at: int = 0  # the newest version stored whole (store.snapshot_every)
    snapshot: dict[str, np.ndarray] | None = None  # its parameters, the base of every next update (None: params)
    _scale: float | None = None  # max(parameter norm, sqrt(size)): the norm budget's unit, per version

    def update_base(self) -> dict[str, np.ndarray]:
        """The parameters the next version's update is encoded against: the newest snapshot's."""
        return self.params if self.snapshot is None else self.snapshot

    def update_from(self) -> int:
        """The version of `update_base()`."""
        return self.version if self.snapshot is None else self.snapshot_at

    def advance(self, version: int, params, opt_state, residual, *, snapshot_at: int, keep_snapshot: bool) -> None:
        """Move to a committed `version`; with `keep_snapshot` (updates from the snapshot), a new
        snapshot's parameters become the base of every next update."""
        if snapshot_at != self.snapshot_at and keep_snapshot:
            self.snapshot = params
        self.version, self.params, self.opt_state, self.residual = version, params, opt_state, residual
        self.snapshot_at, self._scale = snapshot_at, None

    def budget_scale(self) -> float:
        if self._scale is None:
            norm = math.sqrt(sum(fused.squared_norm(a) for a in self.params.values()))
            self._scale = max(norm, math.sqrt(sum(a.size for a in self.params.values())))
        return self._scale


def contribution_meta(m, tp: TP, first_offset: int, arrival: float) -> dict:
    """What Redis keeps of an accepted contribution (manifest `m`, read from `tp` at `first_offset`):
    the round's, the merge record's and the rebuild's input."""
    return {"id": m.id, "learner": m.learner, "region": m.region, "fragment": m.fragment,
            "base_version": m.base_version, "tokens": m.tokens, "steps": m.steps, "step_time": m.step_time,
            "bytes": m.total_bytes, "arrival": arrival, "topic": tp[0], "partition": tp[1],
            "offset": first_offset, "created": m.created, "cursor": None if m.cursor is None else list(m.cursor)}


def accepted_fields(m, version: int, meta: dict) -> dict:
    """The `contribution_accepted` event's fields: manifest `m` taken into the round of `version`."""
    return {"id": m.id, "learner": m.learner, "region": m.region, "fragment": m.fragment,
            "base_version": m.base_version, "version": version, "tokens": m.tokens, "bytes": m.total_bytes,
            "cursor": meta["cursor"]}


def rejection_fields(cid: str | None, reason: str, detail: str, manifest=None, where=None) -> dict:
    """The `contribution_rejected` event's fields (docs/wire-format.md): whose, why, and from where in
    the log (`where`: topic, partition, offset), each bounded."""
    fields = {"id": cid if cid is None else cid[:64], "reason": reason, "detail": messages.bounded(detail)}
    if manifest is not None:
        fields |= {"learner": manifest.learner, "region": manifest.region, "fragment": manifest.fragment,
                   "base_version": manifest.base_version}
    if where is not None:
        fields["where"] = {"topic": where[0], "partition": int(where[1]), "offset": where[2]}
    return fields
