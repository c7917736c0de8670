"""Corpus pipeline: text, JSON Lines and Parquet files to the token shards learners read (format:
`diloco.shard_format`).

    plan (match inputs, cap bytes) -> Beam: read + normalise -> drop duplicates -> tokenize -> split
    -> rebalance (no empty output) -> pack one file per shard -> finalise (manifest.json)

Every choice that places a document is a function of its content hash and the seed, and each shard
is written sorted by content hash, so the same input gives byte-identical shards on any runner.
Planning happens before the pipeline because the byte cap keeps a prefix of the sorted file list,
which is a global decision; everything per document happens in the pipeline.

The tokenizer is "bytes" (UTF-8 bytes, vocabulary 256), a Hugging Face tokenizer.json or a
SentencePiece .model. DoFns carry only its spec (kind, path, SHA-256) and load it in setup(), so
nothing loaded is pickled and workers check they read the same file the manifest names.

A text file is one document. A JSON Lines file (.jsonl, .jsonl.gz, .jsonl.zst) or a Parquet file
(.parquet) holds one document per line / row: the string in its text field. Rows that cannot be a
document are skipped and counted by reason (`bad_rows_<reason>`, BAD_ROW_REASONS); a record file
that cannot be read at all is an error naming it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import sysconfig
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece
import tokenizers
import zstandard
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from diloco.pipelines.near_duplicates import DropNearDuplicates, NearDuplicates
from diloco.shard_format import DTYPES, FORMAT, MANIFEST, SEPARATOR, DataError, shard_name, token_dtype

NEAR_DUPLICATES_LISTED = 1000   # dropped near duplicates the manifest names (all are counted)
HELDOUT = -1       # split key of the held-out set; train shards are 0..learners-1
PARTS = ".parts"   # the pipeline's small outputs, read by the finaliser and then deleted
NS = "corpus"      # Beam Metrics namespace

log = logging.getLogger(__name__)


# --- tokenizers ------------------------------------------------------------------------------

KINDS = {".json": "huggingface", ".model": "sentencepiece"}   # file suffix -> kind
# Hugging Face tokenizers name their end-of-document token differently; the first one present joins documents.
EOD_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer, as plain values: what DoFns carry (a loaded tokenizer need not pickle)."""

    kind: str               # "bytes", "huggingface" or "sentencepiece"
    path: str | None = None  # the file: local (absolute) or any Beam filesystem URL
    sha256: str | None = None

    @property
    def name(self) -> str:
        return "bytes" if self.path is None else self.path.rstrip("/").rsplit("/", 1)[-1]


def _read(path: str) -> bytes:
    with FileSystems.open(path, compression_type="uncompressed") as f:
        return f.read()


