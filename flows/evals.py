"""Held-out evaluation of a run's global parameters, read from TensorStore at given versions."""

from __future__ import annotations

import json
import math
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from diloco.checkpoint import latest_versions, read_global
from diloco.config import Config, load_config
from diloco.flows import reports
from diloco.infra.store import FragmentStore
from diloco.plan import unflatten
from diloco.spec import evaluate, load_spec


def tokens_at(cfg: Config, store: FragmentStore, versions: list[int]) -> int:
    """Tokens the global model has seen: every fragment merges each step once, so the mean over fragments."""
    per_fragment = [sum(store.read_meta(p, v)["tokens"] for v in range(1, versions[p] + 1))
                    for p in range(cfg.fragments.count)]
    return round(sum(per_fragment) / len(per_fragment))


def evaluate_versions(cfg: Config, versions: list[int]) -> dict:
    """Loss and perplexity of the global parameters at `versions` (one per fragment) on the held-out set
    of the run's model spec (model.entry): the run's plan says where its tensors go in the model's tree."""
    store = FragmentStore(cfg.store.url, cfg.run.id)
    spec, plan = load_spec(cfg), store.read_plan()
    params = unflatten(spec.init(cfg.model.seed), plan, read_global(store, plan, dict(enumerate(versions))))
    loss = evaluate(spec, params)
    return {"version": min(versions), "versions": list(versions), "tokens": tokens_at(cfg, store, versions),
            "loss": loss, "perplexity": math.exp(loss)}


def eval_path(cfg: Config, versions: list[int]) -> Path:
    """Where a run keeps its eval of `versions`: RUN_DIR/evals/v<p0>-<p1>-....json."""
    return Path(cfg.run.dir) / cfg.run.id / "evals" / ("v" + "-".join(str(v) for v in versions) + ".json")


def record_eval(cfg: Config, figures: dict) -> None:
    path = eval_path(cfg, figures["versions"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures))


def recorded_evals(cfg: Config) -> list[dict]:
    """The run's evals so far, by tokens seen."""
    folder = Path(cfg.run.dir) / cfg.run.id / "evals"
    return sorted((json.loads(p.read_text()) for p in folder.glob("v*.json")), key=lambda e: (e["tokens"], e["version"]))


@task(retries=2, retry_delay_seconds=[2, 8], cache_policy=NO_CACHE)
def read_versions(cfg: Config) -> list[int]:
    store = FragmentStore(cfg.store.url, cfg.run.id)
    return list(latest_versions(store, store.read_plan()).values())


@task(retries=2, retry_delay_seconds=[2, 8], cache_policy=NO_CACHE)
def measure(cfg: Config, versions: list[int]) -> dict:
    return evaluate_versions(cfg, versions)


@task(cache_policy=NO_CACHE)
def report_eval(run_id: str, figures: dict) -> None:
    reports.eval_artifact(run_id, figures)


@flow(name="diloco-eval")
def evaluate_checkpoint(config: str, versions: list[int] | None = None) -> dict:
    """Evaluate a run's checkpoint: `config` is the run's own config.yaml (it names the run); `versions`
    one per fragment, default the latest committed version of each. Versions the run has an eval of
    already (RUN_DIR/evals) are not evaluated again: that eval is returned."""
    cfg = load_config(config)
    versions = versions if versions is not None else read_versions(cfg)
    done = eval_path(cfg, versions)
    if done.is_file():
        get_run_logger().info(f"versions {versions} of {cfg.run.id} are evaluated already ({done})")
        return json.loads(done.read_text())
    figures = measure(cfg, versions)
    record_eval(cfg, figures)
    report_eval(cfg.run.id, figures)
    return figures
