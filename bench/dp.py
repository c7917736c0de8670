"""The data-parallel baseline: M workers' gradients per step, averaged (what an all-reduce computes),
one AdamW optimizer. One JAX process stands for the M workers; its wall-clock is modelled (see clock).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco.config import Config
from diloco.learners.data import Corpus, sample_batches
from diloco.models.transformer import adamw as inner_optimizer
from diloco.models.transformer import evaluate, init_params, loss_fn


def make_dp_step(cfg: Config, opt: optax.GradientTransformation):
    per_worker = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0, None))

    @jax.jit
    def step(params, opt_state, batches):                   # batches (M, B, T + 1)
        losses, grads = per_worker(params, batches, cfg.model.transformer)
        grads = jax.tree_util.tree_map(lambda g: g.mean(axis=0), grads)  # the all-reduce
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses.mean()
    return step


def worker_batches(cfg: Config, corpus: Corpus) -> list:
    """Each of the M workers' batch stream: its own shard, seeded as a learner's first incarnation."""
    return [sample_batches(corpus.train_tokens(i), batch_size=cfg.inner.batch_size, seq_len=cfg.model.transformer.seq_len,
                           seed=(cfg.data.seed, i, 0, 0)) for i in range(cfg.num_learners)]


def train_dp(cfg: Config, corpus: Corpus, held: np.ndarray, evals: int = 8) -> dict:
    """Train for cfg.inner.steps steps on every worker's shard (same seeds as the learners) and
    evaluate `evals` times; returns the loss curve against steps and tokens, and the step time."""
    M = cfg.num_learners
    params = {k: jnp.asarray(v) for k, v in init_params(cfg.model.transformer, cfg.model.seed).items()}
    opt = inner_optimizer(cfg)
    opt_state = opt.init(params)
    streams = worker_batches(cfg, corpus)
    step_fn = make_dp_step(cfg, opt)
    tokens_per_step = M * cfg.inner.batch_size * cfg.model.transformer.seq_len
    steps = cfg.inner.steps
    eval_at = set(np.linspace(0, steps, evals + 1).astype(int).tolist())
    curve = {"step": [0], "tokens": [0], "loss": [evaluate(params, held, cfg.model.transformer)]}
    batches = jnp.asarray(np.stack([next(s) for s in streams]))
    step_fn(params, opt_state, batches)[2].block_until_ready()  # compile outside the clock
    compute_s = 0.0
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        params, opt_state, loss = step_fn(params, opt_state, batches)
        loss.block_until_ready()
        compute_s += time.perf_counter() - t0
        batches = jnp.asarray(np.stack([next(st) for st in streams]))
        if s in eval_at:
            curve["step"].append(s)
            curve["tokens"].append(s * tokens_per_step)
            curve["loss"].append(evaluate(params, held, cfg.model.transformer))
    return {"curve": curve, "steps": steps, "tokens": steps * tokens_per_step,
            "measured_step_s": compute_s / steps, "worker_step_s": compute_s / steps / M}
