"""`diloco topics` and `diloco ckpt ...`: thin rendering of diloco.ops.topics and diloco.ops.ckpt.

Heavy imports (kafka, tensorstore, numpy) happen inside the commands so `diloco --help` stays fast.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

err_console = Console(stderr=True)
# In a pipe or a file there is no terminal width to fit: tables print whole values (as wide as they
# need) instead of cutting every column to 80 characters; --json is the form for scripts.
out = Console() if sys.stdout.isatty() else Console(width=100_000)

ckpt_app = typer.Typer(help="Inspect the fragment versions a run wrote to TensorStore (file:// or gs://).",
                       no_args_is_help=True)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config, e.g. .diloco/runs/RUN/config.yaml")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a config key, e.g. --set state.redis_url=...")]
RunOpt = Annotated[Optional[str], typer.Option("--run", help="run id; default: the config's run.id, else the newest "
                                                             "run under run.dir")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print plain JSON instead of tables")]
UrlArg = Annotated[Optional[str], typer.Argument(help="STORE_URL/RUN_ID, e.g. file:///data/store/RUN or "
                                                      "gs://bucket/path/RUN; omitted = the config's store.url + run")]
LsUrlArg = Annotated[Optional[str], typer.Argument(help="STORE_URL/RUN_ID for one run's versions, or STORE_URL (a store "
                                                        "root, the config's store.url) to list its runs; omitted = "
                                                        "the config's store.url + run")]
NOT_COMMITTED = "not committed: an orphan a crashed or fenced syncer wrote, never announced; the next merge overwrites it"
FragmentOpt = Annotated[Optional[int], typer.Option("--fragment", "-p", min=0, help="only this fragment")]


def _fail(msg: str, code: int = 1):
    err_console.print(f"[red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)  # a name may hold [..]
    raise typer.Exit(code)


def _run_config(config: Optional[Path], overrides: Optional[list[str]], run: Optional[str]):
    """(config, run id). Without --config, a named or newest run's own config.yaml is used when present,
    since its regions and fragment count decide the topic names."""
    from diloco.config import ConfigError, load_config
    from diloco.ops import OpsError, latest_run

    try:
        cfg = load_config(config, overrides or [])
        run = run or cfg.run.id or latest_run(cfg.run.dir)
        own = Path(cfg.run.dir) / run / "config.yaml"
        if config is None and own.is_file():
            cfg = load_config(own, overrides or [])
    except ConfigError as err:
        _fail(str(err), 2)
    except OpsError as err:
        _fail(str(err))
    return cfg, run


def _dump(obj) -> None:
    print(json.dumps(obj, indent=1))


def _num(x, fmt: str = ",") -> str:
    return "-" if x is None else format(x, fmt)


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000


def _when(t) -> str:
    return "-" if t is None else dt.datetime.fromtimestamp(t).strftime("%m-%d %H:%M:%S")


# --- topics -----------------------------------------------------------------------------------------

def topics_tables(rep: dict) -> list[Table]:
    t = Table(title=f"topics of run {rep['run']} (<prefix>.{rep['run']}.*)"
                    + ("" if rep["caught_up"] else "  (still reading)"),
              title_justify="left")
    for col in ("topic", "part", "high wm", "syncer at", "lag", "msgs", "bytes", "msg/s", "B/s", "newest"):
        t.add_column(col, justify="left" if col == "topic" else "right")
    for row in rep["topics"]:
        for i, p in enumerate(row["by_partition"]):
            t.add_row(row["topic"].rsplit(f".{rep['run']}.", 1)[-1] if i == 0 else "", str(p["partition"]), _num(p["high_watermark"]),
                      _num(p["committed"]), _num(p["lag"]), _num(p["messages"]), _bytes(p["bytes"]),
                      _num(p["messages_per_s"], ",.1f"), _bytes(p["bytes_per_s"]),
                      "-" if p["newest_age_s"] is None else f"{p['newest_age_s']:.0f}s ago",
                      end_section=i == row["partitions"] - 1)
    announced = " ".join(f"p{p}:v{v}" for p, v in rep["announced"].items()) or "none"
    kinds = next(r["records_by_kind"] for r in rep["topics"] if r["kind"] == "events")
    t.caption = (f"announced {announced} | events: " + ", ".join(f"{k} {v}" for k, v in kinds.items())
                 + (f" | rates over {rep['interval_s']:.1f}s" if rep["interval_s"] else ""))
    learners = Table(title="fragment traffic by learner", title_justify="left")
    for col in ("region", "learner", "contributions", "frames", "bytes", "payload", "B/s", "per fragment"):
        learners.add_column(col, justify="left" if col in ("region", "learner", "per fragment") else "right")
    for row in rep["topics"]:
        for lid, s in row.get("learners", {}).items():
            learners.add_row(row["region"], lid, _num(s["contributions"]), _num(s["frames"]), _bytes(s["bytes"]),
                             _bytes(s["payload_bytes"]), _bytes(s["bytes_per_s"]),
                             " ".join(f"p{p}:{n}" for p, n in sorted(s["fragments"].items(), key=lambda x: int(x[0]))))
    return [t, learners]


def topics(config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None,
           watch: Annotated[Optional[float], typer.Option(min=0.1, help="refresh a live table every this many "
                                                                         "seconds (with --json: a JSON line each time)")] = None,
           interval: Annotated[float, typer.Option(min=0, help="without --watch: seconds between the two samples "
                                                               "that rates come from")] = 1.0,
           timeout_s: Annotated[float, typer.Option(help="give up reading to the high watermarks after this long")] = 60.0,
           json_: JsonOpt = False):
    """Every topic of a run: high watermark, syncer position and lag, rates, newest message, traffic by learner.

    Reads the topics from the start of retention (every frame is parsed for the by-learner figures),
    and the syncer's replay offsets from Redis.
    """
    from diloco.config import ConfigError
    from diloco.infra.kafka import TransportError
    from diloco.ops import OpsError
    from diloco.ops import topics as ops_topics
    from diloco.syncer import state as state_mod

    cfg, run_id = _run_config(config, set_, run)
    monitor = None
    try:
        state = state_mod.SyncerState(state_mod.connect(cfg.state, timeout_s=5), cfg.state.key_prefix, run_id)
        monitor = ops_topics.TopicMonitor(cfg, run_id)

        def snapshot(prev):
            cur = monitor.sample(timeout_s)
            committed = state.committed(monitor.topics.events)  # the syncer's replay offsets
            return cur, ops_topics.report(monitor.topics, prev, cur, committed)

        prev, _ = snapshot(None)
        if watch is None:
            time.sleep(interval)
            _, rep = snapshot(prev)
            if json_:
                return _dump(rep)
            return out.print(*topics_tables(rep))
        if json_:
            while True:
                time.sleep(watch)
                prev, rep = snapshot(prev)
                print(json.dumps(rep), flush=True)
        with Live(console=out, auto_refresh=False) as live:
            while True:
                time.sleep(watch)
                prev, rep = snapshot(prev)
                live.update(Group(*topics_tables(rep)), refresh=True)
    except KeyboardInterrupt:
        pass
    except (OpsError, TransportError, state_mod.StateError, ConfigError) as err:
        _fail(str(err))
    finally:
        if monitor is not None:
            monitor.close()


# --- ckpt -------------------------------------------------------------------------------------------

def _checkpoint(url: Optional[str], config: Optional[Path], overrides: Optional[list[str]], run: Optional[str],
                *, roots: bool = False):
    """The run's Checkpoint; with `roots`, a URL may also name a store root (a StoreRoot comes back)."""
    from diloco.ops import OpsError
    from diloco.ops.ckpt import open_checkpoint, open_url

    if url is None:
        cfg, run_id = _run_config(config, overrides, run)
        url = f"{cfg.store.url.rstrip('/')}/{run_id}"
    elif config is not None or run is not None:
        _fail("give either a checkpoint URL or --config/--run, not both", 2)
    try:
        return open_url(url) if roots else open_checkpoint(url)
    except OpsError as err:
        _fail(str(err))


