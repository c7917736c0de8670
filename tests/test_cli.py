"""The `diloco` command line: help, config errors, and the local service stack."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from diloco.cli import app
from diloco.infra import services

runner = CliRunner()


def test_help_lists_every_command():
    out = runner.invoke(app, ["--help"]).output
    for cmd in ("train", "infra", "syncer", "learner", "simulate", "data", "report"):
        assert cmd in out
    assert "--summary-json" in runner.invoke(app, ["train", "--help"]).output


def test_bad_config_value_exits_2_naming_the_key():
    res = runner.invoke(app, ["train", "--config", "configs/local.yaml", "--set", "syncer.quorum=0"])
    assert res.exit_code == 2 and "syncer.quorum" in res.output


def test_train_without_services_fails_clearly(tmp_path):
    port = services.free_port()  # nothing listens there
    res = subprocess.run(
        [sys.executable, "-m", "diloco", "train", "--set", f"transport.bootstrap_servers=127.0.0.1:{port}",
         "--set", f"state.redis_url=redis://127.0.0.1:{port}/0", "--set", "state.connect_timeout_s=2",
         "--set", f"run.dir={tmp_path}",
         "--set", f"data.dir={tmp_path}/data", "--set", "data.max_corpus_bytes=200000"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "not reachable" in res.stderr and "diloco infra up" in res.stderr


@pytest.mark.integration
def test_infra_up_status_down(tmp_path):
    kport, rport = services.free_port(), services.free_port()
    sets = ["--set", f"transport.bootstrap_servers=127.0.0.1:{kport}", "--set", f"state.redis_url=redis://127.0.0.1:{rport}/0"]
    state = ["--state-dir", str(tmp_path)]
    assert runner.invoke(app, ["infra", "status", *sets]).exit_code == 1
    up = runner.invoke(app, ["infra", "up", *sets, *state])
    assert up.exit_code == 0, up.output
    try:
        assert runner.invoke(app, ["infra", "status", *sets]).exit_code == 0
        assert "already answering" in runner.invoke(app, ["infra", "up", *sets, *state]).output
    finally:
        down = runner.invoke(app, ["infra", "down", *state])
    assert "kafka: stopped" in down.output and "redis: stopped" in down.output
    assert not services.port_open(kport) and not services.port_open(rport)
