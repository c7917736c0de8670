"""The top-level Config (its sections, cross-section checks and member ids) and the PRESETS it starts from."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, model_validator

from diloco.config.backend import BackendConfig
from diloco.config.secrets import resolve_secret
from diloco.config.sections import (ConfigError, DataConfig, FragmentsConfig, InnerConfig, ModelConfig, OuterConfig,
                                    ParallelConfig, RegionConfig, SyncerConfig, _Section)
from diloco.config.services import (ChaosConfig, MonitoringConfig, RunConfig, StateConfig, StoreConfig,
                                    TransportConfig)


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

    def with_corpus(self, prepared) -> Config:
        """This config reading the prepared corpus at `prepared` (data.prepared): the one a run prepared,
        or a directory given on a command line or in the environment."""
        return self.model_copy(update={"data": self.data.model_copy(update={"prepared": str(prepared)})})

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
            raise ConfigError(self.not_a_member(learner_id)) from None

    def is_member_id(self, learner_id: str) -> bool:
        """Whether `learner_id` names a learner this run has or may admit."""
        return isinstance(learner_id, str) and learner_id in self._members

    def not_a_member(self, learner_id: str) -> str:
        """Why `learner_id` is refused: not one of this run's ids, and which ids may join."""
        joins = {r.name: r.capacity for r in self.regions if r.capacity > r.learners}
        may = f"; ids <region>-<k> below {joins} may join" if joins else "; no region takes joins (regions[].max_learners)"
        return f"unknown learner {learner_id!r}; this run starts with {self.learner_ids()}{may}"

    def syncer_port(self, shard: int) -> int:
        """The port syncer shard `shard` serves /metrics and the status page on; 0 = none."""
        return self.monitoring.syncer_port and self.monitoring.syncer_port + shard

    def learner_port(self, learner_id: str) -> int:
        """The port the learner serves /metrics on (by its data shard); 0 = none."""
        return self.monitoring.learner_port_base and self.monitoring.learner_port_base + self.shard_index(learner_id)

    def keys_dir(self, run_id: str | None = None) -> str:
        """Where learners read their signing keys (run.keys_dir, default <run.dir>/<run id>/keys)."""
        return self.run.keys_dir or f"{self.run.dir}/{run_id or self.run.id}/keys"

    def signing_secret(self) -> bytes | None:
        """The run's signing secret from the env var run.signing_secret_env names; None when unset."""
        value = resolve_secret(self.run.signing_secret_env, "run.signing_secret_env")
        return None if value is None else value.encode()

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
            raise ConfigError(self.not_a_member(learner_id)) from None


@lru_cache(maxsize=256)
def _member_table(regions: tuple[RegionConfig, ...]) -> dict[str, tuple[int, RegionConfig]]:
    """Every member id in data-shard order (the starting learners, then those that may join, region by
    region) -> (its shard, its region): Config.member_ids, shard_index and region_of read it."""
    ids = [(f"{r.name}-{i}", r) for r in regions for i in range(r.learners)]
    ids += [(f"{r.name}-{i}", r) for r in regions for i in range(r.learners, r.capacity)]
    return {lid: (k, r) for k, (lid, r) in enumerate(ids)}
