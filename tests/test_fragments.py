import math

import pytest

from diloco.config import TransformerOptions
from diloco.fragments import fragments_due, plan_fragments, sync_offset, syncs_through
from diloco.models.transformer import init_params


def test_plan_covers_every_tensor_once_and_is_balanced():
    shapes = {k: v.shape for k, v in init_params(TransformerOptions(n_layers=4)).items()}
    plan = plan_fragments(shapes, 4)
    names = [n for frag in plan for n in frag]
    assert sorted(names) == sorted(shapes) and len(names) == len(set(names))
    sizes = [sum(math.prod(shapes[n]) for n in frag) for frag in plan]
    assert max(sizes) / min(sizes) < 1.25
    assert plan == plan_fragments(dict(reversed(list(shapes.items()))), 4)  # order-independent


def test_too_many_fragments_is_an_error():
    with pytest.raises(ValueError, match="only 2 tensors"):
        plan_fragments({"a": (2,), "b": (3,)}, 3)


def test_each_fragment_syncs_every_h_steps_staggered():
    P, H = 4, 40
    due = {p: [s for s in range(1, 201) if p in fragments_due(s, P, H)] for p in range(P)}
    for p, steps in due.items():
        assert len(steps) == 5 and all(b - a == H for a, b in zip(steps, steps[1:]))
    firsts = sorted(steps[0] for steps in due.values())
    assert firsts == [10, 20, 30, 40]                     # spread over the period
    assert all(len(fragments_due(s, P, H)) <= 1 for s in range(1, 201))  # about one in flight at a time
    assert sync_offset(0, 1, 5) == 5 % 5 or sync_offset(0, 1, 5) == 5


@pytest.mark.parametrize("count,every", [(1, 1), (1, 10), (4, 20), (4, 10), (3, 7), (8, 4)])
def test_syncs_through_counts_the_due_steps(count, every):
    for p in range(count):
        due = 0
        for step in range(0, 5 * every + 3):
            if step >= 1 and p in fragments_due(step, count, every):
                due += 1
            assert syncs_through(step, p, count, every) == due, (p, step)


def test_the_hold_rule_the_learner_and_the_simulator_share():
    """fragments.must_hold: a due fragment waits for a new version only while the learner already
    sent from the version it is on, for at most HOLD_PERIODS periods of steps."""
    from diloco.fragments import HOLD_PERIODS, must_hold

    H = 10
    assert must_hold(sent_from=3, version=3, steps_since_send=H, every=H)
    assert must_hold(sent_from=3, version=3, steps_since_send=HOLD_PERIODS * H - 1, every=H)
    assert not must_hold(sent_from=3, version=3, steps_since_send=HOLD_PERIODS * H, every=H)  # held too long
    assert not must_hold(sent_from=3, version=4, steps_since_send=H, every=H)                 # its version moved
    assert not must_hold(sent_from=None, version=0, steps_since_send=H, every=H)              # never sent


def test_a_fragment_is_fetched_the_prefetch_steps_before_its_sync_point():
    from diloco.fragments import fragments_due, fragments_to_fetch

    P, H = 4, 20
    for step in range(1, 3 * H):
        assert fragments_to_fetch(step, P, H, prefetch_steps=4) == fragments_due(step + 4, P, H)
        assert fragments_to_fetch(step, P, H, prefetch_steps=99) == fragments_due(step + H, P, H)  # a period at most
