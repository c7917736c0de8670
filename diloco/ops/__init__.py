"""Operator tools: Kafka topic monitoring (`diloco topics`) and checkpoint inspection (`diloco ckpt`).

The logic returns plain dicts (`topics.py`, `ckpt.py`); `cli.py` only renders them.
"""

from __future__ import annotations

from pathlib import Path


class OpsError(RuntimeError):
    """Something an operator asked for does not exist or cannot be read; the text says what."""


def latest_run(run_dir: str | Path) -> str:
    """The run under `run_dir` whose config.yaml was written last (every run keeps one there)."""
    configs = sorted(Path(run_dir).glob("*/config.yaml"), key=lambda p: p.stat().st_mtime)
    if not configs:
        raise OpsError(f"no runs under {run_dir} (no */config.yaml); name one with --run")
    return configs[-1].parent.name
