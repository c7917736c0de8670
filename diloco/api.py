"""The public API of Decoupled DiLoCo: everything a user imports, in one place (docs/api.md).

Bring your own model: a function returning a `ModelSpec` (init, loss, optimizer, batches), named in
the config as `model.entry: "my_package.my_module:spec"`; then `train(config(...))` runs it on the
local stack, and `diloco train --config ...`, the Prefect flows and the job manifests run it anywhere.

Keep your own training loop: wrap it in a `Session` (a learner of a provisioned run).

Get the result back: `restore(store_url, run_id, template)` puts a run's global version into your
own pytree; `diloco ckpt export` writes safetensors and Orbax checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from diloco.checkpoint import latest_versions, restore
from diloco.config import Config, ConfigError, build_config, load_config, merge_sections
from diloco.learners.parallel import LearnerMesh, learner_mesh
from diloco.learners.session import Session
from diloco.plan import Plan, PlanError, make_plan
from diloco.spec import DataShard, ModelSpec, evaluate


def configure(path: str | Path | None = None, *, overrides: list[str] = (), **sections) -> Config:
    """A run's config: the YAML at `path` (None: the embedded defaults), then `sections` given as
    keywords (`model={"entry": "mymodel:spec"}, inner={"steps": 200}`), merged key by key into the
    YAML's, then `key=value` overrides."""
    base = {} if path is None else load_config(path).model_dump(mode="json")
    return build_config(merge_sections(base, sections), list(overrides))


def train(cfg: Config, *, summary_json: str | Path | None = None, progress: bool = True) -> dict:
    """A local multi-region run of `cfg` to the end: provision, start the syncer and every learner as
    processes, watch, evaluate, summarise. Needs the broker and Redis (`diloco infra up`). Returns
    the summary (the same as `diloco train --summary-json`)."""
    from diloco.run import train as run_train

    return run_train(cfg, summary_json=summary_json, progress=progress)


__all__ = ["Config", "ConfigError", "DataShard", "LearnerMesh", "ModelSpec", "Plan", "PlanError", "Session", "configure",
           "evaluate", "latest_versions", "learner_mesh", "load_config", "make_plan", "restore", "train"]
