"""The syncer's decisions, each in its own small module, without a broker, Redis or a store:
intake's rejection reasons, when a round is due and whom its share counts, norm outliers, the
records' spellings, the periodic helper, the lease keeper, rebalancing and claiming, and the learner
registry, on fake clocks and fakes."""

from __future__ import annotations

import dataclasses
import json

import crc32c
import numpy as np
import pytest

from diloco import messages, quantize
from diloco.config import build_config
from diloco.messages import Assembled, ChunkAssembler, Reason
from diloco.plan import Plan, Tensor
from diloco.syncer import fused, rounds
from diloco.syncer import merge as merge_math
from diloco.syncer.intake import Intake, Rejection
from diloco.syncer import shards
from diloco.syncer.ownership import LeaseKeeper, Ownership
from diloco.periodic import Every
from diloco.syncer.policy import QuorumPolicy
from diloco.syncer.records import (Contribution, Status, Where, parse_partition_key, partition_key,
                                   rejection_counter, rejections_by_reason, replay_mismatch)
from diloco.syncer.registry import LearnerRegistry
from diloco.syncer.rounds import FragmentState, Pending

PLAN = Plan((Tensor("w", (2, 3), "float32", 0, "rda"), Tensor("v", (4,), "float32", 1, "rda")), 2)
CFG = build_config({"fragments": {"count": 2}, "regions": [{"name": "us", "learners": 2, "max_learners": 3},
                                                          {"name": "eu", "learners": 2}]})
MEMBERS = set(CFG.learner_ids())


def _fragment(version: int = 3, scale: float = 1.0) -> FragmentState:
    params = {"w": np.full((2, 3), scale, np.float32)}
    opt = merge_math.outer_optimizer(CFG.outer.lr, CFG.outer.momentum, CFG.outer.nesterov)
    return FragmentState(version, params, opt.init(merge_math.as_float32(params)))


def _contribution(value: float = 0.1, **claims):
    claims = {"run": "run", "learner": "us-0", "region": "us", "fragment": 0, "base_version": 3, "tokens": 100,
              "steps": 10, "step_time": 0.1, **claims}
    shapes = claims.pop("shapes", {"w": (2, 3)})
    deltas = {n: np.full(s, value, np.float32) for n, s in shapes.items()}
    _, frames = messages.encode_contribution(deltas=deltas, scheme="fp32", chunk_bytes=1 << 20, **claims)
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    for i, f in enumerate(frames):
        got = asm.add(*messages.parse_frame(f), now=0.0, offset=i)
    assert isinstance(got, Assembled)
    return got.manifest, got.payload


def _verdict(**claims):
    m, payload = _contribution(**claims)
    return Intake(CFG, "run", PLAN).check(m, payload, members=MEMBERS, fragment=_fragment())


@pytest.mark.parametrize("claims, reason", [
    ({"run": "other"}, Reason.WRONG_RUN),
    ({"learner": "mars-0", "region": "mars"}, Reason.UNKNOWN_LEARNER),
    ({"learner": "us-7"}, Reason.UNKNOWN_LEARNER),                 # beyond the region's max_learners
    ({"learner": "eu-0", "region": "us"}, Reason.UNKNOWN_LEARNER),  # published as another region's learner
    ({"fragment": 5}, Reason.UNKNOWN_FRAGMENT),
    ({"shapes": {"w": (3, 2)}}, Reason.WRONG_SHAPE),
    ({"tokens": 10 * (1 << 24) + 1}, Reason.BAD_METADATA),         # more than max_tokens_per_step
    ({"base_version": 4}, Reason.FUTURE_VERSION),
    ({"base_version": 3 - 5}, Reason.STALE),                       # older than max_staleness (4)
    ({"value": float("nan")}, Reason.NON_FINITE),
    ({"value": 1e4}, Reason.NORM_BUDGET),                          # 10 x max(|params|, sqrt(size))
])
def test_intake_names_why_a_contribution_cannot_enter_a_merge(claims, reason):
    verdict = _verdict(**claims)
    assert isinstance(verdict, Rejection) and verdict.reason == reason, verdict
    assert verdict.reason == reason.value and verdict.detail          # a plain string on the wire


