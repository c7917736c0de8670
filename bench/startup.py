"""A run's start-up: seconds from `diloco train`'s start to every learner training, read from the
times of the run's events (a learner's first heartbeat is sent at its first step; its phase events,
where the learner sends them, say when it began importing, compiling and joining).

    python -m bench.startup --config configs/local.yaml --set inner.steps=40 [--set model.entry=...]

It runs `diloco train` with the given overrides under a run id of its own, then reads the run's
events topic and prints the figures as JSON (docs/operations.md, "Start-up").
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import time

from diloco import messages


def startup(events: list[dict], started: float) -> dict:
    """Per learner, seconds from `started` to the start of each phase it reported and to its first
    heartbeat (`training`); `all_training_s`: when the last learner began training (None while one
    has not); `syncer_started_s`: the first syncer shard's start."""
    learners: dict[str, dict[str, float]] = {}
    syncer = None
    for ev in sorted(events, key=lambda e: e["time"]):
        at = round(ev["time"] - started, 2)
        if ev["kind"] == "syncer_started":
            syncer = at if syncer is None else syncer
        elif ev["kind"] == "learner_phase":
            learners.setdefault(ev["learner"], {}).setdefault(ev["phase"], at)
        elif ev["kind"] == "heartbeat":
            learners.setdefault(ev["learner"], {}).setdefault("training", at)
    training = [p.get("training") for p in learners.values()]
    return {"learners": learners, "syncer_started_s": syncer,
            "all_training_s": None if not training or None in training else max(training)}


def run(config: str, overrides: list[str]) -> dict:
    """Run `diloco train` to its end and return `startup` of its events, with its wall time."""
    from diloco.config import load_config
    from diloco.infra import kafka as kafka_io

    run_id = f"startup-{time.strftime('%H%M%S')}-{secrets.token_hex(2)}"
    sets = [a for o in [*overrides, f"run.id={run_id}"] for a in ("--set", o)]
    started = time.time()
    subprocess.run([sys.executable, "-m", "diloco", "train", "--config", config, "--no-progress", *sets], check=True)
    wall = time.time() - started
    cfg = load_config(config, [*overrides, f"run.id={run_id}"])
    topic = kafka_io.Topics.for_run(cfg, run_id).events
    records = kafka_io.read_to_end(cfg.transport, [(topic, 0)])
    events = [ev for ev in map(messages.parse_event, (r.value for r in records)) if ev]
    return {"run_id": run_id, "overrides": overrides, "wall_s": round(wall, 1), **startup(events, started)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    print(json.dumps(run(a.config, a.set), indent=1))
