"""Token shards: the on-disk format learners read, and batches drawn from it.

A prepared corpus is a directory with `manifest.json` and raw little-endian uint16 token files:
one `train-XXXXX-of-YYYYY.bin` per learner and `heldout.bin`. Documents are joined with token 0
(NUL never occurs in text, so the byte-level vocabulary needs no extra id).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "diloco-tokens/1"
SEPARATOR = 0
MANIFEST = "manifest.json"


class DataError(ValueError):
    pass


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
        return Corpus(path, manifest)

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    def train_tokens(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_shards:
            raise DataError(f"learner shard {index} does not exist; the corpus has {self.num_shards} shards")
        return np.memmap(self.dir / self.manifest["shards"][index]["name"], dtype="<u2", mode="r")

    def heldout_tokens(self) -> np.ndarray:
        return np.memmap(self.dir / self.manifest["heldout"]["name"], dtype="<u2", mode="r")


def sample_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int, seed):
    """Endless (B, T + 1) int32 batches of random windows from one token stream."""
    if len(tokens) < seq_len + 2:
        raise DataError(f"shard has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        yield np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, n_batches: int, batch_size: int, seq_len: int) -> np.ndarray:
    """A fixed (N, B, T + 1) stack of evenly spaced held-out windows: the same for every eval."""
    n = n_batches * batch_size
    span = seq_len + 1
    if len(tokens) < span:
        raise DataError(f"held-out set has {len(tokens)} tokens, fewer than one sequence of {span}")
    starts = np.linspace(0, len(tokens) - span, n).astype(np.int64)
    return np.stack([tokens[s:s + span] for s in starts]).astype(np.int32).reshape(n_batches, batch_size, span)


def ensure_corpus(corpus: str | None, data_dir: str, *, learners: int, heldout_fraction: float,
                  max_bytes: int, seed: int) -> Corpus:
    """Reuse a prepared corpus for the same inputs and settings, or run the Beam corpus pipeline now.

    corpus=None is the Python standard library's sources. The pipeline writes into a scratch
    directory that is renamed into place, so a crashed or concurrent preparation never leaves a
    half-written corpus under the key.
    """
    from diloco.pipelines.corpus import (
        prepare,  # Beam loads only when a corpus must be built
    )

    key = hashlib.sha256(json.dumps([corpus or "stdlib", learners, heldout_fraction, max_bytes, seed,
                                     "beam/1"]).encode()).hexdigest()[:12]
    out = Path(data_dir) / key
    if (out / MANIFEST).is_file():
        return Corpus.open(out)
    tmp = out.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        prepare(None if corpus is None else [corpus], str(tmp), learners=learners, heldout_fraction=heldout_fraction,
                seed=seed, max_bytes=max_bytes, pipeline_args=["--runner=FnApiRunner"])
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same corpus first
            if not (out / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Corpus.open(out)
