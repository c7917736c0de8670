import pytest

from diloco.syncer.policy import QuorumPolicy, decide, grace_window

P = QuorumPolicy(quorum=2, overlap_steps=10, grace_gamma=0.5, grace_max_s=3.0)


def test_grace_is_half_the_remaining_overlap_slack_clamped():
    # slack = 10 * 0.5 - 1 - 0.5 = 3.5 -> 1.75
    assert grace_window(P, step_time_s=0.5, time_to_quorum_s=1.0, sync_time_s=0.5) == pytest.approx(1.75)
    assert grace_window(P, step_time_s=0.1, time_to_quorum_s=2.0, sync_time_s=0.5) == 0.0   # no slack left
    assert grace_window(P, step_time_s=10, time_to_quorum_s=0, sync_time_s=0) == 3.0        # capped


def test_round_waits_below_quorum_however_long():
    d = decide(P, [0.0], now=1e6, expected=4, step_time_s=0.5, sync_time_s=0.0)
    assert not d.close and d.reason == "waiting_for_quorum"
    assert not decide(P, [], now=5, expected=4, step_time_s=0.5, sync_time_s=0).close


def test_round_closes_when_grace_after_quorum_expires():
    arrivals = [10.0, 11.0]            # quorum at 11, time to quorum 1 -> grace 0.5*(5-1-0)=2 -> deadline 13
    open_ = decide(P, arrivals, now=12.9, expected=4, step_time_s=0.5, sync_time_s=0.0)
    assert not open_.close and open_.reason == "grace" and open_.deadline == pytest.approx(13.0)
    closed = decide(P, arrivals, now=13.0, expected=4, step_time_s=0.5, sync_time_s=0.0)
    assert closed.close and closed.reason == "grace_expired"


def test_round_closes_at_once_when_every_live_learner_is_in():
    d = decide(P, [3.0, 1.0, 2.0], now=3.0, expected=3, step_time_s=0.5, sync_time_s=0.0)
    assert d.close and d.reason == "all_arrived"


def test_arrival_order_does_not_matter():
    a = decide(P, [11.0, 10.0, 30.0], now=12.0, expected=5, step_time_s=0.5, sync_time_s=0.0)
    b = decide(P, [10.0, 30.0, 11.0], now=12.0, expected=5, step_time_s=0.5, sync_time_s=0.0)
    assert a == b


def test_zero_grace_closes_at_quorum():
    sync = QuorumPolicy(quorum=3, overlap_steps=0, grace_gamma=0.0, grace_max_s=0.0)
    assert not decide(sync, [0.0, 1.0], now=100, expected=4, step_time_s=1, sync_time_s=0).close
    assert decide(sync, [0.0, 1.0, 2.0], now=2.0, expected=4, step_time_s=1, sync_time_s=0).close


def test_the_quorum_shrinks_to_the_learners_still_in_the_run_not_to_the_live_ones():
    """K = 2, one learner left for good: the last one's round closes alone. A silent learner is
    still a member (it may come back), so K keeps waiting for it."""
    assert decide(P, [0.0], now=0.0, expected=1, step_time_s=0.5, sync_time_s=0.0, members=1).close
    assert not decide(P, [0.0], now=1e6, expected=1, step_time_s=0.5, sync_time_s=0.0, members=2).close
    assert not decide(P, [0.0], now=1e6, expected=1, step_time_s=0.5, sync_time_s=0.0).close  # no count: K
