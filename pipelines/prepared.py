"""A run's prepared corpus: reused from the cache under `data.dir` for the same inputs and settings,
or prepared now by the Beam corpus pipeline (pipelines/corpus.py). Beam loads only when a corpus
must be prepared, so a learner given `data.prepared` needs none of the pipelines extra."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from diloco.shard_format import MANIFEST, Corpus


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
