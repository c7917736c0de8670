"""The corpus pipeline with real tokenizers (Hugging Face, SentencePiece), uint32 shards, and small corpora.

Tokenizers are trained or built in the tests from synthetic text (no downloads); every preparation
runs on the FnApiRunner over a few tiny files.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import typer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from diloco.learners.data import shard_batches
from diloco.pipelines import corpus as cp
from diloco.pipelines.cli import data_app
from diloco.pipelines.prepared import ensure_corpus
from diloco.shard_format import Corpus, DataError, shard_name, token_dtype
from diloco.spec import DataShard

FN_API = ["--runner=FnApiRunner"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _texts(n: int) -> list[str]:
    """n distinct one-line documents (no newline, single spaces: SentencePiece decodes them exactly)."""
    return [" ".join(WORDS[(i * j + i) % len(WORDS)] for j in range(1, 6 + i % 5)) + f" {i}" for i in range(n)]


def _write(root: Path, texts: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(t, encoding="utf-8")
    return root


def _split(tokens: np.ndarray, separator: int) -> list[list[int]]:
    """A shard back to its documents' token ids."""
    docs, cur = [], []
    for t in np.asarray(tokens).tolist():
        if t == separator:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return [*docs, cur]


def _all_docs(c: Corpus) -> list[list[int]]:
    sep = c.manifest["separator"]
    return [d for i in range(c.num_shards) for d in _split(c.train_tokens(i), sep)] + _split(c.heldout_tokens(), sep)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bpe(path: Path, texts: list[str], vocab_size: int = 320) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    return _bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", _texts(40))


# --- Hugging Face and SentencePiece ---------------------------------------------------------------

def test_huggingface_bpe_shards_decode_to_the_documents(bpe_file, tmp_path):
    texts = _texts(20)
    m = cp.prepare([str(_write(tmp_path / "in", texts))], str(tmp_path / "out"), learners=2, heldout_fraction=0.2,
                   tokenizer_name=str(bpe_file), pipeline_args=FN_API)
    tok = Tokenizer.from_file(str(bpe_file))
    assert (m["tokenizer"], m["tokenizer_kind"], m["tokenizer_sha256"]) == (
        "tokenizer.json", "huggingface", _sha256(bpe_file))
    assert (m["vocab_size"], m["dtype"], m["separator"]) == (tok.get_vocab_size(), "uint16", tok.token_to_id("</s>"))
    c = Corpus.open(tmp_path / "out")
    assert c.dtype == np.dtype("<u2") and c.vocab_size == tok.get_vocab_size()
    assert sorted(tok.decode(d) for d in _all_docs(c)) == sorted(texts)
    for entry in [*m["shards"], m["heldout"]]:
        assert (tmp_path / "out" / entry["name"]).stat().st_size == 2 * entry["tokens"]
    assert m["moved"] == [] and m["counts"]["documents_train"] + m["counts"]["documents_heldout"] == 20


def test_sentencepiece_shards_decode_to_the_documents(tmp_path):
    texts = _texts(20)
    (tmp_path / "train.txt").write_text("\n".join(_texts(40)))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=40, hard_vocab_limit=False, minloglevel=2)
    model = tmp_path / "sp.model"
    m = cp.prepare([str(_write(tmp_path / "in", texts))], str(tmp_path / "out"), learners=2, heldout_fraction=0.2,
                   tokenizer_name=str(model), pipeline_args=FN_API)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert (m["tokenizer"], m["tokenizer_kind"], m["tokenizer_sha256"]) == ("sp.model", "sentencepiece", _sha256(model))
    assert (m["vocab_size"], m["dtype"], m["separator"]) == (sp.get_piece_size(), "uint16", sp.eos_id())
    assert sorted(sp.decode(d) for d in _all_docs(Corpus.open(tmp_path / "out"))) == sorted(texts)


def test_sentencepiece_without_eos_is_refused(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(_texts(40)))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=40, hard_vocab_limit=False, eos_id=-1, minloglevel=2)
    with pytest.raises(DataError, match=r"tokenizer sp\.model has no end-of-document token .*eos_id\(\) is -1"):
        cp.prepare([str(_write(tmp_path / "in", _texts(3)))], str(tmp_path / "out"), learners=1,
                   tokenizer_name=str(tmp_path / "sp.model"), pipeline_args=FN_API)


def test_huggingface_without_end_of_document_token_is_refused(tmp_path):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="alpha"))
    tok.save(str(tmp_path / "words.json"))
    with pytest.raises(DataError, match=r"tokenizer words\.json has no end-of-document token .*'</s>'"):
        cp.prepare([str(_write(tmp_path / "in", _texts(3)))], str(tmp_path / "out"), learners=1,
                   tokenizer_name=str(tmp_path / "words.json"), pipeline_args=FN_API)


