import itertools
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


def _ticks(asm, start, stop, caught_up=lambda where: True, step=0.5):
    """expire() called every `step` seconds of [start, stop], as a reading syncer does; what it dropped."""
    out, t = [], start
    while t <= stop:
        out += asm.expire(now=t, caught_up=caught_up)
        t += step
    return out


def test_missing_chunk_expires_as_incomplete_once_its_partition_was_read_to_the_end():
    _, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    assert all(r is None for r in feed(asm, frames[:-1], t=0.0))
    assert _ticks(asm, 0.0, 4.0) == []
    (d,) = _ticks(asm, 4.5, 6.0)
    assert isinstance(d, Dropped) and d.reason == "incomplete" and d.id == m.id and d.first_offset == 0
    assert f"{m.n_chunks - 1}/{m.n_chunks} chunks" in d.detail and len(asm) == 0 and asm.buffered == 0


def test_a_reader_that_stops_or_lags_expires_nothing_whose_chunks_may_still_be_in_the_log():
    _, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    feed(asm, frames[:-1], t=0.0)
    assert asm.expire(now=0.0) == [] and asm.expire(now=1000.0) == []   # a pause counts as one tick at most
    assert _ticks(asm, 1000.0, 2000.0, caught_up=lambda where: False) == []   # behind its partition: no clock
    h, p = messages.parse_frame(frames[-1])
    assert isinstance(asm.add(h, p, now=2000.0, offset=len(frames) - 1, where="topic|0"), Assembled)


def test_a_set_expires_by_log_progress_past_its_last_chunk_even_if_never_caught_up():
    _, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5, after_bytes=10_000)
    feed(asm, frames[:-1])
    asm.read("other|0", 50_000)                                          # another partition's progress: none here
    assert asm.expire(now=0.0, caught_up=lambda where: False) == []
    asm.read("topic|0", 10_001)
    (d,) = asm.expire(now=0.0, caught_up=lambda where: False)
    assert d.reason == "incomplete" and "10000 bytes of its partition" in d.detail


def _chunk(cid, index=0, count=4, payload=b"x" * 100):
    return {"kind": "chunk", "id": cid, "index": index, "count": count}, payload


def test_invented_ids_are_bounded_and_sets_with_a_manifest_outlive_them():
    _, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5, max_sets=8)
    feed(asm, frames[:2])                                                # a real set in progress
    for i in range(100):                                                 # a flood of chunks with no manifest
        r = asm.add(*_chunk(f"junk-{i}"), now=0.0, where="topic|0")
        assert r is None or (isinstance(r, Dropped) and r.reason == "buffer_full")
    evicted = asm.expire(now=0.0)
    assert len(asm) <= 8 and m.id in asm
    assert len(evicted) >= 90 and {d.reason for d in evicted} == {"buffer_full"} and m.id not in {d.id for d in evicted}
    assert isinstance(feed(asm, frames[2:])[-1], Assembled)


def test_buffered_bytes_are_bounded_and_counted_exactly():
    asm = ChunkAssembler(max_bytes=4096, timeout_s=5, max_buffered=4096)
    assert asm.add(*_chunk("a", 0, 4, b"x" * 1000), now=0.0) is None
    assert asm.add(*_chunk("a", 0, 4, b"y" * 1000), now=0.0) is None     # a repeat replaces its copy
    assert asm.buffered == 1000 + messages.CHUNK_OVERHEAD
    assert asm.add(*_chunk("b", 0, 4, b"x" * 1000), now=0.0) is None
    assert asm.add(*_chunk("c", 0, 4, b"x" * 1000), now=0.0) is None
    r = asm.add(*_chunk("d", 0, 4, b"x" * 1000), now=0.0)                # over 4096 with overheads: oldest goes
    assert r is None and [d.id for d in asm.expire(now=0.0)] == ["a"]
    assert asm.buffered == 3 * (1000 + messages.CHUNK_OVERHEAD) <= 4096
    asm.discard("b")
    assert asm.buffered == 2 * (1000 + messages.CHUNK_OVERHEAD)


def test_a_held_chunk_counts_the_whole_record_it_keeps_alive_header_and_all():
    """Chunks are held as views into their records (no copy until the set is complete), so a frame
    with a large header costs its header too: a flood of tiny chunks with padded headers stays bounded."""
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5, max_buffered=1 << 20)
    raw = messages.frame({"kind": "chunk", "id": "a", "index": 0, "count": 2, "pad": "p" * 5000}, b"x" * 100)
    header, payload = messages.parse_frame(raw)
    assert asm.add(header, payload, now=0.0) is None
    assert asm.buffered == len(raw) + messages.CHUNK_OVERHEAD
    raw2 = messages.frame({"kind": "chunk", "id": "a", "index": 1, "count": 2}, b"y" * 100)
    assert asm.add(*messages.parse_frame(raw2), now=0.0) is None          # no manifest yet: still held
    assert asm.buffered == len(raw) + len(raw2) + 2 * messages.CHUNK_OVERHEAD
    asm.discard("a")
    assert asm.buffered == 0


