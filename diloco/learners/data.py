"""Token shards: the on-disk format learners read, and batches drawn from it.

A prepared corpus is a directory with `manifest.json` and raw little-endian uint16 token files:
one `train-XXXXX-of-YYYYY.bin` per learner and `heldout.bin`. Documents are joined with token 0
(NUL never occurs in text, so the byte-level vocabulary needs no extra id).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
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


def sample_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int):
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


# --- default corpus preparation (plain Python; the Beam pipeline produces the same format) ---

def default_sources() -> list[Path]:
    """Text every machine has: the Python standard library's own source files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def resolve_sources(corpus: str | None) -> list[Path]:
    if corpus is None:
        return default_sources()
    p = Path(corpus)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else sorted(Path(f) for f in glob.glob(corpus, recursive=True))
    if not files:
        raise DataError(f"data.corpus {corpus!r} matches no files")
    return files


def prepare_corpus(sources: list[Path], out: Path, *, learners: int, heldout_fraction: float,
                   max_bytes: int, seed: int) -> Corpus:
    """Byte-tokenize documents; split held-out by a hash of the content; deal train docs to shards."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[bytes]] = [[] for _ in range(learners)]
    heldout: list[bytes] = []
    seen, total, skipped = set(), 0, 0
    for path in sources:
        try:
            text = path.read_bytes().decode("utf-8").replace("\x00", "").encode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        digest = hashlib.sha256(text).digest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        total += len(text)
        if total > max_bytes:
            break
        h = int.from_bytes(hashlib.sha256(digest + seed.to_bytes(8, "little")).digest()[:8], "little")
        if (h % 10_000) / 10_000 < heldout_fraction:
            heldout.append(text)
        else:
            shards[h % learners].append(text)

    def write(name: str, docs: list[bytes]) -> dict:
        arr = np.frombuffer(bytes([SEPARATOR]).join(docs), dtype=np.uint8).astype("<u2")
        tmp = out / (name + ".tmp")
        arr.tofile(tmp)
        os.replace(tmp, out / name)
        return {"name": name, "documents": len(docs), "tokens": int(arr.size)}

    manifest = {
        "format": FORMAT, "tokenizer": "bytes", "vocab_size": 256, "dtype": "uint16", "seed": seed,
        "heldout_fraction": heldout_fraction, "skipped_files": skipped,
        "shards": [write(shard_name(i, learners), docs) for i, docs in enumerate(shards)],
        "heldout": write("heldout.bin", heldout),
    }
    if any(s["tokens"] == 0 for s in manifest["shards"]) or manifest["heldout"]["tokens"] == 0:
        raise DataError(f"corpus too small for {learners} shards and a held-out set: {manifest}")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return Corpus(out, manifest)


def ensure_corpus(corpus: str | None, data_dir: str, *, learners: int, heldout_fraction: float,
                  max_bytes: int, seed: int) -> Corpus:
    """Reuse a prepared corpus for the same inputs and settings, or prepare it now."""
    key = hashlib.sha256(json.dumps([corpus or "stdlib", learners, heldout_fraction, max_bytes, seed]).encode()).hexdigest()[:12]
    out = Path(data_dir) / key
    if (out / MANIFEST).is_file():
        return Corpus.open(out)
    return prepare_corpus(resolve_sources(corpus), out, learners=learners, heldout_fraction=heldout_fraction,
                          max_bytes=max_bytes, seed=seed)
