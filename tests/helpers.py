"""Checks shared by the integration tests: what the broker, Redis, TensorStore and events say."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import numpy as np

from diloco import messages
from diloco.infra import kafka as kafka_io
from diloco.infra.store import FragmentStore
from diloco.syncer import state as state_mod
from diloco.plan import flatten
from diloco.spec import initial_plan, load_spec
from diloco.syncer.provision import provision
from diloco.syncer.syncer import Syncer


def published_manifests(cfg, run_id) -> list[messages.Manifest]:
    """Every contribution manifest on the region topics, read straight from the broker."""
    topics = kafka_io.Topics.for_run(cfg, run_id)
    tps = [tp for t in topics.fragments.values() for tp in kafka_io.partitions_of(t, topics.partitions)]
    out = []
    for rec in kafka_io.read_to_end(cfg.transport, tps):
        try:
            header, _ = messages.parse_frame(rec.value)
            if header.get("kind") == "manifest":
                out.append(messages.Manifest.from_header(header))
        except messages.WireError:   # a hostile record: it names no contribution the syncer could count
            continue
    return out


def run_events(cfg, run_id) -> list[dict]:
    topics = kafka_io.Topics.for_run(cfg, run_id)
    events = (messages.parse_event(r.value) for r in kafka_io.read_to_end(cfg.transport, kafka_io.partitions_of(topics.events, 1)))
    return [e for e in events if e is not None]   # a hostile record is not an event


def assert_exact_accounting(cfg, run_id, forged: Collection[str] = ()):
    """Every published contribution is applied once, or rejected once, or still pending; nothing else
    (an id that came with no valid manifest, if any, can only have been rejected). `forged`: the eids
    of events a test wrote to the events topic itself, which tell no story of the syncer's."""
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    published = {m.id for m in published_manifests(cfg, run_id) if len(m.id) <= 64}
    status = state.statuses()
    assert published <= set(status), sorted(published - set(status))[:5]
    assert all(s.startswith("rejected:") for cid, s in status.items() if cid not in published)
    merged = [cid for m in state.merges() for cid in m["ids"]]
    assert len(merged) == len(set(merged)), "a contribution entered two merges"
    applied = {cid for cid, s in status.items() if s.startswith("applied")}
    assert set(merged) == applied
    events = [e for eid, e in {e["eid"]: e for e in run_events(cfg, run_id)}.items()  # delivered at least once
              if eid not in set(forged)]
    ev_merged = [cid for e in events if e["kind"] == "merge" for cid in e["ids"]]
    ev_rejected = [e["id"] for e in events if e["kind"] == "contribution_rejected" and e["id"]]
    assert Counter(ev_merged) == Counter(merged)                   # events tell the same story, once each
    assert set(ev_rejected) == {cid for cid, s in status.items() if s.startswith("rejected")}
    # versions: Redis and TensorStore agree, with one complete TensorStore version per merge
    store = FragmentStore(cfg.store.url, run_id)
    counts = Counter(m["fragment"] for m in state.merges())
    for p, v in state.versions().items():
        assert v == counts[p]
        assert store.versions(p) == list(range(v + 1)) and store.read_committed(p) == v
    for m in state.merges():                                       # and merged the same contributions
        assert store.read_meta(m["fragment"], m["version"])["ids"] == m["ids"], (m["fragment"], m["version"])
    return state, published, status


class NoRecords:
    """The syncer's records of a run that has accepted nothing yet, for runner logic tested without
    services: where a learner resumes is read from these (diloco.resume), and there is nothing."""

    def pending(self, fragments: int) -> list[dict]:
        return []

    def merges_since(self, start: int) -> list[dict]:
        return []


OPEN_HARNESSES: list[Harness] = []  # closed after each test by conftest.py


