import jax
import numpy as np
import optax
import pytest

from diloco.syncer import merge


def test_rda_keeps_norm_of_near_orthogonal_deltas_where_mean_shrinks():
    rng = np.random.default_rng(0)
    m, dim = 8, 20_000
    deltas = [rng.normal(size=dim).astype(np.float32) for _ in range(m)]  # near-orthogonal in high dim
    w = np.full(m, 1 / m)
    mean_norm = np.mean([np.linalg.norm(d) for d in deltas])
    assert np.linalg.norm(merge.rda(deltas, w)) == pytest.approx(mean_norm, rel=1e-4)
    assert np.linalg.norm(merge.weighted_mean(deltas, w)) == pytest.approx(mean_norm / np.sqrt(m), rel=0.05)


def test_rda_of_identical_deltas_is_that_delta_and_points_along_the_mean():
    d = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(merge.rda([d, d, d], np.array([0.2, 0.3, 0.5])), d, rtol=1e-5)
    a, b = np.array([3.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    out = merge.rda([a, b], np.array([0.5, 0.5]))
    assert np.linalg.norm(out) == pytest.approx(2.0)            # mean of norms 3 and 1
    np.testing.assert_allclose(out / np.linalg.norm(out), [np.sqrt(0.5)] * 2, rtol=1e-6)  # mean of unit vectors


def test_rda_of_cancelling_deltas_is_zero():
    a = np.ones(5, np.float32)
    assert np.all(merge.rda([a, -a], np.array([0.5, 0.5])) == 0)


def test_token_weights_favour_learners_with_more_tokens_per_step():
    w = merge.token_weights([1000, 1000, 500], [10, 20, 10])
    raw = np.array([1000 * 100, 1000 * 50, 500 * 50], float)
    np.testing.assert_allclose(w, raw / raw.sum())
    assert w.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        merge.token_weights([10, 0], [1, 1])


def test_merge_deltas_uses_mean_for_named_tensors():
    rng = np.random.default_rng(1)
    cs = [{"emb": rng.normal(size=(4, 3)).astype(np.float32), "w": rng.normal(size=50).astype(np.float32)} for _ in range(3)]
    w = np.array([0.5, 0.25, 0.25])
    out = merge.merge_deltas(cs, w, mean_names=("emb",))
    np.testing.assert_allclose(out["emb"], sum(wi * c["emb"] for wi, c in zip(w, cs)), rtol=1e-5)
    np.testing.assert_allclose(out["w"], merge.rda([c["w"] for c in cs], w), rtol=1e-6)


def test_outer_step_is_nesterov_sgd_by_hand():
    lr, mu = 0.7, 0.9
    opt = merge.outer_optimizer(lr, mu, True)
    params = {"a": np.array([1.0, -2.0], np.float32)}
    state = opt.init(params)
    buf = np.zeros(2)
    p = params["a"].astype(np.float64)
    for g in ([0.1, 0.2], [0.3, -0.1], [-0.2, 0.05]):
        g = np.array(g, np.float32)
        params, state = merge.outer_step(opt, params, state, {"a": g})
        buf = mu * buf + g
        p = p - lr * (g + mu * buf)
        np.testing.assert_allclose(params["a"], p, rtol=1e-5)


def test_optimizer_state_round_trips_through_named_arrays():
    opt = merge.outer_optimizer(0.7, 0.9, True)
    params = {"layer0.w": np.ones((2, 3), np.float32), "ln": np.ones(3, np.float32)}
    _, state = merge.outer_step(opt, params, opt.init(params), {k: v * 0.5 for k, v in params.items()})
    named = merge.flatten_state(state)
    assert set(named) == {"0.trace.layer0.w", "0.trace.ln"}
    back = merge.unflatten_state(opt.init(params), named)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), back, state))
    with pytest.raises(KeyError):
        merge.unflatten_state(opt.init(params), {"0.trace.ln": named["0.trace.ln"]})


