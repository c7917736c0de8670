"""The corpus pipeline's record inputs: JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) and Parquet.

Each line / row is one document (its text field); bad rows are skipped and counted per reason;
a record file that cannot be read is an error naming it. Every preparation runs on the in-process
FnApiRunner (or DirectRunner) over a few tiny files written here; no services.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
import zstandard
from typer.testing import CliRunner

from diloco.pipelines import corpus as cp
from diloco.pipelines.cli import data_app
from diloco.shard_format import Corpus, DataError

FN_API = ["--runner=FnApiRunner"]
DIRECT = ["--runner=DirectRunner"]


def _docs(tokens) -> list[str]:
    """A shard back to its documents (byte tokens; documents joined with 0)."""
    return np.asarray(tokens).astype(np.uint8).tobytes().decode("utf-8").split("\x00")


def _line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


# --- the per-row decision ------------------------------------------------------------------------

@pytest.mark.parametrize("line, expected", [
    (b'{"text": "hello"}', ("hello", None)),
    (b'{"text": "a\\r\\nb\\u0000c", "id": 3}', ("a\nbc", None)),   # normalised like a text file
    (b'\xef\xbb\xbf{"text": "bom"}\r\n', ("bom", None)),             # a BOM and CRLF line end are fine
    (b'{"text": "caf\xe9"}', (None, "not_utf8")),                    # a latin-1 byte
    (b'{"text": "\\ud800"}', (None, "not_utf8")),                    # a lone surrogate cannot be UTF-8
    (b'{"text": "unterminated', (None, "not_json")),
    (b"plain words", (None, "not_json")),
    (b"[1, 2]", (None, "not_an_object")),
    (b'"just a string"', (None, "not_an_object")),
    (b"null", (None, "not_an_object")),
    (b'{"body": "x"}', (None, "missing_field")),
    (b'{"text": 5}', (None, "not_a_string")),
    (b'{"text": null}', (None, "not_a_string")),
    (b'{"text": ["a"]}', (None, "not_a_string")),
    (b'{"text": " \\n\\u0000 "}', (None, "empty")),
])
def test_json_line_text(line, expected):
    assert cp.json_line_text(line, "text") == expected


def test_json_line_text_reads_the_named_field():
    assert cp.json_line_text(b'{"text": "no", "body": "yes"}', "body") == ("yes", None)
    assert cp.json_line_text(b'{"text": "no"}', "body") == (None, "missing_field")


@pytest.mark.parametrize("value, expected", [
    ("doc", ("doc", None)), (b"doc", ("doc", None)), (b"\xff", (None, "not_utf8")),
    (None, (None, "not_a_string")), (1.5, (None, "not_a_string")), ({"text": "x"}, (None, "not_a_string")),
    ("", (None, "empty")), ("\ufeff\r\n", (None, "empty")),
])
def test_value_text(value, expected):
    assert cp.value_text(value) == expected
    assert expected[1] is None or expected[1] in cp.BAD_ROW_REASONS


@pytest.mark.parametrize("name, fmt", [
    ("a.jsonl", "jsonl"), ("gs://b/x/a.jsonl.gz", "jsonl"), ("a.JSONL.ZST", "jsonl"), ("a.parquet", "parquet"),
    ("a.txt", None), ("a.json", None), ("a.py", None), ("a.jsonl.bz2", None), ("parquet", None),
])
def test_record_format(name, fmt):
    assert cp.record_format(name) == fmt


def test_jsonl_rows_number_lines_and_skip_blank_ones(tmp_path):
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(_line({"text": "one"}) + b"\n  \n" + b"{bad\n")
                     + zstandard.ZstdCompressor().compress(_line({"text": "two"})))  # two frames: both read
    assert list(cp.jsonl_rows(str(path), "text")) == [(1, "one", None), (4, None, "not_json"), (5, "two", None)]


def test_a_json_line_longer_than_the_bound_is_a_bad_row_read_in_bounded_pieces(tmp_path):
    """A 6.4 KB .jsonl.zst holding one 200 MB line was read whole (a peak of 1 GB for one row): a line is
    read at most `max_line_bytes` at a time, and a longer one is skipped as too_long."""
    import tracemalloc

    bound = 1 << 20
    at_bound = b'{"text": "' + b"y" * (bound - 12) + b'"}'
    path = tmp_path / "a.jsonl.zst"
    with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as f:
        f.write(_line({"text": "one"}) + b'{"text": "')
        for _ in range(64):   # one 64 MiB line
            f.write(b"x" * bound)
        f.write(b'"}\n' + at_bound + b"\n" + at_bound + b"z\n" + _line({"text": "two"}) + at_bound)
    assert path.stat().st_size < 64 << 10
    tracemalloc.start()
    try:
        rows = list(cp.jsonl_rows(str(path), "text", max_line_bytes=bound))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(n, text and text[:3], reason) for n, text, reason in rows] == [
        (1, "one", None), (2, None, "too_long"), (3, "yyy", None), (4, None, "too_long"), (5, "two", None),
        (6, "yyy", None)]   # a line of exactly the bound, its line end aside, is read (the last has none)
    assert peak < 16 * bound, peak
    assert "too_long" in cp.BAD_ROW_REASONS


def test_parquet_rows_stream_batches_and_a_missing_column_is_missing_field(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(7)]}), path, row_group_size=3)
    rows = list(cp.parquet_rows(str(path), "text", batch_rows=2))
    assert rows == [(i + 1, f"doc {i}", None) for i in range(7)]
    assert list(cp.parquet_rows(str(path), "body")) == [(i + 1, None, "missing_field") for i in range(7)]


# --- the pipeline --------------------------------------------------------------------------------

BAD_ROWS = {"not_utf8": 2, "not_json": 2, "not_an_object": 2, "missing_field": 1, "not_a_string": 3, "empty": 2}


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory) -> tuple[Path, set[str]]:
    """A directory with a .jsonl.gz, a .parquet and a text file, bad rows planted in both record files
    (counts: BAD_ROWS); returns it and the documents a correct preparation keeps."""
    root = tmp_path_factory.mktemp("mixed")
    json_docs = [f"json document {i}: {'é' * (i % 3)} words\n" for i in range(12)]
    lines = [_line({"text": d, "id": i}) for i, d in enumerate(json_docs)]
    lines[3:3] = [b"{not json\n", b"\n", b"[1, 2, 3]\n", _line({"title": "no text"}), _line({"text": 5}),
                  b'{"text": "caf\xe9"}\n', b"   \n", b'"a string"\n', _line({"text": None}), b"nope\n",
                  _line({"text": "\r\n  "})]
    with gzip.open(root / "records.jsonl.gz", "wb") as f:
        f.writelines(lines)

    parquet_docs = [f"parquet row {i}\nsecond line {i * i}\n" for i in range(12)]
    texts = pa.array([d.encode() for d in parquet_docs]
                     + [None, b"bad \xff\xfe bytes", b" \t", json_docs[5].replace("\n", "\r\n").encode()],
                     pa.binary()).view(pa.string())   # a string column holding invalid UTF-8 in one row
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), root / "rows.parquet",
                   row_group_size=5)   # the last row duplicates json document 5 once normalised

    (root / "notes.txt").write_text("a plain text file is still one document\n", encoding="utf-8")
    return root, {*json_docs, *parquet_docs, "a plain text file is still one document\n"}


@pytest.fixture(scope="module")
def prepared(mixed_inputs, tmp_path_factory) -> tuple[Path, dict]:
    root, _ = mixed_inputs
    out = tmp_path_factory.mktemp("prepared")
    return out, cp.prepare([str(root)], str(out), learners=2, heldout_fraction=0.2, seed=3, pipeline_args=FN_API)


def test_record_documents_reach_the_shards(prepared, mixed_inputs):
    out, m = prepared
    _, keep = mixed_inputs
    c = Corpus.open(out)
    every = [d for i in range(2) for d in _docs(c.train_tokens(i))] + _docs(c.heldout_tokens())
    assert sorted(every) == sorted(keep)   # every good row once, bad rows and the duplicate out
    assert m["counts"]["duplicates_dropped"] == 1
    assert m["counts"]["files_read"] == 3
    assert m["counts"]["records_read"] == 21 + 16   # non-blank lines + rows
    assert m["counts"]["tokens"] == sum(len(d.encode()) for d in keep)
    assert m["text_field"] == "text" and m["skipped"] == []


def test_bad_rows_are_counted_per_reason(prepared):
    _, m = prepared
    assert m["bad_rows"] == BAD_ROWS
    assert {k: v for k, v in m["counts"].items() if k.startswith("bad_rows_")} == {
        f"bad_rows_{r}": n for r, n in BAD_ROWS.items()}


def test_rerun_on_another_runner_is_byte_identical(prepared, mixed_inputs, tmp_path):
    out, m = prepared
    root, _ = mixed_inputs
    again = cp.prepare([str(root)], str(tmp_path / "again"), learners=2, heldout_fraction=0.2, seed=3,
                       pipeline_args=DIRECT)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    assert again["content_sha256"] == m["content_sha256"]


def _truncated_gzip(path: Path) -> None:
    path.write_bytes(gzip.compress(b"".join(_line({"text": f"doc {i}"}) for i in range(50)))[:-12])


def _not_parquet(path: Path) -> None:
    path.write_bytes(b"PAR1" + b"\x00garbage" * 10 + b"PAR1")


def _not_zstd(path: Path) -> None:
    path.write_bytes(b"this is not zstandard data")


@pytest.mark.parametrize("name, corrupt", [("broken.jsonl.gz", _truncated_gzip), ("broken.parquet", _not_parquet),
                                           ("broken.jsonl.zst", _not_zstd)])
def test_an_unreadable_record_file_is_an_error_naming_it(tmp_path, name, corrupt):
    inp = tmp_path / "in"
    inp.mkdir()
    with gzip.open(inp / "good.jsonl.gz", "wb") as f:
        f.writelines(_line({"text": f"good document {i}"}) for i in range(10))
    corrupt(inp / name)
    with pytest.raises(DataError, match=re.escape(f"cannot read {inp / name}")):
        cp.prepare([str(inp)], str(tmp_path / "out"), learners=2, heldout_fraction=0.2, pipeline_args=FN_API)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_only_bad_rows_fails_with_their_counts(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b"".join(_line({"text": f"doc {i}"}) for i in range(5)))
    with pytest.raises(DataError, match=r"no documents for .*bad rows \{'missing_field': 5\} \(text field 'body'\)"):
        cp.prepare([str(tmp_path / "in")], str(tmp_path / "out"), learners=2, text_field="body",
                   pipeline_args=FN_API)


def test_cli_prepare_takes_a_text_field_and_prints_bad_rows(tmp_path):
    app = typer.Typer()
    app.add_typer(data_app, name="data")
    (tmp_path / "in").mkdir()
    data = b"".join(_line({"body": f"cli document {i}", "text": "ignored"}) for i in range(8)) + _line({"text": "x"})
    (tmp_path / "in" / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    res = CliRunner().invoke(app, ["data", "prepare", "--input", str(tmp_path / "in"), "--output",
                                   str(tmp_path / "out"), "--learners", "2", "--heldout-fraction", "0.2",
                                   "--text-field", "body", "--runner", "FnApiRunner"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "records read 9, bad rows skipped 1: {'missing_field': 1}" in out
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["text_field"] == "body" and m["bad_rows"] == {"missing_field": 1}
    assert sum(s["documents"] for s in [*m["shards"], m["heldout"]]) == 8
    help_text = " ".join(CliRunner().invoke(app, ["data", "prepare", "--help"]).output.split())
    assert "--text-field" in help_text and "bad_rows" in help_text and "--separator" in help_text
    res = CliRunner().invoke(app, ["data", "prepare", "--input", str(tmp_path / "in"), "--output",  # issue 51
                                   str(tmp_path / "sep"), "--learners", "1", "--text-field", "body",
                                   "--separator", "256", "--runner", "FnApiRunner"])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "sep" / "manifest.json").read_text())
    assert (m["separator"], m["vocab_size"]) == (256, 257)


def test_a_run_config_names_the_text_field_of_its_jsonl_corpus(tmp_path):
    """`data.corpus` + `data.text_field` in a run's config: the learners' shards hold that field's
    documents, and the cached preparation is keyed by the field (another field is another corpus)."""
    from diloco.config import build_config
    from diloco.pipelines.prepared import corpus_for

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b"".join(_line({"body": f"body {i}", "text": f"text {i}"})
                                                       for i in range(12)))

    def config(**data):
        return build_config({"data": {"corpus": str(tmp_path / "in"), "dir": str(tmp_path / "cache"),
                                      "heldout_fraction": 0.2, **data}})

    body = corpus_for(config(text_field="body"))
    text = corpus_for(config())
    assert body.dir != text.dir
    docs = {d for s in range(body.num_shards) for d in _docs(body.train_tokens(s))} | set(_docs(body.heldout_tokens()))
    assert {d for d in docs if d} == {f"body {i}" for i in range(12)}
    assert corpus_for(config(text_field="body")).dir == body.dir  # prepared once, then reused
    with pytest.raises(ValueError, match="text_field"):
        config(text_field="")


# --- near duplicates --------------------------------------------------------------------------------

from diloco.pipelines import near_duplicates as nd  # noqa: E402


def _essay(i: int, words: int = 120) -> str:
    """A document of `words` words that shares no 5-word run with _essay(j) for j != i."""
    rng = np.random.default_rng(i)
    return " ".join(f"w{i}x{int(k)}" for k in rng.integers(0, 10_000, words)) + "\n"


def _edited(text: str, every: int) -> str:
    """The text with one word in each `every` replaced: a near duplicate of it."""
    words = text.split()
    return " ".join("EDIT" if k % every == 0 else w for k, w in enumerate(words)) + "\n"


def test_minhash_estimates_the_jaccard_similarity_of_shingle_sets():
    spec = nd.NearDuplicates(0.8, num_perm=256)
    a = _essay(1, 400)
    for every in (3, 10, 40, 200):
        b = _edited(a, every)
        sa, sb = nd.shingles(a, 5), nd.shingles(b, 5)
        exact = len(sa & sb) / len(sa | sb)
        assert abs(nd.similarity(nd.signature(a, spec), nd.signature(b, spec)) - exact) < 0.1, every
    assert nd.similarity(nd.signature(a, spec), nd.signature(_essay(2, 400), spec)) < 0.05
    assert nd.shingles("Two Words", 5) == {b"two words"}   # shorter than a shingle: the whole text


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.8, 0.95])
def test_lsh_bands_put_the_meeting_curve_s_step_near_the_threshold(threshold):
    bands, rows = nd.lsh_bands(threshold, 128)
    assert bands * rows <= 128
    meet = lambda s: 1 - (1 - s ** rows) ** bands  # noqa: E731
    assert meet(min(1.0, threshold + 0.15)) > 0.9 and meet(max(0.0, threshold - 0.25)) < 0.2


def test_bad_near_duplicate_settings_are_refused():
    for bad in (0.0, 1.5, -1):
        with pytest.raises(ValueError, match="threshold must be in"):
            nd.NearDuplicates(bad)


@pytest.fixture(scope="module")
def near_inputs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A Parquet file and a .jsonl.gz with near duplicates planted across and within them, a bad row in
    each; returns the directory and, per planted near duplicate, the original it copies."""
    root = tmp_path_factory.mktemp("near")
    originals = [_essay(i) for i in range(10)]
    near = {_edited(originals[0], 60): originals[0], _edited(originals[3], 200): originals[3],   # Jaccard 0.90,
            _edited(originals[7], 50): originals[7]}                                            # 0.98 and 0.83
    far = _edited(originals[5], 2)          # half the words changed: not near at 0.7
    jsonl = [*originals[:6], far, *list(near)[:2]]
    with gzip.open(root / "a.jsonl.gz", "wb") as f:
        f.writelines([*(_line({"text": d}) for d in jsonl), b"{broken\n"])
    parquet = [*originals[6:], list(near)[2]]
    pq.write_table(pa.table({"text": [*parquet, None]}), root / "b.parquet")
    return root, {"docs": [*originals, far], "near": near}


