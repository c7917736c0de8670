"""Decoupled DiLoCo: learners publish fragment deltas to Kafka; a syncer merges them into TensorStore.

The public API lives in `diloco.api` and is importable from here (`diloco.Session`, `diloco.ModelSpec`,
`diloco.train`, `diloco.restore`, ...), loaded on first use so that the command line starts quickly.
"""

__version__ = "0.1.0"

_API = ("Config", "ConfigError", "DataShard", "LearnerMesh", "ModelSpec", "Plan", "PlanError", "Session", "configure",
        "evaluate", "latest_versions", "learner_mesh", "load_config", "make_plan", "restore", "train")


def __getattr__(name: str):
    if name in _API:
        from diloco import api

        return getattr(api, name)
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
