"""The data-parallel baseline: M workers' gradients per step, averaged (what an all-reduce computes),
one AdamW optimizer. One JAX process stands for the M workers; its wall-clock is modelled
(bench.runs.dp_in_scenario). Workers that join (run.joins) make the global batch grow from that step.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco import membership
from diloco.config import Config
from diloco.learners.data import shard_batches
from diloco.models.transformer import adamw as inner_optimizer
from diloco.models.transformer import evaluate, init_params, loss_fn
from diloco.shard_format import Corpus
from diloco.spec import DataShard


def make_dp_step(cfg: Config, opt: optax.GradientTransformation):
    per_worker = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0, None))

    @jax.jit
    def step(params, opt_state, batches):                   # batches (M, B, T + 1)
        losses, grads = per_worker(params, batches, cfg.model.transformer)
        grads = jax.tree_util.tree_map(lambda g: g.mean(axis=0), grads)  # the all-reduce
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses.mean()
    return step


def worker_batches(cfg: Config, corpus: Corpus, workers: list[str]) -> list:
    """Each worker's batch stream: the shard of the learner it stands for, read as that learner's
    first incarnation reads it."""
    return [shard_batches(corpus.train_tokens(cfg.shard_index(w)),
                          DataShard(cfg.shard_index(w), cfg.num_shards, seed=cfg.data.seed),
                          batch_size=cfg.inner.batch_size, seq_len=cfg.model.transformer.seq_len)
            for w in workers]


def phases(cfg: Config) -> list[tuple[int, tuple[str, ...]]]:
    """Data-parallel's run as (steps, workers) phases. Without run.token_budget: inner.steps steps of
    the starting learners' workers. With it: the workers of run.joins join at the step their share of
    the budget is trained (the same ids the runner gives the joining learners), and the last phase
    runs until the budget is (the step that crosses it counts whole)."""
    workers = tuple(cfg.learner_ids())
    budget = cfg.run.token_budget
    if budget is None:
        return [(cfg.inner.steps, workers)]
    per_worker_step = cfg.inner.batch_size * cfg.model.transformer.seq_len
    out, tokens = [], 0
    for join in sorted(cfg.run.joins, key=lambda j: j.at_tokens_fraction):
        steps = math.ceil(max(0, join.at_tokens_fraction * budget - tokens) / (len(workers) * per_worker_step))
        if steps:
            out.append((steps, workers))
            tokens += steps * len(workers) * per_worker_step
        region = next(r for r in cfg.regions if r.name == join.region)
        workers += tuple(membership.free_ids(region, workers)[:join.count])
    out.append((math.ceil(max(0, budget - tokens) / (len(workers) * per_worker_step)), workers))
    return out


def train_dp(cfg: Config, corpus: Corpus, held: np.ndarray, evals: int = 8) -> dict:
    """Train the steps of `phases(cfg)` on every worker's shard (same seeds as the learners) and
    evaluate `evals` times; returns the loss curve against steps and tokens, the phases and the
    compute time per worker step."""
    params = {k: jnp.asarray(v) for k, v in init_params(cfg.model.transformer, cfg.model.seed).items()}
    opt = inner_optimizer(cfg)
    opt_state = opt.init(params)
    plan = phases(cfg)
    everyone = list(plan[-1][1])
    streams = dict(zip(everyone, worker_batches(cfg, corpus, everyone)))
    step_fn = make_dp_step(cfg, opt)
    per_worker_step = cfg.inner.batch_size * cfg.model.transformer.seq_len
    steps = sum(n for n, _ in plan)
    eval_at = set(np.linspace(0, steps, evals + 1).astype(int).tolist())
    curve = {"step": [0], "tokens": [0], "loss": [evaluate(params, held, cfg.model.transformer)]}
    shape = (cfg.inner.batch_size, cfg.model.transformer.seq_len + 1)
    for _, workers in plan:  # compile each worker count outside the clock (batches are int32, as shard_batches')
        step_fn(params, opt_state, jnp.zeros((len(workers), *shape), jnp.int32))[2].block_until_ready()
    compute_s, s, tokens = 0.0, 0, 0
    for n, workers in plan:
        for _ in range(n):
            batches = jnp.asarray(np.stack([next(streams[w]) for w in workers]))
            t0 = time.perf_counter()
            params, opt_state, loss = step_fn(params, opt_state, batches)
            loss.block_until_ready()
            compute_s += time.perf_counter() - t0
            s, tokens = s + 1, tokens + len(workers) * per_worker_step
            if s in eval_at:
                curve["step"].append(s)
                curve["tokens"].append(tokens)
                curve["loss"].append(evaluate(params, held, cfg.model.transformer))
    return {"curve": curve, "steps": steps, "tokens": tokens, "phases": plan, "measured_step_s": compute_s / steps,
            "worker_step_s": compute_s / sum(n * len(w) for n, w in plan)}
