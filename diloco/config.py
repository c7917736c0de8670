"""One typed config for a run, loaded from YAML with `--set key=value` overrides.

Every section is a pydantic model with `extra="forbid"`, so a misspelt key or a bad value fails at
load time with the dotted key and what is allowed.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_ID = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"  # safe in topic names, Redis keys and paths
_ENV = r"^[A-Za-z_][A-Za-z0-9_]*$"  # an environment variable's name (also a key of the GKE Secret)
_ABS_PATH = r"^/[A-Za-z0-9._/-]*$"  # goes into a container's command line on a TPU VM (quoted there too)
_IMAGE = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$"  # a registry reference, e.g. host/project/repo/name:tag or @sha256:...


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


BUILTIN_MODEL = "diloco.models.transformer:spec"


class TransformerOptions(_Section):
    """`model.options` of the built-in byte-level transformer (BUILTIN_MODEL)."""
    vocab_size: int = Field(256, ge=2, description="256 = byte-level")
    d_model: int = Field(128, ge=8)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=2)
    mlp_ratio: int = Field(4, ge=1)
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter dtype")

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerOptions:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self


class ModelConfig(_Section):
    entry: str = Field(BUILTIN_MODEL, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
                       description="package.module:function returning the model's ModelSpec")
    options: dict[str, Any] = Field(default_factory=dict, description="free-form settings the entry point reads")
    script: str | None = Field(None, description="a Python file each learner runs instead of the built-in loop: your "
                                                 "own training loop around diloco.Session.from_env()")
    seed: int = Field(0, description="seed of the initial parameters")

    @model_validator(mode="after")
    def _builtin_options(self) -> ModelConfig:
        if self.entry == BUILTIN_MODEL:
            try:
                TransformerOptions.model_validate(self.options)
            except ValidationError as err:
                raise ValueError("model.options: " + "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or 'options'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in err.errors())) from None
        return self

    @property
    def transformer(self) -> TransformerOptions:
        """The built-in transformer's validated options."""
        return TransformerOptions.model_validate(self.options)


class DataConfig(_Section):
    corpus: str | None = Field(None, description="directory or glob of text, JSON Lines (.jsonl, .gz, .zst) or "
                               "Parquet files; None = Python stdlib sources")
    dir: str = Field(".diloco/data", description="where prepared token shards live")
    prepared: str | None = Field(None, description="a prepared corpus directory; `diloco train` sets it in the run's config")
    heldout_fraction: float = Field(0.05, gt=0, lt=1)
    max_corpus_bytes: int = Field(16_000_000, ge=1024, description="cap on text read into the corpus")
    tokenizer: str = Field("bytes", description="bytes, a Hugging Face tokenizer.json or a SentencePiece .model")
    text_field: str = Field("text", min_length=1, description="the field (JSON Lines) or column (Parquet) that holds "
                            "a record file's documents; text files are read whole")
    near_duplicates: float | None = Field(None, gt=0, le=1, description="also drop documents whose 5-word shingle "
                                          "sets have an estimated Jaccard similarity of at least this with another "
                                          "(MinHash + LSH); None = exact duplicates only")
    seed: int = 0


class RegionConfig(_Section):
    name: str = Field(pattern=_ID)
    learners: int = Field(2, ge=1, description="learners the run starts with: <name>-0 .. <name>-(learners-1)")
    max_learners: int | None = Field(None, ge=1, description="learners this region may have: ids <name>-<k> with k "
                                     "below it may join the live run (admitted by the syncer on their first "
                                     "heartbeat); default: `learners`, no joins")
    min_learners: int = Field(0, ge=0, description="`diloco learners remove` refuses to take the region below this; "
                              "the syncer warns (region_below_min) when fewer are live")
    speed: float = Field(1.0, gt=0, le=1, description="1 = full speed; 0.5 = steps take twice as long")
    work_pool: str | None = Field(None, pattern=_ID, description="the Prefect work pool whose worker runs this "
                                  "region's learners (the `diloco-region` flow, docs/prefect.md); default "
                                  "diloco-<name>")

    @model_validator(mode="after")
    def _bounds(self) -> RegionConfig:
        if self.max_learners is not None and self.max_learners < self.learners:
            raise ValueError(f"region {self.name}: max_learners ({self.max_learners}) is below learners ({self.learners})")
        if self.min_learners > self.capacity:
            raise ValueError(f"region {self.name}: min_learners ({self.min_learners}) is above the {self.capacity} "
                             "learners it may have")
        return self

    @property
    def capacity(self) -> int:
        """Learners this region may ever have (max_learners, or learners when joins are off)."""
        return self.max_learners or self.learners

    @property
    def pool(self) -> str:
        return self.work_pool or f"diloco-{self.name}"


