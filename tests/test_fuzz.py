"""Structured fuzzing of what crosses the wire, in process (no services).

Valid contribution frames, events and announcements are built with the project's own encoders, then
mutated one field or one byte range at a time: a value of the wrong type, out of range, huge,
negative, NaN or infinite, nested deeply, too long; claims that contradict the payload; chunk sets
that contradict their manifest. The property is always the same: a message decodes to something
self-consistent or is refused with a `WireError` that names what is wrong in bounded text (or, for a
chunk set, dropped with a reason); never another exception, never a silently wrong value. Decoded
contributions then go through the syncer's own validation and merge, checked against the NumPy
reference math (syncer/merge.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from diloco import messages, quantize
from diloco.config import build_config
from diloco.learners.fetcher import Fetcher
from diloco.learners.publisher import Counters
from diloco.messages import Assembled, ChunkAssembler, Dropped, WireError
from diloco.plan import Plan, Tensor
from diloco.syncer import fused
from diloco.syncer import merge as ref
from diloco.syncer import rounds
from diloco.syncer.intake import Intake
from diloco.syncer.registry import LearnerRegistry
from diloco.syncer.records import Contribution, Where
from diloco.syncer.rounds import FragmentState, Pending
from diloco.syncer.syncer import Syncer

FUZZ = settings(max_examples=200, deadline=None)
MAX_ERROR_CHARS = 400
DIGITS = "@digits@"  # stands for a JSON integer of 5000 digits (past Python's int-from-text limit)


def nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


# Values that no field should take quietly: wrong types, out of range, huge, negative, NaN/inf,
# deeply nested, too long.
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4), st.just("x" * 5000), st.just(""),
    st.integers(-3, 3), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([10 ** 4000, -(10 ** 4000), 2 ** 64, DIGITS]),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]), st.floats(),
    st.lists(st.integers(-2, 2), max_size=3), st.just([0] * 10_000),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.integers(1, 500).map(nested),
)


def wire(header: dict, payload: bytes = b"") -> bytes:
    """messages.frame, except that DIGITS becomes a 5000-digit integer in the JSON text."""
    head = json.dumps(header, separators=(",", ":")).replace(json.dumps(DIGITS), "9" * 5000).encode()
    return messages._PREFIX.pack(messages.MAGIC, messages.WIRE_VERSION, len(head)) + head + payload


def event_bytes(ev: dict) -> bytes:
    return json.dumps(ev).replace(json.dumps(DIGITS), "9" * 5000).encode()


def bounded_error(err: Exception, *words: str) -> None:
    """A refusal says what is wrong, briefly."""
    text = str(err)
    assert len(text) <= MAX_ERROR_CHARS, text[:200]
    flat = text.lower().replace("-", "")
    assert any(w.lower() in flat for w in words), f"{text!r} names none of {words}"


# --- contributions: valid ones, then mutations ---------------------------------------------------

FINITE32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
META = st.fixed_dictionaries({
    "run": st.text(max_size=12), "learner": st.text(max_size=12), "region": st.text(max_size=6),
    "fragment": st.integers(0, 2 ** 31), "base_version": st.integers(0, messages.MAX_COUNT - 1),
    "tokens": st.integers(1, messages.MAX_COUNT - 1), "steps": st.integers(1, messages.MAX_COUNT - 1),
    "step_time": st.floats(0, 1e6),
})


@dataclasses.dataclass(frozen=True)
class Sent:
    """A valid contribution as its learner encoded it."""
    deltas: dict[str, np.ndarray]
    codecs: dict[str, str]
    manifest: messages.Manifest
    frames: list[bytes]
    chunk_bytes: int

    @property
    def payload(self) -> bytes:
        return b"".join(quantize.encode(self.deltas[t.name], t.scheme) for t in self.manifest.tensors)


@st.composite
def contributions(draw, max_tensors=3):
    """A valid contribution: random names, shapes (0-3 dims, empty ones too), values (any finite
    float32), codecs and chunk size."""
    shapes = draw(st.dictionaries(st.text("abcxyz._", min_size=1, max_size=6),
                                  st.lists(st.integers(0, 6), max_size=3).map(tuple), min_size=1, max_size=max_tensors))
    deltas = {n: draw(arrays(np.float32, s, elements=FINITE32)) for n, s in shapes.items()}
    codecs = {n: draw(st.sampled_from(quantize.SCHEMES)) for n in shapes}
    total = sum(quantize.encoded_nbytes(s, codecs[n]) for n, s in shapes.items())
    chunk_bytes = draw(st.integers(max(1, total // 12), total + 8))
    manifest, frames = messages.encode_contribution(deltas=deltas, scheme=codecs, chunk_bytes=chunk_bytes, **draw(META))
    # one creation time, so that frames of the same draws have the same length (ids are all 32 hex digits)
    manifest = dataclasses.replace(manifest, created=1.7e9)
    return Sent(deltas, codecs, manifest, [messages.frame(manifest.to_header()), *frames[1:]], chunk_bytes)


def assemble(frames: list[bytes], order=None):
    """What a syncer makes of these records: a WireError, a Dropped set, or (Assembled, decoded)."""
    asm = ChunkAssembler(max_bytes=1 << 20, timeout_s=5, tick_s=10)
    try:
        for i in order if order is not None else range(len(frames)):
            header, payload = messages.parse_frame(frames[i])
            got = asm.add(header, payload, now=0.0, offset=i, where="t|0")
            if isinstance(got, Dropped):
                return got
            if isinstance(got, Assembled):
                return got, messages.decode_payload(got.manifest, got.payload)
        asm.expire(now=0.0)
        return asm.expire(now=10.0)[0]  # never complete: dropped as incomplete (one check 10 s after the first)
    except WireError as err:
        return err


def offsets(m: messages.Manifest) -> dict[str, tuple[messages.TensorSpec, int]]:
    out, pos = {}, 0
    for t in m.tensors:
        out[t.name] = (t, pos)
        pos += t.nbytes
    return out


def assert_self_consistent(assembled: Assembled, decoded: dict, sent: Sent):
    """Decoded tensors are exactly the manifest's claims over the payload's bytes, and a tensor
    whose claims and bytes were not touched decodes to what the encoder sent."""
    m, payload = assembled.manifest, assembled.payload
    assert messages.checksum(payload) == m.crc32c and len(payload) == m.total_bytes
    assert list(decoded) == [t.name for t in m.tensors]
    before = offsets(sent.manifest)
    for name, (t, pos) in offsets(m).items():
        x = decoded[name]
        assert x.dtype == np.float32 and x.shape == t.shape
        np.testing.assert_array_equal(x, quantize.decode(payload[pos:pos + t.nbytes], t.shape, t.scheme))
        if before.get(name) == (t, pos) and payload[pos:pos + t.nbytes] == sent.payload[pos:pos + t.nbytes]:
            np.testing.assert_array_equal(x, quantize.roundtrip(sent.deltas[name], t.scheme))


@FUZZ
@given(contributions(), st.data())
def test_a_valid_contribution_round_trips_exactly_in_any_order(sent, data):
    manifest, frames, payload = sent.manifest, sent.frames, sent.payload
    assert manifest.n_chunks == len(frames) - 1 == max(1, math.ceil(len(payload) / sent.chunk_bytes))
    assert messages.Manifest.from_header(messages.parse_frame(frames[0])[0]) == manifest
    got = assemble(frames, data.draw(st.permutations(range(len(frames)))))
    assert isinstance(got, tuple), got
    assembled, decoded = got
    assert assembled.manifest == manifest and assembled.payload == payload and assembled.first_offset == 0
    assert list(decoded) == sorted(sent.deltas)
    for n, x in sent.deltas.items():
        want = quantize.roundtrip(x, sent.codecs[n])
        assert decoded[n].dtype == np.float32 and decoded[n].shape == x.shape
        np.testing.assert_array_equal(decoded[n], want)
        if sent.codecs[n] == "fp32":
            np.testing.assert_array_equal(decoded[n], x)


@given(contributions(), st.integers(16, 4096), st.data())
def test_a_packed_contribution_decodes_to_what_its_unpacked_twin_does(sent, chunk_bytes, data):
    m = sent.manifest
    manifest, frames = messages.encode_contribution(
        run=m.run, learner=m.learner, region=m.region, fragment=m.fragment, base_version=m.base_version,
        tokens=m.tokens, steps=m.steps, step_time=m.step_time, deltas=sent.deltas, scheme=sent.codecs,
        chunk_bytes=chunk_bytes, packing="zstd")
    assert manifest.codes_bytes == len(sent.payload)
    # packed where the frame is smaller than the codes (tiny or random ones travel as they are)
    assert (manifest.total_bytes < manifest.codes_bytes) if manifest.packing == "zstd" else (
        manifest.packing == "none" and manifest.total_bytes == manifest.codes_bytes)
    assert messages.Manifest.from_header(messages.parse_frame(frames[0])[0]) == manifest
    got = assemble(frames, data.draw(st.permutations(range(len(frames)))))
    assert isinstance(got, tuple), got
    assembled, decoded = got
    assert len(assembled.payload) == manifest.total_bytes and list(decoded) == sorted(sent.deltas)
    for n, x in sent.deltas.items():
        np.testing.assert_array_equal(decoded[n], quantize.roundtrip(x, sent.codecs[n]))


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_empty_tensors_round_trip_in_every_codec(scheme):
    """Found by the fuzz: int8 / int4 could not encode a row of no values (a max of nothing), nor
    int4 decode zero rows (a reshape to (0, -1))."""
    deltas = {"rows0": np.zeros((0, 3), np.float32), "cols0": np.zeros((3, 0), np.float32), "e": np.zeros(0, np.float32)}
    manifest, frames = messages.encode_contribution(
        run="r", learner="l", region="g", fragment=0, base_version=0, tokens=1, steps=1, step_time=0.1,
        deltas=deltas, scheme=scheme, chunk_bytes=64)
    assembled, decoded = assemble(frames)
    assert {n: x.shape for n, x in decoded.items()} == {n: x.shape for n, x in deltas.items()}


TENSOR_FIELDS = ("name", "shape", "scheme", "nbytes")


@st.composite
def field_mutations(draw, header: dict):
    """(path, new header): one field of a manifest header (top level, a tensor's, a shape's element)
    replaced by a hostile value, removed, or an unknown field added."""
    h = copy.deepcopy(header)
    where = draw(st.sampled_from(["top", "tensor", "dim", "unknown"]))
    if where == "unknown":
        h[draw(st.text(max_size=8).filter(lambda k: k not in h))] = draw(HOSTILE)
        return ("unknown",), h
    if where == "top":
        key = draw(st.sampled_from(sorted(h)))
        target, path = h, (key,)
    else:
        i = draw(st.integers(0, len(h["tensors"]) - 1))
        key = draw(st.sampled_from(TENSOR_FIELDS))
        target, path = h["tensors"][i], ("tensors", key)
        if where == "dim" and target["shape"]:
            target, key, path = target["shape"], draw(st.integers(0, len(target["shape"]) - 1)), ("tensors", "shape")
    if draw(st.integers(0, 9)) == 0 and isinstance(target, dict):
        del target[key]
    else:
        target[key] = draw(HOSTILE)
    return path, h


WORDS = {  # besides the field's own name, what a refusal may call it
    "kind": ("kind",), "id": ("id",), "crc32c": ("checksum", "crc32c"), "n_chunks": ("n_chunks", "chunk"),
    "total_bytes": ("total_bytes", "payload has"),
    "tensors": ("tensor", "total_bytes", "nbytes", "payload has"),  # a tensor's claim may only show in the sum
}


@FUZZ
@given(contributions(max_tensors=2), st.data())
def test_a_mutated_manifest_field_decodes_consistently_or_is_refused_naming_it(sent, data):
    path, mutated = data.draw(field_mutations(messages.parse_frame(sent.frames[0])[0]))
    got = assemble([wire(mutated), *sent.frames[1:]])
    if isinstance(got, WireError):
        bounded_error(got, path[0], *WORDS.get(path[0], ()), "header is not json")  # the last: DIGITS
    elif isinstance(got, Dropped):
        assert got.reason in ("malformed", "oversized", "incomplete")
    else:
        assembled, decoded = got
        for key, value in assembled.manifest.to_header().items():  # nothing was changed on the way in
            if key != "tensors":
                assert value == (float(mutated[key]) if key in ("step_time", "created") else mutated[key]), key
                assert math.isfinite(value) if isinstance(value, float) else True, key
        assert_self_consistent(assembled, decoded, sent)


def _header_of(**changes):
    m, frames = messages.encode_contribution(
        run="r", learner="us-0", region="us", fragment=0, base_version=0, tokens=10, steps=2, step_time=0.1,
        deltas={"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, scheme="fp32", chunk_bytes=1 << 20)
    h, _ = messages.parse_frame(frames[0])
    for path, value in changes.items():
        target = h
        *head, last = path.split(".")
        for part in head:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(last) if last.isdigit() else last] = value
    return m, frames, h


@pytest.mark.parametrize("change, words", [  # what the fuzz found: each raised something else, or passed
    ({"step_time": 10 ** 400}, "step_time"),                 # OverflowError converting it to float
    ({"created": math.nan}, "created"),                      # accepted, and NaN went on into the round's meta
    ({"run": DIGITS}, "json"),                               # ValueError (int digit limit), not a WireError
])
def test_what_the_manifest_fuzz_found_is_refused_naming_the_field(change, words):
    m, frames, h = _header_of(**change)
    got = assemble([wire(h), *frames[1:]])
    assert isinstance(got, WireError), got
    bounded_error(got, words)


@pytest.mark.parametrize("shape, payload", [  # found by the fuzz: ValueError from numpy's reshape on decode
    ([0, 10 ** 30], b""), ([0, 2 ** 52, 2 ** 52], b""), ([1] * 100, b"\0" * 4)])
def test_a_shape_no_array_can_have_is_refused_naming_it(shape, payload):
    m, _, h = _header_of()
    h["tensors"][0] |= {"shape": shape, "nbytes": len(payload)}
    h |= {"total_bytes": len(payload), "crc32c": messages.checksum(payload)}
    got = assemble([wire(h), *_chunks(h["id"], payload, 64)])
    assert isinstance(got, WireError), got
    bounded_error(got, "shape")


def test_a_tensor_named_twice_is_refused_not_merged_from_one_of_its_slices():
    """Found by the fuzz: two tensors of one name decoded into one dict entry (the last slice), and
    the syncer's shape check, a dict comparison, could not tell."""
    m, frames, h = _header_of()
    payload = bytes(messages.parse_frame(frames[1])[1])
    h["tensors"] = [h["tensors"][0], dict(h["tensors"][0])]
    h |= {"total_bytes": 2 * len(payload), "crc32c": messages.checksum(payload * 2)}
    got = assemble([wire(h), wire({"kind": "chunk", "id": h["id"], "index": 0, "count": 1}, payload * 2)])
    assert isinstance(got, WireError) and "repeated" in str(got)


