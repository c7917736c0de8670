"""Only committed versions count: the syncer in-process and the CLI against the real broker, Redis and
TensorStore."""

from __future__ import annotations

import json
import logging
import time

import pytest
from helpers import Harness
from typer.testing import CliRunner

from diloco.checkpoint import latest_versions
from diloco.cli import app
from diloco.config import dump_config
from diloco.flows.evals import read_versions

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
