"""The run's plan: which leaves of the user's parameter pytree are synced, under what names, shapes
and dtypes, in which fragment, and merged by which rule.

It is computed once, from the user's initial parameters, when a run is provisioned, and stored with
the run (`plan.json` beside the fragments in TensorStore). The syncer, evals, operator tools and the
simulator read it; none of them imports model code. A learner checks its own parameters against it.

Which leaves are synced: floating-point arrays (float32, bfloat16, float16, float64), except those
matching a `local` pattern; with `sync` patterns, only the leaves they match. Everything else (RNG
keys, step counters, integer buffers, and float leaves marked local such as batch statistics)
stays on the learner and is never sent. Names come from pytree key paths: `{'layer0': {'qkv': x}}`
is `layer0.qkv`; a Flax NNX `State` leaf `['l']['kernel'].value` is `l.kernel`.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import ml_dtypes
import numpy as np

from diloco import messages
from diloco.fragments import plan_fragments

FORMAT = "diloco-plan/1"
MERGE_RULES = ("rda", "mean")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class PlanError(ValueError):
    """A parameter tree or setting that cannot make (or match) a plan; the text names the leaf."""


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str          # numpy name: float32, bfloat16, float16, float64
    fragment: int
    merge: str          # "rda" (radial-directional) or "mean" (plain weighted mean)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def np_dtype(self) -> np.dtype:
        return np_dtype(self.dtype)


@dataclass(frozen=True)
class Plan:
    tensors: tuple[Tensor, ...]   # synced leaves, in the tree's leaf order
    fragments: int

    def __post_init__(self):
        for p in range(self.fragments):
            if not any(t.fragment == p for t in self.tensors):
                raise PlanError(f"fragment {p} of {self.fragments} holds no tensor")

    # --- look-ups (computed once: learners and the syncer use them at every sync) ---------------
    @cached_property
    def by_name(self) -> dict[str, Tensor]:
        return {t.name: t for t in self.tensors}

    def names(self, fragment: int) -> list[str]:
        """Tensor names of one fragment, sorted (the order every process uses)."""
        return sorted(t.name for t in self.tensors if t.fragment == fragment)

    @cached_property
    def fragment_names(self) -> list[list[str]]:
        return [self.names(p) for p in range(self.fragments)]

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape for t in self.tensors}

    @cached_property
    def mean_merged(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors if t.merge == "mean")

    @property
    def num_params(self) -> int:
        return sum(t.size for t in self.tensors)

    # --- storage -------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "fragments": self.fragments, "tensors": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "fragment": t.fragment, "merge": t.merge}
            for t in self.tensors]}, indent=1)

    @staticmethod
    def from_json(text: str | bytes) -> Plan:
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise PlanError(f"plan format {d.get('format')!r}, this build reads {FORMAT!r}")
            tensors = tuple(Tensor(str(t["name"]), tuple(int(s) for s in t["shape"]), str(t["dtype"]),
                                   int(t["fragment"]), str(t["merge"])) for t in d["tensors"])
            plan = Plan(tensors, int(d["fragments"]))
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, PlanError):
                raise
            raise PlanError(f"plan.json is not a valid plan: {err}") from None
        for t in plan.tensors:
            np_dtype(t.dtype)
            if t.merge not in MERGE_RULES or not 0 <= t.fragment < plan.fragments:
                raise PlanError(f"plan.json: tensor {t.name!r} has merge {t.merge!r} / fragment {t.fragment}")
        return plan


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(name)
    except TypeError:
        raise PlanError(f"dtype {name!r} is not a dtype") from None
    if dt.kind != "f":
        raise PlanError(f"dtype {name!r} is not floating point")
    return dt


# --- names from key paths -----------------------------------------------------------------------

def _key_part(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_name(path: Sequence[Any]) -> str:
    """`layer0.qkv` for the key path of `tree['layer0']['qkv']`; a trailing NNX `.value` is dropped."""
    parts = [_key_part(k) for k in path]
    if len(parts) > 1 and parts[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        parts = parts[:-1]
    return ".".join(parts) or "params"


def named_leaves(tree) -> list[tuple[str, Any]]:
    """(name, leaf) for every leaf of the tree, in leaf order; names made storable and unique."""
    out, seen = [], {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        raw = leaf_name(path)
        name = _SAFE.sub("_", raw)
        if name in seen:
            raise PlanError(f"leaves {seen[name]!r} and {raw!r} both map to the tensor name {name!r}; rename one")
        seen[name] = raw
        out.append((name, leaf))
    return out


def _is_float_array(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
        return False
    try:
        return np.dtype(dtype).kind == "f" or np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)
    except TypeError:  # typed PRNG keys and other extended dtypes
        return False


def _dtype_name(leaf) -> str:
    dt = np.dtype(leaf.dtype)
    return "bfloat16" if dt == np.dtype(ml_dtypes.bfloat16) else dt.name


def _describe(leaf) -> str:
    if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
        return f"a {leaf.dtype} array of shape {tuple(leaf.shape)}"
    return f"a {type(leaf).__name__}"


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _check_patterns(what: str, patterns: Sequence[str], names: Sequence[str], among: str, source: str = "") -> None:
    """A pattern that matches nothing is a mistake (a typo, another model's names), not a no-op."""
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            raise PlanError(f"{what} pattern {pat!r}{source} matches no {among} ({_some(list(names))})")


def synced(tree, *, sync: Sequence[str] | None = None, local: Sequence[str] = ()) -> list[tuple[str, Any]]:
    """The (name, leaf) pairs that are synced (see the module docstring)."""
    leaves = named_leaves(tree)
    names = [n for n, _ in leaves]
    _check_patterns("sync", sync or (), names, "leaf of the parameters")
    _check_patterns("local", local, names, "leaf of the parameters")
    out = []
    for name, leaf in leaves:
        if _matches(name, local):
            continue
        if sync is not None:
            if not _matches(name, sync):
                continue
            if not _is_float_array(leaf):
                raise PlanError(f"leaf {name!r} is marked for sync but is {_describe(leaf)}: only floating-point "
                                "arrays can be merged; mark it local or leave it out of `sync`")
        elif not _is_float_array(leaf):
            continue
        out.append((name, leaf))
    if not out:
        raise PlanError(f"no floating-point leaf to sync among {_some(names)}")
    return out


def _some(names: Sequence[str], n: int = 8) -> str:
    shown = ", ".join(names[:n])
    return shown + (f", ... ({len(names)} leaves)" if len(names) > n else "")


def make_plan(params, *, fragments: int, mean_merge: Sequence[str] = (), sync: Sequence[str] | None = None,
              local: Sequence[str] = ()) -> Plan:
    """The plan of a parameter pytree: balanced fragments (largest tensors first) and merge rules.

    `mean_merge` are glob patterns (fnmatch) of tensors merged by plain weighted mean instead of RDA,
    typically embeddings; a pattern that matches no synced tensor is an error, not a silent no-op.
    """
    leaves = synced(params, sync=sync, local=local)
    shapes = {n: tuple(int(s) for s in leaf.shape) for n, leaf in leaves}
    _check_patterns("mean-merge", mean_merge, list(shapes), "synced tensor", " (syncer.mean_merge_tensors)")
    try:
        packed = plan_fragments(shapes, fragments)
    except ValueError as err:
        raise PlanError(str(err)) from None
    fragment_of = {n: p for p, names in enumerate(packed) for n in names}
    return Plan(tuple(Tensor(n, shapes[n], _dtype_name(leaf), fragment_of[n],
                             "mean" if _matches(n, mean_merge) else "rda") for n, leaf in leaves), fragments)


# --- between the user's tree and named arrays -----------------------------------------------------

Region = messages.Region  # (start, stop) per axis: one block of an array (a manifest entry's `block`)


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """The block an index of slices (as JAX's shardings give them) selects."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def regions(leaf) -> dict[Region, tuple[slice, ...]]:
    """The blocks of a leaf this host holds, each once however many of its devices hold a copy: for a
    NumPy array or a single-device one the whole array, for a sharded one its addressable shards."""
    shape = tuple(leaf.shape)
    if isinstance(leaf, jax.Array):
        out: dict[Region, tuple[slice, ...]] = {}
        for index in leaf.sharding.addressable_devices_indices_map(shape).values():
            out.setdefault(region_of(index, shape), index)
        return out
    whole = tuple(slice(0, n) for n in shape)
    return {region_of(whole, shape): whole}


def senders(leaf) -> dict[Region, int]:
    """Each block of a leaf, with the process that sends it in a contribution: the lowest of those
    holding it (a block replicated over hosts goes once). Every host computes the same, from the
    sharding alone."""
    shape = tuple(leaf.shape)
    if not isinstance(leaf, jax.Array):
        return {whole(shape): 0}
    out: dict[Region, int] = {}
    for device, index in leaf.sharding.devices_indices_map(shape).items():
        r = region_of(index, shape)
        out[r] = min(out.get(r, device.process_index), device.process_index)
    return out


def whole(shape: tuple[int, ...]) -> Region:
    """The block that is the whole array."""
    return tuple((0, n) for n in shape)


def is_whole(blocks: Mapping[Region, Any], shape: tuple[int, ...]) -> bool:
    return whole(shape) in blocks


def place(value: np.ndarray, like):
    """`value` where `like` lived: the same dtype, and for a JAX array the same devices and sharding."""
    value = np.asarray(value).astype(like.dtype, copy=False)
    if isinstance(like, jax.Array):
        return jax.make_array_from_callback(value.shape, like.sharding, lambda index: value[index])
    return value


def place_blocks(blocks: Mapping[Region, np.ndarray], like, dtype=None):
    """An array shaped and placed like `like` (its devices and sharding) from this host's blocks of
    it, as `regions(like)` names them; in `dtype` (default like's)."""
    dtype = np.dtype(dtype or like.dtype)
    shape = tuple(like.shape)
    if isinstance(like, jax.Array):
        return jax.make_array_from_callback(
            shape, like.sharding, lambda index: np.asarray(blocks[region_of(index, shape)]).astype(dtype, copy=False))
    return np.asarray(blocks[whole(shape)]).astype(dtype, copy=False)


def check_tree(tree, plan: Plan) -> None:
    """Raise PlanError, naming the leaves, unless every tensor of the plan is a leaf of `tree` with
    the plan's shape and dtype. Other leaves of the tree are local and may be anything."""
    got = {n: leaf for n, leaf in named_leaves(tree)}
    missing = [t.name for t in plan.tensors if t.name not in got]
    differ = []
    for t in plan.tensors:
        leaf = got.get(t.name)
        if leaf is None:
            continue
        if not _is_float_array(leaf):
            differ.append(f"{t.name}: the run has {t.dtype}{list(t.shape)}, this tree {_describe(leaf)}")
        elif (tuple(leaf.shape), _dtype_name(leaf)) != (t.shape, t.dtype):
            differ.append(f"{t.name}: the run has {t.dtype}{list(t.shape)}, this tree {_dtype_name(leaf)}{list(leaf.shape)}")
    if missing or differ:
        parts = ([f"missing {missing[:6]}" + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")]
                 if missing else []) + differ[:6]
        raise PlanError("these parameters do not match the run's plan: " + "; ".join(parts))


def flatten(tree, plan: Plan) -> dict[str, Any]:
    """The synced leaves of `tree` by name (as they are: NumPy or JAX arrays)."""
    wanted = plan.by_name
    return {n: leaf for n, leaf in named_leaves(tree) if n in wanted}


def with_leaves(template, plan: Plan, leaves: Mapping[str, Any]) -> Any:
    """`template` with the synced leaves named in `leaves` replaced as they are (already placed)."""
    wanted = plan.by_name
    treedef = jax.tree_util.tree_structure(template)
    out = [leaves[name] if name in wanted and name in leaves else old for name, old in named_leaves(template)]
    return jax.tree_util.tree_unflatten(treedef, out)


def unflatten(template, plan: Plan, arrays: Mapping[str, Any], place=None, *, partial: bool = False) -> Any:
    """`template` with its synced leaves replaced by `arrays` (cast to the plan's dtype); other
    leaves, and with `partial` the synced leaves `arrays` lacks, are kept. `place(value, old_leaf)`
    puts a value where the old leaf lived (its devices and sharding)."""
    wanted = plan.by_name
    missing = sorted(set(wanted) - set(arrays))
    if missing and not partial:
        raise PlanError(f"no values for {missing[:6]}")
    treedef = jax.tree_util.tree_structure(template)
    leaves = []
    for name, old in named_leaves(template):
        if name in wanted and name in arrays:
            value = np.asarray(arrays[name]).astype(wanted[name].np_dtype, copy=False)
            if value.shape != wanted[name].shape:
                raise PlanError(f"tensor {name!r}: value of shape {value.shape}, plan says {wanted[name].shape}")
            leaves.append(place(value, old) if place else value)
        else:
            leaves.append(old)
    return jax.tree_util.tree_unflatten(treedef, leaves)
