"""`diloco simulate goodput | scavenge | mixed | capacity`: the simulators, their tables and JSON.

Imports only numpy, typer, rich and the pure simulator modules, so `diloco --help` stays fast;
matplotlib loads only when a plot is asked for.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from diloco.sim import goodput as gp
from diloco.sim import scenarios as sc
from diloco.textout import labelled

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
_C, _D, _S, _X = gp.Cluster(), gp.Diloco(), sc.Scavenge(), sc.Mixed()  # option defaults: the models' own

# Options the simulate commands share: the cluster and how it fails, the learners and the syncer.
Learners = Annotated[int, typer.Option(help="M: diloco learners")]
Quorum = Annotated[Optional[int], typer.Option(help="K: diloco minimum quorum [default: M/2 rounded up]")]
MtbiYears = Annotated[float, typer.Option(help="mean time between interruptions of one chip (inf: none)")]
RecoveryS = Annotated[float, typer.Option(help="until a failed slice (or its spare) serves")]
ReconfigS = Annotated[float, typer.Option(help="to re-form a synchronous job on changed slices")]
CheckpointS = Annotated[float, typer.Option(help="dp: to snapshot the state")]
SliceChips = Annotated[int, typer.Option(help="chips one failure takes out")]
StepS = Annotated[float, typer.Option(help="nominal inner step time")]
StepCv = Annotated[float, typer.Option(help="per-slice step-time jitter, std/mean")]
SyncEvery = Annotated[int, typer.Option(help="diloco: inner steps between contributions")]
OverlapSteps = Annotated[int, typer.Option(help="diloco: tau, steps the merge may take")]
GraceGamma = Annotated[float, typer.Option(help="diloco: share of the slack given to stragglers")]
GraceMaxS = Annotated[float, typer.Option(help="diloco: cap on the grace window")]
SyncS = Annotated[float, typer.Option(help="diloco: round close to merged value readable")]
MaxStaleness = Annotated[int, typer.Option(help="diloco: versions a contribution may lag")]
Spares = Annotated[bool, typer.Option(help="diloco: a warm spare learner replaces a failed one whole")]
SpareS = Annotated[float, typer.Option(help="diloco with --spares: until the spare trains (measured locally)")]
QuorumOfFresh = Annotated[bool, typer.Option(
    help="diloco: only contributions trained from the current version count towards K and the grace window "
         "(syncer.quorum_of_fresh); a late one is merged with the next fresh ones")]
WaitForMerge = Annotated[bool, typer.Option(
    help="diloco: a learner idles if no newer version has come overlap_steps after it sent (the paper's "
         "learners); --no-wait-for-merge: it applies versions as they come and never idles (the runner's "
         "default, fragments.wait_for_merge = false)")]
HoldDeltas = Annotated[bool, typer.Option(
    help="diloco: at most one delta per version (fragments.one_delta_per_version): one due before the version "
         f"moved is held until it does, or {gp.HOLD_PERIODS} periods; only acts with --no-wait-for-merge")]
Hours = Annotated[float, typer.Option(help="simulated wall-clock time")]
Workers = Annotated[int, typer.Option(help="processes for the sweep")]
JsonOut = Annotated[bool, typer.Option("--json", help="print rows as JSON instead of a table")]


def _split(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _fail(err: Exception):
    Console(stderr=True).print(labelled("error:", err))
    raise typer.Exit(2) from None


def _learner_caption(setup: gp.Diloco) -> str:
    """The syncer and learner switches, where they differ from the defaults."""
    changed = [n for n in ("quorum_of_fresh", "wait_for_merge", "hold_deltas") if getattr(setup, n) != getattr(_D, n)]
    return "".join(f", {n.replace('_', '-')} {'on' if getattr(setup, n) else 'off'}" for n in changed)


def _cluster_caption(c: gp.Cluster) -> str:
    return (f"MTBI {c.mtbi_years:g} y/chip, slices of {c.slice_chips}, recovery {c.recovery_s:g} s, "
            f"reconfig {c.reconfig_s:g} s, step {c.step_s:g} s (cv {c.step_cv:g})")


def run_cases(cases: list[tuple], workers: int, fn=gp.simulate) -> list:
    """Each case is independent and seeded by (seed, scheme, chips), so processes change nothing but time."""
    if workers <= 1 or len(cases) <= 1:
        return [fn(*case) for case in cases]
    # forkserver: forking a process that has imported JAX (as a test run has) can deadlock
    with ProcessPoolExecutor(min(workers, len(cases)), mp_context=multiprocessing.get_context("forkserver")) as pool:
        return list(pool.map(fn, *zip(*cases)))


def _table(results: list[gp.Result], caption: str) -> Table:
    table = Table(title="Goodput: productive chip-time / total chip-time", caption=caption)
    for name in ("scheme", "chips", "M", "K", "goodput", "failures", "merges", "late"):
        table.add_column(name, justify="left" if name == "scheme" else "right")
    for r in results:
        diloco = r.scheme == "diloco"
        table.add_row(r.scheme, f"{r.chips:,}", str(r.learners), str(r.quorum), f"{100 * r.goodput:.1f}%",
                      f"{r.failures:,}", f"{r.rounds:,}" if diloco else "-", f"{r.late:,}" if diloco else "-")
    return table


def _plot(results: list[gp.Result], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for scheme in dict.fromkeys(r.scheme for r in results):
        rows = sorted((r.chips, r.goodput) for r in results if r.scheme == scheme)
        ax.plot([c for c, _ in rows], [100 * g for _, g in rows], marker="o", label=scheme)
    ax.set(xscale="log", xlabel="chips", ylabel="goodput (%)", ylim=(0, 100), title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@app.command("goodput")
def goodput(
    chips: Annotated[list[str], typer.Option(help="cluster sizes, comma-separated or repeated")] = [str(_C.chips)],
    schemes: Annotated[str, typer.Option(help="comma-separated: dp, elastic-dp, diloco")] = ",".join(gp.SCHEMES),
    learners: Learners = _D.learners,
    quorum: Quorum = None,
    mtbi_years: MtbiYears = _C.mtbi_years,
    recovery_s: RecoveryS = _C.recovery_s,
    reconfig_s: ReconfigS = _C.reconfig_s,
    checkpoint_s: CheckpointS = _C.checkpoint_s,
    slice_chips: SliceChips = _C.slice_chips,
    step_s: StepS = _C.step_s,
    step_time_cv: StepCv = _C.step_cv,
    sync_every: SyncEvery = _D.sync_every,
    overlap_steps: OverlapSteps = _D.overlap_steps,
    grace_gamma: GraceGamma = _D.grace_gamma,
    grace_max_s: GraceMaxS = _D.grace_max_s,
    sync_s: SyncS = _D.sync_s,
    max_staleness: MaxStaleness = _D.max_staleness,
    spares: Spares = _D.spares,
    spare_s: SpareS = _D.spare_s,
    quorum_of_fresh: QuorumOfFresh = _D.quorum_of_fresh,
    wait_for_merge: WaitForMerge = _D.wait_for_merge,
    hold_deltas: HoldDeltas = _D.hold_deltas,
    hours: Hours = _C.hours,
    seed: int = 0,
    workers: Workers = os.cpu_count() or 1,
    plot: Annotated[Optional[Path], typer.Option(help="write a PNG of goodput against chips")] = None,
    json_out: JsonOut = False,
):
    """Simulate goodput under Poisson chip failures for synchronous, elastic and Decoupled-DiLoCo training.

    The diloco rounds close by diloco.syncer.policy, the code the real syncer runs. See docs/simulate.md.
    """
    try:
        names = _split([schemes])
        if unknown := [s for s in names if s not in gp.SCHEMES]:
            raise ValueError(f"unknown scheme(s) {', '.join(unknown)}; expected {', '.join(gp.SCHEMES)}")
        sizes = [int(c.replace("_", "")) for c in _split(chips)]
        setup = gp.Diloco(learners=learners, quorum=quorum, sync_every=sync_every, overlap_steps=overlap_steps,
                          grace_gamma=grace_gamma, grace_max_s=grace_max_s, sync_s=sync_s,
                          max_staleness=max_staleness, spares=spares, spare_s=spare_s,
                          quorum_of_fresh=quorum_of_fresh, wait_for_merge=wait_for_merge, hold_deltas=hold_deltas)
        clusters = [gp.Cluster(chips=n, slice_chips=slice_chips, mtbi_years=mtbi_years, recovery_s=recovery_s,
                               reconfig_s=reconfig_s, checkpoint_s=checkpoint_s, step_s=step_s,
                               step_cv=step_time_cv, hours=hours) for n in sizes]
    except ValueError as e:
        _fail(e)
    results = run_cases([(s, c, setup, seed) for c in clusters for s in names], workers)
    settings = (f"{_cluster_caption(clusters[0])}, {hours:g} h, seed {seed}"
                + (f", diloco spares {spare_s:g} s" if spares else "") + _learner_caption(setup))
    if json_out:
        typer.echo(json.dumps([r.row() for r in results]))
    else:
        Console().print(_table(results, settings))
    if plot:
        _plot(results, plot, settings.split(", step")[0])
        Console(stderr=True).print(f"plot written to {plot}")


@app.command("scavenge")
def scavenge(
    extra: Annotated[list[str], typer.Option(
        help="extra compute, in % of the base chips (comma-separated or repeated); rounded to whole learners of "
             "the base size, the same chips for dp")] = ["25", "50", "100", "300"],
    share: Annotated[float, typer.Option(help="of the budget merged (dp: checkpointed) before the extra chips "
                                              "are reclaimed")] = _S.share,
    budget_hours: Annotated[float, typer.Option(help="the token budget: the base cluster's chip-time over "
                                                     "this many hours")] = _S.budget_hours,
    join_s: Annotated[float, typer.Option(help="diloco: until a joining learner trains, from the latest merged "
                                               "version (default: spare_s, measured)")] = _S.join_s,
    graceful_leave: Annotated[bool, typer.Option(help="diloco: reclaimed learners send their unsent work first; "
                                                      "otherwise it is lost")] = _S.graceful_leave,
    schemes: Annotated[str, typer.Option(help="comma-separated: dp, diloco")] = ",".join(sc.SCAVENGE_SCHEMES),
    chips: Annotated[int, typer.Option(help="the base cluster")] = _C.chips,
    learners: Learners = _D.learners,
    quorum: Quorum = None,
    mtbi_years: MtbiYears = _C.mtbi_years,
    recovery_s: RecoveryS = _C.recovery_s,
    reconfig_s: ReconfigS = _C.reconfig_s,
    checkpoint_s: CheckpointS = _C.checkpoint_s,
    slice_chips: SliceChips = _C.slice_chips,
    step_s: StepS = _C.step_s,
    step_time_cv: StepCv = _C.step_cv,
    sync_every: SyncEvery = _D.sync_every,
    overlap_steps: OverlapSteps = _D.overlap_steps,
    grace_gamma: GraceGamma = _D.grace_gamma,
    grace_max_s: GraceMaxS = _D.grace_max_s,
    sync_s: SyncS = _D.sync_s,
    max_staleness: MaxStaleness = _D.max_staleness,
    quorum_of_fresh: QuorumOfFresh = _D.quorum_of_fresh,
    wait_for_merge: WaitForMerge = _D.wait_for_merge,
    hold_deltas: HoldDeltas = _D.hold_deltas,
    seed: int = 0,
    workers: Workers = os.cpu_count() or 1,
    json_out: JsonOut = False,
):
    """Time to a token budget with scavenged compute, for data-parallel and Decoupled DiLoCo.

    The base run trains the budget (merged productive chip-time) on the base cluster. In the scavenged run,
    extra chips are there from the start and are reclaimed once --share of the budget has been merged. Each
    scheme's time is divided by its own base run's: the paper's figure (Decoupled DiLoCo, arXiv 2604.21428).
    diloco's extra chips are extra learners (K stays as configured); dp runs one bigger job, which fails and
    straggles more, and re-forms to shrink. See docs/simulate.md.
    """
    try:
        levels = [float(x.rstrip("%")) / 100 for x in _split(extra)]
        if not levels:
            raise ValueError("--extra names no level of extra compute")
        names = _split([schemes])
        if unknown := [s for s in names if s not in sc.SCAVENGE_SCHEMES]:
            raise ValueError(f"unknown scheme(s) {', '.join(unknown)}; expected {', '.join(sc.SCAVENGE_SCHEMES)}")
        setup = gp.Diloco(learners=learners, quorum=quorum, sync_every=sync_every, overlap_steps=overlap_steps,
                          grace_gamma=grace_gamma, grace_max_s=grace_max_s, sync_s=sync_s,
                          max_staleness=max_staleness, quorum_of_fresh=quorum_of_fresh,
                          wait_for_merge=wait_for_merge, hold_deltas=hold_deltas)
        cluster = gp.Cluster(chips=chips, slice_chips=slice_chips, mtbi_years=mtbi_years, recovery_s=recovery_s,
                             reconfig_s=reconfig_s, checkpoint_s=checkpoint_s, step_s=step_s, step_cv=step_time_cv)
        runs = [sc.Scavenge(extra=x, share=share, budget_hours=budget_hours, join_s=join_s,
                            graceful_leave=graceful_leave) for x in levels]
    except ValueError as e:
        _fail(e)
    rows = sc.scavenge(cluster, setup, runs, seed, names, run_all=lambda fn, cases: run_cases(cases, workers, fn))
    if json_out:
        typer.echo(json.dumps([r.row() for r in rows]))
        return
    table = Table(title="Time to a token budget with scavenged compute, over the scheme's own run without it",
                  caption=f"{chips:,} chips, {_cluster_caption(cluster)}, budget {budget_hours:g} h of the base "
                          f"cluster, extra reclaimed at {share:g} of it, join {join_s:g} s"
                          + (", graceful leave" if graceful_leave else "") + f", seed {seed}"
                          + _learner_caption(setup))
    for name in ("extra", "scheme", "extra chips", "base run", "with extra", "ratio", "ideal", "paper"):
        table.add_column(name, justify="left" if name == "scheme" else "right")
    for r in rows:
        table.add_row(f"+{100 * r.extra:g}%", r.scheme, f"{r.extra_chips:,}", f"{r.base_hours:.2f} h",
                      f"{r.hours:.2f} h", f"{r.ratio:.3f}x", f"{r.ideal:.3f}x",
                      "-" if r.paper is None else f"{r.paper:.2f}x")
    Console().print(table)


@app.command("mixed")
def mixed(
    slow_share: Annotated[float, typer.Option(help="share of the learners on the older, slower chips")] = _X.slow_share,
    slow_factor: Annotated[float, typer.Option(
        help="their step time over the newer chips' (TPU v5p against v6e: 1 to 2 by peak compute and memory "
             "bandwidth)")] = _X.slow_factor,
    chips: Annotated[int, typer.Option(help="the cluster, both generations")] = _C.chips,
    learners: Learners = _D.learners,
    mtbi_years: MtbiYears = math.inf,
    recovery_s: RecoveryS = _C.recovery_s,
    reconfig_s: ReconfigS = _C.reconfig_s,
    slice_chips: SliceChips = _C.slice_chips,
    step_s: Annotated[float, typer.Option(help="nominal inner step time on the newer chips")] = _C.step_s,
    step_time_cv: StepCv = _C.step_cv,
    sync_every: SyncEvery = _D.sync_every,
    overlap_steps: OverlapSteps = _D.overlap_steps,
    grace_gamma: GraceGamma = _D.grace_gamma,
    grace_max_s: Annotated[float, typer.Option(help="diloco: cap on the third policy's grace window")] = _D.grace_max_s,
    sync_s: SyncS = _D.sync_s,
    max_staleness: MaxStaleness = _D.max_staleness,
    quorum_of_fresh: QuorumOfFresh = _D.quorum_of_fresh,
    wait_for_merge: WaitForMerge = _D.wait_for_merge,
    hold_deltas: HoldDeltas = _D.hold_deltas,
    hours: Hours = _C.hours,
    seed: int = 0,
    json_out: JsonOut = False,
):
    """Two chip generations in one run: K = M without grace, K = 1 without grace, K = 1 with grace.

    --slow-share of the learners take --slow-factor times as long per step. Goodput counts each chip's
    steps at its own nominal time, so a slow chip that never waits is fully productive; it falls when fast
    learners idle for a merge, or when trained tokens never enter a merge (stale). No failures by default,
    as the comparison is about speed (give --mtbi-years 1 for the paper's failure rate). See docs/simulate.md.
    """
    try:
        setup = gp.Diloco(learners=learners, sync_every=sync_every, overlap_steps=overlap_steps,
                          grace_gamma=grace_gamma, grace_max_s=grace_max_s, sync_s=sync_s,
                          max_staleness=max_staleness, quorum_of_fresh=quorum_of_fresh,
                          wait_for_merge=wait_for_merge, hold_deltas=hold_deltas)
        cluster = gp.Cluster(chips=chips, slice_chips=slice_chips, mtbi_years=mtbi_years, recovery_s=recovery_s,
                             reconfig_s=reconfig_s, step_s=step_s, step_cv=step_time_cv, hours=hours)
        mix = sc.Mixed(slow_share=slow_share, slow_factor=slow_factor)
    except ValueError as e:
        _fail(e)
    rows = sc.mixed(cluster, setup, mix, seed)
    if json_out:
        typer.echo(json.dumps([r.row() for r in rows]))
        return
    slow = round(slow_share * learners)
    table = Table(title=f"Mixed hardware: {learners - slow} learners at {step_s:g} s/step, "
                        f"{slow} at {slow_factor:g}x that",
                  caption=f"{chips:,} chips, {_cluster_caption(cluster)}, {hours:g} h, seed {seed}"
                          + _learner_caption(setup))
    for name in ("policy", "goodput", "tokens merged", "late", "merges"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in rows:
        table.add_row(r.policy, f"{100 * r.goodput:.1f}%", f"{100 * r.merged_share:.1f}%",
                      f"{100 * r.late_share:.0f}%", f"{r.rounds:,}")
    Console().print(table)


@app.command("capacity")
def capacity(
    params: Annotated[float, typer.Option(help="model parameters, e.g. 10e9")],
    fragments: Annotated[int, typer.Option(min=1, help="P: fragments the model is cut into")] = 24,
    sync_every: Annotated[int, typer.Option(min=1, help="H: inner steps between two sends of a fragment")] = 24,
    learners: Annotated[int, typer.Option(min=1, help="M: learners")] = 8,
    quorum: Annotated[Optional[int], typer.Option(min=1, help="K: contributions a round closes on; default M // 2")] = None,
    regions: Annotated[int, typer.Option(min=1, help="regions: one fragments topic each")] = 2,
    step_time: Annotated[float, typer.Option(help="seconds per inner step")] = 2.0,
    quantization: Annotated[str, typer.Option(help="codec of the deltas learners send")] = "int8",
    broadcast: Annotated[str, typer.Option(help="codec of the updates learners fetch")] = "int4",
    packing_ratio: Annotated[float, typer.Option(help="share of the codes a lossless stage keeps (zstd: ~0.8-0.95)")] = 1.0,
    consumer: Annotated[str, typer.Option(help="the Kafka client the syncer reads with (syncer.consumer): "
                                          "librdkafka or kafka-python; sets the default --intake-mb-s")] = "librdkafka",
    intake_mb_s: Annotated[Optional[float], typer.Option(help="contribution MB/s one syncer core takes in; default: "
                                                         "the rate measured here for --consumer")] = None,
    outer_ns_per_param: Annotated[float, typer.Option(help="core ns per parameter of each version merged (measured here: 8)")] = 8.0,
    snapshot_every: Annotated[int, typer.Option(min=1, help="store.snapshot_every")] = 8,
    replicas: Annotated[int, typer.Option(min=1, help="broker replication factor")] = 3,
    target_load: Annotated[float, typer.Option(help="share of its core a shard is planned to keep busy")] = 0.7,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
):
    """A capacity plan: syncer shards and cores, memory per shard, Kafka partitions and bytes per
    second, retention for the replay window, store writes per hour, learner traffic.

    Each figure is arithmetic on the layout and two rates measured on this machine by
    `python -m bench load --drain` (docs/simulate.md says how each is derived and how the rates were
    fitted, for each Kafka client the syncer may read with); give your own with --intake-mb-s and
    --outer-ns-per-param.
    """
    from diloco.sim import capacity as cap

    if consumer not in cap.INTAKE_MB_S_BY_CLIENT:
        Console(stderr=True).print(labelled("error:", f"--consumer {consumer!r}: one of {', '.join(cap.INTAKE_MB_S_BY_CLIENT)}"))
        raise typer.Exit(2)
    intake_mb_s = cap.INTAKE_MB_S_BY_CLIENT[consumer] if intake_mb_s is None else intake_mb_s
    try:
        layout = cap.Layout(params, fragments, sync_every, learners, quorum=quorum, regions=regions,
                            step_time_s=step_time, quantization=quantization, broadcast=broadcast,
                            packing_ratio=packing_ratio, intake_mb_s=intake_mb_s, outer_ns_per_param=outer_ns_per_param,
                            snapshot_every=snapshot_every, replicas=replicas, target_load=target_load)
    except ValueError as err:
        Console(stderr=True).print(labelled("error:", err))
        raise typer.Exit(2) from None
    p = cap.plan(layout)
    if as_json:
        typer.echo(json.dumps(p, indent=1))
        return
    table = Table("what", "plan", title="Capacity plan", show_header=False)
    for what, value in cap.rows(p):
        table.add_row(what, value)
    Console().print(table)
