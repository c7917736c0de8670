"""The device codecs (diloco/device_codec.py) write the reference codec's bytes, bit for bit, and
decode to the reference's values: a learner that quantizes on its accelerator publishes exactly
what the host codec would have."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import device_codec, quantize

SHAPES = [(), (1,), (7,), (3, 5), (4, 8), (2, 3, 9), (0,), (3, 0), (0, 4), (64, 257)]


def _device_bytes(x: np.ndarray, scheme: str) -> bytes:
    parts = jax.jit(device_codec.encode, static_argnums=1)(x, scheme)
    return device_codec.DeviceCode(x.shape, scheme, parts).coded().data


@pytest.mark.parametrize("scheme", device_codec.ON_DEVICE)
@pytest.mark.parametrize("shape", SHAPES)
def test_device_codes_are_the_reference_codes(scheme, shape):
    rng = np.random.default_rng(hash((scheme, shape)) % 2**32)
    for x in (rng.normal(size=shape).astype(np.float32) * 10 ** rng.uniform(-6, 2),
              np.zeros(shape, np.float32), np.full(shape, -0.5, np.float32)):
        want = quantize.encode(x, scheme)
        got = _device_bytes(x, scheme)
        assert got == want
        decoded = jax.jit(device_codec.decode, static_argnums=(1, 2))(
            jax.jit(device_codec.encode, static_argnums=1)(x, scheme), shape, scheme)
        np.testing.assert_array_equal(np.asarray(decoded), quantize.decode(want, shape, scheme))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), scheme=st.sampled_from(device_codec.ON_DEVICE),
       exponent=st.integers(-30, 30), ties=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_device_codes_match_on_scales_and_ties(rows, cols, scheme, exponent, ties, seed):
    """Values a half step apart (round half to even), and scales from tiny to huge."""
    rng = np.random.default_rng(seed)
    if ties:  # k + 0.5 steps of a row whose max is 7 or 127 steps: rounding must agree on each tie
        levels = quantize.LEVELS.get(scheme, 7)
        x = (rng.integers(-levels, levels, size=(rows, cols)) + 0.5).astype(np.float32)
        x[:, 0] = levels
    else:
        x = rng.normal(size=(rows, cols)).astype(np.float32)
    x = (x * np.float32(2.0 ** exponent)).astype(np.float32)
    assert _device_bytes(x, scheme) == quantize.encode(x, scheme)


def test_a_coded_value_must_fit_its_shape():
    with pytest.raises(quantize.CodecError, match="needs 10 bytes, got 5"):
        quantize.Coded((2, 2), "int4", b"\x00" * 5)


@pytest.mark.parametrize("place", ["host", "device"])
@pytest.mark.parametrize("scheme", ["int4", "int8", "bf16", "fp32"])
def test_a_sync_on_the_devices_sends_the_reference_codes_and_moves_the_anchor_as_before(place, scheme):
    """learners.outer.outer_deltas against the host path it replaced: delta = anchor - local in
    float32, encoded by quantize.encode, the anchor moved by what a receiver decodes. Every code
    and every anchor bit agree, sync after sync, with the anchor on the host or on the devices."""
    import jax.numpy as jnp

    from diloco.learners.outer import Anchors, outer_deltas

    rng = np.random.default_rng(1)
    shapes = {"w": (16, 33), "b": (33,), "s": ()}
    start = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
    anchors, ref = Anchors(place), dict(start)
    for n in shapes:
        anchors[n] = jnp.asarray(start[n])
    local = {n: jnp.asarray(a) for n, a in start.items()}
    for _ in range(4):
        local = {n: a - jnp.asarray(rng.normal(size=a.shape).astype(np.float32) * 0.01) for n, a in local.items()}
        codes = outer_deltas(anchors, local, sorted(shapes), dict.fromkeys(shapes, scheme))
        for n in shapes:
            want = quantize.encode(ref[n] - np.asarray(local[n]), scheme)
            assert codes[n].coded().data == want
            ref[n] = ref[n] - quantize.decode(want, shapes[n], scheme)
            np.testing.assert_array_equal(np.asarray(anchors[n]), ref[n])
    held = anchors.nbytes()
    assert (held["device"] == 0) is (place == "host") and (held["host"] == 0) is (place == "device")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("anchor_dtype", ["float32", "param"])
def test_an_anchor_kept_as_codes_is_the_anchor_kept_whole_bit_for_bit(dtype, anchor_dtype, monkeypatch):
    """A host anchor kept as what it is made of (the fetched version's base, shared with the fetcher,
    its update code, the codes sent since) gives the same codes and the same anchor, bit for bit, as
    one kept whole, sync after sync, across a new version and past MAX_SENT; and holds a fraction of
    its bytes."""
    import jax.numpy as jnp
    import ml_dtypes

    from diloco.learners import outer
    from diloco.learners.outer import Anchors, outer_deltas, rebase

    monkeypatch.setattr(outer, "MAX_SENT", 3)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(7)
    shapes = {"w": (64, 130), "b": (130,)}
    names = sorted(shapes)

    def version(base):  # a fetched version: a base with an int4 update applied
        update = {n: quantize.encode(rng.normal(size=shapes[n]).astype(np.float32) * 0.01, "int4") for n in names}
        values = quantize.apply_update(base, update, "int4")
        return values, {n: (base[n], quantize.Coded(shapes[n], "int4", update[n])) for n in names}

    snapshot = {n: rng.normal(size=s).astype(np_dtype) for n, s in shapes.items()}
    values, made_of = version(snapshot)
    whole, codes_only = Anchors("host", anchor_dtype), Anchors("host", anchor_dtype)
    f32 = anchor_dtype == "float32"
    first = {n: jnp.asarray(values[n]).astype(jnp.float32 if f32 else values[n].dtype) for n in names}
    whole.keep(first)
    codes_only.keep(first, made_of)
    assert codes_only.nbytes()["host"] == sum(c.nbytes for _, c in made_of.values()) < whole.nbytes()["host"] / 3
    assert all(any(b is a for a in codes_only.bases()) for b in snapshot.values())  # shared, not copied
    local = {n: jnp.asarray(values[n]) for n in names}
    for step in range(8):
        local = {n: (a.astype(jnp.float32) - 0.01 * jnp.asarray(rng.normal(size=a.shape), jnp.float32)).astype(a.dtype)
                 for n, a in local.items()}
        sent = [outer_deltas(a, local, names, dict.fromkeys(names, "int4")) for a in (whole, codes_only)]
        for n in names:
            assert sent[0][n].coded().data == sent[1][n].coded().data, (step, n)
            np.testing.assert_array_equal(np.asarray(whole[n]), np.asarray(codes_only[n]), err_msg=f"{step} {n}")
        if step == 3:  # a new version on the same snapshot arrives
            values, made_of = version(snapshot)
            blocks = lambda rest: {n: {tuple((0, d) for d in shapes[n]): values[n]} for n in rest}  # noqa: E731
            got = [rebase(a, local, names, m, blocks, "rebase") for a, m in ((whole, {}), (codes_only, made_of))]
            for n in names:
                np.testing.assert_array_equal(np.asarray(got[0][n]), np.asarray(got[1][n]))
            local = got[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_version_decoded_on_the_devices_is_the_hosts_bit_for_bit(dtype):
    """learners.outer.version_on_devices decodes a fetched version (its base and its update code) on
    the devices: the same bits as quantize.apply_update on the host. A tensor it cannot build there
    (here: a NumPy leaf) is placed from the host's blocks."""
    import ml_dtypes

    from diloco.learners.outer import version_on_devices
    from diloco.plan import whole

    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    shapes = {"w": (32, 65), "b": (65,), "s": ()}
    base = {n: rng.normal(size=s).astype(np_dtype) for n, s in shapes.items()}
    for scheme in device_codec.ON_DEVICE:
        update = {n: quantize.encode(rng.normal(size=s).astype(np.float32), scheme) for n, s in shapes.items()}
        want = quantize.apply_update(base, update, scheme)
        made_of = {n: (base[n], quantize.Coded(shapes[n], scheme, update[n])) for n in shapes}
        leaves = {"w": jax.numpy.asarray(base["w"]), "b": jax.numpy.asarray(base["b"]), "s": np.asarray(base["s"])}
        asked = []
        got = version_on_devices(made_of, leaves, sorted(shapes),
                                 lambda rest: asked.extend(rest) or {n: {whole(shapes[n]): want[n]} for n in rest})
        assert asked == ["s"] and isinstance(got["w"], jax.Array) and got["w"].dtype == np_dtype
        for n in shapes:
            np.testing.assert_array_equal(np.asarray(got[n]), want[n], err_msg=f"{scheme} {n}")


