"""Where one learner's arrays live: one JAX program over all of its devices and hosts.

Kept apart from the model (torchtitan style): the model and the train step are single-device code;
this module only says where arrays live, and XLA inserts the collectives. The learner's devices form
a mesh with axes

    data    copies of the model, each on its own rows of the batch
    fsdp    parameters and optimizer state sharded across these devices (FSDP / ZeRO-3)
    tensor  for partition specs that split a layer's matrices (tensor parallelism)

from `parallel.fsdp` and `parallel.tensor` (data is what is left). Parameters are placed by the
model's partition specs (`ModelSpec.partition`) or, without them, by `fsdp_specs`: each array cut
along its longest axis that the fsdp axis divides. The batch is split over data x fsdp.

The same code runs on one CPU, on N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)
and on a multi-host slice. Hosts find each other through `jax.distributed`: on a TPU slice (and under
SLURM or Open MPI) JAX reads everything from the environment the runtime sets; other backends set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (the local backend and the GKE JobSet
manifests do).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco.config import Config, ConfigError

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def cpu_devices_env(n: int, env=os.environ) -> dict[str, str]:
    """`env` for a child process that sees n CPU devices: the XLA_FLAGS it had kept, the count added."""
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return {**env, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def initialize_distributed(cfg: Config) -> None:
    """Join this learner's other hosts, once per process; a no-op for a one-host learner."""
    if jax.distributed.is_initialized():
        return
    n = int(os.environ.get(ENV_NUM_PROCESSES) or 1)
    auto = os.environ.get(ENV_COORDINATOR) or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",")
    if n == 1 and not auto:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts talk over TCP
    timeout = cfg.parallel.heartbeat_timeout_s  # a dead host brings the others down this fast, not never
    if n > 1:
        jax.distributed.initialize(os.environ[ENV_COORDINATOR], num_processes=n,
                                   process_id=int(os.environ[ENV_PROCESS_ID]), heartbeat_timeout_seconds=timeout)
    else:
        jax.distributed.initialize(heartbeat_timeout_seconds=timeout)  # the TPU runtime's environment
    log.info("joined the learner's hosts", extra={"host": jax.process_index(), "hosts": jax.process_count(),
                                                  "devices": jax.device_count()})


@dataclass(frozen=True)
class LearnerMesh:
    mesh: Mesh

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def is_leader(self) -> bool:
        """Deprecated (nothing in the library reads it; to be removed in the next release): whether
        this is host 0, `jax.process_index() == 0`."""
        import warnings

        warnings.warn("LearnerMesh.is_leader is deprecated: use jax.process_index() == 0", DeprecationWarning,
                      stacklevel=2)
        return jax.process_index() == 0

    def shard(self, tree, specs=None):
        """Host values (NumPy or JAX arrays) placed on the mesh by `specs`, a tree of PartitionSpecs
        like `tree` (default: `fsdp_specs`). Each device receives only its block."""
        specs = fsdp_specs(tree, self.mesh) if specs is None else specs
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        spec_leaves = treedef.flatten_up_to(specs)
        out = []
        for leaf, spec in zip(leaves, spec_leaves):
            if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):  # RNG state (NNX dropout)
                data = np.asarray(jax.random.key_data(leaf))
                check_spec(spec, data.shape[:leaf.ndim], self.mesh)
                placed = jax.make_array_from_callback(
                    data.shape, NamedSharding(self.mesh, P(*spec, *[None] * (data.ndim - leaf.ndim))),
                    lambda index, v=data: v[index])
                out.append(jax.random.wrap_key_data(placed, impl=jax.random.key_impl(leaf)))
                continue
            value = np.asarray(leaf)
            check_spec(spec, value.shape, self.mesh)
            out.append(jax.make_array_from_callback(value.shape, NamedSharding(self.mesh, spec),
                                                    lambda index, v=value: v[index]))
        return jax.tree_util.tree_unflatten(treedef, out)

    def init_optimizer(self, opt, params):
        """`opt.init(params)` with each parameter-shaped state (Adam's moments, ...) sharded like its
        parameter and the rest (step counts) replicated, instead of whatever XLA would pick."""
        import optax

        shapes = jax.eval_shape(opt.init, params)
        shardings = optax.tree_map_params(opt, lambda _, p: p.sharding, shapes, params,
                                          transform_non_params=lambda _: NamedSharding(self.mesh, P()))
        return jax.jit(opt.init, out_shardings=shardings)(params)

    def replicate(self, tree):
        return self.shard(tree, jax.tree_util.tree_map(lambda _: P(), tree))

    def shard_batch(self, local_batch):
        """This host's rows of the global batch (an array or any pytree of arrays), split over data x fsdp."""
        sharding = NamedSharding(self.mesh, P(BATCH_AXES))
        return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                                      local_batch)

    def bytes_per_device(self, tree) -> int:
        """Bytes of `tree` on the most loaded device (what has to fit in one chip's memory)."""
        per: dict[int, int] = {}
        for leaf in jax.tree_util.tree_leaves(tree):
            for s in getattr(leaf, "addressable_shards", ()):
                per[s.device.id] = per.get(s.device.id, 0) + s.data.nbytes
        return max(per.values(), default=0)


