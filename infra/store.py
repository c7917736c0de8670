"""TensorStore adapter: global fragment parameters and outer-optimizer state, one version per merge.

Layout `diloco-store/1` (LAYOUT) under `<store.url>/<run>/`:
    plan.json                                the run's plan (diloco.plan): tensor names, shapes, dtypes,
                                             fragments, merge rules, and the store's layout version
                                             (`"layout": "diloco-store/1"`); written once at provisioning.
                                             A run whose plan.json names another layout, or none (written
                                             before layouts were versioned), is refused by name
                                             (`LayoutError`), never guessed at
    fragments/<ppp>/v<vvvvvvvv>/e<eeeeee>/params/<tensor>   zarr3 arrays in the plan's dtype (bf16 stays bf16);
                                             one object per tensor, in blocks along its longest axis
                                             (zarr3 sharding) so that a host of a sharded learner
                                             reads only the bytes of its own shards
    fragments/<ppp>/v<vvvvvvvv>/e<eeeeee>/opt/<state leaf>  zarr3 float32 arrays
    fragments/<ppp>/v<vvvvvvvv>/e<eeeeee>/residual/<tensor> zarr3 float32: quantization error the
                                             syncer carries into the next update
    fragments/<ppp>/v<vvvvvvvv>/e<eeeeee>/update/<tensor>   the encoded update from the snapshot before
                                             v (raw bytes, quantize.encode_update): what learners fetch
    fragments/<ppp>/v<vvvvvvvv>/meta.json    written last, names its e<eeeeee> folder: a version
                                             without it is incomplete
    fragments/<ppp>/committed.json           {"version": v}: the newest version the syncer knows is
                                             committed in Redis (written after each commit and claim,
                                             never moved back)

Committed versions: a version with meta.json is complete, not necessarily committed. The syncer
writes it, then commits it in Redis; a crash or a fenced owner in between leaves an orphan (never
announced, overwritten by the next merge). Readers (evals, `restore`, `diloco ckpt`) take the newest
committed version (`committed`): the marker, or a version whose successor is stored (nobody writes
v+1 before v is committed); a crash between the commit and the marker only makes them one version
conservative until the next merge or claim. A fragment without a marker yet (provisioning writes
version 0 of every fragment, then marks them; or versions written by hand) counts its newest
complete version.

Snapshots: params, opt and residual are written only at snapshot versions (version 0 and every
`store.snapshot_every`-th one); a version between two snapshots stores its update alone, the only
thing learners read (its meta says `snapshot: false` and which snapshot it follows). Every update
after version 0 is relative to the newest snapshot before its version (meta `update.from`; a
snapshot's own update is relative to the snapshot before it), so one update takes a reader holding
that snapshot to any version, however many were committed in between, and a reader holding an
older snapshot walks the snapshots' updates first. A version's parameters are its base's with its
one update applied, bit for bit what every learner holds (`read_params`); with
`syncer.update_base: previous` each update is from version - 1 (`from` = v - 1) and reads the same
way, one link per version; its outer state and residual are rebuilt by the syncer by replaying the
merges since the snapshot (syncer.rebuild.rebuild). So a version costs its update's bytes, not 13
bytes per parameter.

Readers ask the store, never its paths: which versions there are (`versions`, `committed`,
`committed_versions`, `catalog`; the runs under a store root: `run_ids`), what a version is made of
(`chain`: its snapshot and the updates from there; `path`: the updates that take a reader holding
some versions to it), a version's update (`read_update`), its arrays (`read`, `read_params`,
`read_blocks`) and the bytes it occupies (`stored_nbytes`). The fetcher, `restore`, `diloco ckpt`, `diloco state repair` and the syncer's
rebuild all do. Works on `file://` and `gs://` (the `gcs` driver; point TENSORSTORE_GCS_HTTP_URL at
an emulator).

Fencing: the epoch is the writer's ownership epoch of the fragment (a counter in Redis that each
takeover bumps). Each writer puts its arrays in its own epoch folder, so a stale owner never
overwrites a newer owner's arrays, and meta.json is replaced only by a conditional write (TensorStore's
`if_equal` generation, a compare-and-swap on file and GCS) when its epoch is not older than the one
already there. A stale owner's late write is refused with `Fenced`; what decides the version is the
fenced commit in Redis that follows the write.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlparse

import ml_dtypes
import numpy as np
import tensorstore as ts

from diloco import packing, quantize
from diloco.config import redact_url
from diloco.plan import Plan, PlanError, Region

_BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCK_BYTES = 1 << 18   # a params tensor above 2x this is stored in blocks of at least this size
MAX_BLOCKS = 64
_VERSION_KEY = re.compile(r"fragments/(\d+)/v(\d+)/(.+)")                  # a key of a version's folder
_RUN_KEY = re.compile(r"([^/]+)/(?:plan\.json|fragments/\d+/v\d+/.+)")     # a run's key, under a store root


def block_shape(shape: tuple[int, ...], itemsize: int) -> list[int] | None:
    """Inner chunks of a params tensor: its longest axis cut into a power-of-two count of blocks,
    as FSDP shards it (None: small enough to read whole)."""
    nbytes = math.prod(shape) * itemsize
    if not shape or nbytes < 2 * BLOCK_BYTES:
        return None
    axis = max(range(len(shape)), key=lambda i: shape[i])
    k = 1
    while k * 2 <= MAX_BLOCKS and shape[axis] % (k * 2) == 0 and nbytes // (k * 2) >= BLOCK_BYTES:
        k *= 2
    if k == 1:
        return None
    inner = list(shape)
    inner[axis] //= k
    return inner


def _zarr_dtype(arr: np.ndarray) -> str:
    return "bfloat16" if arr.dtype == _BF16 else arr.dtype.name


def array_digest(a: np.ndarray) -> str:
    """The digest of an array's bytes in C order, as version 0's meta stores it per tensor (`digests`):
    a learner whose template is version 0 (the same model init) can tell without reading it."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:32]


