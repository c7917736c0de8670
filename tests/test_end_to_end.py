"""Tiny real runs: learner and syncer processes on the real broker, Redis and TensorStore."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_exact_accounting
from rich.console import Console

from diloco.fragments import fragments_due, syncs_through
from diloco.infra import kafka as kafka_io
from diloco.infra.jobs import LocalJobs
from diloco.infra.store import FragmentStore
from diloco.learners.data import ensure_corpus
from diloco.progress import Progress
from diloco.run import child_env, provision_run, train
from diloco.summary import dp_allreduce_bytes
from diloco.syncer import state as state_mod

pytestmark = pytest.mark.integration


def test_tiny_run_trains_and_accounts_for_every_contribution(tiny_config, tmp_path):
    # Steps stretched (~30 ms): the run outlasts a merge round trip (accept, merge, write, announce,
    # fetch: ~0.4 s here), so learners read new versions while they train, as the bytes check needs.
    # At full speed 80 tiny steps take 0.6 s and a loaded machine can finish before the first merge.
    # The demo's outer step (plain averaging, rebase): with the defaults' Nesterov 0.9 this tiny run's
    # ~20 outer steps per fragment diverge (docs/bench.md, issue #21).
    cfg = tiny_config(regions=[{"name": "us", "learners": 2, "speed": 0.25}, {"name": "eu", "learners": 2, "speed": 0.25}],
                      outer={"lr": 1.0, "momentum": 0.0},
                      syncer={"scale_partial_rounds": True}, fragments={"apply": "rebase", "fetch": "before_sync"})
    summary = train(cfg, summary_json=tmp_path / "summary.json", progress=False, console=Console(quiet=True))
    assert summary["eval_loss_end"] < 0.9 * summary["eval_loss_start"]
    c = summary["contributions"]
    assert c["applied_twice"] == 0 and c["rejected"] == 0 and c["pending"] == 0
    assert c["published"] == c["applied"] == c["accepted"] > 0
    assert all(v > 0 for v in map(int, summary["versions"].values()))
    assert summary["tokens"] == cfg.num_learners * cfg.inner.steps * cfg.inner.batch_size * cfg.model.transformer.seq_len
    assert summary["bytes_dp_equivalent"] == dp_allreduce_bytes(summary["params"], 4, summary["inner_steps"])
    assert 0 < summary["bytes_sent"] < summary["bytes_dp_equivalent"]
    # learners start from their own init (version 0, checked by digest: nothing read), then fetch int8
    # updates, ~1/4 of each version whole
    whole, L = 4 * summary["params"], cfg.num_learners
    every_version = L * sum(map(int, summary["versions"].values())) * whole / cfg.fragments.count
    assert 0 < summary["bytes_fetched"] < 0.5 * every_version
    # each learner fetches a fragment once per sync period (fragments.fetch: before_sync), one update
    # from the snapshot however many versions came between: downloads about match the uploads
    # (int8 both ways), where fetching every version cost ~2x (docs/bench.md)
    assert summary["bytes_fetched"] < 1.3 * summary["bytes_sent"], (summary["bytes_fetched"], summary["bytes_sent"])
    assert summary["bytes_across"] == summary["bytes_sent"] + summary["bytes_fetched"]
    # the coverage ledger: every token trained reached the global model once, none twice or lost, and
    # each learner's cursor reached its last step (the shard read without replacement, part of an epoch)
    cov = summary["coverage"]
    assert cov["totals"]["tokens_twice"] == 0 and cov["totals"]["tokens_lost"] == 0, cov
    assert cov["totals"]["tokens_merged"] == cov["totals"]["tokens_handed_in"] == summary["tokens"]
    for row in cov["learners"].values():
        assert row["cursor_end"] == cfg.inner.steps and row["without_cursor"] == 0 and 0 < row["epoch"] < 1, row
    state, published, _ = assert_exact_accounting(cfg, summary["run_id"])
    assert len(published) == c["published"]
    # the syncer heard every learner's heartbeats (liveness, step times for the grace window)
    registry = state.registry()
    assert set(registry) == set(cfg.learner_ids()) and all(r.get("step_time", 0) > 0 for r in registry.values())
    assert (tmp_path / "summary.json").is_file()


def test_a_signed_run_trains_and_every_frame_carries_its_learners_own_signature(tiny_config, monkeypatch):
    """run.signing_secret_env set: the runner writes each learner its own key, the learners sign every
    frame, the syncer accepts them all; read back from the log, each record's signer is the learner
    its contribution names and its signature holds under that learner's key alone."""
    from kafka import TopicPartition

    from diloco import messages, signing
    from diloco.infra import kafka as kafka_io

    monkeypatch.setenv("DILOCO_TEST_RUN_SECRET", "a run's secret")
    cfg = tiny_config(regions=[{"name": "us", "learners": 1}, {"name": "eu", "learners": 1}],
                      run={"signing_secret_env": "DILOCO_TEST_RUN_SECRET"}, inner={"steps": 40})
    summary = train(cfg, progress=False, console=Console(quiet=True))
    c = summary["contributions"]
    assert c["published"] == c["applied"] == c["accepted"] > 0 and c["rejected"] == 0
    run_id = summary["run_id"]
    keys = {lid: signing.learner_key(b"a run's secret", run_id, lid) for lid in cfg.learner_ids()}
    assert all(signing.read_key(signing.key_path(cfg.keys_dir(run_id), lid)) == k for lid, k in keys.items())
    topics = kafka_io.Topics.for_run(cfg, run_id)
    consumer = kafka_io.consumer(cfg.transport)
    try:
        tps = [TopicPartition(t, p) for t in topics.fragments.values() for p in range(topics.partitions)]
        records = _records(consumer, tps)
    finally:
        consumer.close()
    manifests = 0
    for rec in records:
        signer = signing.signer_of(rec.headers, rec.value, keys.get)   # raises unless it holds
        header, _ = messages.parse_frame(rec.value)
        if header["kind"] == "manifest":
            manifests += 1
            assert header["learner"] == signer
        sig = dict(rec.headers)[signing.SIGNATURE_HEADER]
        assert all(signing.sign(k, rec.value) != sig for lid, k in keys.items() if lid != signer)
    assert manifests == c["published"]


