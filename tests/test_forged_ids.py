"""H1 of issue #53: a contribution id is bound to its place in the log. A writer of any region topic
who learnt an id (the manifest is in the log; `contribution_accepted` events publish it) puts frames
or whole contributions under it elsewhere: live, while the honest set is in flight, and after a
syncer restart, while Redis says the id is pending and its payload comes back from the log. Nothing
it writes changes a merged value or the honest contribution's fate; each forged set is rejected
with a reason of its own, and the id's status stays the honest one's."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import Harness

from diloco import messages


def _config(tiny_config):
    return tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "incomplete_timeout_s": 2.0})


def _harness(cfg, name):
    return Harness(cfg, f"forged-{name}-{time.time_ns() % 10**6}")


def _forged(h, cid, learner, fragment, seed):
    """The frames of a well-formed contribution of `learner` whose every frame names id `cid`."""
    _, frames = messages.encode_contribution(
        run=h.run_id, learner=learner, region=learner.split("-")[0], fragment=fragment, base_version=0, tokens=512,
        steps=2, step_time=0.01, deltas=h.deltas(fragment, scale=0.02, seed=seed), scheme="fp32", chunk_bytes=2048)
    return [messages.frame({**header, "id": cid}, bytes(payload))
            for header, payload in map(messages.parse_frame, frames)]


def _merged(h, fragment=0):
    h.pump(lambda: h.state.versions()[fragment] == 1)
    return h.store.read(fragment, 1)


def _reference(cfg):
    """The no-attack run: us-0 then eu-0 on fragment 0, the same deltas as the attacked runs'."""
    h = _harness(cfg, "reference")
    h.publish("us-0", 0)
    h.publish("eu-0", 0, deltas=h.deltas(0, seed=1))
    return _merged(h)


def _merged_as_without_forgeries(h, cid, want, forged_at) -> dict:
    """eu-0's delta closes the round: the merge is the reference's bit for bit, `cid` is applied, and
    each forged set was rejected `duplicate_id` by itself. Their rejections' details, by place."""
    h.publish("eu-0", 0, deltas=h.deltas(0, seed=1))
    got = _merged(h)
    assert want.meta["learners"] == got.meta["learners"] == ["eu-0", "us-0"]
    for name, a in want.params.items():
        np.testing.assert_array_equal(got.params[name], a, err_msg=name)
    assert h.state.statuses()[cid] == "applied:0:1"
    rejected = [e for e in h.events() if e["kind"] == "contribution_rejected" and e["id"] == cid]
    by_place = {(e["where"]["topic"], e["where"]["partition"]): e for e in rejected}
    assert set(by_place) == set(forged_at) and {e["reason"] for e in rejected} == {"duplicate_id"}
    assert h.state.counters().get("rejected", 0) == 0                  # no id was rejected, only records
    return {place: e["detail"] for place, e in by_place.items()}


@pytest.mark.integration
def test_stray_frames_of_an_id_in_flight_on_other_partitions_leave_the_honest_contribution_whole(tiny_config):
    """Keyed by id alone, one stray chunk with another `count` on any topic dropped the honest set
    (`malformed`), and the id with it."""
    cfg = _config(tiny_config)
    want = _reference(cfg)
    h = _harness(cfg, "live")
    us, eu = h.topics.fragments["us"], h.topics.fragments["eu"]
    a = h.publish("us-0", 0, frames_filter=lambda fs: fs[:2])          # in flight: its manifest and first chunk
    frames = h.sent[a.id][2]
    assert len(frames) > 3
    h.pump(lambda: a.id in h.syncer.assembler)
    stray = {(eu, 0): a.n_chunks + 1, (us, 1): a.n_chunks + 5}         # another topic, another partition
    for (topic, partition), count in stray.items():
        h.raw(topic.rsplit(".", 1)[1], messages.frame({"kind": "chunk", "id": a.id, "index": 0, "count": count},
                                                      b"x" * 64), partition=partition)
    h.pump(lambda: all(h.syncer.consumed.get(tp, 0) == 1 for tp in stray))
    forged = _forged(h, a.id, "eu-1", 1, seed=7)                        # a whole contribution, complete first
    for f in forged:
        h.producer.send(eu, f, partition=1)
    h.pump(lambda: h.syncer.consumed.get((eu, 1), 0) == len(forged))
    assert h.state.statuses().get(a.id) is None                         # the honest set is still in flight
    for f in frames[2:]:                                                 # the honest set goes on
        h.producer.send(us, f, partition=0)
    details = _merged_as_without_forgeries(h, a.id, want, [*stray, (eu, 1)])
    assert details.pop((eu, 1)) == f"id {a.id} is being assembled at {us}|0, begun before this set"
    assert all(f"taken by the contribution at {us}|0@" in d for d in details.values())
    assert h.state.counters()["rejected_records"] == 3 and len(h.syncer.assembler) == 0


@pytest.mark.integration
def test_after_a_restart_a_forged_set_under_a_pending_id_changes_no_merged_value(tiny_config):
    """The replay took the first set of a pending id to complete, from any topic, skipped its checks
    and merged its deltas under the honest learner's name and weight."""
    cfg = _config(tiny_config)
    want = _reference(cfg)
    h = _harness(cfg, "replay")
    us, eu = h.topics.fragments["us"], h.topics.fragments["eu"]
    a = h.publish("us-0", 0)
    h.pump(lambda: h.state.statuses().get(a.id) == "pending:0")
    h.syncer.save_offsets(force=True)
    # while the syncer is down, a writer of other topics and partitions puts whole contributions under the id
    elsewhere = {(eu, 0): _forged(h, a.id, "eu-1", 0, seed=7), (us, 1): _forged(h, a.id, "us-1", 1, seed=8)}
    later = _forged(h, a.id, "us-0", 0, seed=9)                          # the honest place, later in the log
    for (topic, partition), frames in [*elsewhere.items(), ((us, 0), later)]:
        for f in frames:
            h.producer.send(topic, f, partition=partition)
    h.producer.flush()
    h.syncer = h.new_syncer()
    assert h.syncer.fragments[0].round[a.id].deltas is None
    honest = (us, 0)
    h.syncer.consumer.pause(honest)                                      # the forged sets complete first
    h.pump(lambda: all(h.syncer.consumed.get(tp, 0) == len(frames) for tp, frames in elsewhere.items()))
    assert h.syncer.fragments[0].round[a.id].deltas is None and h.state.statuses()[a.id] == "pending:0"
    assert h.state.counters()["rejected:duplicate_id"] == 2
    h.syncer.consumer.resume(honest)
    before = h.state.counters().get("duplicate_records", 0)
    end = len(h.sent[a.id][2]) + len(later)                              # us|0: the honest set, then the copy
    h.pump(lambda: h.syncer.consumed[(us, 0)] == end)
    assert h.syncer.fragments[0].round[a.id].deltas is not None
    # the copy at the honest place comes after the honest set: a repeat of a settled id, counted
    assert h.state.counters().get("duplicate_records", 0) - before == len(later)
    details = _merged_as_without_forgeries(h, a.id, want, elsewhere)
    assert all(f"accepted from {us}|0@" in d for d in details.values())
