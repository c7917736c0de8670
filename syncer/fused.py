"""The syncer's merge path at production sizes: the math of `syncer/merge.py` and the broadcast
encoding of `diloco.quantize`, computed on the encoded contributions where they lie.

A contribution is kept as it arrived (`Encoded` views into its payload: int8 is a quarter of the
float32 it stands for), with each tensor's norm computed once from its codes at validation. A merge
then makes one pass per contribution per tensor into one float32 accumulator (`kernels.axpy_*`),
instead of decoding K float32 copies, stacking them and converting to float64; tensors run in
parallel threads (the kernels release the GIL). The results equal the NumPy reference within float
rounding (tests/test_fused.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from diloco import messages, quantize
from diloco.messages import Manifest, WireError
from diloco.syncer import kernels
from diloco.syncer.merge import _CANCELLED, _NO_DIRECTION, learner_share


@dataclass(frozen=True)
class Encoded:
    """One tensor of one contribution as it arrived: its wire scheme, shape and bytes."""
    scheme: str
    shape: tuple[int, ...]
    buf: memoryview

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(row scales, codes) of an int8 / int4 encoding, as views."""
        rows, cols = quantize._rows(self.shape)
        scale = np.frombuffer(self.buf, dtype="<f4", count=rows)
        width = cols if self.scheme == "int8" else (cols + 1) // 2
        codes = np.frombuffer(self.buf, dtype=np.int8 if self.scheme == "int8" else np.uint8,
                              offset=4 * rows).reshape(rows, width)
        return scale, codes

    def flat(self) -> np.ndarray:
        """The values of an fp32 encoding, or the uint16 bits of a bf16 one, as a flat view."""
        return np.frombuffer(self.buf, dtype="<f4" if self.scheme == "fp32" else "<u2")

    def decode(self) -> np.ndarray:
        return quantize.decode(self.buf, self.shape, self.scheme)


