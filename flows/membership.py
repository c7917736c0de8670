"""The `diloco-scale` flow: add learners to a region of a live run, or ask learners to leave, from
Prefect (`prefect deployment run 'diloco-scale/scale' -p config=RUN_DIR/config.yaml -p region=eu -p add=2`).

It hands the requests to the run's runner (`diloco.membership`), the same path as `diloco learners
add/remove`: the runner (a `decoupled-diloco` flow run or `diloco train`) starts the new learners
through its job backend (processes, or JobSets on GKE) and signals the ones asked to leave.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from diloco import membership


@flow(name="diloco-scale")
def scale(config: str, region: str | None = None, add: int = 0, remove: list[str] | None = None,
          wait_s: float = 120.0) -> list[dict]:
    """`config`: the live run's config.yaml (its directory is the run's); `add` learners to `region`;
    `remove`: learner ids asked to leave. Raises if the runner refuses a request (bounds in
    regions[].max_learners / min_learners) or does not answer within `wait_s`."""
    if add and not region:
        raise ValueError("add needs a region")
    run_dir, logger = Path(config).parent, get_run_logger()
    ops = ([{"op": "add", "region": region, "count": add}] if add else []) + \
          [{"op": "remove", "learner": lid} for lid in remove or []]
    results = []
    for op in ops:
        result = membership.wait(membership.submit(run_dir, op), wait_s)
        logger.info("%s -> %s", op, result)
        results.append(result)
    return results