def tokenizer_spec(name: str) -> TokenizerSpec:
    """"bytes", or a path ending in .json (Hugging Face) or .model (SentencePiece), to a spec."""
    if name == "bytes":
        return TokenizerSpec("bytes")
    kind = next((k for suffix, k in KINDS.items() if name.endswith(suffix)), None)
    if kind is None:
        raise DataError(f"unknown tokenizer {name!r}: expected 'bytes', a Hugging Face tokenizer file (a path "
                        f"ending in .json) or a SentencePiece model (a path ending in .model)")
    path = name if FileSystems.get_scheme(name) else os.path.abspath(name)  # workers need not share our cwd
    try:
        data = _read(path)
    except (OSError, BeamIOError):
        raise DataError(f"tokenizer file {path} does not exist or cannot be read") from None
    return TokenizerSpec(kind, path, hashlib.sha256(data).hexdigest())


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, and 0 (NUL, stripped from text) is free as separator (a
    model that reads 0 as padding wants another: data.separator, `with_separator`)."""

    vocab_size = 256
    separator = SEPARATOR

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


class HuggingFaceTokenizer:
    def __init__(self, data: bytes, name: str):
        try:
            self.tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # the library raises bare Exception for a malformed file
            raise DataError(f"{name} is not a Hugging Face tokenizer file: {err}") from None
        self.tok.encode_special_tokens = True  # "</s>" written inside a document is text, not a document end
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1  # ids need not be contiguous: the model needs max + 1
        self.separator = next((i for t in EOD_TOKENS if (i := self.tok.token_to_id(t)) is not None), None)
        self.missing = f"none of {list(EOD_TOKENS)} is in its vocabulary"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)


class SentencePieceTokenizer:
    def __init__(self, data: bytes, name: str):
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        except (RuntimeError, OSError, TypeError) as err:
            raise DataError(f"{name} is not a SentencePiece model: {err}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.separator = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.missing = "its eos_id() is -1 (train it with an eos_id >= 0; SentencePiece's default is 2)"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.sp.encode(text), dtype=np.int64)  # control symbols such as </s> are never matched


def load_tokenizer(spec: TokenizerSpec):
    """The tokenizer a spec names, checked: the same file, a vocabulary int32 batches hold, a separator."""
    if spec.kind == "bytes":
        return ByteTokenizer()
    data = _read(spec.path)
    if hashlib.sha256(data).hexdigest() != spec.sha256:
        raise DataError(f"tokenizer file {spec.path} changed while the corpus was being prepared")
    tok = (HuggingFaceTokenizer if spec.kind == "huggingface" else SentencePieceTokenizer)(data, spec.name)
    if tok.vocab_size < 1:
        raise DataError(f"tokenizer {spec.name} has an empty vocabulary")
    token_dtype(tok.vocab_size)  # raises for ids that int32 batches cannot hold
    if tok.separator is None:
        raise DataError(f"tokenizer {spec.name} has no end-of-document token to join documents with: {tok.missing}")
    return tok


def with_separator(tok, separator: int | None):
    """The tokenizer with documents joined by `separator` instead of its own end-of-document id. Bytes
    grow their vocabulary to hold it (256 needs a model of vocab_size 257); another tokenizer's must be
    one of its ids."""
    if separator is None:
        return tok
    if isinstance(tok, ByteTokenizer):
        tok = ByteTokenizer()
        tok.vocab_size = max(256, separator + 1)
    elif separator >= tok.vocab_size:
        raise DataError(f"separator {separator} is not an id of the tokenizer's vocabulary of {tok.vocab_size}")
    token_dtype(tok.vocab_size)  # raises for ids that int32 batches cannot hold
    tok.separator = separator
    return tok


# --- planning: which files, before the pipeline --------------------------------------------------

@dataclass(frozen=True)
class Source:
    path: str
    size: int


@dataclass(frozen=True)
class CorpusPlan:
    files: list[Source]     # sorted by path, after the byte cap
    sources: list[dict]     # per input: what it matched
    skipped: list[dict]     # inputs that matched nothing
    capped: int             # files left out by max_bytes


def __getattr__(name: str):
    if name == "Plan":  # the run's plan is diloco.plan.Plan; this one was renamed so the two never meet
        warnings.warn("diloco.pipelines.corpus.Plan is now CorpusPlan; the old name goes next release",
                      DeprecationWarning, stacklevel=2)
        return CorpusPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stdlib_sources() -> tuple[str, list[Source]]:
    """The default corpus, text every machine has: the Python standard library's own .py sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return f"{root}/**/*.py", [Source(str(p), p.stat().st_size) for p in files]


def _pattern(spec: str) -> str:
    """A directory stands for everything below it."""
    if spec.endswith("/") or (FileSystems.get_scheme(spec) is None and os.path.isdir(spec)):
        return spec.rstrip("/") + "/**"
    return spec


def match_inputs(inputs: list[str]) -> tuple[list[dict], list[dict], list[Source]]:
    sources, skipped, files = [], [], {}
    for spec in inputs:
        try:
            found = [Source(m.path, m.size_in_bytes) for m in FileSystems.match([_pattern(spec)])[0].metadata_list]
        except BeamIOError as err:
            found, reason = [], f"cannot list: {err}"
        else:
            reason = "matches no files"
        if not found:
            skipped.append({"path": spec, "reason": reason})
        sources.append({"input": spec, "files": len(found), "bytes": sum(f.size for f in found)})
        files |= {f.path: f for f in found}
    return sources, skipped, sorted(files.values(), key=lambda f: f.path)


def plan(inputs: list[str] | None, max_bytes: int | None = None) -> CorpusPlan:
    """Match the inputs (None = the stdlib corpus) and keep the sorted prefix that fits max_bytes."""
    if inputs is None:
        pattern, files = stdlib_sources()
        sources, skipped = [{"input": pattern, "files": len(files), "bytes": sum(f.size for f in files)}], []
    else:
        sources, skipped, files = match_inputs(inputs)
    kept, total = [], 0
    for f in files:
        if max_bytes is not None and total + f.size > max_bytes:
            break
        kept.append(f)
        total += f.size
    return CorpusPlan(kept, sources, skipped, len(files) - len(kept))


# --- the pipeline ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Doc:
    path: str
    digest: str     # sha256 of the normalised text, hex
    text: str


