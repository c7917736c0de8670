"""The config's base pieces and its training sections: ConfigError, the shared section base, the id,
env and path patterns, and the sections of the model, data, regions, inner and outer optimizers,
parallelism, fragments and the syncer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
    separator: int | None = Field(None, ge=0, description="the token id that joins documents in the prepared shards "
                                  "(the manifest's `separator`); None = the tokenizer's end-of-document token, and 0 "
                                  "(NUL) for bytes, which many models (Gemma's among them) treat as padding: set 256 "
                                  "with a model of vocab_size 257, or an id your model reads as a document end. A "
                                  "document's own tokens equal to it are dropped (counted)")
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
    quantization: Literal["fp32", "bf16", "int8", "int4", "int2", "ternary", "topk"] = Field(
        "int4", description="encoding of each delta a learner sends (docs/wire-format.md; int4: +0.25% from int8 "
                            "over ten seeds at half its bytes, docs/bench.md); what it leaves out goes with its "
                            "next delta (error feedback: for int2, ternary and topk, 8 of every 256 values, from a buffer "
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
    anchor: Literal["host", "device"] = Field(
        "host", description="where a learner keeps each synced tensor's anchor (the global it trains from, less "
                            "what it sent since: every delta is taken against it): host = on the host, as the "
                            "fetched version's base (the fetcher's snapshot, shared) and codes where the learner "
                            "holds whole tensors in one process, else as values in the host memory of the leaf's "
                            "devices (pinned where the backend has it; each host its own shards); brought to the "
                            "devices one fragment at a time when it syncs or applies; device = beside the "
                            "parameters, a whole extra copy of the model on the accelerators (docs/operations.md, "
                            "'What a learner costs')")
    anchor_dtype: Literal["float32", "param"] = Field(
        "float32", description="the anchor's dtype: float32, or the parameter's own (half the bytes for bf16 "
                               "parameters; the anchor then rounds to that dtype after each sync)")
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
    broadcast: Literal["fp32", "bf16", "int8", "int4", "int2", "ternary", "topk"] = Field(
        "int4", description="encoding of each global update learners fetch (its error is carried to the next)")
    broadcast_packing: Literal["none", "zstd"] = Field(
        "zstd", description="the lossless stage over each stored update's codes, as fragments.packing for deltas: "
                            "learners read fewer bytes and apply the same bits")
    update_base: Literal["auto", "snapshot", "previous"] = Field(
        "auto", description="what each update is encoded against: snapshot = the fragment's newest snapshot, so "
                                "one update brings a learner to any later version (its values span the versions since "
                                "the snapshot: coarser codes); previous = the version before, finer codes, one update "
                                "per version to catch up; auto = snapshot, but previous for broadcast int2 / ternary / topk, "
                                "whose code of everything since the snapshot would stay that coarse (topk: the "
                                "global could differ from the snapshot in 3% of its values)")
    flush_on_stop: bool = Field(True, description="on stop, merge every open round even below quorum")
    drain_timeout_s: float = Field(120.0, gt=0, description="on stop, how long a shard keeps reading to catch up "
                                   "with what learners handed in before it gives up, saying what it left unread")
    silent_after_s: float = Field(5.0, gt=0, description="a learner without heartbeat this long is not waited for")
    drop_after_s: float = Field(60.0, gt=0, description="a learner silent this long leaves the registry")
    poll_ms: int = Field(100, ge=1)
    consumer: Literal["librdkafka", "kafka-python"] = Field(
        "librdkafka", description="the Kafka client a shard reads contributions with: librdkafka (confluent-kafka) "
        "parses records in C and takes in about 2.3x as much per core as kafka-python (docs/bench.md)")
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
