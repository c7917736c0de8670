"""`diloco simulate goodput`: the goodput simulator over schemes and cluster sizes, in parallel.

Imports only numpy, typer, rich and the pure policy module, so `diloco --help` stays fast;
matplotlib loads only when a plot is asked for.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from diloco.sim import goodput as gp

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
_C, _D = gp.Cluster(), gp.Diloco()  # option defaults come from the model's own defaults


def _split(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def run_cases(cases: list[tuple[str, gp.Cluster, gp.Diloco, int]], workers: int) -> list[gp.Result]:
    """Each case is independent and seeded by (seed, scheme, chips), so processes change nothing but time."""
    if workers <= 1 or len(cases) <= 1:
        return [gp.simulate(*case) for case in cases]
    # forkserver: forking a process that has imported JAX (as a test run has) can deadlock
    with ProcessPoolExecutor(min(workers, len(cases)), mp_context=multiprocessing.get_context("forkserver")) as pool:
        return list(pool.map(gp.simulate, *zip(*cases)))


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
    learners: Annotated[int, typer.Option(help="M: diloco learners")] = _D.learners,
    quorum: Annotated[Optional[int], typer.Option(help="K: diloco minimum quorum [default: M/2 rounded up]")] = None,
    mtbi_years: Annotated[float, typer.Option(help="mean time between interruptions of one chip")] = _C.mtbi_years,
    recovery_s: Annotated[float, typer.Option(help="until a failed slice (or its spare) serves")] = _C.recovery_s,
    reconfig_s: Annotated[float, typer.Option(help="to re-form a synchronous job on changed slices")] = _C.reconfig_s,
    checkpoint_s: Annotated[float, typer.Option(help="dp: to snapshot the state")] = _C.checkpoint_s,
    slice_chips: Annotated[int, typer.Option(help="chips one failure takes out")] = _C.slice_chips,
    step_s: Annotated[float, typer.Option(help="nominal inner step time")] = _C.step_s,
    step_time_cv: Annotated[float, typer.Option(help="per-slice step-time jitter, std/mean")] = _C.step_cv,
    sync_every: Annotated[int, typer.Option(help="diloco: inner steps between contributions")] = _D.sync_every,
    overlap_steps: Annotated[int, typer.Option(help="diloco: tau, steps the merge may take")] = _D.overlap_steps,
    grace_gamma: Annotated[float, typer.Option(help="diloco: share of the slack given to stragglers")] = _D.grace_gamma,
    grace_max_s: Annotated[float, typer.Option(help="diloco: cap on the grace window")] = _D.grace_max_s,
    sync_s: Annotated[float, typer.Option(help="diloco: round close to merged value readable")] = _D.sync_s,
    max_staleness: Annotated[int, typer.Option(help="diloco: versions a contribution may lag")] = _D.max_staleness,
    spares: Annotated[bool, typer.Option(help="diloco: a warm spare learner replaces a failed one whole")] = _D.spares,
    spare_s: Annotated[float, typer.Option(help="diloco with --spares: until the spare trains (measured locally)")] = _D.spare_s,
    hours: Annotated[float, typer.Option(help="simulated wall-clock time")] = _C.hours,
    seed: int = 0,
    workers: Annotated[int, typer.Option(help="processes for the sweep")] = os.cpu_count() or 1,
    plot: Annotated[Optional[Path], typer.Option(help="write a PNG of goodput against chips")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print rows as JSON instead of a table")] = False,
):
    """Simulate goodput under Poisson chip failures for synchronous, elastic and Decoupled-DiLoCo training.

    The diloco rounds close by diloco.syncer.policy, the code the real syncer runs. See docs/simulate.md.
    """
    err = Console(stderr=True)
    try:
        names = _split([schemes])
        if unknown := [s for s in names if s not in gp.SCHEMES]:
            raise ValueError(f"unknown scheme(s) {', '.join(unknown)}; expected {', '.join(gp.SCHEMES)}")
        sizes = [int(c.replace("_", "")) for c in _split(chips)]
        setup = gp.Diloco(learners=learners, quorum=quorum, sync_every=sync_every, overlap_steps=overlap_steps,
                          grace_gamma=grace_gamma, grace_max_s=grace_max_s, sync_s=sync_s,
                          max_staleness=max_staleness, spares=spares, spare_s=spare_s)
        clusters = [gp.Cluster(chips=n, slice_chips=slice_chips, mtbi_years=mtbi_years, recovery_s=recovery_s,
                               reconfig_s=reconfig_s, checkpoint_s=checkpoint_s, step_s=step_s,
                               step_cv=step_time_cv, hours=hours) for n in sizes]
    except ValueError as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    results = run_cases([(s, c, setup, seed) for c in clusters for s in names], workers)
    settings = (f"MTBI {mtbi_years:g} y/chip, slices of {slice_chips}, recovery {recovery_s:g} s, "
                f"reconfig {reconfig_s:g} s, step {step_s:g} s (cv {step_time_cv:g}), {hours:g} h, seed {seed}"
                + (f", diloco spares {spare_s:g} s" if spares else ""))
    if json_out:
        typer.echo(json.dumps([r.row() for r in results]))
    else:
        Console().print(_table(results, settings))
    if plot:
        _plot(results, plot, settings.split(", step")[0])
        err.print(f"plot written to {plot}")


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
    intake_mb_s: Annotated[float, typer.Option(help="contribution MB/s one syncer core takes in (measured here: 200)")] = 200.0,
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
    fitted); give your own with --intake-mb-s and --outer-ns-per-param.
    """
    from diloco.sim import capacity as cap

    try:
        layout = cap.Layout(params, fragments, sync_every, learners, quorum=quorum, regions=regions,
                            step_time_s=step_time, quantization=quantization, broadcast=broadcast,
                            packing_ratio=packing_ratio, intake_mb_s=intake_mb_s, outer_ns_per_param=outer_ns_per_param,
                            snapshot_every=snapshot_every, replicas=replicas, target_load=target_load)
    except ValueError as err:
        Console(stderr=True).print(f"[red]error:[/] {err}")
        raise typer.Exit(2) from None
    p = cap.plan(layout)
    if as_json:
        typer.echo(json.dumps(p, indent=1))
        return
    table = Table("what", "plan", title="Capacity plan", show_header=False)
    for what, value in cap.rows(p):
        table.add_row(what, value)
    Console().print(table)