class InnerConfig(_Section):
    steps: int = Field(600, ge=1, description="inner steps per learner (the run's budget is steps x learners)")
    steps_by_speed: bool = Field(False, description="share the run's budget by region speed: slower hardware "
                                                    "takes fewer steps and nobody idles at the end")
    max_seconds: float | None = Field(None, gt=0, description="also stop after this much training time (mixed-speed runs)")
    batch_size: int = Field(8, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, gt=0)


class ParallelConfig(_Section):
    """How one learner spreads over its devices and hosts (learners/parallel.py). The devices form a
    mesh of axes (data, fsdp, tensor): fsdp shards parameters and optimizer state, tensor is for the
    model's own partition specs, data is what is left (the batch is split over data x fsdp)."""
    fsdp: int = Field(1, ge=1, description="devices each parameter is sharded over (FSDP / ZeRO-3)")
    tensor: int = Field(1, ge=1, description="tensor-parallel devices (used by partition specs that name it)")
    processes: int = Field(1, ge=1, description="hosts (JAX processes) per learner; the local backend starts this "
                                                "many, on a slice the TPU runtime says so itself")
    heartbeat_timeout_s: int = Field(10, ge=2, description="a learner's host that stops answering this long takes "
                                                           "the whole learner down (it restarts as one)")


