"""The built-in model: a decoder-only transformer LM in plain JAX, parameters a flat dict of arrays.

Single-device code, read top to bottom (nanoGPT style). It is a `model.entry` like any user's:
`spec(cfg)` returns its ModelSpec (init, loss, AdamW, token-shard batches, held-out batches), with
its options in `model.options` (diloco.config.TransformerOptions).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from diloco.config import Config, TransformerOptions
from diloco.spec import DataShard, ModelSpec

Params = dict[str, jax.Array]


def init_params(cfg: TransformerOptions, seed: int = 0) -> dict[str, np.ndarray]:
    key = jax.random.PRNGKey(seed)
    d, f = cfg.d_model, cfg.d_model * cfg.mlp_ratio
    std = 0.02
    proj_std = std / math.sqrt(2 * cfg.n_layers)  # residual projections scaled down (GPT-2)
    shapes: dict[str, tuple[tuple[int, ...], float | None]] = {
        "tok_embed": ((cfg.vocab_size, d), std),
        "pos_embed": ((cfg.seq_len, d), std),
        "ln_f": ((d,), None),
    }
    for i in range(cfg.n_layers):
        shapes |= {
            f"layer{i}.ln1": ((d,), None),
            f"layer{i}.qkv": ((d, 3 * d), std),
            f"layer{i}.proj": ((d, d), proj_std),
            f"layer{i}.ln2": ((d,), None),
            f"layer{i}.fc1": ((d, f), std),
            f"layer{i}.fc2": ((f, d), proj_std),
        }
    dtype = ml_dtypes.bfloat16 if cfg.dtype == "bfloat16" else np.float32
    params = {}
    for name, (shape, scale) in sorted(shapes.items()):
        key, sub = jax.random.split(key)
        value = np.ones(shape, np.float32) if scale is None else np.asarray(
            scale * jax.random.normal(sub, shape, jnp.float32))
        params[name] = value.astype(dtype)
    return params


def _layer_norm(x, scale):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * scale


def forward(params: Params, tokens: jax.Array, cfg: TransformerOptions) -> jax.Array:
    """tokens (B, T) int -> logits (B, T, V), computed in float32 whatever the parameter dtype."""
    params = {k: v.astype(jnp.float32) for k, v in params.items()}
    B, T = tokens.shape
    H, D = cfg.n_heads, cfg.d_model
    x = params["tok_embed"][tokens] + params["pos_embed"][:T]           # (B, T, D)
    causal = jnp.tril(jnp.ones((T, T), bool))
    for i in range(cfg.n_layers):
        h = _layer_norm(x, params[f"layer{i}.ln1"])
        q, k, v = jnp.split(h @ params[f"layer{i}.qkv"], 3, axis=-1)   # 3 x (B, T, D)
        q, k, v = (a.reshape(B, T, H, D // H).transpose(0, 2, 1, 3) for a in (q, k, v))  # (B, H, T, Dh)
        att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(D // H)          # (B, H, T, T)
        att = jax.nn.softmax(jnp.where(causal, att, -1e30), axis=-1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, D)            # (B, T, D)
        x = x + y @ params[f"layer{i}.proj"]
        h = _layer_norm(x, params[f"layer{i}.ln2"])
        x = x + jax.nn.gelu(h @ params[f"layer{i}.fc1"]) @ params[f"layer{i}.fc2"]
    x = _layer_norm(x, params["ln_f"])
    return x @ params["tok_embed"].T                                     # tied output embedding


def loss_fn(params: Params, batch: jax.Array, cfg: TransformerOptions) -> jax.Array:
    """Mean next-token cross-entropy (nats) over a (B, T + 1) batch of token ids."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(params, inputs, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


_held_out_loss = jax.jit(loss_fn, static_argnames="cfg")  # one compilation per model shape, however often it runs


