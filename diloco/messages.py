"""Wire format of the data plane: self-describing, versioned frames (no pickle).

A frame is `MAGIC | u16 wire version | u32 header length | JSON header | binary payload`.
A contribution (one learner's outer delta for one fragment) travels as one `manifest` frame followed
by `n_chunks` `chunk` frames, all keyed to the fragment's partition so they stay in order; a receiver
assembles it from that partition only. It counts only when the manifest and every chunk arrived
there and the payload's CRC-32C matches the manifest.
Announcements and events are plain JSON (readable with kcat) carrying a `schema` number.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import NamedTuple

import crc32c as _crc32c
import numpy as np

from diloco import packing as packing_mod
from diloco import quantize

MAGIC = b"DLCO"
WIRE_VERSION = 2            # 2: the payload checksum is CRC-32C (`crc32c`), where 1 carried a SHA-256
EVENT_SCHEMA = 1
# what a learner tells the run it is doing before its first step (a `learner_phase` event); from its
# first heartbeat on it is training
LEARNER_PHASES = ("importing", "compiling", "joining")
_PREFIX = struct.Struct("<4sHI")
MAX_HEADER_BYTES = 1 << 20


MAX_EVENT_BYTES = 1 << 20
MAX_COUNT = 1 << 53          # tokens, steps, versions: beyond this a float64 stops counting exactly
MAX_DIMS = 32                # of a tensor's shape (numpy's own limit in 1.x)
DETAIL_CHARS = 300           # error texts quote input at most this long
MAX_NAME_CHARS = 64          # contribution and learner ids


class WireError(ValueError):
    """A message that cannot be decoded; the text says what is wrong with it."""


class ChecksumError(WireError):
    """A complete payload that is not the one its manifest describes: another length or CRC-32C
    (docs/wire-format.md: a receiver rejects it as `checksum`)."""


def is_name(value) -> bool:
    """Whether `value` can be a contribution or learner id on the wire: a string of 1-64 characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def short(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: error texts never echo input unbounded."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def bounded(text: str, limit: int = DETAIL_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


Region = tuple[tuple[int, int], ...]  # (start, stop) per axis: one block of an array


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]   # the whole tensor's
    scheme: str
    nbytes: int
    block: Region | None = None  # the block of the tensor this entry codes (a learner over several hosts)

    @property
    def coded_shape(self) -> tuple[int, ...]:
        """The shape of what the entry's codes encode: the block's, or the tensor's."""
        return self.shape if self.block is None else tuple(b - a for a, b in self.block)

    def to_header(self) -> dict:
        d = {"name": self.name, "shape": list(self.shape), "scheme": self.scheme, "nbytes": self.nbytes}
        if self.block is not None:  # optional: a whole tensor's entry reads as before blocks existed
            d["block"] = [list(pair) for pair in self.block]
        return d


def slices(block: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in block)