def _records(consumer, tps):
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    ends, out = consumer.end_offsets(tps), []
    deadline = time.time() + 30
    while any(consumer.position(tp) < ends[tp] for tp in tps):
        assert time.time() < deadline, "the region topics were not read to their ends"
        for batch in consumer.poll(timeout_ms=500).values():
            out.extend(batch)
    return out


def test_a_learner_ahead_sends_one_delta_per_version_and_every_token_is_merged(tiny_config):
    """fragments.one_delta_per_version: every learner waited for (K = M) and eu at half us's speed, so
    us is due again before the version it sent from has moved on. It holds that delta, training on,
    and sends it once the next version is applied: no two of its deltas of a fragment come from one
    version (the hand-in at the end aside), it sends fewer deltas than it has sync points, and every
    token trained is in some merge."""
    # 240 steps: the tiny model's steps take a few ms, and us must still train when the first merges
    # (which wait for eu) come back (80 steps were over in 0.7 s, before its first fetch had returned)
    cfg = tiny_config(regions=[{"name": "us", "learners": 1, "speed": 0.5}, {"name": "eu", "learners": 1, "speed": 0.25}],
                      outer={"lr": 1.0, "momentum": 0.0}, fragments={"apply": "rebase", "one_delta_per_version": True},
                      syncer={"quorum": 2, "scale_partial_rounds": True}, inner={"steps": 240})
    summary = train(cfg, progress=False, console=Console(quiet=True))
    c = summary["contributions"]
    assert c["applied_twice"] == 0 and c["rejected"] == 0 and c["pending"] == 0 and c["published"] == c["applied"]
    store = FragmentStore(cfg.store.url, summary["run_id"])
    bases = {(lrn, p): [] for lrn in cfg.learner_ids() for p in range(cfg.fragments.count)}
    for p in range(cfg.fragments.count):
        merged_tokens = 0
        for v in sorted(store.versions(p))[1:]:
            meta = store.read_meta(p, v)
            merged_tokens += meta["tokens"]
            for lrn, base in zip(meta["learners"], meta["base_versions"]):
                bases[(lrn, p)].append(base)
        assert merged_tokens == summary["tokens"]  # held steps travel in a later delta; none is lost
    # a learner holds a delta HOLD_PERIODS sync periods at most (eu may start seconds after us) and says so
    log = (Path(summary["run_dir"]) / "logs" / "us-0.log").read_text(errors="replace").splitlines()
    capped = Counter(json.loads(line)["fragment"] for line in log if "held too long; sending anyway" in line)
    applied = [json.loads(line) for line in log if '"msg": "applied"' in line]  # each version once, in order
    for p in range(cfg.fragments.count):
        versions = [a["version"] for a in applied if a["fragment"] == p]
        assert versions == sorted(set(versions)), f"fragment {p}: applied {versions}"
    # (with K = M a fragment moves only once eu, which may start seconds later, sent its delta: on a
    # loaded machine us-0 can finish before the last fragment's first merge, so not every fragment)
    assert applied, "us-0 applied no version at all"
    assert all(a["steps_since_send"] >= 0 for a in applied)
    for p in range(cfg.fragments.count):
        held = bases[("us-0", p)][:-1]  # the last is the hand-in, from whatever version it ended on
        assert held == sorted(held) and len(held) - len(set(held)) <= capped[p], (
            f"fragment {p}: us-0 sent two deltas from one version: {bases[('us-0', p)]}")
    # without the hold a learner sends at every sync point plus a hand-in of the steps after the last
    # one; us, twice eu's speed, must hold some of them. (Not "fewer than eu": eu holds too while it
    # trains before us has started or after us has finished, and the two counts may then tie.)
    P, H, S = cfg.fragments.count, cfg.fragments.sync_every, cfg.inner.steps
    unheld = sum(syncs_through(S, p, P, H) + (p not in fragments_due(S, P, H)) for p in range(P))
    sent = {lrn: sum(len(bases[(lrn, p)]) for p in range(P)) for lrn in ("us-0", "eu-0")}
    assert sent["us-0"] < unheld and sent["eu-0"] <= unheld, (sent, unheld)


