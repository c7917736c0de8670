"""Batches drawn from a learner's token shard (the format: diloco/shard_format.py; preparing a
corpus: pipelines/prepared.py)."""

from __future__ import annotations

import itertools

import numpy as np

from diloco.shard_format import DataError


def epoch_windows(n_tokens: int, seed: int, index: int, epoch: int, span: int) -> np.ndarray:
    """The window starts shard `index` reads in `epoch`, in reading order: the shard cut into windows of
    `span` tokens at a seeded phase, in a seeded order."""
    rng = np.random.default_rng([seed, index, epoch])
    phase = int(rng.integers(0, span))
    return phase + span * rng.permutation((n_tokens - phase) // span).astype(np.int64)


def _epoch_length(n_tokens: int, seed: int, index: int, epoch: int, span: int) -> int:
    """len(epoch_windows(...)) without drawing the order."""
    phase = int(np.random.default_rng([seed, index, epoch]).integers(0, span))
    return max(n_tokens - phase, 0) // span


def epochs_read(n_tokens: int, seed: int, index: int, windows: int, span: int) -> float:
    """How many epochs of its shard a reader of `windows` windows got through (1.5: all of the first
    and half of the second), by the epoch lengths shard_batches reads."""
    e, left = 0, windows
    while True:
        n = _epoch_length(n_tokens, seed, index, e, span)
        if n == 0:
            return float(e)
        if left < n:
            return e + left / n
        e, left = e + 1, left - n


def shard_batches(tokens: np.ndarray, shard, *, batch_size: int, seq_len: int):
    """Endless (B, T + 1) int32 batches of this host's share of one learner's shard, read without
    replacement: each epoch cuts the shard into windows of T + 1 tokens at a seeded phase and reads
    them in a seeded order, so every window is trained once before any is trained again. `shard` (a
    diloco.DataShard) says which: its seed and index fix every epoch's order, and a learner that
    resumes at `start_step` (a restart, a spare, a joiner) reads on from the window that step
    reached instead of a new random stream. Each step reads B x `processes` windows, this host
    (`process`) the B-th slice of them."""
    span = seq_len + 1
    if len(tokens) < 2 * span:
        raise DataError(f"shard has {len(tokens)} tokens, fewer than two sequences of {span}")
    per_step = batch_size * shard.processes

    def windows():  # every window start in reading order, from the one start_step reached
        e, skip = 0, shard.start_step * per_step  # windows the steps before start_step read
        while True:
            order = epoch_windows(len(tokens), shard.seed, shard.index, e, span)
            yield from order[skip:]
            skip = max(skip - len(order), 0)
            e += 1

    stream = windows()
    lo, hi = shard.process * batch_size, (shard.process + 1) * batch_size
    while True:
        starts = np.fromiter(itertools.islice(stream, per_step), np.int64, per_step)
        yield np.stack([tokens[s:s + span] for s in starts[lo:hi]]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, n_batches: int, batch_size: int, seq_len: int) -> np.ndarray:
    """A fixed (N, B, T + 1) stack of evenly spaced held-out windows: the same for every eval."""
    n = n_batches * batch_size
    span = seq_len + 1
    if len(tokens) < span:
        raise DataError(f"held-out set has {len(tokens)} tokens, fewer than one sequence of {span}")
    starts = np.linspace(0, len(tokens) - span, n).astype(np.int64)
    return np.stack([tokens[s:s + span] for s in starts]).astype(np.int32).reshape(n_batches, batch_size, span)