def _chunks(cid: str, payload: bytes, chunk_bytes: int) -> list[bytes]:
    n = max(1, math.ceil(len(payload) / chunk_bytes))
    return [messages.frame({"kind": "chunk", "id": cid, "index": i, "count": n},
                           payload[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(n)]


STRUCTURAL = ("shape", "scheme", "unknown_scheme", "nbytes", "total_bytes", "n_chunks", "crc32c", "truncate",
              "extend", "flip", "drop_chunk", "repeat_chunk", "chunk_index", "chunk_count", "chunk_id")


@FUZZ
@given(contributions(max_tensors=2), st.sampled_from(STRUCTURAL), st.booleans(), st.data())
def test_claims_that_contradict_the_payload_are_refused_or_consistent(sent, what, resign, data):
    """Shape and codec claims against the payload, chunk counts, indexes and totals against the
    manifest, the payload truncated, extended or flipped, the checksum wrong. With `resign` the
    attacker also fixes up total_bytes, crc32c and the chunk set, so the deeper checks are reached."""
    h = copy.deepcopy(messages.parse_frame(sent.frames[0])[0])
    payload, chunk_bytes = sent.payload, sent.chunk_bytes
    t = h["tensors"][data.draw(st.integers(0, len(h["tensors"]) - 1))]
    if what == "shape":
        t["shape"] = data.draw(st.one_of(st.lists(st.integers(0, 12), max_size=4),
                                         st.just(t["shape"] + [1]), st.just(t["shape"][::-1])))
    elif what == "scheme":
        t["scheme"] = data.draw(st.sampled_from(quantize.SCHEMES))
    elif what == "unknown_scheme":
        t["scheme"] = data.draw(st.sampled_from(["fp8", "FP32", "int3", "", "pickle"]))
    elif what in ("nbytes", "total_bytes", "n_chunks"):
        target = t if what == "nbytes" else h
        target[what] += data.draw(st.sampled_from([-3, -2, -1, 1, 2, 3]))
    elif what == "crc32c":
        h["crc32c"] ^= 1 << data.draw(st.integers(0, 31))
    elif what == "truncate":
        payload = payload[:data.draw(st.integers(0, max(0, len(payload) - 1)))]
    elif what == "extend":
        payload += data.draw(st.binary(min_size=1, max_size=9))
    elif what == "flip" and payload:
        i = data.draw(st.integers(0, len(payload) - 1))
        payload = payload[:i] + bytes([payload[i] ^ (1 << data.draw(st.integers(0, 7)))]) + payload[i + 1:]
    if resign:
        h |= {"total_bytes": len(payload), "crc32c": messages.checksum(payload)}
        if what in ("shape", "scheme", "unknown_scheme", "nbytes"):  # claims in bytes that add up again
            t["nbytes"] += len(payload) - sum(x["nbytes"] for x in h["tensors"])
        h["n_chunks"] = max(1, math.ceil(len(payload) / chunk_bytes))
    chunks = _chunks(sent.manifest.id, payload, chunk_bytes)
    if what in ("drop_chunk", "repeat_chunk"):
        i = data.draw(st.integers(0, len(chunks) - 1))
        chunks = chunks[:i] + chunks[i + 1:] if what == "drop_chunk" else chunks + [chunks[i]]
    elif what in ("chunk_index", "chunk_count", "chunk_id"):
        i = data.draw(st.integers(0, len(chunks) - 1))
        ch = messages.parse_frame(chunks[i])
        key = what.split("_")[1]
        bad = data.draw(st.one_of(HOSTILE, st.integers(-2, len(chunks) + 2)))
        chunks[i] = wire({**ch[0], key: bad}, bytes(ch[1]))
    got = assemble([wire(h), *chunks])
    if isinstance(got, WireError):
        bounded_error(got, "tensor", "payload", "checksum", "manifest", "id", "scheme", "shape", "json", "kind")
    elif isinstance(got, Dropped):  # its detail is cut to size where the syncer reports it (Syncer._reject)
        assert got.reason in ("malformed", "oversized", "incomplete")
    else:
        assert_self_consistent(*got, sent)


@st.composite
def frame_byte_mutations(draw):
    """A valid manifest or chunk frame with its bytes cut, flipped, spliced or replaced by other JSON."""
    raw = bytearray(draw(st.sampled_from(draw(contributions(max_tensors=2)).frames)))
    how = draw(st.sampled_from(["cut", "flip", "splice", "json", "prefix"]))
    if how == "cut":
        return bytes(raw[:draw(st.integers(0, len(raw) - 1))])
    if how == "flip":
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] ^= draw(st.integers(1, 255))
    elif how == "splice":
        i = draw(st.integers(0, len(raw)))
        raw[i:i] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"\xff\xfe", b"[" * 5000, b"\x00"]))
    elif how == "json":  # any JSON at all as the header
        value = draw(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                                  lambda inner: st.lists(inner, max_size=3) |
                                  st.dictionaries(st.sampled_from(["kind", "id", "index", "count", "tensors"]) |
                                                  st.text(max_size=3), inner, max_size=4), max_leaves=10))
        return wire(value if not isinstance(value, dict) else {"kind": draw(st.sampled_from(["manifest", "chunk"])),
                                                                "id": "x", **value}, b"xyz")
    else:  # a header length or version that lies
        version, hlen = draw(st.integers(0, 2 ** 16 - 1)), draw(st.integers(0, 2 ** 32 - 1))
        return messages._PREFIX.pack(messages.MAGIC, version, hlen) + bytes(raw[messages._PREFIX.size:])
    return bytes(raw)


