"""Print the latest `decoupled-diloco` flow run, its region flow runs (those run again by hand too) and
the evals its version events triggered, with their artifacts (`python -m diloco.flows.show`). Waits up
to `--wait-s` for the triggered evals still running."""

from __future__ import annotations

import argparse
import json
import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterName,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterTags,
)
from prefect.client.schemas.sorting import FlowRunSort


def print_artifacts(client, flow_run) -> None:
    for art in client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))):
        print(f"\n== artifact {art.key} ({art.type}) of {flow_run.name}: {art.description}")
        if art.type == "table":
            rows = json.loads(art.data)
            print(" | ".join(rows[0]))
            for row in rows:
                print(" | ".join(str(v) for v in row.values()))
        elif "base64," in art.data:
            print(f"(PNG image, {len(art.data):,} characters of data URI)")
        else:
            print(art.data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wait-s", type=float, default=180.0)
    args = parser.parse_args()
    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["decoupled-diloco"])),
                                       sort=FlowRunSort.START_TIME_DESC, limit=1)
        print(f"flow run {run.name} ({run.id}) on pool {run.work_pool_name}: {run.state.name}")
        # the region flow runs it submitted, and any run again by hand with their tag (docs/prefect.md)
        tags = sorted({t for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))) for t in fr.tags if t.startswith("diloco-run:")})
        regions = sorted(client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(any_=tags))),
                         key=lambda fr: fr.created) if tags else []
        for fr in regions:
            print(f"  region {fr.parameters['region']}: flow run {fr.name} on pool {fr.work_pool_name}, "
                  f"tags {sorted(fr.tags)}: {fr.state.name} {fr.state.message or ''}".rstrip())
        config = regions[0].parameters["config"] if regions else None
        deadline = time.time() + args.wait_s
        while True:
            evals = [fr for fr in client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["eval"])),
                sort=FlowRunSort.START_TIME_DESC) if config and fr.parameters.get("config") == config]
            if all(fr.state.is_final() for fr in evals) or time.time() > deadline:
                break
            time.sleep(2)
        for fr in evals:
            print(f"  eval {fr.name} (created by {fr.created_by.type if fr.created_by else '?'}) on pool "
                  f"{fr.work_pool_name}, versions {fr.parameters.get('versions')}: {fr.state.name}")
        for fr in [run, *regions, *evals]:
            print_artifacts(client, fr)


if __name__ == "__main__":
    main()
