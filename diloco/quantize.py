"""Delta codecs for the wire: fp32, bf16 and int8 with one float32 scale per row.

A tensor of shape (..., C) is treated as rows of C values (a 1-D tensor is one row). int8 stores
`round(x / s)` with s = max|row| / 127, so every element is off by at most s / 2.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

SCHEMES = ("fp32", "bf16", "int8")


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
    raise CodecError(f"unknown quantization scheme {scheme!r}; known: {SCHEMES}")


def encode(x: np.ndarray, scheme: str) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if scheme == "fp32":
        return x.astype("<f4").tobytes()
    if scheme == "bf16":
        return x.astype(ml_dtypes.bfloat16).tobytes()
    if scheme == "int8":
        rows, cols = _rows(x.shape)
        m = x.reshape(rows, cols)
        scale = np.max(np.abs(m), axis=1) / 127.0
        scale = np.where(scale > 0, scale, 1.0).astype("<f4")
        q = np.clip(np.rint(m / scale[:, None]), -127, 127).astype(np.int8)
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
    q = np.frombuffer(buf, dtype=np.int8, offset=4 * rows).reshape(rows, cols)
    return (q.astype(np.float32) * scale[:, None]).reshape(shape)
