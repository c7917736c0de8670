"""The wire format from its spec alone: docs/wire-format.md's worked example, a second codec
(tests/spec_codec.py) and a second Kafka client (librdkafka, through confluent-kafka) against the
project's codec, syncer and consumer-group offsets."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import crc32c
import numpy as np
import pytest
import spec_codec as spec
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, Producer
from confluent_kafka import TopicPartition as CTP
from confluent_kafka.admin import AdminClient
from helpers import Harness, run_events
from kafka.errors import KafkaError
from rich.console import Console
from typer.testing import CliRunner

from diloco import messages, quantize
from diloco.cli import app
from diloco.infra import kafka as kafka_io
from diloco.run import train
from diloco.syncer import state as state_mod

DOC = Path(__file__).resolve().parents[1] / "docs" / "wire-format.md"
EXAMPLE = {"b": (np.array([0.7, -0.35, 0.1], np.float32), "int4"),
           "w": (np.array([[0.5, -1.0, 0.25], [0, 0, 0]], np.float32), "int8")}


def test_the_worked_example_is_what_both_codecs_write_and_read():
    doc = DOC.read_text()
    payload = bytes.fromhex("cd cc cc 3d 4f 89 04 02 01 3c 00 00 80 3f 40 81 20 00 00 00")
    assert "payload (20 bytes):  " + payload.hex(" ") in doc and "0xe3069283" in doc.lower()
    assert crc32c.crc32c(b"123456789") == 0xE3069283 and crc32c.crc32c(payload) == 1609594627
    kw = dict(run="r1", learner="us-0", fragment=0, base_version=3, tokens=512, steps=4, step_time=0.05)
    manifest, frames = spec.contribution(**kw, tensors=EXAMPLE, chunk_bytes=16)
    assert [spec.unframe(f)[1] for f in frames] == [b"", payload[:16], payload[16:]]
    # the project's decoder reads the spec's frames (spaced JSON, its own ids) ...
    m = messages.Manifest.from_header(messages.parse_frame(frames[0])[0])
    assert m.crc32c == manifest["crc32c"] and m.n_chunks == 2
    ours = messages.decode_payload(m, payload)
    np.testing.assert_allclose(ours["b"], [0.7, -0.4, 0.1], rtol=1e-6)
    np.testing.assert_allclose(ours["w"], [[0.503937, -1.0, 0.2519685], [0, 0, 0]], rtol=1e-6)
    # ... and the spec's decoder the project's, bit for bit the same values
    m2, frames2 = messages.encode_contribution(**kw, region="us", deltas={n: x for n, (x, _) in EXAMPLE.items()},
                                               scheme={n: s for n, (_, s) in EXAMPLE.items()}, chunk_bytes=16)
    assert frames2[0][:6] == bytes.fromhex("44 4c 43 4f 02 00")   # H = 369 with the example's 18-digit `created`
    assert struct.unpack_from("<I", frames2[0], 6)[0] == 369 - len("1796150688.5899963") + len(repr(m2.created))
    assert frames2[1][:10] == bytes.fromhex("44 4c 43 4f 02 00 4c 00 00 00")
    (header, got), = spec.assemble(frames2[::-1]).values()  # chunks before their manifest, in any order
    assert got == payload
    for name, x in spec.tensors_of(header, got).items():
        np.testing.assert_array_equal(x, ours[name])


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_spec_codec_and_project_codec_agree_bit_for_bit(scheme):
    rng = np.random.default_rng(0)
    shapes = [(), (1,), (7,), (3, 5), (2, 3, 4), (4, 0), (0, 3), (5, 1)]
    for shape in shapes:
        x = rng.normal(size=shape).astype(np.float32)
        if x.ndim == 2 and x.size:
            x[1] = 0.0                                    # an all-zero row: scale 1
        if x.size > 2:
            x.flat[1] = np.float32(1.00390625)             # a bf16 tie (rounds to even)
        blob = spec.encode(x, scheme)
        assert len(blob) == spec.nbytes(shape, scheme) == quantize.encoded_nbytes(shape, scheme), shape
        assert blob == quantize.encode(x, scheme), (scheme, shape)
        np.testing.assert_array_equal(spec.decode(blob, shape, scheme), quantize.decode(blob, shape, scheme))


VECTORS = [("int2", [[0.5, -1.0, 0.25, 2.0, 0.0]], "7b f0 83 3f e6 02"),
           ("ternary", [[0.5, -1.0, 0.25, 2.0, 0.0, -0.125, 0.75]], "00 00 a0 3f 91 7c"),
           ("topk", [0.1, -0.9, 0.0, 0.3, 0.05, -0.2, 0.6, 0.0, -0.01, 0.45],
            "d4 36 e8 3b 00 01 03 04 05 06 08 09 0e 81 2a 07 e4 55 ff 40")]


@pytest.mark.parametrize("scheme,values,hexed", VECTORS)
def test_the_specs_codec_vectors_are_what_both_codecs_write_and_read(scheme, values, hexed):
    assert hexed in " ".join(DOC.read_text().replace("|", " ").split())
    x = np.array(values, np.float32)
    assert quantize.encode(x, scheme) == spec.encode(x, scheme) == bytes.fromhex(hexed)
    np.testing.assert_array_equal(quantize.decode(bytes.fromhex(hexed), x.shape, scheme),
                                  spec.decode(bytes.fromhex(hexed), x.shape, scheme))


def test_the_specs_signing_vectors_are_what_both_codecs_derive_and_sign():
    from diloco import signing

    text = " ".join(DOC.read_text().split())
    key, sig = (text.split(f"{label} = ")[-1].split()[0] for label in ("K(L)", 'diloco-sig of "abc"'))
    assert spec.learner_key(b"secret", "run-1", "us-0").hex() == signing.learner_key(b"secret", "run-1", "us-0").hex() == key
    assert signing.sign(bytes.fromhex(key), b"abc").hex() == spec.signed_headers(b"secret", "run-1", "us-0", b"abc")[1][1].hex() == sig


@pytest.mark.integration
def test_a_spec_producer_signs_on_librdkafka_and_only_its_own_key_is_accepted(tiny_config, kafka_bootstrap, monkeypatch):
    """A second client (librdkafka, the spec's codec and signatures) writes us-0's contribution signed
    with us-0's key, and one that names us-0 in its headers but is signed with eu-0's key: the syncer,
    reading through librdkafka, merges the first and rejects every frame of the second `bad_signature`."""
    monkeypatch.setenv("DILOCO_TEST_RUN_SECRET", "secret")
    cfg = tiny_config(run={"signing_secret_env": "DILOCO_TEST_RUN_SECRET"}, syncer={"quorum": 1, "consumer": "librdkafka"})
    h = Harness(cfg, f"spec-signed-{time.time_ns() % 10**8}")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    mine = {n: (0.01 * np.random.default_rng(1).normal(size=h.params[n].shape).astype(np.float32), "int8")
            for n in h.plan[0]}
    sent = {}
    for signer in ("eu-0", "us-0"):   # eu-0's forgery first: it must not settle us-0's id or version
        manifest, frames = spec.contribution(run=h.run_id, learner="us-0", fragment=0, base_version=0, tokens=64,
                                             steps=1, step_time=0.01, tensors=mine, chunk_bytes=1000)
        sent[signer] = manifest["id"]
        for f in frames:
            (_, name), (_, sig) = spec.signed_headers(b"secret", h.run_id, signer, f)
            producer.produce(h.topics.fragments["us"], f, partition=h.topics.partition_of(0),
                             headers=[("diloco-learner", b"us-0"), ("diloco-sig", sig)])
    producer.flush(10)
    h.pump(lambda: h.state.versions()[0] == 1)
    assert h.state.merges()[0]["ids"] == [sent["us-0"]] and h.state.statuses()[sent["us-0"]] == "applied:0:1"
    h.pump(lambda: [e for e in run_events(cfg, h.run_id) if e["kind"] == "contribution_rejected"])
    rejected = [e for e in run_events(cfg, h.run_id) if e["kind"] == "contribution_rejected"]
    assert {e["reason"] for e in rejected} == {"bad_signature"}
    assert "signature does not hold for signer 'us-0'" in rejected[0]["detail"] and sent["eu-0"] not in h.state.statuses()
BLOCKED = np.array([[0.7, -0.35, 0.1, 0.0], [0.5, -1.0, 0.25, 2.0]], np.float32)
BLOCK_VECTORS = [([((0, 1), (0, 4)), ((1, 2), (0, 4))], ["cd cc cc 3d 4f 89", "25 49 92 3e 5a f9"]),
                 ([((0, 2), (0, 2)), ((0, 2), (2, 4))], ["cd cc cc 3d 25 49 12 3e 4f 1b",
                                                          "a1 0e 6a 3c 25 49 92 3e 8f f9"])]


@pytest.mark.parametrize("blocks,hexed", BLOCK_VECTORS, ids=["by-rows", "by-columns"])
def test_the_specs_block_vectors_are_what_both_codecs_write_and_read(blocks, hexed):
    """A tensor in two blocks, written by two hosts (the project's part_frames), read by the spec's
    reader; and written by the spec's codec, read by the project's."""
    doc = " ".join(DOC.read_text().replace("|", " ").split())
    assert all(h in doc for h in hexed)
    kw = dict(run="r1", learner="us-0", fragment=0, base_version=3, tokens=512, steps=4, step_time=0.05)
    manifest, frames = spec.contribution(**kw, tensors={"w": (BLOCKED, "int4", blocks)}, chunk_bytes=4)
    assert [t["block"] for t in manifest["tensors"]] == [[list(p) for p in b] for b in blocks]
    payload = b"".join(bytes.fromhex(h) for h in hexed)
    (_, got), = spec.assemble(frames).values()
    assert got == payload
    m = messages.Manifest.from_header(messages.parse_frame(frames[0])[0])
    ours = messages.decode_payload(m, payload)["w"]
    np.testing.assert_array_equal(ours, spec.tensors_of(manifest, payload)["w"])
    if blocks[0][1] == (0, 4):  # by rows: the whole tensor's codes, cut by rows
        np.testing.assert_array_equal(ours, quantize.roundtrip(BLOCKED, "int4"))
    # two hosts, one block each: chunks numbered across them, the CRC combined from the two parts
    specs = [[messages.TensorSpec("w", (2, 4), "int4", len(bytes.fromhex(h)), b)] for h, b in zip(hexed, blocks)]
    codes = [{("w", b): quantize.coded(BLOCKED[messages.slices(b)], "int4")} for b in blocks]
    parts = [messages.part_payload(mine, c) for mine, c in zip(specs, codes)]
    assert parts == [bytes.fromhex(h) for h in hexed]
    crcs = [crc32c.crc32c(p) for p in parts]
    ours_frames = []
    for host in (1, 0):
        _, f = messages.part_frames(cid="c" * 32, host=host, specs=specs, crcs=crcs, payload=parts[host],
                                    chunk_bytes=4, region="us", **kw)
        ours_frames += f
    (header, got), = spec.assemble(ours_frames).values()
    assert got == payload and header["crc32c"] == crc32c.crc32c(payload)
    np.testing.assert_array_equal(spec.tensors_of(header, got)["w"], ours)


def test_topk_blocks_the_spec_refuses_are_refused_by_the_project_reader():
    x = np.random.default_rng(1).normal(size=(600,)).astype(np.float32)   # blocks of 256, 256 and 88
    good = spec.encode(x, "topk")
    repeated = bytearray(good)
    repeated[4 * 3 + 1] = repeated[4 * 3]                   # block 0's second index equals its first
    outside = bytearray(good)
    outside[4 * 3 + 16 + 7] = 100                           # the last block holds 88 values
    for bad in (repeated, outside):
        with pytest.raises(AssertionError):
            spec.decode(bytes(bad), x.shape, "topk")
        with pytest.raises(quantize.CodecError, match="strictly increasing"):
            quantize.decode(bytes(bad), x.shape, "topk")


def test_the_ternary_vector_decodes_to_the_levels_the_spec_states():
    got = quantize.decode(bytes.fromhex("00 00 a0 3f 91 7c"), (1, 7), "ternary")
    np.testing.assert_array_equal(got, np.float32(1.25) * np.array([[0, -1, 0, 1, 0, 0, 1]], np.float32))


def test_ternary_bytes_the_spec_refuses_are_refused_by_the_project_reader():
    """A byte above 242 holds no five base-3 digits: both readers refuse it, the project's by row and byte."""
    x = np.random.default_rng(3).normal(size=(3, 12)).astype(np.float32)   # 3 bytes a row
    good = spec.encode(x, "ternary")
    for value in (243, 255):
        bad = bytearray(good)
        bad[4 * 3 + 3 + 2] = value                                       # row 1, its last byte
        with pytest.raises(AssertionError):
            spec.decode(bytes(bad), x.shape, "ternary")
        with pytest.raises(quantize.CodecError, match=f"ternary row 1: byte 2 is {value}"):
            quantize.decode(bytes(bad), x.shape, "ternary")


def test_packed_payloads_cross_between_the_codecs_and_decode_to_the_same_codes():
    rng = np.random.default_rng(2)
    tensors = {"w": (rng.laplace(size=(64, 96)).astype(np.float32), "int4"),
               "b": (rng.normal(size=(96,)).astype(np.float32), "int8")}
    kw = dict(run="r1", learner="us-0", fragment=0, base_version=0, tokens=64, steps=2, step_time=0.1)
    header, frames = spec.contribution(**kw, tensors=tensors, chunk_bytes=1024, packing="zstd")
    (_, packed), = spec.assemble(frames).values()
    m = messages.Manifest.from_header(messages.parse_frame(frames[0])[0])
    assert m.packing == "zstd" and m.total_bytes == len(packed) < 0.9 * m.codes_bytes  # Laplace int4 packs well
    ours = messages.decode_payload(m, packed)  # the spec's level-19 frame, read by the project
    m2, frames2 = messages.encode_contribution(**kw, region="us", deltas={n: x for n, (x, _) in tensors.items()},
                                               scheme={n: s for n, (_, s) in tensors.items()}, chunk_bytes=1024,
                                               packing="zstd")
    (header2, packed2), = spec.assemble(frames2).values()
    assert header2["packing"] == "zstd" and len(packed2) == m2.total_bytes
    for name, x in spec.tensors_of(header2, packed2).items():  # the project's level-1 frame, read by the spec
        np.testing.assert_array_equal(x, ours[name])
        np.testing.assert_array_equal(x, quantize.decode(quantize.encode(tensors[name][0], tensors[name][1]),
                                                         x.shape, tensors[name][1]))


def _packed_manifest(payload: bytes, codes: bytes) -> messages.Manifest:
    return messages.Manifest(id="x", run="r", learner="us-0", region="us", fragment=0, base_version=0, tokens=1,
                             steps=1, step_time=0.0, tensors=(messages.TensorSpec("v", (len(codes) // 4,), "fp32",
                                                                                   len(codes)),),
                             total_bytes=len(payload), n_chunks=1, crc32c=crc32c.crc32c(payload), created=0.0,
                             packing="zstd")


def test_a_packed_payload_must_state_exactly_the_codes_size_and_hold_nothing_more():
    import zstandard

    codes = np.arange(1000, dtype=np.float32).tobytes()
    good = zstandard.ZstdCompressor().compress(codes)
    assert messages.decode_payload(_packed_manifest(good, codes), good)["v"][999] == 999.0
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))  # 16 MiB of zeros in a few hundred bytes
    bad = {
        "unstated": zstandard.ZstdCompressor(write_content_size=False).compress(codes),
        "larger": bomb, "smaller": zstandard.ZstdCompressor().compress(codes[:-4]),
        "trailing": good + b"\0", "truncated": good[:-2], "not zstd": b"DLCO" + codes[:100],
    }
    for what, payload in bad.items():
        with pytest.raises(messages.WireError, match="packing") as err:
            messages.decode_payload(_packed_manifest(payload, codes), payload)
        assert len(str(err.value)) < 400, what
    # an unknown packing is refused where the manifest is read
    header = dict(_packed_manifest(good, codes).to_header(), packing="brotli")
    with pytest.raises(messages.WireError, match="packing must be one of"):
        messages.Manifest.from_header(header)


def test_the_project_reader_keeps_the_specs_edge_rules():
    # an empty payload travels as one empty chunk: the one empty chunk the spec allows
    manifest, frames = spec.contribution(run="r1", learner="us-0", fragment=0, base_version=0, tokens=1, steps=1,
                                         step_time=0.0, tensors={"e": (np.zeros((0,), np.float32), "fp32")},
                                         chunk_bytes=16)
    reader = messages.ChunkAssembler(max_bytes=1 << 20, timeout_s=60)
    got = [reader.add(*messages.parse_frame(f), now=0.0) for f in frames]
    assert isinstance(got[-1], messages.Assembled) and got[-1].payload == b"" and manifest["n_chunks"] == 1
    # JSON true/false are not integers, in a tensor's nbytes too (`false` is the size of an empty fp32 tensor)
    header = dict(manifest, tensors=[dict(manifest["tensors"][0], nbytes=False)])
    with pytest.raises(messages.WireError, match="nbytes"):
        messages.Manifest.from_header(spec.unframe(spec.frame(header))[0])


def test_both_readers_key_sets_by_place_and_keep_the_first_copy_of_a_frame():
    """docs/wire-format.md: sets are keyed by (topic, partition, id); a frame naming the id elsewhere
    is another set, and a repeated frame's first copy counts. A log of one honest contribution on
    us|0 with a forged one under its id on eu|0 and stray or conflicting frames around them."""
    tensors = {n: (x, "fp32") for n, (x, _) in EXAMPLE.items()}
    honest, frames = spec.contribution(run="r1", learner="us-0", fragment=0, base_version=3, tokens=512, steps=4,
                                       step_time=0.05, tensors=tensors, chunk_bytes=16)
    forged, other = spec.contribution(run="r1", learner="eu-1", fragment=0, base_version=3, tokens=512, steps=4,
                                      step_time=0.05, tensors={n: (2 * x, s) for n, (x, s) in tensors.items()},
                                      chunk_bytes=16)
    cid = honest["id"]
    other = [spec.frame({**h, "id": cid}, p) for h, p in map(spec.unframe, other)]
    h1, p1 = spec.unframe(frames[1])
    log = [(("us", 0), frames[0]), (("us", 0), frames[1]),
           (("eu", 0), other[0]), (("us", 1), spec.frame({**h1, "count": 99}, p1)),   # strays elsewhere
           (("us", 0), spec.frame(h1, bytes(len(p1)))),                               # a repeat with other bytes
           *[(("eu", 0), f) for f in other[1:]], *[(("us", 0), f) for f in frames[2:]]]
    theirs = spec.assemble_log(log)
    assert set(theirs) == {(("us", 0), cid), (("eu", 0), cid)}
    ours, reader = {}, messages.ChunkAssembler(max_bytes=1 << 20, timeout_s=60)
    for offset, ((topic, partition), value) in enumerate(log):
        got = reader.add(*messages.parse_frame(value), now=0.0, offset=offset, where=f"{topic}|{partition}")
        if isinstance(got, messages.Assembled):
            ours[(tuple(got.where.split("|")), got.manifest.id)] = got
    assert {(t, int(p)) for (t, p), _ in ours} == {("us", 0), ("eu", 0)} and reader.places(cid) == ["us|1"]
    for ((topic, partition), _), got in ours.items():
        manifest, payload = theirs[((topic, int(partition)), cid)]
        assert got.payload == payload and got.manifest.learner == manifest["learner"]
    assert theirs[(("us", 0), cid)][0]["learner"] == "us-0" and theirs[(("eu", 0), cid)][0]["learner"] == "eu-1"


def read_with_librdkafka(bootstrap: str, tps: list[tuple[str, int]], timeout_s: float = 60.0) -> list[tuple]:
    """(topic, partition, key, value) of every record from offset 0 up to the high watermark that
    librdkafka's fetches report (the local broker's ListOffsets end is not the partition's end)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "conformance-reader", "enable.auto.commit": False})
    try:
        c.assign([CTP(t, p, 0) for t, p in tps])
        out, deadline = [], time.time() + timeout_s
        while True:
            for msg in c.consume(500, timeout=0.2):
                assert msg.error() is None, msg.error()
                out.append((msg.topic(), msg.partition(), msg.key(), msg.value()))
            ends = {tp: c.get_watermark_offsets(CTP(*tp), cached=True)[1] for tp in tps}
            at = {(p.topic, p.partition): p.offset for p in c.position([CTP(*tp) for tp in tps])}
            # an empty partition has no position; its end is 0
            if all(ends[tp] >= 0 and (ends[tp] == 0 or at[tp] >= ends[tp]) for tp in tps):
                return out
            assert time.time() < deadline, (ends, at)
    finally:
        c.close()


def committed_by_librdkafka(bootstrap: str, group: str) -> dict[tuple[str, int], int]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    (fut,) = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)]).values()
    return {(tp.topic, tp.partition): tp.offset for tp in fut.result().topic_partitions}


@pytest.mark.integration
def test_a_tiny_runs_fragments_decode_from_the_spec_alone(tiny_config, kafka_bootstrap):
    cfg = tiny_config(regions=[{"name": "us", "learners": 1}, {"name": "eu", "learners": 1}], inner={"steps": 40},
                      fragments={"quantization": "int4"}, outer={"lr": 1.0, "momentum": 0.0})
    summary = train(cfg, progress=False, console=Console(quiet=True))
    run_id = summary["run_id"]
    topics = kafka_io.Topics.for_run(cfg, run_id)
    tps = [(t, p) for t in topics.fragments.values() for p in range(topics.partitions)]
    records = read_with_librdkafka(kafka_bootstrap, tps)
    contributions = spec.assemble(v for *_, v in records)
    events = list({e["eid"]: e for e in run_events(cfg, run_id)}.values())
    accepted = {e["id"]: e for e in events if e["kind"] == "contribution_accepted"}
    merged = [cid for e in events if e["kind"] == "merge" for cid in e["ids"]]
    assert summary["contributions"]["published"] == len(contributions) > 0
    assert set(contributions) == set(accepted) and sorted(merged) == sorted(accepted)
    by_id = {}
    for t, p, key, value in records:
        by_id.setdefault(spec.unframe(value)[0]["id"], []).append((t, p, key, value))
    for cid, (m, payload) in contributions.items():
        ev = accepted[cid]
        claims = ("learner", "region", "fragment", "base_version", "tokens")
        assert {k: m[k] for k in claims} == {k: ev[k] for k in claims} and ev["bytes"] == m["total_bytes"]
        frag = m["fragment"]   # every frame on the fragment's partition of its region's topic, keyed by the fragment
        assert {(t, p, k) for t, p, k, _ in by_id[cid]} == {(topics.fragments[m["region"]], frag % topics.partitions,
                                                             str(frag).encode())}
        # the oracle: the project's own reader of the same records
        ours = messages.ChunkAssembler(max_bytes=1 << 30, timeout_s=60)
        for *_, value in by_id[cid]:
            got = ours.add(*messages.parse_frame(value), now=0.0)
        theirs = messages.decode_payload(got.manifest, got.payload)
        decoded = spec.tensors_of(m, payload)
        assert set(decoded) == set(theirs)
        for name, x in decoded.items():
            assert np.isfinite(x).all() and np.abs(x).max() > 0
            np.testing.assert_array_equal(x, theirs[name])
    # the syncer's consumer group: committed = its replay offsets in Redis = the end of every partition
    lag = kafka_io.group_lag(cfg.transport, topics.syncer_group, [kafka_io.TopicPartition(*tp) for tp in tps])
    assert all(r["lag"] == 0 and r["committed"] == r["end"] for r in lag) and sum(r["end"] for r in lag) > 0, lag
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    assert committed_by_librdkafka(kafka_bootstrap, topics.syncer_group) == {tp: r["end"] for tp, r in zip(tps, lag)} \
        == state.offsets()
    out = CliRunner().invoke(app, ["lag", "--config", str(Path(cfg.run.dir) / run_id / "config.yaml")])
    assert out.exit_code == 0 and f"group {topics.syncer_group}" in out.output and "total lag 0" in out.output, out.output


@pytest.mark.integration
def test_a_spec_producer_joins_and_its_contribution_is_merged_once(tiny_config, kafka_bootstrap, monkeypatch, caplog):
    cfg = tiny_config(regions=[{"name": "us", "learners": 1, "max_learners": 2}, {"name": "eu", "learners": 1}],
                      outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
                      syncer={"quorum": 2, "merge": "mean", "token_weighting": False, "broadcast": "fp32"})
    h = Harness(cfg, f"spec-{time.time_ns() % 10**8}")
    group, topics = h.topics.syncer_group, h.topics
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topics.events, spec.heartbeat(run=h.run_id, learner="us-1", step=10, tokens=640), partition=0)
    producer.flush(10)
    h.pump(lambda: "us-1" in h.state.members())             # a joiner: admitted on its first heartbeat
    mine = {n: (0.01 * np.random.default_rng(1).normal(size=h.params[n].shape).astype(np.float32), "int8")
            for n in h.plan[0]}
    manifest, frames = spec.contribution(run=h.run_id, learner="us-1", fragment=0, base_version=0, tokens=640,
                                         steps=10, step_time=0.01, tensors=mine, chunk_bytes=1000)
    assert len(frames) > 3
    for f in [frames[0], *frames[:0:-1]]:                     # the manifest, then the chunks last first
        producer.produce(topics.fragments["us"], f, key=b"0", partition=topics.partition_of(0))
    producer.flush(10)
    cid = manifest["id"]
    h.pump(lambda: h.state.statuses().get(cid) == "pending:0")
    h.syncer.save_offsets(force=True)                         # its round is open: the group lags behind it
    tp = (topics.fragments["us"], 0)
    lag = {(r["topic"], r["partition"]): r for r in kafka_io.group_lag(
        cfg.transport, group, [kafka_io.TopicPartition(*tp)])}
    assert lag[tp]["lag"] == len(frames) and committed_by_librdkafka(kafka_bootstrap, group)[tp] == lag[tp]["committed"]
    other = h.publish("eu-0", 0, base_version=0, deltas=h.deltas(0, seed=2), scheme="fp32")
    h.pump(lambda: h.state.versions()[0] == 1)
    h.syncer.save_offsets(force=True)
    (merge,) = h.state.merges()
    assert sorted(merge["ids"]) == sorted([cid, other.id]) and h.state.statuses()[cid] == "applied:0:1"
    assert [e["id"] for e in run_events(cfg, h.run_id) if e["kind"] == "contribution_accepted"].count(cid) == 1
    v0, v1 = h.store.read(0, 0).params, h.store.read(0, 1).params
    decoded = spec.tensors_of(manifest, b"".join(spec.unframe(f)[1] for f in frames[1:]))
    for n in h.plan[0]:  # outer SGD at lr 1 on the plain mean of the two pseudo-gradients (old - new)
        want = v0[n] - (decoded[n] + h.deltas(0, seed=2)[n]) / 2
        np.testing.assert_allclose(v1[n], want, rtol=1e-5, atol=1e-6)
    assert committed_by_librdkafka(kafka_bootstrap, group)[tp] == h.syncer.consumer.highwater(
        kafka_io.TopicPartition(*tp))
    # the group is monitoring only: a commit the broker refuses is logged once, and the syncer goes on
    monkeypatch.setattr(h.syncer.consumer, "commit", lambda *a, **k: (_ for _ in ()).throw(KafkaError("refused")))
    for _ in range(2):
        h.syncer.save_offsets(force=True)
        h.syncer.step()
    assert [r.message for r in caplog.records].count(
        "consumer group commit failed (monitoring only; Redis keeps the offsets)") == 1
