"""A finished run's summary: losses, tokens, contributions, the bytes each way against a data-parallel
all-reduce (counted from the broker's log and the learners' beats), and the table and rows the CLI
and the flows show.
"""

from __future__ import annotations

import math

from rich.table import Table

from diloco import messages
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore
from diloco.progress import Progress
from diloco.sim.capacity import dp_allreduce_bytes  # the plan counts data-parallel's bytes the same way
from diloco.syncer import state as state_mod
from diloco.syncer.records import rejections_by_reason


def published_on_broker(cfg: Config, run_id: str) -> tuple[int, int, dict[tuple[str, str, int], int]]:
    """Contributions (distinct manifest ids), bytes (values + keys) on the region topics, and those
    bytes by (learner, region, fragment) as the contributions' manifests name them (("?", topic's
    region, partition) for records of no contribution with a manifest).

    Counted from the log itself, so that learners killed between two heartbeats are counted too.
    """
    topics = kafka_io.Topics.for_run(cfg, run_id)
    region_of_topic = {t: r for r, t in topics.fragments.items()}
    tps = [tp for t in topics.fragments.values() for tp in kafka_io.partitions_of(t, topics.partitions)]
    total, by_id, owner, loose = 0, {}, {}, {}
    for rec in kafka_io.read_to_end(cfg.transport, tps):
        n = len(rec.value or b"") + len(rec.key or b"")
        total += n
        try:
            h = messages.FrameHeader.from_header(messages.parse_frame(rec.value)[0])
        except messages.WireError:
            h = None
        if h is None or h.id is None:  # no contribution id (wire format): bytes only
            where = ("?", region_of_topic.get(rec.topic, "?"), rec.partition)
            loose[where] = loose.get(where, 0) + n
            continue
        by_id[h.id] = by_id.get(h.id, 0) + n
        if h.kind == "manifest" and h.id not in owner:
            owner[h.id] = (h.learner or "?", h.region or "?", -1 if h.fragment is None else h.fragment)
    up = dict(loose)
    for cid, n in by_id.items():
        where = owner.get(cid, ("?", "?", -1))
        up[where] = up.get(where, 0) + n
    return len(owner), total, up


