"""Delta codecs for the wire: fp32, bf16, and int8 / int4 with one float32 scale per row.

A tensor of shape (..., C) is treated as rows of C values (a 1-D tensor is one row). intB stores
`round(x / s)` with s = max|row| / L (L = 127 for int8, 7 for int4), so every element is off by at
most s / 2. int4 packs two values per byte (low nibble first, a row padded to an even length).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

SCHEMES = ("fp32", "bf16", "int8", "int4")
LEVELS = {"int8": 127, "int4": 7}


class CodecError(ValueError):
    pass


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    cols = shape[-1]
    return (math.prod(shape[:-1]) if len(shape) > 1 else 1), cols


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
    raise CodecError(f"unknown quantization scheme {scheme!r}; known: {SCHEMES}")


def decode(buf: bytes | memoryview, shape: tuple[int, ...], scheme: str) -> np.ndarray:
    shape = tuple(shape)
    want = encoded_nbytes(shape, scheme)
    if len(buf) != want:
        raise CodecError(f"{scheme} tensor of shape {shape} needs {want} bytes, got {len(buf)}")
    if scheme == "fp32":
        return np.frombuffer(buf, dtype="<f4").reshape(shape).astype(np.float32)
    if scheme == "bf16":
        return np.frombuffer(buf, dtype=ml_dtypes.bfloat16).astype(np.float32).reshape(shape)
    rows, cols = _rows(shape)
    scale = np.frombuffer(buf, dtype="<f4", count=rows)
    if scheme == "int4":
        packed = np.frombuffer(buf, dtype=np.uint8, offset=4 * rows).reshape(rows, (cols + 1) // 2)
        q = np.empty((rows, 2 * packed.shape[1]), np.int8)
        q[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
        q[:, 1::2] = (packed >> 4).astype(np.int8) - 8
        q = q[:, :cols]
    else:
        q = np.frombuffer(buf, dtype=np.int8, offset=4 * rows).reshape(rows, cols)
    return (q.astype(np.float32) * scale[:, None]).reshape(shape)


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