def test_intake_accepts_an_honest_contribution_and_a_joiner_within_max_learners():
    for learner in ("us-0", "us-2"):                # us-2 may join (max_learners 3): its delta may come first
        got = _verdict(learner=learner)
        assert isinstance(got, fused.EncodedDelta) and got.norm == pytest.approx(0.1 * np.sqrt(6), rel=1e-6)


def test_one_writer_claiming_more_tokens_per_step_cannot_take_a_rounds_weight():
    """w = tokens^2 / steps: a manifest claiming 100x the tokens of an honest one took ~100% of a merge."""
    honest, liar = (256, 10), (256 * 100, 10)
    tokens = merge_math.bounded_tokens([honest[0], honest[0], liar[0]], [10, 10, 10], 1.5)
    assert tokens == pytest.approx([256, 256, 384])
    w = merge_math.token_weights(tokens, [10, 10, 10])
    assert w[2] < 0.6 and merge_math.bounded_tokens([256, 300], [10, 10], 1.5) == [256, 300]  # honest spread kept
    assert merge_math.bounded_tokens([256, 25600], [10, 10], 0) == [256, 25600]


def test_intake_judges_a_replay_as_it_judges_live_intake():
    """H1 (issue #53): a replay skipped the staleness and norm-budget checks, so whatever a replay
    assembled under a pending id merged unchecked. A pending contribution waits in the round of the
    version it was accepted at (a merge takes the whole round): judged again, the honest one passes."""
    m, payload = _contribution(base_version=3, value=1e4)
    got = Intake(CFG, "run", PLAN).check(m, payload, members=MEMBERS, fragment=_fragment(version=3))
    assert got.reason == Reason.NORM_BUDGET
    m, payload = _contribution(base_version=3)
    assert isinstance(Intake(CFG, "run", PLAN).check(m, payload, members=MEMBERS, fragment=_fragment(version=3)),
                      fused.EncodedDelta)


def test_a_checksum_mismatch_is_said_as_such():
    m, payload = _contribution()
    corrupt = bytearray(payload)
    corrupt[-1] ^= 0xFF
    got = Intake(CFG, "run", PLAN).check(m, bytes(corrupt), members=MEMBERS, fragment=_fragment())
    assert got.reason == Reason.CHECKSUM


def test_a_complete_payload_of_another_length_is_a_checksum_mismatch_as_the_spec_says():
    """docs/wire-format.md: the payload must be exactly total_bytes long and match its CRC-32C, else
    `checksum`; one of another length was rejected `malformed` (issue 53, L4)."""
    m, payload = _contribution()
    for other in (payload[:-1], payload + b"\0"):
        got = Intake(CFG, "run", PLAN).check(m, other, members=MEMBERS, fragment=_fragment())
        assert got.reason == Reason.CHECKSUM and "bytes, manifest says" in got.detail