def test_documents_the_tokenizer_fails_on_are_skipped(tmp_path):
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2}))  # no unknown token: "c" is an error
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "ab.json"))
    inp = _write(tmp_path / "in", ["a b", "b a a", "a c"])
    m = cp.prepare([str(inp)], str(tmp_path / "out"), learners=1, heldout_fraction=0.5,
                   tokenizer_name=str(tmp_path / "ab.json"), pipeline_args=FN_API)
    assert m["separator"] == 2 and m["counts"]["skipped_tokenizer_failed"] == 1
    assert [(Path(s["path"]).name, s["reason"]) for s in m["skipped"]] == [
        ("doc002.txt", "tokenizer failed (WordLevel error: Missing [UNK] token from the vocabulary)")]
    assert sorted(_all_docs(Corpus.open(tmp_path / "out"))) == [[0, 1], [1, 0, 0]]


# --- a vocabulary above uint16 -----------------------------------------------------------------------

def test_vocabulary_over_65536_gives_uint32_shards(tmp_path):
    n_words = 70_000
    vocab = {f"w{i}": i for i in range(n_words)} | {"<unk>": n_words, "</s>": n_words + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "words.json"))
    docs = [[65_536 + (37 * i + 11 * j) % (n_words - 65_536) for j in range(3 + i % 4)] for i in range(12)]
    texts = [" ".join(f"w{t}" for t in d) for d in docs]
    texts[0] += " </s> w1"  # the separator written inside a document is dropped, not a document end
    docs[0] += [1]
    m = cp.prepare([str(_write(tmp_path / "in", texts))], str(tmp_path / "out"), learners=2, heldout_fraction=0.2,
                   tokenizer_name=str(tmp_path / "words.json"), pipeline_args=FN_API)
    assert (m["vocab_size"], m["dtype"], m["separator"]) == (n_words + 2, "uint32", n_words + 1)
    assert m["counts"]["separator_tokens_dropped"] == 1
    c = Corpus.open(tmp_path / "out")
    assert c.dtype == np.dtype("<u4") and c.train_tokens(0).dtype == np.dtype("<u4")
    assert sorted(_all_docs(c)) == sorted(docs)
    for entry in [*m["shards"], m["heldout"]]:
        assert (tmp_path / "out" / entry["name"]).stat().st_size == 4 * entry["tokens"]
    tokens = c.train_tokens(0)
    epoch = list(itertools.islice(shard_batches(tokens, DataShard(0, 2), batch_size=2, seq_len=4), len(tokens) // 10))
    assert all(b.dtype == np.int32 for b in epoch) and max(int(b.max()) for b in epoch) > 65_535


def test_token_dtype_fits_the_ids():
    assert [token_dtype(v) for v in (256, 2**16, 2**16 + 1, 2**31)] == ["uint16", "uint16", "uint32", "uint32"]
    with pytest.raises(DataError, match=r"vocabulary of 2,147,483,649 ids: batches are int32"):
        token_dtype(2**31 + 1)


def test_old_manifests_open_as_bytes_and_uint16(tmp_path):
    np.arange(1, 200, dtype="<u2").tofile(tmp_path / "heldout.bin")
    np.arange(1, 200, dtype="<u2").tofile(tmp_path / shard_name(0, 1))
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "diloco-tokens/1", "shards": [{"name": shard_name(0, 1)}], "heldout": {"name": "heldout.bin"}}))
    c = Corpus.open(tmp_path)
    assert (c.dtype, c.vocab_size) == (np.dtype("<u2"), 256)
    assert c.heldout_tokens().tolist() == list(range(1, 200))


# --- small corpora ----------------------------------------------------------------------------------

def _never_heldout(n: int, *, learners: int, heldout_fraction: float, seed: int) -> list[str]:
    """n documents that the hash split alone would all put in train shards."""
    out, i = [], 0
    while len(out) < n:
        text = f"small file {i}\n"
        if cp.split_of(hashlib.sha256(text.encode()).hexdigest(), learners=learners,
                       heldout_fraction=heldout_fraction, seed=seed) != cp.HELDOUT:
            out.append(text)
        i += 1
    return out


def test_small_corpus_moves_a_document_into_the_empty_heldout(tmp_path):
    texts = _never_heldout(26, learners=2, heldout_fraction=0.05, seed=0)
    inp = _write(tmp_path / "in", texts)
    m = cp.prepare([str(inp)], str(tmp_path / "out"), learners=2, heldout_fraction=0.05, seed=0, pipeline_args=FN_API)
    digests = {hashlib.sha256(t.encode()).hexdigest(): i for i, t in enumerate(texts)}
    first = min(digests, key=lambda d: cp.move_key(d, 0))  # the nearest to being held out
    assert m["heldout"]["documents"] == 1 and m["counts"]["documents_moved"] == 1
    assert [mv["path"] for mv in m["moved"]] == [str(inp / f"doc{digests[first]:03d}.txt")]
    assert m["moved"][0]["to"] == "heldout.bin" and m["moved"][0]["from"] in {shard_name(i, 2) for i in range(2)}
    assert bytes(Corpus.open(tmp_path / "out").heldout_tokens().astype(np.uint8)).decode() == texts[digests[first]]
    assert sum(s["documents"] for s in m["shards"]) == 25