def _ops(fn, *args):
    from diloco.ops import OpsError

    try:
        return fn(*args)
    except OpsError as err:
        _fail(str(err))


def _runs_table(rep: dict) -> Table:
    t = Table(title=f"runs in {rep['url']}", title_justify="left")
    t.add_column("run", no_wrap=True)
    for col in ("fragments", "tensors", "parameters", "dtype", "latest"):
        t.add_column(col, justify="right" if col in ("fragments", "tensors", "parameters") else "left")
    for r in rep["runs"]:
        t.add_row(r["run"] + (" *" if r["note"] else ""), _num(r["fragments"]), _num(r["tensors"]),
                  _num(r["parameters"]), " ".join(r["dtypes"]) or "-",
                  " ".join(f"p{p}:" + ("-" if v is None else f"v{v}") for p, v in r["latest"].items()) or "-")
    t.caption = " | ".join(f"* {r['run']}: {r['note']}" for r in rep["runs"] if r["note"]) or None
    return t


@ckpt_app.command("ls")
def ckpt_ls(url: LsUrlArg = None, config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None,
            json_: JsonOpt = False):
    """Every fragment with its versions: write time, tokens merged, contributors, why the round closed.

    Given a store root (STORE_URL without a run id), one row per run instead: fragments, tensors,
    parameters and dtypes from its plan.json, and each fragment's newest version.
    """
    from diloco.ops import ckpt

    ck = _checkpoint(url, config, set_, run, roots=True)
    if isinstance(ck, ckpt.StoreRoot):
        rep = _ops(ckpt.runs, ck)
        return _dump(rep) if json_ else out.print(_runs_table(rep))
    rep = _ops(ckpt.ls, ck)
    if json_:
        return _dump(rep)
    t = Table(title=f"checkpoint {rep['url']}", title_justify="left")
    for col in ("fragment", "version", "written", "tokens", "contributors", "reason"):
        t.add_column(col, justify="right" if col in ("fragment", "version", "tokens") else "left")
    for f in rep["fragments"]:
        for i, v in enumerate(f["versions"]):
            t.add_row(str(f["fragment"]) if i == 0 else "", str(v["version"]) + ("" if v["committed"] else " *"),
                      _when(v["time"]), _num(v["tokens"]),
                      " ".join(v["contributors"]) or "-", v["reason"] or "-",
                      end_section=i == len(f["versions"]) - 1)
    t.caption = "committed " + " ".join(f"p{f['fragment']}:v{f['latest']}" for f in rep["fragments"]) + "".join(
        f" | p{f['fragment']} incomplete (no meta.json): {f['incomplete']}" for f in rep["fragments"] if f["incomplete"])
    if any(not v["committed"] for f in rep["fragments"] for v in f["versions"]):
        t.caption += f" | * {NOT_COMMITTED}"

    out.print(t)


