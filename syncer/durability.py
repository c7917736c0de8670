"""Whether Redis still holds what the syncer committed, checked against TensorStore.

Redis can lose writes it acknowledged (a failover to a replica that lagged, `appendfsync everysec`,
a restore from an older snapshot). Versions then roll back: the syncer would overwrite a version
learners already hold and merge contributions again that it had applied. The store keeps what
survives: every committed version's meta.json (with the ids it merged) and the commit marker
(infra/store.py). A shard checks a fragment against them when it loads it and refuses to go on;
`diloco state repair` rebuilds the run's Redis state from the store (diloco/ops/repair.py).
"""

from __future__ import annotations

from diloco.infra.store import FragmentStore
from diloco.syncer.state import StateError, SyncerState

EXIT_STATE_LOST = 4  # `diloco syncer` exits with this when it refuses: restarting cannot help


class StateLost(StateError):
    """Redis holds less than the store proves was committed."""


def lost(run_id: str, what: str) -> StateLost:
    return StateLost(f"run {run_id}: {what}. Redis lost acknowledged writes (a failover, appendfsync everysec, a "
                     f"restore from an older snapshot); going on would overwrite announced versions and apply "
                     f"contributions twice. Stop every syncer shard of the run, then rebuild its Redis state from "
                     f"the store: `diloco state repair --config CONFIG --run {run_id}` (--dry-run first; "
                     f"docs/operations.md, 'Redis lost writes')")


def check_fragment(state: SyncerState, store: FragmentStore, run_id: str, fragment: int, version: int) -> None:
    """Raise StateLost unless `version`, Redis's, can be the fragment's newest committed version: the
    store's commit marker is not ahead of it, the store holds at most one version past it (the orphan
    a crash leaves), and the ids merged into it are the ones Redis's merge record names."""
    marker = store.read_committed(fragment)
    if marker is not None and marker > version:
        raise lost(run_id, f"fragment {fragment} is at version {version} in Redis, but the store's commit marker "
                           f"says version {marker} was committed")
    if store.has(fragment, version + 2):  # versions are written in order: one beyond v + 1 means v + 2 is there
        raise lost(run_id, f"fragment {fragment} is at version {version} in Redis, but the store holds version "
                           f"{version + 2} (only {version + 1} can be an uncommitted orphan)")
    if version == 0:
        return
    record = state.merge_record(fragment, version)
    ids = store.read_meta(fragment, version).get("ids", [])
    if record is None or record["ids"] != ids:
        held = "no merge record" if record is None else f"a merge record of ids {record['ids'][:4]}"
        raise lost(run_id, f"fragment {fragment} version {version}: the store merged ids {ids[:4]}, Redis holds "
                           f"{held} for that version (the version was merged again after Redis rolled back)")


def committed_in_store(store: FragmentStore, fragments: int) -> dict[int, int]:
    """Fragment -> newest committed version, for the fragments that have one in the store."""
    found = {p: store.committed(p) for p in range(fragments)}
    return {p: v for p, v in found.items() if v is not None}


def provisioned_versions(state: SyncerState, store: FragmentStore, run_id: str, fragments: int) -> dict[int, int]:
    """Redis's version of every fragment; StateLost if Redis forgot a run the store committed versions
    of, RuntimeError if the run was never provisioned."""
    versions = state.versions()
    if len(versions) != fragments:
        if held := committed_in_store(store, fragments):
            raise lost(run_id, f"Redis holds versions {versions}, the store committed {held}")
        raise RuntimeError(f"run {run_id} is not provisioned in Redis (versions: {versions}); "
                           "`diloco train` provisions it")
    return versions