@dataclass(frozen=True)
class Manifest:
    id: str
    run: str
    learner: str
    region: str
    fragment: int
    base_version: int
    tokens: int
    steps: int
    step_time: float
    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    n_chunks: int
    crc32c: int              # CRC-32C (Castagnoli) of the whole payload, as Kafka and GCS use it
    created: float
    packing: str = "none"    # the lossless stage over the tensors' codes (diloco.packing); total_bytes counts its output
    # [first, end): the learner's data-stream steps the delta trained on (a shard_batches reader's step
    # k reads its k-th batch); None when the sender does not say (the field is optional)
    cursor: tuple[int, int] | None = None

    @property
    def codes_bytes(self) -> int:
        """The bytes of the tensors' codes once unpacked."""
        return sum(t.nbytes for t in self.tensors)

    def to_header(self) -> dict:
        d = asdict(self)
        d["tensors"] = [t.to_header() for t in self.tensors]
        if d["packing"] == "none":  # the field is optional: an unpacked manifest reads as before packing existed
            del d["packing"]
        if d["cursor"] is None:
            del d["cursor"]
        else:
            d["cursor"] = list(d["cursor"])
        return {"kind": "manifest", **d}

    @staticmethod
    def from_header(h: Mapping) -> Manifest:
        def need(key, typ):
            v = h.get(key)
            if isinstance(v, bool) or not isinstance(v, typ):
                raise WireError(f"manifest field {key!r} must be {getattr(typ, '__name__', typ)}, got {short(v)}")
            return v

        def number(key):  # NaN, Infinity or a JSON integer too large for a float is no time
            try:
                v = float(need(key, (int, float)))
            except OverflowError:
                v = math.inf
            if not math.isfinite(v):
                raise WireError(f"manifest field {key!r} must be a finite number, got {short(h[key])}")
            return v

        raw_tensors = need("tensors", list)
        tensors, blocked = [], {}
        for i, t in enumerate(raw_tensors):
            if not isinstance(t, dict):
                raise WireError(f"manifest tensors[{i}] must be an object")
            shape = t.get("shape")
            if not isinstance(shape, list) or not all(is_count(s) and s >= 0 for s in shape):
                raise WireError(f"manifest tensors[{i}].shape must be a list of non-negative ints, got {short(shape)}")
            # numpy refuses these even when a dim is 0: more than 32 dims, or too many elements in the others
            if len(shape) > MAX_DIMS or math.prod(max(s, 1) for s in shape) >= MAX_COUNT:
                raise WireError(f"manifest tensors[{i}].shape is no array's shape: {short(shape)}")
            if t.get("scheme") not in quantize.SCHEMES:
                raise WireError(f"manifest tensors[{i}].scheme must be one of {quantize.SCHEMES}, got {short(t.get('scheme'))}")
            if not isinstance(t.get("name"), str) or not is_count(t.get("nbytes")):
                raise WireError(f"manifest tensors[{i}] needs a string name and an int nbytes")
            block = _block(t.get("block"), shape, f"manifest tensors[{i}] ({short(t['name'])})")
            # a name repeats only as blocks: two payload slices for one whole tensor, which would merge?
            if t["name"] in blocked and not (blocked[t["name"]] and block is not None):
                mixed = blocked[t["name"]] or block is not None
                raise WireError(f"manifest tensors[{i}].name {short(t['name'])} is repeated"
                                + (" with and without a block (a tensor is whole or in blocks)" if mixed else ""))
            blocked[t["name"]] = block is not None
            tensors.append(TensorSpec(t["name"], tuple(shape), t["scheme"], t["nbytes"], block))
        check_tilings(tensors)
        m = Manifest(
            id=need("id", str), run=need("run", str), learner=need("learner", str), region=need("region", str),
            fragment=need("fragment", int), base_version=need("base_version", int), tokens=need("tokens", int),
            steps=need("steps", int), step_time=number("step_time"), tensors=tuple(tensors),
            total_bytes=need("total_bytes", int), n_chunks=need("n_chunks", int), crc32c=need("crc32c", int),
            created=number("created"), packing=h.get("packing", "none"), cursor=_cursor(h.get("cursor"), h.get("steps")),
        )
        if m.packing not in packing_mod.PACKINGS:
            raise WireError(f"manifest packing must be one of {packing_mod.PACKINGS}, got {short(m.packing)}")
        if not 0 <= m.crc32c < 1 << 32:
            raise WireError(f"manifest crc32c must be a 32-bit unsigned integer, got {short(m.crc32c, 40)}")
        if m.n_chunks < 1 or m.total_bytes < 0:
            raise WireError(f"manifest n_chunks={short(m.n_chunks, 40)} total_bytes={short(m.total_bytes, 40)} are not possible")
        if m.packing == "none" and m.codes_bytes != m.total_bytes:
            raise WireError("manifest total_bytes is not the sum of its tensors' nbytes")
        return m


MAX_CURSOR = 2**53   # steps: beyond it a JSON number is no exact integer in most readers


def _cursor(v, steps) -> tuple[int, int] | None:
    """A manifest's optional cursor: [first, end) steps of the learner's data stream, as many as it claims."""
    if v is None:
        return None
    if (not isinstance(v, list) or len(v) != 2
            or not all(is_count(x) and 0 <= x < MAX_CURSOR for x in v)):
        raise WireError(f"manifest cursor must be [first, end], two integers in 0..2**53, got {short(v)}")
    if v[1] - v[0] != steps:
        raise WireError(f"manifest cursor {v} spans {v[1] - v[0]} steps, the manifest claims {short(steps, 40)}")
    return v[0], v[1]


def _block(v, shape: list[int], where: str) -> Region | None:
    """A tensor entry's optional block: [start, stop] per axis of `shape`, inside it, non-empty but
    along an axis of length 0."""
    if v is None:
        return None
    if (not isinstance(v, list) or len(v) != len(shape)
            or not all(isinstance(p, list) and len(p) == 2 and all(is_count(x) for x in p) for p in v)):
        raise WireError(f"{where}.block must be one [start, stop] pair of integers per axis of {shape}, got {short(v)}")
    for axis, ((a, b), n) in enumerate(zip(v, shape)):
        if not (0 <= a <= b <= n and (a < b or n == 0)):
            raise WireError(f"{where}.block {short(v)} is not a non-empty span of axis {axis} (length {n})")
    return tuple((a, b) for a, b in v)