@FUZZ
@given(frame_byte_mutations())
def test_damaged_frame_bytes_are_a_wire_error_never_another_exception(raw):
    try:
        header, payload = messages.parse_frame(raw)
        ChunkAssembler(max_bytes=1 << 16, timeout_s=1).add(header, payload, now=0)
    except WireError as err:
        assert len(str(err)) <= MAX_ERROR_CHARS


# --- events and announcements ---------------------------------------------------------------------

COUNT = st.integers(0, messages.MAX_COUNT - 1)
SECONDS = st.floats(0, 1e6)
LEARNER_IDS = ("us-0", "us-1", "eu-0", "eu-1")


def heartbeats():
    """A heartbeat as Session._beat sends it (fields from learners/session.py)."""
    return st.fixed_dictionaries({
        "run": st.just("run"), "source": st.just("learner"), "learner": st.sampled_from(LEARNER_IDS),
        "region": st.sampled_from(["us", "eu"]), "incarnation": st.text("0123456789abcdef", min_size=8, max_size=8),
        "start_step": COUNT, "published": COUNT, "bytes_sent": COUNT, "bytes_fetched": COUNT, "versions_applied": COUNT,
        "step": COUNT, "tokens": COUNT, "loss": st.none() | st.floats(-1e6, 1e6), "step_time": SECONDS,
        "compute_s": SECONDS, "at": st.floats(1.6e9, 4e9), "state": st.sampled_from(["running", "finished"]),
        "versions": st.dictionaries(st.integers(0, 64).map(str), COUNT, max_size=4)})


