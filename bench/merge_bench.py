"""Micro-benchmark of the syncer's merge path: validate (checksum, norms and finiteness from the
codes) + token weights + fused RDA + outer step + fused update encoding + TensorStore write, against
a plain NumPy copy of the same bytes and the NumPy reference math (decode, stack, merge), both
measured in the same process. Timed versions fall between two snapshots (store.snapshot_every): their
write is the encoded update learners fetch; a snapshot version's extra write (parameters, outer
state, residual) is measured once and amortized. Times per phase and store bytes per version are
reported."""

from __future__ import annotations

import math
import tempfile
import time

import numpy as np

from diloco import messages, quantize
from diloco.config import TransformerOptions
from diloco.infra.store import FragmentStore
from diloco.models.transformer import init_params
from diloco.syncer import fused
from diloco.syncer import merge as merge_math


def contributions(params: dict[str, np.ndarray], k: int, scheme: str, seed: int = 0) -> list[tuple]:
    """k encoded contributions (manifest, payload) of random deltas shaped like `params`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(k):
        deltas = {n: (1e-3 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in params.items()}
        manifest, frames = messages.encode_contribution(
            run="bench", learner=f"l{i}", region="r", fragment=0, base_version=0, tokens=1000 * (i + 1),
            steps=10, step_time=0.1, deltas=deltas, scheme=scheme, chunk_bytes=1 << 30)
        _, payload = messages.parse_frame(frames[1])
        out.append((manifest, bytes(payload)))
    return out


PHASES = ("validate", "merge", "outer_step_and_update", "store_write")


def merge_once(contribs: list[tuple], params: dict[str, np.ndarray], opt, opt_state, store: FragmentStore,
               version: int, broadcast: str = "int8", threads: int = 1, times: dict | None = None,
               snapshot_every: int = 8) -> int:
    """The syncer's merge path (syncer/fused.py, as Syncer.validate and Syncer._merged run it):
    checksum and norms from the codes, fused RDA, the outer step fused with the update encoding, store write."""
    times = {} if times is None else times
    clock = [time.perf_counter()]

    def lap(phase: str) -> None:
        now = time.perf_counter()
        times[phase] = times.get(phase, 0.0) + now - clock[0]
        clock[0] = now

    deltas = []
    for manifest, payload in contribs:
        messages.verify_payload(manifest, payload)
        d = fused.encoded_delta(manifest, payload)
        if any(d.tensors[n].shape != params[n].shape or not math.isfinite(d.norms[n]) for n in params):
            raise ValueError("benchmark contribution failed validation")
        deltas.append(d)
    lap("validate")
    weights = merge_math.token_weights([m.tokens for m, _ in contribs], [m.steps for m, _ in contribs])
    delta = fused.merge(deltas, weights, ("tok_embed", "pos_embed"), threads=threads)
    lap("merge")
    update, new, residual, state = fused.outer_update(params, opt_state, delta, {}, lr=0.7, momentum=0.9, nesterov=True,
                                                      scheme=broadcast, threads=threads)
    lap("outer_step_and_update")
    # version 0 (the warm-up) has no version to be an update from: it is a snapshot only
    store.write(0, version, new, merge_math.flatten_state(state), {"time": time.time()}, residual=residual,
                update=update if version else None, update_scheme=broadcast,
                snapshot_at=None if version % snapshot_every == 0 else 0)
    lap("store_write")
    return sum(len(b) for b in update.values())


def reference_once(contribs: list[tuple], params: dict[str, np.ndarray], opt, opt_state, broadcast: str = "int8"
                   ) -> None:
    """The same math on the NumPy reference path (decode every contribution, stack, merge.merge_deltas,
    quantize.encode_update), without the store write: the baseline the fused path is measured against."""
    deltas = [messages.decode_payload(m, p) for m, p in contribs]
    if any(not np.isfinite(d[n]).all() for d in deltas for n in params):
        raise ValueError("benchmark contribution failed validation")
    weights = merge_math.token_weights([m.tokens for m, _ in contribs], [m.steps for m, _ in contribs])
    delta = merge_math.merge_deltas(deltas, weights, ("tok_embed", "pos_embed"))
    new, _ = merge_math.outer_step(opt, params, opt_state, delta)
    quantize.encode_update(params, new, {}, broadcast)


def copy_mb_per_s(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        np.copyto(dst, src)
    return nbytes * repeats / 1e6 / (time.perf_counter() - t0)


def run(model: TransformerOptions, k: int = 4, scheme: str = "int8", repeats: int = 5, store_url: str | None = None,
        threads: int = 1, reference: bool = True, snapshot_every: int = 8) -> dict:
    params = init_params(model)
    contribs = contributions(params, k, scheme)
    opt = merge_math.outer_optimizer(0.7, 0.9, True)
    opt_state = opt.init(params)
    nbytes = sum(len(p) for _, p in contribs)
    times: dict[str, float] = {}
    repeats = min(repeats, snapshot_every - 1)  # timed versions fall between two snapshots
    with tempfile.TemporaryDirectory() as tmp:
        store = FragmentStore(store_url or f"file://{tmp}/store", "merge-bench")
        merge_once(contribs, params, opt, opt_state, store, 0, threads=threads)  # warm-up: compile, store open
        t0 = time.perf_counter()
        for v in range(1, repeats + 1):
            update_bytes = merge_once(contribs, params, opt, opt_state, store, v, threads=threads, times=times,
                                      snapshot_every=snapshot_every)
        seconds = (time.perf_counter() - t0) / repeats
        snap: dict[str, float] = {}
        merge_once(contribs, params, opt, opt_state, store, snapshot_every, threads=threads, times=snap,
                   snapshot_every=snapshot_every)
        stored = {"between_snapshots": store.stored_nbytes(0, 1), "snapshot": store.stored_nbytes(0, snapshot_every),
                  "update": update_bytes}
    out = {"params": sum(a.size for a in params.values()), "contributions": k, "scheme": scheme, "threads": threads,
           "payload_mb": nbytes / 1e6, "merge_s": seconds, "merge_mb_per_s": nbytes / 1e6 / seconds,
           "phases_s": {p: times.get(p, 0.0) / repeats for p in PHASES}}
    without_store = seconds - out["phases_s"]["store_write"]
    out["merge_mb_per_s_without_store"] = nbytes / 1e6 / without_store
    # every snapshot_every-th version also writes the whole state: its extra write time, amortized
    extra = max(snap["store_write"] - out["phases_s"]["store_write"], 0.0) / snapshot_every
    out["merge_mb_per_s_amortized"] = nbytes / 1e6 / (seconds + extra)
    out["snapshot_every"] = snapshot_every
    out["store_bytes"] = stored | {"between_over_update": stored["between_snapshots"] / stored["update"],
                                   "amortized_over_update": (stored["between_snapshots"] * (snapshot_every - 1)
                                                             + stored["snapshot"]) / snapshot_every / stored["update"]}
    copy = copy_mb_per_s(nbytes, max(repeats, 20))
    out |= {"copy_mb_per_s": copy, "copy_over_merge": copy / out["merge_mb_per_s"]}
    if reference:
        reference_once(contribs, params, opt, opt_state)  # warm-up
        t0 = time.perf_counter()
        for _ in range(max(1, repeats // 2)):
            reference_once(contribs, params, opt, opt_state)
        ref_s = (time.perf_counter() - t0) / max(1, repeats // 2)
        out |= {"reference_s": ref_s, "reference_mb_per_s": nbytes / 1e6 / ref_s,
                "fused_over_reference": ref_s / without_store}
    return out