@dataclass(frozen=True)
class Blocks:
    """One tensor of one contribution that arrived in blocks (a learner over several hosts): each
    block's `Encoded` (of the block's own shape) with where it lies in the tensor."""
    scheme: str
    shape: tuple[int, ...]
    parts: tuple[tuple[messages.Region, Encoded], ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def decode(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        for block, e in self.parts:
            out[messages.slices(block)] = e.decode()
        return out

    def in_order(self) -> list[tuple[int | None, messages.Region, Encoded]]:
        """(where the block starts in the flat tensor, or None where it is no contiguous run of it;
        block; codes), the contiguous runs first, in the tensor's order."""
        runs = [(flat_start(self.shape, block), block, e) for block, e in self.parts]
        return sorted(runs, key=lambda r: (r[0] is None, r[0] or 0))


def flat_start(shape: tuple[int, ...], block: messages.Region) -> int | None:
    """Where a block starts in the C-order flattening of `shape`, if its values are one contiguous
    run there (the axes after its last partial one are whole, those before it one index wide)."""
    partial = [i for i, ((a, b), n) in enumerate(zip(block, shape)) if (a, b) != (0, n)]
    if partial and any(b - a != 1 for a, b in block[:partial[-1]]):
        return None
    start = 0
    for (a, _), n in zip(block, shape):
        start = start * n + a
    return start


@dataclass(frozen=True)
class EncodedDelta:
    """A validated contribution's tensors as they arrived, with each one's norm."""
    tensors: dict[str, Encoded | Blocks]
    norms: dict[str, float]

    @property
    def norm(self) -> float:
        return math.sqrt(sum(n * n for n in self.norms.values()))

    def decode(self) -> dict[str, np.ndarray]:
        return {n: e.decode() for n, e in self.tensors.items()}


def views(manifest: Manifest, payload: bytes) -> dict[str, Encoded | Blocks]:
    """The payload's tensors as `Encoded` views (no copy), a tensor sent in blocks as `Blocks`;
    raises WireError if a size does not fit."""
    out: dict[str, Encoded | Blocks] = {}
    for t, view in messages.tensor_codes(manifest, messages.codes_of(manifest, payload)):
        e = Encoded(t.scheme, t.coded_shape, view)
        if t.block is None:
            out[t.name] = e
        else:
            had = out.get(t.name)
            out[t.name] = Blocks(t.scheme, t.shape, (had.parts if had else ()) + ((t.block, e),))
    return out


def encoded_delta(manifest: Manifest, payload: bytes) -> EncodedDelta:
    """The payload's tensors and their norms; a norm is nan where a value is not finite. Raises
    WireError for codes no encoder writes (a topk block's indices out of order or range)."""
    tensors = views(manifest, payload)
    try:
        squares = {n: sumsq(e) for n, e in tensors.items()}
    except quantize.CodecError as err:
        raise WireError(str(err)) from None
    return EncodedDelta(tensors, {n: math.sqrt(s) if s == s else math.nan for n, s in squares.items()})


BY_ROWS = ("int8", "int4", "fp32", "bf16")  # the schemes whose norm is a running sum over rows (or values)


def sumsq(e: Encoded | Blocks, total: float = 0.0) -> float:
    """`total` plus the squared norm of the decoded tensor (float64), from its codes; nan if any
    value is not finite. A tensor in blocks adds them up in the tensor's order, one running sum,
    so a tensor in blocks of whole rows has the norm of the same tensor sent whole, bit for bit."""
    if isinstance(e, Blocks) and e.scheme in BY_ROWS:
        for _, _, part in e.in_order():
            total = sumsq(part, total)
        return total
    if e.scheme in ("int8", "int4"):
        scale, codes = e.rows()
        if e.scheme == "int8":
            return float(kernels.sumsq_q8(codes, scale, total))
        return float(kernels.sumsq_q4(codes, scale, quantize._rows(e.shape)[1], total))
    if e.scheme in ("fp32", "bf16"):
        return float(kernels.sumsq_f32(e.flat(), total) if e.scheme == "fp32" else kernels.sumsq_bf16(e.flat(), total))
    # int2, ternary, topk (in blocks: put together first): a quarter, a fifth, a thirteenth of int8's bytes, decoded once
    s = total + squared_norm(e.decode())
    return s if math.isfinite(s) else math.nan


def squared_norm(a: np.ndarray) -> float:
    """sum(a^2) in float64 of any array: one pass with no temporaries for float32 (`kernels.sumsq`)."""
    a = np.asarray(a)
    if a.dtype == np.float32:
        return float(kernels.sumsq(np.ascontiguousarray(a).reshape(-1)))
    return float(np.sum(np.square(a, dtype=np.float64)))


def axpy(acc: np.ndarray, e: Encoded | Blocks, coef: float) -> None:
    """acc (float32, the tensor's shape) += coef * decode(e)."""
    if isinstance(e, Blocks):  # each block where it lies: in place where it is a contiguous run
        flat = acc.reshape(-1)
        for start, block, part in e.in_order():
            if start is not None:
                axpy(flat[start:start + part.size].reshape(part.shape), part, coef)
            else:
                tmp = np.zeros(part.shape, np.float32)
                axpy(tmp, part, coef)
                acc[messages.slices(block)] += tmp
    elif e.scheme in ("int8", "int4"):
        scale, codes = e.rows()
        target = acc.reshape(quantize._rows(e.shape))
        (kernels.axpy_q8 if e.scheme == "int8" else kernels.axpy_q4)(target, codes, scale, coef)
    elif e.scheme == "fp32":
        kernels.axpy_f32(acc.reshape(-1), e.flat(), coef)
    elif e.scheme == "bf16":
        kernels.axpy_bf16(acc.reshape(-1), e.flat(), coef)
    else:  # int2, ternary, topk: decoded to float32 first, then the fp32 kernel
        kernels.axpy_f32(acc.reshape(-1), e.decode().reshape(-1), coef)


def merge_tensor(parts: Sequence[Encoded | Blocks], norms: Sequence[float], weights: np.ndarray, *, plain: bool,
                 share: float = 1.0, learners: Sequence[str] | None = None) -> np.ndarray:
    """One tensor's merged delta: RDA over `learners` (merge.rda) times learner_share, or, if `plain`,
    the weighted mean (merge.weighted_mean) times `share`. `norms` are the parts' norms, `weights`
    sum to 1."""
    acc = np.zeros(parts[0].shape, np.float32)
    w = np.asarray(weights, np.float64)
    if plain:
        for e, wm in zip(parts, w):
            axpy(acc, e, float(wm))
        if share != 1.0:
            kernels.scale_into(acc.reshape(-1), acc.reshape(-1), share)
        return acc
    groups, gw, gnorms = _by_learner(parts, norms, w, learners)
    radius = float(np.sum(gw * np.asarray(gnorms)) / np.sum(gw))
    for group, wm, nm in zip(groups, gw / np.sum(gw), gnorms):
        if nm > _NO_DIRECTION:  # an all-zero (or vanishing) delta has no direction and adds none
            if not isinstance(group, np.ndarray):  # one learner's part as it arrived
                axpy(acc, group, float(wm / nm))
            else:
                kernels.axpy_f32(acc.reshape(-1), group.reshape(-1), float(wm / nm))
    dnorm = math.sqrt(kernels.sumsq(acc.reshape(-1)))
    if dnorm < _CANCELLED:  # the deltas cancel: no direction to move in
        return np.zeros_like(acc)
    kernels.scale_into(acc.reshape(-1), acc.reshape(-1), radius / dnorm * learner_share(share, learners))
    return acc


def _by_learner(parts: Sequence[Encoded | Blocks], norms: Sequence[float], w: np.ndarray, learners: Sequence[str] | None):
    """merge.by_learner on encoded parts: ([a learner's one Encoded part, or its parts summed in
    float32], weights, norms), learners in order of first appearance."""
    if learners is None or len(set(learners)) == len(learners):
        return list(parts), w, list(norms)
    if len(learners) != len(parts):
        raise ValueError(f"{len(learners)} learner names for {len(parts)} deltas")
    index: dict[str, list[int]] = {}
    for i, lid in enumerate(learners):
        index.setdefault(lid, []).append(i)
    groups, gw, gnorms = [], [], []
    for members in index.values():
        if len(members) == 1:
            groups.append(parts[members[0]])
            gnorms.append(norms[members[0]])
        else:
            total = np.zeros(parts[0].shape, np.float32)
            for i in members:
                axpy(total, parts[i], 1.0)
            groups.append(total)
            gnorms.append(math.sqrt(kernels.sumsq(total.reshape(-1))))
        gw.append(float(sum(w[i] for i in members)))
    return groups, np.array(gw), gnorms


def _threaded(one, names: list[str], threads: int) -> list:
    """[one(n) for n in names], in `threads` threads (the kernels release the GIL)."""
    if threads <= 1:
        return [one(n) for n in names]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, names))


