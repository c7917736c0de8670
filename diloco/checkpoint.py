"""Global versions of a run, read back into the user's own pytree.

    params = restore("file://.diloco/store", "local-20261201-...", template=my_params)

The run's plan (in the store) says which leaves of the template are synced and what they are
called; those leaves get the global values (in the plan's dtype, on the template leaf's devices and
sharding), every other leaf of the template is kept as it is.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from diloco.infra.store import FragmentStore, StoreError
from diloco.plan import Plan, check_tree, place, unflatten


def latest_versions(store: FragmentStore, plan: Plan) -> dict[int, int]:
    """The newest committed version of every fragment (never an orphan a crashed or fenced syncer left)."""
    out = {}
    for p in range(plan.fragments):
        v = store.committed(p)
        if v is None:
            raise StoreError(f"{store.url}: fragment {p} has no committed version")
        out[p] = v
    return out


def read_global(store: FragmentStore, plan: Plan, versions: Mapping[int, int] | None = None) -> dict[str, np.ndarray]:
    """Every synced tensor of the run, by name, at `versions` (default: the latest of each fragment)."""
    versions = latest_versions(store, plan) if versions is None else versions
    arrays: dict[str, np.ndarray] = {}
    for p in range(plan.fragments):
        arrays |= store.read(p, versions[p], with_opt=False).params
    return arrays


def restore(store_url: str, run_id: str, template, versions: Mapping[int, int] | None = None):
    """The run's global parameters at `versions` (default latest) put into `template`, your pytree."""
    store = FragmentStore(store_url, run_id)
    plan = store.read_plan()
    check_tree(template, plan)
    return unflatten(template, plan, read_global(store, plan, versions), place=place)