# Every kind the syncer and learners emit (grep `event(` in syncer/ and learners/), with its fields.
IDS = st.text("0123456789abcdef", min_size=32, max_size=32)
EVENT_FIELDS = {
    "heartbeat": heartbeats(),
    "version": st.fixed_dictionaries({"run": st.just("run"), "fragment": st.integers(0, 3), "version": COUNT,
                                      "store": st.text(max_size=20)}),
    "syncer_started": st.fixed_dictionaries({"shard": st.integers(0, 8), "fragments": st.lists(st.integers(0, 3)),
                                             "versions": st.dictionaries(st.integers(0, 3).map(str), COUNT),
                                             "pending": COUNT}),
    "syncer_stopped": st.fixed_dictionaries({"shard": st.integers(0, 8),
                                             "versions": st.dictionaries(st.integers(0, 3).map(str), COUNT)}),
    "fragment_claimed": st.fixed_dictionaries({"fragment": st.integers(0, 3), "shard": st.integers(0, 8),
                                               "epoch": COUNT, "version": COUNT, "pending": COUNT,
                                               "previous": st.none() | st.text(max_size=16)}),
    "fragment_released": st.fixed_dictionaries({"fragment": st.integers(0, 3), "shard": st.integers(0, 8),
                                                "reason": st.text(max_size=40)}),
    "fragment_state_approximate": st.fixed_dictionaries({"fragment": st.integers(0, 3), "snapshot": COUNT,
                                                         "version": COUNT, "reason": st.text(max_size=40)}),
    "learner_joined": st.fixed_dictionaries({"learner": st.sampled_from(LEARNER_IDS), "incarnation": IDS,
                                             "step": COUNT, "was": st.none() | st.sampled_from(["silent", "dropped"])}),
    "learner_silent": st.fixed_dictionaries({"learner": st.sampled_from(LEARNER_IDS), "last_step": COUNT,
                                             "silent_s": SECONDS}),
    "learner_dropped": st.fixed_dictionaries({"learner": st.sampled_from(LEARNER_IDS), "silent_s": SECONDS}),
    "contribution_accepted": st.fixed_dictionaries({"id": IDS, "learner": st.sampled_from(LEARNER_IDS),
                                                    "region": st.sampled_from(["us", "eu"]), "fragment": st.integers(0, 3),
                                                    "base_version": COUNT, "version": COUNT, "tokens": COUNT,
                                                    "bytes": COUNT}),
    "contribution_rejected": st.fixed_dictionaries({"id": st.none() | IDS, "reason": st.text(max_size=20),
                                                    "detail": st.text(max_size=300)}),
    "merge": st.fixed_dictionaries({"fragment": st.integers(0, 3), "version": COUNT, "ids": st.lists(IDS, max_size=3),
                                    "learners": st.lists(st.sampled_from(LEARNER_IDS), max_size=3), "tokens": COUNT,
                                    "late": COUNT, "reason": st.text(max_size=10),
                                    "missing": st.lists(st.sampled_from(LEARNER_IDS), max_size=3),
                                    "seconds": SECONDS}),
}


