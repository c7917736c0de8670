"""The Beam pipelines on the in-process FnApiRunner: corpus to token shards, events to a report."""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from diloco.pipelines import corpus as cp
from diloco.pipelines import telemetry as tm
from diloco.pipelines.prepared import ensure_corpus
from diloco.shard_format import Corpus, DataError, shard_name

FN_API = ["--runner=FnApiRunner"]


def fn_api_pipeline() -> BeamTestPipeline:
    return BeamTestPipeline(options=PipelineOptions(FN_API))


# --- corpus --------------------------------------------------------------------------------------

def _docs(tokens: np.ndarray) -> list[str]:
    """A shard back to its documents (byte tokens; documents joined with 0)."""
    return np.asarray(tokens).astype(np.uint8).tobytes().decode("utf-8").split("\x00")


@pytest.fixture(scope="module")
def raw_corpus(tmp_path_factory) -> tuple[Path, set[str]]:
    """60 distinct documents in nested directories, plus duplicates and bad files; returns the
    directory and the set of normalised texts a correct preparation keeps."""
    root = tmp_path_factory.mktemp("raw")
    keep = set()
    for i in range(60):
        d = root / f"part{i % 3}"
        d.mkdir(exist_ok=True)
        text = f"# document {i}\n" + "".join(f"line {j} of {i}: é\n" for j in range(i % 7 + 1))
        (d / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
        keep.add(text)
    (root / "part0" / "copy-of-doc05.txt").write_text((root / "part2" / "doc05.txt").read_text())
    (root / "windows.txt").write_bytes(b"crlf\r\nand nul\x00 here\r\n")   # normalises to a new document
    keep.add("crlf\nand nul here\n")
    (root / "windows-unix.txt").write_bytes(b"crlf\nand nul here\n")     # ... duplicated after normalising
    (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_bytes(b"  \n\r\n\x00")
    return root, keep


@pytest.fixture(scope="module")
def prepared(raw_corpus, tmp_path_factory) -> tuple[Path, dict]:
    root, _ = raw_corpus
    out = tmp_path_factory.mktemp("prepared")
    manifest = cp.prepare([str(root), str(root / "missing-*.txt")], str(out), learners=3, heldout_fraction=0.2,
                          seed=7, pipeline_args=FN_API)
    return out, manifest


def test_read_documents_routes_bad_files_to_skipped(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes(b"\xef\xbb\xbfhello\r\nworld\x00\n")
    (tmp_path / "bad.txt").write_bytes(b"ok then \xff\xfe")
    (tmp_path / "empty.txt").write_bytes(b"\n\n")
    paths = [str(tmp_path / n) for n in ("good.txt", "bad.txt", "empty.txt", "gone.txt")]
    text = "hello\nworld\n"
    with fn_api_pipeline() as p:
        out = p | beam.Create(paths) | cp.ReadDocuments()
        assert_that(out["docs"], equal_to([cp.Doc(str(good), hashlib.sha256(text.encode()).hexdigest(), text)]),
                    label="docs")
        assert_that(out["skipped"] | beam.Map(lambda s: (Path(s["path"]).name, s["reason"])), equal_to([
            ("bad.txt", "not UTF-8 (byte 8)"), ("empty.txt", "empty"),
            ("gone.txt", "unreadable: FileNotFoundError")]), label="skipped")


def test_drop_duplicates_keeps_the_smallest_path():
    docs = [cp.Doc("b", "d1", "x"), cp.Doc("a", "d1", "x"), cp.Doc("c", "d2", "y"), cp.Doc("d", "d1", "x")]
    with fn_api_pipeline() as p:
        kept = p | beam.Create(docs) | cp.DropDuplicates()
        assert_that(kept, equal_to([cp.Doc("a", "d1", "x"), cp.Doc("c", "d2", "y")]))


def test_shards_hold_every_kept_document_once(prepared, raw_corpus):
    out, m = prepared
    _, keep = raw_corpus
    c = Corpus.open(out)
    assert c.num_shards == 3 and [s["name"] for s in m["shards"]] == [shard_name(i, 3) for i in range(3)]
    train = [_docs(np.asarray(c.train_tokens(i))) for i in range(3)]
    heldout = _docs(np.asarray(c.heldout_tokens()))
    every = [d for shard in train for d in shard] + heldout
    assert sorted(every) == sorted(keep)  # duplicates gone, nothing lost, bad files out
    assert not set(heldout) & {d for shard in train for d in shard}
    for entry, docs in zip([*m["shards"], m["heldout"]], [*train, heldout]):
        assert entry["documents"] == len(docs)
        assert entry["tokens"] == sum(len(d.encode()) for d in docs) + len(docs) - 1  # + separators
        assert entry["sequences"] == entry["tokens"] // 129
        assert (out / entry["name"]).stat().st_size == 2 * entry["tokens"]
    assert m["counts"]["duplicates_dropped"] == 2
    assert m["counts"]["documents_train"] + m["counts"]["documents_heldout"] == len(keep)
    assert m["counts"]["tokens"] == sum(len(d.encode()) for d in keep)
    assert 0 < m["heldout"]["documents"] < len(keep) / 2
    assert m["tokenizer"] == "bytes" and m["vocab_size"] == 256 and m["seed"] == 7


def test_bad_inputs_are_reported(prepared, raw_corpus):
    _, m = prepared
    root, _ = raw_corpus
    skipped = {Path(s["path"]).name: s["reason"] for s in m["skipped"]}
    assert skipped == {"latin1.txt": "not UTF-8 (byte 3)", "empty.txt": "empty", "blank.txt": "empty",
                       "missing-*.txt": "matches no files"}
    assert m["counts"]["skipped_not_utf8"] == 1 and m["counts"]["skipped_empty"] == 2
    assert [s["files"] for s in m["sources"]] == [66, 0]
    assert not (Path(prepared[0]) / cp.PARTS).exists()


def test_rerun_is_byte_identical_and_heldout_is_stable(prepared, raw_corpus, tmp_path):
    out, m = prepared
    root, _ = raw_corpus
    again = cp.prepare([str(root), str(root / "missing-*.txt")], str(tmp_path / "again"), learners=3,
                       heldout_fraction=0.2, seed=7, pipeline_args=FN_API)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    assert again["content_sha256"] == m["content_sha256"]
    # the held-out set depends on content and seed only, not on how many learners share the rest
    five = cp.prepare([str(root)], str(tmp_path / "five"), learners=5, heldout_fraction=0.2, seed=7,
                      pipeline_args=FN_API)
    assert (tmp_path / "five" / "heldout.bin").read_bytes() == (out / "heldout.bin").read_bytes()
    assert sum(s["documents"] for s in five["shards"]) == sum(s["documents"] for s in m["shards"])


def test_empty_input_fails_with_the_skip_report(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"no documents for .*empty\.txt.*'empty'"):
        cp.prepare([str(tmp_path / "in")], str(tmp_path / "out"), learners=2, pipeline_args=FN_API)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_ensure_corpus_runs_the_pipeline_once(tmp_path):
    c = ensure_corpus(None, str(tmp_path), learners=2, heldout_fraction=0.1, max_bytes=300_000, seed=0)
    assert c.manifest["sources"][0]["input"].endswith("/**/*.py") and c.manifest["capped_files"] > 0
    assert sum(s["tokens"] for s in [*c.manifest["shards"], c.manifest["heldout"]]) <= 300_000
    again = ensure_corpus(None, str(tmp_path), learners=2, heldout_fraction=0.1, max_bytes=300_000, seed=0)
    assert again.dir == c.dir and [p.name for p in tmp_path.iterdir()] == [c.dir.name]


# --- telemetry -----------------------------------------------------------------------------------

LEARNERS = {"us-0": "us", "us-1": "us", "eu-0": "eu", "eu-1": "eu"}
FRAGMENTS = 2
T = 1000  # tokens each learner trains between two syncs of a fragment


def simulated_run() -> list[dict]:
    """The events of a small run: 4 learners in 2 regions, 2 fragments, 3 rounds; one contribution
    lands late and enters the next round, one is stale, one is a norm outlier, one never merges,
    one record is unreadable."""
    events, clock, n = [], [1000.0], [0]

    def emit(kind, source, dt=0.25, **fields):
        clock[0] += dt
        events.append({"schema": 1, "kind": kind, "time": clock[0], "run": "r1", "source": source, **fields})

    def accept(lrn, p, base, tokens=T):
        n[0] += 1
        cid = f"c{n[0]}"
        emit("contribution_accepted", "syncer", id=cid, learner=lrn, region=LEARNERS[lrn], fragment=p,
             base_version=base, version=version[p], tokens=tokens, bytes=4096)
        return cid, lrn, base

    version = dict.fromkeys(range(FRAGMENTS), 0)
    sent = dict.fromkeys(LEARNERS, 0)
    emit("syncer_started", "syncer", versions={str(p): 0 for p in range(FRAGMENTS)}, pending=0)
    for lrn in LEARNERS:  # each learner's first heartbeat
        emit("learner_joined", "syncer", learner=lrn, incarnation="a", step=0, was=None)
    carried: dict[int, list[tuple]] = {p: [] for p in range(FRAGMENTS)}
    for rnd in range(3):
        for p in range(FRAGMENTS):
            contribs, late_one = carried[p], None
            carried[p] = []
            for lrn in LEARNERS:
                sent[lrn] += 4200
                if (lrn, rnd, p) == ("eu-1", 1, 0):
                    n[0] += 1
                    emit("contribution_rejected", "syncer", id=f"c{n[0]}", reason="stale", detail="base 0 < 1 - 0",
                         learner=lrn, region="eu", fragment=p, base_version=version[p] - 1)
                elif (lrn, rnd, p) == ("us-1", 0, 1):
                    late_one = lrn
                else:
                    contribs.append(accept(lrn, p, version[p]))
            if (rnd, p) == (2, 1):
                outlier = contribs.pop()
                emit("contribution_rejected", "syncer", id=outlier[0], reason="norm_outlier", detail="norm 9 > 5 x 1")
            merged_at = version[p]
            version[p] += 1
            emit("merge", "syncer", dt=0.5 + rnd, fragment=p, version=version[p], ids=[c[0] for c in contribs],
                 learners=[c[1] for c in contribs], tokens=T * len(contribs),
                 late=sum(1 for c in contribs if c[2] < merged_at), reason="quorum", seconds=0.02)
            if late_one:  # arrives after its round closed: counts in the next one
                carried[p].append(accept(late_one, p, merged_at))
        for i, lrn in enumerate(LEARNERS):
            emit("heartbeat", "learner", learner=lrn, region=LEARNERS[lrn], step=(rnd + 1) * 10, tokens=(rnd + 1) * T,
                 loss=5.0 - rnd - 0.1 * i, step_time=0.05, state="finished" if rnd == 2 else "running",
                 published=(rnd + 1) * FRAGMENTS, bytes_sent=sent[lrn], bytes_fetched=1000 * rnd, versions_applied=rnd,
                 versions={str(q): v for q, v in version.items()})
    accept("eu-0", 0, version[0], tokens=T // 2)  # handed in at the end, never merged
    emit("contribution_rejected", "syncer", id=None, reason="malformed", detail="frame header has no contribution id",
         where={"topic": "diloco.r1.fragments.eu", "partition": 0, "offset": 99})
    for lrn in LEARNERS:
        emit("learner_finished", "syncer", learner=lrn, step=30, tokens=3 * T)
    emit("syncer_stopped", "syncer", versions={str(p): v for p, v in version.items()})
    return events


def expected_figures(events: list[dict]) -> dict:
    """The report's figures computed straight from the events, independently of the pipeline."""
    accepted = {e["id"]: e for e in events if e["kind"] == "contribution_accepted"}
    merges = [e for e in events if e["kind"] == "merge"]
    merged = {cid: m for m in merges for cid in m["ids"]}
    rejected = {e["id"]: e for e in events if e["kind"] == "contribution_rejected" and e["id"] and e["id"] not in merged}
    trained = {e["learner"]: e["tokens"] for e in events if e["kind"] == "heartbeat"}  # last one wins
    out = {"learners": {}, "regions": defaultdict(Counter)}
    for lrn, region in LEARNERS.items():
        mine = [a for a in accepted.values() if a["learner"] == lrn]
        ok = [a for a in mine if a["id"] in merged]
        lags = [merged[a["id"]]["version"] - 1 - a["base_version"] for a in ok]
        rej = Counter(r["reason"] for cid, r in rejected.items()
                      if (accepted.get(cid) or r).get("learner") == lrn)
        row = {"tokens_trained": trained[lrn], "tokens_contributed": sum(a["tokens"] for a in mine),
               "tokens_merged": sum(a["tokens"] for a in ok), "merged": len(ok), "late": sum(1 for x in lags if x > 0),
               "rejected": sum(rej.values()), "rejected_by_reason": dict(rej),
               "bytes_sent": max(e["bytes_sent"] for e in events if e.get("learner") == lrn and e["kind"] == "heartbeat")}
        row["goodput"] = row["tokens_merged"] / (FRAGMENTS * row["tokens_trained"])
        out["learners"][lrn] = row
        out["regions"][region].update({k: row[k] for k in ("tokens_trained", "tokens_merged", "bytes_sent", "late")})
    out["staleness"] = Counter(str(m["version"] - 1 - accepted[cid]["base_version"]) for cid, m in merged.items())
    latency = [m["time"] - min(accepted[c]["time"] for c in m["ids"]) for m in merges]
    out["latency"] = {"p50": float(np.percentile(latency, 50)), "p90": float(np.percentile(latency, 90)),
                      "max": max(latency), "count": len(latency)}
    return out


@pytest.fixture(scope="module")
def run_report(tmp_path_factory) -> tuple[Path, list[dict], dict]:
    d = tmp_path_factory.mktemp("report")
    events = simulated_run()
    lines = [json.dumps(e) for e in events]
    lines.insert(3, "{not json")
    lines.insert(5, json.dumps({**events[0], "run": "another"}))
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")
    rep = tm.report(str(d / "events.jsonl"), str(d / "out"), run_id="r1", pipeline_args=FN_API)
    return d / "out", events, rep


def test_contribution_outcomes_join_acceptances_rejections_and_merges():
    events = simulated_run()
    with fn_api_pipeline() as p:
        outcomes = p | beam.Create(events) | tm.ContributionOutcomes()
        assert_that(outcomes | beam.Filter(lambda o: o["status"] != "merged")
                    | beam.Map(lambda o: (o["learner"], o["status"], o["reason"])),
                    equal_to([("eu-1", "rejected", "stale"), ("eu-1", "rejected", "norm_outlier"),
                              ("eu-0", "pending", None), ("(unknown)", "rejected", "malformed")]))


def test_learner_counters_add_up_over_incarnations():
    """A learner killed and restarted counts its tokens, sends and reads from zero again: both lives
    count. Its steps go on from where it resumed."""
    beats = [{"time": 1.0, "incarnation": "a", "step": 5, "tokens": 50, "bytes_sent": 100, "bytes_fetched": 10,
              "versions_applied": 1},
             {"time": 2.0, "incarnation": "a", "step": 9, "tokens": 90, "bytes_sent": 300, "bytes_fetched": 40,
              "versions_applied": 3},
             {"time": 5.0, "incarnation": "b", "step": 12, "tokens": 30, "bytes_sent": 50, "bytes_fetched": 70,
              "versions_applied": 2, "state": "finished"}]
    row = tm.learner_row(("us-0", {"heartbeats": beats, "outcomes": []}), fragments=2)
    assert (row["bytes_sent"], row["bytes_fetched"], row["versions_applied"]) == (350, 110, 5)
    assert (row["steps"], row["tokens_trained"], row["finished"]) == (12, 120, True)  # 90 + 30 tokens, step 12


def test_report_figures_match_the_events(run_report):
    out, events, rep = run_report
    want = expected_figures(events)
    assert rep["fragments"] == FRAGMENTS
    assert rep["counts"] == {"events": len(events), "malformed": 1, "other_run": 1}
    assert rep["events"] == dict(Counter(e["kind"] for e in events))
    got = {r["learner"]: r for r in rep["learners"]}
    assert set(got) == set(LEARNERS)
    for lrn, row in want["learners"].items():
        assert {k: got[lrn][k] for k in row} == row, lrn
        assert got[lrn]["region"] == LEARNERS[lrn]
    assert got["us-1"]["late"] == 1 and got["eu-1"]["goodput"] < got["us-0"]["goodput"] == 1.0
    for r in rep["regions"]:
        assert {k: r[k] for k in want["regions"][r["region"]]} == dict(want["regions"][r["region"]])
    assert rep["staleness"] == dict(want["staleness"]) == {"0": 21, "1": 1}
    lat = rep["merge_latency_s"]["all"]
    assert {k: lat[k] for k in want["latency"]} == pytest.approx(want["latency"])
    assert [(m["fragment"], m["version"]) for m in rep["merges"]] == [
        (e["fragment"], e["version"]) for e in events if e["kind"] == "merge"]
    assert {(r["reason"], r["learner"]): r["count"] for r in rep["rejections"]} == {
        ("malformed", "(unknown)"): 1, ("norm_outlier", "eu-1"): 1, ("stale", "eu-1"): 1}
    merged = sum(r["tokens_merged"] for r in want["learners"].values())
    assert rep["totals"]["rejected_unattributed"] == 1
    assert rep["totals"]["goodput"] == pytest.approx(merged / (FRAGMENTS * 4 * 3 * T))
    assert [m["members"] for m in rep["membership"]] == [0, 1, 2, 3, 4, 3, 2, 1, 0]   # joined, then finished
    # the coverage ledger: the pure function over the merge events and the learners' last beats
    from diloco import coverage
    assert rep["coverage"] == coverage.ledger(
        [e for e in events if e["kind"] == "merge"], fragments=FRAGMENTS,
        trained={lrn: r["tokens_trained"] for lrn, r in want["learners"].items()}, handed_in=dict.fromkeys(LEARNERS, 0))
    assert rep["coverage"]["totals"]["tokens_merged"] == round(merged / FRAGMENTS)


def test_report_writes_json_csv_and_plots(run_report):
    out, _, rep = run_report
    assert json.loads((out / "report.json").read_text()) == rep
    for name in ("learners", "regions", "merges", "staleness", "rejections", "loss", "coverage"):
        assert (out / f"{name}.csv").read_text().count("\n") > 1, name
    assert (out / "loss.csv").read_text().count("\n") == 1 + 4 * 3
    for name in ("loss_versions.png", "goodput.png", "bytes_by_region.png", "membership.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_export_events_reads_the_topic_to_its_high_watermark(kafka_bootstrap, tmp_path):
    from diloco.config import build_config
    from diloco.infra import kafka as kafka_io

    cfg = build_config({"transport": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": "pipelines-test"}})
    topics = kafka_io.Topics.for_run(cfg, "r1")
    kafka_io.ensure_topics(cfg.transport, {topics.events: 1})
    events = simulated_run()
    prod = kafka_io.producer(cfg.transport)
    for i, e in enumerate(events):
        prod.send(topics.events, json.dumps(e).encode(), partition=0)
        if i % 20 == 0:
            prod.flush()  # several batches, as a live run writes them
    prod.flush()
    prod.close()
    n = tm.export_events(cfg, "r1", str(tmp_path / "events.jsonl"), timeout_s=30)
    assert n == len(events)
    assert [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()] == events
