"""Only committed versions count, and a Redis that lost acknowledged writes is refused, then repaired
from the store: the syncer in-process and the CLI against the real broker, Redis and TensorStore."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from helpers import Harness, assert_exact_accounting
from typer.testing import CliRunner

from diloco.checkpoint import latest_versions
from diloco.cli import app
from diloco.config import dump_config
from diloco.flows.evals import read_versions
from diloco.syncer.durability import EXIT_STATE_LOST, StateLost
from diloco.syncer.provision import provision

pytestmark = pytest.mark.integration
cli = CliRunner()


class Crash(BaseException):
    """The syncer process dying at that point (a SIGKILL): nothing after it runs."""


@pytest.fixture
def run(tiny_config, tmp_path, request):
    """(harness of a provisioned run, its config.yaml with run.id)."""
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "norm_outlier_factor": 0})
    run_id = f"dur-{request.node.name[5:25].replace('_', '-')}-{time.time_ns() % 10**6}"
    h = Harness(cfg, run_id)
    conf = tmp_path / "config.yaml"
    conf.write_text(dump_config(cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})))
    yield h, conf
    h.producer.close()


def invoke(*args, code=0):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        res = cli.invoke(app, list(map(str, args)))
    finally:  # `diloco syncer` points the root logger at the runner's stream, closed afterwards
        root.handlers[:], root.level = handlers, level
    assert res.exit_code == code, res.output
    return res


def test_an_orphan_version_is_never_taken_as_committed(run, monkeypatch):
    h, conf = run
    h.rounds(2)
    assert h.store.read_committed(0) == 2

    def crash(*_, **__):
        raise Crash()
    monkeypatch.setattr(h.state, "commit_merge", crash)  # dies between the store write and the Redis commit
    for learner in ("us-0", "eu-0"):
        h.publish(learner, 0, base_version=2)
    with pytest.raises(Crash):
        h.pump(lambda: False)
    monkeypatch.undo()
    assert h.store.versions(0) == [0, 1, 2, 3] and h.state.versions()[0] == 2   # v3: an orphan

    assert latest_versions(h.store, h.run_plan) == {0: 2, 1: 0, 2: 0, 3: 0}
    run_cfg = h.cfg.model_copy(update={"run": h.cfg.run.model_copy(update={"id": h.run_id})})
    assert read_versions.fn(run_cfg) == [2, 0, 0, 0]                            # what evals measure
    ls = json.loads(invoke("ckpt", "ls", h.store.url, "--json").stdout)
    assert ls["fragments"][0]["latest"] == 2
    assert [(v["version"], v["committed"]) for v in ls["fragments"][0]["versions"]] == \
        [(0, True), (1, True), (2, True), (3, False)]
    root = h.store.url.rsplit("/", 1)[0]
    assert json.loads(invoke("ckpt", "ls", root, "--json").stdout)["runs"][0]["latest"] == \
        {"0": 2, "1": 0, "2": 0, "3": 0}
    assert "* not committed: an orphan" in invoke("ckpt", "ls", h.store.url).stdout
    export = json.loads(invoke("ckpt", "export", h.store.url, "-o", conf.parent / "m.npz", "--json").stdout)
    assert export["versions"] == {"0": 2, "1": 0, "2": 0, "3": 0}
    shown = json.loads(invoke("ckpt", "show", h.store.url, "--version", 2, "--json").stdout)
    assert [(f["version"], f["committed"]) for f in shown["fragments"]] == [(2, True)] + [(0, True)] * 3
    assert "no fragment has version 3 committed (newest committed: p0:v2" in \
        invoke("ckpt", "export", h.store.url, "--version", 3, "-o", conf.parent / "x.npz", code=1).output
    [orphan] = json.loads(invoke("ckpt", "show", h.store.url, "-p", 0, "--version", 3, "--json").stdout)["fragments"]
    assert orphan["version"] == 3 and orphan["committed"] is False
    assert "not committed" in invoke("ckpt", "show", h.store.url, "-p", 0, "--version", 3).stdout
    [d] = json.loads(invoke("ckpt", "diff", h.store.url, 2, 3, "-p", 0, "--json").stdout)["fragments"]
    assert d["committed"] == {"from": True, "to": False}

    # the next owner takes the fragment at Redis's version (one orphan above it is what a crash leaves),
    # merges the round again and overwrites the orphan; only then does v3 count
    h.syncer = h.new_syncer()
    h.pump(lambda: h.state.versions()[0] == 3)
    assert h.store.read_committed(0) == 3 and latest_versions(h.store, h.run_plan)[0] == 3


def test_a_redis_that_lost_writes_is_refused_and_repaired_from_the_store(run):
    h, conf = run
    merged = h.rounds(3) + h.rounds(1, fragment=1)
    pending = h.publish("us-0", 2)                                # accepted into fragment 2's round
    h.pump(lambda: h.state.statuses().get(pending.id) == "pending:2")
    h.syncer.save_offsets(force=True)
    h.syncer.consumer.close()                                     # stopped (as if SIGKILLed)
    before = h.state.merges()
    k = h.state.k

    # the merge record of the version Redis holds names other ids than the store: refused
    record = json.loads(h.state.r.lindex(k + "merges", 2))
    h.state.r.lset(k + "merges", 2, json.dumps(record | {"ids": ["someone-else"]}))
    with pytest.raises(StateLost, match=f"run {h.run_id}: fragment 0 version 3: the store merged ids"):
        h.new_syncer()
    h.state.r.lset(k + "merges", 2, json.dumps(record))

    # Redis lost the last two commits of fragment 0 (appendfsync everysec): the syncer refuses, and
    # `diloco syncer` exits with the message instead of going on
    h.state.r.hset(k + "version", "0", 1)
    with pytest.raises(StateLost, match="fragment 0 is at version 1 in Redis, but the store's commit marker says "
                                        "version 3 was committed"):
        h.new_syncer()
    marker = Path(h.store.url.removeprefix("file://")) / "fragments/000/committed.json"
    kept = marker.read_bytes()
    marker.unlink()                                               # no marker: the stored versions still tell
    with pytest.raises(StateLost, match="fragment 0 is at version 1 in Redis, but the store holds version 3"):
        h.new_syncer()
    marker.write_bytes(kept)
    res = invoke("syncer", "--config", conf, code=EXIT_STATE_LOST)
    assert f"run {h.run_id}: fragment 0 is at version 1 in Redis" in res.output
    assert f"diloco state repair --config CONFIG --run {h.run_id}" in " ".join(res.output.split())
    assert "Traceback" not in res.output

    # then Redis lost the run altogether: the syncer refuses, and so does provisioning again, which
    # would overwrite version 0
    for key in h.state.r.scan_iter(k + "*"):
        h.state.r.delete(key)
    with pytest.raises(StateLost, match="the store committed"):
        h.new_syncer()
    v0 = h.store.read_meta(0, 0)
    with pytest.raises(StateLost, match="provisioning again would overwrite version 0"):
        provision(h.cfg, h.run_id, state=h.state, store=h.store, producer=h.producer, plan=h.run_plan,
                  initial=h.params)
    assert h.store.read_meta(0, 0) == v0 and h.state.versions() == {}

    # the repair: refused while a shard is live, shown with --dry-run, then done
    h.state.join(0, "0:still-running", ttl_s=30)
    assert "are live; stop every shard" in invoke("state", "repair", "--config", conf, code=1).output
    h.state.leave(0, "0:still-running")
    plan = json.loads(invoke("state", "repair", "--config", conf, "--dry-run", "--json").stdout)
    assert h.state.versions() == {}                               # --dry-run changes nothing
    assert [(f["fragment"], f["redis_version"], f["version"], f["applied"]) for f in plan["fragments"]] == \
        [(0, None, 3, 6), (1, None, 1, 2), (2, None, 0, 0), (3, None, 0, 0)]
    assert "repaired the Redis state" in invoke("state", "repair", "--config", conf).stdout
    assert h.state.versions() == {0: 3, 1: 1, 2: 0, 3: 0}
    assert h.state.statuses() == {cid: f"applied:{m['fragment']}:{m['version']}" for m in before for cid in m["ids"]}
    assert sorted(h.state.merges(), key=lambda m: (m["fragment"], m["version"])) == \
        sorted(before, key=lambda m: (m["fragment"], m["version"]))

    # the syncer starts, re-reads the topics from their start: what was applied is dropped as a
    # duplicate, the pending contribution is judged again, and merging goes on with nothing applied twice
    h.syncer = h.new_syncer()
    h.pump(lambda: h.state.statuses().get(pending.id) == "pending:2" and
           h.state.counters().get("duplicate_records", 0) >= len(merged))
    h.publish("eu-1", 2)
    h.pump(lambda: h.state.versions()[2] == 1)
    h.rounds(1)
    assert h.state.versions() == {0: 4, 1: 1, 2: 1, 3: 0}
    h.syncer.outbox.relay()
    _, published, status = assert_exact_accounting(h.cfg, h.run_id)
    assert set(status.values()) <= {f"applied:{p}:{v}" for p in range(4) for v in range(1, 5)}
