"""The lossless stage after a code: what travels is `pack(codes)`, what a reader decodes is exactly
the codes again, so packing changes bytes and never a bit of any parameter.

- none: the codes as they are.
- zstd: one Zstandard frame (RFC 8878) of the codes, at level 1, its header stating the content
  size. Quantized deltas are far from uniform (most codes sit near zero), so an entropy coder takes
  a sixth to a third off int4 and int8 codes at hundreds of MB/s (docs/wire-format.md, "Packing").

A reader knows how many bytes the codes must have (from their shapes and scheme), and `unpack`
accepts only a frame that says exactly that size and holds nothing after it: a frame claiming more
is refused before anything is allocated, so a small record cannot make a reader hold a large one.
"""

from __future__ import annotations

import zstandard

PACKINGS = ("none", "zstd")
ZSTD_LEVEL = 1  # levels 1-9 pack quantized codes alike (Huffman does the work); 1 is the fastest


class PackingError(ValueError):
    pass


def pack(codes: bytes, packing: str) -> bytes:
    if packing == "none":
        return bytes(codes)
    if packing == "zstd":
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(codes)
    raise PackingError(f"unknown packing {packing!r}; known: {PACKINGS}")


def pack_smaller(codes: bytes, packing: str) -> tuple[str, bytes]:
    """(the packing used, what to send): `packing`'s output where it is smaller than the codes, else
    the codes as they are (a frame costs about a dozen bytes: a tiny tensor would grow)."""
    packed = pack(codes, packing)
    return (packing, packed) if len(packed) < len(codes) else ("none", bytes(codes))


def unpack(packed: bytes | memoryview, packing: str, nbytes: int) -> bytes:
    """The codes, which must be exactly `nbytes` long; PackingError says what is wrong otherwise."""
    if packing == "none":
        if len(packed) != nbytes:
            raise PackingError(f"{len(packed)} bytes where the codes have {nbytes}")
        return bytes(packed)
    if packing != "zstd":
        raise PackingError(f"unknown packing {packing!r}; known: {PACKINGS}")
    packed = bytes(packed)
    try:
        size = zstandard.frame_content_size(packed)
    except zstandard.ZstdError as err:
        raise PackingError(f"not a zstd frame: {err}") from None
    if size != nbytes:  # -1: the frame does not say (refused: its size would be unbounded)
        raise PackingError(f"zstd frame holds {'an unstated size' if size < 0 else f'{size} bytes'} "
                           f"where the codes have {nbytes}")
    try:
        codes = zstandard.ZstdDecompressor().decompress(packed, max_output_size=nbytes, allow_extra_data=False)
    except zstandard.ZstdError as err:
        raise PackingError(f"zstd frame does not decode: {err}") from None
    if len(codes) != nbytes:
        raise PackingError(f"zstd frame decoded to {len(codes)} bytes where the codes have {nbytes}")
    return codes
