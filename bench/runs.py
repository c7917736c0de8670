"""One benchmark run per (method, scenario), reduced to the same shape of result:
curve (tokens, time_s, loss), final loss, bytes across regions, goodput, idle share, merge figures."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from rich.console import Console

from bench import dp as dp_mod
from bench import metrics
from diloco import chaos, messages
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.checkpoint import read_global
from diloco.infra.store import FragmentStore
from diloco.models.transformer import evaluate
from diloco.run import train
from diloco.summary import dp_allreduce_bytes
from diloco.spec import initial_plan, load_spec


def num_params(cfg: Config) -> int:
    return initial_plan(cfg, load_spec(cfg))[0].num_params


def read_events(cfg: Config, run_id: str) -> list[dict]:
    topics = kafka_io.Topics.for_run(cfg, run_id)
    recs = kafka_io.read_to_end(cfg.transport, [(topics.events, 0)])
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
    lt = metrics.learner_time(events, cfg.member_ids())
    final = {int(p): int(v) for p, v in summary["versions"].items()}
    curve = loss_curve(cfg, run_id, final, events, lt["origin"], held, points)
    curve["tokens"][-1], curve["loss"][-1] = summary["tokens"], summary["eval_loss_end"]  # the run's own final eval
    wall, compute = sum(lt["wall_s"].values()), sum(lt["compute_s"].values())
    return {"run_id": run_id, "curve": curve, "tokens": summary["tokens"], "loss_end": summary["eval_loss_end"],
            "bytes_sent": summary["bytes_sent"], "bytes_fetched": summary["bytes_fetched"],
            "bytes_dp": summary["bytes_dp_equivalent"],
            "goodput": summary["goodput_wall"], "goodput_tokens": summary["goodput"],
            "idle": 1 - compute / wall if wall else math.nan, "merge": metrics.merge_stats(events),
            "step_times": lt["step_s"], "phase_step_s": phase_step_s(cfg, events, lt),
            "outages_s": summary.get("outages_s", {}), "kills": summary.get("kills", {}),
            "contributions": summary["contributions"], "time_s": curve["time_s"][-1],
            "codecs": {"up": codec_name(cfg.fragments.quantization, cfg.fragments.packing),
                       "down": codec_name(cfg.syncer.broadcast, cfg.syncer.broadcast_packing)}}


def codec_name(scheme: str, packing: str) -> str:
    """A direction's code as the bytes table names it: the scheme, and `+zstd` when packed."""
    return scheme if packing == "none" else f"{scheme}+{packing}"


def phase_step_s(cfg: Config, events: list[dict], lt: dict) -> list[float]:
    """Per phase of data-parallel's run (bench.dp.phases), the slowest learner's step time while this
    run trained the same share of its tokens: a phase with more workers pays what more learners on
    the machine cost. A phase with no two heartbeats of a learner takes the whole run's slowest."""
    out, tokens = [], 0
    per_worker_step = cfg.inner.batch_size * cfg.model.transformer.seq_len
    for steps, workers in dp_mod.phases(cfg):
        start = lt["origin"] if tokens == 0 else metrics.time_at_tokens(events, tokens)
        tokens += steps * len(workers) * per_worker_step
        seen = metrics.step_s_between(events, start, metrics.time_at_tokens(events, tokens))
        out.append(max(seen.values()) if seen else max(lt["step_s"].values()))
    return out


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
    """Data-parallel's figures in a scenario. Training is the same in every scenario but scavenge (a
    synchronous job computes the same steps whatever happens; with joins its batch grows); its
    clock is modelled: each step costs the slowest worker's step time (from the decoupled learners'
    heartbeats in the same scenario over the same share of the tokens, so both pay the same machine
    contention; else the DP process's own time per worker), plus the all-reduce on the WAN among
    that phase's workers, plus failure stalls (see dp_stalls)."""
    plan, steps, params = dp["phases"], dp["steps"], num_params(cfg)
    slowest = min(r.speed for r in cfg.regions)
    phase_s = (reference or {}).get("phase_step_s") or [dp["worker_step_s"] / slowest] * len(plan)
    phase_comm = []
    for _, workers in plan:
        M, sharers = len(workers), max(Counter(cfg.region_of(w).name for w in workers).values())
        phase_comm.append(metrics.dp_comm_s(2 * (M - 1) / M * params * 4, cfg.transport.wan_bandwidth_mbps,
                                            cfg.transport.wan_latency_ms, sharers)
                          if cfg.transport.wan_bandwidth_mbps else 0.0)
    step_s = np.concatenate([np.full(n, s) for (n, _), s in zip(plan, phase_s)])
    comm_s = np.concatenate([np.full(n, c) for (n, _), c in zip(plan, phase_comm)])
    stalls = dp_stalls(cfg, steps, (reference or {}).get("outages_s", {})) if scenario == "failures" else {}
    clock = metrics.dp_clock(steps, step_s, comm_s, stalls)
    lost = sum(step_s[min(s, steps - 1)] for s in stalls)  # the step in flight at each kill is redone
    # each worker's own compute: the slowest worker's step time scaled to its region's speed
    compute = sum(n * s * float(np.mean([slowest / cfg.region_of(w).speed for w in workers]))
                  for (n, workers), s in zip(plan, phase_s))
    total = float(clock[-1])
    curve = dict(dp["curve"])
    curve["time_s"] = [0.0 if s == 0 else float(clock[s - 1]) for s in curve["step"]]
    bytes_dp = sum(dp_allreduce_bytes(params, len(workers), n * len(workers)) for n, workers in plan)
    return {"run_id": None, "curve": curve, "tokens": dp["tokens"], "loss_end": curve["loss"][-1],
            "bytes_sent": bytes_dp, "bytes_fetched": 0, "bytes_dp": bytes_dp, "goodput": (compute - lost) / total,
            "goodput_tokens": 1.0, "idle": max(0.0, 1 - compute / total), "merge": None, "time_s": total,
            "step_s": phase_s, "comm_s": phase_comm, "stall_s": sum(stalls.values())}
