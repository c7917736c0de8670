"""`diloco`: the command line of Decoupled DiLoCo."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from diloco.config import Config, ConfigError, load_config, redact_url
from diloco.ops.cli import ckpt_app, state_app
from diloco.ops.cli import topics as topics_cmd
from diloco.pipelines.cli import PASS_THROUGH, data_app
from diloco.pipelines.cli import report as report_cmd
from diloco.sim.cli import app as simulate_app
from diloco.textout import labelled

app = typer.Typer(
    help="Decoupled DiLoCo: resilient, low-communication LM pre-training.\n\n"
         "Learners (JAX + optax) publish fragment deltas to Kafka; a syncer merges them (quorum, grace "
         "window, token-weighted radial-directional averaging, Nesterov outer step) into TensorStore, "
         "keeping its control state in Redis.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
infra = typer.Typer(help="Start, stop and probe the local service stack (Kafka-protocol broker, Redis).",
                    no_args_is_help=True)
app.add_typer(infra, name="infra")
app.add_typer(simulate_app, name="simulate", help="Simulate goodput of training schemes at datacenter scale.")
app.add_typer(data_app, name="data", help="Prepare token shards (Beam), train a tokenizer, inspect a prepared corpus.")
app.add_typer(ckpt_app, name="ckpt", help="Inspect, compare and export the checkpoints a run wrote to TensorStore.")
app.add_typer(state_app, name="state", help="Repair a run's Redis state from TensorStore after Redis lost writes.")
learners_app = typer.Typer(help="Add learners to a live local run, or ask one to leave (elastic membership).",
                           no_args_is_help=True)
app.add_typer(learners_app, name="learners")
app.command("topics")(topics_cmd)
app.command("report", context_settings=PASS_THROUGH)(report_cmd)
console = Console(stderr=True, markup=False)  # what it prints quotes names and paths a user chose (diloco/textout.py)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config; omitted = embedded defaults")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a config key, e.g. --set inner.steps=200")]
StateDir = Annotated[Path, typer.Option(help="where local services keep pid files, logs and data")]


def _config(path: Optional[Path], overrides: Optional[list[str]]) -> Config:
    try:
        return load_config(path, overrides or [])
    except ConfigError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(2) from None


def _run_config(path: Path, overrides: Optional[list[str]], command: str) -> Config:
    """The config of an existing run (`_config`); exit status 2 if it names no run (run.id)."""
    cfg = _config(path, overrides)
    if not cfg.run.id:
        console.print(labelled("error:", f"{command} needs run.id: give the run's config (RUN_DIR/config.yaml has it)"))
        raise typer.Exit(2)
    return cfg


@infra.command("up")
def infra_up(config: ConfigOpt = None, set_: SetOpt = None, state_dir: StateDir = Path(".diloco/services"),
             durable: Annotated[bool, typer.Option(help="broker on the s3 engine (local moto S3): survives restarts")] = False,
             s3_port: Annotated[int, typer.Option(help="port of the local S3 for --durable")] = 9000):
    """Start the broker (Tansu) and Redis (append-only file, fsync always) on the config's ports, unless they answer.

    With state.password_env set, Redis requires that password (read from the environment).
    """
    from diloco.config import resolve_secret
    from diloco.infra import services

    cfg = _config(config, set_)
    password = resolve_secret(cfg.state.password_env, "state.password_env")
    if durable and not services.port_open(s3_port):
        services.start_s3(state_dir, s3_port)
        console.print(f"s3: started on 127.0.0.1:{s3_port} (moto, bucket {services.S3_BUCKET})")
    starters = {"kafka": lambda d, p: services.start_broker(d, p, s3_port if durable else None),
                "redis": lambda d, p: services.start_redis(d, p, password)}
    addresses = services.stack_addresses(cfg.transport.bootstrap_servers, cfg.state.redis_url)
    console.print(Text(f"services of {config or 'the embedded defaults (no --config)'}: broker "
                       + ", redis ".join(f"{h}:{p}" for h, p in addresses.values())))
    for name, (h, port) in addresses.items():
        start = starters[name]
        if services.port_open(port, h):
            why = services.not_ours(name, port, state_dir) if h in ("127.0.0.1", "localhost") else None
            console.print(Text(f"{name}: already answering on {h}:{port}" + (
                f", not started by you here ({why}): to use a stack of your own, name free ports in a config's "
                "transport.bootstrap_servers and state.redis_url and pass it as --config" if why else "")))
        elif h not in ("127.0.0.1", "localhost"):
            console.print(Text(f"{name}: {h}:{port} is remote and not answering; not starting anything there", style="red"))
            raise typer.Exit(1)
        else:
            try:
                pid = start(state_dir, port)
            except services.ServiceError as err:
                console.print(Text(f"{name}: {err}", style="red"))
                raise typer.Exit(1) from None
            console.print(f"{name}: started on {h}:{port} (pid {pid}, log {state_dir / (name + '.log')})")


@infra.command("down")
def infra_down(state_dir: StateDir = Path(".diloco/services")):
    """Stop the services that `infra up` started."""
    from diloco.infra import services

    for name in ("kafka", "redis", "gcs", "s3"):
        if services.stop(name, state_dir):
            console.print(f"{name}: stopped")


@infra.command("status")
def infra_status(config: ConfigOpt = None, set_: SetOpt = None):
    """Say whether the broker and Redis named by the config answer. Exit 1 if one does not."""
    from diloco.infra import kafka as kafka_io
    from diloco.infra import services
    from diloco.syncer import state as state_mod

    cfg = _config(config, set_)
    ok = True
    try:
        kafka_io.ensure_topics(cfg.transport, {}, timeout_s=3)
        console.print(f"kafka: up at {cfg.transport.bootstrap_servers}")
    except kafka_io.TransportError as err:
        ok = False
        console.print(labelled("kafka: down", f"({err})"))
    try:
        state_mod.connect(cfg.state, timeout_s=3)
        console.print(f"redis: up at {cfg.state.redis_url}")
    except state_mod.StateError as err:
        ok = False
        console.print(labelled("redis: down", f"({err})"))
    del services
    raise typer.Exit(0 if ok else 1)


@app.command()
def train(config: ConfigOpt = None, set_: SetOpt = None,
          summary_json: Annotated[Optional[Path], typer.Option(help="also write the run summary here as JSON")] = None,
          progress: Annotated[bool, typer.Option(help="live progress table (off: a line every 10 s)")] = True):
    """Run a local multi-region training run: syncer + every learner as processes, then a summary.

    Needs the broker and Redis (`diloco infra up`). Prepares the default corpus (the Python standard
    library's sources) unless data.corpus names files.
    """
    _run(_config(config, set_), summary_json, progress, with_chaos=False)


@app.command()
def chaos(config: ConfigOpt = None, set_: SetOpt = None,
          summary_json: Annotated[Optional[Path], typer.Option(help="also write the summary here as JSON")] = None,
          progress: Annotated[bool, typer.Option(help="live progress table (off: a line every 10 s)")] = True):
    """A training run with seeded failures: kills learners and the syncer (config section `chaos`) and
    reports goodput next to what a synchronous run would keep under the same failures."""
    summary = _run(_config(config, set_), summary_json, progress, with_chaos=True)
    console.print(f"goodput {100 * summary['goodput']:.1f}% (synchronous run under the same failures: "
                  f"{100 * summary['goodput_sync_equivalent']:.1f}%); kills {summary['kills']}, "
                  f"restarts {summary['restarts']}")
    if summary["takeovers"]:
        console.print("syncer takeovers: " + ", ".join(
            f"p{t['fragment']} {t['from']} -> {t['to']} after {t['after_s']:.1f}s" for t in summary["takeovers"]))


def _run(cfg: Config, summary_json: Optional[Path], progress: bool, *, with_chaos: bool) -> dict:
    from diloco.run import RunError
    from diloco.run import train as run_train

    try:
        summary = run_train(cfg, summary_json=summary_json, progress=progress and sys.stderr.isatty(),
                            console=console, with_chaos=with_chaos)
    except (RunError, ConnectionError, RuntimeError, ValueError) as err:
        console.print(labelled("run failed:", err))
        raise typer.Exit(1) from None
    if summary["contributions"]["applied_twice"]:
        raise typer.Exit(3)
    return summary


@app.command()
def syncer(config: Annotated[Path, typer.Option("--config", "-c", help="the run's config (with run.id)")],
           set_: SetOpt = None,
           shard: Annotated[Optional[int], typer.Option(help="run as this shard (0..syncer.shards-1)")] = None,
           shards: Annotated[Optional[int], typer.Option(
               help="start this many shard processes here (sets syncer.shards) and wait for them")] = None):
    """Run the syncer of an existing run until SIGTERM (then drain, flush rounds, exit).

    Sharded (syncer.shards > 1 or --shards N): each shard owns the fragments it holds Redis leases
    on, homes first (fragment p belongs to shard p % N); a shard that stops renewing loses its
    fragments to the live ones after syncer.lease_ttl_s, and gets them back when it returns.
    """

    from diloco import logs
    from diloco.syncer.durability import EXIT_STATE_LOST, StateLost
    from diloco.syncer.service import main as syncer_main

    overrides = [*(set_ or []), *([f"syncer.shards={shards}"] if shards else [])]
    cfg = _run_config(config, overrides, "the syncer")
    if shard is None and cfg.syncer.shards > 1:
        raise typer.Exit(_run_shards(config, overrides, cfg.syncer.shards))
    shard = shard or 0
    if not 0 <= shard < cfg.syncer.shards:
        console.print(labelled("error:", f"--shard {shard} is not in 0..{cfg.syncer.shards - 1} (syncer.shards)"))
        raise typer.Exit(2)
    logs.setup("syncer" if cfg.syncer.shards == 1 else f"syncer-{shard}")
    try:
        syncer_main(cfg, cfg.run.id, shard)
    except StateLost as err:  # restarting cannot help: say what happened and how to repair it
        console.print(labelled("error:", err), soft_wrap=True)
        raise typer.Exit(EXIT_STATE_LOST) from None


def _run_shards(config: Path, overrides: list[str], n: int) -> int:
    """Start n shard processes, pass SIGTERM/SIGINT on, and return the worst exit status."""
    import signal
    import subprocess
    import sys

    base = [sys.executable, "-m", "diloco", "syncer", "--config", str(config)]
    base += [a for o in overrides for a in ("--set", o)]
    procs = [subprocess.Popen([*base, "--shard", str(i)]) for i in range(n)]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: [p.send_signal(s) for p in procs if p.poll() is None])
    return max(p.wait() for p in procs)


@app.command()
def learner(config: Annotated[Path, typer.Option("--config", "-c", help="the run's config (with run.id)")],
            learner_id: Annotated[Optional[str], typer.Option("--learner", help="learner id, <region>-<index>")] = None,
            corpus: Annotated[Optional[Path], typer.Option(
                help="prepared corpus directory; default: data.prepared of the config")] = None,
            start_step: Annotated[int, typer.Option(help="resume at this inner step (after a crash)")] = 0,
            spare: Annotated[bool, typer.Option(
                help='a warm spare instead of --learner: warm up, then read {"learner": ID, "start_step": N} '
                     "from stdin and become that learner")] = False,
            set_: SetOpt = None):
    """Run one learner of an existing run to the end of its inner steps.

    It trains the config's model entry point (model.entry, default the built-in transformer) with the
    learner's share of the data, and stops early on SIGTERM after handing in its last deltas."""
    from diloco import logs
    from diloco.learners.learner import main as learner_main

    cfg = _run_config(config, set_, "the learner")
    if spare:
        raise typer.Exit(_spare(cfg, corpus, learner_id))
    if learner_id is None:
        console.print(labelled("error:", "give --learner ID, or --spare"))
        raise typer.Exit(2)
    try:
        cfg.region_of(learner_id)
    except ConfigError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(2) from None
    logs.setup(f"learner:{learner_id}")
    learner_main(cfg, cfg.run.id, learner_id, str(corpus) if corpus else None, start_step, config_path=str(config))


def _spare(cfg: Config, corpus: Optional[Path], learner_id: Optional[str]) -> int:
    """`diloco learner --spare`: exit status 2 on a bad command line or assignment, else 0."""

    from diloco import logs
    from diloco.learners import spare

    if learner_id is not None:
        console.print(labelled("error:", "--spare learns its learner id from stdin: leave out --learner"))
        return 2
    if corpus:
        cfg = cfg.with_corpus(corpus)
    logs.setup("learner:spare")
    try:
        spare.main(cfg, cfg.run.id)
    except ConfigError as err:
        console.print(labelled("error:", err), soft_wrap=True)
        return 2
    return 0


RunConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="the live run's config (RUN_DIR/config.yaml)")]
WaitOpt = Annotated[float, typer.Option(help="seconds to wait for the run's answer")]


