import json
import random
import struct

import numpy as np
import pytest

from diloco import messages
from diloco.messages import Assembled, ChunkAssembler, Dropped, WireError


def contribution(chunk_bytes=64, scheme="fp32", **kw):
    rng = np.random.default_rng(0)
    deltas = {"a": rng.normal(size=(8, 4)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    fields = dict(run="r", learner="us-0", region="us", fragment=1, base_version=3, tokens=100, steps=10,
                  step_time=0.1) | kw
    m, frames = messages.encode_contribution(deltas=deltas, scheme=scheme, chunk_bytes=chunk_bytes, **fields)
    return deltas, m, frames


def feed(asm, frames, order=None, t=0.0):
    out = []
    for i in order if order is not None else range(len(frames)):
        h, p = messages.parse_frame(frames[i])
        out.append(asm.add(h, p, now=t, offset=i, where="topic|0"))
    return out


def test_in_order_reassembly_round_trips_the_deltas():
    deltas, m, frames = contribution()
    assert m.n_chunks == len(frames) - 1 > 1
    results = feed(ChunkAssembler(max_bytes=1 << 20, timeout_s=5), frames)
    assert all(r is None for r in results[:-1]) and isinstance(results[-1], Assembled)
    out = messages.decode_payload(results[-1].manifest, results[-1].payload)
    assert results[-1].first_offset == 0
    for k in deltas:
        np.testing.assert_array_equal(out[k], deltas[k])


def test_out_of_order_chunks_and_manifest_last_still_assemble():
    deltas, m, frames = contribution()
    order = list(range(1, len(frames)))
    random.Random(3).shuffle(order)
    results = feed(ChunkAssembler(max_bytes=1 << 20, timeout_s=5), frames, order + [0])
    assert isinstance(results[-1], Assembled) and results[-1].manifest == m


def test_missing_chunk_expires_as_incomplete():
    _, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    assert all(r is None for r in feed(asm, frames[:-1], t=0.0))
    assert asm.expire(now=4.0) == []
    (d,) = asm.expire(now=6.0)
    assert isinstance(d, Dropped) and d.reason == "incomplete" and d.id == m.id and d.first_offset == 0
    assert f"{m.n_chunks - 1}/{m.n_chunks} chunks" in d.detail and len(asm) == 0


def test_oversized_contribution_is_dropped_on_its_manifest():
    _, m, frames = contribution()
    (r,) = feed(ChunkAssembler(max_bytes=64, timeout_s=5), frames[:1])
    assert isinstance(r, Dropped) and r.reason == "oversized"


def test_inconsistent_chunk_count_is_malformed():
    _, m, frames = contribution()
    h, p = messages.parse_frame(frames[1])
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    feed(asm, frames[:1])
    r = asm.add({**h, "count": h["count"] + 1}, p, now=0)
    assert isinstance(r, Dropped) and r.reason == "malformed"


def test_checksum_mismatch_is_detected_on_decode():
    _, m, frames = contribution(chunk_bytes=1 << 20)
    h, p = messages.parse_frame(frames[1])
    flipped = bytearray(p)
    flipped[5] ^= 0xFF
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    feed(asm, frames[:1])
    a = asm.add(h, bytes(flipped), now=0)
    with pytest.raises(WireError, match="checksum"):
        messages.decode_payload(a.manifest, a.payload)


@pytest.mark.parametrize("raw, words", [
    (b"", "truncated"),
    (b"XXXX" + b"\0" * 10, "not a diloco frame"),
    (struct.pack("<4sHI", b"DLCO", 9, 2) + b"{}", "wire version 9"),
    (struct.pack("<4sHI", b"DLCO", 1, 500) + b"{}", "runs past"),
    (struct.pack("<4sHI", b"DLCO", 1, 3) + b"{x}", "not JSON"),
    (messages.frame({"kind": "pickle"}), "kind must be"),
])
def test_malformed_frames_say_what_is_wrong(raw, words):
    with pytest.raises(WireError, match=words):
        messages.parse_frame(raw)


def test_manifest_fields_are_type_checked():
    _, m, frames = contribution()
    h, _ = messages.parse_frame(frames[0])
    for field, bad in (("fragment", "1"), ("tokens", 1.5), ("tensors", [{"name": "a", "shape": [-1], "scheme": "fp32", "nbytes": 0}]),
                       ("total_bytes", 3)):
        with pytest.raises(WireError):
            messages.Manifest.from_header({**h, field: bad})


def test_events_are_json_with_a_schema():
    ev = messages.parse_event(messages.event("merge", fragment=np.int64(2), version=3))
    assert ev["kind"] == "merge" and ev["fragment"] == 2 and ev["schema"] == messages.EVENT_SCHEMA
    assert messages.parse_event(b"\xff") is None and messages.parse_event(json.dumps([1]).encode()) is None


def test_a_real_heartbeat_passes_the_checks():
    """`at` is a wall-clock time: a heartbeat sent now must not be refused (it once was, for being
    more than 1e9 seconds)."""
    import time as _time

    beat = {"learner": "us-0", "step": 5, "tokens": 640, "loss": 2.5, "step_time": 0.03, "compute_s": 1.2,
            "at": _time.time(), "state": "running", "versions": {"0": 3}, "incarnation": "ab12cd34"}
    assert messages.clean_heartbeat(beat)["at"] == beat["at"]
    with pytest.raises(messages.WireError, match="field 'at'"):
        messages.clean_heartbeat({**beat, "at": float("inf")})