def _pack_int4(q: np.ndarray, cols: int) -> np.ndarray:
    """int4 codes (rows, cols) in -7..7 as the wire's bytes: code + 8 per nibble, low nibble first."""
    q = np.pad(q, ((0, 0), (0, cols % 2))) + 8
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def merge(contributions: Sequence[EncodedDelta], weights: np.ndarray, mean_names: Sequence[str] = (),
          rule: str = "rda", share: float = 1.0, threads: int = 1,
          learners: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """`merge.merge_deltas` on encoded contributions, tensors in `threads` threads."""
    if rule not in ("rda", "mean"):
        raise ValueError(f"unknown merge rule {rule!r}")
    names = list(contributions[0].tensors)

    def one(name: str) -> np.ndarray:
        return merge_tensor([c.tensors[name] for c in contributions], [c.norms[name] for c in contributions],
                            weights, plain=rule == "mean" or name in mean_names, share=share, learners=learners)

    return dict(zip(names, _threaded(one, names, threads)))


def outer_sgd(params: Mapping[str, np.ndarray], state, delta: Mapping[str, np.ndarray], *, lr: float,
              momentum: float, nesterov: bool, threads: int = 1):
    """`merge.outer_step` for the outer optimizer `merge.outer_optimizer(lr, momentum, nesterov)`
    (optax.sgd), one fused pass per tensor: (new params in their dtypes, the optax state)."""
    trace_state = state[0] if momentum > 0 else None
    new_trace = {n: np.array(trace_state.trace[n], np.float32) for n in delta} if trace_state is not None else {}

    def one(n: str) -> np.ndarray:
        p = np.asarray(params[n])
        p32 = np.ascontiguousarray(p, np.float32).reshape(-1)
        out = np.empty_like(p32)
        trace = new_trace[n].reshape(-1) if n in new_trace else out
        kernels.sgd_step(p32, np.ascontiguousarray(delta[n], np.float32).reshape(-1), trace, lr, momentum,
                         nesterov and momentum > 0, out)
        return out.reshape(p.shape).astype(p.dtype, copy=False)

    names = list(delta)
    new = dict(zip(names, _threaded(one, names, threads)))
    if trace_state is not None:
        state = (trace_state._replace(trace=new_trace), *state[1:])
    return new, state


def encode_update(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], residual: Mapping[str, np.ndarray],
                  scheme: str, threads: int = 1, base: Mapping[str, np.ndarray] | None = None
                  ) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`quantize.encode_update`, bit for bit, one fused pass per row for int8 / int4 float32 tensors
    (other schemes and dtypes take the NumPy path)."""
    def one(n: str):
        o, x = np.asarray(old[n]), np.asarray(new[n])
        b = o if base is None else np.asarray(base[n])
        if scheme not in quantize.LEVELS or o.dtype != np.float32 or x.dtype != np.float32:
            wire, pub, car = quantize.encode_update({n: o}, {n: x}, {n: residual[n]} if n in residual else {}, scheme,
                                                    base=None if base is None else {n: b})
            return wire[n], pub[n], car[n]
        rows, cols = quantize._rows(x.shape)
        res = residual.get(n)
        res = np.zeros((rows, cols), np.float32) if res is None else np.asarray(res, np.float32).reshape(rows, cols)
        q = np.empty((rows, cols), np.int8)
        scale = np.empty(rows, "<f4")
        published = np.empty((rows, cols), np.float32)
        carried = np.empty((rows, cols), np.float32)
        kernels.update_q(x.reshape(rows, cols), o.reshape(rows, cols), res, b.reshape(rows, cols), base is not None,
                         quantize.LEVELS[scheme], q, scale, published, carried)
        if scheme == "int4":
            q = _pack_int4(q, cols)
        return scale.tobytes() + q.tobytes(), published.reshape(x.shape), carried.reshape(x.shape)

    names = list(new)
    results = _threaded(one, names, threads)
    return ({n: r[0] for n, r in zip(names, results)}, {n: r[1] for n, r in zip(names, results)},
            {n: r[2] for n, r in zip(names, results)})


def _finite(a: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(np.asarray(a, np.float32))))


NOT_FINITE = ((1, "merged values"), (2, "published values or broadcast residual"))


def outer_update(old: Mapping[str, np.ndarray], state, delta: Mapping[str, np.ndarray],
                 residual: Mapping[str, np.ndarray], *, lr: float, momentum: float, nesterov: bool, scheme: str,
                 scales: Mapping[str, float] | None = None, threads: int = 1,
                 base: Mapping[str, np.ndarray] | None = None):
    """`outer_sgd` then `encode_update` relative to `base` (default `old`; the delta of tensor n
    times `scales[n]`, default 1): (encoded update, published values, residual, outer state), bit
    for bit as those two would give. For int8
    / int4 float32 tensors both are one pass per row (`kernels.step_update_q`): the stepped values are
    never stored. Raises FloatingPointError naming the tensors whose stepped values, published
    values or residual are not finite (int8 codes would launder a NaN), so none is ever written."""
    trace_state = state[0] if momentum > 0 else None
    scales = scales or {}

    def one(n: str):
        o, d = np.asarray(old[n]), np.ascontiguousarray(delta[n], np.float32)
        b = o if base is None else np.asarray(base[n])
        k = float(scales.get(n, 1.0))
        if scheme not in quantize.LEVELS or o.dtype != np.float32:  # bf16 parameters, fp32 / bf16 updates
            if k != 1.0:
                d = np.float32(k) * d
            sub = (trace_state._replace(trace={n: trace_state.trace[n]}), *state[1:]) if trace_state else state
            new, sub = outer_sgd({n: o}, sub, {n: d}, lr=lr, momentum=momentum, nesterov=nesterov)
            wire, pub, car = encode_update({n: o}, new, {n: residual[n]} if n in residual else {}, scheme,
                                           base=None if base is None else {n: b})
            flags = (0 if _finite(new[n]) else 1) | (0 if _finite(pub[n]) and _finite(car[n]) else 2)
            return wire[n], pub[n], car[n], sub[0].trace[n] if trace_state else None, flags
        rows, cols = quantize._rows(o.shape)
        res = residual.get(n)
        res = np.zeros((rows, cols), np.float32) if res is None else np.asarray(res, np.float32).reshape(rows, cols)
        trace_in = np.asarray(trace_state.trace[n], np.float32).reshape(rows, cols) if trace_state else res
        trace_out = np.empty((rows, cols), np.float32) if trace_state else res  # not written without momentum
        q, scale = np.empty((rows, cols), np.int8), np.empty(rows, "<f4")
        published, carried = np.empty((rows, cols), np.float32), np.empty((rows, cols), np.float32)
        flags = kernels.step_update_q(o.reshape(rows, cols), d.reshape(rows, cols), k, trace_in, trace_out, lr,
                                      momentum, nesterov and momentum > 0, res, b.reshape(rows, cols), base is not None,
                                      quantize.LEVELS[scheme], q, scale, published, carried)
        if scheme == "int4":
            q = _pack_int4(q, cols)
        return (scale.tobytes() + q.tobytes(), published.reshape(o.shape), carried.reshape(o.shape),
                trace_out.reshape(o.shape) if trace_state else None, flags)

    names = list(delta)
    results = dict(zip(names, _threaded(one, names, threads)))
    for bit, what in NOT_FINITE:
        bad = [n for n in names if results[n][4] & bit]
        if bad:
            raise FloatingPointError(f"{what} of {bad[:8]} are not finite")
    if trace_state is not None:
        state = (trace_state._replace(trace={**trace_state.trace, **{n: r[3] for n, r in results.items()}}), *state[1:])
    return ({n: r[0] for n, r in results.items()}, {n: r[1] for n, r in results.items()},
            {n: r[2] for n, r in results.items()}, state)


def warm_up() -> None:
    """Run every kernel once on tiny inputs of each wire scheme, so that compiling (or loading them
    from numba's cache) happens when the syncer starts, not during its first merges."""
    from diloco import messages
    from diloco.syncer import merge as merge_math

    rng = np.random.default_rng(0)
    params = {"m": rng.normal(size=(4, 8)).astype(np.float32), "v": rng.normal(size=8).astype(np.float32)}
    frozen = {n: np.frombuffer(a.tobytes(), np.float32).reshape(a.shape) for n, a in params.items()}  # read-only
    for scheme in quantize.SCHEMES:
        manifest, frames = messages.encode_contribution(
            run="warm-up", learner="l", region="r", fragment=0, base_version=0, tokens=1, steps=1, step_time=0.1,
            deltas=params, scheme=scheme, chunk_bytes=1 << 20)
        delta = encoded_delta(manifest, b"".join(bytes(messages.parse_frame(f)[1]) for f in frames[1:]))
        for rule in ("rda", "mean"):
            merged = merge([delta, delta], np.array([0.5, 0.5]), ("v",), rule=rule, share=0.5)
    for momentum in (0.0, 0.9):
        opt = merge_math.outer_optimizer(0.5, momentum, True)
        new, _ = outer_sgd(frozen, opt.init(params), merged, lr=0.5, momentum=momentum, nesterov=True)
    for scheme in quantize.LEVELS:
        for old in (params, frozen):
            encode_update(old, new, {}, scheme)
            encode_update(old, new, {n: np.zeros_like(a) for n, a in params.items()}, scheme)
            encode_update(old, new, {n: np.zeros_like(a) for n, a in params.items()}, scheme, base=frozen)
        for momentum in (0.0, 0.9):  # twice: the state of a later merge (its own trace, residual) types anew
            opt = merge_math.outer_optimizer(0.5, momentum, True)
            _, pub, res, state = outer_update(frozen, opt.init(params), merged, {}, lr=0.5, momentum=momentum,
                                              nesterov=True, scheme=scheme, scales={"m": 0.5})
            outer_update(pub, state, merged, res, lr=0.5, momentum=momentum, nesterov=True, scheme=scheme)
            for base in (frozen, pub):  # updates relative to a snapshot held read-only (rebuilt) or not
                outer_update(pub, state, merged, res, lr=0.5, momentum=momentum, nesterov=True, scheme=scheme,
                             base=base)
