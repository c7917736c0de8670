"""The examples a user copies, end to end at a tiny size on the real broker, Redis and TensorStore:
their own model trains, every contribution is applied once, the global version restores into their
own pytree bit for bit, and the syncer process never imports the model's module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_exact_accounting
from rich.console import Console

import diloco
from diloco.config import load_config
from diloco.infra.store import FragmentStore
from diloco.run import train
from diloco.spec import load_spec

pytestmark = pytest.mark.integration


def _run(tiny_config, monkeypatch, entry: str, **sections):
    # Every child process writes the modules it imports to its log (CPython's -X importtime).
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    demo = load_config(Path(__file__).resolve().parents[1] / "configs/local.yaml")  # the examples' own settings
    sections = {"model": {"entry": entry, "options": {}}, "outer": demo.outer.model_dump(),
                "fragments": {"apply": demo.fragments.apply}, **sections}
    sections["syncer"] = {"scale_partial_rounds": True, **sections.get("syncer", {})}
    # Steps stretched to ~30 ms so that a sync period outlasts a merge round trip, as on real hardware
    # (at full speed 60 tiny steps take half a second and nearly every delta lands late).
    sections.setdefault("regions", [{"name": "us", "learners": 2, "speed": 0.25}, {"name": "eu", "learners": 2, "speed": 0.25}])
    cfg = tiny_config(inner={"steps": 60, "batch_size": 8, "warmup_steps": 5}, **sections)
    summary = train(cfg, progress=False, console=Console(quiet=True))
    monkeypatch.delenv("PYTHONPROFILEIMPORTTIME")
    return cfg, summary


def _imported(summary, process: str, module: str, inherited: bool = True) -> bool:
    """Whether the process imported `module`: its log (with -X importtime lines) shows it, or (`inherited`)
    that of the fork server it was forked from (infra/forkserver.py), whose imports it inherited."""
    logs = Path(summary["run_dir"]) / "logs"
    text = "".join(log.read_text(errors="replace") for log in (logs / f"{process}.log", logs / "forkserver.log")
                   if log.exists() and (inherited or log.name != "forkserver.log"))
    return re.search(rf"^import time:.*\|\s+{re.escape(module)}\s*$", text, re.M) is not None


def _check_run(cfg, summary, module: str):
    c = summary["contributions"]
    assert c["applied"] == c["published"] > 0 and c["applied_twice"] == 0 and c["rejected"] == 0
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    assert_exact_accounting(cfg, summary["run_id"])
    t = summary["traffic"]                                                # the per-link ledger adds up
    for table in ("by_learner", "by_region", "by_fragment"):
        assert sum(r["up"] for r in t[table].values()) == summary["bytes_sent"], table
        assert sum(r["down"] for r in t[table].values()) == summary["bytes_fetched"], table
    assert set(t["by_region"]) == {r.name for r in cfg.regions} and set(t["by_learner"]) == set(cfg.learner_ids())
    assert all(_imported(summary, lid, module) for lid in cfg.learner_ids())  # the learners ran the user's model
    assert _imported(summary, "syncer", "diloco.syncer.syncer")
    # the syncer never imports it: the fork server imported it once for the learners (run.preload), and
    # a syncer forked from it holds what it holds, but nothing of the syncer's own reaches for the model
    assert not _imported(summary, "syncer", module, inherited=False)


def test_flax_nnx_example_trains_and_restores_into_the_users_state(tiny_config, monkeypatch):
    cfg, s = _run(tiny_config, monkeypatch, "examples.flax_nnx_lm:spec")
    _check_run(cfg, s, "examples.flax_nnx_lm")
    spec = load_spec(cfg)
    template = spec.init(123)   # any state of the same model: restore overwrites every parameter
    restored = diloco.restore(cfg.store.url, s["run_id"], template)
    store = FragmentStore(cfg.store.url, s["run_id"])
    plan, versions = store.read_plan(), diloco.latest_versions(store, store.read_plan())
    assert versions == {int(p): v for p, v in s["versions"].items()}
    want = store.read(plan.by_name["embed.embedding"].fragment, versions[plan.by_name["embed.embedding"].fragment],
                      with_opt=False).params["embed.embedding"]
    assert np.array_equal(np.asarray(restored["embed"]["embedding"][...]), want)
    assert diloco.evaluate(spec, restored) == pytest.approx(s["eval_loss_end"], abs=1e-5)


def test_plain_pytree_example_keeps_bf16_a_dict_batch_and_a_local_leaf(tiny_config, monkeypatch):
    cfg, s = _run(tiny_config, monkeypatch, "examples.pytree_mlp_lm:spec", syncer={"mean_merge_tensors": ["embed"]})
    _check_run(cfg, s, "examples.pytree_mlp_lm")
    store = FragmentStore(cfg.store.url, s["run_id"])
    plan = store.read_plan()
    assert plan.by_name["embed"].dtype == "bfloat16" and plan.by_name["embed"].merge == "mean"
    assert "stats.tokens_seen" not in plan.by_name                       # marked local: never synced
    p = plan.by_name["embed"].fragment
    stored = store.read(p, store.versions(p)[-1], with_opt=False).params["embed"]
    assert stored.dtype == np.dtype("bfloat16")
    restored = diloco.restore(cfg.store.url, s["run_id"], load_spec(cfg).init(0))
    assert restored["embed"].dtype == stored.dtype and np.array_equal(restored["embed"].view(np.uint16),
                                                                       stored.view(np.uint16))
    assert s["tokens"] < cfg.num_learners * cfg.inner.steps * cfg.inner.batch_size * 32  # masked targets do not count


def test_a_users_own_training_loop_runs_as_every_learner(tiny_config, monkeypatch):
    cfg, s = _run(tiny_config, monkeypatch, "examples.pytree_mlp_lm:spec", syncer={"mean_merge_tensors": ["embed"]},
                  model={"entry": "examples.pytree_mlp_lm:spec", "options": {}, "script": "examples/own_loop.py"})
    _check_run(cfg, s, "examples.pytree_mlp_lm")
    logs = {lid: (Path(s["run_dir"]) / "logs" / f"{lid}.log").read_text() for lid in cfg.learner_ids()}
    assert all('"msg": "running the learner script", "script": "examples/own_loop.py"' in t for t in logs.values())
    assert {lid: hb["step"] for lid, hb in s["learners"].items()} == {lid: cfg.inner.steps for lid in cfg.learner_ids()}


ROOT = Path(__file__).resolve().parents[1]


def _as_documented(argv: list[str], cwd: Path, tmp_path, kafka_bootstrap, redis_url, data_dir) -> tuple[float, float]:
    """Run an example's documented command (`python examples/X.py [key=value ...]`) in `cwd`, on the
    embedded defaults but for where the services, store and data are and a shorter run; returns the
    (start, end) held-out loss it prints."""
    overrides = [f"transport.bootstrap_servers={kafka_bootstrap}", f"state.redis_url={redis_url}",
                 f"store.url=file://{tmp_path}/store", f"run.dir={tmp_path}/runs", f"data.dir={data_dir}",
                 "data.max_corpus_bytes=2000000", "inner.steps=120", "run.heartbeat_s=0.5"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # nothing but what the user has
    out = subprocess.run([sys.executable, *argv, *overrides], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = re.search(r"held-out loss ([0-9.]+) -> ([0-9.]+)", out.stdout)
    assert m, out.stdout[-2000:]
    return float(m.group(1)), float(m.group(2))


def test_the_flax_example_runs_as_its_docstring_says_on_the_defaults(tmp_path, kafka_bootstrap, redis_url, data_dir):
    """`python examples/flax_nnx_lm.py` from the repository root: a Flax NNX model with dropout (RNG
    state the loss updates) and an int counter trains on the embedded defaults."""
    start, end = _as_documented(["examples/flax_nnx_lm.py"], ROOT, tmp_path, kafka_bootstrap, redis_url, data_dir)
    assert end < start - 0.5


def test_the_pytree_example_runs_from_another_folder(tmp_path, kafka_bootstrap, redis_url, data_dir):
    """The learners import the script's module from the script's folder, wherever it is run from."""
    start, end = _as_documented([str(ROOT / "examples/pytree_mlp_lm.py")], tmp_path, tmp_path, kafka_bootstrap,
                                redis_url, data_dir)
    assert end < start