@pytest.mark.parametrize("scheme", ["int2", "ternary", "topk"])
def test_the_codecs_below_4_bits_are_judged_as_strictly_as_int8(scheme):
    """Honest int2 / ternary / topk deltas enter with the norm of what they decode to; a topk block
    whose indices repeat (no encoder writes that, and it would add one value twice) is malformed, even
    re-signed, and so is a ternary byte past five base-3 digits (243..255); a ternary row scale that
    is not finite is non_finite, whatever its codes."""
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    plan = Plan((Tensor("v", (300,), "float32", 0, "rda"),), 1)
    _, frames = messages.encode_contribution(run="run", learner="us-0", region="us", fragment=0, base_version=3,
                                             tokens=100, steps=10, step_time=0.1, deltas={"v": x}, scheme=scheme,
                                             chunk_bytes=1 << 20)
    m = messages.Manifest.from_header(messages.parse_frame(frames[0])[0])
    payload = b"".join(bytes(messages.parse_frame(f)[1]) for f in frames[1:])
    intake = Intake(CFG, "run", plan)
    frag = FragmentState(3, {"v": np.ones(300, np.float32)}, None)
    got = intake.check(m, payload, members=MEMBERS, fragment=frag)
    assert isinstance(got, fused.EncodedDelta)
    assert got.norm == pytest.approx(np.linalg.norm(quantize.roundtrip(x, scheme)), rel=1e-6)
    if scheme == "topk":
        bad = bytearray(payload)
        bad[4 * 2 + 1] = bad[4 * 2]                                   # block 0's first two indices equal
        forged = dataclasses.replace(m, crc32c=crc32c.crc32c(bytes(bad)))
        verdict = intake.check(forged, bytes(bad), members=MEMBERS, fragment=frag)
        assert verdict.reason == Reason.MALFORMED and "strictly increasing" in verdict.detail
    if scheme == "ternary":
        def judged(bad: bytearray):
            forged = dataclasses.replace(m, crc32c=crc32c.crc32c(bytes(bad)))
            return intake.check(forged, bytes(bad), members=MEMBERS, fragment=frag)

        for value in (243, 255):
            bad = bytearray(payload)
            bad[4 + 7] = value                                            # the one row's eighth byte
            verdict = judged(bad)
            assert verdict.reason == Reason.MALFORMED and f"byte 7 is {value}" in verdict.detail
        for scale in (np.inf, np.nan):
            bad = bytearray(payload)
            bad[:4] = np.float32(scale).tobytes()
            assert judged(bad).reason == Reason.NON_FINITE


def _pending(learner: str, base: int, arrival: float, norm: float = 1.0, cid: str | None = None) -> Pending:
    m, payload = _contribution(learner=learner, region=learner.split("-")[0], base_version=base,
                               value=norm / np.sqrt(6))
    c = Contribution.accepted(m, Where("t", 0, 0), arrival)
    c = dataclasses.replace(c, id=cid or f"{learner}-{base}-{arrival}")
    return Pending(c, fused.encoded_delta(m, payload))


POLICY = QuorumPolicy(quorum=2, overlap_steps=8, grace_gamma=0.5, grace_max_s=3.0)


def _due(st, live, now=10.0, fresh=True):
    return rounds.due(POLICY, st.version, st.arrivals(), live=live, present=live, now=now, step_time_s=0.1,
                      sync_time_s=0.0, quorum_of_fresh=fresh)


def test_late_deltas_do_not_make_a_quorum_of_fresh_ones():
    st = _fragment(version=3)
    for c in (_pending("us-0", 2, 1.0), _pending("us-1", 2, 1.0)):          # both a version late
        st.round[c.contribution.id] = c
    live = {"us-0", "us-1", "eu-0", "eu-1"}
    assert not _due(st, live).close and _due(st, live).reason == "waiting_for_quorum"
    assert _due(st, live, fresh=False).close                                 # without it they close a round
    fresh = _pending("eu-0", 3, 9.0)
    st.round[fresh.contribution.id] = fresh
    assert not _due(st, live).close                                          # one fresh learner is not K = 2
    st.round["x"] = _pending("eu-1", 3, 9.5)
    assert _due(st, live, now=9.5).reason == "grace"                         # two fresh: the grace window runs
    assert _due(st, live, now=20.0).close                                    # and then the round closes
    assert _due(st, set()).close                                             # nobody left to train: late ones close it


