"""A fragment's round: when it is due, and what closing it computes. Pure functions of the round's
contributions, the learners' liveness and the fragment's state: the syncer calls them as records
arrive, and the rebuild replays `close_round` from a merge record to reproduce a version bit for bit.

- `FragmentState`: what a shard holds of a fragment, its open round of `Pending` contributions (each
  a `records.Contribution` and its encoded deltas);
- `due`: the quorum and grace-window decision (syncer/policy.py) over the learners whose deltas
  count towards K (with `syncer.quorum_of_fresh`, only those trained from the current version), on
  the syncer's contributions and the goodput simulator's alike;
- `round_share`'s denominator (`members`): the live learners, those that finished (the last rounds of a
  run are partial), and the round's contributors;
- `norm_outliers`: which contributions are too far above the round's median norm;
- `partial_share`: the share of a full round a partial one carries (syncer.scale_partial_rounds);
- `close_round`: token (and staleness) weights, the merge (mean, or RDA over learners), the outer
  step and the encoded update learners fetch;
- `close`: all of the above for one round, its whole outcome as a value (`Outcome`): the syncer's
  merge only writes it down (its commit protocol).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from diloco.config import Config
from diloco.plan import Plan
from diloco.syncer import merge as merge_math
from diloco.syncer.policy import Decision, QuorumPolicy, decide
from diloco.syncer.records import Contribution

if TYPE_CHECKING:
    # The merge kernels need numba (the syncer extra): the functions that merge import them, so the
    # simulator, which runs `due` on a base install (`diloco simulate`), can import this module.
    from diloco.syncer import fused


@dataclass
class Pending:
    """A contribution accepted into an open round, its deltas kept encoded as they arrived (int8: a
    quarter of their float32 size) with their norms; `deltas` is None until a replay brings them back."""
    contribution: Contribution
    deltas: fused.EncodedDelta | None = None


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
    tokens_merged: int = 0  # the tokens of every merge into this fragment up to `version` (run.token_budget)

    def arrivals(self) -> list[Contribution]:
        """The open round's contributions, as `due` reads them."""
        return [c.contribution for c in self.round.values()]

    def awaiting_payloads(self) -> bool:
        """Whether a contribution of the open round waits for its payload (a replay brings it back):
        until then the round cannot close."""
        return any(c.deltas is None for c in self.round.values())

    def tokens_taken(self) -> int:
        """Tokens this fragment has taken in: merged, or accepted into the open round (merged next)."""
        return self.tokens_merged + sum(c.contribution.tokens for c in self.round.values())

    def update_base(self) -> dict[str, np.ndarray]:
        """The parameters the next version's update is encoded against: the newest snapshot's."""
        return self.params if self.snapshot is None else self.snapshot

    def update_from(self) -> int:
        """The version of `update_base()`."""
        return self.version if self.snapshot is None else self.snapshot_at

    def advance(self, version: int, params, opt_state, residual, *, snapshot_at: int, keep_snapshot: bool,
                tokens: int) -> None:
        """Move to a committed `version` that merged `tokens`; with `keep_snapshot` (updates from the
        snapshot), a new snapshot's parameters become the base of every next update."""
        self.tokens_merged += tokens
        if snapshot_at != self.snapshot_at and keep_snapshot:
            self.snapshot = params
        self.version, self.params, self.opt_state, self.residual = version, params, opt_state, residual
        self.snapshot_at, self._scale = snapshot_at, None

    def budget_scale(self) -> float:
        from diloco.syncer import fused  # numba: see the imports
        if self._scale is None:
            norm = math.sqrt(sum(fused.squared_norm(a) for a in self.params.values()))
            self._scale = max(norm, math.sqrt(sum(a.size for a in self.params.values())))
        return self._scale


def members(live: Collection[str], contributors: Collection[str], registry: Mapping[str, dict]) -> set[str]:
    """Whom a round's share is counted against: live learners, finished ones (a learner that finished
    still counts, so the last rounds of a run are partial, not whole) and the round's contributors."""
    return set(live) | set(contributors) | {lid for lid, hb in registry.items() if hb["status"] == "finished"}