def traffic_ledger(cfg: Config, up: dict[tuple[str, str, int], int], prog: Progress) -> dict:
    """Bytes up (deltas over Kafka, from the log) and down (reads from the store, from the learners'
    last heartbeats of each incarnation) per learner, per region and per fragment."""
    def add(table: dict, key, direction: str, n: int) -> None:
        row = table.setdefault(str(key), {"up": 0, "down": 0})
        row[direction] += n
    by_learner: dict = {}
    by_region: dict = {}
    by_fragment: dict = {}
    for (learner, region, fragment), n in up.items():
        add(by_learner, learner, "up", n)
        add(by_region, region, "up", n)
        add(by_fragment, fragment, "up", n)
    for (learner, _), n in prog.fetched.items():
        add(by_learner, learner, "down", n)
        region = cfg.region_of(learner).name if cfg.is_member_id(learner) else "?"
        add(by_region, region, "down", n)
    for parts in prog.fetched_by_fragment.values():
        for p, n in parts.items():
            add(by_fragment, p, "down", n)
    order = lambda t: dict(sorted(t.items()))  # noqa: E731
    return {"by_learner": order(by_learner), "by_region": order(by_region), "by_fragment": order(by_fragment)}


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
    num_params = FragmentStore(cfg.store.url, run_id).read_plan().num_params
    published, bytes_sent, up = published_on_broker(cfg, run_id)
    bytes_dp = dp_allreduce_bytes(num_params, cfg.num_learners, steps)
    bytes_fetched = sum(prog.fetched.values())
    across = bytes_sent + bytes_fetched
    versions = {str(p): v for p, v in sorted(state.versions().items())}
    return {
        "run_id": run_id,
        "wall_s": round(wall_s, 1),
        "eval_loss_start": eval_start,
        "eval_loss_end": eval_end,
        "eval_loss_drop": (eval_start - eval_end) / eval_start if eval_start else math.nan,
        "tokens": prog.tokens(),
        "inner_steps": steps,
        "params": num_params,
        "bytes_sent": bytes_sent,
        "bytes_fetched": bytes_fetched,
        "bytes_across": across,
        "bytes_dp_equivalent": bytes_dp,
        "bytes_ratio": bytes_dp / across if across else math.inf,
        "bytes_ratio_sent": bytes_dp / bytes_sent if bytes_sent else math.inf,
        "contributions": {
            "published": published,
            "accepted": counters.get("accepted", 0),
            "applied": counters.get("applied", 0),
            "rejected": counters.get("rejected", 0),
            "late": counters.get("late", 0),
            "pending": statuses.get("pending", 0),
            # in the log, never judged: a syncer stopped before it caught up (its log says where)
            "unread": max(0, published - counters.get("applied", 0) - counters.get("rejected", 0)
                          - statuses.get("pending", 0)),
            "applied_twice": sum(1 for n in seen.values() if n > 1),
            "duplicate_records": counters.get("duplicate_records", 0),
            "rejected_records": counters.get("rejected_records", 0),
        },
        "rejections": rejections_by_reason(counters),
        "versions": versions,
        "merges": {str(p): sum(1 for m in merges if m["fragment"] == p) for p in range(cfg.fragments.count)},
        "learners": learners,
        "traffic": traffic_ledger(cfg, up, prog),
    }


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """The summary's figures as (what, value) rows: the CLI's table and the flow's report show the same."""
    c = s["contributions"]
    drop = s["eval_loss_drop"]
    rows = [
        ("held-out loss start -> end", f"{s['eval_loss_start']:.4f} -> {s['eval_loss_end']:.4f} "
                                       + (f"({100 * drop:.1f}% lower)" if drop >= 0 else
                                          f"(ROSE {-100 * drop:.1f}%: the global model got worse)")),
        ("tokens (all learners)", f"{s['tokens']:,}"),
        ("versions per fragment", " ".join(f"p{p}:v{v}" for p, v in s["versions"].items())),
        ("merges per fragment", " ".join(f"p{p}:{n}" for p, n in s["merges"].items())),
        ("contributions published", str(c["published"])),
        ("  applied / late / rejected / pending", f"{c['applied']} / {c['late']} / {c['rejected']} / {c['pending']}"),
        ("  applied twice", str(c["applied_twice"])),
        *([("  never read by the syncer", str(c["unread"]))] if c.get("unread") else []),
        ("bytes across regions (up + down)", f"{s['bytes_across'] / 1e6:,.2f} MB"),
        ("  up: deltas over Kafka", f"{s['bytes_sent'] / 1e6:,.2f} MB"),
        ("  down: globals from TensorStore", f"{s['bytes_fetched'] / 1e6:,.2f} MB"),
        ("bytes a data-parallel all-reduce sends", f"{s['bytes_dp_equivalent'] / 1e6:,.1f} MB"),
        ("  ratio (up only)", f"{s['bytes_ratio']:,.0f}x fewer ({s['bytes_ratio_sent']:,.0f}x)"),
    ]
    if s.get("traffic"):
        rows.append(("  per region (up / down)", "  ".join(
            f"{r} {t['up'] / 1e6:,.2f} / {t['down'] / 1e6:,.2f} MB" for r, t in s["traffic"]["by_region"].items())))
    if s.get("coverage"):
        t = s["coverage"]["totals"]
        rows.append(("tokens into the global model", f"{t['tokens_merged']:,} of {t['tokens_trained']:,} trained; "
                                                     f"twice {t['tokens_twice']:,}, lost {t['tokens_lost']:,}"))
    if s["rejections"]:
        rows.append(("rejections by reason", ", ".join(f"{k} {v}" for k, v in s["rejections"].items())))
    return rows


def run_warnings(s: dict) -> list[str]:
    """What to tell an operator about a finished run: a global model worse than it started, or
    contributions the syncer never read."""
    out = []
    if s["eval_loss_end"] > s["eval_loss_start"]:
        out.append(f"the held-out loss ROSE from {s['eval_loss_start']:.4f} to {s['eval_loss_end']:.4f}: the run "
                   "made the global model worse. Check the merge settings (preset, outer.lr, syncer.merge) and the "
                   "inner learning rate; docs/bench.md lists the measured ones")
    if unread := s["contributions"].get("unread"):
        out.append(f"{unread} published contributions were never read: the syncer stopped before it caught up with "
                   "the log (its log says 'stopped before catching up'; raise syncer.drain_timeout_s, or look for "
                   "a slow broker). They stay in Kafka and a later syncer of the run replays them")
    return out


def summary_table(s: dict) -> Table:
    t = Table(title=f"summary of {s['run_id']} ({s['wall_s']:.0f}s)", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    for row in summary_rows(s):
        t.add_row(*row)
    return t
