"""Telemetry pipeline: a run's events (heartbeats, acceptances, rejections, merges) to a report.

    events topic --(export_events)--> events.jsonl --Beam: RunReport--> tables --(finalise)--> JSON, CSV, PNG

Definitions, all from the events alone:
- a contribution is *merged* when its id is in a `merge` event's ids; its *staleness* is the number of
  versions its fragment moved between the contribution's base and the merge (0 = on time, >0 = late);
- a learner's *goodput* is the tokens of its merged contributions over the tokens it trained, per
  fragment: every contribution to fragment p hands in all tokens trained since p's last sync, so a
  learner whose every delta was merged contributes (fragments x tokens trained) and scores 1;
- a merge's *latency* is from the first acceptance of any contribution in it to the merge event,
  an upper bound on quorum-to-announcement that the events can show.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections import Counter

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from diloco import coverage, membership, messages
from diloco.pipelines.corpus import (
    WriteJsonLines,
    read_json_lines,
    remove_tree,
    write_bytes,
)

EVENT_SCHEMA = 1
NS = "telemetry"
PARTS = ".parts"
UNKNOWN = "(unknown)"  # learner or region of a record that does not say whose it was
TABLES = ("learners", "regions", "merges", "staleness", "latency", "rejections", "loss", "kinds", "span", "fragments",
          "membership", "merge_records", "handed_in")


def _count(v) -> int:
    """A count a beat claims, or 0 when it is not one."""
    return v if messages.is_count(v) and 0 <= v < 2**63 else 0


# --- the Kafka edge ----------------------------------------------------------------------------------

def export_events(cfg, run_id: str, path: str, *, timeout_s: float = 60.0) -> int:
    """Copy `<prefix>.<run>.events` partition 0, offset 0 up to the high watermark, to a JSONL file.

    The end is the high watermark that fetch responses carry: the local broker's end_offsets() is
    wrong (see NOTES). Returns the number of records copied.
    """
    from diloco.infra import kafka as kafka_io

    tp = (kafka_io.Topics.for_run(cfg, run_id).events, 0)
    c = kafka_io.consumer(cfg.transport)
    n, deadline = 0, time.time() + timeout_s
    try:
        c.assign({tp: 0})
        with FileSystems.create(path, mime_type="application/jsonl", compression_type="uncompressed") as out:
            while True:
                for rec in c.poll(timeout_ms=200).get(tp, []):
                    out.write(rec.value.rstrip(b"\n") + b"\n")
                    n += 1
                hw = c.highwater(tp)
                if hw is not None and c.position(tp) >= hw:
                    return n
                if time.time() > deadline:
                    raise kafka_io.TransportError(
                        f"{tp[0]}: read {n} records but did not reach the high watermark ({hw}) in {timeout_s:.0f}s; "
                        "does the topic exist?")
    finally:
        c.close()


# --- the pipeline ----------------------------------------------------------------------------------

class ParseEvent(beam.DoFn):
    """A JSON line -> an event dict of this run; anything else is counted and dropped."""

    def __init__(self, run_id: str | None):
        self.run_id = run_id
        self.events = Metrics.counter(NS, "events")
        self.malformed = Metrics.counter(NS, "malformed")
        self.other_run = Metrics.counter(NS, "other_run")

    def process(self, line: str):
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            self.malformed.inc()
            return
        if not (isinstance(ev, dict) and ev.get("schema") == EVENT_SCHEMA and isinstance(ev.get("kind"), str)
                and isinstance(ev.get("time"), (int, float))):
            self.malformed.inc()
            return
        if self.run_id is not None and ev.get("run") != self.run_id:
            self.other_run.inc()
            return
        self.events.inc()
        yield ev


def _of(*kinds: str):
    return lambda ev: ev["kind"] in kinds


def _reject_key(ev: dict) -> str:
    """Rejections of unidentifiable records still count, each on its own."""
    if ev.get("id"):
        return ev["id"]
    return f"(no id) {json.dumps(ev.get('where'), sort_keys=True)} {ev['time']!r}"


class ResolveOutcome(beam.DoFn):
    """All events about one contribution id -> one outcome: merged, rejected or pending."""

    def __init__(self):
        self.without_acceptance = Metrics.counter(NS, "merged_without_acceptance")

    def process(self, element):
        cid, g = element
        acc = min(g["accepted"], key=lambda e: e["time"], default=None)
        merge = min(g["merged"], key=lambda e: e["time"], default=None)
        rejects = sorted(g["rejected"], key=lambda e: e["time"])
        src = acc or (rejects[0] if rejects else {})
        learner = src.get("learner")
        if merge is not None and acc is None:
            self.without_acceptance.inc()
            learner = learner or merge["learners"][merge["ids"].index(cid)]
        base = src.get("base_version")
        out = {"id": cid if (acc or merge or src.get("id")) else None, "learner": learner or UNKNOWN,
               "region": src.get("region") or UNKNOWN, "fragment": src.get("fragment", merge and merge["fragment"]),
               "base_version": base, "tokens": acc["tokens"] if acc else 0, "bytes": acc["bytes"] if acc else 0,
               "accepted_at": acc["time"] if acc else None, "status": "pending", "reason": None,
               "merged_version": None, "merged_at": None, "staleness": None}
        if merge is not None:
            out |= {"status": "merged", "merged_version": merge["version"], "merged_at": merge["time"],
                    "staleness": None if base is None else merge["version"] - 1 - base}
        elif rejects:
            out |= {"status": "rejected", "reason": rejects[-1]["reason"]}
        yield out


class ContributionOutcomes(beam.PTransform):
    """Events -> one outcome per contribution, joining acceptances, rejections and merges by id."""

    def expand(self, events):
        accepted = (events | "Accepted" >> beam.Filter(_of("contribution_accepted"))
                    | "KeyAccepted" >> beam.Map(lambda e: (e["id"], e)))
        rejected = (events | "Rejected" >> beam.Filter(_of("contribution_rejected"))
                    | "KeyRejected" >> beam.Map(lambda e: (_reject_key(e), e)))
        merged = (events | "Merges" >> beam.Filter(_of("merge"))
                  | "KeyMergedIds" >> beam.FlatMap(lambda e: [(cid, e) for cid in e["ids"]]))
        return ({"accepted": accepted, "rejected": rejected, "merged": merged}
                | "JoinById" >> beam.CoGroupByKey()
                | "Resolve" >> beam.ParDo(ResolveOutcome()))


def _goodput(merged: int, trained: int, fragments: int) -> float | None:
    return merged / (fragments * trained) if trained and fragments else None


def over_incarnations(heartbeats, counter: str) -> int:
    """A learner's counter that restarts from zero with each incarnation: the sum of every
    incarnation's largest value (a restarted learner's sends and reads add to its earlier ones)."""
    best: dict[str, int] = {}
    for h in heartbeats:
        inc = h.get("incarnation", "")
        best[inc] = max(best.get(inc, 0), h.get(counter, 0))
    return sum(best.values())


def learner_row(element, fragments: int) -> dict:
    learner, g = element
    hbs = sorted(g["heartbeats"], key=lambda e: e["time"])
    outs = g["outcomes"]
    last = hbs[-1] if hbs else {}
    merged = [o for o in outs if o["status"] == "merged"]
    trained = over_incarnations(hbs, "tokens")
    tokens_merged = sum(o["tokens"] for o in merged)
    return {
        "learner": learner,
        "region": last.get("region") or next((o["region"] for o in outs), UNKNOWN),
        "steps": max((h.get("step", 0) for h in hbs), default=0),
        "finished": last.get("state") == "finished",
        "final_loss": last.get("loss"),
        "tokens_trained": trained,
        "tokens_contributed": sum(o["tokens"] for o in outs),
        "tokens_merged": tokens_merged,
        "goodput": _goodput(tokens_merged, trained, fragments),
        "contributions": sum(1 for o in outs if o["accepted_at"] is not None),
        "merged": len(merged),
        "late": sum(1 for o in merged if (o["staleness"] or 0) > 0),
        "pending": sum(1 for o in outs if o["status"] == "pending"),
        "rejected": sum(1 for o in outs if o["status"] == "rejected"),
        "rejected_by_reason": dict(sorted(Counter(o["reason"] for o in outs if o["status"] == "rejected").items())),
        "staleness": {str(k): v for k, v in sorted(Counter(o["staleness"] for o in merged
                                                             if o["staleness"] is not None).items())},
        "bytes_sent": over_incarnations(hbs, "bytes_sent"),
        "bytes_fetched": over_incarnations(hbs, "bytes_fetched"),
        "bytes_accepted": sum(o["bytes"] for o in outs),
        "versions_applied": over_incarnations(hbs, "versions_applied"),
    }


SUMMED = ("tokens_trained", "tokens_contributed", "tokens_merged", "contributions", "merged", "late", "pending",
          "rejected", "bytes_sent", "bytes_fetched", "bytes_accepted")


def region_row(element, fragments: int) -> dict:
    region, rows = element
    rows = list(rows)
    out = {"region": region, "learners": len(rows), **{k: sum(r[k] for r in rows) for k in SUMMED}}
    for field in ("rejected_by_reason", "staleness"):
        total: Counter = Counter()
        for r in rows:
            total.update(r[field])
        out[field] = dict(sorted(total.items()))
    out["goodput"] = _goodput(out["tokens_merged"], out["tokens_trained"], fragments)  # pooled over its learners
    return out


class PerLearner(beam.PTransform):
    """(heartbeats, outcomes) -> a row per learner; needs the fragment count as a side input."""

    def __init__(self, fragments):
        super().__init__()
        self.fragments = fragments

    def expand(self, pcolls):
        heartbeats = pcolls["heartbeats"] | "KeyHeartbeats" >> beam.Map(lambda e: (e["learner"], e))
        outcomes = (pcolls["outcomes"]
                    | "Attributed" >> beam.Filter(lambda o: o["learner"] != UNKNOWN)  # these stay in `rejections`
                    | "KeyOutcomes" >> beam.Map(lambda o: (o["learner"], o)))
        return ({"heartbeats": heartbeats, "outcomes": outcomes}
                | "JoinByLearner" >> beam.CoGroupByKey()
                | "LearnerRow" >> beam.Map(learner_row, fragments=self.fragments))


class PerRegion(beam.PTransform):
    def __init__(self, fragments):
        super().__init__()
        self.fragments = fragments

    def expand(self, learners):
        return (learners
                | "KeyByRegion" >> beam.Map(lambda r: (r["region"], r))
                | "GroupRegion" >> beam.GroupByKey()
                | "RegionRow" >> beam.Map(region_row, fragments=self.fragments))


def timeline_row(element) -> list[dict]:
    (fragment, version), g = element
    if not g["merge"]:
        return []
    m = min(g["merge"], key=lambda e: e["time"])
    first = min(g["first_accepted"], default=None)
    return [{"time": m["time"], "fragment": fragment, "version": version, "contributions": len(m["ids"]),
             "learners": sorted(set(m.get("learners", []))), "tokens": m.get("tokens"), "late": m.get("late"),
             "reason": m.get("reason"), "seconds": m.get("seconds"),
             "latency_s": None if first is None else m["time"] - first}]


class MergeTimeline(beam.PTransform):
    """(events, outcomes) -> a row per merge (outer step), with its latency from first acceptance."""

    def expand(self, pcolls):
        merges = (pcolls["events"] | "Merges" >> beam.Filter(_of("merge"))
                  | "KeyMerge" >> beam.Map(lambda e: ((e["fragment"], e["version"]), e)))
        first = (pcolls["outcomes"]
                 | "MergedAccepted" >> beam.Filter(lambda o: o["status"] == "merged" and o["accepted_at"] is not None)
                 | "KeyByMerge" >> beam.Map(lambda o: ((o["fragment"], o["merged_version"]), o["accepted_at"]))
                 | "FirstAccepted" >> beam.CombinePerKey(min))
        return ({"merge": merges, "first_accepted": first}
                | "JoinByVersion" >> beam.CoGroupByKey()
                | "TimelineRow" >> beam.FlatMap(timeline_row))


def percentiles(element) -> dict:
    scope, values = element
    v = np.asarray(sorted(values), dtype=np.float64)
    return {"scope": scope, "count": int(v.size), "mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
            "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99)), "max": float(v.max())}


class LatencyPercentiles(beam.PTransform):
    """Merge rows -> latency percentiles overall ("all") and per fragment ("fragment N")."""

    def expand(self, merges):
        return (merges
                | "WithLatency" >> beam.Filter(lambda r: r["latency_s"] is not None)
                | "Scopes" >> beam.FlatMap(lambda r: [("all", r["latency_s"]), (f"fragment {r['fragment']}", r["latency_s"])])
                | "GroupScope" >> beam.GroupByKey()
                | "Percentiles" >> beam.Map(percentiles))


def span(pairs) -> tuple[float, float]:
    """(first, last) event time; associative, so runners may combine partial spans."""
    pairs = list(pairs)
    return min(p[0] for p in pairs), max(p[1] for p in pairs)


def fragment_hint(ev: dict) -> list[int]:
    if ev["kind"] in ("syncer_started", "syncer_stopped") and isinstance(ev.get("versions"), dict):
        return [len(ev["versions"])]
    if ev["kind"] in ("contribution_accepted", "merge") and isinstance(ev.get("fragment"), int):
        return [ev["fragment"] + 1]
    return []


class DropRepeatedEvents(beam.PTransform):
    """Events are delivered at least once (a restarted syncer re-sends its outbox): keep one per eid."""

    def expand(self, events):
        return (events
                | "KeyByEid" >> beam.Map(lambda e: (e.get("eid") or json.dumps(e, sort_keys=True), e))
                | "GroupByEid" >> beam.GroupByKey()
                | "FirstOfEach" >> beam.MapTuple(lambda _, es: next(iter(es))))


class RunReport(beam.PTransform):
    """Parsed events -> the report's tables, each a PCollection of dicts (see TABLES)."""

    def __init__(self, fragments: int = 0):
        super().__init__()
        self.fragments = fragments  # fallback when no event says how many fragments the run has

    def expand(self, events):
        fallback = self.fragments
        fragments = (events | "FragmentHints" >> beam.FlatMap(fragment_hint)
                     | "FragmentCount" >> beam.CombineGlobally(lambda xs: max(xs, default=fallback)))
        n_frag = beam.pvalue.AsSingleton(fragments)
        heartbeats = events | "Heartbeats" >> beam.Filter(lambda e: e["kind"] == "heartbeat" and e.get("learner"))
        outcomes = events | "Outcomes" >> ContributionOutcomes()
        learners = {"heartbeats": heartbeats, "outcomes": outcomes} | "PerLearner" >> PerLearner(n_frag)
        merges = {"events": events, "outcomes": outcomes} | "Timeline" >> MergeTimeline()
        return {
            "learners": learners,
            "regions": learners | "PerRegion" >> PerRegion(n_frag),
            "merges": merges,
            "latency": merges | "Latency" >> LatencyPercentiles(),
            "staleness": (outcomes | "MergedStaleness" >> beam.FlatMap(
                              lambda o: [o["staleness"]] if o["status"] == "merged" and o["staleness"] is not None else [])
                          | "CountLag" >> beam.combiners.Count.PerElement()
                          | "LagRow" >> beam.MapTuple(lambda lag, n: {"lag": lag, "count": n})),
            "rejections": (outcomes | "RejectReasons" >> beam.FlatMap(
                               lambda o: [(o["reason"], o["learner"])] if o["status"] == "rejected" else [])
                           | "CountReasons" >> beam.combiners.Count.PerElement()
                           | "ReasonRow" >> beam.MapTuple(lambda k, n: {"reason": k[0], "learner": k[1], "count": n})),
            "loss": heartbeats | "LossRow" >> beam.Map(lambda e: {
                "time": e["time"], "learner": e["learner"], "region": e.get("region"), "step": e.get("step"),
                "loss": e.get("loss"), "tokens": e.get("tokens")}),
            "kinds": (events | "Kind" >> beam.Map(lambda e: e["kind"])
                      | "CountKinds" >> beam.combiners.Count.PerElement()
                      | "KindRow" >> beam.MapTuple(lambda k, n: {"kind": k, "count": n})),
            "span": (events | "Times" >> beam.Map(lambda e: (e["time"], e["time"]))
                     | "Span" >> beam.CombineGlobally(span).without_defaults()
                     | "SpanRow" >> beam.MapTuple(lambda start, end: {"start": start, "end": end})),
            "fragments": fragments | "FragmentRow" >> beam.Map(lambda n: {"fragments": n}),
            # the coverage ledger's inputs (diloco.coverage, computed once all are read)
            "merge_records": (events | "MergeEvents" >> beam.Filter(lambda e: e["kind"] == "merge")
                              | "MergeRecord" >> beam.Map(lambda e: {k: e.get(k) for k in (
                                  "fragment", "version", "learners", "tokens", "tokens_each", "cursors")})),
            "handed_in": (heartbeats
                          | "HandedInByIncarnation" >> beam.Map(lambda e: ((e["learner"], str(e.get("incarnation"))),
                                                                          _count(e.get("handed_in_tokens"))))
                          | "LatestHandedIn" >> beam.CombinePerKey(max)
                          | "ByLearner" >> beam.MapTuple(lambda k, n: (k[0], n))
                          | "SumHandedIn" >> beam.CombinePerKey(sum)
                          | "HandedInRow" >> beam.MapTuple(lambda lid, n: {"learner": lid, "handed_in_tokens": n})),
            "membership": (events | "MembershipChanges" >> beam.Filter(lambda e: e["kind"] in membership.CHANGES)
                           | "ChangeRow" >> beam.Map(lambda e: {"time": e["time"], "kind": e["kind"],
                                                                "learner": e.get("learner")})),
        }


