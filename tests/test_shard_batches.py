"""shard_batches: a learner's shard read without replacement, resumable at any step, split across hosts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from diloco.learners.data import shard_batches
from diloco.shard_format import DataError
from diloco.spec import DataShard

SEQ = 7           # windows of 8 tokens
TOKENS = np.arange(1003, dtype=np.uint32)   # each token its own position: a window says where it came from


def take(shard: DataShard, steps: int, batch_size: int = 4, tokens: np.ndarray = TOKENS) -> list[np.ndarray]:
    return list(itertools.islice(shard_batches(tokens, shard, batch_size=batch_size, seq_len=SEQ), steps))


def test_an_epoch_reads_every_window_once_at_one_phase():
    span = SEQ + 1
    batches = take(DataShard(index=0, count=1, seed=3), 31)   # 124 windows: one epoch has 124 or 125
    starts = [int(w[0]) for b in batches for w in b]
    assert all(b.dtype == np.int32 and b.shape == (4, span) for b in batches)
    assert all(np.array_equal(w, np.arange(w[0], w[0] + span)) for b in batches for w in b)  # whole, in order
    phase = starts[0] % span
    assert len(set(starts)) == len(starts) and {s % span for s in starts} == {phase}  # none twice, one phase
    assert len(starts) == (len(TOKENS) - phase) // span or len(starts) == (len(TOKENS) - phase) // span - 1
    assert starts != sorted(starts)                             # shuffled, not read front to back


def test_the_next_epoch_reads_everything_again_in_another_order():
    shard = DataShard(index=1, count=2, seed=0)
    starts = [int(w[0]) for b in take(shard, 200) for w in b]   # 800 windows: six epochs and more
    span = SEQ + 1
    epochs, current = [], []
    for s in starts:
        if current and s % span != current[0] % span or s in current:
            epochs.append(current)
            current = []
        current.append(s)
    full = epochs[:5]
    assert all(len(set(e)) == len(e) == (len(TOKENS) - e[0] % span) // span for e in full)
    assert len({tuple(e) for e in full}) == 5                    # each epoch its own order (or phase)


@pytest.mark.parametrize("start_step", [1, 17, 31, 32, 95])
def test_a_learner_resuming_at_a_step_reads_on_where_that_step_left_off(start_step):
    """A restarted learner, a spare taking over or a joiner starts at start_step: the batches it reads
    are the ones the learner's stream from step 0 reads next, across epoch ends too."""
    whole = take(DataShard(index=2, count=4, seed=5), start_step + 20)
    resumed = take(DataShard(index=2, count=4, seed=5, start_step=start_step), 20)
    for a, b in zip(whole[start_step:], resumed):
        np.testing.assert_array_equal(a, b)


def test_hosts_of_one_learner_read_disjoint_slices_of_the_same_step():
    one = take(DataShard(index=0, count=1, seed=9), 40, batch_size=6)
    hosts = [take(DataShard(index=0, count=1, seed=9, process=p, processes=3), 40, batch_size=2) for p in range(3)]
    for step, batch in enumerate(one):
        np.testing.assert_array_equal(np.concatenate([h[step] for h in hosts]), batch)


def test_learners_read_different_orders_and_a_short_shard_is_refused():
    a = take(DataShard(index=0, count=2, seed=0), 5)
    b = take(DataShard(index=1, count=2, seed=0), 5)
    assert not all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(DataError, match="fewer than two sequences"):
        take(DataShard(index=0, count=1), 1, tokens=np.arange(15, dtype=np.uint16))
