"""Topic monitoring: what is on a run's Kafka topics and how far the syncer has read them.

`TopicMonitor` follows every partition of the run's topics from the start of retention and keeps
running totals (`sample()`); `report(prev, cur, committed)` turns two samples and the syncer's
stored replay offsets into the figures, rates over the interval between the samples included.

High watermarks come from fetch responses (`consumer.highwater`): the local broker's end_offsets()
reports the start of the last batch, not the end of the partition.
"""

from __future__ import annotations

import copy
import time

from diloco import messages
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.infra.log import TP
from diloco.ops import OpsError
from diloco.syncer.records import partition_key


def _new_learner() -> dict:
    return {"contributions": 0, "frames": 0, "bytes": 0, "payload_bytes": 0, "fragments": {}}


class TopicMonitor:
    def __init__(self, cfg: Config, run_id: str):
        self.run_id = run_id
        self.topics = kafka_io.Topics.for_run(cfg, run_id)
        self.consumer = kafka_io.consumer(cfg.transport)
        try:
            existing = self.consumer.topics()
            wanted = self.topics.all()
            if not set(wanted) & existing:
                runs = sorted(t[len(cfg.transport.topic_prefix) + 1:-len(".events")] for t in existing
                              if t.startswith(cfg.transport.topic_prefix + ".") and t.endswith(".events"))
                raise OpsError(f"no topics of run {run_id!r} on {cfg.transport.bootstrap_servers}; runs there: "
                               f"{', '.join(runs) or 'none'}")
            self.tps = [tp for t, n in wanted.items() for tp in kafka_io.partitions_of(t, n)]
            self.consumer.assign({tp: 0 for tp in self.tps})
        except Exception:
            self.consumer.close()
            raise
        self.totals = {partition_key(tp):
                       {"messages": 0, "bytes": 0, "newest_ms": None, "malformed": 0} for tp in self.tps}
        self.learners: dict[str, dict[str, dict]] = {t: {} for t in self.topics.fragments.values()}
        self.kinds: dict[str, dict[str, int]] = {self.topics.events: {}, self.topics.outer: {}}
        self.announced: dict[str, int] = {}      # fragment -> newest version announced on the outer topic
        self._owner: dict[str, str] = {}          # contribution id -> learner: chunks carry only the id

    def close(self) -> None:
        self.consumer.close()

    def sample(self, timeout_s: float = 30.0) -> dict:
        """Read up to every partition's high watermark; return a copy of the running totals."""
        deadline = time.time() + timeout_s
        while True:
            for tp, records in self.consumer.poll(timeout_ms=200, max_records=2000).items():
                for rec in records:
                    self._account(tp, rec)
            hws = {tp: self.consumer.highwater(tp) for tp in self.tps}
            caught_up = all(hw is not None and self.consumer.position(tp) >= hw for tp, hw in hws.items())
            if caught_up or time.time() > deadline:
                break
        parts = copy.deepcopy(self.totals)
        for tp, hw in hws.items():
            parts[partition_key(tp)]["high_watermark"] = hw
        return {"run": self.run_id, "time": time.time(), "caught_up": caught_up, "partitions": parts,
                "learners": copy.deepcopy(self.learners), "kinds": copy.deepcopy(self.kinds),
                "announced": dict(self.announced)}

    def _account(self, tp: TP, rec) -> None:
        t = self.totals[partition_key(tp)]
        size = len(rec.key or b"") + len(rec.value or b"")
        t["messages"] += 1
        t["bytes"] += size
        if rec.timestamp is not None and rec.timestamp >= 0:
            t["newest_ms"] = max(t["newest_ms"] or 0, rec.timestamp)
        topic = tp[0]
        if topic in self.learners:
            try:
                h = messages.FrameHeader.from_header(messages.parse_frame(rec.value)[0])
            except messages.WireError:
                h = None
            if h is None or h.id is None:
                t["malformed"] += 1
                return
            if h.kind == "manifest":
                learner = self._owner[h.id] = str(h.learner)
                while len(self._owner) > 10_000:  # manifests whose last chunk never came: forget the oldest
                    self._owner.pop(next(iter(self._owner)))
            else:
                learner = self._owner.get(h.id, "unknown")
                if h.count is not None and h.index == h.count - 1:  # chunks come in order
                    self._owner.pop(h.id, None)
            row = self.learners[topic].setdefault(learner, _new_learner())
            row["frames"] += 1
            row["bytes"] += size
            if h.kind == "manifest":
                row["contributions"] += 1
                row["payload_bytes"] += h.total_bytes or 0
                frag = str(h.fragment)
                row["fragments"][frag] = row["fragments"].get(frag, 0) + 1
            return
        ev = messages.parse_event(rec.value)
        if ev is None:
            t["malformed"] += 1
            return
        kinds = self.kinds[topic]
        kinds[ev["kind"]] = kinds.get(ev["kind"], 0) + 1
        version = ev.get("version")
        if topic == self.topics.outer and ev["kind"] == "version":
            if not messages.is_count(version) or not 0 <= version < messages.MAX_COUNT:
                t["malformed"] += 1      # a forged or broken announcement: counted, not believed
                return
            p = str(ev.get("fragment"))[:20]
            self.announced[p] = max(self.announced.get(p, -1), version)