def test_near_duplicates_are_dropped_reported_and_deterministic(near_inputs, tmp_path):
    root, planted = near_inputs
    spec = nd.NearDuplicates(0.7)
    m = cp.prepare([str(root)], str(tmp_path / "fn"), learners=2, heldout_fraction=0.2, near_duplicates=spec,
                   pipeline_args=FN_API)
    c = Corpus.open(tmp_path / "fn")
    kept = [d for i in range(2) for d in _docs(c.train_tokens(i))] + _docs(c.heldout_tokens())
    # which copy stays is the smaller content hash: the original or its edit, but one of each pair
    for dup, orig in planted["near"].items():
        assert (dup in kept) != (orig in kept), "exactly one of a near-duplicate pair stays"
    assert len(kept) == len(planted["docs"])                # every other document (the far edit too) stays
    rep = m["near_duplicates"]
    assert rep["dropped"] == 3 == m["counts"]["near_duplicates_dropped"] == len(rep["listed"])
    assert rep["threshold"] == 0.7 and (rep["bands"], rep["rows"]) == nd.lsh_bands(0.7, 128)
    for r in rep["listed"]:
        assert r["similarity"] >= 0.7 and r["path"] != r["like"]
    assert m["bad_rows"] == {"not_json": 1, "not_a_string": 1}
    again = cp.prepare([str(root)], str(tmp_path / "direct"), learners=2, heldout_fraction=0.2,
                       near_duplicates=spec, pipeline_args=DIRECT)
    assert again["content_sha256"] == m["content_sha256"] and again["near_duplicates"] == rep
    off = cp.prepare([str(root)], str(tmp_path / "off"), learners=2, heldout_fraction=0.2, pipeline_args=FN_API)
    assert off["near_duplicates"] is None and sum(s["documents"] for s in [*off["shards"], off["heldout"]]) == 14