# --- running it ------------------------------------------------------------------------------------

def report(events_path: str, output: str, *, run_id: str | None, fragments: int = 0,
           pipeline_args: list[str] | None = None) -> dict:
    """Run the telemetry pipeline over a JSONL events file; write the report under `output`."""
    parts = FileSystems.join(output, PARTS)
    p = beam.Pipeline(options=PipelineOptions(pipeline_args if pipeline_args is not None else ["--runner=FnApiRunner"]))
    tables = (p
              | "ReadEvents" >> beam.io.ReadFromText(events_path)
              | "Parse" >> beam.ParDo(ParseEvent(run_id))
              | "Dedupe" >> DropRepeatedEvents()
              | "Report" >> RunReport(fragments))
    for name in TABLES:
        _ = tables[name] | f"Write_{name}" >> WriteJsonLines(FileSystems.join(parts, f"{name}.jsonl"))
    result = p.run()
    result.wait_until_finish()
    counts = {r.key.metric.name: r.committed for r in result.metrics().query()["counters"]
              if r.key.metric.namespace == NS}
    return finalise(output, run_id, counts)


def finalise(output: str, run_id: str | None, counts: dict) -> dict:
    parts = FileSystems.join(output, PARTS)
    t = {name: read_json_lines(FileSystems.join(parts, f"{name}.jsonl")) for name in TABLES}
    remove_tree(parts)
    learners = sorted(t["learners"], key=lambda r: r["learner"])
    regions = sorted(t["regions"], key=lambda r: r["region"])
    merges = sorted(t["merges"], key=lambda r: (r["time"], r["fragment"], r["version"]))
    span = t["span"][0] if t["span"] else {"start": None, "end": None}
    fragments = t["fragments"][0]["fragments"] if t["fragments"] else 0
    totals = {k: sum(r[k] for r in learners) for k in SUMMED}
    totals["goodput"] = _goodput(totals["tokens_merged"], totals["tokens_trained"], fragments)
    totals["merges"] = len(merges)
    totals["rejected_unattributed"] = sum(r["count"] for r in t["rejections"] if r["learner"] == UNKNOWN)
    latency = {r.pop("scope"): r for r in sorted(t["latency"], key=lambda r: r["scope"])}
    rep = {
        "run": run_id, "start": span["start"], "end": span["end"],
        "duration_s": None if span["start"] is None else span["end"] - span["start"],
        "fragments": fragments,
        "events": {r["kind"]: r["count"] for r in sorted(t["kinds"], key=lambda r: r["kind"])},
        "counts": dict(sorted(counts.items())),
        "totals": totals, "learners": learners, "regions": regions,
        "staleness": {str(r["lag"]): r["count"] for r in sorted(t["staleness"], key=lambda r: r["lag"])},
        "merge_latency_s": latency,
        "rejections": sorted(t["rejections"], key=lambda r: (r["reason"], r["learner"])),
        "merges": merges,
        # members over time: each learner from its first heartbeat (learner_joined) or admission until it
        # left, finished or was dropped (the events do not name the starting learners)
        "membership": membership.timeline([], t["membership"], start=span["start"]),
        "coverage": coverage.ledger(
            sorted(t["merge_records"], key=lambda m: (str(m.get("fragment")), str(m.get("version")))),
            fragments=fragments, trained={r["learner"]: r["tokens_trained"] for r in learners},
            handed_in={r["learner"]: r["handed_in_tokens"] for r in t["handed_in"]}),
    }
    join = lambda name: FileSystems.join(output, name)  # noqa: E731
    write_bytes(join("report.json"), json.dumps(rep, indent=1).encode())
    write_bytes(join("learners.csv"), _csv(learners, ("learner", "region")))
    write_bytes(join("regions.csv"), _csv(regions, ("region",)))
    write_bytes(join("merges.csv"), _csv(merges, ("time", "fragment", "version")))
    write_bytes(join("staleness.csv"), _csv([{"lag": k, "count": v} for k, v in rep["staleness"].items()], ("lag",)))
    write_bytes(join("rejections.csv"), _csv(rep["rejections"], ("reason", "learner")))
    write_bytes(join("coverage.csv"), _csv([{"learner": k, **v} for k, v in rep["coverage"]["learners"].items()],
                                           ("learner",)))
    loss = sorted(t["loss"], key=lambda r: (r["time"], r["learner"]))
    write_bytes(join("loss.csv"), _csv(loss, ("time", "learner")))
    for name, png in plots(rep, loss).items():
        write_bytes(join(name), png)
    return rep


