import ml_dtypes
import numpy as np
import pytest
import spec_codec as spec
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from diloco import quantize

shapes = st.lists(st.integers(1, 17), min_size=1, max_size=3).map(tuple)
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, shapes, elements=finite))
def test_fp32_is_exact(x):
    np.testing.assert_array_equal(quantize.decode(quantize.encode(x, "fp32"), x.shape, "fp32"), x)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, shapes, elements=finite))
def test_bf16_relative_error_is_at_most_half_an_ulp(x):
    y = quantize.decode(quantize.encode(x, "bf16"), x.shape, "bf16")
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0 ** -8 + 1e-38)


@pytest.mark.parametrize("scheme, levels", [("int8", 127), ("int4", 7)])
@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float32, shapes, elements=finite))
def test_integer_codes_are_off_by_at_most_half_a_step_of_their_row(scheme, levels, x):
    y = quantize.decode(quantize.encode(x, scheme), x.shape, scheme)
    rows = x.reshape(-1, x.shape[-1])
    step = np.abs(rows).max(axis=1, keepdims=True) / levels
    assert np.all(np.abs(y.reshape(rows.shape) - rows) <= step / 2 * (1 + 1e-5) + 1e-30)
    again = quantize.decode(quantize.encode(y, scheme), x.shape, scheme)
    np.testing.assert_allclose(again, y, rtol=1e-6, atol=1e-30)  # idempotent: what the learner keeps is what is sent


def test_sizes_shrink_as_promised():
    x = np.ones((64, 32), np.float32)
    sizes = {s: len(quantize.encode(x, s)) for s in quantize.SCHEMES}
    assert sizes == {"fp32": 8192, "bf16": 4096, "int8": 64 * 4 + 2048, "int4": 64 * 4 + 1024, "int2": 64 * 4 + 512,
                     "ternary": 64 * 4 + 64 * 7,  # 32 values a row: 7 bytes of five codes
                     "topk": 8 * (4 + 2 * 8)}  # 2048 values: 8 blocks of 256, each 8 (index, code) pairs
    assert all(quantize.encoded_nbytes(x.shape, s) == n for s, n in sizes.items())
    odd = np.ones((3, 5), np.float32)
    assert len(quantize.encode(odd, "int4")) == quantize.encoded_nbytes(odd.shape, "int4") == 3 * 4 + 3 * 3


@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float32, shapes, elements=finite))
def test_int2_takes_the_nearest_of_four_levels_of_the_rows_rms(x):
    y = quantize.roundtrip(x, "int2").reshape(-1, x.shape[-1]).astype(np.float64)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    s = np.sqrt(np.mean(rows ** 2, axis=1, keepdims=True))
    levels = np.array([-1.5, -0.5, 0.5, 1.5]) * s[..., None]                 # rows x 1 x 4
    nearest = np.min(np.abs(rows[..., None] - levels), axis=-1)
    assert np.all(np.abs(y - rows) <= nearest + 1e-5 * s + 1e-30)            # no level is closer (ties either way)
    assert np.all(np.abs(y) <= 1.5 * s * (1 + 1e-6) + 1e-30)


@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float32, st.integers(0, 700).map(lambda n: (n,)), elements=finite))
def test_topk_keeps_the_largest_of_each_block_within_half_a_step(x):
    y = quantize.roundtrip(x, "topk")
    for start in range(0, x.size, quantize.TOPK_BLOCK):
        block, got = x[start:start + quantize.TOPK_BLOCK], y[start:start + quantize.TOPK_BLOCK]
        keep = min(quantize.TOPK_KEEP, block.size)
        kept = np.flatnonzero(got)
        assert kept.size <= keep
        top = np.sort(np.abs(block))[::-1]
        # what is left out is no larger than the smallest value kept
        dropped = np.setdiff1d(np.arange(block.size), kept)
        step = np.abs(block).max() / 127
        assert np.all(np.abs(block[dropped]) <= top[keep - 1] + step / 2 * (1 + 1e-5) + 1e-30)
        assert np.all(np.abs(got[kept] - block[kept]) <= step / 2 * (1 + 1e-5) + 1e-30)


# the ternary code's hard cases beside any finite values: ties with the cut, constant and zero rows,
# one value far above the rest, the tiniest and largest magnitudes binary32 has
ternary_values = st.one_of(finite, st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -0.7, 2.0, 1e-30, 1e-45, -3e38, 3e38]))


