"""Checkpoint inspection: the fragment versions the syncer wrote to TensorStore, as plain dicts.

A checkpoint URL is the store URL with the run id as its last path element:
`file:///data/store/<run>` or `gs://bucket/path/<run>`. The store (`FragmentStore`, the one owner of
its layout) says which fragments and versions exist and reads their arrays; nothing here parses its
paths. The store URL itself (the config's `store.url`) is a store root: `open_url` tells the two
apart and `runs` lists a root's runs.

Statistics (norm, min, max, mean) are over the finite entries, so one NaN does not hide the rest;
`nonfinite` counts the others.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from diloco.config import redact_url
from diloco.infra.store import FragmentStore, FragmentVersion, LayoutError, StoreError, is_snapshot, run_ids
from diloco.ops import OpsError

EXPORT_FORMATS = ("safetensors", "npz", "orbax")


def split_url(url: str) -> tuple[str, str]:
    """`<store url>/<run id>` -> (store url, run id)."""
    u = urlparse(url)
    if not u.scheme:  # a plain local path
        url = "file://" + str(Path(url).resolve())
        u = urlparse(url)
    if u.scheme not in ("file", "gs"):
        raise OpsError(f"{redact_url(url)!r} is not a checkpoint URL: use file:///PATH/<run id> or gs://BUCKET/PATH/<run id>")
    parts = (u.netloc + u.path).strip("/").split("/") if u.scheme == "file" else u.path.strip("/").split("/")
    if not parts[-1] or (u.scheme == "file" and len(parts) < 2):
        shown = redact_url(url)
        raise OpsError(f"{shown!r} names no run: the run id is the last path element, e.g. {shown.rstrip('/')}/<run id>")
    run = parts[-1]
    return url.rstrip("/")[: -len(run)].rstrip("/"), run


@dataclass
class Checkpoint:
    url: str
    run: str
    store: FragmentStore
    versions: dict[int, list[int]]                            # complete versions (with meta.json)
    committed: dict[int, int]                                 # newest committed version (infra/store.py); a
                                                              # complete version above it is an orphan
    incomplete: dict[int, list[int]]                          # written without meta.json: a crash


@dataclass
class StoreRoot:
    url: str
    runs: list[str]                                           # the run ids under the root


def _normalize(url: str) -> str:
    u = urlparse(url)
    if not u.scheme:  # a plain local path
        return "file://" + str(Path(url).resolve())
    if u.scheme not in ("file", "gs"):
        raise OpsError(f"{redact_url(url)!r} is not a checkpoint URL: use file:///PATH or gs://BUCKET/PATH (a store root), "
                       f"or either with /<run id> after it")
    return url.rstrip("/")


def open_url(url: str) -> Checkpoint | StoreRoot:
    """A run folder (it holds plan.json, or fragments/) opens as a Checkpoint, refused by name unless
    its plan.json names this build's store layout; a store root (folders <run>/ holding plan.json or
    fragments/) as a StoreRoot.

    A root is read with one listing of every key under it (TensorStore's kvstore lists by key range,
    without a delimiter), then each run's versions as `ls` reads them: the cost grows with the number
    of stored arrays, about twice that of `ls` of each run.
    """
    url = _normalize(url)
    try:
        if _is_run(url):
            return open_checkpoint(url)
        found = run_ids(url)
    except (ValueError, StoreError) as err:
        raise OpsError(f"{redact_url(url)}: cannot list the store: {err}") from None
    if found:
        return StoreRoot(url, found)
    raise OpsError(f"{url}: no checkpoint here (no fragments/<p>/v<n>/meta.json) and no runs (no <run>/plan.json "
                   f"or <run>/fragments/); check the store URL and run id")


def _is_run(url: str) -> bool:
    try:
        store_url, run = split_url(url)
    except OpsError:  # names no run: a root, if anything
        return False
    return FragmentStore(store_url, run).exists()


def runs(root: StoreRoot) -> dict:
    """One row per run of a store root: fragments, tensors, parameters and dtypes from its plan.json, and
    each fragment's newest committed version. A run of another store layout (or of none) gets a note instead."""
    rows = []
    for run in root.runs:
        store, plan, note, latest = FragmentStore(root.url, run), None, None, {}
        try:
            plan = store.read_plan()
        except StoreError as err:
            note = f"not read: {err}"
        if plan:
            try:
                catalog = store.catalog()
            except (ValueError, StoreError) as err:
                raise OpsError(f"{root.url}/{run}: {err}") from None
            if not any(v.complete for v in catalog.values()):
                note = "provisioned; no version written yet"
            latest = {p: catalog[p].committed if p in catalog else None for p in range(plan.fragments)}
        rows.append({"run": run, "fragments": plan.fragments if plan else None,
                     "tensors": len(plan.tensors) if plan else None,
                     "parameters": plan.num_params if plan else None,
                     "dtypes": sorted({t.dtype for t in plan.tensors}) if plan else [],
                     "latest": latest, "note": note})
    return {"url": root.url, "runs": rows}


