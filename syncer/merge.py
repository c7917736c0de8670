"""The merge math, as small pure functions (optax style).

- token weights: w_m = tokens_m * (tokens_m / steps_m), normalised;
- radial-directional averaging (RDA) per tensor: mean norm times the unit of the mean direction,
  so that the merged norm does not shrink like 1/sqrt(M) for near-orthogonal deltas; it averages
  learners, so a learner's several contributions to one round are summed into one delta first
  (`by_learner`);
- plain weighted mean for the tensors named in `mean_names` (embeddings);
- the outer optimizer: SGD with Nesterov momentum from optax, fed the merged delta as its gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
import optax

_CANCELLED = 1e-6  # norm of the mean unit direction below which it is rounding noise
_NO_DIRECTION = 1e-30  # a delta shorter than this has no direction float32 can hold (1/norm overflows)


def token_weights(tokens: Sequence[float], steps: Sequence[float], weighted: bool = True) -> np.ndarray:
    """Dynamic token weighting, normalised to sum to 1: w = tokens * tokens / steps (equal if not weighted)."""
    t = np.asarray(tokens, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    if len(t) == 0 or np.any(t <= 0) or np.any(s <= 0):
        raise ValueError("token weights need positive tokens and steps for every contribution")
    w = t * (t / s) if weighted else np.ones_like(t)
    return w / w.sum()


def bounded_tokens(tokens: Sequence[float], steps: Sequence[float], spread: float) -> list[float]:
    """Tokens as weighed: each contribution's tokens per step at most `spread` times the round's
    lowest, so that one writer that claims more (a forged manifest, a learner counting bytes for
    tokens) cannot take a round's weight (w grows as tokens^2). Learners of one run train batches of
    one shape, so honest contributions differ little; 0 = claims as they are."""
    if spread <= 0 or len(tokens) < 2:
        return list(tokens)
    floor = min(t / s for t, s in zip(tokens, steps))
    return [min(t, spread * floor * s) for t, s in zip(tokens, steps)]


def staleness_weights(weights: Sequence[float], staleness: Sequence[int], discount: float) -> np.ndarray:
    """Weights times (1 + staleness) ** -discount, normalised to sum to 1. A contribution's staleness
    is how many versions its fragment gained since the base it was trained from; discount 0 leaves
    the weights as they are, 1 halves a delta one version late against the fresh ones."""
    w, s = np.asarray(weights, np.float64), np.asarray(staleness, np.float64)
    if len(w) != len(s) or np.any(s < 0) or discount < 0:
        raise ValueError("staleness weights need one staleness >= 0 per weight and a discount >= 0")
    w = w * (1.0 + s) ** -discount
    return w / w.sum()


def round_momentum(momentum: float, share: float) -> float:
    """The outer momentum of a round that carries `share` of a full round's deltas (round_share):
    momentum ** share, so that the trace decays by `momentum` per full round's worth of deltas
    whether they come in one round or in several partial ones (two rounds of share 1/2 decay it
    as one full round does)."""
    if not 0 <= momentum < 1 or share < 0:
        raise ValueError(f"round momentum needs 0 <= momentum < 1 and share >= 0, got {momentum}, {share}")
    return momentum ** share if momentum > 0 else 0.0


def weighted_mean(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    return np.tensordot(np.asarray(weights, np.float32), np.stack(deltas).astype(np.float32), axes=1)


def by_learner(deltas: Sequence[np.ndarray], weights: np.ndarray, learners: Sequence[str] | None
               ) -> tuple[list[np.ndarray], np.ndarray]:
    """(one delta per learner, its weight): a learner's contributions to one round are successive
    pieces of its own progress (each measured from what it sent last), so their sum is its delta and
    their weights add up (tokens^2/steps of the union is the sum of the parts' at one step rate).
    Learners in order of first appearance; None: every contribution is its own learner."""
    w = np.asarray(weights, np.float64)
    if learners is None or len(set(learners)) == len(learners):
        return [np.asarray(d, np.float32) for d in deltas], w
    if len(learners) != len(deltas):
        raise ValueError(f"{len(learners)} learner names for {len(deltas)} deltas")
    order = list(dict.fromkeys(learners))
    summed = {lid: np.zeros(np.shape(deltas[0]), np.float32) for lid in order}
    total = dict.fromkeys(order, 0.0)
    for d, wm, lid in zip(deltas, w, learners):
        summed[lid] += np.asarray(d, np.float32)
        total[lid] += float(wm)
    return [summed[lid] for lid in order], np.array([total[lid] for lid in order])


def learner_share(share: float, learners: Sequence[str] | None) -> float:
    """RDA's share of a round: `share` is per contribution (n/M, round_share), RDA counts learners
    (G/M for G distinct learners among the n), so that a round never moves more than a full one."""
    if not learners:
        return share
    return share * len(set(learners)) / len(learners)


def rda(deltas: Sequence[np.ndarray], weights: np.ndarray, learners: Sequence[str] | None = None) -> np.ndarray:
    """Radial-directional average over learners: (sum w|D|) / sum w  *  unit(sum w unit(D))."""
    deltas, w = by_learner(deltas, weights, learners)
    stack = np.stack(deltas).astype(np.float32)
    norms = np.sqrt(np.sum(stack.reshape(len(deltas), -1).astype(np.float64) ** 2, axis=1))
    radius = float(np.sum(w * norms) / np.sum(w))
    has = norms > _NO_DIRECTION  # an all-zero (or vanishing) delta has no direction and adds none
    shape = (-1,) + (1,) * (stack.ndim - 1)
    units = np.where(has.reshape(shape), stack / np.where(has, norms, 1.0).reshape(shape), 0).astype(np.float32)
    direction = np.tensordot((w / np.sum(w)).astype(np.float32), units, axes=1)
    dnorm = float(np.sqrt(np.sum(direction.astype(np.float64) ** 2)))
    if dnorm < _CANCELLED:  # a mean of unit vectors this short: the deltas cancel, no direction to move in
        return np.zeros_like(direction)
    return (radius / dnorm * direction).astype(np.float32)


def merge_deltas(contributions: Sequence[Mapping[str, np.ndarray]], weights: np.ndarray,
                 mean_names: Sequence[str] = (), rule: str = "rda", learners: Sequence[str] | None = None,
                 share: float = 1.0) -> dict[str, np.ndarray]:
    """Merge per-tensor: RDA by default (over `learners`, times learner_share), weighted mean (times
    `share`) for tensors in `mean_names` or for every tensor when rule="mean" (the plain average of
    synchronous DiLoCo)."""
    if rule not in ("rda", "mean"):
        raise ValueError(f"unknown merge rule {rule!r}")
    names = contributions[0].keys()
    out = {}
    for name in names:
        tensors = [c[name] for c in contributions]
        plain = rule == "mean" or name in mean_names
        out[name] = (weighted_mean(tensors, weights) * np.float32(share) if plain else
                     rda(tensors, weights, learners) * np.float32(learner_share(share, learners)))
    return out


def round_share(contributions: int, expected_learners: int) -> float:
    """The share of a full round's progress that a round with this many contributions carries.

    A round that closes with n contributions of the M expected learners applies n/M of its merged
    (weighted-mean) delta, so that each delta counts 1/M of itself whichever round it lands in; RDA,
    which averages learners, applies G/M for the G learners among them (learner_share). Without it, K < M rounds take about
    M/K full outer steps per sync period where synchronous DiLoCo takes one.
    """
    return contributions / max(expected_learners, 1)


def as_float32(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outer optimizer's state lives in float32 whatever the parameters' dtype."""
    return {k: np.asarray(v, np.float32) for k, v in arrays.items()}


def outer_optimizer(lr: float, momentum: float, nesterov: bool) -> optax.GradientTransformation:
    return optax.sgd(learning_rate=lr, momentum=momentum or None, nesterov=nesterov and momentum > 0)


def outer_step(opt: optax.GradientTransformation, params: Mapping[str, np.ndarray], state: optax.OptState,
               delta: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], optax.OptState]:
    """One outer step: the merged delta (global - local) plays the role of a gradient."""
    updates, state = opt.update(dict(delta), state, dict(params))
    new = optax.apply_updates({k: np.asarray(v, np.float32) for k, v in params.items()}, updates)
    return {k: np.asarray(v).astype(np.asarray(params[k]).dtype) for k, v in new.items()}, state  # dtypes kept


def _path_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


def flatten_state(state: optax.OptState) -> dict[str, np.ndarray]:
    """Optimizer state as named arrays (what goes to TensorStore), e.g. `0.trace.layer0.qkv`."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {_path_name(path): np.asarray(leaf) for path, leaf in leaves}


def unflatten_state(template: optax.OptState, arrays: Mapping[str, np.ndarray]) -> optax.OptState:
    """Fill a state of the same structure as `template` from named arrays."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [_path_name(p) for p, _ in paths if _path_name(p) not in arrays]
    if missing:
        raise KeyError(f"optimizer state lacks {missing}")
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(arrays[_path_name(p)]) for p, _ in paths])