def learner_mesh(cfg: Config) -> LearnerMesh:
    """The mesh of this learner's devices (all hosts') for `parallel.fsdp` / `parallel.tensor`."""
    initialize_distributed(cfg)
    devices = jax.devices()
    fsdp, tensor = cfg.parallel.fsdp, cfg.parallel.tensor
    if len(devices) % (fsdp * tensor):
        raise ConfigError(f"parallel.fsdp x parallel.tensor ({fsdp} x {tensor}) must divide the learner's "
                          f"{len(devices)} devices")
    data = len(devices) // (fsdp * tensor)
    if cfg.inner.batch_size % (data * fsdp):
        raise ConfigError(f"inner.batch_size ({cfg.inner.batch_size}) must be divisible by the learner's "
                          f"{data * fsdp} data x fsdp devices")
    if cfg.inner.batch_size % jax.process_count():
        raise ConfigError(f"inner.batch_size ({cfg.inner.batch_size}) must split over the learner's "
                          f"{jax.process_count()} hosts")
    # devices are in process order, so the inner axes (tensor, then fsdp) stay within a host where they fit
    return LearnerMesh(Mesh(np.array(devices).reshape(data, fsdp, tensor), AXES))


def fsdp_specs(tree, mesh: Mesh):
    """The default placement: each array cut along its longest axis that the fsdp axis divides
    (replicated when none does, or when fsdp is 1)."""
    n = mesh.shape["fsdp"]

    def spec(leaf) -> P:
        shape = tuple(np.shape(leaf))
        if n == 1 or not shape:
            return P()
        fits = [i for i in range(len(shape)) if shape[i] % n == 0]
        if not fits:
            return P()
        axis = max(fits, key=lambda i: shape[i])
        return P(*[("fsdp" if i == axis else None) for i in range(len(shape))])

    return jax.tree_util.tree_map(spec, tree)


def check_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> None:
    if len(spec) > len(shape):
        raise ConfigError(f"partition spec {spec} has more entries than the array's {len(shape)} axes {shape}")
    for dim, names in zip(shape, spec):
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        unknown = [a for a in names if a not in mesh.shape]
        if unknown:
            raise ConfigError(f"partition spec {spec} names {unknown}; the learner's mesh has {list(mesh.shape)}")
        size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        if dim % size:
            raise ConfigError(f"partition spec {spec} for an array of shape {shape}: {dim} does not split "
                              f"over {names} ({size} devices)")


def local_batch_size(global_batch: int) -> int:
    return global_batch // jax.process_count()
