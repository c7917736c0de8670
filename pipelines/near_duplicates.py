"""Near-duplicate documents: MinHash signatures of word shingles, grouped by LSH bands, in Beam.

Two documents are near duplicates when the Jaccard similarity of their shingle sets (runs of
`ngram` lower-cased words), estimated from `num_perm` MinHash values (datasketch), is at least
`threshold`. Comparing every pair is quadratic, so documents meet only when one of `bands` slices
of their signatures is identical (locality-sensitive hashing); the band shape is the one that
minimises the chance of missing a pair above the threshold plus the chance of comparing one below it.

Of a set of near duplicates the document with the smallest content hash stays; a document is
dropped when it is near a kept one with a smaller hash. Every decision is a function of content
hashes, so the same corpus drops the same documents on any runner in any order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from datasketch import MinHash

NS = "corpus"


@dataclass(frozen=True)
class NearDuplicates:
    """How near is a duplicate: estimated Jaccard similarity >= threshold over `ngram`-word shingles."""

    threshold: float
    ngram: int = 5
    num_perm: int = 128
    seed: int = 1

    def __post_init__(self):
        if not 0 < self.threshold <= 1:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {self.threshold}")
        if self.ngram < 1 or self.num_perm < 2:
            raise ValueError(f"near duplicates need ngram >= 1 and num_perm >= 2, got {self.ngram}, {self.num_perm}")

    @property
    def bands(self) -> tuple[int, int]:
        return lsh_bands(self.threshold, self.num_perm)

    def as_dict(self) -> dict:
        bands, rows = self.bands
        return {"threshold": self.threshold, "ngram": self.ngram, "num_perm": self.num_perm, "seed": self.seed,
                "bands": bands, "rows": rows}


def shingles(text: str, ngram: int) -> set[bytes]:
    """The document's runs of `ngram` consecutive lower-cased words (all of it when shorter)."""
    words = text.lower().split()
    if len(words) <= ngram:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + ngram]).encode() for i in range(len(words) - ngram + 1)}


def signature(text: str, spec: NearDuplicates) -> np.ndarray:
    """num_perm MinHash values (uint64) of the document's shingles."""
    m = MinHash(num_perm=spec.num_perm, seed=spec.seed)
    m.update_batch(shingles(text, spec.ngram))
    return m.hashvalues.astype(np.uint64)


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity: the share of MinHash values two signatures agree on."""
    return float(np.count_nonzero(a == b)) / len(a)


@lru_cache(maxsize=64)
def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band), bands * rows <= num_perm, minimising the false-positive area below the
    threshold plus the false-negative area above it of P(two documents share a band) = 1 - (1 - s^r)^b."""
    s = np.linspace(0.0, 1.0, 1001)
    below, above = s < threshold, s >= threshold
    best, shape = np.inf, (1, num_perm)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            meet = 1.0 - (1.0 - s ** r) ** b
            cost = np.trapezoid(np.where(below, meet, 0.0), s) + np.trapezoid(np.where(above, 1.0 - meet, 0.0), s)
            if cost < best:
                best, shape = cost, (b, r)
    return shape


class BandKeys(beam.DoFn):
    """Doc -> ((band, band's values), (digest, path, signature bytes)) for each band."""

    def __init__(self, spec: NearDuplicates):
        self.spec = spec

    def process(self, doc):
        sig = signature(doc.text, self.spec)
        bands, rows = self.spec.bands
        member = (doc.digest, doc.path, sig.tobytes())
        for i in range(bands):
            yield (i, sig[i * rows:(i + 1) * rows].tobytes()), member


class FlagInBucket(beam.DoFn):
    """The documents of one band bucket, in content-hash order: each is compared with the ones kept
    so far and flagged (digest -> (path, like, similarity)) when near one; else it is kept.

    Comparing with the kept ones only keeps a bucket of many copies of one boilerplate linear."""

    def __init__(self, spec: NearDuplicates):
        self.spec = spec

    def process(self, element):
        _, members = element
        members = sorted(set(members))
        if len(members) < 2:
            return
        kept: list[tuple[str, np.ndarray]] = []
        for digest, path, raw in members:
            sig = np.frombuffer(raw, np.uint64)
            near = next(((p, sim) for p, s in kept if (sim := similarity(s, sig)) >= self.spec.threshold), None)
            if near is None:
                kept.append((path, sig))
            else:
                yield digest, {"path": path, "like": near[0], "similarity": round(near[1], 4)}


class KeepUnflagged(beam.DoFn):
    """(digest, {"doc": [Doc], "flag": [...]}) -> the Doc, or a near-duplicate record (tag DROPPED)."""

    DROPPED = "near_duplicates"

    def __init__(self):
        self.dropped = Metrics.counter(NS, "near_duplicates_dropped")

    def process(self, element):
        _, joined = element
        flags = sorted(joined["flag"], key=lambda f: (f["like"], f["similarity"]))
        for doc in joined["doc"]:
            if flags:
                self.dropped.inc()
                yield beam.pvalue.TaggedOutput(self.DROPPED, flags[0])
            else:
                yield doc


class DropNearDuplicates(beam.PTransform):
    """Docs (exact duplicates already gone) -> {"docs": the kept ones, "near_duplicates": one
    {path, like, similarity} per dropped document, `like` the document with a smaller content hash
    it is near (kept, or itself near a smaller one)}."""

    def __init__(self, spec: NearDuplicates):
        super().__init__()
        self.spec = spec

    def expand(self, docs):
        flags = (docs
                 | "BandKeys" >> beam.ParDo(BandKeys(self.spec))
                 | "GroupBands" >> beam.GroupByKey()
                 | "FlagInBucket" >> beam.ParDo(FlagInBucket(self.spec)))
        keyed = docs | "KeyByDigest" >> beam.Map(lambda d: (d.digest, d))
        out = ({"doc": keyed, "flag": flags}
               | "Join" >> beam.CoGroupByKey()
               | "KeepUnflagged" >> beam.ParDo(KeepUnflagged()).with_outputs(KeepUnflagged.DROPPED, main="docs"))
        return {"docs": out.docs, "near_duplicates": out[KeepUnflagged.DROPPED]}