@settings(max_examples=200, deadline=None)
@given(x=arrays(np.float32, st.lists(st.integers(0, 13), max_size=3).map(tuple), elements=ternary_values))
@example(x=np.array([[0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]], np.float32))   # a constant row is exact
@example(x=np.full((2, 11), -3e38, np.float32))
def test_ternary_keeps_the_values_past_its_cut_at_their_mean_magnitude(x):
    """The reference encoder's rule, written out in float64: values above the cut decode to their
    sign times the mean magnitude of those kept, the rest to 0; so no value is off by more than the
    cut or the largest magnitude less the cut, and what is left out is never larger than the row
    (error feedback's buffer cannot grow from one message). The size is exact and the spec's codec
    writes and reads the same bytes."""
    blob = quantize.encode(x, "ternary")
    assert len(blob) == quantize.encoded_nbytes(x.shape, "ternary") == spec.nbytes(list(x.shape), "ternary")
    assert blob == spec.encode(x, "ternary")
    y = quantize.decode(blob, x.shape, "ternary")
    np.testing.assert_array_equal(y, spec.decode(blob, x.shape, "ternary"))
    rows, cols = quantize._rows(x.shape)
    for row, got in zip(x.reshape(rows, cols).astype(np.float64), y.reshape(rows, cols).astype(np.float64)):
        a = np.abs(row)
        cut = float(np.float32(quantize.TERNARY_THRESHOLD * a.mean())) if cols else 0.0
        kept = a > cut
        s = a[kept].mean() if kept.any() else 0.0
        np.testing.assert_allclose(got, np.where(kept, np.sign(row) * s, 0.0), rtol=2 ** -23, atol=1e-45)
        err = np.abs(got - row)
        assert np.all(err <= max(cut, a.max(initial=0.0) - cut) * (1 + 2 ** -23) + 1e-45)
        assert np.sum(err ** 2) <= np.sum(row ** 2) * (1 + 2 ** -22)


def test_ternary_codes_five_values_a_byte_in_base_3():
    codes = np.array([[1, -1, 0, 1, 0, 0, 1], [-1, -1, -1, -1, -1, 1, 1]], np.int8)
    packed = quantize.pack_trits(codes)
    assert packed.tolist() == [[2 + 0 * 3 + 1 * 9 + 2 * 27 + 1 * 81, 1 + 2 * 3 + 1 * 9 + 1 * 27 + 1 * 81],
                               [0, 2 + 2 * 3 + 1 * 9 + 1 * 27 + 1 * 81]]   # padding digits are the zero code
    np.testing.assert_array_equal(quantize.unpack_trits(packed, 7), codes)
    every = np.arange(243, dtype=np.uint8)[None]                             # each byte value once: 243 x 5 codes
    assert (quantize.pack_trits(quantize.unpack_trits(every, 5 * 243)) == every).all()
    with pytest.raises(quantize.CodecError, match="row 0: byte 1 is 243"):
        quantize.unpack_trits(np.array([[0, 243, 255]], np.uint8), 15)


@pytest.mark.parametrize("scheme", ["int2", "ternary", "topk"])
def test_error_feedback_sends_what_the_messages_sum_to_and_plain_compression_does_not(scheme):
    """A sender that adds what the code left out to its next message (what a learner's base does)
    sends, over many messages, their sum but for one bounded residual, so its relative error falls
    as messages add up; compressing each message alone keeps losing the same share."""
    rng = np.random.default_rng(0)
    signal = rng.normal(size=(16, 64)).astype(np.float32) * 0.1
    residual, fed, plain, total = (np.zeros_like(signal) for _ in range(4))
    error = {}
    for k in range(1, 201):
        g = signal + rng.normal(size=signal.shape).astype(np.float32)
        y = quantize.roundtrip(g + residual, scheme)
        residual, fed, total = g + residual - y, fed + y, total + g
        plain += quantize.roundtrip(g, scheme)
        if k in (50, 200):
            error[k] = np.linalg.norm(fed - total) / np.linalg.norm(total)
    assert error[200] < 0.6 * error[50]                        # falls as 1/k, not flat
    assert error[200] < 0.2 * np.linalg.norm(plain - total) / np.linalg.norm(total)