def test_outer_step_matches_optax_under_jit():
    opt = merge.outer_optimizer(0.5, 0.8, True)
    params = {"x": np.linspace(-1, 1, 7).astype(np.float32)}
    delta = {"x": np.full(7, 0.1, np.float32)}
    ours, _ = merge.outer_step(opt, params, opt.init(params), delta)

    @jax.jit
    def ref(p, d):
        u, _ = opt.update(d, opt.init(p), p)
        return optax.apply_updates(p, u)
    np.testing.assert_allclose(ours["x"], np.asarray(ref(params, delta)["x"]), rtol=1e-6)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402

# No values near float32's underflow: scaling them by k rounds to zero and turns their direction,
# which is float arithmetic, not a property of the merge.
_vec = arrays(np.float32, 16, elements=st.floats(-100, 100, allow_nan=False, width=32)
              .filter(lambda v: v == 0 or abs(v) > 1e-6))


@settings(max_examples=150, deadline=None)
@given(st.lists(_vec, min_size=1, max_size=6), st.data())
def test_rda_norm_is_the_weighted_mean_norm_and_order_does_not_matter(deltas, data):
    deltas = [d for d in deltas if np.linalg.norm(d) > 1e-3] or [np.ones(16, np.float32)]
    w = np.array(data.draw(st.lists(st.floats(0.1, 10), min_size=len(deltas), max_size=len(deltas))))
    out = merge.rda(deltas, w)
    norms = np.array([np.linalg.norm(d.astype(np.float64)) for d in deltas])
    direction = sum(wi * d / n for wi, d, n in zip(w, deltas, norms))
    if np.linalg.norm(direction) > 1e-3 * w.sum():       # not a near-cancellation
        assert np.linalg.norm(out) == pytest.approx(np.sum(w * norms) / np.sum(w), rel=1e-3)
    perm = data.draw(st.permutations(range(len(deltas))))
    np.testing.assert_allclose(merge.rda([deltas[i] for i in perm], w[list(perm)]), out, rtol=1e-4, atol=1e-4)
    assert np.all(np.isfinite(out))


@settings(max_examples=100, deadline=None)
@given(st.lists(_vec, min_size=1, max_size=5), st.floats(0.01, 100))
def test_rda_scales_with_its_inputs(deltas, k):
    w = np.ones(len(deltas))
    np.testing.assert_allclose(merge.rda([k * d for d in deltas], w), k * merge.rda(deltas, w), rtol=1e-3, atol=1e-3 * k)


def test_a_partial_round_carries_its_share_of_a_full_one():
    assert merge.round_share(2, 4) == 0.5 and merge.round_share(4, 4) == 1.0
    assert merge.round_share(6, 4) == 1.5   # a lagging syncer's round holds more than one delta per learner
    assert merge.round_share(1, 0) == 1.0
    assert merge.learner_share(1.5, ["a", "a", "b", "b", "c", "c"]) == 0.75  # RDA counts the 3 learners of 4


