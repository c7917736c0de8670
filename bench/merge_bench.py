"""Micro-benchmark of the syncer's merge path: decode (checksum + dequantize) + validate (shapes,
finite) + token weights + RDA + outer step + TensorStore write, against a plain NumPy copy of the
same bytes measured in the same process. The write includes the encoded update learners fetch
(`broadcast` scheme) and the residual it leaves."""

from __future__ import annotations

import tempfile
import time

import numpy as np

from diloco import messages, quantize
from diloco.config import TransformerOptions
from diloco.infra.store import FragmentStore
from diloco.models.transformer import init_params
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


def merge_once(contribs: list[tuple], params: dict[str, np.ndarray], opt, opt_state, store: FragmentStore,
               version: int, broadcast: str = "int8") -> None:
    deltas = []
    for manifest, payload in contribs:
        d = messages.decode_payload(manifest, payload)
        if any(d[n].shape != params[n].shape or not np.isfinite(d[n]).all() for n in params):
            raise ValueError("benchmark contribution failed validation")
        deltas.append(d)
    weights = merge_math.token_weights([m.tokens for m, _ in contribs], [m.steps for m, _ in contribs])
    delta = merge_math.merge_deltas(deltas, weights, ("tok_embed", "pos_embed"))
    new, state = merge_math.outer_step(opt, params, opt_state, delta)
    update, new, residual = quantize.encode_update(params, new, {}, broadcast)
    store.write(0, version, new, merge_math.flatten_state(state), {"time": time.time()}, residual=residual,
                update=update, update_scheme=broadcast)


def copy_mb_per_s(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        np.copyto(dst, src)
    return nbytes * repeats / 1e6 / (time.perf_counter() - t0)


def run(model: TransformerOptions, k: int = 4, scheme: str = "int8", repeats: int = 5, store_url: str | None = None) -> dict:
    params = init_params(model)
    contribs = contributions(params, k, scheme)
    opt = merge_math.outer_optimizer(0.7, 0.9, True)
    opt_state = opt.init(params)
    nbytes = sum(len(p) for _, p in contribs)
    with tempfile.TemporaryDirectory() as tmp:
        store = FragmentStore(store_url or f"file://{tmp}/store", "merge-bench")
        merge_once(contribs, params, opt, opt_state, store, 0)  # warm-up: jit of the outer step, store open
        t0 = time.perf_counter()
        for v in range(1, repeats + 1):
            merge_once(contribs, params, opt, opt_state, store, v)
        seconds = (time.perf_counter() - t0) / repeats
    merge = nbytes / 1e6 / seconds
    copy = copy_mb_per_s(nbytes, max(repeats, 20))
    return {"params": sum(a.size for a in params.values()), "contributions": k, "scheme": scheme,
            "payload_mb": nbytes / 1e6, "merge_s": seconds, "merge_mb_per_s": merge, "copy_mb_per_s": copy,
            "copy_over_merge": copy / merge}
