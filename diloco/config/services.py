"""The config's service sections: transport (Kafka), state (Redis), store, joins, run, monitoring, chaos."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from diloco.config.secrets import _without_credentials
from diloco.config.sections import _ENV, _ID, _Section


class TransportConfig(_Section):
    bootstrap_servers: str = Field("127.0.0.1:9092", pattern=r"^[^\s,@/?#]+:\d+(,[^\s,@/?#]+:\d+)*$",
                                   description="host:port[,host:port...]; credentials go in sasl_* instead")
    topic_prefix: str = Field("diloco", pattern=r"^[A-Za-z0-9._-]+$")
    compression: Literal["none", "lz4", "zstd"] = "none"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password_env: str | None = Field(None, pattern=_ENV, description="name of the env var holding the SASL password")
    ssl_cafile: str | None = None
    max_message_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    replication_factor: int = Field(1, ge=1, description="copies of each partition of the topics the run creates; "
                                                         "1 fits the one-node local broker, production: 3")
    min_insync_replicas: int | None = Field(None, ge=1, description="topic config min.insync.replicas: copies that "
                                            "must hold a write before acks=all confirms it; None = the broker's "
                                            "default, production: 2")
    acks: Literal["all", 0, 1] = Field("all", description="producer acks: all = every in-sync copy has the delta "
                                                          "(accepted, unmerged deltas live only in Kafka)")
    wan_bandwidth_mbps: float | None = Field(None, gt=0, description="emulated WAN link per region, shared by its learners")
    wan_latency_ms: float = Field(0.0, ge=0, description="emulated one-way WAN latency per contribution")

    @model_validator(mode="after")
    def _replicas_fit(self) -> TransportConfig:
        if (self.min_insync_replicas or 0) > self.replication_factor:
            raise ValueError(f"transport.min_insync_replicas ({self.min_insync_replicas}) exceeds "
                             f"transport.replication_factor ({self.replication_factor}): no acks=all write could succeed")
        return self

    def wan_delay_s(self, nbytes: int, sharers: int = 1) -> float:
        """Seconds a contribution of `nbytes` takes on the region's link when `sharers` learners use it."""
        transfer = 0.0 if self.wan_bandwidth_mbps is None else nbytes * 8 * sharers / (self.wan_bandwidth_mbps * 1e6)
        return self.wan_latency_ms / 1000 + transfer


class StateConfig(_Section):
    redis_url: str = Field("redis://127.0.0.1:6379/0", pattern=r"^rediss?://.+",
                           description="no credentials here: use username / password_env")
    key_prefix: str = Field("diloco", pattern=r"^[A-Za-z0-9._-]+$")
    username: str | None = Field(None, description="Redis ACL user")
    password_env: str | None = Field(None, pattern=_ENV, description="name of the env var holding the Redis password")
    connect_timeout_s: float = Field(20.0, gt=0, description="how long a process waits at start for Redis to answer "
                                     "(it may still be starting) before it says it is not reachable")
    cluster: bool = Field(False, description="redis_url names a node of a Redis Cluster: use the cluster client "
                                             "(a run's keys share one hash slot, `{<run>}`)")

    @field_validator("redis_url")
    @classmethod
    def _no_credentials(cls, url: str) -> str:
        return _without_credentials(url, "set state.username, and state.password_env to the name of the env var "
                                         "that holds the password")


class StoreConfig(_Section):
    url: str = Field("file://.diloco/store", pattern=r"^(file|gs)://.+")
    snapshot_every: int = Field(8, ge=1, description="a full snapshot (parameters, outer state, residual) every this "
                                                     "many versions; the versions between store only their update")

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, url: str) -> str:
        return _without_credentials(url, "gs:// uses the machine's Google credentials")


class JoinConfig(_Section):
    """Learners the local runner adds by itself once the run has trained a share of its token budget."""
    at_tokens_fraction: float = Field(gt=0, lt=1, description="share of run.token_budget merged into the global "
                                      "model when these learners are added")
    region: str = Field(pattern=_ID)
    count: int = Field(1, ge=1, description="learners added to the region (the next free ids <region>-<k>)")