class Harness:
    """A provisioned run fed crafted contributions; with `in_process`, its syncer runs in this process."""

    def __init__(self, cfg, run_id, in_process=True):
        self.cfg, self.run_id = cfg, run_id
        self.state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
        self.store = FragmentStore(cfg.store.url, run_id)
        self.producer = kafka_io.producer(cfg.transport)
        self.run_plan, tree = initial_plan(cfg, load_spec(cfg))
        self.params = {n: np.asarray(a) for n, a in flatten(tree, self.run_plan).items()}
        self.plan = self.run_plan.fragment_names
        provision(cfg, run_id, state=self.state, store=self.store, producer=self.producer, plan=self.run_plan,
                  initial=self.params)
        self.topics = kafka_io.Topics.for_run(cfg, run_id)
        self.sent = {}
        self.syncer = self.new_syncer() if in_process else None
        OPEN_HARNESSES.append(self)

    def close(self):
        """Stop this harness's syncer and close its Kafka clients: their threads would otherwise outlive
        the test, reconnecting to a broker the fixtures stopped (conftest closes every harness a test made)."""
        if self.syncer is not None:
            self.syncer.close()
            self.syncer.consumer.close()
            self.syncer = None
        self.producer.close(timeout=5)

    def new_syncer(self, shard=0):
        """A syncer started in this process; one that was running here stops first, as if it crashed."""
        if getattr(self, "syncer", None) is not None and self.syncer.shard == shard:
            self.syncer.close()
            self.syncer.consumer.close()
        s = Syncer(self.cfg, self.run_id, state=self.state, store=self.store, producer=self.producer,
                   consumer=kafka_io.consumer(self.cfg.transport, group_id=self.topics.syncer_group), shard=shard)
        s.start()
        return s

    def deltas(self, fragment, scale=0.01, seed=0):
        rng = np.random.default_rng(seed)
        return {n: (scale * rng.normal(size=self.params[n].shape)).astype(np.float32) for n in self.plan[fragment]}

    def publish(self, learner="us-0", fragment=0, base_version=0, deltas=None, tokens=512, steps=2, scheme="fp32",
                region=None, run=None, frames_filter=None, cursor=None, sign=None):
        m, frames = messages.encode_contribution(
            run=run or self.run_id, learner=learner, region=region or learner.split("-")[0], fragment=fragment,
            base_version=base_version, tokens=tokens, steps=steps, step_time=0.01,
            deltas=self.deltas(fragment) if deltas is None else deltas, scheme=scheme, chunk_bytes=2048, cursor=cursor)
        self.sent[m.id] = (region or learner.split("-")[0], fragment, frames)
        for f in (frames_filter(frames) if frames_filter else frames):  # sign(frame): its record headers
            self.producer.send(self.topics.fragments[region or learner.split("-")[0]], f,
                               partition=self.topics.partition_of(fragment), headers=sign(f) if sign else None)
        self.producer.flush()
        return m

    def resend(self, cid):
        region, fragment, frames = self.sent[cid]
        for f in frames:
            self.producer.send(self.topics.fragments[region], f, partition=self.topics.partition_of(fragment))
        self.producer.flush()
        return len(frames)

    def heartbeat(self, learner, **fields):
        self.producer.send(self.topics.events, messages.event(
            "heartbeat", run=self.run_id, source="learner", learner=learner, region=learner.split("-")[0],
            incarnation="test", state="running", **fields), partition=0)
        self.producer.flush()

    def raw(self, region, value, partition=0):
        self.producer.send(self.topics.fragments[region], value, partition=partition)
        self.producer.flush()

    def pump(self, until, timeout=20.0):
        deadline = time.time() + timeout
        while not until():
            assert time.time() < deadline, "syncer did not get there in time"
            self.syncer.step()

    def rounds(self, n: int, fragment: int = 0) -> list[str]:
        """n merges of `fragment` from its current version, each of two learners' deltas on the version
        before; the ids merged."""
        ids = []
        for _ in range(n):
            v = self.state.versions()[fragment]
            for learner, seed in (("us-0", v), ("eu-0", 10 + v)):
                ids.append(self.publish(learner, fragment, base_version=v, deltas=self.deltas(fragment, seed=seed)).id)
            self.pump(lambda v=v: self.state.versions()[fragment] == v + 1)
        return ids

    def events(self):
        self.producer.flush()
        recs = kafka_io.read_to_end(self.cfg.transport, kafka_io.partitions_of(self.topics.events, 1))
        return [messages.parse_event(r.value) for r in recs]


def run_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every process whose command line mentions `marker` (a run's directory)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if marker in cmd and stat.rsplit(")", 1)[1].split()[0] != "Z":  # zombies hold no resources
                out[int(d.name)] = cmd
    return out
