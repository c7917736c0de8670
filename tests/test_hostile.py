"""One hostile or unlucky record is contained: absurd claims, huge deltas, malformed heartbeats and
announcements, deeply nested JSON, a merge that would not be finite, a record the broker refuses.
Each gets a clear reason and a counter; the syncer and the learner's fetcher keep running, nothing
poisons the global parameters, and good contributions still merge."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import numpy as np
import pytest
from helpers import Harness
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import messages
from diloco.infra import kafka as kafka_io
from diloco.learners.fetcher import Fetcher
from diloco.learners.publisher import Counters
from diloco.syncer import syncer as syncer_mod

# --- pure: parsing and event checks --------------------------------------------------------------

NESTED = b"[" * 200_000 + b"]" * 200_000


def test_deeply_nested_json_is_a_wire_error_or_no_event_not_a_recursion_error():
    assert messages.parse_event(NESTED) is None
    with pytest.raises(messages.WireError, match="nests too deeply"):
        messages.parse_frame(messages._PREFIX.pack(messages.MAGIC, messages.WIRE_VERSION, len(NESTED)) + NESTED)
    assert messages.parse_event(b"x" * (messages.MAX_EVENT_BYTES + 1)) is None


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=8)
FIELDS = ["step", "start_step", "tokens", "step_time", "compute_s", "loss", "state", "incarnation", "versions",
          "bytes_sent", "published", "at", "region"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6), st.text(max_size=70))
def test_a_heartbeat_is_either_refused_with_its_field_named_or_fully_checked(fields, learner):
    try:
        hb = messages.clean_heartbeat({"learner": learner, **fields})
    except messages.WireError as err:
        assert len(str(err)) < 300
        return
    for key in ("step", "tokens", "start_step", "bytes_sent", "published"):
        assert key not in hb or (type(hb[key]) is int and 0 <= hb[key] < messages.MAX_COUNT)
    for key in ("step_time", "compute_s", "at"):
        assert key not in hb or (isinstance(hb[key], (int, float)) and np.isfinite(hb[key]) and hb[key] >= 0)
    assert set(hb) <= {"kind", "learner", *FIELDS}
    np.median([hb.get("step_time", 0.0), 1.0])  # what the grace window does with it must not raise


def test_errors_quote_input_bounded():
    h = {"kind": "manifest", "id": "x", "run": "r" * 2000}
    with pytest.raises(messages.WireError) as err:
        messages.Manifest.from_header({**h, "tensors": "t" * 2000})
    assert len(str(err.value)) < 200


# --- the syncer against the real broker, Redis and TensorStore ----------------------------------


@pytest.fixture
def harness(tiny_config, request):
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "max_tokens_per_step": 1000})
    h = Harness(cfg, f"hostile-{request.node.name[5:30].replace('_', '-')}-{time.time_ns() % 10**6}")
    yield h
    h.producer.close()


def _reason(h, cid):
    return h.state.statuses().get(cid, "")


def _good_round(h, fragment=0):
    """Two well-behaved contributions: the fragment must still merge after whatever came before."""
    v = h.state.versions()[fragment]
    h.publish("us-0", fragment, base_version=v, deltas=h.deltas(fragment, seed=1))
    h.publish("eu-0", fragment, base_version=v, deltas=h.deltas(fragment, seed=2))
    h.pump(lambda: h.state.versions()[fragment] == v + 1)
    params = h.store.read(fragment, v + 1).params
    assert all(np.all(np.isfinite(a)) for a in params.values())


@pytest.mark.integration
@pytest.mark.parametrize("tokens, steps, words", [
    (10 ** 309, 2, "out of range"),            # a JSON integer too large for a float: OverflowError before
    (10 ** 200, 10 ** 199, "out of range"),    # weights near 1e200: NaN globals before
    (5000, 2, "more than syncer.max_tokens_per_step=1000"),
    (0, 2, "out of range"),
])
def test_absurd_token_claims_are_rejected_and_the_syncer_goes_on(harness, tokens, steps, words):
    h = harness
    m = h.publish("us-1", 0, tokens=tokens, steps=steps)
    h.pump(lambda: _reason(h, m.id).startswith("rejected"))
    assert _reason(h, m.id) == "rejected:bad_metadata"
    (ev,) = [e for e in h.events() if e["kind"] == "contribution_rejected" and e["id"] == m.id]
    assert words in ev["detail"] and len(ev["detail"]) < 400
    _good_round(h)


@pytest.mark.integration
def test_a_huge_finite_delta_is_rejected_against_the_norm_budget(harness):
    h = harness
    huge = {n: np.full(a.shape, 1e30, np.float32) for n, a in h.deltas(0).items()}
    m = h.publish("us-1", 0, deltas=huge)
    h.pump(lambda: _reason(h, m.id).startswith("rejected"))
    assert _reason(h, m.id) == "rejected:norm_budget"
    _good_round(h)


@pytest.mark.integration
def test_a_malformed_heartbeat_is_counted_and_never_reaches_state(harness):
    h = harness
    h.heartbeat("us-0", step=3, step_time="fast")             # np.median raised on this in maybe_close
    h.heartbeat("us-1", step=[1] * 3, step_time=0.01)
    h.pump(lambda: h.state.counters().get("bad_events", 0) >= 2)
    assert "us-0" not in h.state.registry() and "us-1" not in h.state.registry()
    _good_round(h)
    h.heartbeat("eu-0", step=7, step_time=0.02)               # a good one still counts
    h.pump(lambda: h.state.registry().get("eu-0", {}).get("step") == 7)


@pytest.mark.integration
def test_an_id_too_long_for_the_state_is_malformed(harness):
    h = harness
    before = h.state.counters().get("rejected:malformed", 0)
    h.raw("us", messages.frame({"kind": "chunk", "id": "i" * 5000, "index": 0, "count": 1}, b"x"))
    h.pump(lambda: h.state.counters().get("rejected:malformed", 0) == before + 1)
    assert not any(len(cid) > 64 for cid in h.state.statuses())


@pytest.mark.integration
def test_a_merge_that_would_not_be_finite_is_rejected_not_written(harness, monkeypatch):
    h = harness
    real = syncer_mod.fused.merge

    def poisoned(*args, **kw):  # a merged delta that is not finite: the outer step must refuse it
        return {n: np.full_like(a, np.nan) for n, a in real(*args, **kw).items()}

    monkeypatch.setattr(syncer_mod.fused, "merge", poisoned)
    a = h.publish("us-0", 1, deltas=h.deltas(1, seed=1))
    b = h.publish("eu-0", 1, deltas=h.deltas(1, seed=2))
    h.pump(lambda: _reason(h, a.id).startswith("rejected") and _reason(h, b.id).startswith("rejected"))
    assert {_reason(h, a.id), _reason(h, b.id)} == {"rejected:merge_failed"}
    assert h.state.versions()[1] == 0 and h.store.versions(1) == [0]    # nothing written or announced
    assert not [e for e in h.events() if e["kind"] == "version" and e.get("fragment") == 1 and e["version"] > 0]
    monkeypatch.setattr(syncer_mod.fused, "merge", real)
    _good_round(h, fragment=1)


@pytest.mark.integration
def test_a_record_the_broker_refuses_for_good_is_dead_lettered_and_does_not_block_the_outbox(harness):
    h = harness
    too_big = {"topic": h.topics.events, "partition": 0, "value": "x" * (h.cfg.transport.max_message_bytes + 200_000)}  # past max_request_size
    ok = {"topic": h.topics.events, "partition": 0, "value": messages.event("probe", run=h.run_id, n=1).decode()}
    h.state.r.rpush(h.state.k + "outbox", json.dumps(too_big), json.dumps(ok))
    h.syncer.outbox.relay()
    assert h.state.outbox_peek() == []
    assert h.state.counters().get("dead_letters") == 1 and h.state.r.llen(h.state.k + "deadletter") == 1
    assert [e for e in h.events() if e["kind"] == "probe"]
    _good_round(h)


@pytest.mark.integration
def test_the_fetcher_skips_bad_announcements_and_outlives_a_missing_version(harness):
    h = harness
    _good_round(h, fragment=2)
    bad = [messages.event("version", run=h.run_id, fragment=2, version="7"),
           messages.event("version", run=h.run_id, fragment="two", version=1),
           messages.event("version", run=h.run_id, fragment=2, version=True),
           NESTED[:1000] + b"]" * 1000, b"\xff\xfe"]
    for raw in bad:
        h.producer.send(h.topics.outer, raw, partition=0)
    h.producer.send(h.topics.outer, messages.event("version", run=h.run_id, fragment=3, version=99), partition=0)
    h.producer.flush()
    with _fetching(h) as (fetcher, thread):
        deadline = time.time() + 30
        while 1 not in fetcher.ready_now().get(2, {}):
            assert time.time() < deadline and fetcher.error is None, fetcher.error
            time.sleep(0.05)
        time.sleep(1.5)                                        # fragment 3 v99 does not exist: ignored, not fatal
        assert fetcher.error is None and thread.is_alive()
        h.producer.send(h.topics.outer, messages.event("version", run=h.run_id, fragment=2, version=10 ** 6), partition=0)
        h.producer.flush()                                     # a forged version far ahead must not hold back...
        _good_round(h, fragment=2)
        h.syncer.outbox.relay()
        deadline = time.time() + 15
        while 2 not in fetcher.ready_now().get(2, {}):         # ...the real next one
            assert time.time() < deadline and fetcher.error is None, (fetcher.error, fetcher.ready_now())
            time.sleep(0.05)


@pytest.mark.integration
def test_a_forged_announcement_one_past_the_marker_does_not_hold_a_joiner_back(harness):
    """Issue 53 L9: fragment 2 is at v1 and the store's marker says so; a record on the outer topic
    announces v2, which may be committed next (marker + 1) but never was. A learner joining now gets
    v1 at once instead of chasing v2 until a real merge makes it; the real v2 is taken when it comes."""
    h = harness
    _good_round(h, fragment=2)
    h.syncer.outbox.relay()
    h.producer.send(h.topics.outer, messages.event("version", run=h.run_id, fragment=2, version=2), partition=0)
    h.producer.flush()
    with _fetching(h) as (fetcher, thread):
        deadline = time.time() + 5     # the first retry of v2 alone would come 1 s after its failure, the give-up after minutes
        while 1 not in fetcher.ready_now().get(2, {}):
            assert time.time() < deadline and fetcher.error is None, (fetcher.error, fetcher.ready_now())
            time.sleep(0.05)
        _good_round(h, fragment=2)                               # the real v2, committed and announced
        h.syncer.outbox.relay()
        deadline = time.time() + 15
        while 2 not in fetcher.ready_now().get(2, {}):
            assert time.time() < deadline and fetcher.error is None, (fetcher.error, fetcher.ready_now())
            time.sleep(0.05)


@contextlib.contextmanager
def _fetching(h):
    """A learner's fetcher of every whole tensor, running on a thread of its own; stopped on exit."""
    fetcher = Fetcher(h.cfg, h.run_id, kafka_io.consumer(h.cfg.transport), h.store, h.topics, Counters(), h.run_plan)
    fetcher.want({n: [tuple((0, s) for s in shape)] for n, shape in h.run_plan.shapes.items()})
    thread = threading.Thread(target=fetcher.run, daemon=True)
    thread.start()
    try:
        yield fetcher, thread
    finally:
        fetcher.stop.set()
        thread.join(timeout=30)