def _stats_table(title: str, tensors: dict) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("tensor", no_wrap=True, min_width=min(40, max(map(len, tensors), default=6)))
    for col in ("shape", "dtype", "norm", "min", "max", "mean", "non-finite"):
        t.add_column(col, justify="left" if col in ("shape", "dtype") else "right")
    for name, s in tensors.items():
        t.add_row(name, "x".join(map(str, s["shape"])) or "()", s["dtype"], _num(s["norm"], ".4g"),
                  _num(s["min"], ".4g"), _num(s["max"], ".4g"), _num(s["mean"], ".4g"),
                  f"[red]{s['nonfinite']}[/]" if s["nonfinite"] else "0")
    return t


@ckpt_app.command("show")
def ckpt_show(url: UrlArg = None,
              version: Annotated[Optional[int], typer.Option(min=0, help="version; default: each fragment's newest. "
                                                                         "Without --fragment, each fragment's newest <= V")] = None,
              fragment: FragmentOpt = None, config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None,
              json_: JsonOpt = False):
    """Tensors of a version with shape, dtype, norm, min/max/mean, non-finite count, the outer-optimizer state
    and the residual (quantization error of the published update, carried into the next one)."""
    from diloco.ops import ckpt

    rep = _ops(ckpt.show, _checkpoint(url, config, set_, run), version, fragment)
    if json_:
        return _dump(rep)
    for f in rep["fragments"]:
        head = (f"fragment {f['fragment']} v{f['version']}: {f['tokens']:,} tokens from "
                f"{' '.join(f['contributors']) or 'nobody'} ({f['reason']}, {_when(f['time'])})"
                + (f"; learners fetch it as a {f['update']} update" if f.get("update") else "")
                + ("" if f["snapshot"] else f"; not a snapshot: parameters from v{f['snapshot_at']} "
                                                      "plus the updates since, no outer state stored")
                + ("" if f["committed"] else f"; [red]{NOT_COMMITTED}[/]"))
        out.print(_stats_table(head, {**{f"params/{n}": s for n, s in f["params"].items()},
                                      **{f"opt/{n}": s for n, s in f["opt"].items()},
                                      **{f"residual/{n}": s for n, s in f.get("residual", {}).items()}}))