def test_plan_moves_fills_every_empty_output_from_spare_documents():
    def docs(split, *keys):
        return [(k, f"d-{split}-{k}", f"p-{split}-{k}") for k in keys]

    # held-out empty, shard 1 empty: held-out takes the smallest train key, shard 1 the next spare one
    smallest = {0: docs(0, "05", "07", "09"), 2: docs(2, "03")}
    plan = cp.plan_moves({0: 3, 2: 1}, smallest, learners=3)
    assert plan == {"documents": 4, "moves": [
        {"path": "p-2-03", "digest": "d-2-03", "from": 2, "to": cp.HELDOUT},  # shard 2 is left empty ...
        {"path": "p-0-05", "digest": "d-0-05", "from": 0, "to": 1},
        {"path": "p-0-07", "digest": "d-0-07", "from": 0, "to": 2}]}          # ... and refilled
    # no train shard can spare one: the held-out set gives
    plan = cp.plan_moves({cp.HELDOUT: 2, 0: 1}, {cp.HELDOUT: docs(-1, "01", "02"), 0: docs(0, "08")}, learners=2)
    assert [(mv["digest"], mv["to"]) for mv in plan["moves"]] == [("d--1-01", 1)]
    assert cp.plan_moves({0: 2}, {0: docs(0, "01", "02")}, learners=2) == {"documents": 2, "moves": []}


def test_too_few_documents_say_how_many_are_needed(tmp_path):
    inp = _write(tmp_path / "in", ["one\n", "two\n", "one\n"])  # two documents after dropping the duplicate
    with pytest.raises(DataError, match=r"only 2 documents left, and 2 learners need at least 3 \(one per train "
                                        r"shard and one held out\): add input files or prepare for fewer learners"):
        cp.prepare([str(inp)], str(tmp_path / "out"), learners=2, pipeline_args=FN_API)
    assert not (tmp_path / "out" / "manifest.json").exists()


# --- naming a tokenizer -------------------------------------------------------------------------------

def test_unknown_tokenizer_and_missing_file_are_data_errors(tmp_path):
    inp = _write(tmp_path / "in", _texts(3))
    with pytest.raises(DataError, match=r"unknown tokenizer 'gpt2': expected 'bytes', a Hugging Face tokenizer "
                                        r"file \(a path ending in \.json\) or a SentencePiece model"):
        cp.prepare([str(inp)], str(tmp_path / "out"), learners=1, tokenizer_name="gpt2", pipeline_args=FN_API)
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(DataError, match=rf"tokenizer file {missing} does not exist"):
        cp.prepare([str(inp)], str(tmp_path / "out"), learners=1, tokenizer_name=str(missing), pipeline_args=FN_API)
    with pytest.raises(DataError, match=r"tokenizer file .*nowhere/sp\.model does not exist"):
        ensure_corpus(str(inp), str(tmp_path / "cache"), learners=1, heldout_fraction=0.1, max_bytes=10_000, seed=0,
                      tokenizer=str(tmp_path / "nowhere" / "sp.model"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match=r"bad\.json is not a Hugging Face tokenizer file"):
        cp.prepare([str(inp)], str(tmp_path / "out"), learners=1, tokenizer_name=str(tmp_path / "bad.json"),
                   pipeline_args=FN_API)


def test_ensure_corpus_keys_on_the_tokenizer_file(tmp_path):
    inp = _write(tmp_path / "in", _texts(8))
    tok = _bpe(tmp_path / "tok.json", _texts(40))
    kw = dict(learners=2, heldout_fraction=0.2, max_bytes=100_000, seed=0)
    c = ensure_corpus(str(inp), str(tmp_path / "cache"), tokenizer=str(tok), **kw)
    assert (c.manifest["tokenizer_kind"], c.manifest["tokenizer_sha256"]) == ("huggingface", _sha256(tok))
    assert ensure_corpus(str(inp), str(tmp_path / "cache"), tokenizer=str(tok), **kw).dir == c.dir
    _bpe(tok, _texts(40), vocab_size=290)  # the same path, another tokenizer: another corpus
    again = ensure_corpus(str(inp), str(tmp_path / "cache"), tokenizer=str(tok), **kw)
    assert again.dir != c.dir and again.manifest["tokenizer_sha256"] == _sha256(tok)


def test_cli_prepare_takes_a_tokenizer_path_and_notes_moves(bpe_file, tmp_path):
    app = typer.Typer()
    app.add_typer(data_app, name="data")
    inp = _write(tmp_path / "in", _never_heldout(6, learners=2, heldout_fraction=0.05, seed=0))
    res = CliRunner().invoke(app, ["data", "prepare", "--input", str(inp), "--output", str(tmp_path / "out"),
                                   "--learners", "2", "--tokenizer", str(bpe_file)])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "tokenizer tokenizer.json (huggingface)" in out and "tokens stored as uint16" in out
    assert "note: the hash split left heldout.bin empty: moved" in out
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["heldout"]["documents"] == 1