class OuterConfig(_Section):
    """The outer optimizer, SGD on the merged delta. Default: plain averaging (lr 1, no momentum),
    which trains best at the horizons measured (docs/bench.md); DiLoCo's own is lr 0.7 with
    Nesterov momentum 0.9 (`preset: paper`)."""
    lr: float = Field(1.0, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    nesterov: bool = True
    momentum_per_round: bool = Field(False, description="a round carrying share s of a full round (with "
                                     "syncer.scale_partial_rounds) uses momentum ** s, so the trace decays per full "
                                     "round's worth of deltas however many partial rounds bring them")


class FragmentsConfig(_Section):
    count: int = Field(4, ge=1)
    sync_every: int = Field(40, ge=1, description="H: inner steps between two syncs of one fragment")
    quantization: Literal["fp32", "bf16", "int8", "int4", "int2", "topk"] = Field(
        "int4", description="encoding of each delta a learner sends (docs/wire-format.md; int4: +0.25% from int8 "
                            "over ten seeds at half its bytes, docs/bench.md); what it leaves out goes with its "
                            "next delta (error feedback: for int2 and topk, 8 of every 256 values, from a buffer "
                            "beside the parameters), so nothing is lost, some of it is sent later")
    packing: Literal["none", "zstd"] = Field(
        "zstd", description="the lossless stage over each delta's codes (diloco.packing): zstd takes about a sixth "
                            "off int4 codes and changes no bit of what the syncer decodes; none = the codes as "
                            "they are (docs/wire-format.md)")
    chunk_bytes: int = Field(256 * 1024, ge=1024, le=32 * 1024 * 1024)
    apply: Literal["rebase", "overwrite", "mix"] = Field(
        "rebase", description="a new global fragment: rebase = it plus the local steps not sent yet; "
                              "overwrite = it alone; mix = mix_alpha * it + (1 - mix_alpha) * local")
    mix_alpha: float = Field(0.5, ge=0, le=1, description="weight of the global value when apply=mix")
    wait_for_merge: bool = Field(False, description="synchronous DiLoCo: syncer.overlap_steps after sending a "
                                                    "fragment, stop until its next global version arrives")
    wait_timeout_s: float = Field(60.0, gt=0, description="give up waiting for a merge after this long "
                                                          "(a delta lost in a crash leaves its round short)")
    fetch: Literal["every_version", "before_sync"] = Field(
        "every_version", description="when a learner fetches a fragment's new global version: every_version = the "
                                     "newest announced one as soon as it is committed (one update from the snapshot, "
                                     "however many versions came between); before_sync = only prefetch_steps before "
                                     "it syncs that fragment (and while a delta of it is held or awaited): fewer "
                                     "downloads when a fragment gets several versions per sync period, but the "
                                     "learner trains the period on an older global (docs/bench.md)")
    prefetch_steps: int = Field(4, ge=1, description="with fetch=before_sync, how many inner steps before a "
                                "fragment's sync point its newest version is fetched (time for the read)")
    one_delta_per_version: bool = Field(True, description="a learner sends at most one delta of a fragment from "
                                        "each of its versions: one due again before the version it sent from has "
                                        "moved on keeps training and sends once the next version is applied (fresh, "
                                        "with more steps), so a learner ahead of the others never sends a delta that "
                                        "would arrive stale; needs apply=rebase")

    @model_validator(mode="after")
    def _held_deltas_need_rebase(self):
        if self.one_delta_per_version and self.apply != "rebase":
            raise ValueError(f"fragments.one_delta_per_version needs fragments.apply=rebase (got {self.apply!r}): "
                             "the steps held back would be thrown away when a new version is applied")
        return self


class SyncerConfig(_Section):
    quorum: int = Field(2, ge=1, description="K: contributions needed before a round may close")
    quorum_of_fresh: bool = Field(True, description="only contributions trained from the fragment's current "
                                  "version count towards K and the grace window: a late one waits for the next "
                                  "round with fresh ones (where staleness_discount weighs it) instead of closing "
                                  "a round of late deltas alone")
    overlap_steps: int = Field(8, ge=0, description="tau: inner steps of slack that overlap hides")
    grace_gamma: float = Field(0.5, ge=0)
    grace_max_s: float = Field(3.0, ge=0)
    max_staleness: int = Field(4, ge=0, description="reject deltas whose base is older than this many versions")
    max_contribution_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    incomplete_timeout_s: float = Field(60.0, gt=0, description="drop a chunk set that made no progress this long "
                                        "while its partition was read to the end (a stopped reader expires nothing)")
    incomplete_after_bytes: int | None = Field(None, ge=1, description="drop a partial chunk set once this many bytes "
                                               "of its partition were read past its last chunk; None = 4 x "
                                               "max_contribution_bytes")
    max_partial_sets: int = Field(4096, ge=1, description="partial chunk sets held at once; beyond, those without a "
                                  "manifest go first, then the least recently progressed (buffer_full)")
    status_keep: int = Field(100_000, ge=1, description="finished contribution ids remembered per partition to drop "
                             "repeats; older ones whose records replay has passed are forgotten (bounds Redis)")
    max_buffered_bytes: int = Field(1 << 30, ge=1024, description="bytes of partial chunk sets held at once (a "
                                    "bound on the syncer's memory for hostile or abandoned sets)")
    norm_outlier_factor: float = Field(0.0, ge=0, description="reject deltas this many times the round median; 0 = off")
    max_tokens_per_step: int = Field(1 << 24, ge=1, description="a contribution claiming more tokens per step than "
                                                                "this is rejected (bad_metadata): it would outweigh the rest")
    max_delta_ratio: float = Field(10.0, ge=0, description="reject a delta whose norm exceeds this many times its "
                                   "fragment's parameter norm, or sqrt(parameters) if larger (norm_budget); 0 = off")
    mean_merge_tensors: tuple[str, ...] | None = Field(
        None, description="glob patterns of tensors merged by plain mean instead of RDA; None = the model spec's")
    merge: Literal["rda", "mean"] = Field("mean", description="mean = token-weighted plain mean of every tensor "
                                          "(sync DiLoCo's math; best measured, docs/bench.md); rda = radial-"
                                          "directional averaging over learners, mean_merge_tensors excepted")
    merge_threads: int = Field(2, ge=1, description="threads one merge spreads its tensors over (the kernels "
                                                     "release the GIL)")
    token_weighting: bool = Field(True, description="weigh by tokens * tokens / steps; off = equal weights")
    tokens_per_step_spread: float = Field(1.5, ge=0, description="in a merge, a contribution's tokens per step count "
                                          "at most this many times the round's lowest (one writer's claim cannot "
                                          "take a round's weight); 0 = claims as they are")
    scale_partial_rounds: bool = Field(True, description="a round with n of M learners applies n/M of its merged delta")
    staleness_discount: float = Field(2.0, ge=0, description="weigh a contribution by (1 + staleness) ** -discount, its "
                                      "staleness being the versions its fragment gained since its base; 0 = off")
    broadcast: Literal["fp32", "bf16", "int8", "int4", "int2", "topk"] = Field(
        "int4", description="encoding of each global update learners fetch (its error is carried to the next)")
    broadcast_packing: Literal["none", "zstd"] = Field(
        "zstd", description="the lossless stage over each stored update's codes, as fragments.packing for deltas: "
                            "learners read fewer bytes and apply the same bits")
    update_base: Literal["auto", "snapshot", "previous"] = Field(
        "auto", description="what each update is encoded against: snapshot = the fragment's newest snapshot, so "
                                "one update brings a learner to any later version (its values span the versions since "
                                "the snapshot: coarser codes); previous = the version before, finer codes, one update "
                                "per version to catch up; auto = snapshot, but previous for broadcast int2 / topk, "
                                "whose code of everything since the snapshot would stay that coarse (topk: the "
                                "global could differ from the snapshot in 3% of its values)")
    flush_on_stop: bool = Field(True, description="on stop, merge every open round even below quorum")
    silent_after_s: float = Field(5.0, gt=0, description="a learner without heartbeat this long is not waited for")
    drop_after_s: float = Field(60.0, gt=0, description="a learner silent this long leaves the registry")
    poll_ms: int = Field(100, ge=1)
    shards: int = Field(1, ge=1, description="syncer instances; each owns the fragments it holds Redis leases on")
    lease_ttl_s: float = Field(3.0, gt=0, description="a shard silent this long loses its fragments to the others")
    stuck_after_s: float = Field(300.0, gt=0, description="a shard whose main loop shows no progress this long stops "
                                 "renewing its leases (renewal runs on its own thread, so long merges keep them)")

    @property
    def updates_from(self) -> Literal["snapshot", "previous"]:
        """update_base with auto resolved for the broadcast code."""
        from diloco.quantize import BELOW_4_BITS  # numpy stays out of the config's import

        if self.update_base != "auto":
            return self.update_base
        return "previous" if self.broadcast in BELOW_4_BITS else "snapshot"


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
    eval_batches: int = Field(16, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    timeout_s: float = Field(1800.0, gt=0)
    threads_per_process: int = Field(1, ge=1)
    max_restarts: int = Field(3, ge=0, description="restarts of a failed learner or syncer before the run fails")
    restart_backoff_s: float = Field(1.0, ge=0, description="first restart delay; doubles per restart of a process")
    spares: int = Field(0, ge=0, description="warm spare learner processes the local runner keeps (interpreter, JAX, "
                        "model and compiled step loaded): a learner that dies is replaced by one at once, no restart "
                        "delay, and a new spare starts behind it; 0 = restart the learner itself after the delay")
    token_budget: int | None = Field(None, ge=1, description="tokens the whole run trains into the global model: "
                                     "once the merges the syncer stored hold that many (each token counted once, "
                                     "not once per fragment; the learners' own claims do not count), the local "
                                     "runner asks every learner to stop (SIGTERM: it hands in its last deltas and "
                                     "says left, so up to a sync period more is merged); a learner still stops at its "
                                     "inner.steps if that comes first. None = off: every learner trains inner.steps, "
                                     "so learners that join add tokens")
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


_PROJECT = r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$"  # a GCP project id
_NAMESPACE = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # a Kubernetes namespace (DNS-1123 label)
_CONTEXT = r"^[^\s]+$"  # a kubeconfig context's name: any non-blank text (gke_<project>_<location>_<cluster>)


class SliceConfig(_Section):
    """One region's learner slice in production: each learner of the region gets one such TPU slice, in the
    region's own project, cluster and namespace when set (else the backend's)."""
    project: str | None = Field(None, pattern=_PROJECT, description="GCP project of this region's slices; "
                                "default backend.project")
    context: str | None = Field(None, pattern=_CONTEXT, description="kubeconfig context (cluster) of this region's "
                                "JobSets (kind gke); default backend.context")
    namespace: str | None = Field(None, pattern=_NAMESPACE, description="namespace of this region's JobSets "
                                  "(kind gke); default backend.namespace")
    generation: Literal["v5p", "v6e"] = "v5p"
    topology: str = Field("2x2x1", pattern=r"^[1-9]\d*(x[1-9]\d*){1,2}$", description="chips per axis, e.g. 2x2x1, 2x4")
    zone: str = "us-east5-a"
    runtime_version: str = Field("v2-alpha-tpuv5", description="TPU VM software (queued resources)")
    spot: bool = False

    @model_validator(mode="after")
    def _topology_fits(self) -> SliceConfig:
        dims = len(self.topology.split("x"))
        if dims != (3 if self.generation == "v5p" else 2):
            raise ValueError(f"topology {self.topology!r}: {self.generation} slices have "
                             f"{3 if self.generation == 'v5p' else 2} axes")
        return self


class BackendConfig(_Section):
    """Where the flow starts the run's processes: `local` child processes; `gke`: one TPU slice per learner (a
    JobSet in its region's cluster) and the syncer on CPU in the home cluster; `tpu-vm`: one queued-resource
    TPU VM slice per learner (gcloud), the syncer still a JobSet in the home cluster."""
    kind: Literal["local", "gke", "tpu-vm"] = "local"
    project: str = Field("my-project", pattern=_PROJECT, description="GCP project; regions may override it (slices)")
    context: str | None = Field(None, pattern=_CONTEXT, description="kubeconfig context of the home cluster (the "
                                "syncer's; regions may override it); default kubectl's current context")
    image: str = Field("us-docker.pkg.dev/my-project/diloco/diloco:latest", pattern=_IMAGE,
                       description="image with `diloco` installed (a registry reference: no spaces or shell characters)")
    namespace: str = Field("default", pattern=_NAMESPACE, description="namespace in the home cluster; regions may "
                           "override it (slices)")
    config_dir: str = Field("/etc/diloco", pattern=_ABS_PATH, description="where a job finds the run's config.yaml "
                            "(an absolute path of letters, digits and ._-/)")
    corpus_dir: str = Field("/data/corpus", pattern=_ABS_PATH, description="where a job finds the prepared corpus (e.g. "
                            "a GCS FUSE mount; an absolute path of letters, digits and ._-/)")
    secret_name: str = Field("diloco-secrets", pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$",
                             description="Kubernetes Secret in the namespace that holds the passwords: each of "
                                         "state.password_env and transport.sasl_password_env is a key of it, and a "
                                         "job's env var of that name is set from it (the value never enters a manifest)")
    slices: dict[str, SliceConfig] = Field(default_factory=dict, description="per region name: its slice and where it "
                                           "runs; regions not listed get the defaults")

    def slice_of(self, region: str) -> SliceConfig:
        """The region's slice with its project, context and namespace resolved (the backend's where unset)."""
        s = self.slices.get(region, SliceConfig())
        return s.model_copy(update={k: getattr(s, k) or getattr(self, k) for k in ("project", "context", "namespace")})


# Named starting points, `preset: NAME`: what a preset sets fills in under the YAML, the keyword
# sections and the --set overrides, which all win over it. The defaults are `decoupled`, the settings
# measured best (docs/bench.md); `paper` is the merge and outer optimizer of the Decoupled DiLoCo paper.
PRESETS: dict[str, dict[str, Any]] = {
    "decoupled": {},
    "paper": {"outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
              "fragments": {"apply": "overwrite", "one_delta_per_version": False},
              "syncer": {"merge": "rda", "scale_partial_rounds": False, "quorum_of_fresh": False,
                         "staleness_discount": 0.0}},
}


class Config(_Section):
    preset: Literal["decoupled", "paper"] = Field("decoupled", description="the settings a config starts from "
                                                  "(PRESETS): decoupled = measured best, paper = RDA with Nesterov")
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    regions: tuple[RegionConfig, ...] = (RegionConfig(name="us"), RegionConfig(name="eu"))
    inner: InnerConfig = InnerConfig()
    parallel: ParallelConfig = ParallelConfig()
    outer: OuterConfig = OuterConfig()
    fragments: FragmentsConfig = FragmentsConfig()
    syncer: SyncerConfig = SyncerConfig()
    transport: TransportConfig = TransportConfig()
    state: StateConfig = StateConfig()
    store: StoreConfig = StoreConfig()
    chaos: ChaosConfig = ChaosConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    backend: BackendConfig = BackendConfig()

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        names = [r.name for r in self.regions]
        if not names:
            raise ValueError("regions: at least one region is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"regions: names must be unique, got {names}")
        if unknown := sorted(set(self.backend.slices) - set(names)):
            raise ValueError(f"backend.slices: {unknown} are not regions of this run ({names})")
        if self.syncer.quorum > self.num_learners:
            raise ValueError(f"syncer.quorum ({self.syncer.quorum}) exceeds the number of learners ({self.num_learners})")
        if self.syncer.max_buffered_bytes < self.syncer.max_contribution_bytes:
            raise ValueError(f"syncer.max_buffered_bytes ({self.syncer.max_buffered_bytes}) is below "
                             f"syncer.max_contribution_bytes ({self.syncer.max_contribution_bytes}): one contribution "
                             "could never be held")
        joining: dict[str, int] = {}
        for i, join in enumerate(self.run.joins):
            if self.run.token_budget is None:
                raise ValueError(f"run.joins.{i}: at_tokens_fraction is a share of run.token_budget, which is not set")
            if join.region not in names:
                raise ValueError(f"run.joins.{i}: region {join.region!r} is not one of {names}")
            joining[join.region] = joining.get(join.region, 0) + join.count
        for region in self.regions:
            if region.learners + joining.get(region.name, 0) > region.capacity:
                raise ValueError(f"run.joins add {joining[region.name]} learners to region {region.name}, which starts "
                                 f"with {region.learners} and may have {region.capacity} (regions[].max_learners)")
        if self.syncer.shards > self.fragments.count:
            raise ValueError(f"syncer.shards ({self.syncer.shards}) exceeds fragments.count ({self.fragments.count}): "
                             "a shard owns whole fragments")
        m = self.monitoring
        ports = {"monitoring.syncer_port": (m.syncer_port, self.syncer.shards),
                 "monitoring.learner_port_base": (m.learner_port_base, self.num_shards)}
        for key, (first, n) in ports.items():
            if first and first + n - 1 > 65535:
                raise ValueError(f"{key}: ports {first}-{first + n - 1} (one per process) pass 65535")
        (s0, sn), (l0, ln) = ports.values()
        if s0 and l0 and s0 < l0 + ln and l0 < s0 + sn:
            raise ValueError(f"monitoring: syncer ports {s0}-{s0 + sn - 1} (one per shard) overlap learner ports "
                             f"{l0}-{l0 + ln - 1} (one per member, regions[].max_learners included)")
        if (self.backend.kind != "local" and (m.syncer_port or m.learner_port_base)
                and m.host in ("127.0.0.1", "localhost", "::1")):
            raise ValueError(f"monitoring.host is {m.host} with backend.kind {self.backend.kind}: the pods' endpoints "
                             "would answer only inside each pod; set monitoring.host: 0.0.0.0 for the cluster's scrapes")
        if self.run.spares and (why := self.spares_unsupported()):
            raise ValueError(f"run.spares ({self.run.spares}): {why}")
        return self

    def spares_unsupported(self) -> str | None:
        """Why a warm spare (`diloco learner --spare`) cannot stand in for this run's learners, or None."""
        if self.backend.kind != "local":
            return f"spares are processes of the local backend, and backend.kind is {self.backend.kind}"
        if self.model.script:
            return "a spare warms up the built-in loop, and model.script replaces it"
        if self.parallel.processes > 1:
            return f"a spare is one process, and each learner is parallel.processes={self.parallel.processes}"
        return None

    @property
    def num_learners(self) -> int:
        return sum(r.learners for r in self.regions)

    def syncer_ids(self) -> list[str]:
        """Job names of the syncer shards: `syncer` alone, `syncer-<i>` when sharded."""
        n = self.syncer.shards
        return ["syncer"] if n == 1 else [f"syncer-{i}" for i in range(n)]

    def learner_ids(self) -> list[str]:
        """The learners the run starts with, in data-shard order: `<region>-<index>`."""
        return [f"{r.name}-{i}" for r in self.regions for i in range(r.learners)]

    def member_ids(self) -> list[str]:
        """Every learner id this run may ever have, in data-shard order: the starting learners, then
        those that may join (`regions[].max_learners`), region by region. The same as learner_ids()
        when no region takes joins."""
        return list(self._members)

    @property
    def num_shards(self) -> int:
        """Data shards of the run's corpus: one per possible member, so a joining learner reads its own."""
        return sum(r.capacity for r in self.regions)

    @property
    def _members(self) -> dict[str, tuple[int, RegionConfig]]:
        """Every possible member id -> (its data shard, its region): one lookup, not a scan per call."""
        return _member_table(tuple(self.regions))

    def shard_index(self, learner_id: str) -> int:
        """The learner's data shard (its place in member_ids())."""
        try:
            return self._members[learner_id][0]
        except (KeyError, TypeError):
            raise ConfigError(self._not_a_member(learner_id)) from None

    def is_member_id(self, learner_id: str) -> bool:
        """Whether `learner_id` names a learner this run has or may admit."""
        return isinstance(learner_id, str) and learner_id in self._members

    def _not_a_member(self, learner_id: str) -> str:
        joins = {r.name: r.capacity for r in self.regions if r.capacity > r.learners}
        may = f"; ids <region>-<k> below {joins} may join" if joins else "; no region takes joins (regions[].max_learners)"
        return f"unknown learner {learner_id!r}; this run starts with {self.learner_ids()}{may}"

    def syncer_port(self, shard: int) -> int:
        """The port syncer shard `shard` serves /metrics and the status page on; 0 = none."""
        return self.monitoring.syncer_port and self.monitoring.syncer_port + shard

    def learner_port(self, learner_id: str) -> int:
        """The port the learner serves /metrics on (by its data shard); 0 = none."""
        return self.monitoring.learner_port_base and self.monitoring.learner_port_base + self.shard_index(learner_id)

    def learner_steps(self, learner_id: str) -> int:
        """Inner steps this learner takes: inner.steps, or with inner.steps_by_speed its share of the
        run's budget (inner.steps per learner) in proportion to its region's speed."""
        if not self.inner.steps_by_speed:
            return self.inner.steps
        speeds = [self.region_of(lid).speed for lid in self.learner_ids()]
        return max(1, round(self.inner.steps * len(speeds) * self.region_of(learner_id).speed / sum(speeds)))

    def region_of(self, learner_id: str) -> RegionConfig:
        """The region of member `learner_id` (`<region>-<k>`: with regions us and us-east, us-east-0 is
        us-east's, not us's)."""
        try:
            return self._members[learner_id][1]
        except (KeyError, TypeError):
            raise ConfigError(self._not_a_member(learner_id)) from None


@lru_cache(maxsize=256)
def _member_table(regions: tuple[RegionConfig, ...]) -> dict[str, tuple[int, RegionConfig]]:
    """Every member id in data-shard order (the starting learners, then those that may join, region by
    region) -> (its shard, its region): Config.member_ids, shard_index and region_of read it."""
    ids = [(f"{r.name}-{i}", r) for r in regions for i in range(r.learners)]
    ids += [(f"{r.name}-{i}", r) for r in regions for i in range(r.learners, r.capacity)]
    return {lid: (k, r) for k, (lid, r) in enumerate(ids)}


# query parameters whose values are secrets: password, pwd, token, secret, signature, credential, api/access keys
_SECRET_PARAM = re.compile(r"(^|&)([^&=]*(?:pass|pwd|token|secret|sig|credential|api_?key|access_?key)[^&=]*)=[^&]*",
                           re.IGNORECASE)


def redact_url(url: str) -> str:
    """`url` as logs and errors may show it: the password of its user info (or a user info with no
    password, which may be a token) and the values of secret-like query parameters become ***.
    A URL with none of these comes back unchanged, character for character."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, _SECRET_PARAM.sub(r"\1\2=***", parts.query)
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"***@{host}"
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return parts._replace(netloc=netloc, query=query).geturl()


def _without_credentials(url: str, instead: str) -> str:
    if redact_url(url) != url:
        raise ValueError(f"carries a credential (user info or a password/token parameter); no secret goes in a "
                         f"config: {instead}")
    return url


def resolve_secret(env_var: str | None, key: str) -> str | None:
    """A secret from the environment variable the config names: configs, logs and events never hold it."""
    if env_var is None:
        return None
    value = os.environ.get(env_var)
    if value is None:
        raise ConfigError(f"{key} names ${env_var}, which is not set in the environment")
    return value


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.0.c` in a nested dict/list tree, creating dicts on the way."""
    keys = dotted.split(".")
    node: Any = tree
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"--set {dotted}: {key!r} is not an index of a list of {len(node)}")
            key = int(key)
            if last:
                node[key] = value
            else:
                node = node[key]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[:i])} is not a section")
        if last:
            node[key] = value
        else:
            node = node.setdefault(key, {})


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. inner.steps=200")
        key, raw = pair.split("=", 1)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", key):
            raise ConfigError(f"--set {pair!r}: {key!r} is not a dotted key")
        out.append((key, yaml.safe_load(raw) if raw else None))
    return out


