"""Tiny real runs: learner and syncer processes on the real broker, Redis and TensorStore."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import numpy as np
import pytest
from rich.console import Console

from diloco import messages
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore
from diloco.learners.data import ensure_corpus
from diloco.run import _child_env, _spawn, dp_allreduce_bytes, train
from diloco.syncer import state as state_mod
from diloco.syncer.syncer import provision

pytestmark = pytest.mark.integration


def published_manifests(cfg, run_id) -> list[messages.Manifest]:
    """Every contribution manifest on the region topics, read straight from the broker."""
    topics = kafka_io.Topics.for_run(cfg, run_id)
    tps = [tp for t in topics.fragments.values() for tp in kafka_io.partitions_of(t, topics.partitions)]
    out = []
    for rec in kafka_io.read_to_end(cfg.transport, tps):
        header, _ = messages.parse_frame(rec.value)
        if header["kind"] == "manifest":
            out.append(messages.Manifest.from_header(header))
    return out


def run_events(cfg, run_id) -> list[dict]:
    topics = kafka_io.Topics.for_run(cfg, run_id)
    return [messages.parse_event(r.value) for r in kafka_io.read_to_end(cfg.transport, kafka_io.partitions_of(topics.events, 1))]


def assert_exact_accounting(cfg, run_id):
    """Every published contribution is applied once, or rejected once, or still pending; nothing else."""
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    published = {m.id for m in published_manifests(cfg, run_id)}
    status = state.snapshot(cfg.fragments.count).status
    assert set(status) == published
    merged = [cid for m in state.merges() for cid in m["ids"]]
    assert len(merged) == len(set(merged)), "a contribution entered two merges"
    applied = {cid for cid, s in status.items() if s.startswith("applied")}
    assert set(merged) == applied
    events = list({e["eid"]: e for e in run_events(cfg, run_id)}.values())  # delivered at least once
    ev_merged = [cid for e in events if e["kind"] == "merge" for cid in e["ids"]]
    ev_rejected = [e["id"] for e in events if e["kind"] == "contribution_rejected" and e["id"]]
    assert Counter(ev_merged) == Counter(merged)                   # events tell the same story, once each
    assert set(ev_rejected) == {cid for cid, s in status.items() if s.startswith("rejected")}
    # versions: Redis and TensorStore agree, with one complete TensorStore version per merge
    store = FragmentStore(cfg.store.url, run_id)
    counts = Counter(m["fragment"] for m in state.merges())
    for p, v in state.versions().items():
        assert v == counts[p]
        assert store.versions(p) == list(range(v + 1))
    return state, published, status


def test_tiny_run_trains_and_accounts_for_every_contribution(tiny_config, tmp_path):
    cfg = tiny_config()
    summary = train(cfg, summary_json=tmp_path / "summary.json", progress=False, console=Console(quiet=True))
    assert summary["eval_loss_end"] < 0.9 * summary["eval_loss_start"]
    c = summary["contributions"]
    assert c["applied_twice"] == 0 and c["rejected"] == 0 and c["pending"] == 0
    assert c["published"] == c["applied"] == c["accepted"] > 0
    assert all(v > 0 for v in map(int, summary["versions"].values()))
    assert summary["tokens"] == cfg.num_learners * cfg.inner.steps * cfg.inner.batch_size * cfg.model.seq_len
    assert summary["bytes_dp_equivalent"] == dp_allreduce_bytes(summary["params"], 4, summary["inner_steps"])
    assert 0 < summary["bytes_sent"] < summary["bytes_dp_equivalent"]
    _, published, _ = assert_exact_accounting(cfg, summary["run_id"])
    assert len(published) == c["published"]
    assert (tmp_path / "summary.json").is_file()


def test_syncer_killed_mid_run_resumes_and_applies_nothing_twice(tiny_config, tmp_path):
    cfg = tiny_config(inner={"steps": 160}, fragments={"count": 4, "sync_every": 8, "chunk_bytes": 2048})
    run_id = f"kill-{time.time_ns() % 10**8}"
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})
    (tmp_path / "config.yaml").write_text(__import__("diloco.config", fromlist=["dump_config"]).dump_config(cfg))
    corpus = ensure_corpus(cfg.data.corpus, cfg.data.dir, learners=4, heldout_fraction=cfg.data.heldout_fraction,
                           max_bytes=cfg.data.max_corpus_bytes, seed=0)
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    producer = kafka_io.producer(cfg.transport)
    provision(cfg, run_id, state=state, store=FragmentStore(cfg.store.url, run_id), producer=producer)
    producer.close()
    env, logs, conf = _child_env(cfg), tmp_path / "logs", str(tmp_path / "config.yaml")
    syncer = _spawn(["syncer", "--config", conf], logs / "syncer-1.log", env)
    learners = [_spawn(["learner", "--config", conf, "--learner", lid, "--corpus", str(corpus.dir)],
                       logs / f"{lid}.log", env) for lid in cfg.learner_ids()]
    try:
        deadline = time.time() + 300
        while state.counters().get("merges", 0) < 4:
            assert time.time() < deadline and syncer.poll() is None, (logs / "syncer-1.log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(syncer.pid, signal.SIGKILL)                   # mid-run, wherever it is
        syncer.wait()
        killed_at = dict(state.versions())
        time.sleep(1.0)                                       # learners keep publishing meanwhile
        syncer = _spawn(["syncer", "--config", conf], logs / "syncer-2.log", env)
        while "syncer started" not in (logs / "syncer-2.log").read_text():  # SIGTERM before that just kills it
            assert time.time() < deadline and syncer.poll() is None, (logs / "syncer-2.log").read_text()[-3000:]
            time.sleep(0.1)
        for p in learners:
            assert p.wait(timeout=300) == 0
        syncer.send_signal(signal.SIGTERM)
        assert syncer.wait(timeout=120) == 0, (logs / "syncer-2.log").read_text()[-3000:]
    finally:
        for p in [syncer, *learners]:
            if p.poll() is None:
                p.kill()
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
