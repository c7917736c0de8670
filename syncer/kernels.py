"""The syncer's hot loops, compiled with numba: one pass over the encoded bytes, no temporaries.

NumPy spends most of a merge allocating and converting (int8 -> float32 -> float64 copies of every
contribution, a stack of K of them). These kernels read the wire encoding where it lies and write
into one float32 accumulator per tensor:

- `sumsq_*`: the squared norm of an encoded delta (and whether it is finite) from its codes and
  row scales, without decoding it, added to a running `total` (a tensor's blocks in its order);
- `axpy_*`: acc += coef * decode(encoded), the step of a weighted sum;
- `update_q`: the syncer's broadcast encoding of new - old + residual, the published global and
  the residual left, in one pass per row; `step_update_q` the same with the outer SGD step that
  makes `new` in that pass too.

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
def sumsq_q8(q, scale, total):
    """total + sum(decode(int8)^2) in float64; nan when a scale is not finite or a decoded value (binary32) is."""
    rows, cols = q.shape
    for r in range(rows):
        s = scale[r]
        if not math.isfinite(s):
            return math.nan
        acc, top = 0, 0
        for c in range(cols):
            v = np.int64(q[r, c])
            acc += v * v
            top = max(top, abs(v))
        if not math.isfinite(np.float32(s) * np.float32(top)):  # decoded in binary32: q x s overflows
            return math.nan
        total += np.float64(s) * np.float64(s) * np.float64(acc)
    return total


@nb.njit(**_JIT)
def sumsq_q4(packed, scale, cols, total):
    """The same for int4 codes, two per byte (low nibble first); padding nibbles hold 0 (code 8)."""
    rows = packed.shape[0]
    for r in range(rows):
        s = scale[r]
        if not math.isfinite(s):
            return math.nan
        acc, top = 0, 0
        for c in range(cols):
            b = np.int64(packed[r, c // 2])
            v = ((b >> 4) if c % 2 else (b & 15)) - 8
            acc += v * v
            top = max(top, abs(v))
        if not math.isfinite(np.float32(s) * np.float32(top)):
            return math.nan
        total += np.float64(s) * np.float64(s) * np.float64(acc)
    return total


@nb.njit(**_JIT)
def sumsq_f32(x, total):
    """sum(x^2) in float64 of a flat float32 array; nan when any value is not finite."""
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        if not math.isfinite(v):
            return math.nan
        total += v * v
    return total


@nb.njit(**_JIT)
def sumsq_bf16(bits, total):
    """The same for bfloat16 given as its uint16 bits."""
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
    """sum(x^2) in float64 of a flat float32 array, in 8 interleaved partial sums: one running sum
    is a chain of dependent adds (about 1.3 ns per value here), 8 of them vectorize."""
    lanes = np.zeros(8, np.float64)
    n = x.shape[0] - x.shape[0] % 8
    for i in range(0, n, 8):
        for j in range(8):
            v = np.float64(x[i + j])
            lanes[j] += v * v
    total = 0.0
    for i in range(n, x.shape[0]):
        v = np.float64(x[i])
        total += v * v
    return total + lanes.sum()


# --- the broadcast update, fused ---------------------------------------------------------------------

@nb.njit(**_JIT)
def update_q(new, old, residual, base, rebased, levels, q, scale, published, carried):
    """Per row r of (rows, cols) float32 arrays: want = new - old + residual (+ old - base when
    `rebased`, else `base` is `old`); scale = max|want| / levels (1 where the row is zero); q = clip(rint(want / scale));
    published = base + q * scale (float32); carried = want - (published - base). The same arithmetic
    as diloco.quantize.encode_update for int8 / int4 (before packing) on float32 parameters."""
    rows, cols = new.shape
    want = np.empty(cols, np.float32)
    for r in range(rows):
        m = np.float32(0.0)
        for c in range(cols):
            w = (new[r, c] - old[r, c]) + residual[r, c]
            if rebased:
                w = w + (old[r, c] - base[r, c])
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
            p = base[r, c] + np.float32(v) * s
            published[r, c] = p
            carried[r, c] = want[c] - (p - base[r, c])


_EXP = np.uint32(0x7F800000)     # float32 exponent bits: all ones for inf and nan
_ABS = np.uint32(0x7FFFFFFF)


@nb.njit(**_JIT)
def step_update_q(old, delta, k, trace_in, trace_out, lr, momentum, nesterov, residual, base, rebased, levels, q, scale,
                  published, carried):
    """`sgd_step` on the gradient k * delta, then `update_q` of its result relative to `base` (`old`
    itself unless `rebased`), in one pass per row with
    the same float32 arithmetic (bit for bit): the stepped parameters are never stored, only what
    the syncer keeps (published values, residual, new momentum trace) and the broadcast codes.
    Returns bit flags: 1 if a stepped value, 2 a published value or residual, is not finite.

    Every inner loop is branch-free so that LLVM vectorizes it: a row's max |want| is the integer
    max of the float bits less the sign (the same order for non-negative floats), which is at least
    the exponent mask exactly when some value is inf or nan."""
    rows, cols = old.shape
    want = np.empty(cols, np.float32)
    wbits = want.view(np.uint32)
    pbits, cbits = published.view(np.uint32), carried.view(np.uint32)
    top_f = np.empty(1, np.float32)
    top_u = top_f.view(np.uint32)
    kk, m, step = np.float32(k), np.float32(momentum), np.float32(-lr)
    flags = 0
    for r in range(rows):
        o, d, res, b = old[r], delta[r], residual[r], base[r]
        if momentum > 0:
            t_in, t_out = trace_in[r], trace_out[r]
            for c in range(cols):
                g = kk * d[c]
                t = g + m * t_in[c]
                t_out[c] = t
                u = (g + m * t) if nesterov else t
                want[c] = ((o[c] + step * u) - o[c]) + res[c]
        else:
            for c in range(cols):
                want[c] = ((o[c] + step * (kk * d[c])) - o[c]) + res[c]
        if rebased:
            for c in range(cols):
                want[c] = want[c] + (o[c] - b[c])
        top = np.uint32(0)
        for c in range(cols):
            top = max(top, wbits[c] & _ABS)
        if top >= _EXP:
            flags |= 1
            continue
        top_u[0] = top
        s = top_f[0] / np.float32(levels)
        if not s > 0:
            s = np.float32(1.0)
        scale[r] = s
        qr, pr, cr = q[r], published[r], carried[r]
        for c in range(cols):
            v = min(max(np.rint(want[c] / s), np.float32(-levels)), np.float32(levels))
            qr[c] = np.int8(v)
            p = b[c] + v * s
            pr[c] = p
            cr[c] = want[c] - (p - b[c])
        bad = np.uint32(0)
        for c in range(cols):
            bad |= (pbits[r, c] & _EXP) == _EXP
            bad |= (cbits[r, c] & _EXP) == _EXP
        if bad:
            flags |= 2
    return flags


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