class StoreError(RuntimeError):
    pass


LAYOUT = "diloco-store/1"  # the layout this module writes and reads (the module docstring)


class LayoutError(StoreError):
    """The run's store has another layout than this build's (LAYOUT), or none."""


def check_layout(layout: object, where: str) -> None:
    """Refuse a store whose plan.json names another layout than LAYOUT, by name."""
    if layout != LAYOUT:
        named = "no layout version (written before store layouts were versioned)" if layout is None \
            else f"store layout {layout!r}"
        raise LayoutError(f"{where}: {named} is not supported; this build reads {LAYOUT!r}")


def parse_plan(raw: bytes, run_url: str) -> Plan:
    """The plan in a run's plan.json; LayoutError unless it names this build's layout."""
    try:
        d = json.loads(raw)
    except ValueError as err:
        raise StoreError(f"{run_url}/plan.json: not JSON: {err}") from None
    check_layout(d.get("layout") if isinstance(d, dict) else None, run_url)
    try:
        return Plan.from_json(raw)
    except PlanError as err:
        raise StoreError(f"{run_url}/plan.json: {err}") from None


def is_snapshot(meta: dict) -> bool:
    """Whether a version holds its parameters, outer state and residual."""
    return meta["snapshot"]


def update_base(meta: dict) -> int:
    """The version a version's update is relative to (the snapshot before it, or with
    syncer.update_base: previous the version before it)."""
    return meta["update"]["from"]


def stored_update_bytes(meta: dict) -> int:
    """The bytes a reader of a version's update reads: its packed tensors as stored."""
    info = meta["update"]
    return sum(info["stored"][n] for n in info["tensors"])


def marker_version(raw: bytes) -> int:
    """The version a commit marker (fragments/<p>/committed.json) holds."""
    return int(json.loads(raw)["version"])


def committed_of(marker: int | None, complete: list[int]) -> int | None:
    """The newest committed version, from the commit marker and the complete versions (ascending)."""
    if marker is None:  # not marked yet: provisioning marks version 0 once it is written (or written by hand)
        return complete[-1] if complete else None
    held = set(complete)
    return max([marker, *(v for v in complete if v + 1 in held)])