@pytest.mark.parametrize("consumer", ["kafka-python", "librdkafka"])
def test_syncer_killed_mid_run_resumes_and_applies_nothing_twice(tiny_config, tmp_path, consumer):
    """On either client the syncer reads with (syncer.consumer): the restarted shard seeks to the
    offsets Redis kept and reads on from there."""
    cfg = tiny_config(inner={"steps": 160}, fragments={"count": 4, "sync_every": 8, "chunk_bytes": 2048},
                      syncer={"consumer": consumer})
    run_id = f"kill-{time.time_ns() % 10**8}"
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})
    (tmp_path / "config.yaml").write_text(__import__("diloco.config", fromlist=["dump_config"]).dump_config(cfg))
    corpus = ensure_corpus(cfg.data.corpus, cfg.data.dir, learners=4, heldout_fraction=cfg.data.heldout_fraction,
                           max_bytes=cfg.data.max_corpus_bytes, seed=0)
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    producer = kafka_io.producer(cfg.transport)
    provision_run(cfg, run_id, state=state)
    producer.close()
    jobs, conf = LocalJobs(tmp_path / "logs", child_env(cfg)), str(tmp_path / "config.yaml")
    jobs.start("syncer-1", ["syncer", "--config", conf])
    for lid in cfg.learner_ids():
        jobs.start(lid, ["learner", "--config", conf, "--learner", lid, "--corpus", str(corpus.dir)])
    try:
        deadline = time.time() + 300
        while state.counters().get("merges", 0) < 4:
            assert time.time() < deadline and jobs.poll("syncer-1") is None, jobs.tail("syncer-1", 40)
            time.sleep(0.05)
        jobs.signal("syncer-1", signal.SIGKILL)             # mid-run, wherever it is
        jobs.wait("syncer-1")
        killed_at = dict(state.versions())
        time.sleep(1.0)                                       # learners keep publishing meanwhile
        jobs.start("syncer-2", ["syncer", "--config", conf])
        while "syncer started" not in jobs.jobs["syncer-2"].log.read_text():  # SIGTERM before that just kills it
            assert time.time() < deadline and jobs.poll("syncer-2") is None, jobs.tail("syncer-2", 40)
            time.sleep(0.1)
        for lid in cfg.learner_ids():
            assert jobs.wait(lid, timeout=300) == 0, jobs.tail(lid)
        jobs.signal("syncer-2", signal.SIGTERM)
        assert jobs.wait("syncer-2", timeout=120) == 0, jobs.tail("syncer-2", 40)
    finally:
        jobs.stop_all()
    state, published, status = assert_exact_accounting(cfg, run_id)
    assert all(state.versions()[p] > killed_at[p] for p in killed_at)   # every fragment kept advancing
    assert Counter(s.split(":")[0] for s in status.values()) == {"applied": len(published)}


