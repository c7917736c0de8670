"""A user's own model in the built-in loop, without services: float leaves are trained, the rest
(RNG state, integer counters) is state the loss reads and, when it says so, updates."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco.config import build_config
from diloco.learners.learner import make_train_step, partition
from diloco.spec import evaluate, import_roots, load_entry

ROOT = Path(__file__).resolve().parents[1]


def test_an_int_leaf_is_state_not_a_parameter():
    params = {"w": jnp.ones((3, 3)), "step": jnp.zeros((), jnp.int32)}
    opt = optax.adam(1e-2)
    trainable, rest = partition(params)
    assert trainable["step"] is None and rest["w"] is None
    step = make_train_step(lambda p, x: jnp.sum((x @ p["w"]) ** 2) + 0.0 * p["step"], opt)
    new, _, value = step(params, opt.init(trainable), jnp.ones((2, 3)))
    assert new["step"].dtype == jnp.int32 and int(new["step"]) == 0        # read, not trained
    assert float(value) > 0 and not np.allclose(new["w"], 1.0)


def test_a_stateful_loss_updates_its_counter_and_the_tree_keeps_its_shape():
    def loss(p, x):
        return jnp.mean((x * p["w"]) ** 2), {**p, "step": p["step"] + 1}
    params = {"w": jnp.ones(4), "step": jnp.zeros((), jnp.int32)}
    opt = optax.sgd(0.1)
    step = make_train_step(loss, opt, stateful=True)
    state = opt.init(partition(params)[0])
    for _ in range(3):
        params, state, _ = step(params, state, jnp.ones(4))
    assert int(params["step"]) == 3 and params["step"].dtype == jnp.int32


def test_the_flax_example_trains_with_dropout_and_an_int_counter():
    pytest.importorskip("flax")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import flax_nnx_lm as example
    finally:
        sys.path.remove(str(ROOT / "examples"))
    spec = example.spec(build_config({}))
    params = spec.init(0)
    opt = spec.optimizer
    step = make_train_step(spec.loss, opt, stateful=spec.stateful)
    state = opt.init(partition(params)[0])
    rng = np.random.default_rng(0)
    batch = jnp.asarray(np.tile(rng.integers(0, 256, (1, example.SEQ + 1)), (4, 1)).astype(np.int32))
    before = evaluate(spec, params, [batch])
    counts = []
    for _ in range(20):
        params, state, _ = step(params, state, batch)
        counts.append(int(params["blocks"][0]["drop"]["rngs"]["count"][...]))
    assert int(params["calls"][...]) == 20                                   # the counter the model keeps
    assert counts == sorted(set(counts))                                     # dropout draws new masks each step
    assert evaluate(spec, params, [batch]) < before - 1.0                    # and it learns


def test_an_entry_point_imports_from_the_scripts_folder_and_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_model_xyz.py").write_text("def spec():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    assert str(tmp_path) in import_roots()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert load_entry("my_model_xyz:spec")() == 1
    sys.modules.pop("my_model_xyz", None)


def test_rng_keys_are_placed_on_the_learners_mesh_as_keys():
    """An NNX model's dropout key (a typed PRNG key leaf) goes onto the devices like any other leaf."""
    from diloco.learners.parallel import learner_mesh
    mesh = learner_mesh(build_config({}))
    tree = {"key": jax.random.key(3), "keys": jax.random.split(jax.random.key(1), 4), "w": np.ones((4, 2), np.float32)}
    placed = mesh.shard(tree)
    assert jax.dtypes.issubdtype(placed["key"].dtype, jax.dtypes.prng_key) and placed["keys"].shape == (4,)
    np.testing.assert_array_equal(jax.random.key_data(placed["keys"]), jax.random.key_data(tree["keys"]))
