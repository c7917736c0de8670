"""A capacity plan for a run (`diloco simulate capacity`): syncer shards and cores, memory, Kafka,
retention, store and learner traffic, from the run's shape and a few measured per-core rates.

Every figure is arithmetic on the layout (docs/simulate.md says how each is derived):

- each of M learners sends every one of P fragments once per H steps of `step_time_s` (fragments
  staggered across the period), so contributions arrive at M P / (H t) per second, each one
  fragment of int8 (or `quantization`) codes: the syncer's intake;
- a round closes on K contributions, so each fragment gains M / (K H t) versions per second;
- a syncer core spends `intake_mb_s`-worth of time per byte taken in (the Kafka client, chunk
  assembly, checksums, decoding into the accumulator) and `outer_ns_per_param` per parameter of
  every version it merges (the outer step, encoding the update, writing it, a share of the
  snapshot): both measured on this machine (`python -m bench load --drain`, docs/bench.md);
- a shard is one process on one core that owns whole fragments: it gets as many as keep its core
  at most `target_load` busy (slack to catch up after an outage), and a fragment that alone needs
  more than that says how many fragments the model should be cut into instead;
- a shard keeps per owned fragment the parameters, the outer optimizer's state, the snapshot the
  updates are encoded against, the broadcast residual and the round's accumulator in fp32, plus the
  open round's K encoded contributions and up to `syncer.max_buffered_bytes` of partial chunk sets;
- a learner sends each fragment once per period and fetches each new version of it (the default
  `fragments.fetch: every_version`, each update from the snapshot): one to M / K updates per period,
  as a period's contributions close one round or M / K of them. The traffic figures take the most,
  and the ratio to data-parallel (counted as the run summary counts it) is given for both ends.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from diloco import quantize

ROW = 1024   # the codes' row length the per-parameter size is taken at (scales are per row)


def dp_allreduce_bytes(num_params: float, workers: int, steps: int, bytes_per_value: int = 4) -> int:
    """Bytes all workers together send for `steps` ring all-reduces of fp32 gradients: what the run
    summary and the plan compare against.

    Per step each of M workers sends 2 (M - 1) / M of the gradient (reduce-scatter + all-gather);
    `steps` counts every learner's steps, i.e. the same tokens a data-parallel job would process.
    """
    if workers < 2:
        return 0
    return int(steps * 2 * (workers - 1) / workers * num_params * bytes_per_value)


def bytes_per_param(scheme: str, packing_ratio: float = 1.0) -> float:
    """Encoded bytes per parameter of a codec on rows of ROW values, after a lossless stage that keeps
    `packing_ratio` of them (1.0: none; zstd kept 0.80-0.95 of int4 codes in the bench)."""
    return quantize.encoded_nbytes((ROW, ROW), scheme) / (ROW * ROW) * packing_ratio


# Per-core rates of the syncer measured on this machine (docs/simulate.md): contribution bytes taken
# in per second, by the Kafka client a shard reads with (`syncer.consumer`; fitted to `python -m
# bench load --drain` rows, whose rounds merge many contributions each), and core time per parameter
# of each version merged (a 50M-parameter merge with its outer step, update encoding, write and
# share of the snapshot: about 0.4 s, docs/bench.md).
INTAKE_MB_S_BY_CLIENT = {"librdkafka": 450.0, "kafka-python": 200.0}
INTAKE_MB_S = INTAKE_MB_S_BY_CLIENT["librdkafka"]  # the default client's
OUTER_NS_PER_PARAM = 8.0


def syncer_core_seconds(contribution_bytes: float, versions: float, params_per_fragment: float, *,
                        intake_mb_s: float = INTAKE_MB_S, outer_ns_per_param: float = OUTER_NS_PER_PARAM) -> float:
    """Core-seconds a syncer spends taking in `contribution_bytes` and merging `versions` versions of
    fragments of `params_per_fragment` parameters: the model every figure of the plan rests on."""
    return contribution_bytes / (intake_mb_s * 1e6) + versions * params_per_fragment * outer_ns_per_param * 1e-9


@dataclass(frozen=True)
class Layout:
    params: float                 # model parameters
    fragments: int                # P
    sync_every: int               # H: steps between two sends of one fragment
    learners: int                 # M
    quorum: int | None = None     # K: contributions a round closes on; None = max(1, M // 2)
    regions: int = 2
    step_time_s: float = 2.0
    quantization: str = "int8"    # deltas up
    broadcast: str = "int4"       # updates down
    packing_ratio: float = 1.0    # share of the codes a lossless stage keeps (both ways)
    intake_mb_s: float = INTAKE_MB_S  # contribution MB a syncer core takes in per second (intake alone)
    outer_ns_per_param: float = OUTER_NS_PER_PARAM  # core nanoseconds per parameter of each version merged
    target_load: float = 0.7      # the share of its core a shard is planned to keep busy (slack to catch up)
    optimizer_floats: int = 1     # fp32 values of outer-optimizer state per parameter (Nesterov: momentum)
    snapshot_every: int = 8       # versions between full snapshots (store.snapshot_every)
    replicas: int = 3             # broker replication factor (retention is stored this many times)
    buffered_bytes: float = float(1 << 30)  # syncer.max_buffered_bytes of partial chunk sets per shard

    def __post_init__(self):
        for name in ("params", "fragments", "sync_every", "learners", "regions", "step_time_s", "intake_mb_s",
                     "snapshot_every", "replicas"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.quorum is not None and not 1 <= self.quorum <= self.learners:
            raise ValueError(f"quorum must be in 1..learners ({self.learners}), got {self.quorum}")
        for scheme in (self.quantization, self.broadcast):
            if scheme not in quantize.SCHEMES:
                raise ValueError(f"unknown codec {scheme!r}; known: {quantize.SCHEMES}")
        if not 0 < self.target_load <= 1:
            raise ValueError(f"target load must be in (0, 1], got {self.target_load}")
        if not 0 < self.packing_ratio <= 1:
            raise ValueError(f"packing ratio must be in (0, 1], got {self.packing_ratio}")

    @property
    def k(self) -> int:
        return self.quorum if self.quorum is not None else max(1, self.learners // 2)


def plan(x: Layout) -> dict:
    """The capacity plan of a layout: every figure in plain units (bytes, per second, cores)."""
    P, H, M, K, t = x.fragments, x.sync_every, x.learners, x.k, x.step_time_s
    frag = x.params / P
    up = frag * bytes_per_param(x.quantization, x.packing_ratio)          # one contribution
    down = frag * bytes_per_param(x.broadcast, x.packing_ratio)           # one stored update
    contributions_s = M * P / (H * t)
    intake = contributions_s * up
    versions_s = M / (K * H * t)                                          # per fragment
    core_s_per_fragment = syncer_core_seconds(intake / P, versions_s, frag, intake_mb_s=x.intake_mb_s,
                                              outer_ns_per_param=x.outer_ns_per_param)   # per second
    cores = core_s_per_fragment * P
    fits = core_s_per_fragment <= x.target_load
    per_shard = max(1, math.floor(x.target_load / core_s_per_fragment)) if fits else 1
    shards = math.ceil(P / min(per_shard, P))
    per_shard = math.ceil(P / shards)
    state_bytes = frag * 4 * (1 + x.optimizer_floats + 1 + 1 + 1)         # params, optimizer, snapshot, residual, sum
    snapshot_bytes = frag * 4 * (1 + x.optimizer_floats + 1)              # params, optimizer state, residual
    snapshot_span_s = x.snapshot_every / versions_s                       # a rebuild replays this far back
    retention = intake * snapshot_span_s * 2                              # two snapshot spans: a margin for one missed
    dp_per_step = dp_allreduce_bytes(x.params, M, 1)                      # one learner's share of a step's all-reduce
    fetches = max(1.0, M / K)                                             # updates of a fragment per period, at most
    learner_up = P * up                                                   # per period
    return {
        "layout": asdict(x) | {"quorum": K},
        "fragment_params": frag,
        "contribution_bytes": up, "update_bytes": down,
        "contributions_per_s": contributions_s,
        "intake_bytes_per_s": intake,
        "intake_bytes_per_s_per_fragment": intake / P,
        "versions_per_s_per_fragment": versions_s,
        "syncer_cores": cores, "core_load_per_fragment": core_s_per_fragment,
        "shards": shards, "fragments_per_shard": per_shard,
        "shard_core_load": core_s_per_fragment * per_shard,
        "fragment_fits_a_shard": fits,
        # the load per fragment falls as 1 / P (both its intake and its parameters): the P that fits
        "fragments_needed": P if fits else math.ceil(P * core_s_per_fragment / x.target_load),
        "shard_memory_bytes": per_shard * (state_bytes + K * up) + x.buffered_bytes,
        "kafka": {"topics": x.regions, "partitions_per_topic": P,
                  "bytes_per_s_per_topic": intake / x.regions,
                  "bytes_per_s_per_partition": intake / (x.regions * P)},
        "retention_bytes": retention, "retention_bytes_replicated": retention * x.replicas,
        "retention_s": 2 * snapshot_span_s,
        "store_bytes_per_hour": 3600 * versions_s * P * (down + snapshot_bytes / x.snapshot_every),
        "learner_download_per_version": down,
        "learner_fetches_per_period": {"fewest": 1.0, "most": fetches},
        "learner_bytes_per_s": {"up": learner_up / (H * t), "down": fetches * P * down / (H * t)},
        "bytes_ratio_vs_dp": dp_per_step * H / (learner_up + fetches * P * down),
        "bytes_ratio_vs_dp_one_fetch": dp_per_step * H / (learner_up + P * down),
    }


def _si(n: float, unit: str = "B") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {prefix}{unit}"
    return f"{n:,.2f} {unit}"


def rows(p: dict) -> list[tuple[str, str]]:
    """The plan as (what, value) rows for a table."""
    x = p["layout"]
    k = p["kafka"]
    fits = ("" if p["fragment_fits_a_shard"] else
            f"  (one fragment needs {p['core_load_per_fragment']:.2f} of a core, over the target "
            f"{x['target_load']}: use >= {p['fragments_needed']} fragments)")
    return [
        ("layout", f"{x['params']:,.3g} params, P={x['fragments']}, H={x['sync_every']}, M={x['learners']}, "
                   f"K={x['quorum']}, {x['step_time_s']} s/step, {x['quantization']} up / {x['broadcast']} down"),
        ("fragment", f"{p['fragment_params']:,.0f} params; contribution {_si(p['contribution_bytes'])}, "
                     f"update {_si(p['update_bytes'])}"),
        ("syncer intake", f"{_si(p['intake_bytes_per_s'])}/s ({p['contributions_per_s']:.2f} contributions/s; "
                          f"{_si(p['intake_bytes_per_s_per_fragment'])}/s per fragment)"),
        ("versions", f"{p['versions_per_s_per_fragment']:.4f}/s per fragment "
                     f"({3600 * p['versions_per_s_per_fragment']:,.0f}/h)"),
        ("syncer cores", f"{p['syncer_cores']:.2f} ({p['core_load_per_fragment']:.3f} per fragment){fits}"),
        ("syncer shards", f"{p['shards']} x {p['fragments_per_shard']} fragments, "
                          f"each {p['shard_core_load']:.2f} of a core busy"),
        ("memory per shard", _si(p["shard_memory_bytes"])),
        ("Kafka", f"{k['topics']} topics x {k['partitions_per_topic']} partitions; "
                  f"{_si(k['bytes_per_s_per_topic'])}/s per topic, {_si(k['bytes_per_s_per_partition'])}/s per partition"),
        ("retention (replay window)", f"{_si(p['retention_bytes'])} over {p['retention_s'] / 3600:,.2f} h "
                                      f"({_si(p['retention_bytes_replicated'])} with {x['replicas']} replicas)"),
        ("store writes", f"{_si(p['store_bytes_per_hour'])}/h (updates + a snapshot every {x['snapshot_every']})"),
        ("learner traffic", f"up {_si(p['learner_bytes_per_s']['up'])}/s, down up to {_si(p['learner_bytes_per_s']['down'])}/s "
                            f"({_si(p['learner_download_per_version'])} per version, "
                            f"{p['learner_fetches_per_period']['most']:g} versions per period at most)"),
        ("vs data-parallel", f"{p['bytes_ratio_vs_dp']:,.0f}x-{p['bytes_ratio_vs_dp_one_fetch']:,.0f}x fewer bytes per "
                             "learner than an fp32 ring all-reduce every step (fetching M/K versions a period; one)"),
    ]
