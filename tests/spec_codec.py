"""A second codec of the wire format, written from docs/wire-format.md alone.

It must not import diloco.messages or diloco.quantize: the conformance tests (test_conformance.py)
hold the project's codec, syncer and Kafka client against this one and against librdkafka.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import time
import uuid

import crc32c
import numpy as np
import zstandard

MAGIC, VERSION = b"DLCO", 2
PREFIX = struct.Struct("<4sHI")       # magic, wire version, header length H
LEVELS = {"int8": 127, "int4": 7}


def frame(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return PREFIX.pack(MAGIC, VERSION, len(head)) + head + payload


def unframe(value: bytes) -> tuple[dict, bytes]:
    magic, version, h = PREFIX.unpack_from(value)
    assert magic == MAGIC and version == VERSION and PREFIX.size + h <= len(value), value[:16]
    header = json.loads(value[PREFIX.size:PREFIX.size + h])
    assert header["kind"] in ("manifest", "chunk"), header
    return header, value[PREFIX.size + h:]


def rows_cols(shape) -> tuple[int, int]:
    """A 0-d tensor is 1 row of 1; otherwise cols is the last dimension, rows the product of the rest."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def nbytes(shape, scheme: str) -> int:
    n, (rows, cols) = math.prod(shape), rows_cols(shape)
    if scheme == "topk":
        return sum(4 + 2 * min(8, n - b) for b in range(0, n, 256))
    return {"fp32": 4 * n, "bf16": 2 * n, "int8": 4 * rows + n, "int4": 4 * rows + rows * ((cols + 1) // 2),
            "int2": 4 * rows + rows * ((cols + 3) // 4), "ternary": 4 * rows + rows * math.ceil(cols / 5)}[scheme]


def encode(x, scheme: str) -> bytes:
    x = np.asarray(x, np.float32)
    if scheme == "fp32":
        return x.astype("<f4").tobytes()
    if scheme == "bf16":  # the upper 16 bits, rounded to nearest, ties to even
        u = x.astype("<f4").view("<u4").astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
    if scheme == "topk":
        return encode_topk(x.reshape(-1))
    rows, cols = rows_cols(x.shape)
    if scheme == "int2":
        return encode_int2(x.reshape(rows, cols))
    if scheme == "ternary":
        return encode_ternary(x.reshape(rows, cols))
    m, level = x.reshape(rows, cols), LEVELS[scheme]
    scale = np.array([np.abs(r).max() / level if r.size and np.abs(r).max() > 0 else 1.0 for r in m], "<f4")
    q = np.clip(np.rint(m / scale[:, None]), -level, level).astype(np.int64)
    if scheme == "int8":
        return scale.tobytes() + q.astype("<i1").tobytes()
    nib = np.full((rows, cols + cols % 2), 8, np.int64)  # an odd row ends with the nibble 8 (code 0)
    nib[:, :cols] = q + 8
    return scale.tobytes() + (nib[:, 0::2] | nib[:, 1::2] << 4).astype(np.uint8).tobytes()


def encode_int2(m: np.ndarray) -> bytes:
    """Per row: s = RMS (0 for a zero row), code c = clip(floor(x / s) + 2, 0, 3), four codes a byte."""
    scales, body = [], bytearray()
    for row in m:
        s = np.float32(math.sqrt(sum(float(v) ** 2 for v in row) / len(row))) if len(row) else np.float32(0)
        codes = [int(min(3, max(0, math.floor(np.float32(v) / s) + 2))) if s > 0 else 2 for v in row]
        codes += [0] * (-len(codes) % 4)
        body += bytes(codes[i] | codes[i + 1] << 2 | codes[i + 2] << 4 | codes[i + 3] << 6
                      for i in range(0, len(codes), 4))
        scales.append(s)
    return np.array(scales, "<f4").tobytes() + bytes(body)


def encode_ternary(m: np.ndarray) -> bytes:
    """Per row: m = mean |x| (binary64), keep |x| > binary32(0.9 m), s = mean |x| of those kept (0 if
    none; NaN if the row holds a value that is not finite), code sign(x) or 0; five digits code + 1
    per byte, the first column the lowest (times 1), the next times 3, 9, 27, 81; padding digit 1."""
    scales, body = [], bytearray()
    for row in m:
        mags = [abs(float(v)) for v in row]
        cut = np.float32(0.9 * (sum(mags) / len(mags))) if mags else np.float32(0)
        kept = [mag > cut for mag in mags]
        chosen = [mag for mag, k in zip(mags, kept) if k]
        s = np.float32(sum(chosen) / len(chosen)) if chosen else np.float32(0)
        scales.append(s if all(math.isfinite(v) for v in mags) else np.float32(math.nan))
        digits = [(2 if v > 0 else 0) if k else 1 for v, k in zip(row, kept)]
        digits += [1] * (-len(digits) % 5)
        body += bytes(sum(d * 3 ** i for i, d in enumerate(digits[j:j + 5])) for j in range(0, len(digits), 5))
    return np.array(scales, "<f4").tobytes() + bytes(body)


def decode_ternary(buf: bytes, rows: int, cols: int) -> np.ndarray:
    """Byte j of a row holds columns 5j .. 5j + 4 as base-3 digits (lowest first), digit d decoding
    to (d - 1) x s; a byte above 242 is refused."""
    scale = np.frombuffer(buf[:4 * rows], "<f4")
    width, out = math.ceil(cols / 5), np.zeros((rows, cols), np.float32)
    for r in range(rows):
        for j, byte in enumerate(buf[4 * rows + r * width:4 * rows + (r + 1) * width]):
            assert byte <= 242, (r, j, byte)
            for i in range(5):
                if 5 * j + i < cols:
                    out[r, 5 * j + i] = np.float32(byte // 3 ** i % 3 - 1) * scale[r]
    return out


def encode_topk(flat: np.ndarray) -> bytes:
    """Blocks of 256: the min(8, length) largest magnitudes (ties to the lower index), in index order."""
    scales, indices, codes = [], [], []
    for start in range(0, len(flat), 256):
        block = flat[start:start + 256]
        keep = sorted(sorted(range(len(block)), key=lambda i: (-abs(float(block[i])), i))[:min(8, len(block))])
        top = max(abs(float(block[i])) for i in keep)
        s = np.float32(np.float32(top) / np.float32(127)) if top > 0 else np.float32(1)
        scales.append(s)
        indices += keep
        codes += [int(np.clip(np.rint(np.float32(block[i]) / s), -127, 127)) for i in keep]
    return np.array(scales, "<f4").tobytes() + bytes(indices) + np.array(codes, "<i1").tobytes()


def decode_topk(buf: bytes, n: int) -> np.ndarray:
    starts = list(range(0, n, 256))
    kept = [min(8, n - b) for b in starts]
    k = sum(kept)
    scales = np.frombuffer(buf[:4 * len(starts)], "<f4")
    idx = buf[4 * len(starts):4 * len(starts) + k]
    codes = np.frombuffer(buf[4 * len(starts) + k:], "<i1")
    out, pos = np.zeros(n, np.float32), 0
    for b, (start, kb) in enumerate(zip(starts, kept)):
        mine = list(idx[pos:pos + kb])
        assert all(a < c for a, c in zip(mine, mine[1:])) and all(i < min(256, n - start) for i in mine), (b, mine)
        for j, i in enumerate(mine):
            out[start + i] = np.float32(codes[pos + j]) * scales[b]
        pos += kb
    return out


def decode(buf: bytes, shape, scheme: str) -> np.ndarray:
    assert len(buf) == nbytes(shape, scheme), (len(buf), shape, scheme)
    if scheme == "fp32":
        return np.frombuffer(buf, "<f4").reshape(shape)
    if scheme == "bf16":
        return (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if scheme == "topk":
        return decode_topk(buf, math.prod(shape)).reshape(shape)
    rows, cols = rows_cols(shape)
    if scheme == "ternary":
        return decode_ternary(buf, rows, cols).reshape(shape)
    scale = np.frombuffer(buf[:4 * rows], "<f4")
    if scheme == "int2":
        packed = np.frombuffer(buf[4 * rows:], np.uint8).reshape(rows, (cols + 3) // 4).astype(np.int64)
        c = np.stack([(packed >> sh) & 3 for sh in (0, 2, 4, 6)], axis=-1).reshape(rows, 4 * packed.shape[1])[:, :cols]
        return ((c.astype(np.float32) - np.float32(1.5)) * scale[:, None]).astype(np.float32).reshape(shape)
    if scheme == "int8":
        q = np.frombuffer(buf[4 * rows:], "<i1").reshape(rows, cols).astype(np.int64)
    else:
        packed = np.frombuffer(buf[4 * rows:], np.uint8).reshape(rows, (cols + 1) // 2).astype(np.int64)
        q = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, 2 * packed.shape[1])[:, :cols] - 8
    return (q.astype(np.float32) * scale[:, None]).astype(np.float32).reshape(shape)


def entries(tensors: dict[str, tuple]) -> list[tuple[dict, bytes]]:
    """(tensor entry, its codes) in name order. A tensor given as (x, scheme, blocks) is sent as its
    blocks ([[start, stop], ...] per axis), each coded as an array of the block's own shape."""
    out = []
    for name in sorted(tensors):
        x, scheme, *blocks = tensors[name]
        for block in (blocks[0] if blocks else [None]):
            part = x if block is None else x[tuple(slice(a, b) for a, b in block)]
            blob = encode(part, scheme)
            entry = {"name": name, "shape": list(np.shape(x)), "scheme": scheme, "nbytes": len(blob)}
            out.append((entry if block is None else {**entry, "block": [list(p) for p in block]}, blob))
    return out


def contribution(*, run: str, learner: str, fragment: int, base_version: int, tokens: int, steps: int,
                 step_time: float, tensors: dict[str, tuple], chunk_bytes: int,
                 packing: str = "none") -> tuple[dict, list[bytes]]:
    """The manifest header and every frame (manifest first) of one contribution, tensors in name order
    (see `entries` for tensors in blocks); with packing "zstd" the payload is one zstd frame of the
    codes (a level of this codec's own choosing)."""
    listed = entries(tensors)
    payload = b"".join(blob for _, blob in listed)
    if packing == "zstd":
        payload = zstandard.ZstdCompressor(level=19).compress(payload)
    n_chunks = max(1, -(-len(payload) // chunk_bytes))
    cid = uuid.uuid4().hex
    manifest = {
        "kind": "manifest", "id": cid, "run": run, "learner": learner, "region": learner.rsplit("-", 1)[0],
        "fragment": fragment, "base_version": base_version, "tokens": tokens, "steps": steps, "step_time": step_time,
        "tensors": [entry for entry, _ in listed],
        "total_bytes": len(payload), "n_chunks": n_chunks, "crc32c": crc32c.crc32c(payload), "created": time.time(),
    }
    if packing != "none":
        manifest["packing"] = packing
    chunks = [frame({"kind": "chunk", "id": cid, "index": i, "count": n_chunks},
                    payload[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(n_chunks)]
    return manifest, [frame(manifest), *chunks]


def assemble(values) -> dict[str, tuple[dict, bytes]]:
    """Contribution id -> (manifest, payload) for every complete set among the frame values of one
    partition (in any order), each payload checked: every chunk index present, `total_bytes` long,
    CRC-32C as the manifest says."""
    return {cid: got for (_, cid), got in assemble_log((None, v) for v in values).items()}


def assemble_log(records) -> dict[tuple[object, str], tuple[dict, bytes]]:
    """(place, id) -> (manifest, payload) for every complete set among `(place, frame value)` records
    in log order, `place` the (topic, partition) read from: a set is its frames at one place (frames
    naming the id elsewhere are another set), and the first copy of a repeated frame counts."""
    manifests, chunks = {}, {}
    for place, value in records:
        header, payload = unframe(value)
        key = (place, header["id"])
        if header["kind"] == "manifest":
            manifests.setdefault(key, header)
        else:
            chunks.setdefault(key, {}).setdefault(header["index"], (header["count"], payload))
    out = {}
    for key, m in manifests.items():
        got = chunks.get(key, {})
        assert sorted(got) == list(range(m["n_chunks"])) and {c for c, _ in got.values()} == {m["n_chunks"]}, key
        payload = b"".join(got[i][1] for i in range(m["n_chunks"]))
        assert len(payload) == m["total_bytes"] and crc32c.crc32c(payload) == m["crc32c"], key
        out[key] = (m, payload)
    return out


def tensors_of(manifest: dict, payload: bytes) -> dict[str, np.ndarray]:
    """Each tensor decoded; a tensor sent in blocks is put together whole, its blocks checked to
    cover it exactly once."""
    out, pos, covered = {}, 0, {}
    if manifest.get("packing", "none") == "zstd":
        size = sum(t["nbytes"] for t in manifest["tensors"])
        assert zstandard.frame_content_size(payload) == size, "the frame must state the codes' size"
        payload = zstandard.ZstdDecompressor().decompress(payload, allow_extra_data=False)
    for t in manifest["tensors"]:
        shape, block = tuple(t["shape"]), t.get("block")
        coded = shape if block is None else tuple(b - a for a, b in block)
        assert t["nbytes"] == nbytes(coded, t["scheme"]), t
        value = decode(payload[pos:pos + t["nbytes"]], coded, t["scheme"])
        pos += t["nbytes"]
        if block is None:
            assert t["name"] not in out, t
            out[t["name"]] = value
            continue
        where = tuple(slice(a, b) for a, b in block)
        out.setdefault(t["name"], np.zeros(shape, np.float32))[where] = value
        count = covered.setdefault(t["name"], np.zeros(shape, np.int64))
        count[where] += 1
    assert pos == len(payload)
    assert all((c == 1).all() for c in covered.values()), "blocks must cover their tensor exactly once"
    return out


def heartbeat(*, run: str, learner: str, step: int, tokens: int, state: str = "running") -> bytes:
    """An events-topic heartbeat as the spec's events section lists its fields."""
    return json.dumps({
        "schema": 1, "kind": "heartbeat", "eid": uuid.uuid4().hex, "time": time.time(), "run": run,
        "learner": learner, "region": learner.rsplit("-", 1)[0], "incarnation": "spec-" + uuid.uuid4().hex[:8],
        "step": step, "start_step": 0, "tokens": tokens, "published": 0, "bytes_sent": 0, "bytes_fetched": 0,
        "versions_applied": 0, "step_time": 0.01, "compute_s": 0.01, "at": time.time(), "loss": None,
        "state": state, "versions": {},
    }).encode()


def learner_key(secret: bytes, run: str, learner: str) -> bytes:
    """K(L) of the spec's "Signatures": HMAC-SHA256 of the label, the run and the learner, 0-separated."""
    return hmac.new(secret, b"diloco learner key v1" + b"\x00" + run.encode() + b"\x00" + learner.encode(),
                    hashlib.sha256).digest()


def signed_headers(secret: bytes, run: str, learner: str, value: bytes) -> list[tuple[str, bytes]]:
    """The two record headers that sign a frame (`value`) as `learner`'s."""
    return [("diloco-learner", learner.encode()),
            ("diloco-sig", hmac.new(learner_key(secret, run, learner), value, hashlib.sha256).digest())]
