"""A local multi-region run: provision, start the syncer and every learner as processes, watch the
events topic, stop cleanly, evaluate, and summarise.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kafka import TopicPartition
from rich.console import Console
from rich.live import Live
from rich.table import Table

from diloco import messages
from diloco.config import Config, dump_config
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore
from diloco.learners.data import Corpus, ensure_corpus, eval_batches
from diloco.learners.model import evaluate
from diloco.syncer import state as state_mod
from diloco.syncer.syncer import fragment_plan, provision


class RunError(RuntimeError):
    pass


def new_run_id(cfg: Config) -> str:
    return cfg.run.id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def dp_allreduce_bytes(num_params: int, workers: int, steps: int, bytes_per_value: int = 4) -> int:
    """Bytes all workers together send for `steps` ring all-reduces of fp32 gradients.

    Per step each of M workers sends 2 (M - 1) / M of the gradient (reduce-scatter + all-gather);
    `steps` counts every learner's steps, i.e. the same tokens a data-parallel job would process.
    """
    if workers < 2:
        return 0
    return int(steps * 2 * (workers - 1) / workers * num_params * bytes_per_value)


@dataclass
class Progress:
    """What the events topic has told us so far."""
    learners: dict[str, dict] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    merges: int = 0
    accepted: int = 0
    rejected: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    merged_ids: list[str] = field(default_factory=list)
    kinds_seen: set[str] = field(default_factory=set)
    eids: set[str] = field(default_factory=set)

    def apply(self, ev: dict) -> None:
        if ev.get("eid") in self.eids:  # at-least-once delivery: a restarted syncer may repeat events
            return
        self.eids.add(ev.get("eid"))
        kind = ev["kind"]
        self.kinds_seen.add(kind)
        if kind == "heartbeat":
            self.learners[ev["learner"]] = ev
        elif kind == "merge":
            self.merges += 1
            self.versions[int(ev["fragment"])] = int(ev["version"])
            self.merged_ids.extend(ev["ids"])
        elif kind == "contribution_accepted":
            self.accepted += 1
        elif kind == "contribution_rejected":
            self.rejected += 1
            self.rejections[ev["reason"]] = self.rejections.get(ev["reason"], 0) + 1
        elif kind == "syncer_started":
            self.versions |= {int(k): int(v) for k, v in ev["versions"].items()}


def progress_table(cfg: Config, prog: Progress, run_id: str, elapsed: float) -> Table:
    t = Table(title=f"run {run_id}  ({elapsed:.0f}s)", title_justify="left")
    for col in ("learner", "step", "tokens", "loss", "step ms", "sent", "state"):
        t.add_column(col, justify="right" if col not in ("learner", "state") else "left")
    for lid in cfg.learner_ids():
        hb = prog.learners.get(lid)
        if hb is None:
            t.add_row(lid, "-", "-", "-", "-", "-", "starting")
            continue
        t.add_row(lid, f"{hb['step']}/{cfg.inner.steps}", f"{hb['tokens']:,}", f"{hb['loss']:.3f}",
                  f"{1000 * hb['step_time']:.0f}", f"{hb['published']} ({hb['bytes_sent'] / 1e6:.2f} MB)", hb["state"])
    versions = " ".join(f"p{p}:v{v}" for p, v in sorted(prog.versions.items()))
    rej = ", ".join(f"{k} {v}" for k, v in sorted(prog.rejections.items())) or "none"
    t.caption = f"syncer: {versions} | merges {prog.merges} | accepted {prog.accepted} | rejected {prog.rejected} ({rej})"
    return t


def _child_env(cfg: Config) -> dict:
    n = cfg.run.threads_per_process
    flags = os.environ.get("XLA_FLAGS", "")
    if n == 1 and "multi_thread_eigen" not in flags:
        flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    return {**os.environ, "XLA_FLAGS": flags.strip(), "OMP_NUM_THREADS": str(n), "PYTHONUNBUFFERED": "1"}


def _spawn(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "diloco", *argv], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def train(cfg: Config, *, summary_json: str | Path | None = None, progress: bool = True,
          console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    t_start = time.time()
    run_id = new_run_id(cfg)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})
    run_dir = Path(cfg.run.dir) / run_id
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(dump_config(cfg))
    console.print(f"[bold]run[/] {run_id}  dir {run_dir}  broker {cfg.transport.bootstrap_servers}  store {cfg.store.url}")

    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)  # fail fast
    producer = kafka_io.producer(cfg.transport)
    corpus = ensure_corpus(cfg.data.corpus, cfg.data.dir, learners=cfg.num_learners,
                           heldout_fraction=cfg.data.heldout_fraction, max_bytes=cfg.data.max_corpus_bytes,
                           seed=cfg.data.seed)
    console.print(f"corpus {corpus.dir}: {sum(s['tokens'] for s in corpus.manifest['shards']):,} train tokens "
                  f"in {corpus.num_shards} shards, {corpus.manifest['heldout']['tokens']:,} held out")

    store = FragmentStore(cfg.store.url, run_id)
    provision(cfg, run_id, state=state, store=store, producer=producer)
    producer.close()

    held = eval_batches(corpus.heldout_tokens(), n_batches=cfg.run.eval_batches, batch_size=cfg.run.eval_batch_size,
                        seq_len=cfg.model.seq_len)
    eval_start = evaluate(load_global(cfg, store, {p: 0 for p in range(cfg.fragments.count)}), held, cfg.model)
    console.print(f"held-out loss at start: {eval_start:.4f}")

    topics = kafka_io.Topics.for_run(cfg, run_id)
    events = kafka_io.consumer(cfg.transport)
    kafka_io.assign_from(events, {TopicPartition(topics.events, 0): 0})
    env = _child_env(cfg)
    logs = run_dir / "logs"
    syncer = _spawn(["syncer", "--config", str(cfg_path)], logs / "syncer.log", env)
    prog = Progress()
    _wait_for_syncer(events, prog, syncer, logs, console)
    learners = {lid: _spawn(["learner", "--config", str(cfg_path), "--learner", lid, "--corpus", str(corpus.dir)],
                            logs / f"{lid}.log", env) for lid in cfg.learner_ids()}
    try:
        _watch(cfg, run_id, events, prog, syncer, learners, logs, console, progress, t_start)
    finally:
        for proc in [*learners.values(), syncer]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        events.close()

    final_versions = state.versions()
    eval_end = evaluate(load_global(cfg, store, final_versions), held, cfg.model)
    summary = build_summary(cfg, run_id, state, prog, eval_start, eval_end, time.time() - t_start)
    summary["run_dir"] = str(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary_json:
        Path(summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_json).write_text(json.dumps(summary, indent=1))
    console.print(summary_table(summary))
    return summary


def _wait_for_syncer(events, prog: Progress, syncer, logs: Path, console, timeout_s: float = 180.0) -> None:
    """Learners start once the syncer is consuming: deltas would only pile up in the topics before."""
    deadline = time.time() + timeout_s
    with console.status("starting the syncer"):
        while not any(k == "syncer_started" for k in prog.kinds_seen):
            if syncer.poll() is not None:
                raise RunError(f"syncer exited with {syncer.returncode}:\n" + _tail(logs / "syncer.log"))
            if time.time() > deadline:
                raise RunError(f"syncer did not start within {timeout_s:.0f}s:\n" + _tail(logs / "syncer.log"))
            for records in events.poll(timeout_ms=200).values():
                for rec in records:
                    if (ev := messages.parse_event(rec.value)):
                        prog.apply(ev)


def _watch(cfg, run_id, events, prog: Progress, syncer, learners, logs: Path, console, progress: bool, t0: float):
    deadline = t0 + cfg.run.timeout_s
    stop_sent = False
    last_line = 0.0
    live = Live(progress_table(cfg, prog, run_id, 0), console=console, refresh_per_second=2) if progress else None
    if live:
        live.start()
    try:
        while True:
            for records in events.poll(timeout_ms=250).values():
                for rec in records:
                    ev = messages.parse_event(rec.value)
                    if ev:
                        prog.apply(ev)
            now = time.time()
            if live:
                live.update(progress_table(cfg, prog, run_id, now - t0))
            elif now - last_line > 10:
                lrn = " ".join(f"{k} step {v['step']} loss {v['loss']:.3f};" for k, v in sorted(prog.learners.items()))
                vers = " ".join(f"p{p}:v{v}" for p, v in sorted(prog.versions.items()))
                console.print(f"[{now - t0:4.0f}s] {lrn or 'learners starting;'} syncer {vers} merges {prog.merges} "
                              f"accepted {prog.accepted} rejected {prog.rejected}", soft_wrap=True)
                last_line = now
            for lid, proc in learners.items():
                if proc.poll() not in (None, 0):
                    raise RunError(f"learner {lid} exited with {proc.returncode}; log {logs / (lid + '.log')}:\n"
                                   + _tail(logs / f"{lid}.log"))
            if syncer.poll() is not None and not stop_sent:
                raise RunError(f"syncer exited with {syncer.returncode}; log {logs / 'syncer.log'}:\n"
                               + _tail(logs / "syncer.log"))
            if not stop_sent and all(p.poll() == 0 for p in learners.values()):
                syncer.send_signal(signal.SIGTERM)  # drain, flush open rounds, exit
                stop_sent = True
                deadline = min(deadline, now + 120)
            if stop_sent and syncer.poll() is not None:
                if syncer.returncode != 0:
                    raise RunError(f"syncer failed on stop ({syncer.returncode}):\n" + _tail(logs / "syncer.log"))
                for records in events.poll(timeout_ms=500).values():  # the syncer's last events
                    for rec in records:
                        if (ev := messages.parse_event(rec.value)):
                            prog.apply(ev)
                return
            if now > deadline:
                raise RunError(f"run did not finish within run.timeout_s={cfg.run.timeout_s:.0f}s")
    finally:
        if live:
            live.update(progress_table(cfg, prog, run_id, time.time() - t0))
            live.stop()


def load_global(cfg: Config, store: FragmentStore, versions: dict[int, int]) -> dict[str, np.ndarray]:
    params: dict[str, np.ndarray] = {}
    for p in range(cfg.fragments.count):
        params |= store.read(p, versions[p], with_opt=False).params
    return params


def build_summary(cfg: Config, run_id: str, state: state_mod.SyncerState, prog: Progress, eval_start: float,
                  eval_end: float, wall_s: float) -> dict:
    counters = state.counters()
    statuses = state.status_counts()
    merges = state.merges()
    seen: dict[str, int] = {}
    for m in merges:
        for cid in m["ids"]:
            seen[cid] = seen.get(cid, 0) + 1
    learners = {lid: {k: hb.get(k) for k in ("step", "tokens", "loss", "published", "bytes_sent", "bytes_fetched",
                                              "state")} for lid, hb in sorted(prog.learners.items())}
    steps = sum(hb.get("step", 0) for hb in prog.learners.values())
    num_params = sum(int(np.prod(a.shape)) for a in fragment_plan(cfg)[0].values())
    bytes_sent = sum(hb.get("bytes_sent", 0) for hb in prog.learners.values())
    bytes_dp = dp_allreduce_bytes(num_params, cfg.num_learners, steps)
    versions = {str(p): v for p, v in sorted(state.versions().items())}
    return {
        "run_id": run_id,
        "wall_s": round(wall_s, 1),
        "eval_loss_start": eval_start,
        "eval_loss_end": eval_end,
        "eval_loss_drop": (eval_start - eval_end) / eval_start if eval_start else math.nan,
        "tokens": sum(hb.get("tokens", 0) for hb in prog.learners.values()),
        "inner_steps": steps,
        "params": num_params,
        "bytes_sent": bytes_sent,
        "bytes_fetched": sum(hb.get("bytes_fetched", 0) for hb in prog.learners.values()),
        "bytes_dp_equivalent": bytes_dp,
        "bytes_ratio": bytes_dp / bytes_sent if bytes_sent else math.inf,
        "contributions": {
            "published": sum(hb.get("published", 0) for hb in prog.learners.values()),
            "accepted": counters.get("accepted", 0),
            "applied": counters.get("applied", 0),
            "rejected": counters.get("rejected", 0),
            "late": counters.get("late", 0),
            "pending": statuses.get("pending", 0),
            "applied_twice": sum(1 for n in seen.values() if n > 1),
            "duplicate_records": counters.get("duplicate_records", 0),
            "rejected_records": counters.get("rejected_records", 0),
        },
        "rejections": {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("rejected:")},
        "versions": versions,
        "merges": {str(p): sum(1 for m in merges if m["fragment"] == p) for p in range(cfg.fragments.count)},
        "learners": learners,
    }


def summary_table(s: dict) -> Table:
    t = Table(title=f"summary of {s['run_id']} ({s['wall_s']:.0f}s)", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    c = s["contributions"]
    rows = [
        ("held-out loss start -> end", f"{s['eval_loss_start']:.4f} -> {s['eval_loss_end']:.4f} "
                                       f"({100 * s['eval_loss_drop']:.1f}% lower)"),
        ("tokens (all learners)", f"{s['tokens']:,}"),
        ("versions per fragment", " ".join(f"p{p}:v{v}" for p, v in s["versions"].items())),
        ("merges per fragment", " ".join(f"p{p}:{n}" for p, n in s["merges"].items())),
        ("contributions published", str(c["published"])),
        ("  applied / late / rejected / pending", f"{c['applied']} / {c['late']} / {c['rejected']} / {c['pending']}"),
        ("  applied twice", str(c["applied_twice"])),
        ("bytes sent over Kafka", f"{s['bytes_sent'] / 1e6:,.2f} MB"),
        ("bytes a data-parallel all-reduce sends", f"{s['bytes_dp_equivalent'] / 1e6:,.1f} MB"),
        ("  ratio", f"{s['bytes_ratio']:,.0f}x fewer"),
        ("bytes fetched from TensorStore", f"{s['bytes_fetched'] / 1e6:,.2f} MB"),
    ]
    if s["rejections"]:
        rows.append(("rejections by reason", ", ".join(f"{k} {v}" for k, v in s["rejections"].items())))
    for row in rows:
        t.add_row(*row)
    return t


__all__ = ["train", "Progress", "build_summary", "dp_allreduce_bytes", "new_run_id", "Corpus"]
