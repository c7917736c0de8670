"""Checkpoint inspection: the fragment versions the syncer wrote to TensorStore, as plain dicts.

A checkpoint URL is the store URL with the run id as its last path element:
`file:///data/store/<run>` or `gs://bucket/path/<run>`. One key listing of `fragments/` tells which
fragments and versions exist; arrays are read through `FragmentStore`.

Statistics (norm, min, max, mean) are over the finite entries, so one NaN does not hide the rest;
`nonfinite` counts the others.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import tensorstore as ts

from diloco.infra.store import FragmentStore, FragmentVersion, StoreError, kvstore_spec
from diloco.ops import OpsError

_KEY = re.compile(r"fragments/(\d+)/v(\d+)/(.+)")


def split_url(url: str) -> tuple[str, str]:
    """`<store url>/<run id>` -> (store url, run id)."""
    u = urlparse(url)
    if not u.scheme:  # a plain local path
        url = "file://" + str(Path(url).resolve())
        u = urlparse(url)
    if u.scheme not in ("file", "gs"):
        raise OpsError(f"{url!r} is not a checkpoint URL: use file:///PATH/<run id> or gs://BUCKET/PATH/<run id>")
    parts = (u.netloc + u.path).strip("/").split("/") if u.scheme == "file" else u.path.strip("/").split("/")
    if not parts[-1] or (u.scheme == "file" and len(parts) < 2):
        raise OpsError(f"{url!r} names no run: the run id is the last path element, e.g. {url.rstrip('/')}/<run id>")
    run = parts[-1]
    return url.rstrip("/")[: -len(run)].rstrip("/"), run


@dataclass
class Checkpoint:
    url: str
    run: str
    store: FragmentStore
    kv: ts.KvStore                                            # the run's root, for listing and zarr.json
    versions: dict[int, list[int]]                            # complete versions (with meta.json)
    incomplete: dict[int, list[int]]                          # written without meta.json: a crash
    keys: frozenset[str]


def open_checkpoint(url: str) -> Checkpoint:
    store_url, run = split_url(url)
    try:
        store = FragmentStore(store_url, run)
        kv = ts.KvStore.open(kvstore_spec(store.url)).result()
        raw = kv.list(ts.KvStore.KeyRange("fragments/", "fragments/\xff")).result()
    except (ValueError, StoreError) as err:
        raise OpsError(f"{url}: cannot list the store: {err}") from None
    keys = frozenset(k.decode() if isinstance(k, bytes) else k for k in raw)
    dirs: dict[int, set[int]] = {}
    complete: dict[int, set[int]] = {}
    for k in keys:
        if m := _KEY.fullmatch(k):
            p, v = int(m.group(1)), int(m.group(2))
            dirs.setdefault(p, set()).add(v)
            if m.group(3) == "meta.json":
                complete.setdefault(p, set()).add(v)
    if not complete:
        raise OpsError(f"{url}: no checkpoint here (no fragments/<p>/v<n>/meta.json); check the store URL and run id")
    missing = sorted(set(dirs) - set(complete))
    if missing:
        raise OpsError(f"{url}: fragment(s) {missing} have no complete version")
    return Checkpoint(url, run, store, kv, {p: sorted(vs) for p, vs in sorted(complete.items())},
                      {p: sorted(dirs[p] - complete[p]) for p in sorted(dirs) if dirs[p] - complete[p]}, keys)


def span(versions: list[int]) -> str:
    """[0, 1, 2, 5] -> 'v0-v2 v5'."""
    out, start = [], None
    for i, v in enumerate(versions):
        start = v if start is None else start
        if i + 1 == len(versions) or versions[i + 1] != v + 1:
            out.append(f"v{start}" if start == v else f"v{start}-v{v}")
            start = None
    return " ".join(out)


def pick_versions(ck: Checkpoint, want: int | None, fragment: int | None = None) -> dict[int, int]:
    """Fragment -> version to read. None = each fragment's newest. With `fragment`, V must exist exactly;
    across all fragments, each gets its newest version <= V (fragments advance at different paces)."""
    if fragment is not None:
        if fragment not in ck.versions:
            raise OpsError(f"{ck.url}: no fragment {fragment} (the run has fragments {sorted(ck.versions)})")
        vs = ck.versions[fragment]
        if want is not None and want not in vs:
            raise OpsError(f"{ck.url}: fragment {fragment} has no version {want} (complete versions: {span(vs)})")
        return {fragment: vs[-1] if want is None else want}
    if want is None:
        return {p: vs[-1] for p, vs in ck.versions.items()}
    newest = " ".join(f"p{p}:v{vs[-1]}" for p, vs in ck.versions.items())
    if want < 0 or want > max(vs[-1] for vs in ck.versions.values()):
        raise OpsError(f"{ck.url}: no fragment has version {want} (newest: {newest})")
    out = {}
    for p, vs in ck.versions.items():
        below = [v for v in vs if v <= want]
        if not below:
            raise OpsError(f"{ck.url}: fragment {p} has no version <= {want} (complete versions: {span(vs)})")
        out[p] = below[-1]
    return out


def _check_chunks(ck: Checkpoint, fragment: int, version: int, meta: dict, groups: tuple[str, ...]) -> None:
    """Every array needs its zarr.json; every `params` array needs all its chunks. TensorStore reads a
    missing chunk as the fill value (0) without complaint, and parameters are never all zero, so a
    missing parameter chunk means lost data. Optimizer chunks may legitimately be absent (zeros)."""
    d = ck.store.data_dir(fragment, version, meta)
    for group in groups:
        for name in meta.get(group, []):
            base = f"{d}{group}/{name}/"
            if base + "zarr.json" not in ck.keys:
                raise OpsError(f"{ck.url}: fragment {fragment} v{version}: {base}zarr.json is missing")
            if group != "params":
                continue
            r = ck.kv.read(base + "zarr.json").result()
            zmeta = json.loads(r.value)
            enc = zmeta.get("chunk_key_encoding", {})
            if enc.get("name") != "default":
                continue
            sep = enc.get("configuration", {}).get("separator", "/")
            chunk = zmeta["chunk_grid"]["configuration"]["chunk_shape"]
            grid = [math.ceil(s / c) if c else 0 for s, c in zip(zmeta["shape"], chunk)]
            for idx in np.ndindex(*grid):
                key = base + "c" + "".join(f"{sep}{i}" for i in idx)
                if key not in ck.keys:
                    raise OpsError(f"{ck.url}: fragment {fragment} v{version}: chunk {key} of params/{name} is missing")


def read_version(ck: Checkpoint, fragment: int, version: int, *, with_opt: bool = True) -> FragmentVersion:
    try:
        meta = ck.store.read_meta(fragment, version)
        _check_chunks(ck, fragment, version, meta, ("params", "opt") if with_opt else ("params",))
        return ck.store.read(fragment, version, with_opt=with_opt)
    except (StoreError, ValueError, KeyError) as err:
        # ValueError covers a meta.json that is not JSON; KeyError one that lacks its array lists
        raise OpsError(f"{ck.url}: fragment {fragment} v{version} unreadable: {err}") from None


def _contributors(meta: dict) -> list[str]:
    return meta.get("learners", meta.get("contributors", []))  # version 0 says contributors, merges learners


def ls(ck: Checkpoint) -> dict:
    pairs = [(p, v) for p, vs in ck.versions.items() for v in vs]
    try:
        with ThreadPoolExecutor(16) as pool:  # one small read per version: overlap them on gs://
            metas = dict(zip(pairs, pool.map(lambda pv: ck.store.read_meta(*pv), pairs)))
    except (StoreError, ValueError) as err:
        raise OpsError(f"{ck.url}: {err}") from None
    frags = []
    for p, vs in ck.versions.items():
        rows = [{"version": v, "time": metas[p, v].get("time"), "tokens": metas[p, v].get("tokens", 0),
                 "contributors": _contributors(metas[p, v]), "reason": metas[p, v].get("reason"),
                 "late": metas[p, v].get("late", 0)} for v in vs]
        frags.append({"fragment": p, "latest": vs[-1], "versions": rows, "incomplete": ck.incomplete.get(p, [])})
    return {"url": ck.url, "run": ck.run, "fragments": frags}


def tensor_stats(a: np.ndarray) -> dict:
    a = np.asarray(a)
    finite = a[np.isfinite(a)].astype(np.float64)
    some = finite.size > 0
    return {"shape": list(a.shape), "dtype": str(a.dtype), "size": int(a.size),
            "norm": float(np.linalg.norm(finite)), "min": float(finite.min()) if some else None,
            "max": float(finite.max()) if some else None, "mean": float(finite.mean()) if some else None,
            "nonfinite": int(a.size - finite.size)}


def show(ck: Checkpoint, version: int | None = None, fragment: int | None = None) -> dict:
    frags = []
    for p, v in pick_versions(ck, version, fragment).items():
        fv = read_version(ck, p, v)
        frags.append({"fragment": p, "version": v, "tokens": fv.meta.get("tokens", 0),
                      "contributors": _contributors(fv.meta), "reason": fv.meta.get("reason"),
                      "time": fv.meta.get("time"),
                      "params": {n: tensor_stats(a) for n, a in sorted(fv.params.items())},
                      "opt": {n: tensor_stats(a) for n, a in sorted(fv.opt.items())},
                      "residual": {n: tensor_stats(a) for n, a in sorted(fv.residual.items())},
                      "update": fv.meta.get("update", {}).get("scheme")})
    return {"url": ck.url, "run": ck.run, "fragments": frags}


def change_stats(a: np.ndarray, b: np.ndarray) -> dict:
    """How b differs from a: norm of the change, relative to a's norm (None if a is zero and b is not)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = b64 - a64
    base, change = float(np.linalg.norm(a64)), float(np.linalg.norm(d))
    return {"shape": list(a64.shape), "base_norm": base, "change_norm": change,
            "relative": change / base if base else (0.0 if change == 0 else None),
            "max_abs": float(np.abs(d).max()) if d.size else 0.0}


