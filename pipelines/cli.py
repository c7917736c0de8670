"""`diloco data prepare | tokenizer | inspect` and `diloco report`: the data and telemetry tools.

Options this script does not know are Beam pipeline options and go to the runner untouched
(e.g. `--runner DataflowRunner --project P --region R --temp_location gs://...`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from rich.console import Console
from rich.table import Table
from rich.text import Text

from diloco.textout import labelled

console = Console(stderr=True, markup=False)  # what it prints quotes paths and names a user chose (diloco/textout.py)
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}

data_app = typer.Typer(help="Prepare token shards (Beam), train a tokenizer, inspect a prepared corpus.",
                       no_args_is_help=True)

Runner = Annotated[str, typer.Option(help="Beam runner: FnApiRunner (in-process), DirectRunner, DataflowRunner, "
                                          "FlinkRunner, ...")]


def _beam_args(runner: str, extra: list[str]) -> list[str]:
    return [f"--runner={runner}", *extra]


@data_app.command("prepare", context_settings=PASS_THROUGH)
def prepare(ctx: typer.Context,
            output: Annotated[str, typer.Option(help="directory or gs:// URL for the shards and manifest.json")],
            learners: Annotated[int, typer.Option(min=1, help="train shards: one per learner")],
            input: Annotated[Optional[list[str]], typer.Option(
                "--input", help="file, directory or glob (local or gs://); repeatable; omitted = the Python "
                                "standard library's sources. A .jsonl, .jsonl.gz, .jsonl.zst or .parquet file holds "
                                "one document per line / row (see --text-field); any other file is one text "
                                "document")] = None,
            heldout_fraction: Annotated[float, typer.Option(min=0, max=1, help="share of documents held out")] = 0.05,
            seed: Annotated[int, typer.Option(help="seed of the document-hash split")] = 0,
            max_bytes: Annotated[Optional[int], typer.Option(help="keep the sorted files that fit in this many bytes")] = None,
            tokenizer: Annotated[str, typer.Option(
                help="bytes (UTF-8 bytes, vocabulary 256), or the path of a Hugging Face tokenizer.json or a "
                     "SentencePiece .model; the model's vocab_size must cover its vocabulary")] = "bytes",
            seq_len: Annotated[int, typer.Option(help="sequence length the manifest counts sequences in")] = 128,
            text_field: Annotated[str, typer.Option(
                help="the JSON Lines field / Parquet column holding each record's document; rows where it is "
                     "missing, not a string or empty (and lines that are not a JSON object) are skipped and "
                     "counted per reason under bad_rows")] = "text",
            near_duplicates: Annotated[Optional[float], typer.Option(
                min=0, max=1, metavar="JACCARD",
                help="also drop near duplicates: a document whose set of --shingle-words word runs has an "
                     "estimated Jaccard similarity of at least this with a document of smaller content hash "
                     "(MinHash, 128 permutations, LSH bands); e.g. 0.8; omitted = exact duplicates only")] = None,
            shingle_words: Annotated[int, typer.Option(min=1, help="words per shingle for --near-duplicates")] = 5,
            separator: Annotated[Optional[int], typer.Option(
                min=0, help="the token id that joins documents (the manifest's separator, data.separator in a "
                            "run's config); omitted = the tokenizer's end-of-document token (0 for bytes)")] = None,
            runner: Runner = "FnApiRunner"):
    """Read, normalise, dedupe, split, tokenize and pack text files, JSON Lines and Parquet into one shard per
    learner + held-out.

    Bad rows of JSON Lines / Parquet files are skipped and counted per reason (not_utf8, not_json,
    not_an_object, missing_field, not_a_string, empty, too_long) under bad_rows in manifest.json; a record file
    that cannot be read at all (e.g. a corrupt .gz or .parquet) is an error naming it.
    """
    from diloco.pipelines.corpus import prepare as run_prepare
    from diloco.pipelines.near_duplicates import NearDuplicates
    from diloco.shard_format import DataError

    near = None if near_duplicates is None else NearDuplicates(near_duplicates, ngram=shingle_words)
    try:
        m = run_prepare(input, output, learners=learners, heldout_fraction=heldout_fraction, seed=seed,
                        max_bytes=max_bytes, tokenizer_name=tokenizer, seq_len=seq_len, text_field=text_field,
                        near_duplicates=near, separator=separator, pipeline_args=_beam_args(runner, ctx.args))
    except DataError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(1) from None
    table = Table("file", "documents", "tokens", "sequences", title=f"{output} ({m['content_sha256'][:12]})")
    for s in [*m["shards"], m["heldout"]]:
        table.add_row(s["name"], f"{s['documents']:,}", f"{s['tokens']:,}", f"{s['sequences']:,}")
    console.print(table)
    console.print(f"tokenizer {m['tokenizer']} ({m['tokenizer_kind']}): vocab_size {m['vocab_size']:,}, "
                  f"separator {m['separator']}, tokens stored as {m['dtype']}")
    for mv in m["moved"]:
        console.print(labelled("note:", f"the hash split left {mv['to']} empty: moved {mv['path']} there "
                                        f"from {mv['from']}", style="yellow"))
    c = m["counts"]
    console.print(f"files read {c.get('files_read', 0):,}, duplicates dropped {c.get('duplicates_dropped', 0):,}, "
                  f"skipped {len(m['skipped']):,}, left out by --max-bytes {m['capped_files']:,}")
    if m["near_duplicates"] is not None:
        nd = m["near_duplicates"]
        console.print(f"near duplicates dropped {nd['dropped']:,} (Jaccard >= {nd['threshold']} over "
                      f"{nd['ngram']}-word shingles, {nd['bands']} bands of {nd['rows']})")
        for r in nd["listed"][:10]:
            console.print(f"  {r['path']} ~ {r['like']} ({r['similarity']:.2f})")
        if nd["dropped"] > 10:
            console.print(f"  ... and {nd['dropped'] - 10:,} more ({len(nd['listed']):,} listed in manifest.json)")
    if c.get("records_read") or m["bad_rows"]:
        console.print(f"records read {c.get('records_read', 0):,}, bad rows skipped {sum(m['bad_rows'].values()):,}"
                      + (f": {m['bad_rows']}" if m["bad_rows"] else ""))
    for s in m["skipped"][:20]:
        console.print(f"  skipped {s['path']}: {s['reason']}")
    if len(m["skipped"]) > 20:
        console.print(f"  ... and {len(m['skipped']) - 20} more in manifest.json")


@data_app.command("tokenizer")
def tokenizer(output: Annotated[str, typer.Option(help="the tokenizer.json to write (local or gs://)")],
              vocab_size: Annotated[int, typer.Option(help="ids at most, the end-of-text token and the 256 byte "
                                                           "symbols included; above 65,536 the shards are uint32")],
              input: Annotated[Optional[list[str]], typer.Option(
                  "--input", help="file, directory or glob, read as `data prepare` reads it; repeatable; "
                                  "omitted = the Python standard library's sources")] = None,
              text_field: Annotated[str, typer.Option(help="JSON Lines field / Parquet column of the documents")] = "text",
              max_bytes: Annotated[Optional[int], typer.Option(
                  help="train on the sorted files that fit in this many bytes (a sample of a large corpus)")] = None,
              min_frequency: Annotated[int, typer.Option(min=1, help="a pair merges only if seen this often")] = 2):
    """Train a byte-level BPE tokenizer on a corpus (Hugging Face tokenizers) for `data prepare --tokenizer`.

    Byte-level: every text encodes, nothing is unknown, and decoding gives the text back. Its first id
    is <|endoftext|>, which `data prepare` joins documents with. A corpus too small for the vocabulary
    gives fewer ids than asked (the command says how many): the model's vocab_size must cover them.
    """
    from diloco.pipelines.vocab import train_tokenizer
    from diloco.shard_format import DataError

    try:
        t = train_tokenizer(input, output, vocab_size=vocab_size, text_field=text_field, max_bytes=max_bytes,
                            min_frequency=min_frequency)
    except DataError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(1) from None
    short = "" if t["vocab_size"] == t["asked"] else f" (asked for {t['asked']:,}: the corpus has no more merges)"
    console.print(f"wrote {output}: byte-level BPE, {t['vocab_size']:,} ids{short}, {t['end_of_text']} = id "
                  f"{t['end_of_text_id']}")
    console.print(f"trained on {t['documents']:,} documents, {t['bytes'] / 1e6:,.1f} MB"
                  + (f", skipped {t['skipped']}" if t["skipped"] else "")
                  + f"; {t['bytes_per_token']:.2f} bytes per token on the first documents")
    console.print(f"next: diloco data prepare --tokenizer {output} ... and a model with vocab_size >= "
                  f"{t['vocab_size']:,}")


@data_app.command("inspect")
def inspect(corpus: Annotated[str, typer.Argument(help="a prepared corpus: directory or gs:// URL")],
            verify: Annotated[bool, typer.Option(help="read every file: size and SHA-256 against the manifest")] = False,
            documents: Annotated[int, typer.Option(min=0, help="show the first N documents of each file")] = 0,
            tokenizer: Annotated[Optional[str], typer.Option(
                help="the corpus's tokenizer file, to decode documents of a non-byte corpus")] = None,
            as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False):
    """Show what a prepared corpus holds: files, documents, tokens, what preparation dropped and why.

    Exits 1 when --verify finds a file that is not what the manifest says (missing, truncated, changed).
    """
    import json as json_lib

    from diloco.pipelines.inspection import inspect_corpus
    from diloco.shard_format import DataError

    try:
        s = inspect_corpus(corpus, verify=verify, documents=documents, tokenizer=tokenizer)
    except DataError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json_lib.dumps(s, indent=1))
    else:
        table = Table("file", "documents", "tokens", "sequences", "sha256", *(["check"] if verify else []),
                      title=Text(f"{corpus} ({s['content_sha256'][:12]})"))
        for f in s["files"]:
            check = ([] if not verify else ["ok" if f["problem"] is None else Text(f["problem"], style="red")])
            table.add_row(Text(f["name"]), f"{f['documents']:,}", f"{f['tokens']:,}", f"{f['sequences']:,}",
                          (f["sha256"] or "-")[:12], *check)
        t = s["totals"]
        table.add_row("total", f"{t['documents']:,}", f"{t['tokens']:,}", f"{t['sequences']:,}", "",
                      *([""] if verify else []))
        console.print(table)
        console.print(f"tokenizer {s['tokenizer']} ({s['tokenizer_kind']}): vocab_size {s['vocab_size']:,}, "
                      f"separator {s['separator']}, {s['dtype']}; sequences of {s['seq_len']} + 1, seed "
                      f"{s['seed']}, held out {s['heldout_fraction']}")
        for src in s["sources"]:
            console.print(f"source {src['input']}: {src['files']:,} files, {src['bytes'] / 1e6:,.1f} MB")
        d = s["dropped"]
        console.print(f"files read {s['files_read']:,}, records read {s['records_read']:,}; dropped: duplicates "
                      f"{d['duplicates']:,}, near duplicates "
                      + ("off" if d["near_duplicates"] is None else f"{d['near_duplicates']:,}")
                      + f", bad rows {sum(d['bad_rows'].values()):,}" + (f" {d['bad_rows']}" if d["bad_rows"] else "")
                      + f", skipped files {d['skipped']:,}, left out by the byte cap {d['capped_files']:,}")
        for mv in s["moved"]:
            console.print(f"moved {mv['path']} from {mv['from']} to {mv['to']}")
        for name, docs in s["documents"].items():
            console.print(Text(name, style="bold"))
            for doc in docs:
                console.print("  " + repr(doc[:160]) + ("..." if len(doc) > 160 else ""), markup=False)
    if verify and not s["verified"]:
        raise typer.Exit(1)


def report(ctx: typer.Context,
           run: Annotated[str, typer.Option(help="run id")],
           output: Annotated[str, typer.Option(help="directory or gs:// URL for report.json, CSVs and PNGs")],
           events: Annotated[Optional[str], typer.Option(
               help="JSONL file of exported events; omitted = read the run's events topic")] = None,
           config: Annotated[Optional[Path], typer.Option(
               "--config", "-c", help="the run's config (broker, topic prefix); default: <run.dir>/RUN/config.yaml")] = None,
           timeout_s: Annotated[float, typer.Option(help="give up reading the events topic after this long")] = 60.0,
           runner: Runner = "FnApiRunner"):
    """Telemetry report of a run: goodput, tokens, bytes, lateness, rejections, merge latency, timeline.

    Without --events, the events topic is first copied to OUTPUT/events.jsonl.
    """
    from diloco.config import Config, ConfigError, load_config
    from diloco.infra.kafka import TransportError
    from diloco.pipelines import telemetry

    if config is None and (Path(Config().run.dir) / run / "config.yaml").is_file():
        config = Path(Config().run.dir) / run / "config.yaml"
    try:
        cfg = load_config(config)
    except ConfigError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(2) from None
    if events is None:
        from apache_beam.io.filesystems import FileSystems

        if FileSystems.get_scheme(output) is None:
            Path(output).mkdir(parents=True, exist_ok=True)
        events = FileSystems.join(output, "events.jsonl")
        try:
            n = telemetry.export_events(cfg, run, events, timeout_s=timeout_s)
        except TransportError as err:
            console.print(labelled("error:", err))
            raise typer.Exit(1) from None
        console.print(f"copied {n:,} events to {events}")
    rep = telemetry.report(events, output, run_id=run, fragments=cfg.fragments.count if config else 0,
                           pipeline_args=_beam_args(runner, ctx.args))
    table = Table("learner", "region", "tokens trained", "merged/accepted", "goodput", "late", "rejected", "MB sent",
                  title=f"run {run}")
    for r in rep["learners"]:
        table.add_row(r["learner"], r["region"], f"{r['tokens_trained']:,}", f"{r['merged']}/{r['contributions']}",
                      "-" if r["goodput"] is None else f"{r['goodput']:.1%}", str(r["late"]), str(r["rejected"]),
                      f"{r['bytes_sent'] / 1e6:.1f}")
    console.print(table)
    cov = rep["coverage"]
    if cov["learners"]:
        ct = Table("learner", "tokens merged", "twice", "missed", "lost", "cursor end", title="coverage ledger")
        for lid, r in cov["learners"].items():
            ct.add_row(lid, f"{r['tokens_merged']:,}", f"{r['tokens_twice']:,}", f"{r['tokens_missed']:,}",
                       f"{r['tokens_lost']:,}", "-" if r["cursor_end"] is None else f"{r['cursor_end']:,}")
        console.print(ct)
    lat = rep["merge_latency_s"].get("all")
    console.print(f"{rep['totals']['merges']} merges over {rep['fragments']} fragments"
                  + (f", latency p50 {lat['p50']:.2f}s p90 {lat['p90']:.2f}s" if lat else "")
                  + f"; report in {output}")