def test_a_topk_int2_or_ternary_block_with_a_non_finite_value_decodes_non_finite():
    x = np.ones(300, np.float32)
    x[270] = np.nan                                                          # in the second block, not among its top 8
    x[3] = 1e4
    y = quantize.roundtrip(x, "topk")
    assert np.isfinite(y[:256]).all() and not np.isfinite(y[256:]).all()
    assert not np.isfinite(quantize.roundtrip(x.reshape(3, 100), "int2")[2]).all()
    assert not np.isfinite(quantize.roundtrip(x.reshape(3, 100), "ternary")[2]).any()   # its scale is NaN
    x[270] = np.inf
    assert not np.isfinite(quantize.roundtrip(x.reshape(3, 100), "ternary")[2]).any()


def test_bf16_matches_ml_dtypes_rounding():
    x = np.array([1.0 + 2 ** -9, 3.14159, -2.5e-3], np.float32)
    np.testing.assert_array_equal(quantize.decode(quantize.encode(x, "bf16"), x.shape, "bf16"),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_wrong_length_and_unknown_scheme_are_errors():
    with pytest.raises(quantize.CodecError, match="needs 16 bytes"):
        quantize.decode(b"\0" * 15, (4,), "fp32")
    with pytest.raises(quantize.CodecError, match="unknown"):
        quantize.encode(np.ones(3), "fp4")


def _walk(seed: int, steps: int, shape=(6, 16)) -> list[dict[str, np.ndarray]]:
    """A global fragment as the outer optimizer moves it: steps of shrinking random size."""
    rng = np.random.default_rng(seed)
    x = {"w": rng.normal(size=shape).astype(np.float32), "b": rng.normal(size=shape[-1:]).astype(np.float32)}
    out = [x]
    for k in range(steps):
        x = {n: (a + rng.normal(scale=0.1 / (k + 1), size=a.shape)).astype(np.float32) for n, a in x.items()}
        out.append(x)
    return out


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_a_receiver_following_the_updates_holds_the_published_global_bit_for_bit(scheme):
    targets = _walk(0, 8)
    published, residual, receiver = targets[0], {}, dict(targets[0])
    for target in targets[1:]:
        wire, published, residual = quantize.encode_update(published, target, residual, scheme)
        receiver = quantize.apply_update(receiver, wire, scheme)
        for n in target:
            np.testing.assert_array_equal(receiver[n], published[n])
            assert len(wire[n]) == quantize.encoded_nbytes(target[n].shape, scheme)


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_one_update_relative_to_the_snapshot_brings_a_receiver_to_any_later_version(scheme):
    """Updates encoded against the snapshot: a receiver holding only the snapshot reaches each
    version, bit for bit, with that version's update alone, and the published global stays within
    one quantization step of the exact walk (the error is carried, not accumulated)."""
    targets = _walk(3, 10)
    snapshot = published = targets[0]
    residual = {}
    for before, target in zip(targets, targets[1:]):  # each outer step taken from the published global
        new = {n: published[n] + (target[n] - before[n]) for n in target}
        wire, published, residual = quantize.encode_update(published, new, residual, scheme, base=snapshot)
        receiver = quantize.apply_update(snapshot, wire, scheme)
        for n in target:
            np.testing.assert_array_equal(receiver[n], published[n])
            np.testing.assert_allclose(published[n] + residual[n], target[n], atol=1e-5)
            if scheme in quantize.LEVELS:  # off by at most half a step of the update's largest row
                step = np.max(np.abs(target[n] - snapshot[n])) / quantize.LEVELS[scheme]
                assert np.max(np.abs(residual[n])) <= 0.5 * step * 1.01 + 1e-6


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_update_error_is_carried_not_lost(scheme):
    walk = _walk(1, 12)
    steps = [{n: b[n] - a[n] for n in a} for a, b in zip(walk, walk[1:])]  # outer steps, as the syncer takes them
    published, residual = walk[0], {}
    for step in steps:
        _, published, residual = quantize.encode_update(published, {n: published[n] + step[n] for n in step},
                                                        residual, scheme)
    for n in walk[0]:  # every step arrived, but for what the last update still carries
        np.testing.assert_allclose(published[n] + residual[n], walk[0][n] + sum(s[n] for s in steps), atol=1e-5)
        assert np.max(np.abs(residual[n])) <= np.max(np.abs(steps[0][n])) / quantize.LEVELS[scheme]


def test_an_update_missing_a_tensor_is_an_error():
    x = _walk(2, 1)
    wire, _, _ = quantize.encode_update(x[0], x[1], {}, "int8")
    del wire["b"]
    with pytest.raises(quantize.CodecError, match="lacks tensors"):
        quantize.apply_update(x[0], wire, "int8")
