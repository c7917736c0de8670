"""Ideal DiLoCo: the method with no system around it, a reference row of the healthy scenario.

The M learners train in one process (vmapped, the same seeds and shards as the real learners and as
data-parallel). At each fragment's sync point every learner's fp32 delta is merged by the run's rule
(RDA or plain mean, token weights) and the outer step applied at once: no quorum, no grace window,
no quantization, no merge latency. Its gap to data-parallel is what the method itself costs at this
size; a DiLoCo run's gap beyond it is what quorum, staleness and compression add.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.dp import worker_batches
from diloco.config import Config
from diloco.fragments import fragments_due
from diloco.learners.data import Corpus
from diloco.learners.learner import make_train_step
from diloco.models.transformer import adamw as inner_optimizer
from diloco.models.transformer import evaluate, loss_fn
from diloco.plan import Plan, flatten
from diloco.spec import initial_plan, load_spec
from diloco.syncer import merge


def outer_round(cfg: Config, plan: Plan, glob: dict[str, np.ndarray], names: list[str],
                local: dict[str, np.ndarray], opt: optax.GradientTransformation, state: optax.OptState, steps: int):
    """Merge every learner's delta of one fragment (local[n] stacked by learner), each `steps`
    inner steps long, and take the outer step; returns (new global tensors of the fragment, outer state)."""
    M = cfg.num_learners
    deltas = [{n: glob[n] - local[n][i] for n in names} for i in range(M)]
    tokens = steps * cfg.inner.batch_size * cfg.model.transformer.seq_len
    weights = merge.token_weights([tokens] * M, [steps] * M, cfg.syncer.token_weighting)
    merged = merge.merge_deltas(deltas, weights, plan.mean_merged, rule=cfg.syncer.merge)
    return merge.outer_step(opt, {n: glob[n] for n in names}, state, merged)


def train_ideal(cfg: Config, corpus: Corpus, held: np.ndarray, evals: int = 8) -> dict:
    """Run cfg.inner.steps inner steps on every learner; the held-out loss of the global model at
    `evals` points, against tokens (all learners)."""
    M, P, H, steps = cfg.num_learners, cfg.fragments.count, cfg.fragments.sync_every, cfg.inner.steps
    run_plan, tree = initial_plan(cfg, load_spec(cfg))
    plan = run_plan.fragment_names
    glob = {k: np.asarray(v, np.float32) for k, v in flatten(tree, run_plan).items()}
    opts = cfg.model.transformer
    inner = inner_optimizer(cfg)
    local = {k: jnp.stack([jnp.asarray(v)] * M) for k, v in glob.items()}
    inner_state = jax.vmap(inner.init)(local)
    step_fn = jax.jit(jax.vmap(make_train_step(lambda p, b: loss_fn(p, b, opts), inner)))  # every learner's step at once, stacked on axis 0
    outer = merge.outer_optimizer(cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
    outer_state = [outer.init({n: glob[n] for n in names}) for names in plan]
    streams = worker_batches(cfg, corpus, cfg.learner_ids())
    tokens_per_step = M * cfg.inner.batch_size * opts.seq_len
    eval_at = set(np.linspace(0, steps, evals + 1).astype(int).tolist())
    curve = {"step": [0], "tokens": [0], "loss": [evaluate(glob, held, opts)]}
    last = {p: 0 for p in range(P)}
    for s in range(1, steps + 1):
        local, inner_state, _ = step_fn(local, inner_state, jnp.asarray(np.stack([next(st) for st in streams])))
        # at the end every fragment hands in its steps since its last sync, as the learners do
        due = fragments_due(s, P, H) if s < steps else [p for p in range(P) if last[p] < s]
        for p in due:
            names = plan[p]
            new, outer_state[p] = outer_round(cfg, run_plan, glob, names, {n: np.asarray(local[n]) for n in names},
                                              outer, outer_state[p], s - last[p])
            glob.update(new)
            local = {**local, **{n: jnp.stack([jnp.asarray(new[n])] * M) for n in names}}
            last[p] = s
        if s in eval_at:
            curve["step"].append(s)
            curve["tokens"].append(s * tokens_per_step)
            curve["loss"].append(evaluate(glob, held, opts))
    return {"curve": curve, "steps": steps, "tokens": steps * tokens_per_step}


def as_result(cfg: Config, ideal: dict) -> dict:
    """The bench's result shape; no clock, bytes or goodput: nothing ran but the math."""
    curve = dict(ideal["curve"], time_s=[float("nan")] * len(ideal["curve"]["loss"]))
    return {"run_id": None, "curve": curve, "tokens": ideal["tokens"], "loss_end": curve["loss"][-1],
            "bytes_sent": None, "bytes_fetched": 0, "bytes_dp": None, "goodput": None, "idle": None,
            "merge": None, "time_s": None}
