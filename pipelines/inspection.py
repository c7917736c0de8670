"""What a prepared corpus holds (`diloco data inspect`): its manifest read back, its files checked.

Local directories and any Beam filesystem URL (gs://...). Checking a file streams it once: its size
must be its token count times the token width and its SHA-256 the manifest's, so a truncated copy,
a shard from another preparation or a flipped byte shows before a run trains on it.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems

from diloco.pipelines.corpus import load_tokenizer, tokenizer_spec
from diloco.shard_format import DTYPES, FORMAT, MANIFEST, DataError

READ_CHUNK = 1 << 22       # bytes per read while checking a file
PREVIEW_BYTES = 1 << 20    # the head of a file the document preview decodes


def read_manifest(corpus: str) -> dict:
    path = FileSystems.join(corpus, MANIFEST)
    try:
        with FileSystems.open(path, compression_type="uncompressed") as f:
            manifest = json.loads(f.read())
    except (OSError, BeamIOError):
        raise DataError(f"{corpus} is not a prepared corpus: no {MANIFEST} (a preparation writes it last, so "
                        f"one that did not finish has none); run `diloco data prepare`") from None
    except ValueError as err:
        raise DataError(f"{path} is not JSON: {err}") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def files_of(manifest: dict) -> list[dict]:
    return [*manifest["shards"], manifest["heldout"]]


def check_file(corpus: str, entry: dict, itemsize: int) -> str | None:
    """None when the file is what the manifest says, else what is wrong with it."""
    path = FileSystems.join(corpus, entry["name"])
    sha, size = hashlib.sha256(), 0
    try:
        with FileSystems.open(path, compression_type="uncompressed") as f:
            while chunk := f.read(READ_CHUNK):
                sha.update(chunk)
                size += len(chunk)
    except (OSError, BeamIOError) as err:
        return f"missing or unreadable ({type(err).__name__})"
    if size != entry["tokens"] * itemsize:
        return f"{size:,} bytes, the manifest's {entry['tokens']:,} tokens are {entry['tokens'] * itemsize:,}"
    if entry["sha256"] is not None and sha.hexdigest() != entry["sha256"]:
        return f"SHA-256 {sha.hexdigest()[:12]}..., the manifest says {entry['sha256'][:12]}..."
    return None


def decoder(manifest: dict, tokenizer: str | None):
    """ids -> text for the corpus's tokenizer: bytes need nothing; a tokenizer file must be given and be
    the one the corpus was prepared with (same SHA-256)."""
    if manifest.get("tokenizer_kind", "bytes") == "bytes":
        return lambda ids: np.asarray(ids, np.uint8).tobytes().decode("utf-8", errors="replace")
    if tokenizer is None:
        raise DataError(f"the corpus was prepared with {manifest['tokenizer']}: pass it (--tokenizer PATH) to "
                        f"decode documents")
    spec = tokenizer_spec(tokenizer)
    if spec.sha256 != manifest.get("tokenizer_sha256"):
        raise DataError(f"{tokenizer} is not the tokenizer the corpus was prepared with (SHA-256 "
                        f"{spec.sha256[:12]}..., the manifest says {str(manifest.get('tokenizer_sha256'))[:12]}...)")
    tok = load_tokenizer(spec)
    if spec.kind == "huggingface":
        return lambda ids: tok.tok.decode([int(i) for i in ids], skip_special_tokens=False)
    return lambda ids: tok.sp.decode([int(i) for i in ids])


def first_documents(corpus: str, entry: dict, manifest: dict, n: int, decode) -> list[str]:
    """The first n documents of a file (from its first PREVIEW_BYTES), decoded."""
    dtype = np.dtype(DTYPES[manifest.get("dtype", "uint16")])
    with FileSystems.open(FileSystems.join(corpus, entry["name"]), compression_type="uncompressed") as f:
        head = f.read(PREVIEW_BYTES)
    ids = np.frombuffer(head[:len(head) // dtype.itemsize * dtype.itemsize], dtype)
    ends = np.flatnonzero(ids == manifest.get("separator", 0))
    docs, start = [], 0
    for end in [*ends, len(ids)][:n]:
        docs.append(decode(ids[start:end]))
        start = end + 1
    return docs


def inspect_corpus(corpus: str, *, verify: bool = False, documents: int = 0, tokenizer: str | None = None) -> dict:
    """The corpus's summary: settings, per-file figures (and `problem` when verify finds one), what
    the preparation dropped, and with documents > 0 the first documents of each file."""
    m = read_manifest(corpus)
    itemsize = np.dtype(DTYPES[m.get("dtype", "uint16")]).itemsize
    files = []
    for entry in files_of(m):
        row = {k: entry[k] for k in ("name", "documents", "tokens", "sequences", "sha256")}
        if verify:
            row["problem"] = check_file(corpus, entry, itemsize)
        files.append(row)
    decode = decoder(m, tokenizer) if documents else None
    counts = m.get("counts", {})
    near = m.get("near_duplicates")
    return {
        "corpus": corpus, "format": m["format"], "content_sha256": m["content_sha256"],
        "tokenizer": m.get("tokenizer", "bytes"), "tokenizer_kind": m.get("tokenizer_kind", "bytes"),
        "vocab_size": m.get("vocab_size", 256), "dtype": m.get("dtype", "uint16"), "separator": m.get("separator", 0),
        "seq_len": m.get("seq_len"), "seed": m.get("seed"), "heldout_fraction": m.get("heldout_fraction"),
        "text_field": m.get("text_field", "text"), "sources": m.get("sources", []), "files": files,
        "totals": {k: sum(f[k] for f in files) for k in ("documents", "tokens", "sequences")},
        "dropped": {"duplicates": counts.get("duplicates_dropped", 0),
                    "near_duplicates": None if near is None else near["dropped"],
                    "bad_rows": m.get("bad_rows", {}), "skipped": len(m.get("skipped", [])),
                    "capped_files": m.get("capped_files", 0)},
        "records_read": counts.get("records_read", 0), "files_read": counts.get("files_read", 0),
        "moved": m.get("moved", []),
        "verified": None if not verify else all(f["problem"] is None for f in files),
        "documents": {} if not documents else {
            e["name"]: first_documents(corpus, e, m, documents, decode) for e in files_of(m)},
    }