def test_gcs_store_round_trips_through_the_emulator(gcs_emulator):
    store = FragmentStore(gcs_emulator + "/runs", "gcs-run")
    rng = np.random.default_rng(0)
    params = {"layer0.qkv": rng.normal(size=(16, 48)).astype(np.float32), "ln_f": np.ones(16, np.float32)}
    opt = {"0.trace.layer0.qkv": rng.normal(size=(16, 48)).astype(np.float32), "0.trace.ln_f": np.zeros(16, np.float32)}
    store.write(2, 0, params, opt, {"tokens": 0})
    store.write(2, 1, {k: v + 1 for k, v in params.items()}, opt, {"tokens": 123})
    assert store.versions(2) == [0, 1] and store.versions(0) == []
    got = FragmentStore(gcs_emulator + "/runs", "gcs-run").read(2, 1)
    assert got.meta["tokens"] == 123 and got.meta["version"] == 1
    for k in params:
        np.testing.assert_array_equal(got.params[k], params[k] + 1)
        np.testing.assert_array_equal(got.opt["0.trace." + k], opt["0.trace." + k])


def test_bytes_fetched_and_tokens_add_up_over_a_learners_incarnations():
    prog = Progress()
    beat = lambda eid, inc, step, fetched: {"kind": "heartbeat", "eid": eid, "learner": "us-0",  # noqa: E731
                                            "incarnation": inc, "step": step, "bytes_fetched": fetched,
                                            "tokens": 10 * (step - (15 if inc == "two" else 0))}  # each counts from 0
    for ev in (beat("a", "one", 10, 100), beat("b", "one", 20, 300), beat("c", "two", 15, 50),
               beat("d", "one", 21, 320), beat("e", "two", 30, 90), beat("e", "two", 30, 90)):
        prog.apply(ev)  # "d": a late beat of the killed incarnation; "e" twice: delivered again
    assert prog.fetched == {("us-0", "one"): 320, ("us-0", "two"): 90}
    assert prog.learners["us-0"]["incarnation"] == "two"
    assert prog.tokens() == 210 + 150  # every incarnation's tokens (the summary's and run.token_budget's count)


def test_a_run_on_the_codecs_below_4_bits_trains_and_accounts_for_every_contribution(tiny_config, tmp_path):
    """topk deltas up (8 of every 256 values, error buffered on the learner) and int2 updates down (each
    from the version before, the syncer's residual carried): the syncer accepts every one of them,
    nothing is applied twice or lost, the run still learns, and learners send about a thirteenth of
    what int8 deltas would take."""
    cfg = tiny_config(regions=[{"name": "us", "learners": 1, "speed": 0.25}, {"name": "eu", "learners": 1, "speed": 0.25}],
                      outer={"lr": 1.0, "momentum": 0.0}, syncer={"scale_partial_rounds": True, "broadcast": "int2"},
                      fragments={"apply": "rebase", "quantization": "topk"})
    assert cfg.syncer.updates_from == "previous"
    summary = train(cfg, progress=False, console=Console(quiet=True))
    assert summary["eval_loss_end"] < 0.95 * summary["eval_loss_start"]
    c = summary["contributions"]
    assert c["applied_twice"] == 0 and c["rejected"] == 0 and c["pending"] == 0
    assert c["published"] == c["applied"] == c["accepted"] > 0
    assert_exact_accounting(cfg, summary["run_id"])
    store = FragmentStore(cfg.store.url, summary["run_id"])
    newest = {int(p): int(v) for p, v in summary["versions"].items()}[0]
    meta = store.read_meta(0, newest)
    assert meta["update"]["scheme"] == "int2" and meta["update"]["from"] == newest - 1
    # per contribution: topk's 20 bytes per 256 values against int8's ~256, plus frame headers
    per_delta = summary["bytes_sent"] / c["published"]
    assert per_delta < 0.2 * summary["params"] / cfg.fragments.count, (per_delta, summary["params"])