def test_cli_prepare_drops_near_duplicates_and_names_them(near_inputs, tmp_path):
    root, _ = near_inputs
    app = typer.Typer()
    app.add_typer(data_app, name="data")
    res = CliRunner().invoke(app, ["data", "prepare", "--input", str(root), "--output", str(tmp_path / "out"),
                                   "--learners", "2", "--heldout-fraction", "0.2", "--near-duplicates", "0.7",
                                   "--runner", "FnApiRunner"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "near duplicates dropped 3 (Jaccard >= 0.7 over 5-word shingles" in out
    assert out.count(" ~ ") == 3
    bad = CliRunner().invoke(app, ["data", "prepare", "--input", str(root), "--output", str(tmp_path / "bad"),
                                   "--learners", "2", "--near-duplicates", "1.5"])
    assert bad.exit_code == 2 and "near-duplicates" in " ".join(bad.output.split())


def test_a_run_config_asks_for_near_duplicate_removal(near_inputs, tmp_path):
    from diloco.config import build_config
    from diloco.pipelines.prepared import corpus_for

    root, planted = near_inputs

    def config(**data):
        return build_config({"data": {"corpus": str(root), "dir": str(tmp_path / "cache"), "heldout_fraction": 0.2,
                                      **data}})

    near, exact = corpus_for(config(near_duplicates=0.7)), corpus_for(config())
    assert near.dir != exact.dir
    assert json.loads((near.dir / "manifest.json").read_text())["near_duplicates"]["dropped"] == 3
    assert json.loads((exact.dir / "manifest.json").read_text())["near_duplicates"] is None
    with pytest.raises(Exception, match="near_duplicates"):
        config(near_duplicates=0)


@pytest.mark.integration
def test_a_record_corpus_with_near_duplicates_trains_in_a_local_run(near_inputs, tiny_config, tmp_path):
    """The issue's whole path: a Parquet file and a .jsonl.gz with bad rows and near duplicates planted,
    prepared by the run itself (data.corpus, data.near_duplicates), trained by a local multi-region run."""
    from rich.console import Console

    from diloco.pipelines.prepared import corpus_for
    from diloco.run import train

    root, _ = near_inputs
    cfg = tiny_config(data={"corpus": str(root), "dir": str(tmp_path / "data"), "heldout_fraction": 0.2,
                            "near_duplicates": 0.7},
                      outer={"lr": 1.0, "momentum": 0.0}, fragments={"apply": "rebase"})
    m = corpus_for(cfg).manifest
    assert m["near_duplicates"]["dropped"] == 3 and m["bad_rows"] == {"not_json": 1, "not_a_string": 1}
    s = train(cfg, progress=False, console=Console(quiet=True))
    assert s["eval_loss_end"] < 0.9 * s["eval_loss_start"], (s["eval_loss_start"], s["eval_loss_end"])
    assert s["coverage"]["totals"]["tokens_twice"] == 0 and s["coverage"]["totals"]["tokens_merged"] > 0


def test_a_json_line_nested_deeper_than_json_reads_is_a_bad_row():
    """One such row raised RecursionError and failed the whole preparation; bad rows are skipped."""
    assert cp.json_line_text(b"[" * 100_000 + b"]" * 100_000, "text") == (None, "not_json")
    assert cp.json_line_text(b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "text") == (None, "not_json")
