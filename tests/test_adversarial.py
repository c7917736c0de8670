"""A live run under attack: a plain Kafka client writes every hostile class the syncer and the learners
must contain to the run's own topics while it trains. The run must finish with no process restarted,
a finite falling loss, every honest contribution applied exactly once and every hostile one rejected."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import numpy as np
import pytest
from helpers import assert_exact_accounting
from kafka import KafkaProducer
from rich.console import Console

from diloco import messages
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore
from diloco.ops.topics import TopicMonitor
from diloco.run import train
from diloco.syncer import state as state_mod

pytestmark = pytest.mark.integration

NESTED = b"[" * 100_000 + b"]" * 100_000


def _contribution(run, fragment, shapes, *, learner="us-1", region="us", tokens=640, steps=10, fill=None, **kw):
    """A well-formed contribution of the run's real shapes (or others), as a learner would send it."""
    rng = np.random.default_rng(fragment)
    deltas = {n: (np.full(s, fill, np.float32) if fill is not None else 1e-3 * rng.normal(size=s).astype(np.float32))
              for n, s in shapes.items()}
    m, frames = messages.encode_contribution(run=run, learner=learner, region=region, fragment=fragment, base_version=0,
                                             tokens=tokens, steps=steps, step_time=0.01, deltas=deltas, scheme="fp32",
                                             chunk_bytes=4096, **kw)
    return m, frames


def _header(frame: bytes) -> dict:
    return messages.parse_frame(frame)[0]


def _attack(cfg, run_id: str, shapes: dict[int, dict[str, tuple]]) -> dict[str, str]:
    """Every hostile class, sent with a plain client. Returns the ids it used with the reason each must get."""
    topics = kafka_io.Topics.for_run(cfg, run_id)
    kp = KafkaProducer(bootstrap_servers=cfg.transport.bootstrap_servers, max_request_size=16 << 20)
    us, expect = topics.fragments["us"], {}

    def send(frames, fragment=0, topic=us, partition=None):
        for f in frames:
            kp.send(topic, f, partition=topics.partition_of(fragment) if partition is None else partition)

    def contribution(reason, fragment=0, frames_filter=None, **kw):
        m, frames = _contribution(run_id, fragment, kw.pop("shapes", shapes[fragment]), **kw)
        send(frames_filter(frames) if frames_filter else frames, fragment)
        expect[m.id] = reason
        return m, frames

    contribution("bad_metadata", tokens=10 ** 309)                    # OverflowError before
    contribution("bad_metadata", tokens=10 ** 200, steps=10 ** 199)   # NaN weights before
    contribution("bad_metadata", tokens=10 ** 9, steps=1)             # more tokens per step than allowed
    contribution("norm_budget", fill=1e30)                            # huge but finite
    contribution("non_finite", fill=float("nan"))
    contribution("unknown_learner", learner="us-9")
    contribution("unknown_learner", learner="eu-0", region="us")      # not that region's
    contribution("misrouted", learner="eu-0", region="eu")            # eu's learner, written on us's topic
    m, frames = _contribution("another-run", 0, shapes[0])
    send(frames)
    expect[m.id] = "wrong_run"
    contribution("wrong_shape", shapes={n: (3,) for n in shapes[0]})
    m, frames = _contribution(run_id, 1, shapes[1])                   # fragment 1's deltas on fragment 0's partition
    send(frames, fragment=0)
    expect[m.id] = "misrouted"
    m, frames = _contribution(run_id, 0, shapes[0])
    send(frames[:-1])                                                 # its last chunk never comes
    expect[m.id] = "incomplete"
    m, frames = _contribution(run_id, 0, shapes[0])
    chunk = messages.parse_frame(frames[1])[1]
    send([frames[0], messages.frame(_header(frames[1]), bytes(len(chunk))), *frames[2:]])   # a chunk altered
    expect[m.id] = "checksum"
    m, frames = _contribution(run_id, 0, shapes[0])
    send([messages.frame(_header(frames[0]) | {"id": "x" * 65}), *frames[1:]])         # an id too long
    for i in range(200):                                              # invented ids, empty and bogus chunks
        send([messages.frame({"kind": "chunk", "id": f"junk-{i}", "index": 0, "count": 1 << 30}, b"")])
        expect[f"junk-{i}"] = "malformed"
    send([b"DLCO\x01\x00" + (200).to_bytes(4, "little") + NESTED[:100] + NESTED[-100:],   # deeply nested header
          b"\x00" * 64, b"DLCO" + b"\xff" * 10])                      # garbage
    # events: heartbeats with the wrong types, deeply nested JSON, a syncer_started of a shard that is not
    for ev in ({"step_time": "fast"}, {"step": [1, 2]}, {"at": 10 ** 400}, {"loss": float("inf")}):
        kp.send(topics.events, json.dumps({"schema": 1, "kind": "heartbeat", "eid": f"bad-{len(expect)}-{list(ev)[0]}",
                                           "time": time.time(), "run": run_id, "learner": "us-0", **ev},
                                          default=str).encode(), partition=0)
    kp.send(topics.events, NESTED, partition=0)
    kp.send(topics.events, messages.event("syncer_started", run=run_id, shard=99, versions={"x": "y"}), partition=0)
    kp.send(topics.events, messages.event("heartbeat", run=run_id, learner=["us-0"], step=1), partition=0)
    # announcements: wrong types, nested, a version far ahead of what was committed
    for value in (messages.event("version", run=run_id, fragment=0, version="7"),
                  messages.event("version", run=run_id, fragment=0, version="seven"),
                  messages.event("version", run=run_id, fragment=2, version=10 ** 6),
                  messages.event("version", run=run_id, fragment=-1, version=1), NESTED):
        kp.send(topics.outer, value, partition=0)
    kp.flush()
    kp.close()
    return expect


