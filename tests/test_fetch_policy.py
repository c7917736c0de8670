"""When a learner's fetcher reads a fragment's new version (fragments.fetch): pure logic over the
announcements it saw and what the learner asked for and applied; no broker, no store."""

from __future__ import annotations

from diloco import messages
from diloco.config import build_config
from diloco.learners.fetcher import Fetcher
from diloco.learners.publisher import Counters
from diloco.plan import Plan, Tensor

PLAN = Plan((Tensor("w", (2, 4), "float32", 0, "rda"), Tensor("v", (4,), "float32", 1, "rda")), 2)


def fetcher(**fragments) -> Fetcher:
    cfg = build_config({"fragments": {"count": 2, "fetch": "before_sync", **fragments}})
    f = Fetcher(cfg, "run", None, None, None, Counters(), PLAN)
    f.markers = {0: 10 ** 6, 1: 10 ** 6}  # every announcement below is committed: no store read
    return f


def announce(f: Fetcher, fragment: int, version: int) -> None:
    f._take(messages.event("version", run="run", fragment=fragment, version=version, store="x"))


def fetched(f: Fetcher, fragment: int, version: int) -> None:
    """What a successful fetch and the learner's application of it leave."""
    f.held[fragment] = (version, None)
    f.needed.discard(fragment)
    f.release(fragment, version)


def test_a_fragment_never_applied_is_fetched_at_once():
    f = fetcher()
    announce(f, 0, 3)
    assert f._due() == [(0, 3)]


def test_new_versions_wait_until_the_learner_asks_then_the_newest_is_fetched_once():
    f = fetcher()
    fetched(f, 0, 1)
    for v in (2, 3, 4):
        announce(f, 0, v)
        assert f._due() == []                   # versions the learner would not apply before its sync
    f.need(0)
    assert f._due() == [(0, 4)]                 # the newest: one update from the snapshot
    fetched(f, 0, 4)
    announce(f, 0, 5)
    assert f._due() == []


def test_asked_with_nothing_newer_the_next_version_is_fetched_when_it_comes():
    f = fetcher()
    fetched(f, 1, 2)
    f.need(1)                                   # e.g. a held delta waiting for a new version
    assert f._due() == []
    announce(f, 1, 3)
    assert f._due() == [(1, 3)]


def test_every_version_fetches_each_newer_version_and_other_records_are_ignored():
    f = fetcher(fetch="every_version")
    fetched(f, 0, 1)
    announce(f, 0, 2)
    assert f._due() == [(0, 2)]
    f._take(messages.event("version", run="other", fragment=1, version=9, store="x"))
    f._take(b"not json")
    assert f._due() == [(0, 2)]


def test_a_version_fetched_and_not_yet_applied_keeps_the_fragment_due_for_newer_ones():
    """(the hosts of one learner must come to hold a common version)"""
    f = fetcher()
    fetched(f, 0, 1)
    f.held[0] = (3, None)
    f.ready[0] = {3: {}}
    announce(f, 0, 4)
    assert f._due() == [(0, 4)]