@ckpt_app.command("diff")
def ckpt_diff(args: Annotated[list[str], typer.Argument(metavar="[URL] V1 V2", help="checkpoint URL (omitted = "
                                                                                    "config + run), then two versions")],
              fragment: FragmentOpt = None, config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None,
              json_: JsonOpt = False):
    """Per-tensor change norm and relative change between two versions."""
    from diloco.ops import ckpt

    if len(args) not in (2, 3) or not all(a.isdigit() for a in args[-2:]):
        _fail(f"expected [URL] V1 V2 with two version numbers, got {' '.join(args)}", 2)
    url = args[0] if len(args) == 3 else None
    rep = _ops(ckpt.diff, _checkpoint(url, config, set_, run), int(args[-2]), int(args[-1]), fragment)
    if json_:
        return _dump(rep)
    for f in rep["fragments"]:
        orphans = [f[end] for end in ("from", "to") if not f["committed"][end]]
        t = Table(title=f"fragment {f['fragment']} v{f['from']} -> v{f['to']}: parameters moved "
                        f"{_num(f['params_change_norm'], '.4g')} ({_num(f['params_relative'], '.2%')})"
                        + (f"; v{' and v'.join(map(str, orphans))}: [red]{NOT_COMMITTED}[/]" if orphans else ""),
                  title_justify="left")
        t.add_column("tensor", no_wrap=True, min_width=min(40, max(map(len, f["tensors"]), default=6)))
        for col in ("shape", "norm before", "change norm", "relative", "max |change|"):
            t.add_column(col, justify="left" if col == "shape" else "right")
        for name, s in f["tensors"].items():
            t.add_row(name, "x".join(map(str, s["shape"])) or "()", _num(s["base_norm"], ".4g"),
                      _num(s["change_norm"], ".4g"), _num(s["relative"], ".2%"), _num(s["max_abs"], ".4g"))
        out.print(t)


