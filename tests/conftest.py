"""Fixtures that start the real services once per test session.

A Tansu broker and a Redis server are started on free ports under a temporary directory (or the
ones named by DILOCO_TEST_KAFKA=host:port / DILOCO_TEST_REDIS=redis://... are used instead). The GCS
emulator and a Redis Cluster start only for the tests that ask for them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import helpers  # tests/helpers.py: pytest puts this folder on sys.path for its conftest

# XLA compiles for CPU at LLVM's lowest optimisation level in the tests, this process and every run it
# starts (they inherit XLA_FLAGS): the tests' models are tiny, so compiling, not running, is most of
# their time, and level 0 halves it. IEEE semantics stay (no fast math either way); set XLA_FLAGS
# yourself to test at the default level.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
from diloco.config import Config, build_config
from diloco.infra import services


# Fixtures that start or reach a real service: a test that asks for one (directly or through another
# fixture) belongs to the integration tier, and must say so, so that `make test-fast` runs no service.
SERVICE_FIXTURES = frozenset({"kafka_bootstrap", "redis_url", "redis_cluster_url", "gcs_emulator"})


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("integration") is None]
    if unmarked:
        raise pytest.UsageError("tests that start services must carry @pytest.mark.integration (or a module "
                                "pytestmark): " + ", ".join(unmarked[:20]) + (" ..." if len(unmarked) > 20 else ""))


def pytest_sessionfinish(session, exitstatus):
    # Client threads still running when the session ends (a Kafka client reconnecting to the broker
    # the fixtures just stopped) log into handlers Prefect has closed; their tracebacks would bury
    # pytest's summary, which must be the last thing a CI log shows. Their log lines are dropped too:
    # a reconnecting client writes hundreds, and a CI log shows its last lines only. Here, not at
    # unconfigure: the terminal summary is printed after this hook, and lines logged while it is
    # printed would land below it.
    logging.raiseExceptions = False
    logging.disable(logging.CRITICAL)


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """One JAX compilation cache for every run the session starts (diloco/run.py honours a cache
    the caller set): most tests run the same tiny model, so most learners load their steps compiled."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
    # and this process's own compilations: JAX read the variable when the test modules imported it
    import jax
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    yield


@pytest.fixture(autouse=True)
def close_harnesses():
    """Close the harnesses a test made (their syncer and Kafka clients), pass or fail."""
    yield
    while helpers.OPEN_HARNESSES:
        helpers.OPEN_HARNESSES.pop().close()


@pytest.fixture(scope="session")
def service_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("services")


def _service(env_var: str, name: str, start, address: str, service_dir: Path):
    """The service named by `env_var`, or one started on a free port for the session."""
    if os.environ.get(env_var):
        yield os.environ[env_var]
        return
    port = services.free_port()
    start(service_dir, port)
    yield address.format(port=port)
    services.stop(name, service_dir)


@pytest.fixture(scope="session")
def kafka_bootstrap(service_dir) -> str:
    yield from _service("DILOCO_TEST_KAFKA", "kafka", services.start_broker, "127.0.0.1:{port}", service_dir)


@pytest.fixture(scope="session")
def redis_url(service_dir) -> str:
    yield from _service("DILOCO_TEST_REDIS", "redis", services.start_redis, "redis://127.0.0.1:{port}/0", service_dir)


@pytest.fixture(scope="session")
def redis_cluster_url(service_dir) -> str:
    """A Redis Cluster of three masters, started for the tests that ask for it; the URL names one node."""
    ports = [services.free_port() for _ in range(3)]
    services.start_redis_cluster(service_dir, ports)
    yield f"redis://127.0.0.1:{ports[0]}/0"
    services.stop_redis_cluster(service_dir)


@pytest.fixture(scope="session")
def gcs_emulator(service_dir):
    """A fake-gcs-server with bucket `diloco-test`; sets the env the TensorStore gcs driver reads."""
    port = services.free_port()
    services.start_gcs(service_dir, port, "diloco-test")
    old = {k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = f"http://127.0.0.1:{port}"
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "x"
    yield "gs://diloco-test"
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    services.stop("gcs", service_dir)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


TINY = {
    # the integration tests pin the paper's merge (RDA, Nesterov, overwrite) that they were written
    # against; the defaults (preset decoupled) have tests of their own
    "preset": "paper",
    "model": {"options": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32}},
    "data": {"max_corpus_bytes": 2_000_000},
    "inner": {"steps": 80, "batch_size": 8, "lr": 0.01, "warmup_steps": 5},
    "fragments": {"count": 4, "sync_every": 10, "quantization": "int8", "chunk_bytes": 4096},
    "syncer": {"quorum": 2, "grace_max_s": 0.5, "broadcast": "int8"},  # int8 both ways, as they were written
    "run": {"heartbeat_s": 0.5, "eval_batches": 4, "eval_batch_size": 8, "timeout_s": 600},
}


@pytest.fixture
def tiny_config(tmp_path, kafka_bootstrap, redis_url, data_dir):
    """Build a tiny run's config on the session's services; keyword sections override TINY."""
    def make(**sections) -> Config:
        tree = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
        for key, value in sections.items():
            tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
        tree["transport"] = {"bootstrap_servers": kafka_bootstrap, **tree.get("transport", {})}
        tree["state"] = {"redis_url": redis_url, **tree.get("state", {})}
        tree.setdefault("store", {"url": f"file://{tmp_path}/store"})
        tree["data"] = {"dir": str(data_dir), **tree["data"]}
        tree["run"] = {"dir": str(tmp_path / "runs"), **tree["run"]}
        return build_config(tree)
    return make
