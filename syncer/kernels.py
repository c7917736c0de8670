"""The syncer's hot loops, compiled with numba: one pass over the encoded bytes, no temporaries.

NumPy spends most of a merge allocating and converting (int8 -> float32 -> float64 copies of every
contribution, a stack of K of them). These kernels read the wire encoding where it lies and write
into one float32 accumulator per tensor:

- `sumsq_*`: the squared norm of an encoded delta (and whether it is finite) from its codes and
  row scales, without decoding it;
- `axpy_*`: acc += coef * decode(encoded), the step of a weighted sum;
- `update_int8` / `update_int4`: the syncer's broadcast encoding of new - old + residual, the
  published global and the residual left, in one pass per row.

`nogil=True`, so tensors merge in parallel threads; `cache=True`, so a restarted syncer does not
compile again. Each kernel has a NumPy twin in `syncer/merge.py` and `diloco/quantize.py`; the
tests hold them equal.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

_JIT = {"cache": True, "nogil": True, "fastmath": False}


# --- norms of encoded deltas ---------------------------------------------------------------------

@nb.njit(**_JIT)
def sumsq_q8(q, scale):
    """sum(decode(int8)^2) in float64; nan when a scale is not finite."""
    rows, cols = q.shape
    total = 0.0
    for r in range(rows):
        s = scale[r]
        if not math.isfinite(s):
            return math.nan
        acc = 0
        for c in range(cols):
            v = np.int64(q[r, c])
            acc += v * v
        total += np.float64(s) * np.float64(s) * np.float64(acc)
    return total


@nb.njit(**_JIT)
def sumsq_q4(packed, scale, cols):
    """The same for int4 codes, two per byte (low nibble first); padding nibbles hold 0 (code 8)."""
    rows = packed.shape[0]
    total = 0.0
    for r in range(rows):
        s = scale[r]
        if not math.isfinite(s):
            return math.nan
        acc = 0
        for c in range(cols):
            b = np.int64(packed[r, c // 2])
            v = ((b >> 4) if c % 2 else (b & 15)) - 8
            acc += v * v
        total += np.float64(s) * np.float64(s) * np.float64(acc)
    return total


@nb.njit(**_JIT)
def sumsq_f32(x):
    """sum(x^2) in float64 of a flat float32 array; nan when any value is not finite."""
    total = 0.0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        if not math.isfinite(v):
            return math.nan
        total += v * v
    return total


@nb.njit(**_JIT)
def sumsq_bf16(bits):
    """The same for bfloat16 given as its uint16 bits."""
    total = 0.0
    for i in range(bits.shape[0]):
        v = np.float64(_bf16(bits[i]))
        if not math.isfinite(v):
            return math.nan
        total += v * v
    return total


@nb.njit(inline="always")
def _bf16(b):
    return np.array([np.uint32(b) << np.uint32(16)], np.uint32).view(np.float32)[0]


# --- acc += coef * decode(encoded) ------------------------------------------------------------------

@nb.njit(**_JIT)
def axpy_q8(acc, q, scale, coef):
    rows, cols = q.shape
    for r in range(rows):
        k = np.float32(coef * scale[r])
        for c in range(cols):
            acc[r, c] += k * np.float32(q[r, c])


@nb.njit(**_JIT)
def axpy_q4(acc, packed, scale, coef):
    rows, cols = acc.shape
    for r in range(rows):
        k = np.float32(coef * scale[r])
        for c in range(cols):
            b = np.int32(packed[r, c // 2])
            v = ((b >> 4) if c % 2 else (b & 15)) - 8
            acc[r, c] += k * np.float32(v)


@nb.njit(**_JIT)
def axpy_f32(acc, x, coef):
    k = np.float32(coef)
    for i in range(acc.shape[0]):
        acc[i] += k * x[i]


@nb.njit(**_JIT)
def axpy_bf16(acc, bits, coef):
    k = np.float32(coef)
    for i in range(acc.shape[0]):
        acc[i] += k * _bf16(bits[i])


@nb.njit(**_JIT)
def scale_into(out, acc, k):
    kk = np.float32(k)
    for i in range(acc.shape[0]):
        out[i] = kk * acc[i]


@nb.njit(**_JIT)
def sumsq(x):
    total = 0.0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        total += v * v
    return total


# --- the broadcast update, fused ---------------------------------------------------------------------

@nb.njit(**_JIT)
def update_q(new, old, residual, levels, q, scale, published, carried):
    """Per row r of (rows, cols) float32 arrays: want = new - old + residual; scale = max|want| / levels
    (1 where the row is zero); q = clip(rint(want / scale)); published = old + q * scale (float32);
    carried = want - (published - old). The same arithmetic as diloco.quantize.encode_update for
    int8 / int4 (before packing) on float32 parameters."""
    rows, cols = new.shape
    want = np.empty(cols, np.float32)
    for r in range(rows):
        m = np.float32(0.0)
        for c in range(cols):
            w = (new[r, c] - old[r, c]) + residual[r, c]
            want[c] = w
            a = abs(w)
            if a > m:
                m = a
        s = m / np.float32(levels)
        if not s > 0:
            s = np.float32(1.0)
        scale[r] = s
        for c in range(cols):
            v = np.rint(want[c] / s)
            if v > levels:
                v = levels
            elif v < -levels:
                v = -levels
            q[r, c] = np.int8(v)
            p = old[r, c] + np.float32(v) * s
            published[r, c] = p
            carried[r, c] = want[c] - (p - old[r, c])


# --- the outer step ---------------------------------------------------------------------------------

@nb.njit(**_JIT)
def sgd_step(params, delta, trace, lr, momentum, nesterov, out):
    """optax.sgd(lr, momentum, nesterov) fed `delta` as the gradient, in place on `trace` (float32):
    trace = delta + momentum * trace; u = delta + momentum * trace if nesterov else trace;
    out = params - lr * u. With momentum 0 the trace is not read (pass any array)."""
    m = np.float32(momentum)
    k = np.float32(-lr)
    for i in range(params.shape[0]):
        g = delta[i]
        if momentum > 0:
            t = g + m * trace[i]
            trace[i] = t
            u = (g + m * t) if nesterov else t
        else:
            u = g
        out[i] = params[i] + k * u