def test_a_round_waits_for_a_payload_a_replay_has_not_brought_back():
    st = _fragment()
    assert _due(st, {"us-0"}) is None and not st.awaiting_payloads()        # nothing to close
    st.round["a"] = dataclasses.replace(_pending("us-0", 3, 1.0), deltas=None)
    assert st.awaiting_payloads()
    st.round["a"].deltas = _pending("us-0", 3, 1.0).deltas
    assert not st.awaiting_payloads() and _due(st, {"us-0"}).close


def test_a_rounds_share_counts_finished_learners_but_not_silent_ones():
    registry = {"us-0": {"status": "finished"}, "us-1": {"status": "silent"}, "eu-0": {"status": "alive"}}
    members = rounds.members({"eu-0", "eu-1"}, {"eu-0"}, registry)
    assert members == {"us-0", "eu-0", "eu-1"}
    assert merge_math.round_share(1, len(members)) == pytest.approx(1 / 3)
    one = [_pending("eu-0", 3, 0.0)]
    assert rounds.partial_share(one, {"eu-0", "eu-1"}, registry, scale=True) == pytest.approx(1 / 3)
    assert rounds.partial_share(one, {"eu-0", "eu-1"}, registry, scale=False) == 1.0


def test_norm_outliers_are_those_far_above_the_median():
    contribs = [_pending("us-0", 3, 0, 1.0), _pending("us-1", 3, 0, 1.2), _pending("eu-0", 3, 0, 50.0)]
    out = rounds.norm_outliers(contribs, factor=10.0)
    assert [c.contribution.learner for c, _, _ in out] == ["eu-0"]
    assert out[0][2] == pytest.approx(1.2, rel=1e-4)                        # the median
    assert rounds.norm_outliers(contribs, factor=0.0) == [] and rounds.norm_outliers(contribs[:2], 1.0) == []