@st.composite
def events(draw):
    kind = draw(st.sampled_from(sorted(EVENT_FIELDS)))
    return kind, draw(EVENT_FIELDS[kind])


@FUZZ
@given(events())
def test_every_event_kind_round_trips(ev):
    kind, fields = ev
    fields = {k: np.int64(v) if type(v) is int else v for k, v in fields.items()}  # as the syncer passes numbers
    got = messages.parse_event(messages.event(kind, **fields))
    assert got is not None and got["kind"] == kind and got["schema"] == messages.EVENT_SCHEMA
    assert isinstance(got["eid"], str) and math.isfinite(got["time"])
    assert {k: got[k] for k in fields} == json.loads(json.dumps(fields, default=int))


@st.composite
def mutated_events(draw, valid):
    """(field, record bytes): a valid event with one field replaced by a hostile value or removed,
    the envelope (schema, kind) broken, or the bytes cut or corrupted."""
    ev = {"schema": messages.EVENT_SCHEMA, "eid": "e" * 32, "time": 1.7e9, **draw(valid)}
    ev.setdefault("kind", "heartbeat")
    how = draw(st.sampled_from(["field", "field", "field", "drop", "bytes"]))
    key = draw(st.sampled_from(sorted(ev))) if how != "bytes" else None
    if how == "drop":
        del ev[key]
    elif how == "field":
        ev[key] = draw(HOSTILE | st.dictionaries(st.text(max_size=3), HOSTILE, max_size=3))
    raw = event_bytes(ev)
    if how == "bytes":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.sampled_from([b"", b"\xff", b"]]", b"[" * 3000])) + raw[i + draw(st.integers(0, 3)):]
    return key, raw