class StoreFenced(StoreError):
    """A newer owner of the fragment already wrote this version."""


def kvstore_spec(url: str) -> dict:
    if redact_url(url) != url:
        raise StoreError(f"{redact_url(url)}: a store URL carries no credentials (TensorStore's gcs driver uses the "
                         "machine's Google credentials)")
    u = urlparse(url)
    if u.scheme == "file":
        path = (u.netloc + u.path) if u.netloc not in ("", "localhost") else u.path
        return {"driver": "file", "path": path.rstrip("/") + "/"}
    if u.scheme == "gs":
        if len(u.netloc) < 3:
            raise StoreError(f"{url}: GCS bucket names need at least 3 characters")
        return {"driver": "gcs", "bucket": u.netloc, "path": u.path.strip("/") + "/" if u.path.strip("/") else ""}
    raise StoreError(f"unsupported store URL {url!r}: use file://PATH or gs://BUCKET/PATH")


@dataclass(frozen=True)
class Link:
    """One version on the way to another, with its meta.json: whether it is a snapshot, and the version
    its update comes from."""
    version: int
    meta: dict

    @property
    def snapshot(self) -> bool:
        return is_snapshot(self.meta)

    @property
    def base(self) -> int | None:
        """The version its update comes from (None: it has no update, as version 0)."""
        return update_base(self.meta) if self.meta.get("update") else None

    @property
    def update_nbytes(self) -> int:
        """The bytes a reader of its update reads."""
        return stored_update_bytes(self.meta)


@dataclass(frozen=True)
class Chain:
    """What a version is made of: the snapshot it is built on, and the versions from there to it, each
    an update of the one before, oldest first (empty for a snapshot)."""
    snapshot: int
    links: list[Link]


@dataclass(frozen=True)
class Versions:
    """A fragment's versions as stored: `complete` (with meta.json, ascending), `incomplete` (folders
    without meta.json: a write that crashed), `committed` (the newest committed version; a complete
    version above it is an orphan)."""
    complete: list[int]
    incomplete: list[int]
    committed: int | None


@dataclass(frozen=True)
class FragmentVersion:
    params: dict[str, np.ndarray]
    opt: dict[str, np.ndarray]
    meta: dict
    residual: dict[str, np.ndarray] = field(default_factory=dict)


def _safe(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]']+", name):
        raise StoreError(f"tensor name {name!r} is not storable")
    return name


_WRITE_FIELDS = ("epoch", "data", "params", "opt", "residual", "snapshot", "snapshot_at", "update")  # see write()


