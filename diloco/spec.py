"""What a user's model entry point returns: the model, its loss, its data and its inner optimizer.

The config names the entry point as `package.module:function` (`model.entry`); `diloco train`,
`diloco learner`, the Prefect flows and the job manifests all call it. The function takes the run's
`Config` (or nothing) and returns a `ModelSpec`. The built-in transformer is one such entry
(`diloco.models.transformer:spec`).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import optax

from diloco.config import Config, ConfigError

Batch = Any
PyTree = Any


@dataclass(frozen=True)
class DataShard:
    """Which batches a learner reads: its index among the run's learners, the step it starts from
    (a restarted learner, a spare or a joiner; `learners.data.shard_batches` reads on from the window
    that step reached), and the run's data seed."""
    index: int
    count: int
    start_step: int = 0
    seed: int = 0
    process: int = 0         # this host's index within a multi-host learner
    processes: int = 1


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as Decoupled DiLoCo needs it. Only `init`, `loss`, `optimizer` and `batches` are required.

    init:       seed -> the initial parameter pytree (a dict, a Flax NNX `State`, Equinox arrays, ...).
    loss:       (params, batch) -> scalar mean loss; the inner steps minimise it over the floating-point
                leaves (the rest: RNG keys and counts, integer counters, are state it may read).
    stateful:   the loss returns (scalar, params) whose non-float leaves are the updated state (a Flax
                NNX model's RNG counts after dropout, a step counter): `nnx.state(model)` after the call.
    optimizer:  an optax GradientTransformation, or (start_step, total_steps) -> one, so that a
                schedule continues where a restarted learner left off.
    batches:    DataShard -> an endless iterator of this host's batches (any pytree of arrays).
    tokens:     tokens one batch of this host trains on (int, or batch -> int); weighs contributions.
    eval_batches: () -> a fixed iterable of held-out batches (for the run's start/end and checkpoint
                evals); eval_loss defaults to loss.
    mean_merge: glob patterns of tensors merged by plain weighted mean instead of RDA (embeddings),
                used when the config's syncer.mean_merge_tensors is not set.
    sync / local: glob patterns of leaves to sync (default: every floating-point leaf) / to keep local.
    vocab_size: checked against the tokenizer of the run's corpus at provisioning.
    partition:  params -> a tree of jax PartitionSpecs over the learner's mesh axes (data, fsdp,
                tensor), how the built-in loop places parameters and optimizer state; default: each
                array sharded along its longest axis over `parallel.fsdp` devices.
    """
    init: Callable[[int], PyTree]
    loss: Callable[[PyTree, Batch], Any]
    optimizer: optax.GradientTransformation | Callable[[int, int], optax.GradientTransformation]
    batches: Callable[[DataShard], Iterator[Batch]]
    tokens: int | Callable[[Batch], int] = 0
    eval_batches: Callable[[], Iterable[Batch]] | None = None
    eval_loss: Callable[[PyTree, Batch], Any] | None = None
    mean_merge: tuple[str, ...] = ()
    sync: tuple[str, ...] | None = None
    local: tuple[str, ...] = ()
    vocab_size: int | None = None
    partition: Callable[[PyTree], PyTree] | None = None
    stateful: bool = False

    def inner_optimizer(self, start_step: int, total_steps: int) -> optax.GradientTransformation:
        opt = self.optimizer
        if isinstance(opt, optax.GradientTransformation):
            return opt
        return opt(start_step, total_steps)

    def tokens_in(self, batch: Batch) -> int:
        n = self.tokens(batch) if callable(self.tokens) else self.tokens
        if not n:
            import jax
            leaves = jax.tree_util.tree_leaves(batch)
            n = int(leaves[0].size) if leaves else 0  # a fallback: every element of the first leaf
        return int(n)

    def loss_value(self, params: PyTree, batch: Batch):
        """The loss alone, whether or not the loss also returns its updated state (`stateful`)."""
        out = self.loss(params, batch)
        return out[0] if self.stateful else out

    @property
    def select(self) -> dict:
        """The leaf selection keywords of `diloco.plan.synced`."""
        return {"sync": self.sync, "local": self.local}


def import_roots() -> list[str]:
    """Where a model entry point is imported from, beside sys.path: the folder of the script this
    process runs (what `python my_model.py` puts first on its own path) and the working directory, so
    that the learner processes import `my_model:spec` as the user's own `python my_model.py` does."""
    roots = []
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script and not getattr(getattr(main, "__spec__", None), "name", None):  # a script, not `python -m`
        roots.append(os.path.dirname(os.path.abspath(script)))
    roots.append(os.getcwd())
    return list(dict.fromkeys(roots))