class _Counts:
    """The one write of LearnerRegistry.heard that reaches Redis when it refuses a beat: a count."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1


def _typed_and_finite(hb: dict) -> None:
    for key in ("step", "start_step", "tokens", "published", "bytes_sent", "bytes_fetched", "versions_applied"):
        assert key not in hb or (type(hb[key]) is int and 0 <= hb[key] < messages.MAX_COUNT), key
    for key in ("step_time", "compute_s", "at", "loss"):
        assert hb.get(key) is None or (type(hb[key]) in (int, float) and math.isfinite(hb[key])), key
    for key in ("incarnation", "region"):
        assert key not in hb or (type(hb[key]) is str and len(hb[key]) <= 64), key
    for k, v in hb.get("versions", {}).items():
        assert int(k) >= 0 and type(v) is int and 0 <= v < messages.MAX_COUNT
    assert hb.get("state", "running") in ("running", "finished") and hb["learner"] in LEARNER_IDS


@FUZZ
@given(mutation=mutated_events(heartbeats()))
@example(mutation=("learner", json.dumps({"schema": 1, "kind": "heartbeat", "learner": ["us-0"]}).encode()))  # unhashable
@example(mutation=("versions", json.dumps({"schema": 1, "kind": "heartbeat", "learner": "us-0",
                                           "versions": {"\u00b2": 1}}).encode()))  # '²'.isdigit(); int('²') raises
@example(mutation=("at", b'{"schema": 1, "kind": "heartbeat", "learner": "us-0", "at": 1' + b"0" * 400 + b"}"))  # OverflowError
def test_a_mutated_heartbeat_is_refused_or_reaches_the_registry_typed_and_finite(syncer, mutation):
    key, raw = mutation
    syncer.registry = LearnerRegistry(syncer.cfg, _Counts(), emit=None)  # a follower's: it emits nothing
    ev = messages.parse_event(raw)
    syncer.handle_event(raw)        # what the syncer does with the record: never raises
    if syncer.registry:
        (hb,) = syncer.registry.values()
        _typed_and_finite(hb)
        assert hb["status"] in ("alive", "finished")
    elif ev is not None and ev["kind"] == "heartbeat" and ev.get("learner") in LEARNER_IDS:
        assert syncer.registry.state.counts == {"bad_events": 1}
        with pytest.raises(WireError) as err:
            messages.clean_heartbeat(ev)
        bounded_error(err.value, *([key] if key else ["field", "learner"]))


@FUZZ
@given(mutation=mutated_events(EVENT_FIELDS["version"].map(lambda f: {"kind": "version", **f})))
def test_a_mutated_announcement_is_skipped_or_read_as_what_it_says(fetcher, mutation):
    _, raw = mutation
    p, v = fetcher._announced(raw)
    if p is None:
        assert v == -1
        return
    ev = messages.parse_event(raw)
    assert (p, v) == (ev["fragment"], ev["version"]) and ev["run"] == "run" and ev["kind"] == "version"
    assert type(p) is int and type(v) is int and 0 <= p < fetcher.plan.fragments and 0 <= v < messages.MAX_COUNT


# --- validation and merge of decoded contributions ------------------------------------------------

PLAN = Plan((Tensor("emb", (4, 3), "float32", 0, "mean"), Tensor("w", (2, 5), "float32", 0, "rda"),
             Tensor("b", (3,), "float32", 0, "rda"), Tensor("v", (2, 2), "float32", 1, "rda")), 2)
VERSION = 3  # of every fragment, for the staleness checks
REASONS = {"malformed", "oversized", "incomplete", "checksum", "wrong_run", "unknown_learner", "unknown_fragment",
           "wrong_shape", "bad_metadata", "future_version", "stale", "non_finite", "norm_budget"}


class _PlanStore:
    """What Syncer.__init__ reads from TensorStore: the run's plan."""

    def read_plan(self):
        return PLAN