def _rate(cur: float, prev: float | None, dt: float) -> float | None:
    return (cur - prev) / dt if prev is not None and dt > 0 else None


def report(topics: kafka_io.Topics, prev: dict | None, cur: dict, committed: dict[tuple[str, int], int]) -> dict:
    """Per topic and partition: high watermark, syncer position and lag, totals, rates, newest message age;
    per fragments topic the traffic by learner; per JSON topic the records by kind."""
    dt = cur["time"] - prev["time"] if prev else 0.0
    region_of = {t: r for r, t in topics.fragments.items()}
    out = []
    for topic, n in topics.all().items():
        parts = []
        for p in range(n):
            key = partition_key((topic, p))
            c, before = cur["partitions"][key], prev["partitions"][key] if prev else None
            pos = committed.get((topic, p))
            hw = c["high_watermark"]
            parts.append({"partition": p, "high_watermark": hw, "committed": pos,
                          "lag": hw - pos if hw is not None and pos is not None else None,
                          "messages": c["messages"], "bytes": c["bytes"], "malformed": c["malformed"],
                          "messages_per_s": _rate(c["messages"], before and before["messages"], dt),
                          "bytes_per_s": _rate(c["bytes"], before and before["bytes"], dt),
                          "newest_age_s": cur["time"] - c["newest_ms"] / 1000 if c["newest_ms"] else None})
        row = {"topic": topic, "kind": "fragments" if topic in region_of else "outer" if topic == topics.outer
               else "events", "region": region_of.get(topic), "partitions": n, "by_partition": parts}
        for k in ("high_watermark", "committed", "lag", "messages_per_s", "bytes_per_s"):
            vals = [x[k] for x in parts]
            row[k] = None if any(v is None for v in vals) else sum(vals)
        for k in ("messages", "bytes", "malformed"):
            row[k] = sum(x[k] for x in parts)
        ages = [x["newest_age_s"] for x in parts if x["newest_age_s"] is not None]
        row["newest_age_s"] = min(ages) if ages else None
        if topic in region_of:
            row["learners"] = {}
            for lid, s in sorted(cur["learners"][topic].items()):
                was = None if prev is None else prev["learners"][topic].get(lid, {}).get("bytes", 0)
                row["learners"][lid] = {**s, "bytes_per_s": _rate(s["bytes"], was, dt)}
        else:
            row["records_by_kind"] = dict(sorted(cur["kinds"][topic].items()))
        out.append(row)
    return {"run": cur["run"], "time": cur["time"], "interval_s": dt,
            "caught_up": cur["caught_up"], "announced": dict(sorted((int(p), v) for p, v in cur["announced"].items())),
            "topics": out}