def check_tilings(tensors) -> None:
    """Raise WireError unless the blocks of each name are the cells of a grid over its shape: along
    each axis the blocks' spans cut 0..length into consecutive pieces, and each combination of one
    piece per axis is one block, once. So they are disjoint and cover the tensor exactly."""
    by_name: dict[str, list[TensorSpec]] = {}
    for t in tensors:
        if t.block is not None:
            by_name.setdefault(t.name, []).append(t)
    for name, specs in by_name.items():
        shape = specs[0].shape
        if any(t.shape != shape or t.scheme != specs[0].scheme for t in specs):
            raise WireError(f"tensor {short(name)}: its blocks disagree on the tensor's shape or scheme")
        blocks = [t.block for t in specs]
        cells = 1
        for axis, n in enumerate(shape):
            at = 0
            spans = sorted({b[axis] for b in blocks})
            for a, b in spans:
                if a != at:
                    raise WireError(f"tensor {short(name)}: blocks {'overlap' if a < at else 'leave a gap'} along axis "
                                    f"{axis} at {min(a, at)} (spans {short(spans, 120)})")
                at = b
            if at != n:
                raise WireError(f"tensor {short(name)}: blocks leave a gap along axis {axis} from {at} to {n}")
            cells *= len(spans)
        if len(set(blocks)) != len(blocks):
            raise WireError(f"tensor {short(name)}: a block is repeated (blocks overlap)")
        if len(blocks) != cells:
            raise WireError(f"tensor {short(name)}: {len(blocks)} blocks do not cover its {cells}-cell grid of spans "
                            f"(a gap, or blocks that are no grid)")


def frame(header: Mapping, payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, WIRE_VERSION, len(head)) + head + payload


def parse_frame(raw: bytes) -> tuple[dict, memoryview]:
    if raw is None or len(raw) < _PREFIX.size:
        raise WireError(f"truncated frame: {0 if raw is None else len(raw)} bytes")
    magic, version, hlen = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise WireError(f"not a diloco frame (magic {magic!r})")
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version} is not supported (this build speaks {WIRE_VERSION})")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > len(raw):
        raise WireError(f"header length {hlen} runs past the {len(raw)}-byte frame")
    try:
        header = json.loads(bytes(raw[_PREFIX.size:_PREFIX.size + hlen]))
    except ValueError as err:  # not UTF-8, not JSON, or an integer of more than 4300 digits
        raise WireError(f"header is not JSON: {bounded(str(err), 120)}") from None
    except RecursionError:
        raise WireError("header JSON nests too deeply") from None
    if not isinstance(header, dict) or header.get("kind") not in ("manifest", "chunk"):
        raise WireError(f"header kind must be 'manifest' or 'chunk', got {header!r:.80}")
    return header, memoryview(raw)[_PREFIX.size + hlen:]


class FrameHeader(NamedTuple):
    """The fields of a frame header that readers outside the wire decoder use, each checked once here:
    one missing or of the wrong type is None, so no reader meets a bool as a count or a list as a name.
    The dict parse_frame returns stays the assembler's (a manifest's full check is Manifest.from_header)."""
    kind: str | None          # 'manifest' or 'chunk'
    id: str | None
    learner: str | None
    region: str | None
    fragment: int | None
    index: int | None         # a chunk's number in its set
    count: int | None         # a chunk's set size
    total_bytes: int | None   # what a manifest says its payload weighs (unchecked against the chunks)

    @staticmethod
    def from_header(h: Mapping, *, need_id: bool = False) -> FrameHeader:
        """The typed view of a parsed header; `need_id`: WireError when it names no contribution id
        (a receiver can file such a frame under no contribution)."""
        def name(key):
            return h.get(key) if is_name(h.get(key)) else None

        def number(key):
            v = h.get(key)
            return v if is_count(v) and v >= 0 else None

        if need_id and name("id") is None:
            raise WireError(f"frame header needs a contribution id of 1-64 characters, got {short(h.get('id'), 40)}")
        kind = h.get("kind")
        return FrameHeader(kind=kind if kind in ("manifest", "chunk") else None, id=name("id"),
                           learner=name("learner"), region=name("region"), fragment=number("fragment"),
                           index=number("index"), count=number("count"), total_bytes=number("total_bytes"))


def encode_contribution(
    *, run: str, learner: str, region: str, fragment: int, base_version: int, tokens: int, steps: int,
    step_time: float, deltas: Mapping[str, np.ndarray], scheme: str | Mapping[str, str], chunk_bytes: int,
    packing: str = "none", cursor: tuple[int, int] | None = None,
) -> tuple[Manifest, list[bytes]]:
    """Quantize a fragment's deltas (one scheme, or one per tensor; a `quantize.Coded` value is
    taken as it is, encoded once where it was made), pack the codes (`packing`) and cut them into a
    manifest frame plus chunk frames."""
    blobs, specs = [], []
    for name in sorted(deltas):
        codec = scheme if isinstance(scheme, str) else scheme[name]
        code = deltas[name]
        if not isinstance(code, quantize.Coded):
            code = quantize.coded(np.asarray(code, dtype=np.float32), codec)
        elif code.scheme != codec:
            raise ValueError(f"tensor {name}: coded as {code.scheme}, the contribution says {codec}")
        blobs.append(code.data)
        specs.append(TensorSpec(name, tuple(code.shape), codec, len(code.data)))
    packing, payload = packing_mod.pack_smaller(b"".join(blobs), packing)
    n_chunks = max(1, math.ceil(len(payload) / chunk_bytes))
    manifest = Manifest(
        id=uuid.uuid4().hex, run=run, learner=learner, region=region, fragment=fragment,
        base_version=base_version, tokens=tokens, steps=steps, step_time=step_time, tensors=tuple(specs),
        total_bytes=len(payload), n_chunks=n_chunks, crc32c=checksum(payload), created=time.time(),
        packing=packing, cursor=None if cursor is None else (int(cursor[0]), int(cursor[1])),
    )
    pieces = cut(payload, chunk_bytes) or [b""]  # an empty payload travels as one empty chunk
    return manifest, [frame(manifest.to_header()), *chunk_frames(manifest.id, pieces, 0, n_chunks)]