def test_empty_chunks_and_more_chunks_than_bytes_are_malformed():
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    r = asm.add(*_chunk("z", 1, 1 << 30, b""), now=0.0)
    assert isinstance(r, Dropped) and r.reason == "malformed" and "empty" in r.detail and len(asm) == 0
    _, m, frames = contribution()
    h, _ = messages.parse_frame(frames[0])
    r = asm.add({**h, "n_chunks": h["total_bytes"] + 1}, b"", now=0.0)
    assert isinstance(r, Dropped) and r.reason == "malformed" and "chunks for" in r.detail


def test_a_manifest_refused_by_the_check_drops_its_set_before_chunks_are_held():
    _, m, frames = contribution()
    seen = []
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5,
                         check=lambda man: seen.append(man.id) or ("unknown_learner", f"{man.learner} is not in this run"))
    (r,) = feed(asm, frames[:1])
    assert isinstance(r, Dropped) and r.reason == "unknown_learner" and seen == [m.id] and len(asm) == 0


def test_chunks_of_one_set_may_not_outgrow_its_manifest():
    _, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    feed(asm, frames[:1])
    h, p = messages.parse_frame(frames[1])
    r = asm.add(h, bytes(p) + b"x" * m.total_bytes, now=0.0, where="topic|0")
    assert isinstance(r, Dropped) and r.reason == "malformed" and "manifest" in r.detail


def test_oversized_contribution_is_dropped_on_its_manifest():
    _, m, frames = contribution()
    (r,) = feed(ChunkAssembler(max_bytes=64, timeout_s=5), frames[:1])
    assert isinstance(r, Dropped) and r.reason == "oversized"


def test_inconsistent_chunk_count_is_malformed():
    _, m, frames = contribution()
    h, p = messages.parse_frame(frames[1])
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    feed(asm, frames[:1])
    r = asm.add({**h, "count": h["count"] + 1}, p, now=0, where="topic|0")
    assert isinstance(r, Dropped) and r.reason == "malformed"


def test_checksum_mismatch_is_detected_on_decode():
    _, m, frames = contribution(chunk_bytes=1 << 20)
    h, p = messages.parse_frame(frames[1])
    flipped = bytearray(p)
    flipped[5] ^= 0xFF
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    feed(asm, frames[:1])
    a = asm.add(h, bytes(flipped), now=0, where="topic|0")
    with pytest.raises(WireError, match="checksum"):
        messages.decode_payload(a.manifest, a.payload)


