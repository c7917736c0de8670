"""A learner over several devices trains exactly like over one, for the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from diloco.learners.parallel import cpu_devices_env

SCRIPT = r"""
import json, sys
import jax, numpy as np
from diloco.config import build_config
from diloco.learners.learner import make_train_step
from diloco.learners.parallel import learner_mesh, local_batch_size
from diloco.models.transformer import adamw, init_params, loss_fn
cfg = build_config({"model": {"options": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16}},
                    "inner": {"batch_size": 8, "lr": 0.01, "warmup_steps": 2, "steps": 20}})
dp = learner_mesh(cfg)
assert local_batch_size(cfg.inner.batch_size) == 8
params = dp.replicate(init_params(cfg.model.transformer))
opt = adamw(cfg)
state = dp.init_optimizer(opt, params)  # as the learner does: step counts on the mesh, one compilation
data = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)  # learnable: seen each step
step = make_train_step(lambda p, b: loss_fn(p, b, cfg.model.transformer), opt)
losses = []
for _ in range(12):
    batch = dp.shard_batch(data)
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
print(json.dumps({"devices": dp.devices, "shards": len(batch.addressable_shards), "losses": losses,
                  "checksum": float(sum(float(np.abs(np.asarray(v)).sum()) for v in params.values()))}))
"""


def _run(devices: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=cpu_devices_env(devices), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_four_cpu_devices_follow_the_single_device_loss_curve():
    one, four = _run(1), _run(4)
    assert one["devices"] == 1 and four["devices"] == 4 and four["shards"] == 4
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=2e-5)
    assert four["losses"][-1] < four["losses"][0]
    assert abs(four["checksum"] - one["checksum"]) < 1e-4 * one["checksum"]


def test_a_batch_that_does_not_split_over_the_devices_is_refused():
    env = cpu_devices_env(3)
    code = ("from diloco.config import build_config; from diloco.learners.parallel import learner_mesh; "
            "learner_mesh(build_config({'inner': {'batch_size': 8}}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "must be divisible by the learner's 3 data x fsdp devices" in out.stderr


def test_the_deprecated_is_leader_still_answers_and_warns():
    import pytest

    from diloco.config import build_config
    from diloco.learners.parallel import learner_mesh

    mesh = learner_mesh(build_config({"inner": {"batch_size": 8}}))
    with pytest.warns(DeprecationWarning, match="is_leader"):
        assert mesh.is_leader is True
