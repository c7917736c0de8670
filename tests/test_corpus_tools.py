"""`diloco data tokenizer` (a byte-level BPE trained on the corpus) and `diloco data inspect` (a
prepared corpus read back and checked). Tiny corpora written here; Beam on the FnApiRunner; no services."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import tokenizers
import typer
from typer.testing import CliRunner

from diloco.pipelines import corpus as cp
from diloco.pipelines.cli import data_app
from diloco.pipelines.inspection import inspect_corpus
from diloco.pipelines.vocab import END_OF_TEXT, train_tokenizer
from diloco.shard_format import DataError

FN_API = ["--runner=FnApiRunner"]
TEXTS = [f"document {i}: the learners train, the syncer merges, café {i * 7} ünïcode ✓\n" * (3 + i % 4)
         for i in range(30)]


def _cli():
    app = typer.Typer()
    app.add_typer(data_app, name="data")
    return app


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tools")
    with gzip.open(root / "docs.jsonl.gz", "wb") as f:
        f.writelines(json.dumps({"text": t}).encode() + b"\n" for t in TEXTS[:20])
        f.write(b"not json\n")
    for i, t in enumerate(TEXTS[20:]):
        (root / f"note{i}.txt").write_text(t, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def trained(inputs, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return out, train_tokenizer([str(inputs)], str(out), vocab_size=400, show_progress=False)


def test_a_trained_tokenizer_is_byte_level_bpe_with_end_of_text_first(trained):
    path, t = trained
    tok = tokenizers.Tokenizer.from_file(str(path))
    assert t["documents"] == 30 and t["bytes"] == sum(len(x.encode()) for x in TEXTS)
    assert 258 <= t["vocab_size"] == tok.get_vocab_size() <= 400
    assert tok.token_to_id(END_OF_TEXT) == 0 == t["end_of_text_id"]
    for text in [TEXTS[3], "never seen: 日本語 and \x01 control bytes 🚀"]:   # byte-level: nothing is unknown
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    assert t["bytes_per_token"] > 1.5   # it learned merges: fewer tokens than bytes


def test_a_trained_tokenizer_prepares_a_corpus_and_inspect_decodes_it(trained, inputs, tmp_path):
    path, t = trained
    m = cp.prepare([str(inputs)], str(tmp_path / "c"), learners=2, heldout_fraction=0.2, tokenizer_name=str(path),
                   pipeline_args=FN_API)
    assert m["tokenizer_kind"] == "huggingface" and m["separator"] == 0 and m["vocab_size"] <= t["vocab_size"]
    s = inspect_corpus(str(tmp_path / "c"), verify=True, documents=2, tokenizer=str(path))
    assert s["verified"] and s["totals"]["documents"] == 30 and s["dropped"]["bad_rows"] == {"not_json": 1}
    shown = [d for docs in s["documents"].values() for d in docs]
    assert len(shown) == 6 and all(d in TEXTS for d in shown)
    with pytest.raises(DataError, match="pass it .--tokenizer PATH."):
        inspect_corpus(str(tmp_path / "c"), documents=1)
    other = tmp_path / "other.json"
    train_tokenizer([str(inputs)], str(other), vocab_size=300, show_progress=False)
    with pytest.raises(DataError, match="is not the tokenizer the corpus was prepared with"):
        inspect_corpus(str(tmp_path / "c"), documents=1, tokenizer=str(other))


@pytest.mark.parametrize("vocab, match", [(257, "vocab size must be at least 258"),
                                          (2**31 + 1, "does not fit the int32")])
def test_an_impossible_vocab_size_is_refused(inputs, tmp_path, vocab, match):
    with pytest.raises(DataError, match=match):
        train_tokenizer([str(inputs)], str(tmp_path / "t.json"), vocab_size=vocab, show_progress=False)
    assert not (tmp_path / "t.json").exists()


def test_no_documents_is_an_error_and_writes_nothing(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match=r"no documents to train a tokenizer on .*skipped: \{'empty': 1\}"):
        train_tokenizer([str(tmp_path / "in")], str(tmp_path / "t.json"), vocab_size=300, show_progress=False)
    assert not (tmp_path / "t.json").exists()


def test_cli_tokenizer_then_inspect_verify_catches_a_damaged_shard(inputs, tmp_path):
    res = CliRunner().invoke(_cli(), ["data", "tokenizer", "--input", str(inputs), "--output",
                                      str(tmp_path / "tok.json"), "--vocab-size", "350"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    # rich folds a path longer than the terminal anywhere (before its colon, too): compare without spaces
    assert f"wrote{tmp_path / 'tok.json'}:byte-levelBPE" in "".join(out.split()) and "<|endoftext|> = id 0" in out
    assert "trained on 30 documents" in out
    cp.prepare([str(inputs)], str(tmp_path / "c"), learners=2, heldout_fraction=0.2, pipeline_args=FN_API)
    ok = CliRunner().invoke(_cli(), ["data", "inspect", str(tmp_path / "c"), "--verify", "--documents", "1"])
    assert ok.exit_code == 0, ok.output
    assert "ok" in ok.output and "near duplicates off" in " ".join(ok.output.split())
    shard = tmp_path / "c" / "train-00000-of-00002.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    flipped = CliRunner().invoke(_cli(), ["data", "inspect", str(tmp_path / "c"), "--verify", "--json"])
    assert flipped.exit_code == 1
    problems = {f["name"]: f["problem"] for f in json.loads(flipped.stdout)["files"]}
    assert problems["train-00000-of-00002.bin"].startswith("SHA-256") and problems["heldout.bin"] is None
    shard.write_bytes(bytes(data[:-2]))
    cut = inspect_corpus(str(tmp_path / "c"), verify=True)
    assert "bytes, the manifest's" in cut["files"][0]["problem"]
    shard.unlink()
    assert inspect_corpus(str(tmp_path / "c"), verify=True)["files"][0]["problem"].startswith("missing")
    gone = CliRunner().invoke(_cli(), ["data", "inspect", str(tmp_path / "nothing")])
    assert gone.exit_code == 1 and "not a prepared corpus" in " ".join(gone.output.split())