@pytest.mark.parametrize("raw, words", [
    (b"", "truncated"),
    (b"XXXX" + b"\0" * 10, "not a diloco frame"),
    (struct.pack("<4sHI", b"DLCO", 9, 2) + b"{}", "wire version 9"),
    (struct.pack("<4sHI", b"DLCO", 1, 2) + b"{}", "wire version 1 is not supported"),  # SHA-256 manifests
    (struct.pack("<4sHI", b"DLCO", messages.WIRE_VERSION, 500) + b"{}", "runs past"),
    (struct.pack("<4sHI", b"DLCO", messages.WIRE_VERSION, 3) + b"{x}", "not JSON"),
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


def test_a_count_is_an_int_that_json_did_not_decode_from_true_or_false():
    assert [messages.is_count(json.loads(t)) for t in ("3", "0", "-2", "true", "false", "1.0", '"1"', "null")] == [
        True, True, True, False, False, False, False, False]
    h = messages.parse_frame(contribution()[2][0])[0]
    with pytest.raises(WireError, match="nbytes"):                         # a bool is no tensor's byte count
        messages.Manifest.from_header({**h, "tensors": [{**h["tensors"][0], "nbytes": True}]})


def test_the_typed_frame_header_passes_valid_fields_and_makes_ill_typed_ones_none():
    _, m, frames = contribution()
    h = messages.FrameHeader.from_header(messages.parse_frame(frames[0])[0])
    assert h == messages.FrameHeader(kind="manifest", id=m.id, learner="us-0", region="us", fragment=1,
                                     index=None, count=None, total_bytes=m.total_bytes)
    chunk = messages.FrameHeader.from_header(messages.parse_frame(frames[-1])[0])
    assert (chunk.kind, chunk.id, chunk.index, chunk.count) == ("chunk", m.id, m.n_chunks - 1, m.n_chunks)
    bad = messages.FrameHeader.from_header({"kind": "manifest", "learner": "x" * 100, "region": ["us"],
                                            "fragment": True, "index": -1, "count": 2.0, "total_bytes": "9"})
    assert bad == messages.FrameHeader("manifest", None, None, None, None, None, None, None)  # the id is missing
    assert messages.FrameHeader.from_header({"kind": "pickle", "id": ""}).kind is None
    with pytest.raises(WireError, match="contribution id of 1-64 characters, got 7"):
        messages.FrameHeader.from_header({"kind": "chunk", "id": 7}, need_id=True)


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


def test_the_wire_format_documents_bytes_the_encoder_writes():
    """docs/wire-format.md's worked example, byte for byte: its payload, its CRC-32C and the check
    value it gives; the frame prefix of its manifest and chunks."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "wire-format.md").read_text()

    def hexes(label: str) -> bytes:  # the bytes printed after `label ...:` in the doc
        return bytes.fromhex(re.search(label + r"[^:\n]*:\s+([0-9a-f |]+)\n", doc).group(1).replace("|", ""))

    m, frames = messages.encode_contribution(
        run="r1", learner="us-0", region="us", fragment=0, base_version=3, tokens=512, steps=4, step_time=0.05,
        deltas={"b": np.array([0.7, -0.35, 0.1], np.float32),
                "w": np.array([[0.5, -1.0, 0.25], [0, 0, 0]], np.float32)},
        scheme={"b": "int4", "w": "int8"}, chunk_bytes=16)
    payload = b"".join(bytes(messages.parse_frame(f)[1]) for f in frames[1:])
    assert payload == hexes(r"\npayload \(20 bytes\)") == hexes(r"\nb  \(int4") + hexes(r"\nw  \(int8")
    assert f"crc32c(payload) = {m.crc32c:#010x} = {m.crc32c}" in doc
    assert messages.checksum(b"123456789") == 0xE3069283 and "0xE3069283" in doc
    assert frames[0][:6] == bytes.fromhex("444c434f0200") and frames[1][:10] == bytes.fromhex("444c434f02004c000000")


def test_a_frame_from_another_partition_forms_its_own_set_and_never_touches_this_one():
    """H1 (issue #53): sets were keyed by id alone, so one stray chunk with another `count` on any
    topic dropped a contribution in flight, and a forged set elsewhere could complete it."""
    deltas, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    assert feed(asm, frames[:2]) == [None, None]                        # honest, in flight on topic|0
    stray = asm.add(*_chunk(m.id, 0, m.n_chunks + 1, b"z" * 8), now=0.0, offset=7, where="other|3")
    assert stray is None and asm.places(m.id) == ["topic|0", "other|3"] and asm.holds(m.id, "other|3")
    results = feed(asm, frames, order=list(range(2, len(frames))))
    done = results[-1]
    assert isinstance(done, Assembled) and done.where == "topic|0" and done.first_offset == 0 and done.conflicts == 0
    out = messages.decode_payload(done.manifest, done.payload)
    assert all(np.array_equal(out[k], deltas[k]) for k in deltas)
    (d,) = _ticks(asm, 0.0, 6.0)                                        # the stray set fails by itself
    assert d.id == m.id and d.where == "other|3" and d.first_offset == 7 and d.reason == "incomplete"
    assert len(asm) == 0 and asm.buffered == 0


def test_a_forged_set_with_a_known_id_elsewhere_assembles_apart_with_its_own_place():
    _, m, frames = contribution()
    _, forged, forged_frames = contribution(learner="us-1")
    forged_frames = [messages.frame({**messages.parse_frame(f)[0], "id": m.id}, bytes(messages.parse_frame(f)[1]))
                     for f in forged_frames]
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    got = []
    for i, (mine, theirs) in enumerate(zip(frames, forged_frames)):     # interleaved, as two partitions read
        got.append(asm.add(*messages.parse_frame(theirs), now=0.0, offset=100 + i, where="eu|1"))
        got.append(asm.add(*messages.parse_frame(mine), now=0.0, offset=i, where="topic|0"))
    honest, fake = [g for g in got if isinstance(g, Assembled)][::-1]
    assert (honest.where, honest.first_offset, honest.manifest) == ("topic|0", 0, m)
    assert (fake.where, fake.first_offset, fake.manifest.learner) == ("eu|1", 100, "us-1")


def test_a_repeated_chunk_keeps_its_first_copy_and_counts_one_with_other_bytes():
    """First wins: a producer retry repeats the same bytes; a copy with other bytes read after the
    honest one (a writer can only learn the id from the log) is ignored and said, never swapped in."""
    deltas, m, frames = contribution()
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    feed(asm, frames[:2])
    h, p = messages.parse_frame(frames[1])
    assert asm.add(h, p, now=0.0, offset=2, where="topic|0") is None                 # a retry: same bytes
    assert asm.add(h, b"\xff" * len(p), now=0.0, offset=3, where="topic|0") is None  # other bytes: ignored
    held = asm.buffered
    done = feed(asm, frames, order=list(range(2, len(frames))))[-1]
    assert held == len(frames[1]) + messages.CHUNK_OVERHEAD and done.conflicts == 1
    out = messages.decode_payload(done.manifest, done.payload)
    assert all(np.array_equal(out[k], deltas[k]) for k in deltas)
    feed(asm, frames[1:2])                                                           # a set that fails says so
    asm.add(h, b"\x00" * len(p), now=0.0, where="topic|0")
    (d,) = _ticks(asm, 0.0, 6.0)
    assert d.reason == "incomplete" and "1 repeated chunks with other bytes ignored" in d.detail


# --- tensors in blocks, and payloads written by several hosts ------------------------------------

def _grid(rng: random.Random, shape: tuple[int, ...]) -> list[tuple]:
    """A random grid of blocks over `shape`: each axis cut at random points."""
    spans = []
    for n in shape:
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(3, n - 1)))) if n > 1 else []
        spans.append(list(zip([0, *cuts], [*cuts, n])))
    return [tuple(c) for c in itertools.product(*spans)]


def _blocked(x: np.ndarray, blocks, scheme: str, hosts: int, rng: random.Random):
    """(manifest, payload) of x sent as `blocks` by `hosts` hosts, each a random share of them, the
    frames through part_frames and a ChunkAssembler in a random order."""
    from diloco import quantize
    owner = {b: rng.randrange(hosts) for b in blocks}
    specs = [[messages.TensorSpec("w", x.shape, scheme, quantize.encoded_nbytes(tuple(e - s for s, e in b), scheme),
                                  None if len(blocks) == 1 else b)
              for b in sorted(blocks) if owner[b] == h] for h in range(hosts)]
    parts = [messages.part_payload(mine, {("w", t.block): quantize.coded(x[messages.slices(b)], scheme)
                                          for t, b in zip(mine, sorted(b for b in blocks if owner[b] == h))})
             for h, mine in enumerate(specs)]
    crcs = [messages.checksum(p) for p in parts]
    frames = []
    for h in range(hosts):
        frames += messages.part_frames(cid="c1", host=h, specs=specs, crcs=crcs, payload=parts[h], chunk_bytes=7,
                                       run="r", learner="us-0", region="us", fragment=0, base_version=0, tokens=1,
                                       steps=1, step_time=0.1)[1]
    rng.shuffle(frames)
    (got,) = [r for r in feed(ChunkAssembler(max_bytes=1 << 20, timeout_s=5), frames) if r is not None]
    return got


@pytest.mark.parametrize("scheme", ["fp32", "bf16", "int8", "int4", "int2", "topk"])
def test_any_grid_of_blocks_from_any_hosts_decodes_to_the_whole_tensor(scheme):
    from diloco import quantize
    from diloco.syncer import fused
    rng, nrng = random.Random(scheme), np.random.default_rng(0)
    for _ in range(25):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        x = nrng.normal(size=shape).astype(np.float32)
        blocks = _grid(rng, shape)
        got = _blocked(x, blocks, scheme, rng.randint(1, 3), rng)
        assert isinstance(got, Assembled), (shape, blocks, got)
        decoded = messages.decode_payload(got.manifest, got.payload)["w"]
        expect = np.zeros(shape, np.float32)
        for b in blocks:
            expect[messages.slices(b)] = quantize.roundtrip(x[messages.slices(b)], scheme)
        np.testing.assert_array_equal(decoded, expect)
        np.testing.assert_array_equal(fused.encoded_delta(got.manifest, got.payload).decode()["w"], expect)
        if len(shape) > 1 and all(b[1:] == tuple((0, n) for n in shape[1:]) for b in blocks) and scheme != "topk":
            np.testing.assert_array_equal(decoded, quantize.roundtrip(x, scheme))  # rows: the whole tensor's codes


def _tensor(block=None, shape=(4, 6)):
    """An fp32 entry of tensor w, whole or (`block`: [[start, stop], ...] as JSON) one block of it."""
    coded = shape if block is None else [max(p[1] - p[0], 0) if isinstance(p, list) and len(p) == 2 else 1
                                         for p in block]
    t = {"name": "w", "shape": list(shape), "scheme": "fp32", "nbytes": 4 * int(np.prod(coded))}
    return t if block is None else t | {"block": block}


def _header(tensors: list) -> dict:
    return contribution()[1].to_header() | {"tensors": tensors, "total_bytes": sum(t["nbytes"] for t in tensors)}


BROKEN_TILINGS = [
    ([None, None], "is repeated"),
    ([None, [[0, 2], [0, 6]]], "with and without a block"),
    ([[[0, 2], [0, 6]], None], "with and without a block"),
    ([[[0, 3], [0, 6]], [[2, 4], [0, 6]]], "overlap along axis 0"),
    ([[[0, 2], [0, 6]], [[3, 4], [0, 6]]], "leave a gap along axis 0"),
    ([[[0, 2], [0, 6]], [[2, 3], [0, 6]]], "leave a gap along axis 0 from 3 to 4"),
    ([[[0, 2], [0, 6]], [[0, 2], [0, 6]], [[2, 4], [0, 6]]], "repeated"),
    ([[[0, 2], [0, 3]], [[2, 4], [0, 6]]], "overlap along axis 1"),
    ([[[0, 2], [0, 3]], [[0, 2], [3, 6]], [[2, 4], [0, 3]]], "do not cover"),
    ([[[0, 4], [0, 7]]], "not a non-empty span of axis 1"),
    ([[[2, 2], [0, 6]], [[0, 4], [0, 6]]], "not a non-empty span of axis 0"),
    ([[[0, 4]]], r"one \[start, stop\] pair of integers per axis"),
    ([[[0, 4], [0, True]]], r"one \[start, stop\] pair of integers per axis"),
]


@pytest.mark.parametrize("blocks,why", BROKEN_TILINGS)
def test_blocks_that_do_not_tile_their_tensor_are_malformed_naming_it(blocks, why):
    header = _header([_tensor(b) for b in blocks])
    with pytest.raises(WireError, match=why) as err:
        messages.Manifest.from_header(header)
    assert "'w'" in str(err.value)
    with pytest.raises(WireError, match=why):  # an assembler refuses the frame the same way (malformed)
        feed(ChunkAssembler(max_bytes=1 << 20, timeout_s=5), [messages.frame(header)])


def test_random_broken_tilings_are_refused_and_valid_ones_read():
    """Random grids read; the same with one block dropped, repeated, grown or shrunk by one along an
    axis (a gap, an overlap, a block outside the tensor or an empty one) are refused."""
    rng = random.Random(7)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        blocks = [[list(p) for p in b] for b in _grid(rng, shape)]
        if len(blocks) > 1 or rng.random() < 0.5:
            messages.Manifest.from_header(_header([_tensor(b, shape) for b in blocks]))
        change, i = rng.choice(["drop", "repeat", "grow", "shrink"]), rng.randrange(len(blocks))
        if change == "drop":
            if len(blocks) == 1:
                continue
            blocks.pop(i)
        elif change == "repeat":
            blocks.append(blocks[i])
        else:
            blocks[i][rng.randrange(len(shape))][1] += 1 if change == "grow" else -1
        with pytest.raises(WireError, match="'w'"):
            messages.Manifest.from_header(_header([_tensor(b, shape) for b in blocks]))


def test_an_unblocked_manifest_reads_and_writes_byte_for_byte_as_before():
    _, m, frames = contribution()
    assert b'"block"' not in frames[0]
    header = messages.parse_frame(frames[0])[0]
    assert messages.frame(messages.Manifest.from_header(header).to_header()) == frames[0]


def test_crc32c_combine_is_the_crc_of_the_concatenation():
    import crc32c
    rng = random.Random(3)
    for _ in range(200):
        a = rng.randbytes(rng.choice([0, 1, 2, rng.randrange(3000)]))
        b = rng.randbytes(rng.choice([0, 1, 3, rng.randrange(70000)]))
        assert messages.crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    # three parts, as three hosts' bytes
    parts = [rng.randbytes(n) for n in (5, 0, 1000)]
    crc = crc32c.crc32c(parts[0])
    for p in parts[1:]:
        crc = messages.crc32c_combine(crc, crc32c.crc32c(p), len(p))
    assert crc == crc32c.crc32c(b"".join(parts))
