"""A learner's side of the outer step, on its devices: each synced tensor's anchor, the outer delta
taken against it and quantized, and a new global version rebased onto the local steps.

    codes = outer_deltas(anchors, leaves, names, schemes, error)   # at a fragment's sync point
    values = rebase(anchors, leaves, names, made_of, blocks, mode)  # when a new version arrives

For the codecs of 4 bits and more (device_codec.ON_DEVICE) a jitted function forms each tensor's
delta (anchor - local, in float32), quantizes it, and moves its anchor by what a receiver will
decode; it is compiled once per shape (a model's layers share a handful), not per fragment. Only
the codes and row scales leave the devices, copied to the host asynchronously
(device_codec.DeviceCode) and read by the publisher thread. The training thread dispatches and
returns. A learner spanning hosts gathers nothing: each host codes the blocks its devices hold and
sends them itself, as parts of one contribution (docs/wire-format.md).
A new version comes as its snapshot and update code (learners.fetcher.Fetched) and is decoded,
rebased and made the new anchor in one jitted function per tensor.
The codes below 4 bits (int2, ternary, topk) keep their error buffers on the host and are made there.

The anchor (`fragments.anchor`, `fragments.anchor_dtype`): the global version a tensor was last
on, less every delta sent since (what quantization left out stays in the difference and goes with
the next delta). Kept on the host (the default), a fragment's anchors come to the devices only
while it syncs or applies; kept on the devices, they cost a whole copy of the model there. On the
host an anchor is kept as what it is made of where it can be: the fetched version's base (the
snapshot the fetcher holds anyway, shared, not copied), the version's update code and the codes
sent since, all a fraction of the model, rebuilt on the devices by one jitted function. So a
learner holding whole tensors keeps one copy of the model on the host, not two. Otherwise (a
learner over several hosts, the codes below 4 bits, a store read whole) the anchor itself is kept,
in the leaf's host memory kind, pinned where the backend has one, each host its own shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco import device_codec, quantize
from diloco.messages import TensorSpec
from diloco.plan import Region, place, place_blocks, region_of, senders, whole


def _host_kind(sharding) -> str | None:
    """The memory kind a host copy of an array placed by `sharding` takes: pinned where the
    backend offers it (a DMA away from the devices), else plain host memory; None if neither."""
    try:
        kinds = {m.kind for m in next(iter(sharding.device_set)).addressable_memories()}
    except (AttributeError, StopIteration, jax.errors.JaxRuntimeError):
        return None
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


MAX_SENT = 16  # deltas sent since a version that an anchor kept as codes replays; past them it is kept whole


@dataclass
class MadeOf:
    """An anchor kept as what it is made of: a fetched version's `base` array (shared with the
    fetcher) with its `update` code applied (none: the version is the base), less the `sent` codes."""

    base: np.ndarray
    update: quantize.Coded | None
    sent: list = field(default_factory=list)  # device_codec.DeviceCode or quantize.Coded, in order

    def nbytes(self) -> int:
        return (self.update.nbytes if self.update else 0) + sum(c.nbytes for c in self.sent)

    def recipe(self) -> tuple:
        """(the update's scheme or None, the sent codes' schemes): how `_value` builds it (static)."""
        return self.update.scheme if self.update else None, tuple(c.scheme for c in self.sent)

    def codes(self) -> tuple:
        """The codes' parts on the host, the update's first if there is one."""
        return tuple(device_codec.parts_of(c) for c in ([self.update] if self.update else []) + self.sent)


class Anchors:
    """Each synced tensor's anchor, where `place` says ("host" or "device"), in `dtype` ("float32" or
    "param": the leaf's own dtype). `anchors[n]` is the anchor on the devices (placed like its leaf,
    in the anchor's dtype): a transient copy when it lives on the host. `anchors[n] = value` (on the
    devices, or a NumPy array for a NumPy leaf) keeps it where it lives; the copy to the host is
    started and not waited for. `keep(values, made_of)` keeps what a host anchor is made of instead
    of its value, where it can (see the module docstring); `sent` notes a delta sent from it."""

    def __init__(self, place: str = "host", dtype: str = "float32"):
        self.place, self.dtype = place, dtype
        self._kept: dict[str, Any] = {}
        self._made: dict[str, MadeOf] = {}
        self._sharding: dict[str, Any] = {}   # where each anchor goes on the devices
        self._kinds: dict[Any, str] = {}      # a sharding's host memory kind ("" = none)

    def __getitem__(self, name: str):
        return self.on_devices([name])[0]

    def __setitem__(self, name: str, value) -> None:
        self.keep({name: value})

    def on_devices(self, names: list[str]) -> list:
        """The anchors of `names` on the devices (placed like their leaves)."""
        dtypes = [self._dtype(n) for n in names]
        return [_version(src, recipe, dt) if recipe else src for (src, recipe), dt in zip(self.sources(names)[0], dtypes)]

    def sources(self, names: list[str], versions: list[tuple[MadeOf, Any]] = ()) -> tuple[list, list]:
        """(each anchor of `names` as a jitted function takes it, the same for `versions`: (MadeOf,
        sharding) pairs of a fetched version). A source is (array, None) for an anchor kept as it
        is, (placed base and codes, recipe) for one kept as codes (`_value` builds it). Everything
        crosses in one transfer, a base shared by several only once."""
        kept = [self._kept.get(n) for n in names]
        moving = [i for i, (n, a) in enumerate(zip(names, kept))
                  if isinstance(a, jax.Array) and n in self._sharding and a.sharding != self._sharding[n]]
        made = [(self._made[n], self._sharding[n]) for n in names if n in self._made] + list(versions)
        moved, built = _placed([kept[i] for i in moving], [self._sharding[names[i]] for i in moving], made)
        for i, a in zip(moving, moved):
            kept[i] = a
        built = iter(built)
        return [next(built) if n in self._made else (a, None) for n, a in zip(names, kept)], list(built)

    def _dtype(self, name: str):
        m, a = self._made.get(name), self._kept.get(name)
        if m is not None:
            return jnp.dtype(m.base.dtype if self.dtype == "param" else jnp.float32)
        return jnp.dtype(a.dtype)

    def sent(self, codes: Mapping[str, Any], moved: Mapping[str, Any]) -> None:
        """A delta was sent from each of these anchors: `codes` its code, `moved` the anchor less what
        a receiver decodes. An anchor kept as codes notes the code (past MAX_SENT it keeps `moved`)."""
        rest = {}
        for n, code in codes.items():
            m = self._made.get(n)
            if m is not None and len(m.sent) < MAX_SENT:
                m.sent.append(code)
            else:
                rest[n] = moved[n]
        self.keep(rest)

    def keep(self, values: Mapping[str, Any], made_of: Mapping[str, tuple] | None = None) -> None:
        """Set these anchors; those that live on the host are copied there in one transfer, not waited
        for. `made_of[n]` = (base array, update code or None), when values[n] is that version: kept
        instead of the value where the anchor can be rebuilt from it (one process holding the tensor,
        on the host, a device codec)."""
        to_host = {}
        made_of = made_of or {}
        for name, value in values.items():
            self._made.pop(name, None)
            if name in made_of and self._rebuildable(value, *made_of[name]):
                self._kept.pop(name, None)
                self._sharding[name] = value.sharding
                self._made[name] = MadeOf(*made_of[name])
                continue
            if self.dtype == "float32" and value.dtype != np.float32:
                value = value.astype(jnp.float32) if isinstance(value, jax.Array) else np.asarray(value, np.float32)
            self._kept[name] = value
            if isinstance(value, jax.Array) and self.place == "host":
                self._sharding[name] = value.sharding
                kind = self._kinds.get(value.sharding)
                if kind is None:
                    kind = self._kinds[value.sharding] = _host_kind(value.sharding) or ""
                if kind:
                    to_host[name] = value.sharding.with_memory_kind(kind)
        if to_host:
            moved = jax.device_put([self._kept[n] for n in to_host], list(to_host.values()))
            for n, a in zip(to_host, moved):
                self._kept[n] = a

    def _rebuildable(self, value, base: np.ndarray, update: quantize.Coded | None) -> bool:
        return self.place == "host" and _buildable(value, base, update)

    def bases(self) -> list[np.ndarray]:
        """The arrays the anchors kept as codes are built on (held by the fetcher too)."""
        return [m.base for m in self._made.values()]

    def nbytes(self) -> dict[str, int]:
        """Bytes the anchors hold, by where: {"device": ..., "host": ...} (this process's shards;
        the host's codes, not the bases they share with the fetcher: `bases`)."""
        out = {"device": 0, "host": sum(m.nbytes() for m in self._made.values())}
        for a in self._kept.values():
            if isinstance(a, jax.Array):
                where = "device" if a.sharding.memory_kind in (None, "device") else "host"
                out[where] += sum(s.data.nbytes for s in a.addressable_shards)
            else:
                out["host"] += np.asarray(a).nbytes
        return out


def _placed(arrays: list, shardings: list, made: list[tuple[MadeOf, Any]]) -> tuple[list, list]:
    """`arrays` placed by `shardings`, and each (MadeOf, sharding) of `made` as a source `_value`
    builds ((base, codes) on the devices, its recipe), in one transfer: a base shared by several
    crosses once."""
    bases: dict[int, int] = {}
    values, where = list(arrays), list(shardings)
    for m, sharding in made:
        if id(m.base) not in bases:
            bases[id(m.base)] = len(values)
            values.append(m.base)
            where.append(sharding)
    codes = [m.codes() for m, _ in made]
    where += [jax.tree.map(lambda _, sh=sh: _replicated(sh), c) for (_, sh), c in zip(made, codes)]
    placed = jax.device_put(values + codes, where) if values else []
    built = [((placed[bases[id(m.base)]], placed[len(values) + k]), m.recipe()) for k, (m, _) in enumerate(made)]
    return placed[:len(arrays)], built


def _made_here(made_of: Mapping[str, tuple], leaves: Mapping[str, Any], names: list[str]) -> list[str]:
    """The tensors of `names` whose version is built on the devices from what it is made of."""
    return [n for n in names if n in made_of and _buildable(leaves[n], *made_of[n])]


def _buildable(like, base: np.ndarray, update: quantize.Coded | None) -> bool:
    """Whether a value placed like `like` can be built on the devices from `base` and `update`: one
    process holds the whole array, and the update's codec has a device decoder."""
    return (isinstance(like, jax.Array) and like.is_fully_addressable and jax.process_count() == 1
            and tuple(base.shape) == tuple(like.shape) and (update is None or update.scheme in device_codec.ON_DEVICE))


def version_on_devices(made_of: Mapping[str, tuple], leaves: Mapping[str, Any], names: list[str],
                       blocks: Callable[[list[str]], Mapping[str, Mapping]]) -> dict[str, Any]:
    """Each tensor of `names` of a fetched version, placed like its leaf and in its dtype. Where it
    can be (`made_of[n]`: (base, update code), see learners.fetcher.Fetched) it is decoded on the
    devices, bit for bit quantize.apply_update: only the base and the codes cross. The others are
    placed from `blocks(those names)`, this host's blocks of each (plan.place_blocks)."""
    here = _made_here(made_of, leaves, names)
    _, sources = _placed([], [], [(MadeOf(*made_of[n]), leaves[n].sharding) for n in here])
    out = {n: _version(src, recipe, jnp.dtype(leaves[n].dtype)) for n, (src, recipe) in zip(here, sources)}
    rest = [n for n in names if n not in out]
    if rest:
        out.update(place_all(blocks(rest), leaves))
    return {n: out[n] for n in names}


@functools.cache
def _replicated(sharding) -> jax.sharding.Sharding:
    """A whole copy on each device of `sharding` (where a code goes to be decoded)."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    mesh = jax.sharding.Mesh(np.array(sorted(sharding.device_set, key=lambda d: d.id)), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind)


def _decoded(parts, shape, scheme: str):
    """What a receiver decodes, behind a barrier: never fused into the sum it goes into (an FMA
    would round differently from the host's two operations)."""
    return jax.lax.optimization_barrier(device_codec.decode(parts, shape, scheme))


def _value(src, recipe: tuple | None, dtype):
    """An anchor or a version on the devices from its source (Anchors.sources): a kept array as it
    is, or a base with its update applied as quantize.apply_update does (in float32, back to the
    tensor's dtype), in `dtype`, less each sent code as `_delta_code` takes it off."""
    if recipe is None:
        return src
    (base, codes), (update_scheme, sent_schemes) = src, recipe
    version = base
    if update_scheme is not None:
        version = (base.astype(jnp.float32) + _decoded(codes[0], base.shape, update_scheme)).astype(base.dtype)
        codes = codes[1:]
    value = version.astype(dtype)
    for parts, scheme in zip(codes, sent_schemes):
        value = (value.astype(jnp.float32) - _decoded(parts, base.shape, scheme)).astype(dtype)
    return value


_version = jax.jit(_value, static_argnames=("recipe", "dtype"))


def _delta_code_of(src, leaf, recipe, scheme: str, dtype):
    """(the code parts of anchor - leaf, the anchor moved by what a receiver decodes), the anchor
    built from its source. Compiled once per shape, scheme, recipe and placement: a model's layers
    share a handful of shapes."""
    base = _value(src, recipe, dtype).astype(jnp.float32)
    delta = base - leaf.astype(jnp.float32)
    code = device_codec.encode(delta, scheme)
    return code, (base - _decoded(code, delta.shape, scheme)).astype(dtype)


# a kept anchor's buffer is reused for the moved one; a base is never donated (a CPU backend's
# transfer may share the host array's memory, the fetcher's snapshot)
_delta_code = {kept: jax.jit(_delta_code_of, static_argnames=("recipe", "scheme", "dtype"),
                             donate_argnums=(0,) if kept else ()) for kept in (True, False)}


@functools.partial(jax.jit, static_argnames=("new_recipe", "anchor_recipe", "mode", "alpha", "dtype"))
def _rebased(new, leaf, anchor, new_recipe, anchor_recipe, mode: str, alpha: float, dtype):
    """(the leaf's value with the new global version applied, its new anchor in `dtype`), both
    built from their sources (Anchors.sources) in this one call."""
    n32 = _value(new, new_recipe, leaf.dtype).astype(jnp.float32)
    if mode == "rebase":  # keep the steps taken since the last send: they are in no delta yet
        value = n32 + (leaf.astype(jnp.float32) - _value(anchor, anchor_recipe, dtype).astype(jnp.float32))
    elif mode == "mix":
        value = alpha * n32 + (1 - alpha) * leaf.astype(jnp.float32)
    else:
        value = n32
    return value.astype(leaf.dtype), n32.astype(dtype)


def _anchor_dtypes(anchors: Anchors, leaves: Mapping[str, Any], names: list[str]) -> tuple:
    param = anchors.dtype == "param"
    return tuple(jnp.dtype(leaves[n].dtype) if param else jnp.dtype(jnp.float32) for n in names)


def outer_deltas(anchors: Anchors, leaves: Mapping[str, Any], names: list[str], schemes: Mapping[str, str],
                 error: dict[str, np.ndarray] | None = None) -> dict[str, device_codec.DeviceCode | quantize.Coded]:
    """The codes of the outer deltas (anchor - local) of tensors `names`, each made once, and each
    anchor moved to what was just sent, so that if the merged global is slow to arrive two
    contributions never carry the same progress twice; what quantization left out stays in the
    difference and travels with the next delta (error feedback). On a learner over several hosts
    this is `outer_block_deltas`: every host calls it, and gets the codes of the blocks it sends.

    For the codes below 4 bits (quantize.BELOW_4_BITS), which leave out a third or more of a delta,
    what was left out waits in `error` (host arrays) instead, and the anchor moves to the local
    value: the learner then trains on from the merged global plus its own steps since the send,
    not from a point its residual keeps apart from the other learners'."""
    if jax.process_count() > 1:
        return outer_block_deltas(anchors, leaves, names, schemes, error)
    on_device = [n for n in names if schemes[n] in device_codec.ON_DEVICE and isinstance(leaves[n], jax.Array)]
    codes: dict[str, Any] = {}
    if on_device:
        made = [_delta_code[recipe is None](src, leaves[n], recipe, schemes[n], dt) for n, (src, recipe), dt in
                zip(on_device, anchors.sources(on_device)[0], _anchor_dtypes(anchors, leaves, on_device))]
        for n, (p, _) in zip(on_device, made):
            codes[n] = device_codec.DeviceCode(tuple(leaves[n].shape), schemes[n], p)
        anchors.sent({n: codes[n] for n in on_device}, {n: m for n, (_, m) in zip(on_device, made)})
    for n in names:
        if n in codes:
            continue
        local, anchor = _float32(leaves[n]), _float32(anchors[n])  # one transfer of the anchor
        delta = np.asarray(anchor - local)
        if error is not None and schemes[n] in quantize.BELOW_4_BITS:
            delta = delta + error[n] if n in error else delta
            codes[n] = quantize.coded(delta, schemes[n])
            error[n] = (delta - codes[n].decoded()).astype(np.float32)
            anchors[n] = local
        else:
            codes[n] = quantize.coded(delta, schemes[n])
            anchors[n] = anchor - place(codes[n].decoded(), anchor)
        del delta
    return codes


def outer_block_deltas(anchors: Anchors, leaves: Mapping[str, Any], names: list[str], schemes: Mapping[str, str],
                       error: dict | None = None) -> dict[tuple[str, Region | None], Any]:
    """`outer_deltas` on a learner over several hosts: every host codes each block of a tensor its
    devices hold, as an array of its own (row scales over the block's rows), moves its anchors by
    what a receiver decodes of them, and returns the codes of the blocks it sends (plan.senders: a
    block held by several hosts goes from the lowest) keyed by (name, block), the block None where
    it is the whole tensor. Nothing is gathered across hosts; every host calls it at the same step.
    The codes below 4 bits keep their error buffers per block (`error[(name, block)]`), on the
    host that sends the block."""
    me, codes, moved = jax.process_index(), {}, {}
    sources = anchors.sources(names)[0]
    for n, (anchor, _), dt in zip(names, sources, _anchor_dtypes(anchors, leaves, names)):
        leaf, scheme = leaves[n], schemes[n]
        shape, sends = tuple(leaf.shape), senders(leaf)
        mine = {r for r, host in sends.items() if host == me}
        key = {r: (n, None if len(sends) == 1 else r) for r in sends}  # a whole tensor's entry has no block
        if scheme in device_codec.ON_DEVICE:
            by_device = {s.device: s.data for s in anchor.addressable_shards}
            new = []
            for shard in leaf.addressable_shards:  # each device its own copy of a block: replicas stay alike
                r = region_of(shard.index, shape)
                parts, m = _delta_code[False](by_device[shard.device], shard.data, None, scheme, dt)
                new.append(m)
                if r in mine and key[r] not in codes:
                    codes[key[r]] = device_codec.DeviceCode(tuple(shard.data.shape), scheme, parts)
            moved[n] = jax.make_array_from_single_device_arrays(shape, anchor.sharding, new)
            continue
        local = _float32(leaf)
        delta = _float32(anchor) - local
        sent = {}
        for shard in delta.addressable_shards:
            r = region_of(shard.index, shape)
            if r in sent or (error is not None and r not in mine):
                continue
            d = np.asarray(shard.data)
            if error is not None:
                d = d + error[key[r]] if key[r] in error else d
            sent[r] = quantize.coded(d, scheme)
            if error is not None:
                error[key[r]] = (d - sent[r].decoded()).astype(np.float32)
        codes.update({key[r]: c for r, c in sent.items() if r in mine})
        moved[n] = local if error is not None else (
            _float32(anchor) - place_blocks({r: c.decoded() for r, c in sent.items()}, delta, np.float32))
    anchors.keep(moved)
    return codes


def part_entries(leaves: Mapping[str, Any], names: list[str], schemes: Mapping[str, str]) -> list[list[TensorSpec]]:
    """Each host's manifest entries of a contribution of tensors `names` (sorted) from a learner over
    several hosts: the blocks it sends (plan.senders), in name and block order; the same lists on
    every host, made from the shardings alone."""
    hosts: list[list[TensorSpec]] = [[] for _ in range(jax.process_count())]
    for n in names:
        sends, shape = senders(leaves[n]), tuple(leaves[n].shape)
        for r, host in sorted(sends.items()):
            spec = TensorSpec(n, shape, schemes[n], 0, None if len(sends) == 1 else r)
            hosts[host].append(replace(spec, nbytes=quantize.encoded_nbytes(spec.coded_shape, spec.scheme)))
    return hosts


def rebase(anchors: Anchors, leaves: Mapping[str, Any], names: list[str], made_of: Mapping[str, tuple],
           blocks: Callable[[list[str]], Mapping[str, Mapping]], mode: str, alpha: float = 1.0) -> dict[str, Any]:
    """Each leaf of `names` with a new global version applied (placed like the leaf, in its dtype):
    rebase = the version plus the local steps since the anchor, overwrite = the version, mix = alpha
    version + (1 - alpha) local. The version comes as what it is made of (`made_of`: see
    version_on_devices) or, for the tensors that cannot be built on the devices, as this host's
    `blocks(names)`. The anchors become the new version (kept as `made_of` it where they can be).
    One jitted call per tensor, after one transfer of the bases and codes."""
    here = _made_here(made_of, leaves, names)
    rest = [n for n in names if n not in here]
    placed = place_all(blocks(rest), leaves) if rest else {}
    used, built = anchors.sources(names if mode == "rebase" else [],
                                  [(MadeOf(*made_of[n]), leaves[n].sharding) for n in here])
    new = dict(zip(here, built)) | {n: (placed[n], None) for n in rest}
    used = dict(zip(names, used)) if mode == "rebase" else dict.fromkeys(names, (None, None))
    out, keep = {}, {}
    for n, dt in zip(names, _anchor_dtypes(anchors, leaves, names)):
        (version, new_recipe), (anchor, anchor_recipe) = new[n], used[n]
        v, k = _rebased(version, leaves[n], anchor, new_recipe, anchor_recipe, mode, float(alpha), dt)
        out[n] = v if isinstance(leaves[n], jax.Array) else np.asarray(v)
        keep[n] = k if isinstance(leaves[n], jax.Array) else np.asarray(k)
    anchors.keep(keep, made_of)
    return out


def place_all(blocks: Mapping[str, Mapping], leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Each tensor's value from this host's blocks of it (plan.place_blocks), placed like its leaf and
    in its dtype; the leaves this process holds whole go in one transfer."""
    out, batch = {}, []
    for n, b in blocks.items():
        leaf = leaves[n]
        full = whole(tuple(leaf.shape))
        if isinstance(leaf, jax.Array) and leaf.is_fully_addressable and full in b:
            batch.append(n)
        else:
            out[n] = place_blocks(b, leaf)
    if batch:
        values = [np.asarray(blocks[n][whole(tuple(leaves[n].shape))]).astype(leaves[n].dtype, copy=False) for n in batch]
        out.update(zip(batch, jax.device_put(values, [leaves[n].sharding for n in batch])))
    return {n: out[n] for n in blocks}


@functools.partial(jax.jit, static_argnames=("dtype",))
def _copy(x, dtype):
    return x.astype(dtype)


def copy_as(value, dtype=None):
    """A copy of `value` with buffers of its own (placed alike), in `dtype` (default its own)."""
    dtype = np.dtype(dtype or value.dtype)
    return _copy(value, jnp.dtype(dtype)) if isinstance(value, jax.Array) else np.array(value, dtype)


def _float32(leaf):
    return leaf.astype(jnp.float32) if isinstance(leaf, jax.Array) else np.asarray(leaf, np.float32)