@dataclass(frozen=True)
class Tokens:
    path: str
    digest: str
    data: bytes     # the document's token ids in the corpus dtype (little-endian), separator-free


def normalise(text: str) -> str:
    return text.lstrip("\ufeff").replace("\x00", "").replace("\r\n", "\n").replace("\r", "\n")


class ReadNormalised(beam.DoFn):
    """Path -> Doc; files that cannot become a document go to the `skipped` output with a reason."""

    SKIPPED = "skipped"

    def __init__(self):
        self.read = Metrics.counter(NS, "files_read")
        self.bytes = Metrics.counter(NS, "bytes_read")
        self.unreadable = Metrics.counter(NS, "skipped_unreadable")
        self.not_utf8 = Metrics.counter(NS, "skipped_not_utf8")
        self.empty = Metrics.counter(NS, "skipped_empty")

    def process(self, path: str):
        try:
            with FileSystems.open(path, compression_type="uncompressed") as f:
                raw = f.read()
        except (OSError, BeamIOError) as err:
            self.unreadable.inc()
            yield beam.pvalue.TaggedOutput(self.SKIPPED, {"path": path, "reason": f"unreadable: {type(err).__name__}"})
            return
        self.read.inc()
        self.bytes.inc(len(raw))
        try:
            text = normalise(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            self.not_utf8.inc()
            yield beam.pvalue.TaggedOutput(self.SKIPPED, {"path": path, "reason": f"not UTF-8 (byte {err.start})"})
            return
        if not text.strip():
            self.empty.inc()
            yield beam.pvalue.TaggedOutput(self.SKIPPED, {"path": path, "reason": "empty"})
            return
        yield Doc(path, hashlib.sha256(text.encode("utf-8")).hexdigest(), text)


# --- record files: one document per JSON line or Parquet row ---------------------------------------

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
# Why a row is not a document; each is counted as `bad_rows_<reason>` and reported under `bad_rows`.
BAD_ROW_REASONS = ("not_utf8", "not_json", "not_an_object", "missing_field", "not_a_string", "empty", "too_long")
# A JSON Lines row longer than this (its line end aside) is skipped as too_long, read and dropped in pieces:
# a few kilobytes of .jsonl.zst can hold a line of gigabytes, and one row costs a few times its length in memory.
MAX_JSON_LINE_BYTES = 32 << 20
PARQUET_BATCH_ROWS = 1024   # rows per Parquet read: a file streams, it is never read whole
# What reading or decompressing a record file raises when the file itself is broken.
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, zstandard.ZstdError, pa.ArrowException, BeamIOError)

Row = tuple[str, None] | tuple[None, str]   # (normalised text, None) or (None, reason)


def record_format(path: str) -> str | None:
    """"jsonl", "parquet", or None for a text file (one document), by the file name's suffix."""
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def value_text(value) -> Row:
    """A record's text-field value -> its normalised text, or why it is not a document."""
    if isinstance(value, bytes):  # a Parquet binary column, or a string column read as bytes
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "not_utf8"
    if not isinstance(value, str):  # null included
        return None, "not_a_string"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, which JSON's "\ud800" escape can produce
        return None, "not_utf8"
    text = normalise(value)
    if not text.strip():
        return None, "empty"
    return text, None


def json_line_text(line: bytes, field: str) -> Row:
    """One JSON Lines line (bytes) -> the normalised text of its `field`, or why it is not a document."""
    try:
        decoded = line.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError:
        return None, "not_utf8"
    try:
        obj = json.loads(decoded)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json reads
        return None, "not_json"
    if not isinstance(obj, dict):
        return None, "not_an_object"
    if field not in obj:
        return None, "missing_field"
    return value_text(obj[field])


def _decompressed(path: str, raw):
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if name.endswith(".zst"):
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def bounded_lines(f, limit: int) -> Iterator[bytes | None]:
    """The lines of a binary stream, each read `limit` bytes (and its line end) at most; None for a longer
    line, whose rest is read and dropped `limit` bytes at a time rather than held."""
    while line := f.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(limit)
        yield None


