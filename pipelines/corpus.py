"""Corpus pipeline: text files to the token shards learners read (format: `diloco.learners.data`).

    plan (match inputs, cap bytes) -> Beam: read + normalise -> drop duplicates -> split -> tokenize
    -> pack one file per shard -> finalise (manifest.json)

Every choice that places a document is a function of its content hash and the seed, and each shard
is written sorted by content hash, so the same input gives byte-identical shards on any runner.
Planning happens before the pipeline because the byte cap keeps a prefix of the sorted file list,
which is a global decision; everything per document happens in the pipeline.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from diloco.learners.data import FORMAT, MANIFEST, SEPARATOR, DataError, shard_name

HELDOUT = -1       # split key of the held-out set; train shards are 0..learners-1
PARTS = ".parts"   # the pipeline's small outputs, read by the finaliser and then deleted
NS = "corpus"      # Beam Metrics namespace


# --- tokenizers ------------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, and 0 (NUL, stripped from text) is free as separator."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<u2")


TOKENIZERS = {"bytes": ByteTokenizer}


def tokenizer(name: str):
    if name not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {name!r}; known: {sorted(TOKENIZERS)}")
    return TOKENIZERS[name]()


# --- planning: which files, before the pipeline --------------------------------------------------

@dataclass(frozen=True)
class Source:
    path: str
    size: int


@dataclass(frozen=True)
class Plan:
    files: list[Source]     # sorted by path, after the byte cap
    sources: list[dict]     # per input: what it matched
    skipped: list[dict]     # inputs that matched nothing
    capped: int             # files left out by max_bytes


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


def plan(inputs: list[str] | None, max_bytes: int | None = None) -> Plan:
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
    return Plan(kept, sources, skipped, len(files) - len(kept))


# --- the pipeline ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Doc:
    path: str
    digest: str     # sha256 of the normalised text, hex
    text: str


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


class ReadDocuments(beam.PTransform):
    """Paths -> {"docs": Doc, "skipped": {path, reason}}."""

    def expand(self, paths):
        out = paths | "ReadNormalise" >> beam.ParDo(ReadNormalised()).with_outputs(ReadNormalised.SKIPPED, main="docs")
        return {"docs": out.docs, "skipped": out[ReadNormalised.SKIPPED]}


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


def split_of(digest: str, *, learners: int, heldout_fraction: float, seed: int) -> int:
    """HELDOUT or a train shard; independent bytes of one keyed hash decide each."""
    h = hashlib.sha256(seed.to_bytes(8, "little", signed=True) + bytes.fromhex(digest)).digest()
    if int.from_bytes(h[:8], "little") / 2**64 < heldout_fraction:
        return HELDOUT
    return int.from_bytes(h[8:16], "little") % learners


class AssignSplit(beam.DoFn):
    def __init__(self, learners: int, heldout_fraction: float, seed: int):
        self.learners, self.heldout_fraction, self.seed = learners, heldout_fraction, seed
        self.heldout = Metrics.counter(NS, "documents_heldout")
        self.train = Metrics.counter(NS, "documents_train")

    def process(self, doc: Doc):
        key = split_of(doc.digest, learners=self.learners, heldout_fraction=self.heldout_fraction, seed=self.seed)
        (self.heldout if key == HELDOUT else self.train).inc()
        yield key, doc


class Tokenize(beam.DoFn):
    """(split, Doc) -> (split, (digest, little-endian uint16 token bytes))."""

    def __init__(self, name: str):
        self.name = name
        self.tokens = Metrics.counter(NS, "tokens")

    def setup(self):
        self.tok = tokenizer(self.name)

    def process(self, element):
        key, doc = element
        ids = self.tok.encode(doc.text)
        assert SEPARATOR not in ids, f"{doc.path}: tokenizer produced the separator id"
        self.tokens.inc(len(ids))
        yield key, (doc.digest, ids.astype("<u2").tobytes())


class WriteShard(beam.DoFn):
    """One shard's documents, sorted by digest and joined with the separator, to one .bin file."""

    def __init__(self, output: str, learners: int, seq_len: int):
        self.output, self.learners, self.seq_len = output, learners, seq_len

    def process(self, element):
        key, docs = element
        name = "heldout.bin" if key == HELDOUT else shard_name(key, self.learners)
        sep = np.array([SEPARATOR], dtype="<u2").tobytes()
        sha, tokens, n = hashlib.sha256(), 0, 0
        with FileSystems.create(FileSystems.join(self.output, name), compression_type="uncompressed") as f:
            for i, (_, data) in enumerate(sorted(docs)):
                chunk = sep + data if i else data
                f.write(chunk)
                sha.update(chunk)
                tokens += len(chunk) // 2
                n += 1
        yield {"split": "heldout" if key == HELDOUT else "train", "index": key, "name": name, "documents": n,
               "tokens": tokens, "sequences": tokens // (self.seq_len + 1), "sha256": sha.hexdigest()}


class PrepareCorpus(beam.PTransform):
    """Paths -> {"shards": per-file stats (files written under `output`), "skipped": {path, reason}}."""

    def __init__(self, output: str, *, learners: int, heldout_fraction: float, seed: int,
                 tokenizer: str = "bytes", seq_len: int = 128):
        super().__init__()
        self.output, self.learners, self.heldout_fraction, self.seed = output, learners, heldout_fraction, seed
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def expand(self, paths):
        read = paths | "Read" >> ReadDocuments()
        shards = (read["docs"]
                  | "Dedupe" >> DropDuplicates()
                  | "Split" >> beam.ParDo(AssignSplit(self.learners, self.heldout_fraction, self.seed))
                  | "Tokenize" >> beam.ParDo(Tokenize(self.tokenizer))
                  | "GroupShards" >> beam.GroupByKey()
                  | "WriteShards" >> beam.ParDo(WriteShard(self.output, self.learners, self.seq_len)))
        return {"shards": shards, "skipped": read["skipped"]}


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
            pipeline_args: list[str] | None = None) -> dict:
    """Run the whole preparation; returns the manifest. inputs=None is the stdlib corpus."""
    if learners < 1:
        raise DataError(f"learners must be at least 1, got {learners}")
    if not 0 < heldout_fraction < 1:
        raise DataError(f"heldout fraction must be in (0, 1), got {heldout_fraction}")
    tok = tokenizer(tokenizer_name)
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
                                        tokenizer=tokenizer_name, seq_len=seq_len))
    _ = out["shards"] | "WriteShardStats" >> WriteJsonLines(FileSystems.join(parts, "shards.jsonl"))
    _ = out["skipped"] | "WriteSkipped" >> WriteJsonLines(FileSystems.join(parts, "skipped.jsonl"))
    result = p.run()
    result.wait_until_finish()
    counts = {r.key.metric.name: r.committed for r in result.metrics().query()["counters"]
              if r.key.metric.namespace == NS}
    return finalise(output, pl, learners=learners, heldout_fraction=heldout_fraction, seed=seed, tok=tok,
                    seq_len=seq_len, max_bytes=max_bytes, counts=counts)