def run_modules(cfg: Config) -> list[str]:
    """The run's own modules that a warm start imports once for all its learners (infra/forkserver.py):
    the model entry's module (unless the learners run model.script), then run.preload."""
    entry = [] if cfg.model.script else [cfg.model.entry.partition(":")[0]]
    return list(dict.fromkeys(entry + cfg.run.preload))


def import_failure(module: str, err: ImportError) -> str:
    """Why `module` did not import, and what to do: a module not found says where it was looked for
    and suggests PYTHONPATH; one found that failed inside names the module it lacked."""
    missing = getattr(err, "name", None)
    if isinstance(err, ModuleNotFoundError) and missing and (module == missing or module.startswith(missing + ".")):
        looked = [p or os.getcwd() for p in sys.path if not p.endswith(".zip")]
        return (f"no module {missing!r} in any folder on the import path ({', '.join(looked)}). Put the folder "
                f"that holds it on PYTHONPATH (PYTHONPATH=/path/to/folder diloco train ...), run from that folder, "
                f"or install its package in this environment")
    return f"{type(err).__name__}: {err}" + (
        f" (install {missing!r} in this environment, in the same pip command as this library)"
        if isinstance(err, ModuleNotFoundError) and missing else "")


def load_entry(entry: str) -> Callable[..., ModelSpec]:
    module, _, func = entry.partition(":")
    for root in import_roots():
        if root not in sys.path:
            sys.path.append(root)
    try:  # the import statement's own machinery, so that `python -X importtime` lists the module too
        __import__(module)
        mod = sys.modules[module]
    except ImportError as err:
        raise ConfigError(f"model.entry {entry!r}: cannot import {module!r}: {import_failure(module, err)}") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise ConfigError(f"model.entry {entry!r}: {module} has no function {func!r}")
    return fn


def load_spec(cfg: Config) -> ModelSpec:
    """Call the config's model entry point (with the config if it takes an argument)."""
    fn = load_entry(cfg.model.entry)
    try:
        takes_config = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes_config = True
    spec = fn(cfg) if takes_config else fn()
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"model.entry {cfg.model.entry!r} returned {type(spec).__name__}, not a diloco ModelSpec")
    return spec


def initial_plan(cfg: Config, spec: ModelSpec):
    """(plan, initial parameter tree) of a run of this model: the tree from `spec.init(model.seed)`,
    fragments from `fragments.count`, mean-merged tensors from `syncer.mean_merge_tensors` (or the
    spec's own `mean_merge` when that is not set; every tensor under `syncer.merge: mean`, where the
    patterns change nothing). Raises PlanError naming the leaf or pattern."""
    from diloco.plan import make_plan

    tree = spec.init(cfg.model.seed)
    patterns = cfg.syncer.mean_merge_tensors
    patterns = spec.mean_merge if patterns is None else patterns
    plan = make_plan(tree, fragments=cfg.fragments.count, mean_merge=patterns, **spec.select)  # checks the patterns
    if cfg.syncer.merge == "mean":  # every tensor is a plain mean: plan.json says so, not the patterns' rda
        plan = make_plan(tree, fragments=cfg.fragments.count, mean_merge=["*"], **spec.select)
    return plan, tree


def evaluate(spec: ModelSpec, params, batches=None) -> float:
    """Mean eval loss (spec.eval_loss, else spec.loss) over held-out batches (default spec.eval_batches())."""
    import jax
    import numpy as np

    if batches is None:
        if spec.eval_batches is None:
            raise ConfigError("the model spec has no eval_batches: nothing to evaluate on")
        batches = spec.eval_batches()
    fn = jax.jit(spec.eval_loss or spec.loss_value)
    losses = [float(fn(params, b)) for b in batches]
    if not losses:
        raise ConfigError("the model spec's eval_batches() gave no batch")
    return float(np.mean(losses))
