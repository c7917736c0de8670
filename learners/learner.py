"""The learner process that `diloco learner` (and so `diloco train`, the flows and the job manifests)
starts: the config's model entry point, trained by the plain loop a user would write around a
`Session`, over all of the learner's devices and hosts (`learners/parallel.py`: data parallel, FSDP
and tensor parallel by the model's partition specs).

Regions slower than 1 (`regions[].speed`) stand for slower hardware: each step is stretched to
1/speed of its time.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import time

import jax
import optax

from diloco.config import Config
from diloco.learners.parallel import LearnerMesh, learner_mesh
from diloco.learners.session import ENV_CONFIG, ENV_CORPUS, ENV_LEARNER, ENV_START_STEP, Session
from diloco.spec import DataShard, ModelSpec, load_spec

log = logging.getLogger(__name__)


def is_trainable(leaf) -> bool:
    """Floating-point leaves are differentiated; the rest (RNG keys and counts, integer counters and
    buffers) is state the loss may read and, with `ModelSpec.stateful`, update."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def partition(params):
    """(trainable leaves, the rest): two trees of the structure of `params`, None where the other holds a leaf."""
    trainable = jax.tree_util.tree_map(lambda x: x if is_trainable(x) else None, params)
    rest = jax.tree_util.tree_map(lambda x: None if is_trainable(x) else x, params)
    return trainable, rest


def combine(trainable, rest):
    """The inverse of `partition`."""
    return jax.tree_util.tree_map(lambda t, r: r if t is None else t, trainable, rest, is_leaf=lambda x: x is None)


def make_train_step(loss, opt: optax.GradientTransformation, *, stateful: bool = False):
    """The jitted inner step of a loss `(params, batch) -> scalar` (or, `stateful`, -> (scalar, params
    with its state updated)) under an optax optimizer, which sees the trainable leaves only."""
    @jax.jit
    def train_step(params, opt_state, batch):
        trainable, rest = partition(params)

        def objective(t):
            out = loss(combine(t, rest), batch)
            return out if stateful else (out, None)

        (value, updated), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        new_rest = partition(updated)[1] if stateful else rest
        return combine(optax.apply_updates(trainable, updates), new_rest), opt_state, value
    return train_step


def initial_params(cfg: Config, spec: ModelSpec, mesh: LearnerMesh):
    """The model's initial parameters, placed on the learner's mesh (the template `Session.join` fills)."""
    init = spec.init(cfg.model.seed)
    return mesh.shard(init, spec.partition(init) if spec.partition else None)


def compile_step(spec: ModelSpec, mesh: LearnerMesh, opt: optax.GradientTransformation, params, batch):
    """(the optimizer state placed like `params`, the inner step compiled for these shapes)."""
    opt_state = mesh.init_optimizer(opt, partition(params)[0])
    return opt_state, make_train_step(spec.loss, opt, stateful=spec.stateful).lower(params, opt_state, batch).compile()


def run(cfg: Config, run_id: str, learner_id: str, *, start_step: int = 0, spec: ModelSpec | None = None,
        mesh: LearnerMesh | None = None, **services) -> dict:
    """Train `learner_id` of the run to its step budget (or until SIGTERM); returns its summary."""
    mesh = mesh or learner_mesh(cfg)  # joins the learner's other hosts first: the session asks JAX which host it is
    total_steps = cfg.learner_steps(learner_id)
    speed = cfg.region_of(learner_id).speed
    session = Session(cfg, learner_id, run_id=run_id, start_step=start_step, **services)
    session.open()
    ok = False
    try:
        session.phase("importing")  # the model entry (a warm start's fork server has imported its module)
        spec = spec or load_spec(cfg)
        shard = DataShard(cfg.shard_index(learner_id), cfg.num_shards, start_step, cfg.data.seed,
                          jax.process_index(), jax.process_count())
        n = jax.process_count()
        feed = ((spec.tokens_in(b) * n, mesh.shard_batch(b)) for b in spec.batches(shard))  # (global tokens, on devices)
        # Compile before joining (join keeps the template's shapes, dtypes and shardings): a join
        # followed by a long compile would train its first steps from versions the run left behind
        # meanwhile, and a restarted learner's first delta would be refused as stale, its tokens lost.
        session.phase("compiling")  # the model's init, the first batch, the inner step
        template = initial_params(cfg, spec, mesh)
        tokens, batch = next(feed)
        opt_state, train_step = compile_step(spec, mesh, spec.inner_optimizer(start_step, total_steps), template, batch)
        params = session.join(template)
        del template
        log.info("parameters placed", extra={"mesh": dict(mesh.mesh.shape), "hosts": jax.process_count(),
                                             "param_bytes_per_device": mesh.bytes_per_device(params),
                                             "opt_bytes_per_device": mesh.bytes_per_device(opt_state)})
        compute_s, queued = 0.0, None
        for _ in range(start_step + 1, total_steps + 1):
            # both agreed by every host of the learner at its last step, so that all stop together
            if session.stopping or (cfg.inner.max_seconds and session.compute_s >= cfg.inner.max_seconds):
                break
            t0 = time.perf_counter()
            params, opt_state, loss = train_step(params, opt_state, batch)   # dispatched, not waited for
            trained = tokens
            tokens, batch = next(feed)
            if speed < 1:  # stands for slower hardware in this region: this step's own time, stretched
                loss.block_until_ready()
                time.sleep((time.perf_counter() - t0) * (1 / speed - 1))
            elif queued is not None:  # one step runs while the next is queued: never further ahead
                queued.block_until_ready()
            queued = loss
            dt = time.perf_counter() - t0
            compute_s += dt
            params = session.step(params, tokens=trained, loss=loss, compute_s=compute_s)
        ok = True
    finally:
        summary = session.close(hand_in=ok)
    return summary


def main(cfg: Config, run_id: str, learner_id: str, corpus_dir: str | None = None, start_step: int = 0,
         config_path: str | None = None) -> dict | None:
    """What `diloco learner` runs: the built-in loop over the model entry point, or the user's own
    script (`model.script`), which finds the run through the environment (`Session.from_env()`)."""
    if corpus_dir:
        cfg = cfg.with_corpus(corpus_dir)
    if cfg.model.script is None:
        return run(cfg, run_id, learner_id, start_step=start_step)
    os.environ.update({ENV_CONFIG: str(config_path), ENV_LEARNER: learner_id, ENV_START_STEP: str(start_step)})
    if corpus_dir:
        os.environ[ENV_CORPUS] = corpus_dir
    sys.argv = [cfg.model.script]
    log.info("running the learner script", extra={"script": cfg.model.script, "learner": learner_id})
    runpy.run_path(cfg.model.script, run_name="__main__")
    return None