class Arrival(Protocol):
    """What `due` reads of a contribution in an open round: the syncer's `Contribution`, or the
    simulator's own record of one (diloco/sim/goodput.py)."""
    learner: Hashable
    base_version: int
    arrival: float


def due(policy: QuorumPolicy, version: int, arrivals: Collection[Arrival], *, live: Set, present: Set, now: float,
        step_time_s: float, sync_time_s: float, quorum_of_fresh: bool) -> Decision | None:
    """Whether the open round of `arrivals` of a fragment at `version` closes now (None: nothing to
    close). With `quorum_of_fresh`, late contributions ride with the next fresh ones instead of making
    a round; with nobody left to train, late ones close it. Each learner counts once, at its first."""
    if not arrivals:
        return None
    fresh_only = quorum_of_fresh and bool(live)
    first_by_learner: dict[Hashable, float] = {}
    for a in arrivals:
        if fresh_only and a.base_version < version:
            continue
        first_by_learner[a.learner] = min(first_by_learner.get(a.learner, math.inf), a.arrival)
    return decide(policy, list(first_by_learner.values()), now=now, expected=len(live | set(first_by_learner)),
                  step_time_s=step_time_s, sync_time_s=sync_time_s, members=len(present | set(first_by_learner)))


def in_canonical_order(contribs: Collection[Pending]) -> list[Pending]:
    """A round's contributions by (learner, base, id): the sum's float rounding then depends on what
    a round holds, not on the order it arrived in, so a restarted syncer computes the very same bits."""
    return sorted(contribs, key=lambda c: (c.contribution.learner, c.contribution.base_version, c.contribution.id))


class Outlier(NamedTuple):
    """A contribution whose delta's norm is more than `factor` times its round's median norm."""
    pending: Pending
    norm: float
    median: float


def norm_outliers(contribs: Sequence[Pending], factor: float) -> list[Outlier]:
    """The contributions whose delta is more than `factor` times the median norm; none with factor 0 or
    fewer than 3 contributions."""
    if factor <= 0 or len(contribs) < 3:
        return []
    norms = [c.deltas.norm for c in contribs]
    median = float(np.median(norms))
    return [Outlier(c, n, median) for c, n in zip(contribs, norms) if median > 0 and n > factor * median]


def partial_share(contribs: Collection[Pending], live: Collection[str], registry: Mapping[str, dict], *,
                  scale: bool) -> float:
    """The share of a full round that `contribs` carry (merge.round_share over the round's `members`);
    1 without `scale` (syncer.scale_partial_rounds)."""
    if not scale:
        return 1.0
    return merge_math.round_share(len(contribs), len(members(live, {c.contribution.learner for c in contribs},
                                                             registry)))


@dataclass(frozen=True)
class Closed:
    """What closing a round computed: the contributions' weights, the fragment's new parameters and
    outer state, the encoded update learners fetch, and the broadcast error carried to the next."""
    weights: np.ndarray
    params: dict[str, np.ndarray]
    opt_state: object
    update: dict[str, bytes]
    residual: dict[str, np.ndarray]


