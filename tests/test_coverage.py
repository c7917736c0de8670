"""The coverage ledger (diloco.coverage), the manifest's data cursor and where a restart resumes:
pure logic on plain records, no services."""

from __future__ import annotations

import numpy as np
import pytest

from diloco import coverage, messages, resume
from diloco.messages import WireError
from diloco.progress import Progress, check_heartbeat_claims


def _merge(fragment, *contribs):
    """A merge record of contributions (learner, tokens, cursor)."""
    return {"fragment": fragment, "learners": [c[0] for c in contribs], "tokens": sum(c[1] for c in contribs),
            "tokens_each": [c[1] for c in contribs], "cursors": [c[2] for c in contribs]}


def test_extra_coverage_counts_each_copy_past_the_first():
    assert coverage.extra_coverage([(0, 10, 5.0)]) == 0
    assert coverage.extra_coverage([(0, 10, 5.0), (10, 20, 5.0)]) == 0            # adjacent: no overlap
    assert coverage.extra_coverage([(0, 10, 5.0), (6, 20, 5.0)]) == 4 * 5.0        # steps 6..9 twice
    assert coverage.extra_coverage([(0, 10, 1.0), (0, 10, 1.0), (0, 10, 1.0)]) == 20  # three copies: two extra
    assert coverage.extra_coverage([(0, 4, 2.0), (2, 8, 3.0)]) == 2 * 2.0           # the denser one counts once


def test_a_clean_run_merges_each_step_of_each_fragment_once():
    # 2 fragments, a learner of 100 tokens per step: fragment 0 sent at steps 5 and 10, fragment 1 at 7 and 12
    merges = [_merge(0, ("us-0", 500, [0, 5])), _merge(1, ("us-0", 700, [0, 7])), _merge(0, ("us-0", 500, [5, 10])),
              _merge(1, ("us-0", 500, [7, 12]))]
    led = coverage.ledger(merges, fragments=2, trained={"us-0": 1200}, handed_in={"us-0": 2400},
                          epochs=lambda lid, end: end / 100)
    row = led["learners"]["us-0"]
    assert row["tokens_merged"] == 1100 and row["tokens_twice"] == 0 and row["tokens_lost"] == 100
    assert row["lost_not_handed_in"] == 0 and row["lost_not_merged"] == 100   # fragment 0's steps 10..12 unmerged
    assert row["cursor_end"] == 12 and row["epoch"] == 0.12 and row["merged_contributions"] == 4
    assert row["tokens_missed"] == 0


def test_steps_no_merged_contribution_covers_are_missed():
    # fragment 0: steps 0..5 merged, 5..9 killed before the send, resumed at 9; fragment 1 covered throughout
    merges = [_merge(0, ("us-0", 500, [0, 5])), _merge(0, ("us-0", 300, [9, 12])), _merge(1, ("us-0", 1200, [0, 12]))]
    row = coverage.ledger(merges, fragments=2, trained={"us-0": 1200})["learners"]["us-0"]
    assert row["tokens_missed"] == 4 * 100 / 2 and row["tokens_twice"] == 0
    assert coverage.gaps([(0, 5, 1.0), (9, 12, 1.0)]) == [(5, 9)] and coverage.gaps([(2, 4, 1.0)]) == [(0, 2)]


def test_a_restart_that_re_reads_handed_in_steps_shows_as_twice():
    merges = [_merge(0, ("us-0", 1000, [0, 10])), _merge(0, ("us-0", 600, [4, 10]))]   # resumed at step 4
    row = coverage.ledger(merges, fragments=1, trained={"us-0": 1600})["learners"]["us-0"]
    assert row["tokens_twice"] == 600 and row["tokens_merged"] == 1600


def test_merge_records_without_cursors_still_count_tokens():
    old = {"fragment": 0, "learners": ["a", "b"], "tokens": 300}      # written before tokens_each and cursors
    row = coverage.ledger([old], fragments=1, trained={"a": 150, "b": 150})["learners"]
    assert row["a"]["tokens_merged"] == 150 and row["a"]["without_cursor"] == 1 and row["a"]["cursor_end"] is None