def cut(payload, chunk_bytes: int) -> list:
    """A payload in pieces of `chunk_bytes`, the last shorter (none for an empty payload)."""
    return [payload[i:i + chunk_bytes] for i in range(0, len(payload), chunk_bytes)]


def chunk_frames(cid: str, pieces, first: int, count: int) -> list[bytes]:
    """Chunk frames of contribution `cid` holding `pieces`, numbered from `first`, of `count` in all."""
    return [frame({"kind": "chunk", "id": cid, "index": first + i, "count": count}, piece)
            for i, piece in enumerate(pieces)]


# --- a contribution written by several hosts (a learner over jax.distributed processes) -----------
# Each host codes the blocks it holds and sends them as chunks of its own; the payload is host 0's
# entries, then host 1's, ...; each host cuts its own bytes and numbers its chunks after the hosts
# before it; host 0 sends the manifest, whose CRC-32C it combines from each host's (length, CRC).

def part_payload(specs, codes: Mapping[tuple[str, Region | None], quantize.Coded]) -> bytes:
    """One host's bytes of a contribution: the codes of its entries `specs`, in their order (a code
    keyed by (name, block), the block None for a whole tensor), each checked against its entry."""
    blobs = []
    for t in specs:
        code = codes[t.name, t.block]
        if (tuple(code.shape), code.scheme, len(code.data)) != (t.coded_shape, t.scheme, t.nbytes):
            raise ValueError(f"tensor {t.name} block {t.block}: a {code.scheme} code of {tuple(code.shape)}, "
                             f"the entry says {t.scheme} {t.coded_shape}")
        blobs.append(code.data)
    return b"".join(blobs)


