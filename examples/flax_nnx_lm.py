"""Your own Flax NNX model trained with Decoupled DiLoCo on the local stack, on the library's defaults.

    python examples/flax_nnx_lm.py [key=value ...]   # needs `diloco infra up` (the broker and Redis)

The config names `spec` below as the model entry point; every learner process calls it. The model is
a small causal transformer LM in Flax NNX on the run's byte-level token shards, with dropout (its RNG
key and count are state the loss updates) and an integer step counter: only the float parameters are
trained and synced, the rest stays on each learner. Arguments are config overrides
(`inner.steps=400`, `transport.bootstrap_servers=host:port`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import diloco
from diloco.learners.data import eval_batches, shard_batches
from diloco.pipelines.prepared import corpus_for

SEQ, VOCAB = 32, 256


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)                         # RNG state: a key and a uint32 count

    def __call__(self, x):                                              # (B, T, D)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.drop(self.attn(self.ln1(x), mask=mask))
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.ln2(x)))))


class LM(nnx.Module):
    def __init__(self, d: int = 32, heads: int = 2, layers: int = 1, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, d)))
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))            # an int counter: state, never synced

    def __call__(self, tokens):                                         # (B, T) -> (B, T, V)
        self.calls[...] += 1
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln(x))


def spec(cfg: diloco.Config) -> diloco.ModelSpec:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LM(rngs=nnx.Rngs(0))))

    def loss(state, batch):                                             # batch (B, T + 1) token ids
        model = nnx.merge(graphdef, state)
        logits = model(batch[:, :-1])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return xent, nnx.state(model)                                   # stateful: dropout's RNG count moved on

    def eval_loss(state, batch):                                        # no dropout on held-out batches
        model = nnx.merge(graphdef, state)
        model.eval()
        return optax.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:]).mean()

    corpus = lambda: corpus_for(cfg)  # noqa: E731  (opened where it is used: in each learner)
    return diloco.ModelSpec(
        init=lambda seed: nnx.split(LM(rngs=nnx.Rngs(seed, dropout=seed + 1)))[1],  # an nnx.State pytree
        loss=loss,
        stateful=True,
        eval_loss=eval_loss,
        optimizer=optax.adamw(3e-3, weight_decay=0.1),
        batches=lambda shard: shard_batches(corpus().train_tokens(shard.index), shard, batch_size=cfg.inner.batch_size,
                                            seq_len=SEQ),
        tokens=lambda batch: batch.shape[0] * (batch.shape[1] - 1),
        eval_batches=lambda: eval_batches(corpus().heldout_tokens(), n_batches=4, batch_size=8, seq_len=SEQ),
        mean_merge=("embed.*", "pos"),                                  # embeddings: plain mean, not RDA
        vocab_size=VOCAB,
    )


if __name__ == "__main__":
    # the learners import this file as the module `flax_nnx_lm`, from its own folder, as Python did here
    cfg = diloco.configure(model={"entry": f"{Path(__file__).stem}:spec"}, inner={"steps": 200},
                           overrides=sys.argv[1:])
    summary = diloco.train(cfg)
    print(f"held-out loss {summary['eval_loss_start']:.3f} -> {summary['eval_loss_end']:.3f}")