def _fragments(cfg) -> dict[int, FragmentState]:
    opt = ref.outer_optimizer(cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
    rng = np.random.default_rng(0)
    out = {}
    for p, names in enumerate(PLAN.fragment_names):
        params = {n: rng.normal(size=PLAN.shapes[n]).astype(np.float32) for n in names}
        out[p] = FragmentState(VERSION, params, opt.init(ref.as_float32(params)))
    return out


def _config(**syncer_cfg):
    # the paper's outer step (Nesterov): its trace after one step is the merged delta, which the merge
    # property reads; no staleness discount, so the reference's token weights are the syncer's
    return build_config({"preset": "paper", "fragments": {"count": PLAN.fragments}, "syncer": syncer_cfg})


def make_syncer(**syncer_cfg) -> Syncer:
    """A syncer shard as it is after start(), minus the services (for its heartbeat handling)."""
    cfg = _config(**syncer_cfg)
    s = Syncer(cfg, "run", state=None, store=_PlanStore(), producer=None, consumer=None)
    s.fragments.update(_fragments(cfg))
    return s


@dataclass
class Shard:
    """What intake and a round's close need of a shard: the config, the members, the fragments."""
    cfg: object
    fragments: dict[int, FragmentState]

    @classmethod
    def make(cls, **syncer_cfg) -> "Shard":
        cfg = _config(**syncer_cfg)
        return cls(cfg, _fragments(cfg))

    def validate(self, m, payload):
        return Intake(self.cfg, "run", PLAN).check(m, payload, members=set(self.cfg.learner_ids()),
                                                   fragment=self.fragments.get(m.fragment))


@pytest.fixture(scope="module")
def syncer():
    fused.warm_up()
    return make_syncer()


@pytest.fixture(scope="module")
def fetcher():
    return Fetcher(None, "run", None, None, None, Counters(), PLAN)


VALUES = st.one_of(st.floats(-10, 10, width=32), st.sampled_from([0.0, 1e30, -3e38, math.inf, -math.inf, math.nan]))


LIES = {  # one claim of a contribution, made dishonest
    "run": st.just("other"), "learner": st.sampled_from(["nobody", "", "us-0" * 40]), "region": st.just("mars"),
    "fragment": st.sampled_from([1, 2, -1, 10 ** 30]), "base_version": st.sampled_from([-2, VERSION + 1, 10 ** 30]),
    "tokens": st.sampled_from([0, -5, 10 ** 30, messages.MAX_COUNT, 2 ** 24 * 101]),
    "steps": st.sampled_from([0, -1, 10 ** 30]), "step_time": st.sampled_from([-1.0, 1e7, math.nan, math.inf]),
    "shape": st.sampled_from([(1,), (), (0,), "reversed"]), "value": VALUES,
}


@st.composite
def claimed_contributions(draw):
    """The records of a contribution to fragment 0: honest, or with one claim (LIES) dishonest;
    its deltas zero, small, usual or past the norm budget."""
    lie = draw(st.sampled_from([None] * len(LIES) + sorted(LIES)))
    learner = draw(st.sampled_from(LEARNER_IDS))
    claims = {"run": "run", "learner": learner, "region": learner.split("-")[0], "fragment": 0,
              "base_version": draw(st.integers(-1, VERSION)), "tokens": draw(st.integers(1, 10 ** 5)),
              "steps": draw(st.integers(1, 100)), "step_time": draw(st.floats(0, 10))}
    if lie in claims:
        claims[lie] = draw(LIES[lie])
    shapes = {n: PLAN.shapes[n] for n in PLAN.fragment_names[0]}
    if lie == "shape":
        name, wrong = draw(st.sampled_from(sorted(shapes))), draw(LIES["shape"])
        shapes[name] = shapes[name][::-1] if wrong == "reversed" else shapes[name] + wrong
    scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 30.0]))
    deltas = {n: draw(arrays(np.float32, s, elements=st.floats(-1, 1, width=32))) * np.float32(scale)
              for n, s in shapes.items()}
    if lie == "value":
        x = deltas[draw(st.sampled_from(sorted(deltas)))]
        x.flat[draw(st.integers(0, x.size - 1))] = draw(VALUES)
    with np.errstate(invalid="ignore"):  # int8 / int4 of a NaN: the learner's own numpy warns
        _, frames = messages.encode_contribution(deltas=deltas, scheme=draw(st.sampled_from(quantize.SCHEMES)),
                                                 chunk_bytes=draw(st.sampled_from([16, 1 << 20])), **claims)
    return frames


