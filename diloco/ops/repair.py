"""`diloco state repair`: rebuild a run's Redis state from TensorStore after Redis lost writes.

The syncer refuses a Redis that holds less than the store proves was committed (syncer/durability.py).
What the store proves, per fragment: its newest committed version (infra/store.py `committed`) and,
in the meta.json of every version up to it, the merge record the syncer committed (ids included).
The repair makes Redis say exactly that, in one MULTI/EXEC:

- `version`: each fragment's committed version;
- `status`: every id merged into a committed version `applied:<p>:<v>`; rejections Redis still holds
  are kept; every other status (pending, or applied at a version the store does not hold) is dropped,
  so the replay judges those contributions again (one may now be `stale`);
- `merges`: the committed versions' records, oldest first; counters `applied`, `merges`, `late` and
  `accepted` recounted from them (the other counters are kept);
- `epoch:<p>`: at least every epoch the store saw for the fragment, so the next owner's writes are
  not refused by an orphan an owner of a lost epoch left; leases dropped;
- open rounds and replay offsets dropped: the syncer reads the fragment topics from their start, and
  drops the records of applied ids as duplicates;
- the outbox emptied (what it held may announce lost versions); each shard announces its fragments'
  versions when it claims them.

Every syncer shard of the run must be stopped: the repair refuses while one is live.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from diloco.infra.store import FragmentStore, StoreError, Versions
from diloco.ops import OpsError
from diloco.syncer.records import Status
from diloco.syncer.state import SyncerState


def repair(state: SyncerState, store: FragmentStore, run: str, *, shards: int, dry_run: bool = False) -> dict:
    """What the repair of `run` does (or, with `dry_run`, would do), as a plain dict."""
    if live := state.live_shards(shards):
        raise OpsError(f"run {run}: syncer shard(s) {sorted(live)} are live; stop every shard of the run first "
                       "(a stopped shard's membership lapses after syncer.lease_ttl_s)")
    try:
        plan = store.read_plan()
        catalog = store.catalog()
        held = {p: catalog[p] if p in catalog else Versions([], [], None) for p in range(plan.fragments)}
        metas = {p: _metas(store, p, held[p].complete) for p in held}
        committed = {p: held[p].committed for p in held}
    except (StoreError, ValueError, KeyError) as err:
        raise OpsError(f"{store.url}: {err}") from None
    before, statuses = state.versions(), state.statuses()
    applied: dict[str, str] = {}
    records, fragments = [], []
    for p, v in committed.items():
        if v is None:
            raise OpsError(f"{store.url}: fragment {p} has no version: the run's provisioning never finished; "
                           f"delete {store.url} and provision the run again")
        if missing := sorted(set(range(v + 1)) - set(metas[p])):
            raise OpsError(f"{store.url}: fragment {p} committed version {v}, but versions {missing} are missing "
                           "from the store: it cannot tell what was applied")
        ids = {cid: Status.applied(p, u) for u in range(1, v + 1) for cid in metas[p][u].get("ids", [])}
        applied |= ids
        records += [store.record_of(metas[p][u]) for u in range(1, v + 1)]
        fragments.append({"fragment": p, "redis_version": before.get(p), "version": v, "applied": len(ids),
                          "orphans": sorted(u for u in metas[p] if u > v),
                          "epoch": max([state.epoch(p), *(m.get("epoch", 0) for m in metas[p].values())])})
    records.sort(key=lambda r: r.get("time", 0))
    kept = {cid: s for cid, s in statuses.items() if Status.kind_of(s) == "rejected" and cid not in applied}
    dropped: dict[str, int] = {}
    for cid, s in statuses.items():
        if cid not in applied and cid not in kept:
            kind = Status.kind_of(s)
            dropped[kind] = dropped.get(kind, 0) + 1
    counters = {"applied": len(applied), "accepted": len(applied), "merges": len(records),
                "late": sum(r.get("late", 0) for r in records)}
    if not dry_run:
        state.restore(versions={f["fragment"]: f["version"] for f in fragments}, statuses=applied | kept,
                      merges=records, epochs={f["fragment"]: f["epoch"] for f in fragments}, counters=counters)
    return {"run": run, "store": store.url, "dry_run": dry_run, "fragments": fragments,
            "statuses": {"applied": len(applied), "rejected_kept": len(kept), "dropped": dropped},
            "merge_records": len(records), "counters": counters}


def _metas(store: FragmentStore, fragment: int, versions: list[int]) -> dict[int, dict]:
    """These versions' meta.json, read in parallel (one small read each: overlap them on gs://)."""
    with ThreadPoolExecutor(16) as pool:
        return dict(zip(versions, pool.map(lambda v: store.read_meta(fragment, v), versions)))