def _manifest(**over):
    m, _ = messages.encode_contribution(run="r", learner="us-0", region="us", fragment=0, base_version=0, tokens=64,
                                        steps=4, step_time=0.1, deltas={"w": np.zeros(3, np.float32)}, scheme="int8",
                                        chunk_bytes=1 << 20, cursor=(8, 12))
    return m.to_header() | over


def test_the_cursor_travels_in_the_manifest_and_is_checked():
    h = _manifest()
    assert h["cursor"] == [8, 12] and messages.Manifest.from_header(h).cursor == (8, 12)
    del h["cursor"]
    assert messages.Manifest.from_header(h).cursor is None      # optional: a client may leave it out
    for bad, why in [([8, 13], "spans 5 steps"), ([12, 8], "spans -4"), ([8], "two integers"),
                     ([8.0, 12.0], "two integers"), ([True, 5], "two integers"), ([-4, 0], "two integers"),
                     ("8-12", "two integers"), ([2**53, 2**53 + 4], "two integers")]:
        with pytest.raises(WireError, match=why):
            messages.Manifest.from_header(_manifest(cursor=bad))


def test_a_restart_resumes_past_the_furthest_cursor_the_syncer_accepted_pending_or_merged():
    merges = [_merge(0, ("us-0", 500, [0, 5]), ("eu-0", 500, [0, 6])), _merge(1, ("us-0", 700, [0, 7]))]
    pending = [{"learner": "us-0", "fragment": 0, "cursor": [5, 9]},   # accepted, not merged yet: it will be
               {"learner": "eu-0", "fragment": 1, "cursor": None}]     # kept before cursors existed: moves nothing
    ends = resume.furthest_ends(coverage.merged_contributions(merges))
    assert ends == {"us-0": 7, "eu-0": 6}
    assert resume.furthest_ends(pending, into=dict(ends)) == {"us-0": 9, "eu-0": 6} and ends["us-0"] == 7
    assert resume.resume_step(9, schedule_end=50) == 9
    assert resume.resume_step(None, default=3, schedule_end=50) == 3          # a joiner with no record yet
    assert resume.resume_step(60, schedule_end=50) == 50


def test_a_record_with_a_malformed_cursor_moves_no_resume_point():
    bad = [{"learner": "us-0", "cursor": c} for c in ([9, 3], [0, 2 ** 60], "0-9", [0.0, 9.0], [True, 9], [1, 2, 3])]
    assert resume.furthest_ends([*bad, {"learner": 7, "cursor": [0, 9]}, {"cursor": [0, 9]}]) == {}


def test_what_a_beat_says_it_handed_in_only_makes_a_restart_wait_for_the_records():
    prog = Progress()
    prog.apply(messages.parse_event(messages.event("heartbeat", run="r", source="learner", learner="us-0",
                                                   incarnation="a", step=7, handed_in_to=5, handed_in_tokens=900)))
    claimed = prog.handed_in["us-0"]
    assert claimed == 5 and not resume.settled(None, claimed) and not resume.settled(4, claimed)
    assert resume.settled(5, claimed) and resume.settled(None, 0)


def test_a_beat_cannot_claim_it_handed_in_past_its_step():
    from diloco.config import build_config

    cfg = build_config({})
    lid = cfg.learner_ids()[0]
    check_heartbeat_claims(cfg, {"learner": lid, "step": 5, "handed_in_to": 5})
    with pytest.raises(ValueError, match="handed in steps up to 9"):
        check_heartbeat_claims(cfg, {"learner": lid, "step": 5, "handed_in_to": 9})


