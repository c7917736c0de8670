"""A plain-pytree model: nested dicts and lists of arrays, a bfloat16 embedding, a dict batch
(tokens plus a loss mask), an optax optimizer other than AdamW (SGD with Nesterov momentum), and a
float leaf kept local (never synced).

    python examples/pytree_mlp_lm.py [key=value ...]   # needs `diloco infra up` (the broker and Redis)

The model predicts the next byte from the previous CONTEXT bytes with an MLP.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

import diloco
from diloco.learners.data import eval_batches, shard_batches
from diloco.pipelines.prepared import corpus_for

CONTEXT, VOCAB, D, HIDDEN = 8, 256, 32, 128


def init(seed: int) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": np.asarray(0.02 * jax.random.normal(k[0], (VOCAB, D))).astype(ml_dtypes.bfloat16),  # bf16 end to end
        "mlp": [{"w": np.asarray(jax.random.normal(k[1], (CONTEXT * D, HIDDEN)) / np.sqrt(CONTEXT * D)),
                 "b": np.zeros(HIDDEN, np.float32)},
                {"w": np.asarray(jax.random.normal(k[2], (HIDDEN, VOCAB)) / np.sqrt(HIDDEN)),
                 "b": np.zeros(VOCAB, np.float32)}],
        "stats": {"tokens_seen": np.zeros((), np.float32)},            # local: marked below, never synced
    }


def loss(params: dict, batch: dict) -> jax.Array:
    """batch["tokens"] (B, T + 1) ids, batch["mask"] (B, T) 1 where the target counts."""
    tokens = batch["tokens"]
    windows = jnp.stack([tokens[:, i:i + tokens.shape[1] - CONTEXT] for i in range(CONTEXT)], axis=-1)  # (B, N, C)
    targets = tokens[:, CONTEXT:]                                       # (B, N)
    x = params["embed"].astype(jnp.float32)[windows].reshape(*windows.shape[:2], CONTEXT * D)
    h = jax.nn.relu(x @ params["mlp"][0]["w"] + params["mlp"][0]["b"])
    logits = h @ params["mlp"][1]["w"] + params["mlp"][1]["b"]         # (B, N, V)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mask = batch["mask"][:, CONTEXT - 1:]
    return (ce * mask).sum() / jnp.maximum(mask.sum(), 1) + 0.0 * params["stats"]["tokens_seen"]


def with_mask(tokens: np.ndarray) -> dict:
    """Targets that are the document separator (0) do not count."""
    return {"tokens": tokens, "mask": (tokens[:, 1:] != 0).astype(np.float32)}


def spec(cfg: diloco.Config) -> diloco.ModelSpec:
    seq = 32
    corpus = lambda: corpus_for(cfg)  # noqa: E731

    def batches(shard: diloco.DataShard):
        stream = shard_batches(corpus().train_tokens(shard.index), shard, batch_size=cfg.inner.batch_size, seq_len=seq)
        return map(with_mask, stream)

    return diloco.ModelSpec(
        init=init,
        loss=loss,
        optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9, nesterov=True)),
        batches=batches,
        tokens=lambda batch: int(batch["mask"].sum()),                 # what the loss trains on
        eval_batches=lambda: [with_mask(b) for b in eval_batches(corpus().heldout_tokens(), n_batches=4,
                                                                 batch_size=8, seq_len=seq)],
        local=("stats.*",),
        vocab_size=VOCAB,
    )


if __name__ == "__main__":
    # the learners import this file as the module `pytree_mlp_lm`, from its own folder, as Python did here
    cfg = diloco.configure(model={"entry": f"{Path(__file__).stem}:spec"}, inner={"steps": 200},
                           overrides=sys.argv[1:])
    summary = diloco.train(cfg)
    print(f"held-out loss {summary['eval_loss_start']:.3f} -> {summary['eval_loss_end']:.3f}")
