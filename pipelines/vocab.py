"""A tokenizer from the corpus: byte-level BPE trained with the Hugging Face `tokenizers` library.

For a team without a vocabulary of its own (`diloco data tokenizer`). The documents are read by the
corpus pipeline's own readers (text files whole, JSON Lines and Parquet row by row, bad rows
skipped), in path order, so the tokenizer learns from the same text `diloco data prepare` shards.
Byte-level means every string encodes (no unknown token) and decodes back to itself. The
end-of-text token is the first id, and it is the one `diloco data prepare` joins documents with.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystems import FileSystems
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diloco.pipelines.corpus import ReadNormalised, ReadRecords, plan, record_format
from diloco.shard_format import DataError

END_OF_TEXT = "<|endoftext|>"      # one of corpus.EOD_TOKENS: prepare joins documents with it
SMALLEST_VOCAB = 258               # the 256 byte symbols, the end-of-text token and one merge
SAMPLE_DOCUMENTS = 1000            # documents the bytes-per-token figure is measured on


def documents(inputs: list[str] | None, *, text_field: str = "text", max_bytes: int | None = None,
              skipped: Counter | None = None) -> Iterator[str]:
    """The corpus's documents in path order, read as `diloco data prepare` reads them; what cannot be a
    document is counted in `skipped` by reason."""
    skipped = Counter() if skipped is None else skipped
    text_files, record_files = ReadNormalised(), ReadRecords(text_field)
    for f in plan(inputs, max_bytes).files:
        reader = text_files if record_format(f.path) is None else record_files
        for out in reader.process(f.path):
            if isinstance(out, beam.pvalue.TaggedOutput):
                skipped[out.value["reason"].split(" (")[0]] += 1
            else:
                yield out.text


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(inputs: list[str] | None, output: str, *, vocab_size: int, text_field: str = "text",
                    max_bytes: int | None = None, min_frequency: int = 2, show_progress: bool = True) -> dict:
    """Train a byte-level BPE of at most `vocab_size` ids on the corpus, write it to `output` (a
    tokenizer.json, local or any Beam filesystem URL), and return what it is: ids, end-of-text id,
    documents and bytes read, what was skipped, and bytes per token on the first documents."""
    if vocab_size < SMALLEST_VOCAB:
        raise DataError(f"vocab size must be at least {SMALLEST_VOCAB} (256 bytes, {END_OF_TEXT} and one merge), "
                        f"got {vocab_size}")
    if vocab_size > 2**31:
        raise DataError(f"vocab size {vocab_size} does not fit the int32 training batches")
    skipped, seen, sample = Counter(), {"documents": 0, "bytes": 0}, []

    def counted():
        for text in documents(inputs, text_field=text_field, max_bytes=max_bytes, skipped=skipped):
            seen["documents"] += 1
            seen["bytes"] += len(text.encode("utf-8"))
            if len(sample) < SAMPLE_DOCUMENTS:
                sample.append(text)
            yield text

    tok = byte_level_bpe()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
                                  special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(counted(), trainer=trainer)
    if not seen["documents"]:
        raise DataError(f"no documents to train a tokenizer on in {inputs or 'the stdlib corpus'}"
                        + (f" (skipped: {dict(skipped)})" if skipped else ""))
    with FileSystems.create(output, compression_type="uncompressed") as f:
        f.write(tok.to_str().encode("utf-8"))
    encoded = tok.encode_batch(sample, add_special_tokens=False)
    tokens = sum(len(e.ids) for e in encoded)
    return {"output": output, "vocab_size": tok.get_vocab_size(with_added_tokens=True), "asked": vocab_size,
            "end_of_text": END_OF_TEXT, "end_of_text_id": tok.token_to_id(END_OF_TEXT),
            "documents": seen["documents"], "bytes": seen["bytes"], "skipped": dict(sorted(skipped.items())),
            "bytes_per_token": float(np.divide(sum(len(t.encode("utf-8")) for t in sample), max(tokens, 1)))}