class FragmentStore:
    def __init__(self, url: str, run_id: str):
        self.url = url.rstrip("/") + f"/{run_id}"
        self._base = kvstore_spec(self.url)
        self._kv = ts.KvStore.open(self._base).result()
        self._plan: Plan | None = None

    def _dir(self, fragment: int, version: int) -> str:
        return f"fragments/{fragment:03d}/v{version:08d}/"

    def _array_spec(self, key: str, shape=None, dtype: str = "float32", blocks: list[int] | None = None) -> dict:
        spec = {"driver": "zarr3", "kvstore": {**self._base, "path": self._base["path"] + key + "/"}}
        # every chunk is stored, zeros too, and a chunk that is not there is an error where it is read:
        # a lost chunk of a snapshot must never read as zeros (every later version would build on them)
        spec["store_data_equal_to_fill_value" if shape is not None else "fill_missing_data_reads"] = shape is not None
        if shape is not None:
            chunk = list(shape) if shape else []
            spec["metadata"] = {"shape": list(shape), "data_type": dtype,
                                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}}}
            if blocks:  # one object, read by byte ranges of its blocks
                spec["metadata"]["codecs"] = [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": blocks, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]
        return spec

    def data_dir(self, fragment: int, version: int, meta: dict) -> str:
        return self._dir(fragment, version) + meta["data"]

    def write(self, fragment: int, version: int, params: dict[str, np.ndarray], opt: dict[str, np.ndarray],
              meta: dict, *, epoch: int = 0, residual: dict[str, np.ndarray] | None = None,
              update: dict[str, bytes] | None = None, update_scheme: str = "", update_packing: str = "none",
              snapshot_at: int | None = None, update_from: int | None = None) -> None:
        """Write one version; meta.json goes last so readers never see a half-written version.
        `update` (encoded with `update_scheme`, each tensor's codes stored packed with `update_packing`)
        takes version `update_from` (default version - 1) to this one. With `snapshot_at` (an earlier
        snapshot version) only the update is written: the version is not a snapshot."""
        data = f"e{epoch:06d}/"
        d = self._dir(fragment, version) + data
        residual = residual or {}
        snapshot = snapshot_at is None or snapshot_at == version
        if not snapshot:
            if not update:
                raise StoreError(f"fragment {fragment} v{version}: a version that is not a snapshot needs its update")
            params, opt, residual = {}, {}, {}
        packed = {n: packing.pack_smaller(blob, update_packing) for n, blob in (update or {}).items()}
        futures = [self._kv.write(f"{d}update/{_safe(n)}", blob) for n, (_, blob) in packed.items()]
        # Every array opened at once, then every write issued, so no round trip waits on another. The
        # epoch folder is this writer's own; a retry of the same version in it finds arrays of the same
        # names and shapes (one chunk each) and overwrites them whole, so no delete is needed first.
        opening = []
        for group, arrays in (("params", params), ("opt", opt), ("residual", residual)):
            for name, arr in arrays.items():
                arr = np.asarray(arr)
                keep = group == "params" and (arr.dtype.kind == "f" or arr.dtype == _BF16)  # the plan's dtype
                arr = arr if keep else arr.astype(np.float32, copy=False)
                blocks = block_shape(arr.shape, arr.dtype.itemsize) if group == "params" else None
                opening.append((ts.open(self._array_spec(f"{d}{group}/{_safe(name)}", arr.shape, _zarr_dtype(arr),
                                                         blocks), create=True, open=True), arr))
        futures += [t.result().write(arr) for t, arr in opening]
        for f in futures:
            f.result()
        body = {**meta, "fragment": fragment, "version": version, "epoch": epoch, "data": data,
                "params": sorted(params), "opt": sorted(opt), "residual": sorted(residual),
                "snapshot": snapshot, "snapshot_at": version if snapshot else snapshot_at}
        if update:
            base = version - 1 if update_from is None else update_from
            if not 0 <= base < version:
                raise StoreError(f"fragment {fragment} v{version}: an update from v{base} cannot lead to it")
            body["update"] = {"from": base, "scheme": update_scheme, "tensors": sorted(update),
                              "packing": {n: how for n, (how, _) in sorted(packed.items())},
                              "stored": {n: len(b) for n, (_, b) in sorted(packed.items())}}
        self._commit_meta(fragment, version, epoch, json.dumps(body, sort_keys=True).encode())

    @staticmethod
    def record_of(meta: dict) -> dict:
        """The `meta` a version was written with (the syncer's merge record): its meta.json less what
        write() adds about the stored arrays."""
        return {k: v for k, v in meta.items() if k not in _WRITE_FIELDS}

    def _commit_meta(self, fragment: int, version: int, epoch: int, body: bytes) -> None:
        key = self._dir(fragment, version) + "meta.json"
        while True:
            cur = self._kv.read(key).result()
            written_by = json.loads(cur.value).get("epoch", 0) if cur.state == "value" else -1
            if written_by > epoch:
                raise StoreFenced(f"{self.url}: fragment {fragment} v{version} was written by epoch "
                                  f"{written_by}; this writer holds epoch {epoch}")
            if self._kv.write(key, body, if_equal=cur.stamp.generation).result().generation:
                return  # an empty generation means the compare-and-swap lost a race: look again

    def read_meta(self, fragment: int, version: int) -> dict:
        r = self._kv.read(self._dir(fragment, version) + "meta.json").result()
        if r.state != "value":
            raise StoreError(f"{self.url}: fragment {fragment} version {version} not found")
        return json.loads(r.value)

    def has(self, fragment: int, version: int) -> bool:
        """Whether the version is complete (its meta.json exists)."""
        return self._kv.read(self._dir(fragment, version) + "meta.json").result().state == "value"

    def read(self, fragment: int, version: int, *, with_opt: bool = True) -> FragmentVersion:
        """A version's arrays. At a version that is not a snapshot only its parameters exist (the
        snapshot's with the updates applied); `opt` and `residual` are then empty."""
        meta = self.read_meta(fragment, version)
        if not is_snapshot(meta):
            return FragmentVersion(self.read_params(fragment, version, meta)[0], {}, meta)
        d = self.data_dir(fragment, version, meta)
        out = {}
        for group in ("params", "opt", "residual") if with_opt else ("params",):
            stores = {n: ts.open(self._array_spec(f"{d}{group}/{n}"), open=True) for n in meta[group]}
            try:
                reads = {n: s.result().read() for n, s in stores.items()}
                out[group] = {n: np.asarray(r.result()) for n, r in reads.items()}
            except ValueError as err:
                raise StoreError(f"{self.url}: fragment {fragment} v{version} {group} unreadable: {err}") from None
        return FragmentVersion(out["params"], out.get("opt", {}), meta, out.get("residual", {}))

    def read_params(self, fragment: int, version: int, meta: dict | None = None) -> tuple[dict[str, np.ndarray], int]:
        """(a version's parameters, bytes read): at a snapshot its arrays, else its update's base with
        the update applied, as a learner applies it (the same bits)."""
        chain = self.chain(fragment, version, meta)
        params = self.read(fragment, chain.snapshot, with_opt=False).params
        nbytes = sum(a.nbytes for a in params.values())
        for link in chain.links:
            scheme, update, read = self.read_update(fragment, link.version, link.meta)
            params = quantize.apply_update(params, update, scheme)
            nbytes += read
        return params, nbytes

    def _walk(self, fragment: int, version: int, meta: dict | None = None) -> Iterator[Link]:
        """`version`, then the version its update comes from, and so on to one without an update
        (version 0); each meta.json is read only when the walk gets there. A loop, not a recursion:
        with updates from the previous version a chain is as long as the snapshot interval."""
        while True:
            link = Link(version, meta or self.read_meta(fragment, version))
            yield link
            base = link.base
            if base is None:
                return
            if not 0 <= base < version:
                raise StoreError(f"{self.url}: fragment {fragment} v{version} is an update from v{base}")
            version, meta = base, None

    def chain(self, fragment: int, version: int, meta: dict | None = None) -> Chain:
        """What a version is made of: the snapshot it is built on and the updates from there to it."""
        links = []
        for link in self._walk(fragment, version, meta):
            if link.snapshot:
                return Chain(link.version, links[::-1])
            links.append(link)
        raise StoreError(f"{self.url}: fragment {fragment} v{version} is built on no snapshot")

    def path(self, fragment: int, version: int, *, held: Collection[int] = (), limit: int | None = None
             ) -> list[Link]:
        """The versions a reader holding the versions `held` reads to reach `version`, newest first:
        `version`, the version its update comes from, and so on, through the snapshots' own updates.
        It stops before a version in `held` (then its last link's `base` is that version), at a version
        without an update (version 0), or after `limit` links; empty if `version` is held."""
        out: list[Link] = []
        if version in held:
            return out
        for link in self._walk(fragment, version):
            out.append(link)
            if link.base is None or link.base in held or len(out) == limit:
                break
        return out

    def read_blocks(self, fragment: int, version: int, blocks: dict[str, list[Region]]
                    ) -> dict[str, dict[Region, np.ndarray]]:
        """Only the named blocks of a version's params: what one host of a sharded learner holds
        (between snapshots: the snapshot's blocks plus each update's, one tensor at a time)."""
        chain = self.chain(fragment, version)
        out = self._snapshot_blocks(fragment, chain.snapshot, blocks)
        for link in chain.links:
            scheme, update, _ = self.read_update(fragment, link.version, link.meta)
            for n, rs in out.items():
                dtype = next(iter(rs.values())).dtype
                step = quantize.decode(update[n], self._shape_of(n), scheme)
                for r in rs:
                    block = step[tuple(slice(a, b) for a, b in r)]
                    rs[r] = (rs[r].astype(np.float32) + block).astype(dtype)
                del step
        return out

    def _snapshot_blocks(self, fragment: int, version: int, blocks: dict[str, list[Region]]
                         ) -> dict[str, dict[Region, np.ndarray]]:
        meta = self.read_meta(fragment, version)
        d = self.data_dir(fragment, version, meta)
        if missing := sorted(set(blocks) - set(meta["params"])):
            raise StoreError(f"{self.url}: fragment {fragment} v{version} has no params {missing[:4]}")
        stores = {n: ts.open(self._array_spec(f"{d}params/{n}"), open=True) for n in blocks}
        try:
            arrays = {n: s.result() for n, s in stores.items()}
            reads = {(n, r): arrays[n][tuple(slice(a, b) for a, b in r)].read() for n, rs in blocks.items() for r in rs}
            out: dict[str, dict[Region, np.ndarray]] = {n: {} for n in blocks}
            for (n, r), f in reads.items():
                out[n][r] = np.asarray(f.result())
        except (ValueError, IndexError) as err:
            raise StoreError(f"{self.url}: fragment {fragment} v{version} params unreadable: {err}") from None
        return out

    def _shape_of(self, name: str) -> tuple[int, ...]:
        self._plan = self._plan or self.read_plan()  # read once per store object
        if name not in self._plan.by_name:
            raise StoreError(f"{self.url}: tensor {name!r} is not in the run's plan")
        return self._plan.by_name[name].shape

    def read_update(self, fragment: int, version: int, meta: dict | None = None) -> tuple[str, dict[str, bytes], int]:
        """(scheme, encoded tensors, bytes read) of the update that takes its base (`update_base(meta)`)
        to `version`: the codes unpacked, each checked to have its tensor's size."""
        meta = meta or self.read_meta(fragment, version)
        info = meta.get("update")
        if not info or not isinstance(info.get("from"), int) or not 0 <= info["from"] < version:
            raise StoreError(f"{self.url}: fragment {fragment} v{version} has no update")
        d = self.data_dir(fragment, version, meta) + "update/"
        how = info["packing"]  # per tensor
        reads = {n: self._kv.read(d + n) for n in info["tensors"]}
        out, nbytes = {}, 0
        for n, f in reads.items():
            r = f.result()
            if r.state != "value":
                raise StoreError(f"{self.url}: fragment {fragment} v{version} update/{n} is missing")
            nbytes += len(r.value)
            try:
                out[n] = packing.unpack(r.value, how[n],
                                        quantize.encoded_nbytes(self._shape_of(n), info["scheme"]))
            except (packing.PackingError, quantize.CodecError) as err:
                raise StoreError(f"{self.url}: fragment {fragment} v{version} update/{n}: {err}") from None
        return info["scheme"], out, nbytes

    def write_plan(self, plan: Plan) -> None:
        """Store the run's plan with the store's layout version (once, at provisioning; a rewrite must
        say the same)."""
        key = "plan.json"
        body = json.dumps({**json.loads(plan.to_json()), "layout": LAYOUT}, indent=1).encode()
        cur = self._kv.read(key).result()
        if cur.state == "value" and parse_plan(cur.value, self.url) != plan:
            raise StoreError(f"{self.url}/plan.json already holds a different plan for this run")
        self._kv.write(key, body).result()

    def read_plan(self) -> Plan:
        """The run's plan; LayoutError if its store has another layout than this build's. Every reader
        (learners, the syncer, evals, `restore`, `diloco ckpt`) reads it first."""
        r = self._kv.read("plan.json").result()
        if r.state == "value":
            return parse_plan(r.value, self.url)
        if self._has_versions():
            check_layout(None, self.url)  # versions without a plan: a run from before plans were stored
        raise StoreError(f"{self.url}: no plan.json; the run is not provisioned (`diloco train` provisions it)")

    def _marker(self, fragment: int) -> str:
        return f"fragments/{fragment:03d}/committed.json"

    def read_committed(self, fragment: int) -> int | None:
        """The fragment's commit marker: the newest version known committed in Redis (None: no marker)."""
        r = self._kv.read(self._marker(fragment)).result()
        return marker_version(r.value) if r.state == "value" else None

    def mark_committed(self, fragment: int, version: int) -> None:
        """Move the commit marker to `version` (the syncer calls this only once Redis committed it);
        never back: a compare-and-swap, so a slower writer of an older version leaves it alone."""
        key = self._marker(fragment)
        while True:
            cur = self._kv.read(key).result()
            if cur.state == "value" and marker_version(cur.value) >= version:
                return
            body = json.dumps({"version": version}).encode()
            if self._kv.write(key, body, if_equal=cur.stamp.generation).result().generation:
                return

    def committed(self, fragment: int) -> int | None:
        """The fragment's newest committed version (None if it has none); see the module docstring."""
        return committed_of(self.read_committed(fragment), self.versions(fragment))

    def versions(self, fragment: int) -> list[int]:
        """Complete versions of a fragment (those with meta.json), ascending."""
        return self._listing(f"fragments/{fragment:03d}/").get(fragment, (set(), []))[1]

    def committed_versions(self, fragment: int) -> list[int]:
        """The fragment's committed versions, ascending (never an orphan above the newest)."""
        complete = self.versions(fragment)
        newest = committed_of(self.read_committed(fragment), complete)
        return [v for v in complete if newest is not None and v <= newest]

    def catalog(self) -> dict[int, Versions]:
        """Every stored fragment's versions (one listing of the run's fragments/, one read of each
        fragment's commit marker)."""
        found = self._listing("fragments/")
        markers = {p: self._kv.read(self._marker(p)) for p in found}  # all in flight at once
        out = {}
        for p, (folders, complete) in sorted(found.items()):
            r = markers[p].result()
            try:
                marker = marker_version(r.value) if r.state == "value" else None
            except (ValueError, KeyError, TypeError) as err:
                raise StoreError(f"{self.url}/{self._marker(p)} is unreadable: {err}") from None
            out[p] = Versions(complete, sorted(folders - set(complete)), committed_of(marker, complete))
        return out

    def _listing(self, prefix: str) -> dict[int, tuple[set[int], list[int]]]:
        """fragment -> (its version folders, its complete versions ascending), from the keys under prefix."""
        keys = self._kv.list(ts.KvStore.KeyRange(prefix, prefix + "\xff")).result()
        found: dict[int, tuple[set[int], set[int]]] = {}
        for k in keys:
            if m := _VERSION_KEY.fullmatch(k.decode() if isinstance(k, bytes) else k):
                folders, complete = found.setdefault(int(m.group(1)), (set(), set()))
                folders.add(int(m.group(2)))
                if m.group(3) == "meta.json":
                    complete.add(int(m.group(2)))
        return {p: (folders, sorted(complete)) for p, (folders, complete) in found.items()}

    def stored_nbytes(self, fragment: int, version: int) -> int:
        """The bytes a version occupies in the store: every object of its folder (meta.json, its arrays,
        its update), read back."""
        prefix = self._dir(fragment, version)
        keys = self._kv.list(ts.KvStore.KeyRange(prefix, prefix + "\xff")).result()
        reads = [self._kv.read(k.decode() if isinstance(k, bytes) else k) for k in keys]
        return sum(len(r.result().value) for r in reads)

    def exists(self) -> bool:
        """Whether anything of the run is stored (its plan.json or versions)."""
        return self._kv.read("plan.json").result().state == "value" or self._has_versions()

    def _has_versions(self) -> bool:
        return bool(self._kv.list(ts.KvStore.KeyRange("fragments/", "fragments/\xff")).result())



def run_ids(url: str) -> list[str]:
    """The runs under a store root (the config's store.url): its folders that hold a plan.json or
    versions, sorted. One listing of every key under the root (TensorStore lists without a delimiter)."""
    kv = ts.KvStore.open(kvstore_spec(url.rstrip("/"))).result()
    found = set()
    for k in kv.list().result():
        if m := _RUN_KEY.fullmatch(k.decode() if isinstance(k, bytes) else k):
            found.add(m.group(1))
    return sorted(found)