def build_config(tree: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Defaults, then the preset's settings, then `tree` on top (sections merge, lists replace), then
    the overrides."""
    tree, pairs = _plain(tree), parse_overrides(list(overrides))
    preset = next((v for k, v in reversed(pairs) if k == "preset"), tree.get("preset", "decoupled"))
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"config key preset: must be one of {', '.join(PRESETS)} (got {preset!r})")
    tree = _merge(_merge(Config().model_dump(mode="json"), PRESETS[preset]), tree)
    for key, value in pairs:
        _set_path(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load YAML (None = embedded defaults), apply `key=value` overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    return build_config(tree, overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def merge_sections(base: dict, top: dict) -> dict:
    """`top` over `base`, key by key inside sections (lists replace): one key given keeps the rest."""
    return _merge(base, _plain(top))


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _plain(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return tree


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "literal_error":
            msg = f"must be one of {e['ctx']['expected']}"
        msg = msg.removeprefix("Value error, ")
        if not e["loc"]:  # a cross-field check: its message names the keys
            lines.append(msg)
            continue
        inp = e.get("input")
        secret = "password" in where or "@" in str(inp)  # a user info, URL or not: not echoed
        shown = "" if isinstance(inp, (dict, list, tuple)) or secret else f" (got {redact_url(inp) if isinstance(inp, str) else inp!r})"
        lines.append(f"config key {where}: {msg}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)