def verdict(s: Shard, frames: list[bytes]):
    """What Syncer.handle_record and intake make of a contribution's records: (reason, detail),
    or (manifest, encoded delta) when it may join a round."""
    got = assemble(frames)
    if isinstance(got, WireError):
        return "malformed", str(got)
    if isinstance(got, Dropped):
        return got.reason, got.detail
    m = got[0].manifest
    v = s.validate(m, got[0].payload)
    return (m, v) if isinstance(v, fused.EncodedDelta) else v


def _honest(learner: str, value: float) -> list[bytes]:
    deltas = {n: np.full(PLAN.shapes[n], value, np.float32) for n in PLAN.fragment_names[0]}
    return messages.encode_contribution(run="run", learner=learner, region=learner[:2], fragment=0, base_version=VERSION,
                                        tokens=100, steps=10, step_time=0.1, deltas=deltas, scheme="fp32",
                                        chunk_bytes=1 << 20)[1]


@settings(max_examples=100, deadline=None)
@example([_honest("us-0", 3e38), _honest("eu-0", 3e38)], "mean", 0.0, "int8", 1.0)  # no budget: merge_failed
@given(st.lists(claimed_contributions(), min_size=2, max_size=5), st.sampled_from(["rda", "mean"]),
       st.sampled_from([10.0, 0.0]), st.sampled_from(["int8", "fp32"]), st.sampled_from([1.0, 0.5]))
def test_a_contribution_is_rejected_with_a_reason_or_merges_finite_and_equal_to_the_reference(
        round_, rule, ratio, broadcast, share):
    s = Shard.make(merge=rule, max_delta_ratio=ratio, broadcast=broadcast)
    accepted = []
    for frames in round_:
        v = verdict(s, frames)
        if isinstance(v[1], str):
            assert v[0] in REASONS, v
            event(f"rejected: {v[0]}")
            continue
        m, delta = v
        assert m.run == "run" and m.fragment == 0 and 0 < m.tokens < messages.MAX_COUNT and 0 < m.steps
        assert m.tokens <= m.steps * s.cfg.syncer.max_tokens_per_step and math.isfinite(m.step_time)
        assert all(math.isfinite(x) for x in delta.norms.values())
        assert {t.name: t.shape for t in m.tensors} == {n: PLAN.shapes[n] for n in PLAN.fragment_names[0]}
        if ratio:
            assert delta.norm <= ratio * s.fragments[0].budget_scale()
        accepted.append((m, delta))
    if not accepted:
        return
    st0 = s.fragments[0]
    contribs = [Pending(Contribution.accepted(m, Where("t", 0, 0), 0.0), d) for m, d in accepted]
    steps = [m.steps for m, _ in accepted]
    weights = ref.token_weights(ref.bounded_tokens([m.tokens for m, _ in accepted], steps,
                                                   s.cfg.syncer.tokens_per_step_spread), steps)
    with np.errstate(all="ignore"):
        want = ref.merge_deltas([d.decode() for _, d in accepted], weights, PLAN.mean_merged, rule=rule,
                                learners=[m.learner for m, _ in accepted], share=share)
        opt = ref.outer_optimizer(s.cfg.outer.lr, s.cfg.outer.momentum, s.cfg.outer.nesterov)
        want_params, _ = ref.outer_step(opt, st0.params, st0.opt_state, want)
    reference_finite = all(np.all(np.isfinite(a)) for a in [*want.values(), *want_params.values()])
    try:
        closed = rounds.close_round(s.cfg, PLAN, st0, 0, contribs, share)
        published, opt_state, residual = closed.params, closed.opt_state, closed.residual
    except FloatingPointError:  # the round is rejected as merge_failed: only if it truly is not finite
        event("round rejected: merge_failed")
        assert not reference_finite
        return
    for n in want:
        assert np.all(np.isfinite(published[n])) and np.all(np.isfinite(residual[n]))
    if not reference_finite:  # values near float32's limit: the reference overflowed in its own order of sums
        event("merged a round the reference overflows on")
        return
    event(f"merged a round of {len(accepted)}")
    trace = opt_state[0].trace  # the first outer step's momentum is the merged delta itself
    for n in want:
        big = max(float(np.abs(want[n]).max()), 1e-30)
        np.testing.assert_allclose(trace[n], want[n], rtol=2e-5, atol=2e-6 * big, err_msg=n)
        target = published[n] + residual[n]    # what was published plus what the next update carries
        np.testing.assert_allclose(target, want_params[n], rtol=2e-5, atol=2e-5 * max(big, 1.0), err_msg=n)