@app.command()
def lag(config: RunConfigOpt, set_: SetOpt = None):
    """The syncer's consumer-group lag per fragments partition: committed offset, end offset, lag.

    The syncer commits its replay offsets (what Redis says is safe to resume from) to the group
    `<topic_prefix>.<run.id>.syncer` about once a second; the same numbers show in
    kafka-consumer-groups.sh --describe --group ... (docs/operations.md)."""
    from rich.table import Table

    from diloco.infra import kafka as kafka_io

    cfg = _run_config(config, set_, "lag")
    topics = kafka_io.Topics.for_run(cfg, cfg.run.id)
    tps = [tp for t in topics.fragments.values() for tp in kafka_io.partitions_of(t, topics.partitions)]
    try:
        rows = kafka_io.group_lag(cfg.transport, topics.syncer_group, tps)
    except kafka_io.TransportError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(1) from None
    t = Table(title=f"group {topics.syncer_group}", title_justify="left")
    for col in ("topic", "partition", "committed", "end", "lag"):
        t.add_column(col, justify="left" if col == "topic" else "right")
    for r in rows:
        t.add_row(r["topic"], str(r["partition"]), "-" if r["committed"] is None else str(r["committed"]), str(r["end"]),
                  str(r["lag"]))
    t.caption = f"total lag {sum(r['lag'] for r in rows)}"
    Console(width=200).print(t)


