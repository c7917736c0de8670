"""Intake: one contribution in, a verdict out. Its deltas (kept encoded, with their norms), or a
`Rejection` saying why it can never enter a merge. Pure: it reads the run's config and plan and what
the caller says of the live run (its members, the fragment's state), and writes nothing."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import NamedTuple

from diloco import messages, signing
from diloco.config import Config
from diloco.messages import FrameHeader, Manifest, Reason, WireError
from diloco.plan import Plan
from diloco.syncer import fused
from diloco.syncer.records import TP
from diloco.syncer.rounds import FragmentState


class Rejection(NamedTuple):
    reason: Reason
    detail: str


def read_frame(raw: bytes) -> tuple[FrameHeader, dict, memoryview]:
    """(typed header, header, payload) of one record of a region topic (the header dict is the
    assembler's); WireError if it is no frame or names no contribution id of 1-64 characters."""
    header, payload = messages.parse_frame(raw)
    return FrameHeader.from_header(header, need_id=True), header, payload


class Intake:
    """The checks of one run's contributions: the manifest's claims, then the payload."""

    def __init__(self, cfg: Config, run_id: str, plan: Plan):
        self.cfg, self.run_id, self.plan = cfg, run_id, plan
        self.shapes = plan.shapes
        self.secret = cfg.signing_secret()   # None: frames are not signed (the topics' ACLs say who writes)
        self._keys: dict[str, bytes] = {}

    def key_of(self, learner: str) -> bytes | None:
        """Learner `learner`'s signing key, None for an id that is no member of this run and may not join."""
        if learner not in self._keys:
            if not self.cfg.is_member_id(learner):
                return None
            self._keys[learner] = signing.learner_key(self.secret, self.run_id, learner)
        return self._keys[learner]

    def signer(self, raw: bytes, headers) -> str | None:
        """The learner that signed the frame `raw` (its record headers), None when the run signs nothing;
        raises signing.SigningError when a signed run's frame is unsigned or its signature does not hold."""
        return None if self.secret is None else signing.signer_of(headers, raw, self.key_of)

    @staticmethod
    def not_the_signers(header: FrameHeader, signer: str, began: str | None) -> Rejection | None:
        """Why a frame `signer` signed may not join its set: a manifest naming another learner (or none),
        or a set whose first frame another learner signed (`began`). Such a frame is refused alone."""
        named = header.learner if header.kind == "manifest" else signer
        if named != signer:
            return Rejection(Reason.BAD_SIGNATURE, f"a manifest of learner {messages.short(named, 64)} signed by "
                             f"{signer!r}")
        if began is not None and began != signer:
            return Rejection(Reason.BAD_SIGNATURE, f"a frame signed by {signer!r} for a set {began!r} began")
        return None

    def assembler(self, check) -> messages.ChunkAssembler:
        """The chunk assembler of this run's contributions, bounded as syncer.* says; `check` judges each
        manifest before its chunks are buffered."""
        sc = self.cfg.syncer
        return messages.ChunkAssembler(max_bytes=sc.max_contribution_bytes, timeout_s=sc.incomplete_timeout_s,
                                       after_bytes=sc.incomplete_after_bytes, max_sets=sc.max_partial_sets,
                                       max_buffered=sc.max_buffered_bytes, check=check)

    def check_route(self, m: Manifest, tp: TP, region: str | None) -> Rejection | None:
        """Why a contribution read from partition `tp` of `region`'s topic (None: not a region topic)
        does not belong there: one partition carries one fragment, and the broker's ACLs bind a writer
        to its region's topic."""
        if 0 <= m.fragment < self.plan.fragments and m.fragment != tp[1]:
            return Rejection(Reason.MISROUTED, f"fragment {m.fragment} on partition {tp[1]}, which carries fragment "
                             f"{tp[1]}")
        if region is not None and m.region != region:
            return Rejection(Reason.MISROUTED, f"a contribution of region {messages.short(m.region, 40)} on region "
                             f"{region}'s topic {tp[0]}")
        return None

    def check_claims(self, m: Manifest, *, members: Collection[str], fragment: FragmentState | None
                     ) -> Rejection | None:
        """Why what the manifest claims (run, learner, fragment, shapes, counts, base version) rules it
        out, or None. `members` are the learners of the live run (configured or admitted); an id that
        may join is accepted too. `fragment` is the state of the fragment it names where this shard holds it (None:
        misrouted, which the caller says). A replay is judged the same way: a contribution waits in the
        open round of the version it was accepted at (a merge takes the whole round), so its verdict
        holds unless what the log gave back is not what was accepted."""
        if m.run != self.run_id:
            return Rejection(Reason.WRONG_RUN, f"run {m.run!r}, this syncer serves {self.run_id!r}")
        # a joiner's first delta may be read before its first heartbeat (two topics, no order between
        # them): a possible member is admitted by either, by its id alone (the caller admits it)
        if m.learner not in members and not self.cfg.is_member_id(m.learner):
            return Rejection(Reason.UNKNOWN_LEARNER,
                             f"learner {messages.short(m.learner, 64)} is not in this run and may not join it")
        if self.cfg.region_of(m.learner).name != m.region:
            return Rejection(Reason.UNKNOWN_LEARNER, f"learner {m.learner!r} does not belong to region {m.region!r}")
        if not 0 <= m.fragment < self.plan.fragments:
            return Rejection(Reason.UNKNOWN_FRAGMENT, f"fragment {m.fragment} (this run has {self.plan.fragments})")
        want = {n: tuple(self.shapes[n]) for n in self.plan.fragment_names[m.fragment]}
        got = {t.name: tuple(t.shape) for t in m.tensors}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:4]
            return Rejection(Reason.WRONG_SHAPE, f"fragment {m.fragment} tensors differ from the model: {diff}")
        sc = self.cfg.syncer
        if not (0 < m.tokens < messages.MAX_COUNT and 0 < m.steps < messages.MAX_COUNT and
                math.isfinite(m.step_time) and 0 <= m.step_time < 1e6):
            return Rejection(Reason.BAD_METADATA, f"tokens={messages.short(m.tokens, 40)} steps="
                             f"{messages.short(m.steps, 40)} step_time={m.step_time:.6g}: out of range")
        if m.tokens > m.steps * sc.max_tokens_per_step:
            return Rejection(Reason.BAD_METADATA, f"{m.tokens} tokens in {m.steps} steps is more than "
                             f"syncer.max_tokens_per_step={sc.max_tokens_per_step} per step")
        if fragment is not None:
            current = fragment.version
            if m.base_version > current:
                return Rejection(Reason.FUTURE_VERSION, f"base version {m.base_version} > current {current}")
            if m.base_version < current - sc.max_staleness:
                return Rejection(Reason.STALE, f"base version {m.base_version} older than {current} - {sc.max_staleness}")
        return None

    def check_budget(self, m: Manifest, fragment: FragmentState) -> Rejection | None:
        """Why a new contribution may not be accepted into a fragment that has taken in run.token_budget
        tokens (merged, or accepted and merged next): what the global model holds ends within one
        contribution of the budget, however late the learners hear of it. Never asked of a replay."""
        budget, taken = self.cfg.run.token_budget, fragment.tokens_taken()
        if budget is not None and taken >= budget:
            return Rejection(Reason.TOKEN_BUDGET, f"fragment {m.fragment} has taken in {taken:,} tokens of "
                             f"run.token_budget={budget:,}")
        return None

    def check(self, m: Manifest, payload: bytes, *, members: Collection[str], fragment: FragmentState | None
              ) -> fused.EncodedDelta | Rejection:
        """The contribution's deltas as they arrived (norms from the codes, nothing decoded), or why
        it cannot enter a merge."""
        if verdict := self.check_claims(m, members=members, fragment=fragment):
            return verdict
        try:
            messages.verify_payload(m, payload)
            deltas = fused.encoded_delta(m, payload)
        except WireError as err:
            return Rejection(Reason.CHECKSUM if isinstance(err, messages.ChecksumError) else Reason.MALFORMED, str(err))
        bad = [n for n, x in deltas.norms.items() if not math.isfinite(x)]
        if bad:
            return Rejection(Reason.NON_FINITE, f"non-finite values in {bad[:8]}")
        ratio = self.cfg.syncer.max_delta_ratio
        if ratio > 0 and fragment is not None:
            norm, scale = deltas.norm, fragment.budget_scale()  # the parameters change only at a merge
            if not norm <= ratio * scale:
                return Rejection(Reason.NORM_BUDGET, f"delta norm {norm:.4g} > {ratio:g} x max(parameter norm, "
                                 f"sqrt(size)) = {ratio * scale:.4g} (syncer.max_delta_ratio)")
        return deltas