@ckpt_app.command("export")
def ckpt_export(output: Annotated[Path, typer.Option("--output", "-o", help="FILE.safetensors, FILE.npz, or a new "
                                                                             "folder for --format orbax")],
                url: UrlArg = None,
                version: Annotated[str, typer.Option(help="'latest', or V: each fragment at its newest version <= V")] = "latest",
                format_: Annotated[Optional[str], typer.Option("--format", "-f", help="safetensors, npz or orbax; "
                                                                                      "default: npz for a .npz output, "
                                                                                      "else safetensors")] = None,
                config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None, json_: JsonOpt = False):
    """The full model at one consistent set of versions for JAX users: one safetensors (or .npz) file, or
    with --format orbax an Orbax checkpoint (a new folder; tensors nested at '.', `layer0.qkv` ->
    {"layer0": {"qkv": ...}}, flat by name if a name is both a leaf and a branch).

    The metadata (safetensors metadata, Orbax custom metadata) records the run and the version used per
    fragment. bf16 tensors stay bf16 (BF16 in safetensors).
    """
    from diloco.ops import ckpt

    if version != "latest" and not version.isdigit():
        _fail(f"--version must be 'latest' or a version number, got {version!r}", 2)
    if format_ is not None and format_ not in ckpt.EXPORT_FORMATS:
        _fail(f"--format must be one of {', '.join(ckpt.EXPORT_FORMATS)}, got {format_!r}", 2)
    rep = _ops(ckpt.export, _checkpoint(url, config, set_, run), None if version == "latest" else int(version), output,
               format_)
    if json_:
        return _dump(rep)
    out.print(f"wrote {rep['output']} ({rep['format']}): {rep['tensors']} tensors, {rep['parameters']:,} parameters, "
              f"{_bytes(rep['bytes'])}; versions " + " ".join(f"p{p}:v{v}" for p, v in rep["versions"].items()),
              highlight=False)


# --- state ------------------------------------------------------------------------------------------

state_app = typer.Typer(help="Repair a run's Redis state (docs/operations.md, 'Redis lost writes').", no_args_is_help=True)


@state_app.command("repair")
def state_repair(config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None,
                 dry_run: Annotated[bool, typer.Option("--dry-run", help="only show what the repair would do")] = False,
                 json_: JsonOpt = False):
    """Rebuild the run's Redis state from TensorStore, after Redis lost acknowledged writes (the syncer
    refuses to start on it and names this command). Stop every syncer shard of the run first.

    Each fragment goes back to its newest committed version in the store; every id merged into a
    committed version is marked applied, merge records and counters come from the stored versions,
    open rounds, replay offsets and the outbox are dropped: the syncer then re-reads the fragment
    topics from their start, drops what was applied as duplicates and judges the rest again.
    """
    from diloco.infra.store import FragmentStore, StoreError
    from diloco.ops import OpsError
    from diloco.ops.repair import repair
    from diloco.syncer import state as state_mod

    cfg, run_id = _run_config(config, set_, run)
    try:
        state = state_mod.SyncerState(state_mod.connect(cfg.state, timeout_s=5), cfg.state.key_prefix, run_id)
        rep = repair(state, FragmentStore(cfg.store.url, run_id), run_id, shards=cfg.syncer.shards, dry_run=dry_run)
    except (OpsError, StoreError, state_mod.StateError) as err:
        _fail(str(err))
    if json_:
        return _dump(rep)
    t = Table(title=f"{'would repair' if dry_run else 'repaired'} the Redis state of run {rep['run']} from {rep['store']}",
              title_justify="left")
    for col in ("fragment", "Redis had", "version", "ids applied", "orphans", "epoch"):
        t.add_column(col, justify="right")
    for f in rep["fragments"]:
        t.add_row(str(f["fragment"]), _num(f["redis_version"]), str(f["version"]), _num(f["applied"]),
                  " ".join(map(str, f["orphans"])) or "-", str(f["epoch"]))
    s = rep["statuses"]
    t.caption = (f"{rep['merge_records']} merge records; statuses: {s['applied']} applied, {s['rejected_kept']} "
                 "rejections kept, dropped " + (", ".join(f"{n} {k}" for k, n in s["dropped"].items()) or "none")
                 + "; open rounds, replay offsets, leases and the outbox "
                 + ("would be cleared (nothing changed: --dry-run)" if dry_run else
                    "cleared: the syncer re-reads the fragment topics from their start"))
    out.print(t)