def open_checkpoint(url: str) -> Checkpoint:
    store_url, run = split_url(url)
    try:
        store = FragmentStore(store_url, run)
        try:
            store.read_plan()  # refuses a store of another layout, by name
        except LayoutError:
            raise
        except StoreError:
            pass  # no plan.json: said below (no checkpoint here)
        catalog = store.catalog()
    except LayoutError as err:
        raise OpsError(str(err)) from None
    except (ValueError, StoreError) as err:
        raise OpsError(f"{redact_url(url)}: cannot list the store: {err}") from None
    versions = {p: c.complete for p, c in catalog.items() if c.complete}
    if not versions:
        raise OpsError(f"{url}: no checkpoint here (no fragments/<p>/v<n>/meta.json); check the store URL and run id")
    if missing := sorted(set(catalog) - set(versions)):
        raise OpsError(f"{url}: fragment(s) {missing} have no complete version")
    return Checkpoint(url, run, store, versions, {p: catalog[p].committed for p in versions},
                      {p: c.incomplete for p, c in catalog.items() if c.incomplete})


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
    """Fragment -> version to read. None = each fragment's newest committed one. With `fragment`, V must
    exist exactly, committed or not (an orphan can be looked at; `show` and `diff` say it is one);
    across all fragments, each gets its newest committed version <= V (fragments advance at different paces)."""
    if fragment is not None:
        if fragment not in ck.versions:
            raise OpsError(f"{ck.url}: no fragment {fragment} (the run has fragments {sorted(ck.versions)})")
        vs = ck.versions[fragment]
        if want is not None and want not in vs:
            raise OpsError(f"{ck.url}: fragment {fragment} has no version {want} (complete versions: {span(vs)})")
        return {fragment: ck.committed[fragment] if want is None else want}
    if want is None:
        return dict(ck.committed)
    newest = " ".join(f"p{p}:v{v}" for p, v in ck.committed.items())
    if want < 0 or want > max(ck.committed.values()):
        raise OpsError(f"{ck.url}: no fragment has version {want} committed (newest committed: {newest})")
    out = {}
    for p, vs in ck.versions.items():
        below = [v for v in vs if v <= min(want, ck.committed[p])]
        if not below:
            raise OpsError(f"{ck.url}: fragment {p} has no committed version <= {want} (complete versions: {span(vs)})")
        out[p] = below[-1]
    return out



def read_version(ck: Checkpoint, fragment: int, version: int, *, with_opt: bool = True) -> FragmentVersion:
    """A version's arrays (infra.store reads a missing or damaged chunk as an error naming it, never as
    the zarr fill value)."""
    try:
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
                 "late": metas[p, v].get("late", 0), "committed": v <= ck.committed[p]} for v in vs]
        frags.append({"fragment": p, "latest": ck.committed[p], "versions": rows, "incomplete": ck.incomplete.get(p, [])})
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
        frags.append({"fragment": p, "version": v, "committed": v <= ck.committed[p], "tokens": fv.meta.get("tokens", 0),
                      "contributors": _contributors(fv.meta), "reason": fv.meta.get("reason"),
                      "time": fv.meta.get("time"),
                      "params": {n: tensor_stats(a) for n, a in sorted(fv.params.items())},
                      "opt": {n: tensor_stats(a) for n, a in sorted(fv.opt.items())},
                      "residual": {n: tensor_stats(a) for n, a in sorted(fv.residual.items())},
                      "update": fv.meta.get("update", {}).get("scheme"),
                      "snapshot": is_snapshot(fv.meta), "snapshot_at": fv.meta["snapshot_at"]})
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
        both_whole = is_snapshot(a.meta) and is_snapshot(b.meta)  # between snapshots only params are stored
        for group in ("params", "opt") if both_whole else ("params",):
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
                      "committed": {"from": first[p] <= ck.committed[p], "to": second[p] <= ck.committed[p]},
                      "params_change_norm": change, "params_relative": change / base if base else None})
    return {"url": ck.url, "run": ck.run, "fragments": frags}


