"""The `diloco` command line: help, config errors, and the local service stack."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_processes
from typer.testing import CliRunner

from diloco.cli import app
from diloco.config import dump_config
from diloco.infra import services

ROOT = Path(__file__).resolve().parents[1]

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


@pytest.mark.integration
def test_train_stopped_with_sigterm_stops_its_learners_and_syncer_first(tiny_config, tmp_path):
    """`kill`, a scheduler's stop or a CI timeout sends SIGTERM: the run's processes must not train on."""
    cfg = tiny_config(inner={"steps": 5000}, regions=[{"name": "us", "speed": 0.1}, {"name": "eu", "speed": 0.1}])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    with open(tmp_path / "train.log", "wb") as log:
        train = subprocess.Popen([sys.executable, "-m", "diloco", "train", "--config", str(tmp_path / "config.yaml"),
                                  "--no-progress"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while len([c for c in run_processes(cfg.run.dir).values() if " learner " in c]) < cfg.num_learners:
            assert train.poll() is None and time.time() < deadline, (tmp_path / "train.log").read_text()[-3000:]
            time.sleep(0.5)
        train.send_signal(signal.SIGTERM)
        assert train.wait(120) == 128 + signal.SIGTERM, (tmp_path / "train.log").read_text()[-3000:]
        assert not run_processes(cfg.run.dir)  # stopped before it exited, not left to train on
        assert "run stopped by SIGTERM" in (tmp_path / "train.log").read_text()
    finally:
        if train.poll() is None:
            train.kill()
        for pid in run_processes(cfg.run.dir):
            os.kill(pid, signal.SIGKILL)