def diff(ck: Checkpoint, v1: int, v2: int, fragment: int | None = None) -> dict:
    first, second = pick_versions(ck, v1, fragment), pick_versions(ck, v2, fragment)
    frags = []
    for p in first:
        a, b = read_version(ck, p, first[p]), read_version(ck, p, second[p])
        tensors = {}
        for group in ("params", "opt"):
            x, y = getattr(a, group), getattr(b, group)
            if set(x) != set(y):
                raise OpsError(f"{ck.url}: fragment {p} {group} differ in names between v{first[p]} and "
                               f"v{second[p]}: {sorted(set(x) ^ set(y))}")
            for n in sorted(x):
                if x[n].shape != y[n].shape:
                    raise OpsError(f"{ck.url}: fragment {p} {group}/{n} has shape {x[n].shape} in v{first[p]} "
                                   f"and {y[n].shape} in v{second[p]}")
                tensors[f"{group}/{n}"] = change_stats(x[n], y[n])
        params = [s for k, s in tensors.items() if k.startswith("params/")]
        base = math.sqrt(sum(s["base_norm"] ** 2 for s in params))
        change = math.sqrt(sum(s["change_norm"] ** 2 for s in params))
        frags.append({"fragment": p, "from": first[p], "to": second[p], "tensors": tensors,
                      "params_change_norm": change, "params_relative": change / base if base else None})
    return {"url": ck.url, "run": ck.run, "fragments": frags}


def export(ck: Checkpoint, version: int | None, output: str | Path) -> dict:
    """Every fragment's parameters at one consistent set of versions, in one safetensors (or .npz) file.

    The metadata records the run and the version used per fragment; in an .npz it is the JSON string
    array `__diloco_metadata__`.
    """
    chosen = pick_versions(ck, version)
    params: dict[str, np.ndarray] = {}
    for p, v in chosen.items():
        params |= read_version(ck, p, v, with_opt=False).params
    meta = {"format": "diloco", "run": ck.run, "source": ck.url,
            "requested_version": "latest" if version is None else str(version),
            "versions": json.dumps({str(p): v for p, v in chosen.items()})}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".npz":
        np.savez(output, **params, __diloco_metadata__=np.array(json.dumps(meta)))
    else:
        from safetensors.numpy import save_file

        save_file({n: np.ascontiguousarray(a) for n, a in params.items()}, str(output), metadata=meta)
    return {"output": str(output), "run": ck.run, "versions": chosen, "tensors": len(params),
            "parameters": int(sum(a.size for a in params.values())), "bytes": output.stat().st_size}