def nest(params: dict[str, np.ndarray]) -> tuple[dict, str]:
    """(tree, layout): `layer0.qkv` -> {"layer0": {"qkv": a}} ("nested"); the flat dict by name ("flat")
    when a name is both a leaf and a branch (`a` and `a.b`) or has an empty part."""
    tree: dict = {}
    for name, a in sorted(params.items()):
        *branch, leaf = parts = name.split(".")
        node = tree
        for k in branch:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                return dict(params), "flat"
        if not all(parts) or leaf in node:
            return dict(params), "flat"
        node[leaf] = a
    return tree, "nested"


def _write_orbax(output: Path, params: dict[str, np.ndarray], meta: dict) -> str:
    import orbax.checkpoint as ocp

    if output.exists():  # Orbax replaces a checkpoint folder whole (force=True); never do that to a user's folder
        raise OpsError(f"{output} already exists; an Orbax checkpoint is a new folder: choose another path")
    empty = sorted(n for n, a in params.items() if a.size == 0)
    if empty:
        raise OpsError(f"Orbax cannot save zero-size arrays: {empty}; export as safetensors instead")
    tree, layout = nest(params)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(output, tree, custom_metadata=meta | {"layout": layout})
        ckptr.wait_until_finished()
    except (ValueError, OSError) as err:
        raise OpsError(f"{output}: Orbax save failed: {err}") from None
    finally:
        ckptr.close()
    return layout


def export(ck: Checkpoint, version: int | None, output: str | Path, fmt: str | None = None) -> dict:
    """Every fragment's parameters at one consistent set of versions: one safetensors or .npz file, or an
    Orbax checkpoint folder. `fmt` None: .npz by that suffix, else safetensors.

    The metadata records the run and the version used per fragment: safetensors' string metadata
    (`versions` a JSON string), the JSON string array `__diloco_metadata__` in an .npz, and Orbax's
    custom metadata (`versions` a dict; `layout` says whether the tree is nested at '.' or flat).
    Tensors keep the plan's dtype: bf16 is BF16 in safetensors and bfloat16 in Orbax (an .npz cannot
    hold bf16: NumPy stores it as raw 2-byte voids).
    """
    output = Path(output)
    fmt = fmt or ("npz" if output.suffix == ".npz" else "safetensors")
    if fmt not in EXPORT_FORMATS:
        raise OpsError(f"unknown export format {fmt!r}: use one of {', '.join(EXPORT_FORMATS)}")
    chosen = pick_versions(ck, version)
    params: dict[str, np.ndarray] = {}
    for p, v in chosen.items():
        params |= read_version(ck, p, v, with_opt=False).params
    meta = {"format": "diloco", "run": ck.run, "source": ck.url,
            "requested_version": "latest" if version is None else str(version),
            "versions": json.dumps({str(p): v for p, v in chosen.items()})}
    output.parent.mkdir(parents=True, exist_ok=True)
    rep = {}
    if fmt == "orbax":
        output = output.resolve()  # Orbax wants an absolute path
        rep["layout"] = _write_orbax(output, params, meta | {"versions": {str(p): v for p, v in chosen.items()}})
        size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    elif fmt == "npz":
        np.savez(output, **params, __diloco_metadata__=np.array(json.dumps(meta)))
        size = output.stat().st_size
    else:
        from safetensors.numpy import save_file

        # safetensors maps the NumPy dtype name to its own: ml_dtypes' "bfloat16" is written as BF16
        # (the tests read the header back). Its NumPy loader has no BF16; safetensors.flax reads it.
        save_file({n: np.ascontiguousarray(a) for n, a in params.items()}, str(output), metadata=meta)
        size = output.stat().st_size
    return {"output": str(output), "format": fmt, "run": ck.run, "versions": chosen, "tensors": len(params),
            "parameters": int(sum(a.size for a in params.values())), "bytes": size, **rep}