class RunConfig(_Section):
    name: str = Field("local", pattern=_ID)
    id: str | None = Field(None, pattern=_ID, description="set to resume a run; default: name + time")
    dir: str = ".diloco/runs"
    heartbeat_s: float = Field(1.0, gt=0)
    signing_secret_env: str | None = Field(None, pattern=_ENV, description="name of the env var holding the run's "
                                           "signing secret (the runner and the syncer read it; learners never): every "
                                           "frame is then signed with its learner's own key and the syncer refuses any "
                                           "other (docs/wire-format.md); unset = the topics' ACLs alone say who writes")
    keys_dir: str | None = Field(None, description="where each learner reads its key file <learner>.key when "
                                 "signing_secret_env is set (default <run.dir>/<run.id>/keys, written by the local "
                                 "runner; on GKE or TPU VMs mount each learner's own key there)")
    eval_batches: int = Field(16, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    timeout_s: float = Field(1800.0, gt=0)
    threads_per_process: int = Field(1, ge=1)
    warm_starts: bool = Field(True, description="the local runner forks each learner and syncer shard from a process "
                              "that imported their code once (infra/forkserver.py): a start or restart takes "
                              "milliseconds, not 1-2 CPU-seconds of imports; false = every process starts from scratch")
    preload: list[str] = Field(default_factory=list, description="modules (dotted names) the local runner's fork server "
                               "imports once per run, after model.entry's module, which it always imports: e.g. a model "
                               "library your learner script (model.script) imports. One that fails to import there, or "
                               "starts JAX's backend at import, is imported by each learner itself (logged)")
    max_restarts: int = Field(3, ge=0, description="restarts of a failed learner or syncer before the run fails")
    restart_backoff_s: float = Field(1.0, ge=0, description="first restart delay; doubles per restart of a process")
    spares: int = Field(0, ge=0, description="warm spare learner processes the local runner keeps (interpreter, JAX, "
                        "model and compiled step loaded): a learner that dies is replaced by one at once, no restart "
                        "delay, and a new spare starts behind it; 0 = restart the learner itself after the delay")
    token_budget: int | None = Field(None, ge=1, description="tokens the whole run trains into the global model "
                                     "(each token counted once, not once per fragment): the syncer takes no new "
                                     "contribution into a fragment that has taken in that many (merged or accepted; "
                                     "refused as token_budget), so each fragment ends within one contribution of it; "
                                     "once the merges the syncer stored hold that many (the learners' own claims do "
                                     "not count), the local runner asks every learner to stop (SIGTERM: it hands in "
                                     "and says left); a learner still stops at its inner.steps if that comes first. "
                                     "None = off: every learner trains inner.steps, so learners that join add tokens")
    joins: tuple[JoinConfig, ...] = Field((), description="learners the local runner adds when the run has trained "
                                          "a share of run.token_budget, as `diloco learners add` would")


class MonitoringConfig(_Section):
    """Prometheus endpoints (/metrics) of the run's processes; the syncer's also serves the status page.
    Ports are fixed so that an operator can name them: syncer shard i on syncer_port + i, the learner
    with data shard k (its place in member_ids()) on learner_port_base + k. 0 = no endpoint."""
    host: str = Field("127.0.0.1", description="address the endpoints listen on: this machine only by default; "
                      "0.0.0.0 (or a pod's address) for a Prometheus elsewhere")
    syncer_port: int = Field(0, ge=0, le=65535, description="syncer shard i serves on syncer_port + i; 0 = off")
    learner_port_base: int = Field(0, ge=0, le=65535, description="learner k (data shard) serves on "
                                   "learner_port_base + k; 0 = off")


class ChaosConfig(_Section):
    """Seeded fault injection for `diloco chaos`: kill processes mid-run and let the run heal."""
    seed: int = 0
    learner_kills: int = Field(1, ge=0, description="SIGKILLs per learner")
    syncer_kills: int = Field(1, ge=0)
    window: tuple[float, float] = Field((0.15, 0.75), description="kills happen in this share of the inner steps")
    restart_after_s: float = Field(2.0, ge=0, description="downtime before a killed process is restarted")
