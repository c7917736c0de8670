"""One benchmark run per (method, scenario), reduced to the same shape of result:
curve (tokens, time_s, loss), final loss, bytes across regions, goodput, idle share, merge figures."""

from __future__ import annotations

import math

import numpy as np
from kafka import TopicPartition
from rich.console import Console

from bench import metrics
from diloco import chaos, messages
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.checkpoint import read_global
from diloco.infra.store import FragmentStore
from diloco.models.transformer import evaluate
from diloco.run import dp_allreduce_bytes, train
from diloco.spec import initial_plan, load_spec


def num_params(cfg: Config) -> int:
    return initial_plan(cfg, load_spec(cfg))[0].num_params


def read_events(cfg: Config, run_id: str) -> list[dict]:
    topics = kafka_io.Topics.for_run(cfg, run_id)
    recs = kafka_io.read_to_end(cfg.transport, [TopicPartition(topics.events, 0)])
    return metrics.dedupe(ev for ev in (messages.parse_event(r.value) for r in recs) if ev)


def version_times(store: FragmentStore, fragments: int, final: dict[int, int]) -> dict[int, list[tuple[int, float]]]:
    """(version, merge time) per fragment up to the committed version (a crash may leave an orphan beyond)."""
    return {p: [(v, store.read_meta(p, v)["time"]) for v in store.versions(p) if v <= final[p]]
            for p in range(fragments)}


def versions_at(vt: dict[int, list[tuple[int, float]]], t: float) -> dict[int, int]:
    return {p: max((v for v, vt_ in vs if vt_ <= t), default=0) for p, vs in vt.items()}


def loss_curve(cfg: Config, run_id: str, final: dict[int, int], events: list[dict], origin: float,
               held: np.ndarray, points: int) -> dict:
    """Held-out loss of the global model at `points` times of the run, evaluated after it ended."""
    store = FragmentStore(cfg.store.url, run_id)
    plan = store.read_plan()
    vt = version_times(store, cfg.fragments.count, final)
    end = max(t for vs in vt.values() for _, t in vs)
    curve = {"tokens": [], "time_s": [], "loss": []}
    for t in np.linspace(origin, end, points + 1):
        curve["tokens"].append(metrics.tokens_at(events, t) if t > origin else 0)
        curve["time_s"].append(float(t - origin))
        curve["loss"].append(evaluate(read_global(store, plan, versions_at(vt, t)), held, cfg.model.transformer))
    return curve


def run_diloco(cfg: Config, scenario: str, held: np.ndarray, points: int, console: Console) -> dict:
    summary = train(cfg, progress=False, console=console, with_chaos=scenario == "failures")
    run_id = summary["run_id"]
    events = read_events(cfg, run_id)
    lt = metrics.learner_time(events, cfg.learner_ids())
    final = {int(p): int(v) for p, v in summary["versions"].items()}
    curve = loss_curve(cfg, run_id, final, events, lt["origin"], held, points)
    curve["tokens"][-1], curve["loss"][-1] = summary["tokens"], summary["eval_loss_end"]  # the run's own final eval
    wall, compute = sum(lt["wall_s"].values()), sum(lt["compute_s"].values())
    return {"run_id": run_id, "curve": curve, "tokens": summary["tokens"], "loss_end": summary["eval_loss_end"],
            "bytes_sent": summary["bytes_sent"], "bytes_fetched": summary["bytes_fetched"],
            "bytes_dp": summary["bytes_dp_equivalent"],
            "goodput": summary["goodput_wall"], "goodput_tokens": summary["goodput"],
            "idle": 1 - compute / wall if wall else math.nan, "merge": metrics.merge_stats(events),
            "step_times": lt["step_s"], "outages_s": summary.get("outages_s", {}), "kills": summary.get("kills", {}),
            "contributions": summary["contributions"], "time_s": curve["time_s"][-1]}


def dp_stalls(cfg: Config, steps: int, outages_s: dict[str, float]) -> dict[int, float]:
    """The same seeded learner kills as the chaos run, each stalling every worker for that learner's
    measured outage (or the configured restart delay) plus the step in flight, lost and redone.
    Syncer kills do not touch data-parallel: it has no syncer."""
    stalls: dict[int, float] = {}
    for kill in chaos.schedule(cfg):
        if kill.target == "syncer":
            continue
        s = int(kill.at_progress * steps)
        stalls[s] = stalls.get(s, 0.0) + outages_s.get(kill.target, cfg.chaos.restart_after_s)
    return stalls


def dp_in_scenario(cfg: Config, scenario: str, dp: dict, reference: dict | None) -> dict:
    """Data-parallel's figures in a scenario. Training is the same in every scenario (a synchronous job
    computes the same steps whatever happens); only its clock differs: each step costs the slowest
    worker's step time (from the decoupled learners' heartbeats in the same scenario, so both pay the
    same machine contention; else the DP process's own time per worker), plus the all-reduce on the
    WAN, plus failure stalls (see dp_stalls)."""
    steps, M = dp["steps"], cfg.num_learners
    params = num_params(cfg)
    if reference and reference.get("step_times"):
        step_s = max(reference["step_times"].values())
    else:
        step_s = dp["worker_step_s"] / min(r.speed for r in cfg.regions)
    sharers = max(r.learners for r in cfg.regions)
    comm_s = metrics.dp_comm_s(2 * (M - 1) / M * params * 4, cfg.transport.wan_bandwidth_mbps,
                               cfg.transport.wan_latency_ms, sharers) if cfg.transport.wan_bandwidth_mbps else 0.0
    stalls = dp_stalls(cfg, steps, (reference or {}).get("outages_s", {})) if scenario == "failures" else {}
    clock = metrics.dp_clock(steps, step_s, comm_s, stalls)
    lost = len(stalls) * step_s  # the step in flight at each kill is redone
    slowest = min(r.speed for r in cfg.regions)
    own = [step_s * slowest / r.speed for r in cfg.regions for _ in range(r.learners)]  # each worker's compute
    compute = steps * float(np.mean(own))
    total = float(clock[-1])
    curve = dict(dp["curve"])
    curve["time_s"] = [0.0 if s == 0 else float(clock[s - 1]) for s in curve["step"]]
    bytes_dp = dp_allreduce_bytes(params, M, steps * M)
    return {"run_id": None, "curve": curve, "tokens": dp["tokens"], "loss_end": curve["loss"][-1],
            "bytes_sent": bytes_dp, "bytes_fetched": 0, "bytes_dp": bytes_dp, "goodput": (compute - lost) / total,
            "goodput_tokens": 1.0, "idle": max(0.0, 1 - compute / total), "merge": None, "time_s": total,
            "step_s": step_s, "comm_s": comm_s, "stall_s": sum(stalls.values())}
