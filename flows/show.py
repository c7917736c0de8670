"""Print the artifacts of the latest `decoupled-diloco` flow run (`python -m diloco.flows.show`)."""

from __future__ import annotations

import json

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowFilter,
    FlowFilterName,
)
from prefect.client.schemas.sorting import FlowRunSort


def main() -> None:
    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["decoupled-diloco"])),
                                       sort=FlowRunSort.START_TIME_DESC, limit=1)
        print(f"flow run {run.name} ({run.id}): {run.state.name}")
        for art in client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))):
            print(f"\n== artifact {art.key} ({art.type}): {art.description}")
            if art.type == "table":
                rows = json.loads(art.data)
                print(" | ".join(rows[0]))
                for row in rows:
                    print(" | ".join(str(v) for v in row.values()))
            elif "base64," in art.data:
                print(f"(PNG image, {len(art.data):,} characters of data URI)")
            else:
                print(art.data)


if __name__ == "__main__":
    main()