def close_round(cfg: Config, plan: Plan, st: FragmentState, p: int, contribs: Sequence[Pending],
                share: float) -> Closed:
    """Merge one round of fragment p and take the outer step. Raises FloatingPointError if any
    value is not finite (int8 codes would launder a NaN), so a non-finite version is never written."""
    from diloco.syncer import fused  # numba: see the imports
    sc, cs = cfg.syncer, [c.contribution for c in contribs]
    steps = [c.steps for c in cs]
    tokens = merge_math.bounded_tokens([c.tokens for c in cs], steps, sc.tokens_per_step_spread)
    weights = merge_math.token_weights(tokens, steps, weighted=sc.token_weighting)
    if sc.staleness_discount:
        weights = merge_math.staleness_weights(weights, [st.version - c.base_version for c in cs],
                                               sc.staleness_discount)
    delta = fused.merge([c.deltas for c in contribs], weights, plan.mean_merged, rule=sc.merge,
                        share=share, threads=sc.merge_threads, learners=[c.learner for c in cs])
    old = {n: st.params[n] for n in plan.fragment_names[p]}
    o = cfg.outer
    momentum = merge_math.round_momentum(o.momentum, share) if o.momentum_per_round else o.momentum
    base = st.update_base()
    update, params, residual, opt_state = fused.outer_update(
        old, st.opt_state, delta, st.residual, lr=o.lr, momentum=momentum, nesterov=o.nesterov,
        scheme=sc.broadcast, threads=sc.merge_threads, base=None if base is st.params else base)
    return Closed(weights, params, opt_state, update, residual)


@dataclass(frozen=True)
class Outcome:
    """The whole outcome of closing a round: the norm outliers it rejects, the contributions it merges
    (in canonical order) and the share of a full round they carry, and what the merge computed, or the
    error it raised instead (then the merged ones are rejected as merge_failed and nothing is written)."""
    outliers: list[Outlier]
    merged: list[Pending]
    share: float
    closed: Closed | None = None
    failure: Exception | None = None


def close(cfg: Config, plan: Plan, st: FragmentState, p: int, *, live: Collection[str],
          registry: Mapping[str, dict]) -> Outcome:
    """Close fragment p's open round: set its norm outliers aside, then merge the rest with their share
    of a full round counted among the round's members (`close_round`). With nothing left, or a merge
    that fails, `closed` is None."""
    ordered = in_canonical_order(st.round.values())
    outliers = norm_outliers(ordered, cfg.syncer.norm_outlier_factor)
    set_aside = {id(o.pending) for o in outliers}
    merged = [c for c in ordered if id(c) not in set_aside]
    if not merged:
        return Outcome(outliers, merged, 1.0)
    share = partial_share(merged, live, registry, scale=cfg.syncer.scale_partial_rounds)
    try:
        return Outcome(outliers, merged, share, close_round(cfg, plan, st, p, merged, share))
    except Exception as err:  # what a round holds may break the merge: the syncer rejects it, never crashes on it
        return Outcome(outliers, merged, share, failure=err)


def merge_record(p: int, current: int, contribs: Sequence[Pending], weights, *, reason: str, share: float,
                 live: Collection[str], now: float) -> dict:
    """The merge record of fragment p's version `current + 1`: who and what it merged, with what weights, from
    where in the log (what a rebuild since the last snapshot replays), and whom it did not wait for."""
    cs = [c.contribution for c in contribs]
    return {"fragment": p, "version": current + 1, "ids": [c.id for c in cs],
            "learners": [c.learner for c in cs], "tokens": sum(c.tokens for c in cs),
            "weights": [round(float(w), 6) for w in weights],
            # each contribution's tokens and data-stream cursor: the coverage ledger's input
            "tokens_each": [c.tokens for c in cs], "cursors": [c.cursor_list for c in cs],
            "compute_s": [round(c.steps * c.step_time, 4) for c in cs],
            "base_versions": [c.base_version for c in cs],
            "late": sum(1 for c in cs if c.base_version < current), "reason": reason,
            "share": share, "where": [list(c.where) for c in cs],
            "missing": sorted(set(live) - {c.learner for c in cs}), "time": now,
            "waited_s": round(now - min(c.arrival for c in cs), 4)}  # quorum and grace


MERGE_EVENT_FIELDS = ("fragment", "version", "ids", "learners", "tokens", "late", "tokens_each", "cursors", "reason",
                      "missing")


def merge_event_fields(record: dict, seconds: float) -> dict:
    """The `merge` event's fields (docs/wire-format.md): the merge record's public part and how long it took."""
    return {k: record[k] for k in MERGE_EVENT_FIELDS} | {"seconds": round(seconds, 4)}