def test_a_live_run_under_attack_finishes_clean(tiny_config, tmp_path):
    run_id = f"attack-{time.time_ns() % 10**8}"
    cfg = tiny_config(run={"id": run_id}, inner={"steps": 160},
                      regions=[{"name": "us", "learners": 2, "speed": 0.25}, {"name": "eu", "learners": 2, "speed": 0.25}],
                      outer={"lr": 1.0, "momentum": 0.0}, fragments={"apply": "rebase"},
                      syncer={"scale_partial_rounds": True, "max_tokens_per_step": 4096, "max_staleness": 16,
                              "incomplete_timeout_s": 3.0})
    result = {}
    runner = threading.Thread(target=lambda: result.update(s=train(cfg, progress=False, console=Console(quiet=True))))
    runner.start()
    try:
        r = state_mod.connect(cfg.state)
        key = state_mod.run_prefix(cfg.state.key_prefix, run_id) + "merges"
        deadline = time.time() + 300
        while r.llen(key) < 4:                                        # mid-run: the syncer is merging
            assert time.time() < deadline and runner.is_alive(), "the run did not get to its first merges"
            time.sleep(0.1)
        plan = FragmentStore(cfg.store.url, run_id).read_plan()
        shapes = {p: {n: tuple(plan.shapes[n]) for n in names} for p, names in enumerate(plan.fragment_names)}
        expect = _attack(cfg, run_id, shapes)
    finally:
        runner.join(timeout=900)
    s = result["s"]
    assert not s.get("restarts"), s.get("restarts")                   # no process fell over
    assert np.isfinite(s["eval_loss_end"]) and s["eval_loss_end"] < 0.9 * s["eval_loss_start"]
    state, published, status = assert_exact_accounting(cfg, run_id)
    got = {cid: status.get(cid, "") for cid in expect}
    assert {cid: f"rejected:{why}" for cid, why in expect.items()} == got
    honest = published - set(expect)
    assert honest and Counter(status[cid].split(":")[0] for cid in honest) == {"applied": len(honest)}
    c = s["contributions"]
    assert c["applied_twice"] == 0 and c["pending"] == 0 and c["unread"] == 0   # forged ids are not "unread"
    assert state.counters().get("bad_events", 0) >= 4                 # the malformed heartbeats, counted
    for p in range(cfg.fragments.count):                              # the global stayed finite
        params, _ = FragmentStore(cfg.store.url, run_id).read_params(p, state.versions()[p])
        assert all(np.all(np.isfinite(a)) for a in params.values())
    monitor = TopicMonitor(cfg, run_id)                               # `diloco topics` reads the same log
    try:
        totals = monitor.sample()["partitions"]
    finally:
        monitor.close()
    topics = kafka_io.Topics.for_run(cfg, run_id)
    assert totals[f"{topics.fragments['us']}|0"]["malformed"] >= 3 and totals[f"{topics.outer}|0"]["malformed"] >= 2