# --- bounded buffers and expiry by log progress ---------------------------------------------------


@pytest.mark.integration
def test_a_contribution_ruled_out_by_its_manifest_never_has_its_chunks_buffered(harness):
    h = harness
    before = h.state.counters().get("duplicate_records", 0)
    m = h.publish("us-9", 0)                                   # not a learner of this run
    h.pump(lambda: h.state.counters().get("duplicate_records", 0) == before + m.n_chunks)
    assert _reason(h, m.id) == "rejected:unknown_learner"      # judged on the manifest: chunks skipped
    assert h.syncer.assembler.buffered == 0 and len(h.syncer.assembler) == 0
    _good_round(h)


@pytest.mark.integration
def test_a_syncer_that_stops_reading_rejects_nothing_whose_chunks_are_in_the_log(tiny_config):
    cfg = tiny_config(syncer={"quorum": 4, "grace_max_s": 0.0, "incomplete_timeout_s": 0.5})
    h = Harness(cfg, f"hostile-paused-reader-{time.time_ns() % 10**6}")
    try:
        done = h.publish("us-0", 0)                            # accepted; its round waits for quorum 4
        h.pump(lambda: _reason(h, done.id) == "pending:0")
        m = h.publish("us-1", 0, frames_filter=lambda fs: fs[:2])
        h.pump(lambda: m.id in h.syncer.assembler)
        for _ in range(600 // done.n_chunks + 1):              # a backlog of more than one poll (500 records)
            h.resend(done.id)
        for f in h.sent[m.id][2][2:]:                          # the rest of the set is in the log...
            h.producer.send(h.topics.fragments["us"], f, partition=0)
        h.producer.flush()
        time.sleep(1.5)                                        # ...while the syncer reads nothing (a long merge)
        h.pump(lambda: _reason(h, m.id) != "" and m.id not in h.syncer.assembler)
        assert _reason(h, m.id) == "pending:0"
    finally:
        h.producer.close()


@pytest.mark.integration
def test_an_accepted_payload_missing_from_the_log_is_given_up_and_announced_while_traffic_goes_on(harness):
    h = harness
    a = h.publish("us-0", 0)
    h.pump(lambda: _reason(h, a.id) == "pending:0")
    h.publish("us-1", 1, frames_filter=lambda fs: fs[:2])     # a partial set that keeps the syncer busy
    tp = (h.topics.fragments["us"], h.topics.partition_of(0))
    h.pump(lambda: h.syncer.consumed.get(tp, 0) > 0 and len(h.syncer.assembler) == 1)
    end = h.syncer.consumed[tp]
    key = h.state.k + "round:0"                               # as if retention had dropped its records
    h.state.r.hset(key, a.id, json.dumps(json.loads(h.state.r.hget(key, a.id)) | {"offset": end}))
    h.state.save_offsets({tp: end})
    h.syncer = h.new_syncer()
    h.pump(lambda: _reason(h, a.id).startswith("rejected"))
    assert _reason(h, a.id) == "rejected:lost_payload"
    (ev,) = [e for e in h.events() if e["kind"] == "payload_lost"]
    assert ev["id"] == a.id and ev["fragment"] == 0 and f"@{end}" in ev["detail"]
    _good_round(h)


@pytest.mark.integration
def test_finished_ids_are_forgotten_once_replay_is_past_them_so_the_status_stays_bounded(tiny_config):
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "status_keep": 3})
    h = Harness(cfg, f"hostile-status-bound-{time.time_ns() % 10**6}")
    try:
        for i in range(30):                                    # invented ids, each refused with its id
            h.raw("us", messages.frame({"kind": "chunk", "id": f"invented-{i}", "index": 5, "count": 2}), partition=0)
        h.pump(lambda: h.state.counters().get("rejected:malformed", 0) == 30)
        h.syncer.every_prune.reset()
        h.syncer.save_offsets(force=True)
        kept = {c for c in h.state.statuses() if c.startswith("invented-")}
        assert kept == {"invented-27", "invented-28", "invented-29"}            # the newest status_keep
        assert {c for c in h.syncer.status if c.startswith("invented-")} == kept
        _good_round(h)
    finally:
        h.producer.close()