def _membership(config: Path, op: dict, wait_s: float) -> dict:
    from diloco import membership

    if not config.is_file():
        console.print(labelled("error:", f"{config} is not a run's config.yaml (`diloco train` writes RUN_DIR/config.yaml)"))
        raise typer.Exit(2)
    try:
        result = membership.wait(membership.submit(config.parent, op), wait_s)
    except membership.RequestError as err:
        console.print(labelled("refused:", err))
        raise typer.Exit(1) from None
    console.print(result)
    return result


@app.command()
def status(config: RunConfigOpt, set_: SetOpt = None,
           json_out: Annotated[bool, typer.Option("--json", help="print the status as JSON instead of tables")] = False,
           events: Annotated[int, typer.Option(help="read about this many of the newest events (rejections)")] = 2000):
    """The live status of a run: members and their heartbeats, fragment versions and owners, the last
    rounds (contributors, grace waits), rejections. The syncer serves the same on its status page
    (monitoring.syncer_port). For the local services themselves: `diloco infra status`."""
    from diloco import messages
    from diloco import status as status_mod
    from diloco.infra import kafka as kafka_io
    from diloco.syncer import state as state_mod

    cfg = _run_config(config, set_, "status")
    try:
        state = state_mod.SyncerState(state_mod.connect(cfg.state, timeout_s=5), cfg.state.key_prefix, cfg.run.id)
        snap = status_mod.snapshot(state, cfg.fragments.count)
        topic = kafka_io.Topics.for_run(cfg, cfg.run.id).events
        recs = kafka_io.read_to_end(cfg.transport, kafka_io.partitions_of(topic, 1), timeout_s=10, last=events)
    except (state_mod.StateError, kafka_io.TransportError) as err:
        console.print(labelled("error:", err))
        raise typer.Exit(1) from None
    if not snap["versions"]:
        console.print(labelled("error:", f"run {cfg.run.id} is not in Redis at {redact_url(cfg.state.redis_url)}"))
        raise typer.Exit(1)
    evs = [e for e in map(messages.parse_event, (r.value for r in recs)) if e and e.get("run") == cfg.run.id]
    st = status_mod.build(cfg, cfg.run.id, snap, evs, time.time())
    if json_out:
        print(status_mod.to_json(st))
        return
    out = Console()
    for table in status_mod.tables(st):
        out.print(table)