def finalise(output: str, pl: Plan, *, learners: int, heldout_fraction: float, seed: int, tok, seq_len: int,
             max_bytes: int | None, counts: dict) -> dict:
    """Manifest from the pipeline's shard stats; written last, so its presence means a complete corpus."""
    parts = FileSystems.join(output, PARTS)
    stats = {s["name"]: s for s in read_json_lines(FileSystems.join(parts, "shards.jsonl"))}
    skipped = sorted(pl.skipped + read_json_lines(FileSystems.join(parts, "skipped.jsonl")), key=lambda s: s["path"])
    remove_tree(parts)

    def entry(name: str) -> dict:
        s = stats.get(name, {"documents": 0, "tokens": 0, "sequences": 0, "sha256": None})
        return {"name": name, **{k: s[k] for k in ("documents", "tokens", "sequences", "sha256")}}

    shards = [entry(shard_name(i, learners)) for i in range(learners)]
    heldout = entry("heldout.bin")
    empty = [s["name"] for s in [*shards, heldout] if s["documents"] == 0]
    if empty:
        reasons = Counter(s["reason"].split(" (")[0] for s in skipped)
        raise DataError(f"no documents for {', '.join(empty)}: {len(pl.files)} files planned, "
                        f"{len(skipped)} skipped ({dict(reasons) or 'none'}), "
                        f"{counts.get('duplicates_dropped', 0)} duplicates; skipped: {skipped[:10]}")
    content = hashlib.sha256("".join(s["sha256"] for s in [*shards, heldout]).encode()).hexdigest()
    manifest = {
        "format": FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": "uint16",
        "separator": SEPARATOR, "seed": seed, "heldout_fraction": heldout_fraction, "seq_len": seq_len,
        "shards": shards, "heldout": heldout, "content_sha256": content,
        "sources": pl.sources, "max_bytes": max_bytes, "capped_files": pl.capped,
        "skipped": skipped, "counts": dict(sorted(counts.items())),
    }
    write_bytes(FileSystems.join(output, MANIFEST), json.dumps(manifest, indent=1).encode())
    return manifest
