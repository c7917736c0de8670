"""The fused merge path equals the NumPy reference math (syncer/merge.py, diloco/quantize.py)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import messages, quantize
from diloco.messages import WireError
from diloco.syncer import fused
from diloco.syncer import merge as ref

SHAPES = [(7,), (5, 9), (3, 4, 6), (1, 1), (64, 33)]


def _encoded(deltas: dict[str, np.ndarray], scheme: str):
    manifest, frames = messages.encode_contribution(
        run="r", learner="l", region="g", fragment=0, base_version=0, tokens=10, steps=1, step_time=0.1,
        deltas=deltas, scheme=scheme, chunk_bytes=1 << 20)
    payload = b"".join(bytes(messages.parse_frame(f)[1]) for f in frames[1:])
    return manifest, payload


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_norms_from_codes_equal_the_norms_of_the_decoded_values(scheme):
    rng = np.random.default_rng(0)
    deltas = {f"t{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(SHAPES)}
    deltas["zero"] = np.zeros((4, 3), np.float32)
    manifest, payload = _encoded(deltas, scheme)
    decoded = messages.decode_payload(manifest, payload)
    for name, e in fused.views(manifest, payload).items():
        want = float(np.sum(decoded[name].astype(np.float64) ** 2))
        assert fused.sumsq(e) == pytest.approx(want, rel=1e-6, abs=1e-12), name
        np.testing.assert_array_equal(e.decode(), decoded[name])


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_a_non_finite_value_or_scale_makes_the_norm_nan(scheme):
    x = np.ones((3, 4), np.float32)
    x[1, 2] = np.nan if scheme in ("fp32", "bf16") else 1.0
    manifest, payload = _encoded({"x": x}, scheme)
    payload = bytearray(payload)
    if scheme in ("int8", "int4", "int2", "ternary"):
        payload[4:8] = np.float32(np.inf).tobytes()   # row 1's scale
    elif scheme == "topk":
        payload[0:4] = np.float32(np.inf).tobytes()   # the one block's scale
    e = fused.views(manifest, bytes(payload))["x"]
    assert math.isnan(fused.sumsq(e))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_finite_scale_whose_decoded_values_overflow_makes_the_norm_nan(scheme):
    """Issue 53 L3: the receiver decodes q x s in binary32, so a scale of 1e38 with a code of 7 or
    127 is an infinite value: non_finite, though the float64 sum of squares of q x s is finite."""
    manifest, payload = _encoded({"x": np.ones((3, 4), np.float32)}, scheme)
    payload = bytearray(payload)
    payload[4:8] = np.float32(1e38).tobytes()   # row 1's scale, finite
    e = fused.views(manifest, bytes(payload))["x"]
    assert not np.isfinite(e.decode()).all()
    assert math.isnan(fused.sumsq(e))


def test_views_refuse_sizes_that_do_not_fit():
    manifest, payload = _encoded({"x": np.ones((3, 4), np.float32)}, "int8")
    with pytest.raises(WireError, match="payload has"):
        fused.views(manifest, payload[:-1])


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 5), scheme=st.sampled_from(quantize.SCHEMES), seed=st.integers(0, 2**16),
       rule=st.sampled_from(["rda", "mean"]), share=st.sampled_from([1.0, 0.5, 1.5]),
       cancel=st.booleans(), owners=st.lists(st.sampled_from("abc"), min_size=5, max_size=5))
def test_the_fused_merge_equals_the_reference(k, scheme, seed, rule, share, cancel, owners):
    rng = np.random.default_rng(seed)
    contribs, encoded = [], []
    for i in range(k):
        d = {f"t{j}": rng.normal(size=s).astype(np.float32) * (10.0 ** rng.integers(-3, 2)) for j, s in enumerate(SHAPES)}
        if cancel and i == 1:  # an exact opposite of the first: directions cancel for k == 2
            d = {n: -contribs[0][n] for n in d}
        if i == k - 1 and k > 2:
            d["t0"] = np.zeros_like(d["t0"])   # no direction
        manifest, payload = _encoded(d, scheme)
        contribs.append(messages.decode_payload(manifest, payload))
        encoded.append(fused.encoded_delta(manifest, payload))
    weights = ref.token_weights(rng.integers(1, 1000, k), rng.integers(1, 10, k))
    learners = owners[:k]  # some learners with several contributions in the round
    want = ref.merge_deltas(contribs, weights, ("t1",), rule=rule, learners=learners, share=share)
    got = fused.merge(encoded, weights, ("t1",), rule=rule, share=share, threads=2, learners=learners)
    for n in want:
        scale = max(float(np.abs(want[n]).max()), 1e-30)
        np.testing.assert_allclose(got[n], want[n], rtol=2e-5, atol=2e-6 * scale, err_msg=n)


@pytest.mark.parametrize("relative_to_snapshot", [False, True])
@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_the_fused_update_encoding_is_bit_identical(scheme, relative_to_snapshot):
    rng = np.random.default_rng(1)
    old = {f"t{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(SHAPES)}
    old["bf"] = rng.normal(size=(6, 5)).astype(ml_dtypes.bfloat16)           # a bf16 tensor: the NumPy path
    new = {n: (a.astype(np.float32) + 1e-2 * rng.normal(size=a.shape)).astype(a.dtype) for n, a in old.items()}
    new["t1"] = old["t1"].copy()                                              # a tensor that did not move
    residual = {n: (1e-4 * rng.normal(size=a.shape)).astype(np.float32) for n, a in old.items() if n != "t0"}
    base = ({n: (a.astype(np.float32) - 3e-2 * rng.normal(size=a.shape)).astype(a.dtype) for n, a in old.items()}
            if relative_to_snapshot else None)
    want = quantize.encode_update(old, new, residual, scheme, base=base)
    got = fused.encode_update(old, new, residual, scheme, threads=2, base=base)
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for n in w:
            if isinstance(w[n], bytes):
                assert w[n] == g[n], n
            else:
                assert w[n].dtype == g[n].dtype and w[n].shape == g[n].shape, n
                np.testing.assert_array_equal(g[n], w[n], err_msg=n)


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, True), (0.5, False)])
def test_the_fused_outer_step_equals_optax(momentum, nesterov):
    rng = np.random.default_rng(2)
    params = {f"t{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(SHAPES)}
    params["bf"] = rng.normal(size=(4, 6)).astype(ml_dtypes.bfloat16)
    opt = ref.outer_optimizer(0.7, momentum, nesterov)
    state_ref = state_fused = opt.init(ref.as_float32(params))
    p_ref = p_fused = params
    for step in range(3):
        delta = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in params.items()}
        p_ref, state_ref = ref.outer_step(opt, p_ref, state_ref, delta)
        p_fused, state_fused = fused.outer_sgd(p_fused, state_fused, delta, lr=0.7, momentum=momentum,
                                               nesterov=nesterov, threads=2)
        for n in params:
            assert p_fused[n].dtype == p_ref[n].dtype
            np.testing.assert_allclose(p_fused[n].astype(np.float32), p_ref[n].astype(np.float32),
                                       rtol=1e-6, atol=1e-6, err_msg=f"{n} step {step}")
        a, b = ref.flatten_state(state_ref), ref.flatten_state(state_fused)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("scheme", quantize.SCHEMES)
def test_norms_of_huge_finite_values_are_finite(scheme):
    """1e30 squared overflows float32 but not the float64 the norms are summed in."""
    x = np.full((4, 8), 1e30, np.float32)
    manifest, payload = _encoded({"a": x}, scheme)
    norm = fused.encoded_delta(manifest, payload).norm
    decoded = quantize.roundtrip(x, scheme).astype(np.float64)   # int2 decodes 1.5 s, topk keeps 8 of 32
    assert math.isfinite(norm) and norm == pytest.approx(np.sqrt(np.sum(decoded ** 2)), rel=1e-2)
    assert norm == pytest.approx({"int2": 1.5e30 * math.sqrt(32), "topk": 1e30 * math.sqrt(8)}.get(
        scheme, 1e30 * math.sqrt(32)), rel=1e-2)


@settings(max_examples=30, deadline=None)
@given(scheme=st.sampled_from(quantize.SCHEMES), momentum=st.sampled_from([0.0, 0.5, 0.9]), nesterov=st.booleans(),
       seed=st.integers(0, 2**16), scaled=st.booleans(), with_residual=st.booleans(), snapshot=st.booleans())
def test_the_outer_step_fused_with_the_update_equals_the_two_apart(scheme, momentum, nesterov, seed, scaled,
                                                                   with_residual, snapshot):
    """fused.outer_update is outer_sgd then encode_update, bit for bit: update bytes, published values,
    residual and momentum trace, over three steps (the trace and residual carried), a bf16 tensor
    (the NumPy path) and a tensor whose delta is zero; with `snapshot` every update is relative to
    the first version, as between two snapshots."""
    rng = np.random.default_rng(seed)
    old = {f"t{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(SHAPES)}
    old["bf"] = rng.normal(size=(4, 6)).astype(ml_dtypes.bfloat16)
    opt = ref.outer_optimizer(0.7, momentum, nesterov)
    state_a = state_b = opt.init(ref.as_float32(old))
    pub_a = pub_b = old
    res_a = res_b = ({n: (1e-4 * rng.normal(size=a.shape)).astype(np.float32) for n, a in old.items()}
                     if with_residual else {})
    for step in range(3):
        delta = {n: (1e-2 * rng.normal(size=a.shape)).astype(np.float32) for n, a in old.items()}
        delta["t3"] = np.zeros_like(delta["t3"])
        scales = {n: float(rng.uniform(0.1, 2.0)) for n in delta} if scaled else None
        stepped = {n: np.float32(scales[n]) * d for n, d in delta.items()} if scaled else delta
        new, state_a = fused.outer_sgd(pub_a, state_a, stepped, lr=0.7, momentum=momentum, nesterov=nesterov)
        base = old if snapshot and step else None
        want = fused.encode_update(pub_a, new, res_a, scheme, base=base)
        got = fused.outer_update(pub_b, state_b, delta, res_b, lr=0.7, momentum=momentum, nesterov=nesterov,
                                 scheme=scheme, scales=scales, threads=2, base=base)
        for w, g in zip(want, got):
            assert w.keys() == g.keys()
            for n in w:
                if isinstance(w[n], bytes):
                    assert w[n] == g[n], (n, step)
                else:
                    assert w[n].dtype == g[n].dtype and w[n].shape == g[n].shape, n
                    np.testing.assert_array_equal(g[n], w[n], err_msg=f"{n} step {step}")
        a, b = ref.flatten_state(state_a), ref.flatten_state(got[3])
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
        _, pub_a, res_a = want
        _, pub_b, res_b, state_b = got


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp32"])
@pytest.mark.parametrize("where, words", [("delta", "merged values"), ("residual", "not finite"),
                                          ("huge", "merged values")])
def test_the_fused_outer_update_refuses_what_is_not_finite_naming_the_tensor(scheme, where, words):
    rng = np.random.default_rng(3)
    old = {n: rng.normal(size=s).astype(np.float32) for n, s in (("a", (5, 9)), ("b", (3, 4)))}
    delta = {n: (1e-2 * rng.normal(size=a.shape)).astype(np.float32) for n, a in old.items()}
    residual = {n: np.zeros_like(a) for n, a in old.items()}
    if where == "delta":
        delta["b"][2, 1] = np.nan
    elif where == "residual":
        residual["b"][0, 3] = np.inf
    else:  # finite, but the step overflows float32
        delta["b"][1, 1] = 3e38
    opt = ref.outer_optimizer(1.5, 0.0, False)
    with pytest.raises(FloatingPointError, match=words) as err:
        fused.outer_update(old, opt.init(old), delta, residual, lr=1.5, momentum=0.0, nesterov=False, scheme=scheme)
    assert "'b'" in str(err.value) and "'a'" not in str(err.value)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (7,), (5, 9), (3, 4, 6), (1031,)])
def test_squared_norm_equals_numpy(dtype, shape):
    a = (np.random.default_rng(4).normal(size=shape) * 1e3).astype(dtype)
    want = float(np.sum(a.astype(np.float64) ** 2))
    assert fused.squared_norm(a) == pytest.approx(want, rel=1e-12, abs=0.0)
    assert fused.squared_norm(a.T) == pytest.approx(want, rel=1e-12, abs=0.0)   # not contiguous


def _in_blocks(x: np.ndarray, scheme: str, blocks) -> tuple[messages.Manifest, bytes]:
    """x sent as `blocks` by as many hosts (messages.part_frames), assembled."""
    specs = [[messages.TensorSpec("w", x.shape, scheme, quantize.encoded_nbytes(
        tuple(b - a for a, b in block), scheme), block)] for block in blocks]
    parts = [messages.part_payload(s, {("w", s[0].block): quantize.coded(x[messages.slices(s[0].block)], scheme)})
             for s in specs]
    crcs = [messages.checksum(p) for p in parts]
    frames = []
    for h, payload in enumerate(parts):
        frames += messages.part_frames(cid="c", host=h, specs=specs, crcs=crcs, payload=payload, chunk_bytes=64,
                                       run="r", learner=f"us-{h}", region="us", fragment=0, base_version=0, tokens=1,
                                       steps=1, step_time=0.1)[1]
    asm = messages.ChunkAssembler(max_bytes=1 << 20, timeout_s=5)
    (got,) = [r for r in (asm.add(*messages.parse_frame(f), now=0.0) for f in frames) if r is not None]
    messages.verify_payload(got.manifest, got.payload)
    return got.manifest, got.payload


@pytest.mark.parametrize("scheme", ["fp32", "bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_a_row_sharded_learners_blocks_merge_bit_for_bit_as_the_whole_tensors(scheme, rule):
    """What a learner over hosts sends for tensors cut by rows (FSDP's usual layout) merges to the
    very bits the same deltas give coded whole: the same codes, the same norms, the same sums."""
    rng = np.random.default_rng(5)
    rows = [((0, 3), (0, 40)), ((3, 5), (0, 40)), ((5, 16), (0, 40))]
    whole, blocked = [], []
    for k in range(4):
        x = (rng.normal(size=(16, 40)) * (k + 1)).astype(np.float32)
        m, frames = messages.encode_contribution(run="r", learner=f"us-{k}", region="us", fragment=0, base_version=0,
                                                 tokens=1, steps=1, step_time=0.1, deltas={"w": x}, scheme=scheme,
                                                 chunk_bytes=64)
        whole.append(fused.encoded_delta(m, b"".join(bytes(messages.parse_frame(f)[1]) for f in frames[1:])))
        blocked.append(fused.encoded_delta(*_in_blocks(x, scheme, rows)))
        assert blocked[-1].norms == whole[-1].norms
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    a = fused.merge(whole, weights, rule=rule, learners=["a", "b", "a", "c"])
    b = fused.merge(blocked, weights, rule=rule, learners=["a", "b", "a", "c"])
    assert a["w"].tobytes() == b["w"].tobytes()


def test_column_blocks_merge_as_their_decoded_values():
    """Blocks that are no run of the flat tensor (cut by columns) are added where they lie."""
    rng = np.random.default_rng(6)
    cols = [((0, 8), (0, 5)), ((0, 8), (5, 12))]
    deltas = [fused.encoded_delta(*_in_blocks(rng.normal(size=(8, 12)).astype(np.float32), "int8", cols))
              for _ in range(3)]
    weights = np.array([0.5, 0.25, 0.25])
    got = fused.merge(deltas, weights, rule="mean")["w"]
    want = sum(np.float32(w) * d.decode()["w"] for w, d in zip(weights, deltas))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for d in deltas:  # a norm over all of a tensor's blocks
        np.testing.assert_allclose(d.norms["w"], np.linalg.norm(d.decode()["w"].astype(np.float64)), rtol=1e-6)