_BLOCKS_SCRIPT = r"""
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from diloco import messages, quantize
from diloco.learners.outer import Anchors, outer_block_deltas, outer_deltas, part_entries

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
rng = np.random.default_rng(0)
out = {}
for scheme in ("int4", "int8", "fp32", "int2"):
    a, l = (rng.normal(size=(8, 12)).astype(np.float32) for _ in range(2))
    moved, codes = [], None
    for spec in (P("fsdp", None), P()):  # rows cut over fsdp, replicated over data; then one device's whole
        sh = NamedSharding(mesh, spec)
        anchors = Anchors("host", "float32")
        anchors.keep({"w": jax.device_put(a, sh)})
        leaf = jax.device_put(l, sh)
        if spec == P():
            got = outer_deltas(anchors, {"w": leaf}, ["w"], {"w": scheme}, {})
            whole = got["w"].coded() if hasattr(got["w"], "coded") else got["w"]
        else:
            got = outer_block_deltas(anchors, {"w": leaf}, ["w"], {"w": scheme}, {})
            specs = part_entries({"w": leaf}, ["w"], {"w": scheme})
            codes = messages.part_payload(specs[0], {k: c.coded() if hasattr(c, "coded") else c for k, c in got.items()})
            blocks = [t.block for t in specs[0]]
        moved.append(np.asarray(anchors["w"]))
    m = messages.Manifest(id="x", run="r", learner="l", region="g", fragment=0, base_version=0, tokens=1, steps=1,
                          step_time=0.1, tensors=tuple(specs[0]), total_bytes=len(codes), n_chunks=1,
                          crc32c=messages.checksum(codes), created=0.0)
    cut = b"".join(quantize.encode(a[messages.slices(b)] - l[messages.slices(b)], scheme) for b in blocks)
    out[scheme] = {"blocks": [list(map(list, b)) for b in blocks],
                   "codes_are_whole_cut_by_rows": codes == cut and np.array_equal(
                       messages.decode_payload(m, codes)["w"], whole.decoded()),
                   "anchors_equal": moved[0].tobytes() == moved[1].tobytes()}
print(json.dumps(out))
"""


def test_a_row_sharded_learner_codes_its_blocks_as_the_whole_tensors_codes_cut_by_rows():
    """outer_block_deltas (a learner over hosts; here 4 CPU devices of one process, data 2 x fsdp 2):
    each block of rows is coded by itself, once however many devices hold it, its codes are the
    whole tensor's cut by rows, and the anchors move exactly as the whole tensor's would."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"}
    done = subprocess.run([sys.executable, "-c", _BLOCKS_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for scheme, got in out.items():
        assert got["blocks"] == [[[0, 4], [0, 12]], [[4, 8], [0, 12]]], scheme
        assert got["codes_are_whole_cut_by_rows"] and got["anchors_equal"], (scheme, got)