def test_a_forged_acceptance_moves_no_resume_point():
    """An acceptance with cursor [0, learner_steps] is well formed, so the runner takes it in (the table,
    the counts): it made the learner's next restart start at its last step and train nothing. It is
    only a claim: the resume point comes from the syncer's records, which hold nothing of it."""
    from diloco.config import build_config
    from diloco.progress import check_accepted_cursor

    cfg = build_config({})
    lid = cfg.learner_ids()[0]
    end = cfg.learner_steps(lid)
    forged = messages.parse_event(messages.event("contribution_accepted", run="r", source="syncer", id="f", learner=lid,
                                                 fragment=0, cursor=[0, end]))
    check_accepted_cursor(cfg, forged)
    prog = Progress()
    prog.apply(forged)
    assert prog.handed_in[lid] == end and prog.accepted == 1
    records = resume.furthest_ends([{"learner": lid, "cursor": [0, 12]}]).get(lid)  # what the syncer accepted
    assert resume.resume_step(records, schedule_end=end) == 12 and not resume.settled(records, prog.handed_in[lid])
    for bad in ([0, cfg.learner_steps(lid) + 1], [5, 3], [-1, 2], "0-5", [0.0, 5.0], [True, 5]):
        with pytest.raises(ValueError, match="cursor"):
            check_accepted_cursor(cfg, {"learner": lid, "cursor": bad})
    with pytest.raises(ValueError, match="not one of this run's"):
        check_accepted_cursor(cfg, {"learner": "mars-0", "cursor": [0, 1]})


def test_the_ledger_counts_every_step_of_the_schedule_no_contribution_covers_as_missed():
    """A forged beat at its schedule's end made us-0's restart skip steps 10..50; the ledger measured up to
    the furthest merged cursor, so none of it showed. Measured against the schedule, whatever any event
    claimed: 40 steps of 100 tokens on each fragment, and a fragment with nothing merged misses all 50."""
    merges = [_merge(0, ("us-0", 1000, [0, 10])), _merge(1, ("us-0", 1000, [0, 10]))]
    led = coverage.ledger(merges, fragments=2, trained={"us-0": 5000}, schedule={"us-0": (0, 50)})
    assert led["learners"]["us-0"]["tokens_missed"] == 40 * 100
    led = coverage.ledger(merges[:1], fragments=2, trained={"us-0": 5000}, schedule={"us-0": (0, 50)})
    assert led["learners"]["us-0"]["tokens_missed"] == (40 + 50) * 100 // 2
    # without a schedule (diloco report), as before: up to the furthest merged cursor
    assert coverage.ledger(merges, fragments=2, trained={"us-0": 5000})["learners"]["us-0"]["tokens_missed"] == 0


def test_a_joiners_schedule_starts_at_its_join_step_and_one_asked_to_stop_ends_at_its_hand_in():
    # eu-2 joined at step 30 and trained to 50 cleanly (issue 53 M10: counted from 0, it missed 30 steps)
    merges = [_merge(p, ("eu-2", 2000, [30, 50])) for p in range(2)]
    led = coverage.ledger(merges, fragments=2, trained={"eu-2": 2000}, schedule={"eu-2": (30, 50)})
    assert led["learners"]["eu-2"]["tokens_missed"] == 0 and led["learners"]["eu-2"]["tokens_merged"] == 2000
    # one the runner asked to stop (end None) is measured up to what it handed in; a gap before still counts
    merges = [_merge(0, ("us-0", 500, [0, 5]), ), _merge(0, ("us-0", 500, [10, 15])), _merge(1, ("us-0", 1500, [0, 15]))]
    led = coverage.ledger(merges, fragments=2, trained={"us-0": 1500}, schedule={"us-0": (0, None)})
    assert led["learners"]["us-0"]["tokens_missed"] == 5 * 100 // 2


def test_gaps_within_a_span():
    iv = [(2, 4, 1.0), (6, 8, 1.0)]
    assert coverage.gaps(iv) == [(0, 2), (4, 6)]
    assert coverage.gaps(iv, 3, 10) == [(4, 6), (8, 10)]
    assert coverage.gaps(iv, 0, 5) == [(0, 2), (4, 5)]
    assert coverage.gaps([], 30, 50) == [(30, 50)]


def test_a_restart_waits_for_every_partition_the_dead_learner_wrote():
    ends = {("t", 0): 5, ("t", 1): 0, ("t", 2): 3}
    assert resume.read_up_to({("t", 0): 5, ("t", 2): 4}, ends)       # a partition never written needs no position
    assert not resume.read_up_to({("t", 0): 4, ("t", 2): 9}, ends)   # one record of partition 0 unread
    assert not resume.read_up_to({("t", 0): 5}, ends)                # partition 2 never read