def part_frames(*, cid: str, host: int, specs: list, crcs: list[int], payload: bytes, chunk_bytes: int,
                **claims) -> tuple[Manifest | None, list[bytes]]:
    """Host `host`'s frames of contribution `cid` written by several: `specs[h]` are host h's entries
    (every host computes the same lists), `crcs[h]` the CRC-32C of its bytes, `payload` this host's.
    Host 0's frames begin with the manifest (made of `claims`: run, learner, ...; packing "none":
    a part cannot be packed with the others). Hosts without bytes send no chunk but for an empty
    payload, which is one empty chunk of host 0."""
    sizes = [sum(t.nbytes for t in mine) for mine in specs]
    if sizes[host] != len(payload):
        raise ValueError(f"host {host} has {len(payload)} bytes, its entries {sizes[host]}")
    counts = [-(-n // chunk_bytes) for n in sizes]
    total, crc = sum(sizes), crcs[0]
    for n, c in zip(sizes[1:], crcs[1:]):
        crc = crc32c_combine(crc, c, n)
    n_chunks = max(1, sum(counts))
    pieces = cut(payload, chunk_bytes) or ([b""] if host == 0 and total == 0 else [])
    frames = chunk_frames(cid, pieces, sum(counts[:host]), n_chunks)
    if host != 0:
        return None, frames
    manifest = Manifest(id=cid, tensors=tuple(t for mine in specs for t in mine), total_bytes=total,
                        n_chunks=n_chunks, crc32c=crc, created=time.time(), **claims)
    return manifest, [frame(manifest.to_header()), *frames]


def checksum(payload) -> int:
    """The payload's CRC-32C: it catches corruption and mis-assembled chunks at about 14 GB/s here
    (hardware CRC instructions), where SHA-256 ran at 1.8 GB/s and was a third of the merge path.
    It is no signature: who may write the topic is the broker's ACLs' business."""
    return _crc32c.crc32c(payload)


CASTAGNOLI = 0x82F63B78  # the CRC-32C polynomial, reflected


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.cache
def _zeros_operators() -> list[list[int]]:
    """[M_k]: the GF(2) matrix (32 columns) that moves a CRC-32C register past 2^k zero bytes."""
    one_bit = [CASTAGNOLI] + [1 << (n - 1) for n in range(1, 32)]
    op = one_bit
    for _ in range(3):  # 1 -> 2 -> 4 -> 8 bits: one zero byte
        op = [_gf2_times(op, op[n]) for n in range(32)]
    ops = [op]
    for _ in range(63):
        op = [_gf2_times(op, op[n]) for n in range(32)]
        ops.append(op)
    return ops


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32C of A + B from crc(A), crc(B) and B's length: crc(A) moved past len(B) zero bytes
    (the register's initial and final inversions cancel, as in zlib's crc32_combine), xor crc(B)."""
    if len_b == 0:
        return crc_a
    k, ops = 0, _zeros_operators()
    while len_b:
        if len_b & 1:
            crc_a = _gf2_times(ops[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b


def verify_payload(manifest: Manifest, payload: bytes) -> None:
    """Raise ChecksumError unless the payload has the manifest's size and CRC-32C."""
    if len(payload) != manifest.total_bytes:
        raise ChecksumError(f"payload has {len(payload)} bytes, manifest says {manifest.total_bytes}")
    if checksum(payload) != manifest.crc32c:
        raise ChecksumError("checksum mismatch: payload CRC-32C differs from the manifest")


def codes_of(manifest: Manifest, payload: bytes | memoryview) -> bytes | memoryview:
    """The tensors' codes of a payload of the manifest's size: checked to fit their shapes and
    schemes, then unpacked. Raises WireError; the CRC is verify_payload's (this does not read it)."""
    if len(payload) != manifest.total_bytes:
        raise WireError(f"payload has {len(payload)} bytes, manifest says {manifest.total_bytes}")
    for t in manifest.tensors:
        if t.nbytes != quantize.encoded_nbytes(t.coded_shape, t.scheme):
            raise WireError(f"tensor {t.name}: nbytes {t.nbytes} does not fit {t.scheme} {t.coded_shape}"
                            + ("" if t.block is None else f" (its block {list(map(list, t.block))})"))
    if manifest.packing == "none":
        return payload
    try:
        return packing_mod.unpack(payload, manifest.packing, manifest.codes_bytes)
    except packing_mod.PackingError as err:
        raise WireError(f"payload packing: {err}") from None


def tensor_codes(manifest: Manifest, codes: bytes | memoryview):
    """(entry, its codes as a view) for each tensor entry of the manifest, in payload order, from the
    codes `codes_of` gives. An entry with a block codes that block as an array of its own shape
    (`coded_shape`); every reader of a payload walks it with this."""
    buf, pos = memoryview(codes), 0
    for t in manifest.tensors:
        yield t, buf[pos:pos + t.nbytes]
        pos += t.nbytes


def decode_payload(manifest: Manifest, payload: bytes) -> dict[str, np.ndarray]:
    """Each tensor's decoded float32 values, a tensor sent in blocks put together whole."""
    verify_payload(manifest, payload)
    out = {}
    for t, view in tensor_codes(manifest, codes_of(manifest, payload)):
        try:
            value = quantize.decode(view, t.coded_shape, t.scheme)
        except quantize.CodecError as err:
            raise WireError(f"tensor {t.name}: {err}") from None
        if t.block is None:
            out[t.name] = value
        else:
            out.setdefault(t.name, np.empty(t.shape, np.float32))[slices(t.block)] = value
    return out


class Reason(StrEnum):
    """Why a contribution (or a record naming none) was rejected: `contribution_rejected.reason`
    (docs/wire-format.md, "Rejections")."""
    MALFORMED = "malformed"
    OVERSIZED = "oversized"
    INCOMPLETE = "incomplete"
    BUFFER_FULL = "buffer_full"
    CHECKSUM = "checksum"
    WRONG_RUN = "wrong_run"
    UNKNOWN_LEARNER = "unknown_learner"
    UNKNOWN_FRAGMENT = "unknown_fragment"
    MISROUTED = "misrouted"
    DUPLICATE_ID = "duplicate_id"   # a set of an id that another place (or record) of the log holds
    WRONG_SHAPE = "wrong_shape"
    BAD_METADATA = "bad_metadata"
    FUTURE_VERSION = "future_version"
    STALE = "stale"
    NON_FINITE = "non_finite"
    NORM_BUDGET = "norm_budget"
    NORM_OUTLIER = "norm_outlier"
    TOKEN_BUDGET = "token_budget"   # the fragment has taken in run.token_budget tokens: the run is done with it
    MERGE_FAILED = "merge_failed"
    LOST_PAYLOAD = "lost_payload"
    BAD_SIGNATURE = "bad_signature"  # a signed run's frame unsigned, signed by another key, or for another's set
    INTERNAL_ERROR = "internal_error"


@dataclass
class _Partial:
    manifest: Manifest | None = None
    chunks: dict[int, memoryview] = field(default_factory=dict)  # views into the records: copied once, at the end
    count: int | None = None        # chunks the first chunk frame said the set has
    nbytes: int = 0                 # payload bytes held (kept as chunks arrive: no re-summing)
    held: int = 0                   # bytes the chunks keep alive: their whole records, frame headers too
    idle_s: float = 0.0             # reading time without progress (see ChunkAssembler.expire)
    mark: int = 0                   # bytes of its partition read when it last progressed
    first_offset: int | None = None
    where: str = ""
    conflicts: int = 0              # repeated chunk indexes with other bytes than the copy kept (the first)
    signer: str | None = None       # the learner that signed its first frame (a signed run's; diloco.signing)
    started: int = 0                # the assembler's count of sets when this one began: which of two came first


@dataclass(frozen=True)
class Assembled:
    manifest: Manifest
    payload: bytes
    first_offset: int | None
    where: str
    conflicts: int = 0              # chunk copies with other bytes that arrived after the one kept
    started: int = 0                # when the set began, in the assembler's count of sets (see `places`)


@dataclass(frozen=True)
class Dropped:
    id: str
    manifest: Manifest | None
    reason: Reason
    detail: str
    first_offset: int | None
    where: str
    started: int = 0


# What one buffered chunk costs besides its bytes (dict entry, view object): zero-byte floods count too.
CHUNK_OVERHEAD = 128


def _held(view: memoryview) -> int:
    """Bytes a chunk's view keeps alive: the whole record it points into (its frame header too)."""
    return memoryview(view.obj).nbytes if view.obj is not None else view.nbytes


class ChunkAssembler:
    """Collects manifest and chunk frames by place and contribution id, in any order, within bounds.

    A set is keyed by (where, id), `where` the partition it is read from: a contribution's frames share
    one partition (docs/wire-format.md), so a frame naming the same id on another topic or partition
    forms a set of its own, which completes or fails by itself and never touches this one. Within a
    set the first copy of each frame wins: a repeated manifest or chunk index is ignored, and a repeat
    with other bytes is counted (`conflicts`), never swapped in. The log gives a partition's frames
    one order, so a replay rebuilds the same set, and a stray copy read after the honest one (the only
    order a writer who learnt the id from the log can reach) cannot replace it.

    `add` returns an `Assembled` once every chunk is there, a `Dropped` when the set can never be
    valid (oversized, inconsistent, refused by `check` on its manifest, no room), else None.
    `expire` returns the sets dropped since its last call: those that stopped progressing and those
    evicted to stay within `max_sets` and `max_buffered` (sets with no manifest go first, then the
    least recently progressed).

    Expiry follows the log, not the wall clock alone: a set expires once `after_bytes` of its
    partition were read past its last chunk, or once it made no progress for `timeout_s` while its
    partition was read to the end (`caught_up(where)`). Idle time only counts between checks at most
    `tick_s` apart: a consumer that stops reading (a broker outage, a long merge, a pause) or lags
    behind its partition (a replay) expires nothing whose chunks may still be in the log.
    `first_offset` is the lowest log offset of the set, which bounds how far back a restarted
    consumer must replay.
    """

    def __init__(self, *, max_bytes: int, timeout_s: float, after_bytes: int | None = None,
                 max_sets: int = 4096, max_buffered: int = 1 << 30, check=None, tick_s: float = 1.0):
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.after_bytes = after_bytes if after_bytes is not None else 4 * max_bytes
        self.max_sets, self.max_buffered = max_sets, max_buffered
        self.check = check                       # manifest -> (reason, detail) or None
        self._partial: dict[tuple[str, str], _Partial] = {}  # (where, id); least recently progressed first
        self._read: dict[str, int] = {}          # where -> bytes read from it
        self._buffered = 0
        self._evicted: list[Dropped] = []
        self.tick_s = tick_s
        self._last_check: float | None = None
        self._started = 0                        # sets begun so far

    def pending_offsets(self, where: str) -> list[int]:
        return [p.first_offset for p in self._partial.values() if p.where == where and p.first_offset is not None]

    def __len__(self) -> int:
        return len(self._partial)

    def __contains__(self, cid: str) -> bool:
        """Whether a set of contribution `cid` is being assembled anywhere."""
        return any(c == cid for _, c in self._partial)

    def holds(self, cid: str, where: str) -> bool:
        """Whether a set of contribution `cid` is being assembled from partition `where`."""
        return (where, cid) in self._partial

    def places(self, cid: str) -> list[str]:
        """The partitions holding a partial set of contribution `cid`."""
        return [w for w, c in self._partial if c == cid]

    def rivals(self, cid: str, started: int) -> list[str]:
        """The partitions holding a set of `cid` with a manifest, begun before set number `started`: a
        contribution under that id that was under way first."""
        return [w for (w, c), p in self._partial.items() if c == cid and p.manifest is not None and p.started < started]

    @property
    def buffered(self) -> int:
        return self._buffered

    def read(self, where: str, nbytes: int) -> None:
        """Count `nbytes` read from partition `where` (every record, whatever becomes of it)."""
        self._read[where] = self._read.get(where, 0) + nbytes

    def signer(self, cid: str, where: str) -> str | None:
        """Who signed the first frame of the set of `cid` being assembled at `where` (None: no such set,
        or unsigned)."""
        part = self._partial.get((where, cid))
        return None if part is None else part.signer

    def add(self, header: Mapping, payload: bytes, *, now: float, offset: int | None = None,
            where: str = "", signer: str | None = None) -> Assembled | Dropped | None:
        cid = header.get("id")
        if not isinstance(cid, str) or not cid:
            raise WireError("frame header has no contribution id")
        key = (where, cid)
        part = self._partial.pop(key, None)
        if part is None:
            self._started += 1
            part = _Partial(where=where, started=self._started, signer=signer)
        self._partial[key] = part                # to the back: it progressed last
        part.idle_s, part.mark = 0.0, self._read.get(where, 0)
        if offset is not None and (part.first_offset is None or offset < part.first_offset):
            part.first_offset = offset
        if header["kind"] == "manifest":
            if part.manifest is not None:
                return None                      # a repeated manifest (a producer retry)
            manifest = Manifest.from_header(header)
            if manifest.total_bytes > self.max_bytes:
                return self._drop(key, Reason.OVERSIZED, f"{manifest.total_bytes} bytes > limit {self.max_bytes}",
                                  manifest)
            if manifest.n_chunks > max(1, manifest.total_bytes):
                return self._drop(key, Reason.MALFORMED, f"{manifest.n_chunks} chunks for {manifest.total_bytes} bytes",
                                  manifest)
            if part.count is not None and part.count != manifest.n_chunks:
                return self._drop(key, Reason.MALFORMED,
                                  f"chunks say {part.count} chunks, manifest {manifest.n_chunks}", manifest)
            if part.nbytes > manifest.total_bytes:
                return self._drop(key, Reason.MALFORMED,
                                  f"chunks hold {part.nbytes} bytes, manifest {manifest.total_bytes}", manifest)
            verdict = self.check(manifest) if self.check else None
            if verdict:
                return self._drop(key, *verdict, manifest)
            part.manifest = manifest
        else:
            index, count = header.get("index"), header.get("count")
            if not is_count(index) or not is_count(count) or not 0 <= index < count:
                return self._drop(key, Reason.MALFORMED, f"chunk index {short(index, 40)} of {short(count, 40)}")
            expected = part.manifest.n_chunks if part.manifest is not None else part.count
            if expected is not None and count != expected:
                return self._drop(key, Reason.MALFORMED, f"chunk says {count} chunks, the set has {expected}")
            if not payload and count > 1:
                return self._drop(key, Reason.MALFORMED, f"chunk {index} of {count} is empty")
            part.count = count
            old = part.chunks.get(index)
            if old is not None:                  # a repeat (a producer retry): the first copy stays
                part.conflicts += old != memoryview(payload)
                return None
            view = part.chunks[index] = memoryview(payload)
            part.nbytes += len(view)
            part.held += _held(view)
            self._buffered += _held(view) + CHUNK_OVERHEAD
            limit = part.manifest.total_bytes if part.manifest is not None else self.max_bytes
            if part.nbytes > limit:
                return self._drop(key, Reason.OVERSIZED if part.manifest is None else Reason.MALFORMED,
                                  f"chunks hold {part.nbytes} bytes > {'limit' if part.manifest is None else 'manifest'} "
                                  f"{limit}")
        dropped = self._make_room(key)
        if dropped is not None:
            return dropped
        m = part.manifest
        if m is None or len(part.chunks) < m.n_chunks:
            return None
        self._forget(key)
        payload_all = b"".join(part.chunks[i] for i in range(m.n_chunks))
        return Assembled(m, payload_all, part.first_offset, part.where, part.conflicts, part.started)

    def _make_room(self, key: tuple[str, str]) -> Dropped | None:
        """Evict sets until the bounds hold; the newcomer's own set may be the one to go."""
        while len(self._partial) > self.max_sets or self._buffered > self.max_buffered:
            victim = next((k for k, p in self._partial.items() if p.manifest is None), next(iter(self._partial)))
            detail = (f"buffer full ({len(self._partial)} partial sets, {self._buffered} bytes; limits "
                      f"{self.max_sets} sets, {self.max_buffered} bytes)")
            d = self._drop(victim, Reason.BUFFER_FULL, detail)
            if victim == key:
                return d
            self._evicted.append(d)
        return None

    def discard(self, cid: str, where: str = "") -> None:
        """Forget the partial set of contribution `cid` read from partition `where`."""
        self._forget((where, cid))

    def drop(self, cid: str, where: str, reason: Reason, detail: str) -> Dropped:
        """Drop the partial set of contribution `cid` read from partition `where`, saying why."""
        return self._drop((where, cid), reason, detail)

    def discard_where(self, where: str) -> None:
        """Forget the partial sets read from one partition (its fragment moved to another shard)."""
        for key in [key for key, p in self._partial.items() if p.where == where]:
            self._forget(key)
        self._read.pop(where, None)

    def expire(self, now: float, caught_up=lambda where: True) -> list[Dropped]:
        out, self._evicted = self._evicted, []
        tick = 0.0 if self._last_check is None else min(max(now - self._last_check, 0.0), self.tick_s)
        self._last_check = now
        read_to_end: dict[str, bool] = {}        # asked once per partition, not once per set
        for key, p in list(self._partial.items()):
            outgrown = self._read.get(p.where, 0) - p.mark > self.after_bytes
            if not outgrown and p.where not in read_to_end:
                read_to_end[p.where] = caught_up(p.where)
            if not outgrown and not read_to_end[p.where]:
                continue                         # its chunks may be in the part of the log not read yet
            p.idle_s += tick
            if outgrown or p.idle_s > self.timeout_s:
                have = f"{len(p.chunks)}/{p.manifest.n_chunks if p.manifest else '?'} chunks"
                why = (f"{self.after_bytes} bytes of its partition read since its last chunk" if outgrown else
                       f"no chunk for {self.timeout_s:g}s with its partition read to the end")
                out.append(self._drop(key, Reason.INCOMPLETE, f"{have}, manifest "
                                      f"{'present' if p.manifest else 'missing'}: {why}", p.manifest))
        return out

    def _forget(self, key: tuple[str, str]) -> _Partial:
        p = self._partial.pop(key, None)
        if p is None:
            return _Partial(where=key[0])
        self._buffered -= p.held + CHUNK_OVERHEAD * len(p.chunks)
        return p

    def _drop(self, key: tuple[str, str], reason: Reason, detail: str, manifest: Manifest | None = None) -> Dropped:
        p = self._forget(key)
        if p.conflicts:
            detail += f" ({p.conflicts} repeated chunks with other bytes ignored: the first copy is kept)"
        return Dropped(key[1], manifest or p.manifest, reason, detail, p.first_offset, p.where, p.started)


def event(kind: str, **fields) -> bytes:
    """An events-topic record: JSON with a schema number, a wall-clock time and a unique `eid`.

    Delivery is at least once (the syncer re-sends its outbox after a crash): readers drop
    repeated eids.
    """
    return json.dumps({"schema": EVENT_SCHEMA, "kind": kind, "eid": uuid.uuid4().hex, "time": time.time(), **fields},
                      separators=(",", ":"), default=_jsonable).encode()


def parse_event(raw: bytes) -> dict | None:
    """An events or outer topic record as a dict, or None if it is not one (too large, not JSON,
    nested too deeply, another schema)."""
    if raw is None or len(raw) > MAX_EVENT_BYTES:
        return None
    try:
        ev = json.loads(raw)
    except (TypeError, ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return ev if isinstance(ev, dict) and ev.get("schema") == EVENT_SCHEMA and isinstance(ev.get("kind"), str) else None


def is_count(v) -> bool:
    """Whether a decoded JSON value is an integer: an int and not a bool (true and false decode to
    bools, which Python counts as ints)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v) -> bool:
    return is_count(v) and 0 <= v < MAX_COUNT


def _real(v) -> bool:
    """A number a float holds: not a bool, NaN, infinite, or an integer past the float range."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _seconds(v) -> bool:
    return _real(v) and 0 <= v < 1e9


def _epoch(v) -> bool:
    """A wall-clock time in seconds since 1970 (up to the year 5138)."""
    return _real(v) and 0 <= v < 1e11


_HEARTBEAT = {  # field -> check; unknown fields are dropped, a bad known one refuses the beat
    "step": _count, "start_step": _count, "tokens": _count, "published": _count, "bytes_sent": _count,
    "bytes_fetched": _count, "versions_applied": _count, "handed_in_to": _count,
    "handed_in_tokens": _count,
    "step_time": _seconds, "compute_s": _seconds, "at": _epoch,
    "loss": lambda v: v is None or _real(v),
    "state": lambda v: v in ("running", "finished", "left"),
    "incarnation": lambda v: isinstance(v, str) and len(v) <= 64,
    "region": lambda v: isinstance(v, str) and len(v) <= 64,
    "versions": lambda v: isinstance(v, dict) and len(v) <= 4096 and all(
        isinstance(k, str) and k.isascii() and k.isdigit() and _count(x) for k, x in v.items()),
    "fetched_by_fragment": lambda v: isinstance(v, dict) and len(v) <= 4096 and all(
        isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 6 and _count(x) for k, x in v.items()),
}


def clean_heartbeat(ev: Mapping) -> dict:
    """The heartbeat's known fields, each checked (types, finite, in range), or WireError saying
    which field is wrong: nothing unchecked reaches the syncer's state."""
    learner = ev.get("learner")
    if not is_name(learner):
        raise WireError(f"heartbeat learner must be a short string, got {short(learner)}")
    out = {"kind": "heartbeat", "learner": learner}
    for key, ok in _HEARTBEAT.items():
        if key in ev:
            if not ok(ev[key]):
                raise WireError(f"heartbeat of {short(learner)}: field {key!r} is {short(ev[key])}")
            out[key] = ev[key]
    return out


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")
