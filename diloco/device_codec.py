"""The wire codecs of `diloco.quantize` as traceable JAX functions, so a learner quantizes on its
accelerator and only the codes cross to the host.

`encode(x, scheme)` returns the code's parts in wire order (for int8 / int4: the float32 row
scales, then the codes, int4 two to a byte); their bytes laid end to end are exactly
`quantize.encode(x, scheme)`, bit for bit (tests/test_device_codec.py holds the two together on
random, constant, tiny and empty tensors). `decode(parts, shape, scheme)` is what a receiver
decodes, in float32. Both are pure: jit them inside a larger function (learners/outer.py does).

The codes below 4 bits are not here: int2's and ternary's row scales are float64 means (not an XLA
type on every backend) and topk's sort is better done where its error buffer lives; a learner keeps
those on the host (`ON_DEVICE` says which schemes this module has).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from diloco import quantize

ON_DEVICE = ("fp32", "bf16", "int8", "int4")


_rows = quantize._rows  # (rows, cols) of a tensor as the codecs see it: one piece of code for both


def _divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b, correctly rounded as NumPy's. XLA's simplifier turns a division by a broadcast (or a
    constant) into a multiplication by its reciprocal, which is off by an ulp in about half the
    cases here; behind an optimization barrier the divisor is an array it cannot see into."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def encode(x: jax.Array, scheme: str) -> tuple[jax.Array, ...]:
    """The parts of `x`'s code in wire order (see the module docstring); traceable."""
    x = jnp.asarray(x, jnp.float32)
    if scheme == "fp32":
        return (x,)
    if scheme == "bf16":
        return (x.astype(jnp.bfloat16),)
    if scheme not in quantize.LEVELS:
        raise quantize.CodecError(f"{scheme!r} is not a device codec; these are: {ON_DEVICE}")
    levels = quantize.LEVELS[scheme]
    rows, cols = _rows(tuple(x.shape))
    m = x.reshape(rows, cols)
    scale = _divide(jnp.max(jnp.abs(m), axis=1, initial=0.0), jnp.float32(levels))
    scale = jnp.where(scale > 0, scale, jnp.float32(1.0))
    q = jnp.clip(jnp.round(_divide(m, scale[:, None])), -levels, levels).astype(jnp.int8)
    if scheme == "int4":
        q = (jnp.pad(q, ((0, 0), (0, cols % 2))) + 8).astype(jnp.uint8)   # 1..15 in a nibble
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return scale, q


def decode(parts: tuple[jax.Array, ...], shape: tuple[int, ...], scheme: str) -> jax.Array:
    """The float32 values a receiver decodes from `parts` (as `encode` gives them); traceable."""
    shape = tuple(shape)
    if scheme in ("fp32", "bf16"):
        return parts[0].astype(jnp.float32).reshape(shape)
    scale, q = parts
    rows, cols = _rows(shape)
    if scheme == "int4":
        low = (q & 0x0F).astype(jnp.int8) - 8
        high = (q >> 4).astype(jnp.int8) - 8
        q = jnp.stack([low, high], axis=-1).reshape(rows, 2 * q.shape[1])[:, :cols]
    return (q.astype(jnp.float32) * scale[:, None]).reshape(shape)


@dataclass
class DeviceCode:
    """One tensor's code made on the devices: its parts, whose copy to the host starts at once
    (`copy_to_host_async`), read by whoever sends it (`coded`, which waits for that copy)."""

    shape: tuple[int, ...]
    scheme: str
    parts: tuple

    def __post_init__(self) -> None:
        for p in self.parts:
            if isinstance(p, jax.Array) and p.is_fully_addressable:
                p.copy_to_host_async()

    def host_parts(self) -> tuple[np.ndarray, ...]:
        """The parts on the host (waits for their copy). The device buffers are let go: a learner
        that keeps the code to rebuild an anchor from (learners/outer.py) holds host bytes only."""
        # a copy: on a CPU backend a view would keep the device buffer alive
        parts = tuple(p if isinstance(p, np.ndarray) else np.array(p) for p in self.parts)
        self.parts = parts
        return parts

    def coded(self) -> quantize.Coded:
        data = b"".join(np.ascontiguousarray(p).tobytes() for p in self.host_parts())
        return quantize.Coded(self.shape, self.scheme, data)

    def decoded(self) -> np.ndarray:
        """The float32 values a receiver decodes from it (on the host)."""
        return self.coded().decoded()

    @property
    def nbytes(self) -> int:
        return quantize.encoded_nbytes(tuple(self.shape), self.scheme)


def parts_of(code: DeviceCode | quantize.Coded) -> tuple[np.ndarray, ...]:
    """A code's parts as `decode` takes them, on the host: a wire code's bytes are viewed, not copied."""
    if isinstance(code, DeviceCode):
        return code.host_parts()
    shape, scheme, data = tuple(code.shape), code.scheme, code.data
    if scheme == "fp32":
        return (np.frombuffer(data, "<f4").reshape(shape),)
    if scheme == "bf16":
        return (np.frombuffer(data, ml_dtypes.bfloat16).reshape(shape),)
    if scheme not in quantize.LEVELS:
        raise quantize.CodecError(f"{scheme!r} is not a device codec; these are: {ON_DEVICE}")
    rows, cols = _rows(shape)
    scale = np.frombuffer(data, "<f4", count=rows)
    codes = np.frombuffer(data, np.int8 if scheme == "int8" else np.uint8, offset=4 * rows)
    return scale, codes.reshape(rows, (cols + 1) // 2 if scheme == "int4" else cols)