@app.command()
def dashboard(prometheus: Annotated[str, typer.Option(help="the Prometheus server, e.g. http://127.0.0.1:9090")],
              output: Annotated[Path, typer.Option("--output", "-o", help="the PNG to write")],
              board: Annotated[Optional[Path], typer.Option(
                  "--dashboard", help="Grafana dashboard JSON (default: infra/grafana/diloco.json)")] = None,
              since: Annotated[Optional[str], typer.Option(
                  help="draw the last DURATION (30s, 10m, 1h30m) (default: 10m); not with --start")] = None,
              start: Annotated[Optional[str], typer.Option(help="range start: unix seconds or ISO 8601 (UTC if no zone)")] = None,
              end: Annotated[Optional[str], typer.Option(help="range end, as --start (default: now)")] = None,
              scrape_interval: Annotated[Optional[str], typer.Option(
                  help="for $__rate_interval (default: the server's global scrape_interval)")] = None,
              dpi: Annotated[int, typer.Option(min=20, help="PNG resolution")] = 80):
    """Draw a Grafana dashboard's panels from a Prometheus server, without Grafana.

    Every panel's queries go to Prometheus's /api/v1/query_range (about 200 points over the range;
    $__interval and $__rate_interval filled as Grafana fills them); each panel becomes a small line
    plot titled as in Grafana, one line per series named by its legendFormat. A panel whose
    queries return nothing says "no data". Prints each panel and how many series it drew."""
    from diloco import dashboard as dash

    try:
        if since is not None and start is not None:
            raise dash.DashboardError("give --since or --start, not both")
        t1 = time.time() if end is None else dash.parse_time(end)
        t0 = dash.parse_time(start) if start is not None else t1 - dash.parse_duration(since or "10m")
        scrape_s = None if scrape_interval is None else dash.parse_duration(scrape_interval)
        drawn = dash.render(prometheus, output, t0, t1, dashboard=board or dash.DEFAULT_DASHBOARD, scrape_s=scrape_s,
                            dpi=dpi)
    except dash.DashboardError as err:
        console.print(labelled("error:", err))
        raise typer.Exit(1) from None
    for title, n in drawn.items():
        console.print(f"{title}: {n} series" if n else Text.assemble(f"{title}: ", ("no data", "yellow")))
    console.print(f"wrote {output} ({sum(1 for n in drawn.values() if n)} of {len(drawn)} panels with data)")


@learners_app.command("add")
def learners_add(config: RunConfigOpt,
                 region: Annotated[str, typer.Option(help="the region the learners join")],
                 count: Annotated[int, typer.Option(min=1, help="learners to add")] = 1,
                 wait_s: WaitOpt = 60.0):
    """Start COUNT more learners in REGION of a live local run. They take the next free ids the
    region may have (regions[].max_learners), start from the latest global version, read their own
    data shard and are admitted by the syncer on their first heartbeat."""
    _membership(config, {"op": "add", "region": region, "count": count}, wait_s)


@learners_app.command("remove")
def learners_remove(config: RunConfigOpt,
                    learner_id: Annotated[str, typer.Argument(help="the learner to stop, e.g. eu-2")],
                    wait_s: WaitOpt = 60.0):
    """Ask a learner of a live local run to leave: it hands in its last deltas and says `left`, so no
    round waits for it. Refused below the region's regions[].min_learners."""
    _membership(config, {"op": "remove", "learner": learner_id}, wait_s)


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as err:  # a command of a role whose extra is not installed

        from diloco.extras import install_hint

        hint = install_hint(err)
        if hint is None:
            raise
        console.print(labelled("error:", hint))
        raise SystemExit(1) from None