def jsonl_rows(path: str, field: str, max_line_bytes: int = MAX_JSON_LINE_BYTES
               ) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, reason) per non-blank line, streamed (blank lines are not records); a line
    longer than `max_line_bytes` is too_long."""
    with FileSystems.open(path, compression_type="uncompressed") as raw, _decompressed(path, raw) as f:
        for n, line in enumerate(bounded_lines(f, max_line_bytes), 1):
            if line is None:
                yield n, None, "too_long"
            elif line.strip():
                yield n, *json_line_text(line, field)


def parquet_rows(path: str, field: str, batch_rows: int = PARQUET_BATCH_ROWS
                 ) -> Iterator[tuple[int, str | None, str | None]]:
    """(row number from 1, text, reason) per row, read `batch_rows` rows of one column at a time."""
    with FileSystems.open(path, compression_type="uncompressed") as f:
        pf = pq.ParquetFile(f)
        if pf.schema_arrow.get_field_index(field) < 0:
            for n in range(1, pf.metadata.num_rows + 1):
                yield n, None, "missing_field"
            return
        n = 0
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
            col = batch.column(0)
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                # as bytes, so that invalid UTF-8 is one bad row rather than a failed batch
                col = col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary())
            for value in col.to_pylist():
                n += 1
                yield n, *value_text(value)


class ReadRecords(beam.DoFn):
    """Path of a JSON Lines or Parquet file -> one Doc per good row, named `<path>:<row number>`.

    Bad rows are skipped and counted by reason; a file that cannot be read raises DataError naming it.
    """

    def __init__(self, text_field: str = "text"):
        self.text_field = text_field
        self.read = Metrics.counter(NS, "files_read")
        self.records = Metrics.counter(NS, "records_read")
        self.bad = {r: Metrics.counter(NS, f"bad_rows_{r}") for r in BAD_ROW_REASONS}

    def process(self, path: str):
        rows = parquet_rows if record_format(path) == "parquet" else jsonl_rows
        bad, first, seen = Counter(), None, 0
        try:
            for n, text, reason in rows(path, self.text_field):
                seen += 1
                if reason is not None:
                    bad[reason] += 1
                    first = first or (n, reason)
                    continue
                yield Doc(f"{path}:{n}", hashlib.sha256(text.encode("utf-8")).hexdigest(), text)
        except READ_ERRORS as err:
            raise DataError(f"cannot read {path}: {type(err).__name__}: {err}") from None
        self.read.inc()
        self.records.inc(seen)
        for reason, count in bad.items():
            self.bad[reason].inc(count)
        if bad:
            log.warning("%s: skipped %d of %d rows (%s); the first is row %d (%s)", path, sum(bad.values()), seen,
                        dict(sorted(bad.items())), *first)


def _is_record_file(path: str, _partitions: int) -> int:
    return int(record_format(path) is not None)


class ReadDocuments(beam.PTransform):
    """Paths -> {"docs": Doc, "skipped": {path, reason}}: text files whole, record files row by row."""

    def __init__(self, text_field: str = "text"):
        super().__init__()
        self.text_field = text_field

    def expand(self, paths):
        text_files, record_files = paths | "ByFormat" >> beam.Partition(_is_record_file, 2)
        out = text_files | "ReadNormalise" >> beam.ParDo(ReadNormalised()).with_outputs(ReadNormalised.SKIPPED,
                                                                                          main="docs")
        records = record_files | "ReadRecords" >> beam.ParDo(ReadRecords(self.text_field))
        docs = (out.docs, records) | "AllDocs" >> beam.Flatten()
        return {"docs": docs, "skipped": out[ReadNormalised.SKIPPED]}


class KeepFirst(beam.DoFn):
    def __init__(self):
        self.duplicates = Metrics.counter(NS, "duplicates_dropped")

    def process(self, element):
        _, docs = element
        docs = sorted(docs, key=lambda d: d.path)  # which copy survives must not depend on arrival order
        self.duplicates.inc(len(docs) - 1)
        yield docs[0]


class DropDuplicates(beam.PTransform):
    """Exact duplicates (same normalised text) collapse to the copy with the smallest path."""

    def expand(self, docs):
        return (docs
                | "KeyByDigest" >> beam.Map(lambda d: (d.digest, d))
                | "GroupCopies" >> beam.GroupByKey()
                | "KeepFirst" >> beam.ParDo(KeepFirst()))


class Tokenize(beam.DoFn):
    """Doc -> Tokens; documents the tokenizer fails on or leaves empty go to `skipped` with a reason.

    The separator id is removed from a document's tokens (counted): it may only mark document ends.
    """

    SKIPPED = "skipped"

    def __init__(self, spec: TokenizerSpec, dtype: str, separator: int | None = None):
        self.spec, self.dtype, self.separator = spec, dtype, separator
        self.tokens = Metrics.counter(NS, "tokens")
        self.separators = Metrics.counter(NS, "separator_tokens_dropped")
        self.failed = Metrics.counter(NS, "skipped_tokenizer_failed")
        self.empty = Metrics.counter(NS, "skipped_no_tokens")

    def setup(self):
        self.tok = with_separator(load_tokenizer(self.spec), self.separator)  # once per worker, from the spec's file

    def process(self, doc: Doc):
        try:
            ids = self.tok.encode(doc.text)
        except Exception as err:  # the tokenizers library raises bare Exception (e.g. WordLevel with no unk token)
            self.failed.inc()
            yield beam.pvalue.TaggedOutput(self.SKIPPED, {"path": doc.path,
                                                          "reason": f"tokenizer failed ({str(err)[:200]})"})
            return
        keep = ids != self.tok.separator
        if not keep.all():
            self.separators.inc(int((~keep).sum()))
            ids = ids[keep]
        if not len(ids):
            self.empty.inc()
            yield beam.pvalue.TaggedOutput(self.SKIPPED, {"path": doc.path, "reason": "no tokens"})
            return
        self.tokens.inc(len(ids))
        yield Tokens(doc.path, doc.digest, ids.astype(self.dtype).tobytes())


def split_hash(digest: str, seed: int) -> bytes:
    return hashlib.sha256(seed.to_bytes(8, "little", signed=True) + bytes.fromhex(digest)).digest()


def split_of(digest: str, *, learners: int, heldout_fraction: float, seed: int) -> int:
    """HELDOUT or a train shard; independent bytes of one keyed hash decide each."""
    h = split_hash(digest, seed)
    if int.from_bytes(h[:8], "little") / 2**64 < heldout_fraction:
        return HELDOUT
    return int.from_bytes(h[8:16], "little") % learners


def move_key(digest: str, seed: int) -> str:
    """Order in which documents are moved by a rebalance: by the held-out draw, smallest (the nearest
    to being held out) first; fixed-width hex, so string order is numeric order (and no 64-bit
    unsigned int has to pass through a Beam coder)."""
    return f"{int.from_bytes(split_hash(digest, seed)[:8], 'little'):016x}"


def output_name(key: int, learners: int) -> str:
    return "heldout.bin" if key == HELDOUT else shard_name(key, learners)


class AssignSplit(beam.DoFn):
    def __init__(self, learners: int, heldout_fraction: float, seed: int):
        self.learners, self.heldout_fraction, self.seed = learners, heldout_fraction, seed

    def process(self, doc: Tokens):
        yield split_of(doc.digest, learners=self.learners, heldout_fraction=self.heldout_fraction, seed=self.seed), doc


def plan_moves(counts: dict[int, int], smallest: dict[int, list[tuple]], *, learners: int) -> dict:
    """Documents to move so that the held-out set and every train shard hold at least one.

    counts: documents per split key; smallest: per split key, its learners + 1 smallest
    (move_key, digest, path), which is enough because at most learners + 1 documents move.
    An empty held-out set takes the train document with the smallest key (the same one for any
    number of learners). Then each empty train shard, in order, takes the smallest-keyed document
    of the train shards that can spare one (two or more documents), or of the held-out set if none
    can. With at least learners + 1 documents a donor always exists (pigeonhole); with fewer
    nothing moves and the finaliser says so. A function of the documents only: deterministic.
    """
    n = sum(counts.values())
    moves = []
    if n < learners + 1:
        return {"documents": n, "moves": moves}
    counts = {k: counts.get(k, 0) for k in [HELDOUT, *range(learners)]}
    pool = {k: sorted(smallest.get(k, [])) for k in counts}

    def take(donors: list[int], to: int) -> None:
        frm = min((k for k in donors if pool[k]), key=lambda k: pool[k][0])
        _, digest, path = pool[frm].pop(0)
        counts[frm] -= 1
        counts[to] += 1
        moves.append({"path": path, "digest": digest, "from": frm, "to": to})

    if counts[HELDOUT] == 0:
        take(list(range(learners)), HELDOUT)
    for i in range(learners):
        if counts[i] == 0:
            take([k for k in range(learners) if counts[k] >= 2] or [HELDOUT], i)
    assert all(c > 0 for c in counts.values()), counts
    return {"documents": n, "moves": moves}


def _candidate(element, seed: int):
    key, doc = element
    return key, (move_key(doc.digest, seed), doc.digest, doc.path)


class ApplyMoves(beam.DoFn):
    """(split, Tokens) -> (split after the rebalance, (digest, token bytes)), counted where it lands."""

    def __init__(self):
        self.heldout = Metrics.counter(NS, "documents_heldout")
        self.train = Metrics.counter(NS, "documents_train")
        self.moved = Metrics.counter(NS, "documents_moved")

    def process(self, element, moves: dict[str, int]):
        key, doc = element
        if doc.digest in moves:
            key = moves[doc.digest]
            self.moved.inc()
        (self.heldout if key == HELDOUT else self.train).inc()
        yield key, (doc.digest, doc.data)


class Rebalance(beam.PTransform):
    """(split, Tokens) -> {"placed": (split, (digest, data)), "plan": one {documents, moves} dict}.

    The hash split can leave a small corpus's held-out set or a train shard empty; this moves a
    document into each empty output (plan_moves), so every output has one when there are enough.
    """

    def __init__(self, learners: int, seed: int):
        super().__init__()
        self.learners, self.seed = learners, seed

    def expand(self, keyed):
        candidates = keyed | "Candidates" >> beam.Map(_candidate, seed=self.seed)
        counts = (candidates
                  | "CountPerSplit" >> beam.combiners.Count.PerKey()
                  | "CountsToDict" >> beam.combiners.ToDict())
        smallest = (candidates
                    | "SmallestPerSplit" >> beam.combiners.Top.SmallestPerKey(self.learners + 1)
                    | "SmallestToDict" >> beam.combiners.ToDict())
        plan = counts | "PlanMoves" >> beam.Map(plan_moves, beam.pvalue.AsSingleton(smallest), learners=self.learners)
        moves = plan | "MovesByDigest" >> beam.Map(lambda p: {m["digest"]: m["to"] for m in p["moves"]})
        placed = keyed | "ApplyMoves" >> beam.ParDo(ApplyMoves(), beam.pvalue.AsSingleton(moves))
        return {"placed": placed, "plan": plan}


class WriteShard(beam.DoFn):
    """One shard's documents, sorted by digest and joined with the separator, to one .bin file."""

    def __init__(self, output: str, learners: int, seq_len: int, dtype: str, separator: int):
        self.output, self.learners, self.seq_len = output, learners, seq_len
        self.dtype, self.separator = dtype, separator

    def process(self, element):
        key, docs = element
        name = output_name(key, self.learners)
        sep = np.array([self.separator], dtype=self.dtype).tobytes()
        sha, tokens, n = hashlib.sha256(), 0, 0
        with FileSystems.create(FileSystems.join(self.output, name), compression_type="uncompressed") as f:
            for i, (_, data) in enumerate(sorted(docs)):
                chunk = sep + data if i else data
                f.write(chunk)
                sha.update(chunk)
                tokens += len(chunk) // len(sep)
                n += 1
        yield {"split": "heldout" if key == HELDOUT else "train", "index": key, "name": name, "documents": n,
               "tokens": tokens, "sequences": tokens // (self.seq_len + 1), "sha256": sha.hexdigest()}


class PrepareCorpus(beam.PTransform):
    """Paths -> {"shards": per-file stats (files written under `output`), "skipped": {path, reason},
    "plan": the rebalance's {documents, moves}, "near_duplicates": {path, like, similarity} per
    document dropped as near another (none unless `near_duplicates` is set)}."""

    def __init__(self, output: str, *, learners: int, heldout_fraction: float, seed: int,
                 tokenizer: TokenizerSpec = TokenizerSpec("bytes"), dtype: str = "<u2", separator: int = SEPARATOR,
                 seq_len: int = 128, text_field: str = "text", near_duplicates: NearDuplicates | None = None):
        super().__init__()
        self.output, self.learners, self.heldout_fraction, self.seed = output, learners, heldout_fraction, seed
        self.tokenizer, self.dtype, self.separator, self.seq_len = tokenizer, dtype, separator, seq_len
        self.text_field, self.near_duplicates = text_field, near_duplicates

    def expand(self, paths):
        read = paths | "Read" >> ReadDocuments(self.text_field)
        docs = read["docs"] | "Dedupe" >> DropDuplicates()
        near = paths.pipeline | "NoNearDuplicates" >> beam.Create([])
        if self.near_duplicates is not None:
            nd = docs | "NearDuplicates" >> DropNearDuplicates(self.near_duplicates)
            docs, near = nd["docs"], nd["near_duplicates"]
        tokens = (docs
                  | "Tokenize" >> beam.ParDo(Tokenize(self.tokenizer, self.dtype, self.separator)).with_outputs(
                      Tokenize.SKIPPED, main="docs"))
        balanced = (tokens.docs
                    | "Split" >> beam.ParDo(AssignSplit(self.learners, self.heldout_fraction, self.seed))
                    | "Rebalance" >> Rebalance(self.learners, self.seed))
        shards = (balanced["placed"]
                  | "GroupShards" >> beam.GroupByKey()
                  | "WriteShards" >> beam.ParDo(WriteShard(self.output, self.learners, self.seq_len, self.dtype,
                                                           self.separator)))
        skipped = (read["skipped"], tokens[Tokenize.SKIPPED]) | "AllSkipped" >> beam.Flatten()
        return {"shards": shards, "skipped": skipped, "plan": balanced["plan"], "near_duplicates": near}


class WriteJsonLines(beam.PTransform):
    """A small PCollection of dicts to one JSON-lines file (order is fixed later, by the reader)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def expand(self, pcoll):
        return (pcoll
                | "ToJson" >> beam.Map(lambda r: json.dumps(r, sort_keys=True))
                | "Write" >> beam.io.WriteToText(self.path, shard_name_template=""))


def read_json_lines(path: str) -> list[dict]:
    if not FileSystems.exists(path):
        return []
    with FileSystems.open(path, compression_type="uncompressed") as f:
        return [json.loads(line) for line in f.read().decode("utf-8").splitlines() if line.strip()]


def remove_tree(path: str) -> None:
    if FileSystems.get_scheme(path) is None:
        shutil.rmtree(path, ignore_errors=True)  # Beam's local delete of "dir/" empties it but leaves it
    else:
        FileSystems.delete([path.rstrip("/") + "/"])  # the trailing slash deletes the whole prefix


def write_bytes(path: str, data: bytes) -> None:
    with FileSystems.create(path, compression_type="uncompressed") as f:
        f.write(data)


# --- running it ------------------------------------------------------------------------------------

def prepare(inputs: list[str] | None, output: str, *, learners: int, heldout_fraction: float = 0.05, seed: int = 0,
            max_bytes: int | None = None, tokenizer_name: str = "bytes", seq_len: int = 128,
            text_field: str = "text", near_duplicates: NearDuplicates | None = None,
            pipeline_args: list[str] | None = None, separator: int | None = None) -> dict:
    """Run the whole preparation; returns the manifest. inputs=None is the stdlib corpus; text_field is
    the field (JSON Lines) or column (Parquet) that holds a record file's documents; near_duplicates
    (off when None) drops documents near another beside the exact duplicates; separator joins the
    documents (None: the tokenizer's end-of-document id, 0 for bytes)."""
    if not text_field:
        raise DataError("text field must be a non-empty field / column name")
    if learners < 1:
        raise DataError(f"learners must be at least 1, got {learners}")
    if not 0 < heldout_fraction < 1:
        raise DataError(f"heldout fraction must be in (0, 1), got {heldout_fraction}")
    spec = tokenizer_spec(tokenizer_name)
    tok = with_separator(load_tokenizer(spec), separator)  # here first: a bad tokenizer fails before the pipeline
    dtype = token_dtype(tok.vocab_size)
    pl = plan(inputs, max_bytes)
    if FileSystems.get_scheme(output) is None:
        Path(output).mkdir(parents=True, exist_ok=True)
    parts = FileSystems.join(output, PARTS)
    options = PipelineOptions(pipeline_args if pipeline_args is not None else ["--runner=FnApiRunner"])
    p = beam.Pipeline(options=options)
    out = (p
           | "ListFiles" >> beam.Create([f.path for f in pl.files])
           | "Spread" >> beam.Reshuffle()
           | "Prepare" >> PrepareCorpus(output, learners=learners, heldout_fraction=heldout_fraction, seed=seed,
                                        tokenizer=spec, dtype=DTYPES[dtype], separator=tok.separator,
                                        seq_len=seq_len, text_field=text_field, near_duplicates=near_duplicates))
    _ = out["shards"] | "WriteShardStats" >> WriteJsonLines(FileSystems.join(parts, "shards.jsonl"))
    _ = out["skipped"] | "WriteSkipped" >> WriteJsonLines(FileSystems.join(parts, "skipped.jsonl"))
    _ = out["plan"] | "WritePlan" >> WriteJsonLines(FileSystems.join(parts, "plan.jsonl"))
    _ = out["near_duplicates"] | "WriteNear" >> WriteJsonLines(FileSystems.join(parts, "near_duplicates.jsonl"))
    result = p.run()
    result.wait_until_finish()
    counts = Counter()
    for r in result.metrics().query()["counters"]:  # one result per step: files_read is counted by two
        if r.key.metric.namespace == NS:
            counts[r.key.metric.name] += r.committed
    return finalise(output, pl, learners=learners, heldout_fraction=heldout_fraction, seed=seed, spec=spec, tok=tok,
                    dtype=dtype, seq_len=seq_len, max_bytes=max_bytes, counts=counts, text_field=text_field,
                    near_duplicates=near_duplicates)


def bad_rows(counts: dict) -> dict[str, int]:
    """Rows of record files skipped, per reason (only reasons that occurred), from the pipeline's counters."""
    return {r: counts[f"bad_rows_{r}"] for r in BAD_ROW_REASONS if counts.get(f"bad_rows_{r}")}


def finalise(output: str, pl: CorpusPlan, *, learners: int, heldout_fraction: float, seed: int, spec: TokenizerSpec, tok,
             dtype: str, seq_len: int, max_bytes: int | None, counts: dict, text_field: str = "text",
             near_duplicates: NearDuplicates | None = None) -> dict:
    """Manifest from the pipeline's shard stats; written last, so its presence means a complete corpus."""
    parts = FileSystems.join(output, PARTS)
    stats = {s["name"]: s for s in read_json_lines(FileSystems.join(parts, "shards.jsonl"))}
    skipped = sorted(pl.skipped + read_json_lines(FileSystems.join(parts, "skipped.jsonl")), key=lambda s: s["path"])
    balance = (read_json_lines(FileSystems.join(parts, "plan.jsonl")) or [{"documents": 0, "moves": []}])[0]
    near = sorted(read_json_lines(FileSystems.join(parts, "near_duplicates.jsonl")), key=lambda r: r["path"])
    remove_tree(parts)

    def entry(name: str) -> dict:
        s = stats.get(name, {"documents": 0, "tokens": 0, "sequences": 0, "sha256": None})
        return {"name": name, **{k: s[k] for k in ("documents", "tokens", "sequences", "sha256")}}

    shards = [entry(shard_name(i, learners)) for i in range(learners)]
    heldout = entry("heldout.bin")
    empty = [s["name"] for s in [*shards, heldout] if s["documents"] == 0]
    if empty:
        reasons = Counter(s["reason"].split(" (")[0] for s in skipped)
        n = balance["documents"]
        too_few = (f"only {n} document{'s' * (n != 1)} left, and {learners} learner{'s' * (learners != 1)} need at "
                   f"least {learners + 1} (one per train shard and one held out): add input files or prepare for "
                   f"fewer learners; " if n < learners + 1 else "")
        rows = f", bad rows {bad_rows(counts)} (text field {text_field!r})" if bad_rows(counts) else ""
        raise DataError(f"no documents for {', '.join(empty)}: {too_few}{len(pl.files)} files planned, "
                        f"{len(skipped)} skipped ({dict(reasons) or 'none'}), "
                        f"{counts.get('duplicates_dropped', 0)} duplicates{rows}; skipped: {skipped[:10]}")
    moved = [{"path": m["path"], "from": output_name(m["from"], learners), "to": output_name(m["to"], learners)}
             for m in balance["moves"]]
    for m in moved:
        log.warning("the hash split left %s empty: moved %s there from %s", m["to"], m["path"], m["from"])
    content = hashlib.sha256("".join(s["sha256"] for s in [*shards, heldout]).encode()).hexdigest()
    manifest = {
        "format": FORMAT, "tokenizer": spec.name, "tokenizer_kind": spec.kind, "tokenizer_sha256": spec.sha256,
        "vocab_size": tok.vocab_size, "dtype": dtype, "separator": tok.separator,
        "seed": seed, "heldout_fraction": heldout_fraction, "seq_len": seq_len,
        "shards": shards, "heldout": heldout, "content_sha256": content, "moved": moved,
        "sources": pl.sources, "max_bytes": max_bytes, "capped_files": pl.capped,
        "skipped": skipped, "text_field": text_field, "bad_rows": bad_rows(counts),
        "counts": dict(sorted(counts.items())),
        "near_duplicates": None if near_duplicates is None else {
            **near_duplicates.as_dict(), "dropped": len(near), "listed": near[:NEAR_DUPLICATES_LISTED]},
    }
    write_bytes(FileSystems.join(output, MANIFEST), json.dumps(manifest, indent=1).encode())
    return manifest
