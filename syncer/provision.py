"""Provisioning a run (its topics, plan and version 0) and announcing versions on the outer topic.
Done once by whoever holds the model's initial values (`diloco train`, the flows); the syncer only
announces what it commits."""

from __future__ import annotations

import time

import numpy as np

from diloco import messages
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore, array_digest
from diloco.plan import Plan
from diloco.syncer import durability
from diloco.syncer import merge as merge_math
from diloco.syncer.state import SyncerState


def provision(cfg: Config, run_id: str, *, state: SyncerState, store: FragmentStore, producer, plan: Plan,
              initial: dict[str, np.ndarray]) -> bool:
    """Create topics and, for a new run, store its plan and version 0 of every fragment (from the
    `initial` values of the plan's tensors, computed by whoever holds the model). True if new."""
    topics = kafka_io.Topics.for_run(cfg, run_id)
    kafka_io.ensure_topics(cfg.transport, topics.all())
    if plan.fragments != cfg.fragments.count:
        raise ValueError(f"the plan has {plan.fragments} fragments, fragments.count is {cfg.fragments.count}")
    if state.versions():
        return False
    if held := durability.committed_in_store(store, plan.fragments):
        raise durability.lost(run_id, f"Redis holds nothing of the run, but the store holds its committed versions "
                                      f"{held}; provisioning again would overwrite version 0")
    store.write_plan(plan)
    opt = merge_math.outer_optimizer(cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
    for p, names in enumerate(plan.fragment_names):
        frag = {n: np.asarray(initial[n]).astype(plan.by_name[n].np_dtype) for n in names}
        store.write(p, 0, frag, merge_math.flatten_state(opt.init(merge_math.as_float32(frag))),
                    {"tokens": 0, "contributors": [], "ids": [], "time": time.time(), "reason": "init",
                     "digests": {n: array_digest(a) for n, a in frag.items()}})
    state.init_versions(plan.fragments)
    for p in range(plan.fragments):
        store.mark_committed(p, 0)
        announce(producer, topics, cfg, run_id, p, 0)
    producer.flush()
    return True


def announcement(topics: kafka_io.Topics, cfg: Config, run_id: str, fragment: int, version: int) -> dict:
    """An outbox record telling learners that `version` of `fragment` is in the store."""
    value = messages.event("version", run=run_id, fragment=fragment, version=version, store=cfg.store.url)
    return {"topic": topics.outer, "partition": 0, "value": value.decode()}


def announce(producer, topics: kafka_io.Topics, cfg: Config, run_id: str, fragment: int, version: int) -> None:
    rec = announcement(topics, cfg, run_id, fragment, version)
    producer.send(rec["topic"], rec["value"].encode(), partition=rec["partition"])
