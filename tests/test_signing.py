"""Issue 53 item 1: a contribution is bound to the learner that wrote it. With run.signing_secret_env
set, every frame carries its learner's HMAC under a key derived from the run's secret; the syncer
checks it before reading anything in the frame. A frame signed with another learner's key, unsigned,
or signed by one learner for another's set is rejected `bad_signature` by itself, and changes nothing
of the honest contribution."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest
from helpers import Harness

from diloco import messages, signing

SECRET = b"the run's secret: only the runner and the syncer hold it"


def test_each_learner_has_a_key_of_its_own_in_each_run():
    keys = {(run, lid): signing.learner_key(SECRET, run, lid) for run in ("a", "b") for lid in ("us-0", "us-1")}
    assert len(set(keys.values())) == 4 and all(len(k) == signing.KEY_BYTES for k in keys.values())
    assert signing.learner_key(SECRET, "a", "us-0") == keys[("a", "us-0")]          # derived, not drawn
    assert signing.learner_key(b"another secret", "a", "us-0") != keys[("a", "us-0")]
    # the separator keeps (run, learner) pairs apart that concatenate alike
    assert signing.learner_key(SECRET, "a-b", "c") != signing.learner_key(SECRET, "a", "b-c")


def test_a_frame_is_its_signers_and_nobody_elses():
    keys = {lid: signing.learner_key(SECRET, "r", lid) for lid in ("us-0", "eu-0")}
    frame = messages.frame({"kind": "chunk", "id": "x", "index": 0, "count": 1}, b"payload")
    good = signing.headers("us-0", keys["us-0"], frame)
    assert signing.signer_of(good, frame, keys.get) == "us-0"
    assert signing.signer_of(good, memoryview(frame), keys.get) == "us-0"
    cases = {
        "signature does not hold": signing.headers("us-0", keys["eu-0"], frame),       # another learner's key
        "one diloco-learner": [],                                                         # unsigned
        "no learner of this run": signing.headers("xx-9", keys["us-0"], frame),         # a signer with no key
    }
    for want, hdrs in cases.items():
        with pytest.raises(signing.SigningError, match=want):
            signing.signer_of(hdrs, frame, keys.get)
    with pytest.raises(signing.SigningError, match="signature does not hold"):         # one byte changed
        signing.signer_of(good, frame[:-1] + b"X", keys.get)
    with pytest.raises(signing.SigningError, match="one diloco-learner"):             # a second signature
        signing.signer_of(good + [(signing.SIGNATURE_HEADER, b"\0" * 32)], frame, keys.get)
    with pytest.raises(signing.SigningError, match="not UTF-8"):
        signing.signer_of([(signing.SIGNER_HEADER, b"\xff"), good[1]], frame, keys.get)


def test_key_files_are_each_learners_own_and_read_back(tmp_path):
    signing.write_keys(SECRET, "r", ["us-0", "eu-0"], tmp_path / "keys")
    path = signing.key_path(tmp_path / "keys", "us-0")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert signing.read_key(path) == signing.learner_key(SECRET, "r", "us-0")
    with pytest.raises(signing.SigningError, match="cannot read the learner key .*us-1.key"):
        signing.read_key(signing.key_path(tmp_path / "keys", "us-1"))
    path.write_text("abc\n")
    with pytest.raises(signing.SigningError, match="64 hex digits"):
        signing.read_key(path)


# --- against the syncer, on the real broker and Redis ---------------------------------------------

@pytest.fixture
def signed(tiny_config, monkeypatch):
    monkeypatch.setenv("DILOCO_TEST_RUN_SECRET", SECRET.decode())
    cfg = tiny_config(run={"signing_secret_env": "DILOCO_TEST_RUN_SECRET"},
                      syncer={"quorum": 2, "grace_max_s": 0.0, "incomplete_timeout_s": 2.0})
    h = Harness(cfg, f"signed-{time.time_ns() % 10**8}")
    key = {lid: signing.learner_key(SECRET, h.run_id, lid) for lid in ("us-0", "eu-0")}
    h.as_ = lambda lid, k=None: (lambda f: signing.headers(lid, key[k or lid], f))  # noqa: E731
    return h


def _rejections(h, reason="bad_signature"):
    return [e for e in h.events() if e["kind"] == "contribution_rejected" and e["reason"] == reason]


@pytest.mark.integration
def test_the_syncer_merges_signed_contributions_and_rejects_every_forgery(signed):
    h = signed
    m_us = h.publish("us-0", 0, sign=h.as_("us-0"))
    h.publish("us-0", 0, deltas=h.deltas(0, seed=7), sign=h.as_("us-0", "eu-0"))    # eu-0's key, us-0's name
    h.publish("us-0", 0, deltas=h.deltas(0, seed=8))                                   # unsigned
    h.publish("eu-0", 0, deltas=h.deltas(0, seed=9), region="eu", sign=h.as_("eu-0"),  # eu-0 signs a us-0 manifest
              frames_filter=lambda fs: [messages.frame({**hd, "learner": "us-0", "region": "eu"}, bytes(p))
                                        if hd["kind"] == "manifest" else messages.frame(hd, bytes(p))
                                        for hd, p in map(messages.parse_frame, fs)])
    m_eu = h.publish("eu-0", 0, deltas=h.deltas(0, seed=1), sign=h.as_("eu-0"))
    h.pump(lambda: h.state.versions()[0] == 1)
    merged = h.store.read(0, 1)
    assert set(merged.meta["ids"]) == {m_us.id, m_eu.id}                             # the two honest ones
    h.pump(lambda: len({e["where"]["offset"] for e in _rejections(h)}) >= 3)
    details = " | ".join(e["detail"] for e in _rejections(h))
    assert "signature does not hold for signer 'us-0'" in details
    assert "one diloco-learner" in details                                          # the unsigned one
    assert "a manifest of learner 'us-0' signed by 'eu-0'" in details
    assert h.state.statuses()[m_us.id] == h.state.statuses()[m_eu.id] == "applied:0:1"


@pytest.mark.integration
def test_a_chunk_signed_by_another_learner_never_joins_a_set(signed):
    """eu-0 learns us-0's id from its manifest and writes a chunk of its own under it, signed with its
    own key: the chunk is refused alone, us-0's set completes from us-0's frames, and the merge is
    what us-0 sent."""
    h = signed
    deltas = h.deltas(0, seed=3)
    m, frames = messages.encode_contribution(
        run=h.run_id, learner="us-0", region="us", fragment=0, base_version=0, tokens=512, steps=2, step_time=0.01,
        deltas=deltas, scheme="fp32", chunk_bytes=2048)
    topic, part = h.topics.fragments["us"], h.topics.partition_of(0)
    header, payload = messages.parse_frame(frames[1])
    forged = messages.frame(header, bytes(len(payload)))   # chunk 0 of us-0's set, zeros, eu-0's signature
    h.producer.send(topic, frames[0], partition=part, headers=h.as_("us-0")(frames[0]))
    h.producer.send(topic, forged, partition=part, headers=h.as_("eu-0")(forged))
    for f in frames[1:]:
        h.producer.send(topic, f, partition=part, headers=h.as_("us-0")(f))
    h.producer.flush()
    h.publish("eu-0", 0, deltas=h.deltas(0, seed=1), sign=h.as_("eu-0"))
    h.pump(lambda: h.state.versions()[0] == 1)
    assert h.state.statuses()[m.id] == "applied:0:1"
    h.pump(lambda: _rejections(h))
    assert "a frame signed by 'eu-0' for a set 'us-0' began" in _rejections(h)[0]["detail"]
    assert _rejections(h)[0]["id"] == m.id and not _rejections(h, "duplicate_id")
    reference = Harness(h.cfg, f"signed-ref-{time.time_ns() % 10**8}")   # the same two deltas, no forgery
    reference.publish("us-0", 0, deltas=deltas, sign=lambda f: signing.headers(
        "us-0", signing.learner_key(SECRET, reference.run_id, "us-0"), f))
    reference.publish("eu-0", 0, deltas=h.deltas(0, seed=1), sign=lambda f: signing.headers(
        "eu-0", signing.learner_key(SECRET, reference.run_id, "eu-0"), f))
    reference.pump(lambda: reference.state.versions()[0] == 1)
    want, got = reference.store.read(0, 1), h.store.read(0, 1)
    for name, a in want.params.items():
        np.testing.assert_array_equal(got.params[name], a, err_msg=name)
