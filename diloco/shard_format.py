"""The token shard format: what a prepared corpus is on disk, written by the corpus pipeline
(pipelines/corpus.py) and read by learners (learners/data.py), each importing it from here.

A prepared corpus is a directory with `manifest.json` and raw little-endian token files: one
`train-XXXXX-of-YYYYY.bin` per learner and `heldout.bin`. Tokens are uint16 when every id fits
(vocabulary up to 65,536) and uint32 above that; the manifest's `dtype` says which, and manifests
written before the field existed mean uint16. Documents are joined with the manifest's `separator`:
token 0 for the byte-level vocabulary (NUL never occurs in text, so it needs no extra id), the
tokenizer's end-of-document token otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "diloco-tokens/1"
SEPARATOR = 0           # the byte-level vocabulary's separator
MANIFEST = "manifest.json"
DTYPES = {"uint16": "<u2", "uint32": "<u4"}   # manifest `dtype` -> the files' numpy dtype
MAX_VOCAB = 2**31       # batches are int32: an id of 2**31 or more would wrap


class DataError(ValueError):
    pass


def token_dtype(vocab_size: int) -> str:
    """The manifest `dtype` for a vocabulary of ids 0..vocab_size-1: the narrowest that holds them."""
    if vocab_size > MAX_VOCAB:
        raise DataError(f"vocabulary of {vocab_size:,} ids: batches are int32, so ids must stay below 2**31 "
                        f"({MAX_VOCAB:,})")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_name(index: int, count: int) -> str:
    return f"train-{index:05d}-of-{count:05d}.bin"


@dataclass(frozen=True)
class Corpus:
    dir: Path
    manifest: dict

    @staticmethod
    def open(path: str | Path) -> Corpus:
        path = Path(path)
        mf = path / MANIFEST
        if not mf.is_file():
            raise DataError(f"{path} is not a prepared corpus (no {MANIFEST}); run `diloco data prepare`")
        manifest = json.loads(mf.read_text())
        if manifest.get("format") != FORMAT:
            raise DataError(f"{mf}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        if manifest.get("dtype", "uint16") not in DTYPES:
            raise DataError(f"{mf}: token dtype {manifest['dtype']!r}, expected one of {sorted(DTYPES)}")
        if manifest.get("vocab_size", 256) > MAX_VOCAB:
            raise DataError(f"{mf}: vocabulary of {manifest['vocab_size']:,} ids does not fit int32 batches")
        return Corpus(path, manifest)

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    @property
    def vocab_size(self) -> int:
        return self.manifest.get("vocab_size", 256)  # manifests without it are byte-level

    @property
    def dtype(self) -> np.dtype:
        """The token files' dtype: little-endian uint16 or uint32 (manifests without `dtype`: uint16)."""
        return np.dtype(DTYPES[self.manifest.get("dtype", "uint16")])

    def train_tokens(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_shards:
            raise DataError(f"learner shard {index} does not exist; the corpus has {self.num_shards} shards")
        return np.memmap(self.dir / self.manifest["shards"][index]["name"], dtype=self.dtype, mode="r")

    def heldout_tokens(self) -> np.ndarray:
        return np.memmap(self.dir / self.manifest["heldout"]["name"], dtype=self.dtype, mode="r")