def test_rda_averages_learners_not_the_pieces_of_one_learners_progress():
    """A learner ahead of the merges sends several deltas before one round closes: each is a piece of
    its own progress since its last send. RDA must treat their sum as that learner's delta; over the
    pieces, a round of 3 learners x 4 near-orthogonal pieces with share 12/4 moved ~3.5x further
    than the same progress in one delta each (the flaky own-loop example's divergence)."""
    rng = np.random.default_rng(0)
    pieces = {lid: [rng.normal(size=4096).astype(np.float32) for _ in range(4)] for lid in "abc"}
    deltas = [d for lid in "abc" for d in pieces[lid]]
    learners = [lid for lid in "abc" for _ in range(4)]
    w = np.full(12, 1 / 12)
    whole = [np.sum(pieces[lid], axis=0) for lid in "abc"]
    want = merge.rda(whole, np.full(3, 1 / 3)) * 0.75                          # 3 learners of 4
    got = merge.merge_deltas([{"t": d} for d in deltas], w, learners=learners, share=merge.round_share(12, 4))["t"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    naive = merge.rda(deltas, w) * merge.round_share(12, 4)                   # over the pieces
    assert np.linalg.norm(naive) > 1.5 * np.linalg.norm(got)
    # the weighted mean already counts each piece 1/M: grouping leaves it as it was
    mean = merge.merge_deltas([{"t": d} for d in deltas], w, rule="mean", learners=learners, share=3.0)["t"]
    np.testing.assert_allclose(mean, np.sum(deltas, axis=0) / 4, rtol=1e-5, atol=1e-5)


def test_by_learner_sums_a_learners_pieces_and_their_weights():
    a1, a2, b = (np.full(3, x, np.float32) for x in (1.0, 2.0, 5.0))
    deltas, w = merge.by_learner([a1, b, a2], np.array([0.25, 0.5, 0.25]), ["a", "b", "a"])
    np.testing.assert_array_equal(deltas[0], a1 + a2)
    np.testing.assert_array_equal(deltas[1], b)
    np.testing.assert_allclose(w, [0.5, 0.5])
    # tokens^2/steps of the union equals the sum of the parts' at one step rate
    assert merge.token_weights([200, 100], [20, 10], weighted=True).tolist() == pytest.approx([2 / 3, 1 / 3])
    with pytest.raises(ValueError):
        merge.by_learner([a1, b], np.array([0.5, 0.5]), ["a", "a", "b"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 100), st.integers(0, 6)), min_size=1, max_size=8), st.floats(0, 3))
def test_staleness_weights_discount_late_contributions_by_their_age(pairs, discount):
    w, s = [p[0] for p in pairs], [p[1] for p in pairs]
    out = merge.staleness_weights(w, s, discount)
    assert np.isclose(out.sum(), 1.0) and np.all(out > 0)
    for i in range(len(w)):
        for j in range(len(w)):   # each pair keeps its weight ratio times the ratio of the age factors
            np.testing.assert_allclose(out[i] / out[j], w[i] / w[j] * ((1 + s[j]) / (1 + s[i])) ** discount, rtol=1e-9)
    np.testing.assert_allclose(merge.staleness_weights(w, s, 0.0), np.asarray(w) / sum(w))  # 0 = off
    np.testing.assert_allclose(merge.staleness_weights(w, [3] * len(w), discount), np.asarray(w) / sum(w))  # all as old


def test_staleness_weights_refuse_what_has_no_meaning():
    for w, s, d in (([1.0], [-1], 1.0), ([1.0, 1.0], [0], 1.0), ([1.0], [0], -0.5)):
        with pytest.raises(ValueError, match="staleness"):
            merge.staleness_weights(w, s, d)


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 0.99), st.integers(1, 6))
def test_round_momentum_decays_the_trace_per_full_round_however_it_is_split(beta, parts):
    """With no new delta, n rounds each carrying 1/n of a round decay the outer trace exactly as one
    full round does; a full round is plain Nesterov momentum."""
    assert merge.round_momentum(beta, 1.0) == beta and merge.round_momentum(0.0, 0.5) == 0.0
    params = {"w": np.zeros(4, np.float32)}
    trace0 = {"w": np.array([1.0, -2.0, 0.5, 3.0], np.float32)}
    zero = {"w": np.zeros(4, np.float32)}

    def trace_after(shares):
        state = None
        for share in shares:
            opt = merge.outer_optimizer(0.7, merge.round_momentum(beta, share), True)
            state = state or (opt.init(params)[0]._replace(trace=trace0), *opt.init(params)[1:])
            _, state = merge.outer_step(opt, params, state, zero)
        return state[0].trace["w"]
    np.testing.assert_allclose(trace_after([1.0 / parts] * parts), trace_after([1.0]), rtol=1e-5)
    np.testing.assert_allclose(trace_after([1.0]), beta * trace0["w"], rtol=1e-6)
