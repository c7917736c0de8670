"""Ideal DiLoCo: the method with no system around it, a reference row of the healthy scenario.

The M learners train in one process (vmapped, the same seeds and shards as the real learners and as
data-parallel). At each fragment's sync point every learner's fp32 delta is merged by the run's rule
(RDA or plain mean, token weights) and the outer step applied at once: no quorum, no grace window,
no quantization, no merge latency. Its gap to data-parallel is what the method itself costs at this
size; a DiLoCo run's gap beyond it is what quorum, staleness and compression add.

With `late_share` > 0 it also plays the one thing asynchrony does to the math: each learner's delta
misses its round with that probability (seeded; at least K per round still arrive) and is merged into
its fragment's next round, one version late, weighed by syncer.staleness_discount. Meanwhile every
learner goes on from the new global without its late delta, as a real learner does. This separates
what staleness costs from what the testbed adds (docs/bench.md, issue 21).
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
                contributions: list[tuple[dict[str, np.ndarray], int, int]], opt: optax.GradientTransformation,
                state: optax.OptState):
    """Merge one fragment's round, each contribution (delta tensors, inner steps, staleness in
    versions), by the run's rule and weights, and take the outer step, as the syncer does;
    returns (new global tensors of the fragment, outer state)."""
    sc, per_step = cfg.syncer, cfg.inner.batch_size * cfg.model.transformer.seq_len
    steps = [s for _, s, _ in contributions]
    weights = merge.token_weights([s * per_step for s in steps], steps, sc.token_weighting)
    weights = merge.staleness_weights(weights, [a for *_, a in contributions], sc.staleness_discount)
    merged = merge.merge_deltas([d for d, _, _ in contributions], weights, plan.mean_merged, rule=sc.merge)
    share = merge.round_share(len(contributions), cfg.num_learners) if sc.scale_partial_rounds else 1.0
    return merge.outer_step(opt, {n: glob[n] for n in names}, state, {n: share * d for n, d in merged.items()})


def late_mask(rng: np.random.Generator, learners: int, quorum: int, late_share: float) -> np.ndarray:
    """Which learners' deltas miss this round: each with probability late_share, but never so many
    that fewer than `quorum` arrive (a round does not close without them)."""
    late = rng.random(learners) < late_share
    extra = int(late.sum()) - (learners - min(quorum, learners))
    if extra > 0:
        late[rng.permutation(np.flatnonzero(late))[:extra]] = False
    return late


def train_ideal(cfg: Config, corpus: Corpus, held: np.ndarray, evals: int = 8, late_share: float = 0.0,
                rounds: list | None = None) -> dict:
    """Run cfg.inner.steps inner steps on every learner; the held-out loss of the global model at
    `evals` points, against tokens (all learners). With `rounds`, each round is appended to it as
    (fragment, its fp32 deltas by learner index, the global's step): what a codec would be fed."""
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
    held_back: dict[int, list] = {p: [] for p in range(P)}  # late deltas, merged in the fragment's next round
    rng = np.random.default_rng(cfg.data.seed)
    for s in range(1, steps + 1):
        local, inner_state, _ = step_fn(local, inner_state, jnp.asarray(np.stack([next(st) for st in streams])))
        # at the end every fragment hands in its steps since its last sync, as the learners do
        due = fragments_due(s, P, H) if s < steps else [p for p in range(P) if last[p] < s or held_back[p]]
        for p in due:
            names = plan[p]
            fresh = [({n: glob[n] - np.asarray(local[n][i]) for n in names}, s - last[p], 0) for i in range(M)]
            late = late_mask(rng, M, cfg.syncer.quorum, late_share) if s < steps else np.zeros(M, bool)
            now = [c for c, missed in zip(fresh, late) if not missed] + [(d, n, 1) for d, n, _ in held_back[p]]
            held_back[p] = [c for c, missed in zip(fresh, late) if missed]
            new, outer_state[p] = outer_round(cfg, run_plan, glob, names, now, outer, outer_state[p])
            if rounds is not None:
                rounds.append((p, {i: d for i, (d, _, _) in enumerate(fresh) if not late[i]},
                               {n: new[n] - glob[n] for n in names}))
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
