"""Delta codecs for the wire: fp32, bf16, int8 / int4 / int2 / ternary with one float32 scale per
row, and topk, a sparse code of the largest values of each block.

A tensor of shape (..., C) is treated as rows of C values (a 1-D tensor is one row). intB stores
`round(x / s)` with s = max|row| / L (L = 127 for int8, 7 for int4), so every element is off by at
most s / 2. int4 packs two values per byte (low nibble first, a row padded to an even length).

The two lossy codes below 4 bits are meant for error feedback (the sender keeps what a code left
out and adds it to its next message: a learner in an error buffer, `learners.session.outer_deltas`,
the syncer with its carried residual):
- int2: four levels (c - 1.5) x s for a code c in 0..3, s = the row's root mean square, so values
  beyond 1.5 s are clipped; four codes per byte, low bits first.
- ternary: three levels -s, 0, +s with a zero level, so a message moves only the values it keeps.
  A value is kept when |x| > TERNARY_THRESHOLD x the row's mean |x| and s = the mean |x| of the
  values kept (the least-squares scale of that choice: what is left out is never larger than the
  row); five codes per byte as base-3 digits (3^5 = 243 <= 256), 1.6 bits a value.
- topk: the flat tensor in blocks of TOPK_BLOCK values; each block keeps its TOPK_KEEP largest
  magnitudes as (uint8 index, int8 code) pairs with one float32 scale max|block| / 127, the rest
  decode as zero. A receiver rejects indices that are not strictly increasing inside the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

SCHEMES = ("fp32", "bf16", "int8", "int4", "int2", "ternary", "topk")
LEVELS = {"int8": 127, "int4": 7}  # the max-scaled row codes (int2 is RMS-scaled: its own path)
TOPK_BLOCK, TOPK_KEEP = 256, 8     # topk keeps 8 of every 256 values (3.1%): 20 bytes per block
# the codes below 4 bits: a learner keeps what they left out beside its values, not in them
# (learners.session.outer_deltas), and the syncer encodes their updates from the version before
# (SyncerConfig.updates_from)
BELOW_4_BITS = ("int2", "ternary", "topk")
# ternary keeps a value when |x| > TERNARY_THRESHOLD x its row's mean |x|: of the thresholds 0.5-1.0
# measured on a run's deltas, 0.8 and 0.9 leave error feedback the least to carry, and 0.9 the least
# held back at the end (docs/bench.md, "A ternary code")
TERNARY_THRESHOLD = 0.9
TRITS = 5                                            # base-3 digits per byte: 3^5 = 243 values of 256
_TRIT_WEIGHTS = 3 ** np.arange(TRITS)                # digit i weighs 3^i: a byte's first column is its lowest digit
_TRITS_OF = (np.arange(3 ** TRITS)[:, None] // _TRIT_WEIGHTS % 3 - 1).astype(np.int8)  # byte -> its 5 codes in -1..1


class CodecError(ValueError):
    pass


@dataclass(frozen=True)
class Coded:
    """One tensor's code, already encoded: the bytes `encode` gives for a value of `shape`. A
    sender that quantized elsewhere (a learner's devices: diloco.device_codec) hands this to the
    framing, so that every delta is encoded once."""

    shape: tuple[int, ...]
    scheme: str
    data: bytes

    def __post_init__(self) -> None:
        want = encoded_nbytes(tuple(self.shape), self.scheme)
        if len(self.data) != want:
            raise CodecError(f"{self.scheme} code of shape {tuple(self.shape)} needs {want} bytes, got {len(self.data)}")

    def decoded(self) -> np.ndarray:
        """The float32 values a receiver decodes from it."""
        return decode(self.data, self.shape, self.scheme)

    @property
    def nbytes(self) -> int:
        return len(self.data)


def coded(x: np.ndarray, scheme: str) -> Coded:
    """`x` encoded, with its shape and scheme."""
    return Coded(tuple(np.shape(x)), scheme, encode(x, scheme))


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    cols = shape[-1]
    return (math.prod(shape[:-1]) if len(shape) > 1 else 1), cols


def _topk_blocks(n: int) -> tuple[int, int]:
    """(blocks, values kept in all of them) of a topk code of n values."""
    blocks = -(-n // TOPK_BLOCK)
    if blocks == 0:
        return 0, 0
    return blocks, (blocks - 1) * TOPK_KEEP + min(TOPK_KEEP, n - (blocks - 1) * TOPK_BLOCK)


def encoded_nbytes(shape: tuple[int, ...], scheme: str) -> int:
    n = math.prod(shape)
    if scheme == "fp32":
        return 4 * n
    if scheme == "bf16":
        return 2 * n
    if scheme == "int8":
        rows, _ = _rows(shape)
        return 4 * rows + n
    if scheme == "int4":
        rows, cols = _rows(shape)
        return 4 * rows + rows * ((cols + 1) // 2)
    if scheme == "int2":
        rows, cols = _rows(shape)
        return 4 * rows + rows * ((cols + 3) // 4)
    if scheme == "ternary":
        rows, cols = _rows(shape)
        return 4 * rows + rows * _trit_bytes(cols)
    if scheme == "topk":
        blocks, kept = _topk_blocks(n)
        return 4 * blocks + 2 * kept
    raise CodecError(f"unknown quantization scheme {scheme!r}; known: {SCHEMES}")


def encode(x: np.ndarray, scheme: str) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if scheme == "fp32":
        return x.astype("<f4").tobytes()
    if scheme == "bf16":
        return x.astype(ml_dtypes.bfloat16).tobytes()
    if scheme in LEVELS:
        levels = LEVELS[scheme]
        rows, cols = _rows(x.shape)
        m = x.reshape(rows, cols)
        scale = np.max(np.abs(m), axis=1, initial=0.0) / levels  # initial: a row may be empty
        scale = np.where(scale > 0, scale, 1.0).astype("<f4")
        q = np.clip(np.rint(m / scale[:, None]), -levels, levels).astype(np.int8)
        if scheme == "int4":
            q = np.pad(q, ((0, 0), (0, cols % 2))) + 8                 # 1..15 in a nibble
            q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        return scale.tobytes() + q.tobytes()
    if scheme == "int2":
        return _encode_int2(x)
    if scheme == "ternary":
        rows, cols = _rows(x.shape)
        scale, codes = ternary_rows(x.reshape(rows, cols))
        return scale.tobytes() + pack_trits(codes).tobytes()
    if scheme == "topk":
        return _encode_topk(x)
    raise CodecError(f"unknown quantization scheme {scheme!r}; known: {SCHEMES}")


def _encode_int2(x: np.ndarray) -> bytes:
    rows, cols = _rows(x.shape)
    m = x.reshape(rows, cols)
    scale = np.sqrt(np.mean(np.square(m, dtype=np.float64), axis=1)) if cols else np.zeros(rows)
    scale = scale.astype("<f4")
    safe = np.where(scale > 0, scale, np.float32(1))  # an all-zero row: scale 0, every value decodes to 0
    codes = np.clip(np.floor(m / safe[:, None]) + 2, 0, 3).astype(np.uint8)
    codes = np.pad(codes, ((0, 0), (0, -cols % 4)))
    packed = codes[:, 0::4] | (codes[:, 1::4] << 2) | (codes[:, 2::4] << 4) | (codes[:, 3::4] << 6)
    return scale.tobytes() + packed.astype(np.uint8).tobytes()


def ternary_rows(m: np.ndarray, threshold: float = TERNARY_THRESHOLD) -> tuple[np.ndarray, np.ndarray]:
    """(float32 row scales, int8 codes in -1..1) of the ternary code of rows `m` (rows, cols): a value
    is kept (code sign(x)) when |x| > binary32(threshold x the row's binary64 mean |x|), and the scale
    is binary32 of the binary64 mean |x| of the values kept (0 when none is). A row with a value that
    is not finite gets a NaN scale, so a receiver rejects it (non_finite) instead of the threshold
    leaving the value out unseen."""
    m = np.asarray(m, np.float32)
    rows, cols = m.shape
    a = np.abs(m)
    mean = np.sum(a, axis=1, dtype=np.float64) / cols if cols else np.zeros(rows)
    with np.errstate(invalid="ignore", over="ignore"):
        cut = (threshold * mean).astype(np.float32)
        kept = a > cut[:, None]
    count = np.count_nonzero(kept, axis=1)
    total = np.sum(np.where(kept, a, np.float32(0)), axis=1, dtype=np.float64)
    scale = np.divide(total, count, out=np.zeros(rows), where=count > 0)
    scale = np.where(np.isfinite(m).all(axis=1), scale, np.nan).astype("<f4")
    codes = np.where(kept, np.where(m < 0, -1, 1), 0).astype(np.int8)
    return scale, codes


def _trit_bytes(cols: int) -> int:
    """Bytes of a ternary row of `cols` codes: five a byte, the last one padded."""
    return -(-cols // TRITS)


def pack_trits(codes: np.ndarray) -> np.ndarray:
    """Ternary codes (rows, cols) in -1..1 as the wire's bytes: per row ceil(cols / 5) bytes, byte j
    the base-3 number of digits code + 1 of columns 5j .. 5j + 4 (the first the lowest), a row's
    last byte padded with the zero code."""
    rows, cols = codes.shape
    width = _trit_bytes(cols)
    digits = np.pad(codes.astype(np.int64) + 1, ((0, 0), (0, width * TRITS - cols)), constant_values=1)
    return (digits.reshape(rows, width, TRITS) @ _TRIT_WEIGHTS).astype(np.uint8)


def unpack_trits(packed: np.ndarray, cols: int) -> np.ndarray:
    """The int8 codes (rows, cols) in -1..1 of ternary bytes (rows, ceil(cols / 5)); raises
    CodecError for a byte no encoder writes (243..255: five base-3 digits end at 242)."""
    rows, width = packed.shape
    if packed.size and int(packed.max()) >= 3 ** TRITS:
        r, j = (int(i[0]) for i in np.nonzero(packed >= 3 ** TRITS))
        raise CodecError(f"ternary row {r}: byte {j} is {int(packed[r, j])}, but five base-3 digits "
                         f"are at most {3 ** TRITS - 1}")
    return _TRITS_OF[packed].reshape(rows, width * TRITS)[:, :cols]


def _encode_topk(x: np.ndarray) -> bytes:
    flat = x.reshape(-1)
    n = flat.size
    blocks, kept = _topk_blocks(n)
    if blocks == 0:
        return b""
    padded = np.zeros(blocks * TOPK_BLOCK, np.float32)
    padded[:n] = flat
    m = np.abs(padded.reshape(blocks, TOPK_BLOCK))
    # the TOPK_KEEP largest magnitudes, ties to the lower index (a stable sort of -|x|), then in index order
    order = np.sort(np.argsort(-m, axis=1, kind="stable")[:, :TOPK_KEEP], axis=1)
    values = np.take_along_axis(padded.reshape(blocks, TOPK_BLOCK), order, axis=1)
    scale = np.max(np.abs(values), axis=1) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1))
    # a block with a value that is not finite gets a NaN scale, so a receiver rejects it (non_finite)
    # instead of the sort leaving the value out unseen
    scale = np.where(np.isfinite(padded.reshape(blocks, TOPK_BLOCK)).all(axis=1), scale, np.nan).astype("<f4")
    with np.errstate(invalid="ignore"):
        codes = np.clip(np.nan_to_num(np.rint(values / scale[:, None])), -127, 127).astype(np.int8)
    # a last block shorter than TOPK_KEEP keeps its values only: padding never outranks them (ties go to
    # the lower index) and it sorts last, so cutting the flat selection at `kept` drops just the padding
    return scale.tobytes() + order.astype(np.uint8).reshape(-1)[:kept].tobytes() + codes.reshape(-1)[:kept].tobytes()


def decode(buf: bytes | memoryview, shape: tuple[int, ...], scheme: str) -> np.ndarray:
    shape = tuple(shape)
    want = encoded_nbytes(shape, scheme)
    if len(buf) != want:
        raise CodecError(f"{scheme} tensor of shape {shape} needs {want} bytes, got {len(buf)}")
    if scheme == "fp32":
        return np.frombuffer(buf, dtype="<f4").reshape(shape).astype(np.float32)
    if scheme == "bf16":
        return np.frombuffer(buf, dtype=ml_dtypes.bfloat16).astype(np.float32).reshape(shape)
    if scheme == "topk":
        return _decode_topk(buf, shape)
    rows, cols = _rows(shape)
    scale = np.frombuffer(buf, dtype="<f4", count=rows)
    if scheme == "ternary":
        packed = np.frombuffer(buf, dtype=np.uint8, offset=4 * rows).reshape(rows, _trit_bytes(cols))
        with np.errstate(invalid="ignore"):  # 0 x an infinite scale: NaN, which a receiver rejects (non_finite)
            return (unpack_trits(packed, cols).astype(np.float32) * scale[:, None]).reshape(shape)
    if scheme == "int2":
        packed = np.frombuffer(buf, dtype=np.uint8, offset=4 * rows).reshape(rows, (cols + 3) // 4)
        codes = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=-1).reshape(rows, 4 * packed.shape[1])[:, :cols]
        return ((codes.astype(np.float32) - np.float32(1.5)) * scale[:, None]).reshape(shape)
    if scheme == "int4":
        packed = np.frombuffer(buf, dtype=np.uint8, offset=4 * rows).reshape(rows, (cols + 1) // 2)
        q = np.empty((rows, 2 * packed.shape[1]), np.int8)
        q[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
        q[:, 1::2] = (packed >> 4).astype(np.int8) - 8
        q = q[:, :cols]
    else:
        q = np.frombuffer(buf, dtype=np.int8, offset=4 * rows).reshape(rows, cols)
    return (q.astype(np.float32) * scale[:, None]).reshape(shape)


def _decode_topk(buf, shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape)
    blocks, kept = _topk_blocks(n)
    out = np.zeros(blocks * TOPK_BLOCK, np.float32)
    if blocks == 0:
        return out.reshape(shape)
    scale = np.frombuffer(buf, dtype="<f4", count=blocks)
    idx = np.frombuffer(buf, dtype=np.uint8, count=kept, offset=4 * blocks).astype(np.int64)
    codes = np.frombuffer(buf, dtype=np.int8, count=kept, offset=4 * blocks + kept)
    block = np.arange(kept) // TOPK_KEEP
    repeated = (block[1:] == block[:-1]) & (idx[1:] <= idx[:-1])   # within a block, not increasing
    last = n - (blocks - 1) * TOPK_BLOCK
    if repeated.any() or (idx[block == blocks - 1] >= last).any():
        bad = int(block[1:][repeated][0]) if repeated.any() else blocks - 1
        raise CodecError(f"topk block {bad}: indices must be strictly increasing and inside the block "
                         f"(of {TOPK_BLOCK} values, {last} in the last)")
    out[block * TOPK_BLOCK + idx] = codes.astype(np.float32) * scale[block]
    return out[:n].reshape(shape)


def roundtrip(x: np.ndarray, scheme: str) -> np.ndarray:
    """What a receiver decodes from `encode(x, scheme)`."""
    return decode(encode(x, scheme), np.shape(x), scheme)


# --- Global updates: what the syncer sends learners instead of fp32 fragments ---------------------
# The syncer publishes new = base + decode(update) and learners that hold `base` compute the same
# expression, so both ends hold bit-identical globals while the wire carries 1 (int8) or 0.5 (int4)
# bytes per parameter instead of 4. The base is the fragment's newest snapshot (infra.store), so one
# update brings a learner from that snapshot to any later version. What quantization leaves out
# (the residual) rides with the next update (error feedback on the syncer's side): the published
# global stays within one quantization step of the exact outer-step result, however many versions on.

def apply_update(base: dict[str, np.ndarray], update: dict[str, bytes], scheme: str) -> dict[str, np.ndarray]:
    """The global a receiver holds after applying one encoded update to its `base`."""
    missing = sorted(set(base) - set(update))
    if missing:
        raise CodecError(f"update lacks tensors {missing}")
    # in float32, then back to the tensor's own dtype (bf16 stays bf16): both ends compute the same bits
    return {n: (np.asarray(base[n], np.float32) + decode(update[n], base[n].shape, scheme)).astype(base[n].dtype)
            for n in base}


def encode_update(old: dict[str, np.ndarray], new: dict[str, np.ndarray], residual: dict[str, np.ndarray],
                  scheme: str, base: dict[str, np.ndarray] | None = None
                  ) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(wire update relative to `base` (default `old`), global as published, residual left for the
    next update) for the step old -> new: the update encodes new + residual - base."""
    base = old if base is None else base
    f32 = {n: np.asarray(old[n], np.float32) for n in new}
    want = {n: (np.asarray(new[n], np.float32) - f32[n] + residual.get(n, 0.0)).astype(np.float32) for n in new}
    if base is not old:
        want = {n: (want[n] + (f32[n] - np.asarray(base[n], np.float32))).astype(np.float32) for n in new}
    wire = {n: encode(u, scheme) for n, u in want.items()}
    published = apply_update({n: base[n] for n in new}, wire, scheme)
    carried = {n: (want[n] - (published[n].astype(np.float32) - np.asarray(base[n], np.float32))).astype(np.float32)
               for n in new}
    return wire, published, carried