OUTLIERS_CFG = build_config({"fragments": {"count": 2}, "syncer": {"norm_outlier_factor": 10.0},
                             "regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2}]})


def _round(*contribs: Pending) -> FragmentState:
    st = _fragment()
    st.round.update({c.contribution.id: c for c in contribs})
    return st


def test_closing_a_round_sets_its_norm_outliers_aside_and_merges_the_rest_with_their_share():
    st = _round(_pending("us-1", 3, 0, 1.2), _pending("eu-0", 3, 0, 50.0), _pending("us-0", 3, 0, 1.0))
    live = {"us-0", "us-1", "eu-0", "eu-1"}
    out = rounds.close(OUTLIERS_CFG, PLAN, st, 0, live=live, registry={})
    assert [(o.pending.contribution.learner, round(o.median, 3)) for o in out.outliers] == [("eu-0", 1.2)]
    assert [c.contribution.learner for c in out.merged] == ["us-0", "us-1"]          # in canonical order
    assert out.share == pytest.approx(2 / 4) and out.failure is None                 # 2 of the 4 live learners
    alone = rounds.close_round(OUTLIERS_CFG, PLAN, st, 0, out.merged, out.share)
    assert out.closed.update == alone.update and list(out.closed.weights) == list(alone.weights)


def test_a_round_of_nothing_but_outliers_or_whose_merge_fails_closes_without_a_version(monkeypatch):
    st = _round(_pending("us-0", 3, 0, 1.0), _pending("us-1", 3, 0, 1.0), _pending("eu-0", 3, 0, 2.0))
    spare = build_config({"fragments": {"count": 2}, "syncer": {"norm_outlier_factor": 0.5},
                          "regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2}]})
    out = rounds.close(spare, PLAN, st, 0, live=set(), registry={})                  # every norm > 0.5 x median
    assert len(out.outliers) == 3 and out.merged == [] and out.closed is None and out.failure is None
    monkeypatch.setattr(fused, "merge", lambda *a, **kw: {"w": np.full((2, 3), np.nan, np.float32)})
    out = rounds.close(CFG, PLAN, st, 0, live=set(), registry={})
    assert out.closed is None and isinstance(out.failure, FloatingPointError) and len(out.merged) == 3


def test_a_round_merges_in_one_order_whatever_order_it_arrived_in():
    a, b, c = _pending("us-1", 3, 0, cid="z"), _pending("eu-0", 3, 1, cid="y"), _pending("us-1", 2, 2, cid="x")
    assert [p.contribution.id for p in rounds.in_canonical_order([a, b, c])] == ["y", "x", "z"]
    st = _fragment()
    one = rounds.close_round(CFG, PLAN, st, 0, rounds.in_canonical_order([a, b, c]), 0.75)
    two = rounds.close_round(CFG, PLAN, st, 0, rounds.in_canonical_order([c, a, b]), 0.75)
    assert one.update == two.update


def test_statuses_and_partition_keys_have_one_spelling():
    assert Status.parse(Status.pending(3)) == Status("pending", fragment=3)
    assert Status.parse(Status.applied(1, 7)) == Status("applied", fragment=1, version=7)
    assert Status.parse(Status.rejected(Reason.STALE)) == Status("rejected", reason="stale")
    assert Status.parse("") is None and Status.parse("pending:x") is None
    assert [Status.kind_of(s) for s in (Status.pending(3), Status.applied(1, 7), Status.rejected("stale"))] == [
        "pending", "applied", "rejected"]
    counters = {"rejected": 3, rejection_counter(Reason.STALE): 2, rejection_counter("norm_outlier"): 1, "applied": 4}
    assert rejections_by_reason(counters) == {"stale": 2, "norm_outlier": 1}
    assert parse_partition_key(partition_key(("diloco.r.fragments.us-east", 12))) == ("diloco.r.fragments.us-east", 12)


def test_where_is_named_by_its_partition_key_and_kept_as_a_json_list():
    where = Where("diloco.r.fragments.us-east", 12, 340)
    assert Where(*parse_partition_key(partition_key(where.tp)), where.offset) == where  # a dropped set's
    assert json.loads(json.dumps(where)) == ["diloco.r.fragments.us-east", 12, 340]     # a merge record's


def test_a_contribution_is_kept_in_redis_as_the_same_json_text():
    m, _ = _contribution(cursor=(40, 50))
    c = Contribution.accepted(m, Where("diloco.r.fragments.us", 0, 17), arrival=12.5)
    assert (c.learner, c.base_version, c.tokens, c.steps, c.total_bytes, c.cursor) == ("us-0", 3, 100, 10,
                                                                                      m.total_bytes, (40, 50))
    stored = {"id": m.id, "learner": "us-0", "region": "us", "fragment": 0, "base_version": 3, "tokens": 100,
              "steps": 10, "step_time": 0.1, "bytes": m.total_bytes, "arrival": 12.5,
              "topic": "diloco.r.fragments.us", "partition": 0, "offset": 17, "created": m.created, "cursor": [40, 50]}
    assert json.dumps(c.meta()) == json.dumps(stored)                       # the same keys in the same order
    assert Contribution.from_meta(json.loads(json.dumps(stored))) == c
    before_cursors = {k: v for k, v in stored.items() if k != "cursor"}
    assert Contribution.from_meta(before_cursors).cursor is None


def test_a_periodic_task_is_due_once_per_period():
    now = [100.0]
    every = Every(1.0, lambda: now[0])
    assert every.due() and not every.due()
    now[0] += 0.5
    assert not every.due() and every.due(force=True)
    now[0] += 1.0
    assert every.due()
    passes = Every(10.0)                      # no clock: a loop passes the time it read once per pass
    assert [passes.due(t) for t in (0.0, 9.9, 10.0, 15.0, 20.0)] == [True, False, True, False, True]


class _Leases:
    def __init__(self):
        self.held, self.holder = {0, 1}, None

    def join(self, shard, member, ttl):
        return self.holder

    def renew(self, p, member, ttl):
        return p in self.held


def test_the_lease_keeper_reports_lost_leases_and_a_displaced_shard_and_stops_when_stuck(monkeypatch):
    leases, owned = _Leases(), [0, 1, 2]
    keeper = LeaseKeeper(leases, 0, "0:me", 3.0, lambda: list(owned), stuck_after_s=5.0)
    keeper.renew()
    assert keeper.lost == {2} and not keeper.displaced
    leases.holder = "0:other"
    keeper.renew()
    assert keeper.displaced
    keeper.lost.clear()
    keeper.alive_at -= 10.0                       # the main loop made no progress for longer than stuck_after_s
    leases.held = set()
    keeper.renew()
    assert keeper.lost == set()                   # a stuck loop lets its leases expire rather than renew them


def test_a_rebalance_drops_lost_leases_hands_back_homes_and_claims_fosters_only_once_settled():
    # 4 fragments, 2 shards; shard 1 is down, so shard 0 fosters its fragments 1 and 3
    alone = shards.moves(0, 4, 2, live=set(), held=set(), lost=set(), claiming=True, settled=False)
    assert alone == shards.Moves(drop=[], release=[], claim=[0, 2], coordinator=True)  # its homes only, at once
    settled = shards.moves(0, 4, 2, live=set(), held={0, 2}, lost=set(), claiming=True, settled=True)
    assert settled.claim == [1, 3]
    back = shards.moves(0, 4, 2, live={1}, held={0, 1, 2, 3}, lost={2}, claiming=True, settled=True)
    assert back.drop == [2] and back.release == [1, 3] and back.claim == [2]  # lost: drop it, then try again
    stopping = shards.moves(1, 4, 2, live={0}, held={1}, lost=set(), claiming=False, settled=True)
    assert stopping.claim == [] and stopping.release == [] and not stopping.coordinator
    with pytest.raises(ValueError, match="3 partitions per region topic for 4 fragments"):
        shards.check_layout(3, 4, 0, 1)
    with pytest.raises(ValueError, match=r"shard 2 is not in 0..1"):
        shards.check_layout(4, 4, 2, 2)


class _LeaseTable:
    """Redis's leases, memberships and fencing epochs as syncer/state.py keeps them, in memory."""

    def __init__(self):
        self.owner, self.epoch, self.members, self.live = {}, {}, {}, set()

    def join(self, shard, member, ttl):
        other = self.members.get(shard)
        if other in (None, member):
            self.members[shard] = member
            return None
        return other

    def leave(self, shard, member):
        if self.members.get(shard) == member:
            del self.members[shard]

    def live_shards(self, shards):
        return self.live | set(self.members)

    def claim(self, p, shard, member, ttl):
        if self.owner.get(p) not in (None, member):
            return 0, self.owner[p]
        previous, self.owner[p] = self.owner.get(p), member
        self.epoch[p] = self.epoch.get(p, 0) + 1
        return self.epoch[p], previous

    def renew(self, p, member, ttl):
        return self.owner.get(p) == member

    def release(self, p, member):
        if self.owner.get(p) == member:
            del self.owner[p]


def test_ownership_claims_free_leases_fences_by_epoch_and_hands_everything_back_on_leave():
    table, now = _LeaseTable(), [0.0]
    a = Ownership(table, 0, 2, 4, ttl_s=3.0, stuck_after_s=10.0, clock=lambda: now[0])
    a.stand_by(stopping=lambda: False)
    table.owner[2] = "1:other"                                     # fragment 2 is held by a live shard 1
    moves = a.moves(claiming=True)
    assert moves.claim == [0, 2] and moves.coordinator             # shard 1 is not live yet: 2 is 0's home
    taken = a.claim(moves.claim)
    assert taken == [(0, 1, None)] and a.fence(0) == {0: 1}        # 2's lease is not free: not taken
    now[0] += 3.0                                                  # settled: fosters 1 and 3 too
    assert a.moves(claiming=True).claim == [1, 2, 3]
    a.claim([1, 3])
    table.owner[3] = "1:other"                                     # 3's lease lapsed and went elsewhere
    moves = a.moves(claiming=True)
    assert moves.drop == [3]
    a.forget(3)
    assert sorted(a.epochs) == [0, 1]
    a.leave(release=True)
    assert not table.owner.keys() - {2, 3} and 0 not in table.members  # its leases and membership are free


def test_a_second_process_of_a_shard_stands_by_until_the_first_leaves_or_it_is_asked_to_stop():
    table = _LeaseTable()
    table.members[0] = "0:first"
    b = Ownership(table, 0, 1, 2, ttl_s=0.03, stuck_after_s=10.0)
    with pytest.raises(SystemExit):
        b.stand_by(stopping=lambda: True)
    calls = []

    def first_leaves():
        calls.append(1)
        if len(calls) == 2:
            table.leave(0, "0:first")
        return False
    b.stand_by(stopping=first_leaves)
    assert table.members[0] == b.member and len(calls) == 2


class _Registry:
    """The coordinator's Redis writes of the learner registry, recorded."""

    def __init__(self):
        self.beats, self.dropped = {}, []

    def heartbeat(self, lid, hb):
        self.beats[lid] = hb

    def drop_learner(self, lid, hb):
        self.dropped.append(lid)


def _beat(lid: str, **fields) -> dict:
    return messages.parse_event(messages.event("heartbeat", run="run", source="learner", learner=lid,
                                               region=lid.split("-")[0], incarnation="i0", step=1, **fields))


def test_a_learner_that_stops_beating_goes_silent_then_is_dropped_each_said_once():
    now, said = [100.0], []
    reg = LearnerRegistry(CFG, _Registry(), lambda kind, **f: said.append((kind, f.get("learner"))), lambda: now[0])
    reg.coordinator = True
    reg.heard(_beat("us-0"))
    reg.heard(_beat("us-1", state="finished"))
    assert reg.by_status() == {"alive": 1, "silent": 0, "finished": 1, "left": 0, "dropped": 0}
    assert said == [("learner_joined", "us-0"), ("learner_finished", "us-1")]
    assert reg.live() == MEMBERS - {"us-1"}     # never heard of: waited for; finished: not
    now[0] += CFG.syncer.silent_after_s + 0.1
    reg.check()
    reg.check()
    assert reg["us-0"]["status"] == "silent" and "us-0" not in reg.live() and "us-0" in reg.present()
    now[0] += CFG.syncer.drop_after_s
    reg.check()
    assert reg["us-0"]["status"] == "dropped" and "us-0" not in reg.present() and reg.state.dropped == ["us-0"]
    assert [k for k, lid in said if lid == "us-0"] == ["learner_joined", "learner_silent", "learner_dropped"]
    reg.heard(_beat("us-0"))                    # back: alive again, and said so
    assert reg["us-0"]["status"] == "alive" and said[-1] == ("learner_joined", "us-0")


def test_a_follower_shard_keeps_its_own_view_and_says_nothing():
    now = [0.0]
    reg = LearnerRegistry(CFG, None, emit=None, clock=lambda: now[0])   # it must touch neither
    reg.heard(_beat("eu-1"))
    now[0] += CFG.syncer.silent_after_s + 0.1
    reg.check()
    assert reg["eu-1"]["status"] == "silent" and reg.by_status()["silent"] == 1


class _LaggingShard:
    """What syncer/service.run drives, for its drain loop alone: each step is a second on a fake
    clock, and the shard catches up with the log after `lag_steps` steps (never when None)."""

    def __init__(self, lag_steps: int | None, drain_timeout_s: float):
        self.cfg = build_config({"syncer": {"drain_timeout_s": drain_timeout_s}})
        self.now, self.steps, self.lag_steps, self.stopping, self.finished = 0.0, 0, lag_steps, True, None
        nothing = type("Nothing", (), {"__getattr__": lambda self, name: lambda *a, **k: None})()
        self.ownership = type("O", (), {"keeper": nothing})()
        self.producer = self.consumer = nothing

    def start(self):
        pass

    def clock(self) -> float:
        return self.now

    def step(self):
        self.steps += 1
        self.now += 1.0

    def caught_up(self) -> bool:
        return self.lag_steps is not None and self.steps >= self.lag_steps

    def finish(self, *, caught_up: bool):
        self.finished = caught_up


@pytest.mark.parametrize("lag_steps, timeout_s, caught_up", [(3, 120.0, True), (90, 120.0, True),
                                                             (None, 120.0, False), (90, 30.0, False)])
def test_a_stopping_shard_reads_until_caught_up_however_far_behind_within_its_drain_timeout(lag_steps, timeout_s,
                                                                                             caught_up):
    from diloco.syncer import service
    shard = _LaggingShard(lag_steps, timeout_s)
    service.run(shard)
    assert shard.finished is caught_up
    if caught_up:   # it stops once caught up for the settle time, not at the timeout
        assert shard.steps <= lag_steps + service.DRAIN_SETTLE_S + 1
    else:           # and gives up (saying so) at the timeout, not before
        assert timeout_s <= shard.now <= timeout_s + 2


def test_the_relay_looks_at_the_outbox_after_this_process_wrote_to_it_and_once_a_second_otherwise():
    from diloco.syncer.relay import OutboxRelay

    class Outbox:
        outbox_writes, peeks, records = 0, 0, []

        def outbox_peek(self):
            self.peeks += 1
            return list(self.records)

        def outbox_trim(self, sent):
            del self.records[:len(sent)]
            return True

    class Sent:
        def get(self, timeout):
            return None

    sent = []
    producer = type("P", (), {"send": lambda self, topic, value, partition: sent.append(value) or Sent(),
                              "flush": lambda self, timeout: None})()
    now = [0.0]
    state = Outbox()
    relay = OutboxRelay(state, producer, type("B", (), {"up": True})(), clock=lambda: now[0])
    relay.relay(only_if_written=True)
    assert state.peeks == 1                                       # the first look always happens
    relay.relay(only_if_written=True)
    assert state.peeks == 1                                       # nothing written since: no round trip
    state.records, state.outbox_writes = ['{"topic": "t", "partition": 0, "value": "e1"}'], 1
    relay.relay(only_if_written=True)
    assert sent == [b"e1"] and state.records == [] and state.peeks == 3   # relayed, then seen empty
    state.records = ['{"topic": "t", "partition": 0, "value": "e2"}']    # another shard's record
    relay.relay(only_if_written=True)
    assert sent == [b"e1"]
    now[0] = 1.5                                                  # a second later it is looked at anyway
    relay.relay(only_if_written=True)
    assert sent == [b"e1", b"e2"]
    relay.relay()                                                 # an explicit relay always looks
    assert state.peeks == 6


def test_a_replay_is_bound_to_the_place_offset_and_claims_redis_recorded():
    """H1 (issue #53): a replay took whatever set of a pending id completed first, from any topic."""
    m, _ = _contribution()
    here = Where("pfx.run.fragments.us", 0, 17)
    recorded = Contribution.from_meta(json.loads(json.dumps(Contribution.accepted(m, here, arrival=5.0).meta())))
    assert replay_mismatch(recorded, m, here) is None                   # the record accepted, read back from Redis
    for elsewhere in (Where("pfx.run.fragments.eu", 0, 17), Where(here.topic, 1, 17), Where(here.topic, 0, 40)):
        why = replay_mismatch(recorded, m, elsewhere)
        assert f"accepted from {here.topic}|0@17" in why and partition_key(elsewhere.tp) in why
    other = dataclasses.replace(m, learner="us-1", tokens=m.tokens + 1)
    assert "['learner', 'tokens']" in replay_mismatch(recorded, other, here)
