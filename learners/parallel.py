"""Data parallelism inside one learner: one JAX program over all of the learner's devices.

Kept apart from the model (torchtitan style): the model and the train step are single-device code;
this module only says where arrays live. Parameters and optimizer state are replicated, the batch
is split along its first axis, and XLA inserts the gradient all-reduce. The same code runs on one
CPU, on N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N) and on a multi-host TPU
slice, where `jax.distributed.initialize()` reads the coordinator from the environment the TPU
runtime (or the job backend) sets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclass(frozen=True)
class DataParallel:
    mesh: Mesh

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def is_leader(self) -> bool:
        """One host per learner publishes deltas and heartbeats, not one per device or host."""
        return jax.process_index() == 0

    def replicate(self, tree):
        sharding = NamedSharding(self.mesh, P())
        return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)

    def shard_batch(self, local_batch):
        """This host's rows of the global batch (an array or any pytree of arrays), spread over the
        data axis."""
        sharding = NamedSharding(self.mesh, P("data"))
        return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                                      local_batch)

    @staticmethod
    def to_host(x: jax.Array) -> np.ndarray:
        """A replicated array's value on this host (every device holds all of it)."""
        return np.asarray(x.addressable_data(0))


def data_parallel(global_batch: int) -> DataParallel:
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and jax.process_count() == 1:
        jax.distributed.initialize()  # multi-host slice: coordinator, process count and id from the env
    devices = jax.devices()
    if global_batch % len(devices):
        raise ValueError(f"inner.batch_size ({global_batch}) must be divisible by the learner's "
                         f"{len(devices)} devices")
    return DataParallel(Mesh(np.array(devices), ("data",)))


def local_batch_size(global_batch: int) -> int:
    return global_batch // jax.process_count()