def _csv(rows: list[dict], first: tuple[str, ...] = ()) -> bytes:
    buf = io.StringIO()
    if rows:
        fields = [k for k in first if k in rows[0]] + sorted(k for k in rows[0] if k not in first)
        w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    return buf.getvalue().encode()


def plots(rep: dict, loss: list[dict]) -> dict[str, bytes]:
    """PNG bytes by file name: loss and versions over time, goodput per learner, bytes per region."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = rep["start"] or 0.0

    def png(fig) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
        plt.close(fig)
        return buf.getvalue()

    out = {}
    fig, (ax_loss, ax_ver) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for lrn in sorted({r["learner"] for r in loss}):
        pts = [(r["time"] - t0, r["loss"]) for r in loss if r["learner"] == lrn and r["loss"] is not None]
        if pts:
            ax_loss.plot(*zip(*pts), label=lrn)
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize="small")
    for frag in sorted({m["fragment"] for m in rep["merges"]}):
        pts = [(m["time"] - t0, m["version"]) for m in rep["merges"] if m["fragment"] == frag]
        ax_ver.step(*zip(*pts), where="post", label=f"fragment {frag}")
    ax_ver.set_ylabel("global version")
    ax_ver.set_xlabel("seconds since the first event")
    ax_ver.legend(fontsize="small")
    out["loss_versions.png"] = png(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r["learner"] for r in rep["learners"]], [r["goodput"] or 0.0 for r in rep["learners"]])
    ax.set_ylabel("goodput (merged / trained tokens)")
    ax.set_ylim(0, 1.05)
    out["goodput.png"] = png(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r["region"] for r in rep["regions"]], [r["bytes_sent"] / 1e6 for r in rep["regions"]])
    ax.set_ylabel("MB sent by learners")
    out["bytes_by_region.png"] = png(fig)

    fig, ax = plt.subplots(figsize=(8, 3))
    pts = [(m["time"] - t0, m["members"]) for m in rep["membership"] if m["time"] is not None]
    if pts:
        ax.step(*zip(*pts), where="post")
    ax.set_ylabel("learners in the run")
    ax.set_xlabel("seconds since the first event")
    out["membership.png"] = png(fig)
    return out
