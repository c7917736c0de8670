"""The base install (no extras) is a learner: a fresh venv with `pip install <this repo>` alone trains a
user's own model against the local stack, and neither `import diloco` nor the learner pulls Beam,
Prefect, numba or matplotlib. The run is provisioned, and its syncer merges, in the test's own
(dev) environment: only the learner runs from the base venv.

Building the venv downloads nothing new once pip's cache holds the wheels (about a minute on 2 cores)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from helpers import Harness

from diloco.config import dump_config
from diloco.extras import EXTRA_OF

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("apache_beam", "prefect", "numba", "matplotlib", "redis", "pyarrow", "orbax")

# A user's own model and data: nothing from the library's corpus pipeline.
USER_MODEL = '''
import jax.numpy as jnp
import numpy as np
import optax

import diloco


def init(seed):
    rng = np.random.default_rng(seed)
    return {"w": (0.1 * rng.normal(size=(8, 8))).astype(np.float32), "b": np.zeros(8, np.float32)}


def loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def spec(cfg):
    target = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)

    def batches(shard):
        rng = np.random.default_rng(1000 + shard.index)
        while True:
            x = rng.normal(size=(16, 8)).astype(np.float32)
            yield {"x": x, "y": x @ target}

    return diloco.ModelSpec(init=init, loss=loss, optimizer=optax.sgd(0.05), batches=batches, tokens=16)
'''


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    """A fresh venv with the package installed from a copy of this working tree, no extras."""
    tmp = tmp_path_factory.mktemp("base-install")
    src = tmp / "src"  # a copy: pip builds in the source tree, and would leave build/ in the repository
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in set(package_dirs.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    started = time.monotonic()
    # --no-compile: byte-compiling every installed module took 40% of the install; the few processes
    # this venv runs compile only what they import (measured: the module's tests 60 s -> 42 s)
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--no-compile", str(src)], check=True, timeout=900)
    print(f"base venv installed in {time.monotonic() - started:.0f} s")
    return venv


def test_the_base_install_has_no_beam_or_prefect_and_imports_none_of_the_extras(base_venv):
    listed = subprocess.run([str(base_venv / "bin/pip"), "list", "--format=json"], check=True, capture_output=True,
                            text=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert "decoupled-diloco" in names
    assert not names & {"apache-beam", "prefect", "numba", "matplotlib", "pyarrow", "redis", "orbax-checkpoint"}
    probe = ("import sys, diloco, diloco.learners.session, diloco.learners.learner, diloco.cli; "
             "print(diloco.Session.__module__, sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (LEFT_OUT,))
    out = subprocess.run([str(base_venv / "bin/python"), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=base_venv).stdout.split(maxsplit=1)
    assert out == ["diloco.learners.session", "[]\n"]


def test_a_command_of_an_extra_names_the_extra_to_install(base_venv, tmp_path):
    """`diloco data prepare` (Beam) and `diloco infra status` (Redis) in a base install: one line naming
    the extra, exit 1, no traceback."""
    for argv, extra in ((["data", "prepare", "--output", str(tmp_path / "c"), "--learners", "1"], "pipelines"),
                        (["infra", "status"], "syncer")):
        r = subprocess.run([str(base_venv / "bin/diloco"), *argv], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 1, r.stderr
        assert f"pip install 'decoupled-diloco[{extra}]'" in r.stderr and "Traceback" not in r.stderr


def test_the_extras_named_for_missing_modules_are_the_ones_pyproject_defines():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRA_OF.values()) <= set(extras)
    assert "decoupled-diloco[syncer,pipelines,flows,ops]" in extras["all"]
    assert any(d.startswith("decoupled-diloco[all") for d in extras["dev"])


def test_a_base_install_trains_a_users_model_as_a_learner(base_venv, tiny_config, tmp_path, monkeypatch):
    """`diloco learner` from the base venv (as a job backend starts it) joins the run, trains, and hands in
    deltas that the syncer, running here, merges into new versions."""
    project = tmp_path / "project"  # the user's project: their model module, the run's config
    project.mkdir()
    (project / "user_model.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(project))
    cfg = tiny_config(model={"entry": "user_model:spec", "options": {}},
                      inner={"steps": 40}, fragments={"count": 2, "sync_every": 10},
                      syncer={"quorum": 1}, regions=[{"name": "us", "learners": 1}])
    h = Harness(cfg, f"base-{time.time_ns() % 10**6}")
    before = dict(h.state.versions())
    run_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": h.run_id})})
    (project / "run.yaml").write_text(dump_config(run_cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(tmp_path / "learner.log", "wb") as log:
        proc = subprocess.Popen([str(base_venv / "bin/diloco"), "learner", "--config", "run.yaml", "--learner", "us-0"],
                                cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None:  # the syncer merges what the learner hands in while it trains
                assert time.monotonic() < deadline, "the base-install learner did not finish in 300 s"
                h.syncer.step()
        finally:
            if proc.poll() is None:
                proc.kill()
    output = (tmp_path / "learner.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    h.pump(lambda: all(v > before[f] for f, v in h.state.versions().items()), timeout=30)
