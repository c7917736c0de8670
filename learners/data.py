"""Token shards: the on-disk format learners read, and batches drawn from it.

A prepared corpus is a directory with `manifest.json` and raw little-endian token files: one
`train-XXXXX-of-YYYYY.bin` per learner and `heldout.bin`. Tokens are uint16 when every id fits
(vocabulary up to 65,536) and uint32 above that; the manifest's `dtype` says which, and manifests
written before the field existed mean uint16. Documents are joined with the manifest's `separator`:
token 0 for the byte-level vocabulary (NUL never occurs in text, so it needs no extra id), the
tokenizer's end-of-document token otherwise.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
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


def epoch_windows(n_tokens: int, seed: int, index: int, epoch: int, span: int) -> np.ndarray:
    """The window starts shard `index` reads in `epoch`, in reading order: the shard cut into windows of
    `span` tokens at a seeded phase, in a seeded order."""
    rng = np.random.default_rng([seed, index, epoch])
    phase = int(rng.integers(0, span))
    return phase + span * rng.permutation((n_tokens - phase) // span).astype(np.int64)


def _epoch_length(n_tokens: int, seed: int, index: int, epoch: int, span: int) -> int:
    """len(epoch_windows(...)) without drawing the order."""
    phase = int(np.random.default_rng([seed, index, epoch]).integers(0, span))
    return max(n_tokens - phase, 0) // span


def epochs_read(n_tokens: int, seed: int, index: int, windows: int, span: int) -> float:
    """How many epochs of its shard a reader of `windows` windows got through (1.5: all of the first
    and half of the second), by the epoch lengths shard_batches reads."""
    e, left = 0, windows
    while True:
        n = _epoch_length(n_tokens, seed, index, e, span)
        if n == 0:
            return float(e)
        if left < n:
            return e + left / n
        e, left = e + 1, left - n


def shard_batches(tokens: np.ndarray, shard, *, batch_size: int, seq_len: int):
    """Endless (B, T + 1) int32 batches of this host's share of one learner's shard, read without
    replacement: each epoch cuts the shard into windows of T + 1 tokens at a seeded phase and reads
    them in a seeded order, so every window is trained once before any is trained again. `shard` (a
    diloco.DataShard) says which: its seed and index fix every epoch's order, and a learner that
    resumes at `start_step` (a restart, a spare, a joiner) reads on from the window that step
    reached instead of a new random stream. Each step reads B x `processes` windows, this host
    (`process`) the B-th slice of them."""
    span = seq_len + 1
    if len(tokens) < 2 * span:
        raise DataError(f"shard has {len(tokens)} tokens, fewer than two sequences of {span}")
    per_step = batch_size * shard.processes

    def windows():  # every window start in reading order, from the one start_step reached
        e, skip = 0, shard.start_step * per_step  # windows the steps before start_step read
        while True:
            order = epoch_windows(len(tokens), shard.seed, shard.index, e, span)
            yield from order[skip:]
            skip = max(skip - len(order), 0)
            e += 1

    stream = windows()
    lo, hi = shard.process * batch_size, (shard.process + 1) * batch_size
    while True:
        starts = np.fromiter(itertools.islice(stream, per_step), np.int64, per_step)
        yield np.stack([tokens[s:s + span] for s in starts[lo:hi]]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, n_batches: int, batch_size: int, seq_len: int) -> np.ndarray:
    """A fixed (N, B, T + 1) stack of evenly spaced held-out windows: the same for every eval."""
    n = n_batches * batch_size
    span = seq_len + 1
    if len(tokens) < span:
        raise DataError(f"held-out set has {len(tokens)} tokens, fewer than one sequence of {span}")
    starts = np.linspace(0, len(tokens) - span, n).astype(np.int64)
    return np.stack([tokens[s:s + span] for s in starts]).astype(np.int32).reshape(n_batches, batch_size, span)


def ensure_corpus(corpus: str | None, data_dir: str, *, learners: int, heldout_fraction: float,
                  max_bytes: int, seed: int, tokenizer: str = "bytes", text_field: str = "text",
                  near_duplicates: float | None = None, separator: int | None = None) -> Corpus:
    """Reuse a prepared corpus for the same inputs and settings, or run the Beam corpus pipeline now.

    corpus=None is the Python standard library's sources; tokenizer is "bytes", a Hugging Face
    tokenizer.json or a SentencePiece .model; text_field names the documents' field in JSON Lines and
    Parquet files; near_duplicates, a Jaccard threshold, also drops near duplicates; separator, the id
    that joins documents (None: the tokenizer's). The pipeline writes into a scratch directory that is renamed into place, so a
    crashed or concurrent preparation never leaves a half-written corpus under the key.
    """
    try:  # Beam loads only when a corpus is asked for, and is installed by the pipelines extra
        from diloco.pipelines.corpus import prepare, tokenizer_spec
        from diloco.pipelines.near_duplicates import NearDuplicates
    except ModuleNotFoundError as err:
        from diloco.extras import install_hint

        if (hint := install_hint(err)) is None:
            raise
        raise ModuleNotFoundError(f"preparing a corpus (data.prepared is not set): {hint}", name=err.name) from None

    # A tokenizer file enters the key with its SHA-256, so an edited file is a new corpus. "bytes"
    # and the defaults of the text field and near duplicates add nothing, so corpora cached before
    # they could be chosen keep their keys.
    tok = [] if tokenizer == "bytes" else [tokenizer, tokenizer_spec(tokenizer).sha256]
    field = [] if text_field == "text" else [f"text_field={text_field}"]
    near = [] if near_duplicates is None else [f"near_duplicates={near_duplicates}"]
    sep = [] if separator is None else [f"separator={separator}"]
    key = hashlib.sha256(json.dumps([corpus or "stdlib", learners, heldout_fraction, max_bytes, seed,
                                     "beam/1", *tok, *field, *near, *sep]).encode()).hexdigest()[:12]
    out = Path(data_dir) / key
    if (out / MANIFEST).is_file():
        return Corpus.open(out)
    tmp = out.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        prepare(None if corpus is None else [corpus], str(tmp), learners=learners, heldout_fraction=heldout_fraction,
                seed=seed, max_bytes=max_bytes, tokenizer_name=tokenizer, text_field=text_field,
                near_duplicates=None if near_duplicates is None else NearDuplicates(near_duplicates),
                separator=separator, pipeline_args=["--runner=FnApiRunner"])
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same corpus first
            if not (out / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Corpus.open(out)


def corpus_for(cfg) -> Corpus:
    """The run's token shards: `data.prepared` when set (as `diloco train` does in the run's config),
    else the cached preparation of `data.corpus` for the run's learners (prepared now if missing)."""
    if cfg.data.prepared:
        return Corpus.open(cfg.data.prepared)
    return ensure_corpus(cfg.data.corpus, cfg.data.dir, learners=cfg.num_shards,
                         heldout_fraction=cfg.data.heldout_fraction, max_bytes=cfg.data.max_corpus_bytes,
                         seed=cfg.data.seed, tokenizer=cfg.data.tokenizer, text_field=cfg.data.text_field,
                         near_duplicates=cfg.data.near_duplicates, separator=cfg.data.separator)
