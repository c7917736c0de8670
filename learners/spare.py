"""A warm spare learner: `diloco learner --spare`.

It does everything a learner does before its first step that does not depend on which learner it
is: starts the interpreter and JAX, loads the model spec and the corpus, places the initial
parameters, compiles the inner step (into JAX's persistent compilation cache, which the local
runner points at the run's directory), and opens the Kafka clients and the store. Then it blocks on
one line on stdin, `{"learner": ID, "start_step": N}` (the runner owns the pipe), and becomes that
learner exactly as a restarted one would: `learner.run` joins from the latest global version of
every fragment and draws the batches of `DataShard(..., start_step)`.

The compiled step is found again in the cache at the assignment when its program does not depend on
the learner or its start step: so with the built-in AdamW (the start step is in its state), among
learners with the same step budget. Any other optimizer compiles again there, everything else warm.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

from diloco.config import Config, ConfigError
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore
from diloco.learners import learner
from diloco.learners.parallel import learner_mesh
from diloco.spec import DataShard, load_spec

log = logging.getLogger(__name__)


def read_assignment(cfg: Config, line: str) -> tuple[str, int]:
    """(learner id, start step) from the runner's line; ConfigError saying what is wrong with it."""
    if not line:
        raise ConfigError("the spare's stdin closed before it was given a learner (the runner went away)")
    try:
        msg = json.loads(line)
        lid, step = msg["learner"], msg["start_step"]
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"spare assignment {line.strip()[:200]!r}: expected "
                          f'{{"learner": ID, "start_step": N}} ({type(err).__name__}: {err})') from None
    if not isinstance(lid, str) or not cfg.is_member_id(lid):
        raise ConfigError(f"spare assignment: {str(lid)[:64]!r} is not a learner of this run ({', '.join(cfg.member_ids())})")
    if not isinstance(step, int) or not 0 <= step <= cfg.learner_steps(lid):
        raise ConfigError(f"spare assignment: start_step {step!r} of {lid} is not in 0..{cfg.learner_steps(lid)}")
    return lid, step


def main(cfg: Config, run_id: str, assignments: TextIO = sys.stdin) -> dict:
    """Warm up, wait for the assignment, then train as that learner; returns its summary."""
    if why := cfg.spares_unsupported():
        raise ConfigError(why)
    t0 = time.perf_counter()
    spec, mesh = load_spec(cfg), learner_mesh(cfg)
    first = cfg.learner_ids()[0]  # a guess at the step budget: learners of one speed share it
    params = learner.initial_params(cfg, spec, mesh)
    batch = mesh.shard_batch(next(iter(spec.batches(DataShard(0, cfg.num_shards, 0, cfg.data.seed)))))
    learner.compile_step(spec, mesh, spec.inner_optimizer(0, cfg.learner_steps(first)), params, batch)
    del params, batch
    producer = kafka_io.producer(cfg.transport)
    services = {"store": FragmentStore(cfg.store.url, run_id), "producer": producer,
                "outer_consumer": kafka_io.consumer(cfg.transport)}
    log.info("spare ready", extra={"warm_up_s": round(time.perf_counter() - t0, 2)})
    lid, start_step = read_assignment(cfg, assignments.readline())
    log.info("spare takes over", extra={"learner": lid, "start_step": start_step})
    try:
        return learner.run(cfg, run_id, lid, start_step=start_step, spec=spec, mesh=mesh, **services)
    finally:
        producer.close()
