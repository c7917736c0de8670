"""A decoder-only transformer LM in plain JAX, parameters as a flat dict of named arrays.

Single-device code, read top to bottom (nanoGPT style). A flat dict keeps fragment planning,
TensorStore layout and the wire format free of pytree plumbing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from diloco.config import ModelConfig

Params = dict[str, jax.Array]


def init_params(cfg: ModelConfig, seed: int | None = None) -> dict[str, np.ndarray]:
    key = jax.random.PRNGKey(cfg.seed if seed is None else seed)
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
    params = {}
    for name, (shape, scale) in sorted(shapes.items()):
        key, sub = jax.random.split(key)
        params[name] = np.ones(shape, np.float32) if scale is None else np.asarray(
            scale * jax.random.normal(sub, shape, jnp.float32))
    return params


def _layer_norm(x, scale):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * scale


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """tokens (B, T) int -> logits (B, T, V)."""
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


def loss_fn(params: Params, batch: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Mean next-token cross-entropy (nats) over a (B, T + 1) batch of token ids."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(params, inputs, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def evaluate(params: Params, batches: np.ndarray, cfg: ModelConfig) -> float:
    """Mean loss over a fixed stack of (N, B, T + 1) held-out batches."""
    fn = jax.jit(lambda p, b: loss_fn(p, b, cfg))
    return float(np.mean([float(fn(params, jnp.asarray(b))) for b in batches]))