def evaluate(params: Params, batches: np.ndarray, cfg: TransformerOptions) -> float:
    """Mean loss over a fixed stack of (N, B, T + 1) held-out batches."""
    return float(np.mean([float(_held_out_loss(params, jnp.asarray(b), cfg=cfg)) for b in batches]))


def adamw(cfg: Config, start_step: int = 0, steps: int | None = None) -> optax.GradientTransformation:
    """AdamW on warmup + cosine decay over `steps` (default inner.steps). A learner restarted at
    `start_step` continues the schedule from there, warming up again because its Adam moments start
    from zero. The start step is in the optimizer state, not in the compiled step, so that one
    compiled step serves every start step (a warm spare compiles it before it knows its own)."""
    warmup = max(cfg.inner.warmup_steps, 1)
    sched = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.inner.lr, warmup_steps=warmup,
        decay_steps=max(steps or cfg.inner.steps, warmup + 1), end_value=cfg.inner.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.inner.grad_clip),
                       optax.scale_by_adam(b1=0.9, b2=0.95),
                       optax.add_decayed_weights(cfg.inner.weight_decay),
                       _scale_by_resumed_schedule(sched, warmup, start_step))


class ResumedScheduleState(NamedTuple):
    count: jax.Array   # steps taken since the learner (re)started
    start: jax.Array   # the step it started from: 0, or where a restarted learner resumed


def _scale_by_resumed_schedule(sched, warmup: int, start_step: int) -> optax.GradientTransformation:
    """optax.scale_by_learning_rate(sched) continued from `start_step`, with a new warmup after a restart."""
    def init(params):
        del params
        return ResumedScheduleState(jnp.zeros([], jnp.int32), jnp.asarray(start_step, jnp.int32))

    def update(updates, state, params=None):
        del params
        rewarm = jnp.where(state.start > 0, jnp.minimum(1.0, (state.count + 1) / warmup), 1.0)
        lr = -sched(state.count + state.start) * rewarm
        updates = jax.tree_util.tree_map(lambda g: jnp.array(lr, dtype=g.dtype) * g, updates)
        return updates, ResumedScheduleState(optax.safe_increment(state.count), state.start)

    return optax.GradientTransformation(init, update)


def partition(params: Params):
    """Megatron-style placement on the learner's mesh: the first matrix of each block split by its
    columns over `tensor` and the second by its rows, both sharded over `fsdp` along the other
    axis; embeddings over fsdp; norms replicated."""
    from jax.sharding import PartitionSpec as P

    def spec(name: str) -> P:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("qkv", "fc1"):
            return P("fsdp", "tensor")
        if leaf in ("proj", "fc2"):
            return P("tensor", "fsdp")
        if leaf in ("tok_embed", "pos_embed"):
            return P("fsdp", None)
        return P()
    return {name: spec(name) for name in params}


def spec(cfg: Config) -> ModelSpec:
    """The built-in transformer on the run's token shards (model.options: TransformerOptions)."""
    from diloco.learners.data import eval_batches, shard_batches
    from diloco.pipelines.prepared import corpus_for

    opts = cfg.model.transformer

    def batches(shard: DataShard):
        return shard_batches(corpus_for(cfg).train_tokens(shard.index), shard,
                             batch_size=cfg.inner.batch_size // shard.processes, seq_len=opts.seq_len)

    def held_out():
        return eval_batches(corpus_for(cfg).heldout_tokens(), n_batches=cfg.run.eval_batches,
                            batch_size=cfg.run.eval_batch_size, seq_len=opts.seq_len)

    return ModelSpec(
        init=lambda seed: init_params(opts, seed),
        loss=lambda params, batch: loss_fn(params, batch, opts),
        optimizer=lambda start_step, total_steps: adamw(cfg, start_step, total_steps),
        batches=batches,
        tokens=lambda batch: batch.shape[0] * (batch.shape[1] - 1),
        eval_batches=held_out,
        mean_merge=("tok_embed", "pos_embed"),
        vocab_size=opts.vocab_size,
        partition=partition,
    )
