"""Load generator for the syncer (`python -m bench load`): M simulated learners with no JAX publish
pre-encoded int8 contributions of a chosen fragment size, at a chosen period and arrival jitter, to
the real broker, against real syncer processes (1 or more shards), Redis and TensorStore.

Each learner sends one contribution per fragment per period (fragments staggered across the period,
as learners' fragments are), based on the fragment's current version. One payload per fragment is
encoded once and shared (each contribution gets its own id, learner and manifest), so the generator
itself needs no model and little memory. Reported per setting: sustained merges/s, contribution
MB/s sent and merged, the syncer's lag (records behind the partitions' ends, from the offsets the
syncer saves every few seconds: an upper bound) at the start and end of the window, publish-to-merge latency p50/p99 (the merge event's time minus the send's ack),
store bytes per version, the syncer processes' peak RSS, and where the machine's cores went in the
window (CPU seconds per second of the syncer shards, the generator, the broker; the machine's busy
share; the syncer's share spent merging), which says whether a row that falls behind ran out of
syncer or of machine.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from diloco import messages
from diloco.config import Config, build_config, dump_config
from diloco.infra import kafka as kafka_io
from diloco.infra.kafka import LogError
from diloco.infra.jobs import LocalJobs
from diloco.infra.store import FragmentStore, Link
from diloco.plan import make_plan
from diloco.sim import capacity
from diloco.syncer import state as state_mod
from diloco.syncer.provision import provision

COLS = 1024


def _config(base: Config, *, params: int, learners: int, shards: int, fragments: int, store: str) -> Config:
    tree = base.model_dump(mode="json")
    tree |= {"regions": [{"name": "load", "learners": learners}]}
    tree["fragments"] |= {"count": fragments, "quantization": "int8"}
    tree["syncer"] |= {"shards": shards, "quorum": max(1, learners // 4), "grace_max_s": 0.2, "max_staleness": 1000,
                       "silent_after_s": 3600.0, "drop_after_s": 7200.0}
    tree["store"] = {**tree["store"], "url": store}
    tree["run"] |= {"id": f"load-{time.time_ns() % 10**10}"}
    return build_config(tree)


def _frames(manifest: messages.Manifest, payload: bytes, *, learner: str, base_version: int, chunk_bytes: int,
            ) -> tuple[str, list[bytes]]:
    """A new contribution (id, learner, base version) carrying an already encoded payload."""
    cid = os.urandom(16).hex()
    header = manifest.to_header() | {"id": cid, "learner": learner, "base_version": base_version,
                                     "created": time.time()}
    frames = [messages.frame(header)]
    for i in range(manifest.n_chunks):
        frames.append(messages.frame({"kind": "chunk", "id": cid, "index": i, "count": manifest.n_chunks},
                                     payload[i * chunk_bytes:(i + 1) * chunk_bytes]))
    return cid, frames


def _rss_peak_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (nan once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return math.nan


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _broker_pid() -> int | None:
    """The local broker's pid, where `diloco infra up` started it (else its CPU is not reported)."""
    try:
        return int((Path(".diloco/services") / "kafka.pid").read_text())
    except (OSError, ValueError):
        return None


def _lag(cfg: Config, state: state_mod.SyncerState, topics: kafka_io.Topics) -> int:
    """Records of the region topics the syncer has not consumed yet."""
    c = kafka_io.consumer(cfg.transport)
    try:
        tps = [tp for t in topics.fragments.values() for tp in kafka_io.partitions_of(t, topics.partitions)]
        ends = c.end_offsets(tps)
    finally:
        c.close()
    done = state.offsets()  # saved by the syncer every few seconds: an upper bound on its lag
    return sum(max(0, end - done.get(tp, 0)) for tp, end in ends.items())


def _provisioned(base: Config, tmp: str, *, params: int, learners: int, shards: int, fragments: int):
    """A new run of `fragments` fragments of `params` parameters provisioned (topics, plan, version 0),
    and one int8 payload per fragment encoded: (cfg, run id, state, topics, {fragment: (manifest,
    payload)}, config path)."""
    cfg = _config(base, params=params, learners=learners, shards=shards, fragments=fragments, store=f"file://{tmp}/store")
    run_id = cfg.run.id
    rows = max(1, params // COLS)
    tree = {f"f{p}.w": np.zeros((rows, COLS), np.float32) for p in range(fragments)}
    plan = make_plan(tree, fragments=fragments)
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    store = FragmentStore(cfg.store.url, run_id)
    producer = kafka_io.producer(cfg.transport)
    provision(cfg, run_id, state=state, store=store, producer=producer, plan=plan, initial=tree)
    topics = kafka_io.Topics.for_run(cfg, run_id)
    rng = np.random.default_rng(0)
    encoded = {}
    for p, names in enumerate(plan.fragment_names):
        deltas = {n: (1e-3 * rng.standard_normal(tree[n].shape)).astype(np.float32) for n in names}
        m, frames = messages.encode_contribution(run=run_id, learner="load-0", region="load", fragment=p, base_version=0,
                                                 tokens=1000, steps=10, step_time=0.1, deltas=deltas, scheme="int8",
                                                 chunk_bytes=cfg.fragments.chunk_bytes)
        encoded[p] = (m, b"".join(bytes(messages.parse_frame(f)[1]) for f in frames[1:]))
    del tree
    conf = Path(tmp) / "config.yaml"
    conf.write_text(dump_config(cfg))
    return cfg, run_id, state, topics, encoded, conf


def run_one(base: Config, *, params: int, learners: int, shards: int, seconds: float = 20.0, period_s: float = 2.0,
            jitter: float = 0.2, fragments: int = 3, senders: int = 4, logs: Path | None = None) -> dict:
    """One setting: provision, start the syncer shards, publish for `seconds`, drain, measure. Its
    store and logs live in a temporary folder, removed afterwards (they reach gigabytes)."""
    tmp = tempfile.mkdtemp(prefix="diloco-load-")
    jobs = LocalJobs(logs or Path(tmp) / "logs")
    try:
        return _run_one(base, tmp, jobs, params=params, learners=learners, shards=shards, seconds=seconds,
                        period_s=period_s, jitter=jitter, fragments=fragments, senders=senders)
    finally:
        jobs.stop_all()  # an error or a SIGTERM mid-run leaves no syncer shard behind
        _clean_up(base, tmp)


def _clean_up(base: Config, tmp: str) -> None:
    """Remove a row's store and logs, and its run's topics from the broker (a local broker keeps
    them in memory: a sweep's rows reached 11 GB)."""
    conf = Path(tmp) / "config.yaml"
    if conf.exists():
        cfg = build_config(yaml.safe_load(conf.read_text()))
        topics = kafka_io.Topics.for_run(cfg, cfg.run.id)
        kafka_io.delete_topics(cfg.transport, [*topics.fragments.values(), topics.outer, topics.events])
    shutil.rmtree(tmp, ignore_errors=True)


def _run_one(base: Config, tmp: str, jobs: LocalJobs, *, params: int, learners: int, shards: int, seconds: float,
             period_s: float, jitter: float, fragments: int, senders: int) -> dict:
    cfg, run_id, state, topics, encoded, conf = _provisioned(base, tmp, params=params, learners=learners, shards=shards,
                                                             fragments=fragments)
    for i in range(shards):
        jobs.start(f"syncer-{i}", ["syncer", "--config", str(conf), "--shard", str(i)])
    # the clock starts once every fragment has an owner: a fixed sleep, which a loaded machine outran
    # (no merge inside a 4 s window), measured the shards' start-up instead of their intake
    deadline = time.time() + 120
    while None in state.lease_holders(fragments).values():
        if time.time() > deadline:
            raise RuntimeError(f"the syncer shards did not claim all {fragments} fragments within 120 s")
        time.sleep(0.2)

    versions = dict(state.versions())
    sent: dict[str, float] = {}
    sent_bytes, last_ack = [0], [0.0]
    lock = threading.Lock()
    queue: list[tuple[float, str, int]] = []
    t0 = time.time() + 0.5
    ids = cfg.learner_ids()
    for lid in ids:
        offset = random.Random(lid).uniform(0, period_s)
        for p in range(fragments):
            heapq.heappush(queue, (t0 + offset + p * period_s / fragments, lid, p))
    stop_at = t0 + seconds
    behind = [0.0]
    failed = [0]

    def sender() -> None:
        prod = kafka_io.producer(cfg.transport)
        try:
            while True:
                with lock:
                    if not queue or queue[0][0] > stop_at:
                        return
                    due, lid, p = heapq.heappop(queue)
                    heapq.heappush(queue, (due + period_s * (1 + random.uniform(-jitter, jitter)), lid, p))
                wait = due - time.time()
                if wait > 0:
                    time.sleep(wait)
                else:
                    behind[0] = max(behind[0], -wait)
                m, payload = encoded[p]
                cid, frames = _frames(m, payload, learner=lid, base_version=versions.get(p, 0),
                                      chunk_bytes=cfg.fragments.chunk_bytes)
                try:
                    futs = [prod.send(topics.fragments["load"], f, key=str(p).encode(),
                                      partition=topics.partition_of(p)) for f in frames]
                    for f in futs:
                        f.get(timeout=60)
                except LogError:  # the broker is overloaded: count it and go on (the row says so)
                    with lock:
                        failed[0] += 1
                    continue
                with lock:
                    sent[cid] = time.time()
                    sent_bytes[0] += len(payload)
                    last_ack[0] = max(last_ack[0], time.time())
        finally:
            prod.close()

    def follow_versions() -> None:
        while time.time() < stop_at:
            versions.update(state.versions())
            time.sleep(0.2)

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
    threads.append(threading.Thread(target=follow_versions, daemon=True))
    for th in threads:
        th.start()
    time.sleep(max(0.0, t0 + 1.0 - time.time()))
    lag_start = _lag(cfg, state, topics)
    broker = _broker_pid()
    pids = {"syncer": [job.popen.pid for job in jobs.jobs.values()], "broker": [broker] if broker else []}
    cpu0 = {k: sum(_cpu_s(x) for x in v) for k, v in pids.items()} | {"generator": _self_cpu_s()}
    busy0, wall0, clock0 = *_machine_busy(), time.time()
    time.sleep(max(0.0, stop_at - time.time()))
    cpu1 = {k: sum(_cpu_s(x) for x in v) for k, v in pids.items()} | {"generator": _self_cpu_s()}
    busy1, wall1, clock1 = *_machine_busy(), time.time()
    lag_end = _lag(cfg, state, topics)
    cores = {k: (cpu1[k] - cpu0[k]) / (clock1 - clock0) for k in cpu0}  # the lag reads above are the generator's too
    machine_busy = (busy1 - busy0) / max(wall1 - wall0, 1)
    peak = {name: _rss_peak_mb(job.popen.pid) for name, job in jobs.jobs.items()}
    for th in threads:
        th.join(timeout=120)
    deadline = time.time() + 60  # the syncer takes in what was sent (its saved offsets may lag behind)
    while state.counters().get("accepted", 0) + state.counters().get("rejected", 0) < len(sent) \
            and time.time() < deadline:
        time.sleep(0.5)
    jobs.stop_all(timeout=60)

    window = [m for m in state.merges() if t0 <= m["time"] <= stop_at]
    events = [messages.parse_event(r.value) for r in kafka_io.read_to_end(cfg.transport, [(topics.events, 0)])]
    merged_at = {cid: e["time"] for e in events if e and e["kind"] == "merge" for cid in e["ids"]}
    # contributions sent in the last two periods may wait for a quorum that stopped coming: left out
    latency = [merged_at[c] - t for c, t in sent.items() if c in merged_at and t < stop_at - 2 * period_s]
    counters = state.counters()
    store = FragmentStore(cfg.store.url, run_id)
    merged = [Link(v, store.read_meta(p, v)) for p, held in store.catalog().items() for v in held.complete if v > 0]
    sizes = {(link.meta["fragment"], link.version): store.stored_nbytes(link.meta["fragment"], link.version)
             for link in merged}
    between = [(link.meta["fragment"], link.version) for link in merged if not link.snapshot]
    store_bytes = sum(sizes.values())
    update_bytes = sum(link.update_nbytes for link in merged)
    merged_bytes = sum(len(encoded[m["fragment"]][1]) * len(m["ids"]) for m in window)
    return {
        "mode": "live", "run": run_id, "params_per_fragment": max(1, params // COLS) * COLS, "learners": learners, "shards": shards, "fragments": fragments,
        "period_s": period_s, "seconds": seconds,
        "offered_mb_per_s": learners * fragments * len(encoded[0][1]) / period_s / 1e6,
        # over the time the sends took: a generator behind its schedule goes on past the window
        "sent_mb_per_s": sent_bytes[0] / max(seconds, last_ack[0] - t0) / 1e6, "sender_behind_s": round(behind[0], 3),
        "merges_per_s": len(window) / seconds, "merged_mb_per_s": merged_bytes / seconds / 1e6,
        "lag_records_start": lag_start, "lag_records_end": lag_end,
        "latency_p50_s": float(np.percentile(latency, 50)) if latency else math.nan,
        "latency_p99_s": float(np.percentile(latency, 99)) if latency else math.nan,
        "store_bytes_per_version": store_bytes / max(len(merged), 1),
        "update_bytes_per_version": update_bytes / max(len(merged), 1),
        "store_bytes_between_snapshots": sum(sizes[pv] for pv in between) / max(len(between), 1),
        "versions": len(merged),
        "syncer_peak_rss_mb": max(peak.values()),
        "cores": {k: round(v, 2) for k, v in cores.items()}, "machine_busy": round(machine_busy, 3),
        "cpu_count": os.cpu_count(),
        # the shards' summed merge seconds (merge math, outer step, store write) per second of the window
        "merging_cores": sum(e.get("seconds", 0.0) for e in events
                             if e and e["kind"] == "merge" and t0 <= e["time"] <= stop_at) / seconds,
        "accepted": counters.get("accepted", 0), "applied": counters.get("applied", 0),
        "rejected": counters.get("rejected", 0), "published": len(sent), "send_failures": failed[0],
    }


def drain_one(base: Config, *, params: int, learners: int, shards: int, seconds: float = 20.0, period_s: float = 2.0,
              fragments: int = 3, senders: int = 4, logs: Path | None = None,
              intake_mb_s: float | None = None,
              outer_ns_per_param: float = capacity.OUTER_NS_PER_PARAM) -> dict:
    """The syncer's own capacity: `seconds` of the setting's traffic published first, with no syncer
    running, then the shards started and timed from their first acceptance to the last decision.
    With the generator out of the way the syncer shares the machine only with the broker, so this is
    what one shard (or several) takes in when it has a core; the live rows are what it does beside a
    generator on the same cores. `predicted_syncer_core_s` is what the capacity plan's model
    (diloco.sim.capacity, at its per-core rates `intake_mb_s`, by default the rate of the client the
    shards read with, and `outer_ns_per_param`) says the drain costs: the check of `diloco simulate
    capacity` against the real syncer."""
    intake_mb_s = capacity.INTAKE_MB_S_BY_CLIENT[base.syncer.consumer] if intake_mb_s is None else intake_mb_s
    tmp = tempfile.mkdtemp(prefix="diloco-load-")
    jobs = LocalJobs(logs or Path(tmp) / "logs")
    try:
        cfg, run_id, state, topics, encoded, conf = _provisioned(base, tmp, params=params, learners=learners,
                                                                 shards=shards, fragments=fragments)
        work = [(lid, p) for _ in range(max(1, round(seconds / period_s))) for lid in cfg.learner_ids()
                for p in range(fragments)]
        random.Random(0).shuffle(work)
        lock, published = threading.Lock(), [0]

        def sender() -> None:
            prod = kafka_io.producer(cfg.transport)
            try:
                while True:
                    with lock:
                        if not work:
                            return
                        lid, p = work.pop()
                    m, payload = encoded[p]
                    _, frames = _frames(m, payload, learner=lid, base_version=0, chunk_bytes=cfg.fragments.chunk_bytes)
                    for f in [prod.send(topics.fragments["load"], f, key=str(p).encode(),
                                        partition=topics.partition_of(p)) for f in frames]:
                        f.get(timeout=120)
                    with lock:
                        published[0] += 1
            finally:
                prod.close()

        threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for i in range(shards):
            jobs.start(f"syncer-{i}", ["syncer", "--config", str(conf), "--shard", str(i)])
        pids = [job.popen.pid for job in jobs.jobs.values()]
        broker = _broker_pid()

        def decided() -> int:
            c = state.counters()
            return c.get("accepted", 0) + c.get("rejected", 0)

        deadline = time.time() + 120 + 60 * shards
        while decided() == 0 and time.time() < deadline:
            time.sleep(0.05)
        t0, cpu0, broker0 = time.time(), sum(_cpu_s(x) for x in pids), _cpu_s(broker) if broker else math.nan
        while decided() < published[0] and time.time() < deadline:
            time.sleep(0.05)
        elapsed = time.time() - t0
        cpu = sum(_cpu_s(x) for x in pids) - cpu0
        broker_cpu = (_cpu_s(broker) if broker else math.nan) - broker0
        peak = max(_rss_peak_mb(x) for x in pids)
        jobs.stop_all(timeout=60)
        counters = state.counters()
        payload_bytes = sum(len(encoded[p][1]) for p in encoded) / len(encoded)
        versions = len(state.merges())
        predicted = capacity.syncer_core_seconds(decided() * payload_bytes, versions, max(1, params // COLS) * COLS,
                                                 intake_mb_s=intake_mb_s, outer_ns_per_param=outer_ns_per_param)
        return {"mode": "drain", "versions": versions, "intake_mb_s": intake_mb_s, "syncer_core_s": cpu, "predicted_syncer_core_s": predicted, "run": run_id, "params_per_fragment": max(1, params // COLS) * COLS, "learners": learners,
                "shards": shards, "fragments": fragments, "published": published[0],
                "decided": decided(), "accepted": counters.get("accepted", 0), "applied": counters.get("applied", 0),
                "rejected": counters.get("rejected", 0), "seconds": elapsed,
                "taken_in_mb_per_s": decided() * payload_bytes / elapsed / 1e6,
                "merged_mb_per_s": counters.get("applied", 0) * payload_bytes / elapsed / 1e6,
                "merges_per_s": len(state.merges()) / elapsed,
                "syncer_cores": cpu / elapsed, "broker_cores": broker_cpu / elapsed, "syncer_peak_rss_mb": peak,
                "cpu_count": os.cpu_count()}
    finally:
        jobs.stop_all()
        _clean_up(base, tmp)


def client_ceiling(base: Config, *, megabytes: float = 300.0, partitions: int = 3,
                   client: str = "kafka-python") -> dict:
    """What one process moves through the Kafka client alone, with the learners' producer and the
    syncer's consumer settings (kafka_io) on `client`, in records of `fragments.chunk_bytes`: the
    most any generator or syncer shard can send or take in here, whatever it does with the bytes.
    Measured with nothing else running, on a throwaway topic."""
    t = base.transport
    topic = f"{base.transport.topic_prefix}.load-ceiling-{time.time_ns() % 10**10}"
    kafka_io.ensure_topics(t, {topic: partitions})
    record = os.urandom(base.fragments.chunk_bytes)
    n = max(partitions, int(megabytes * 1e6 / len(record)))
    prod = kafka_io.producer(t)
    start = time.perf_counter()
    futures = [prod.send(topic, record, partition=i % partitions) for i in range(n)]
    prod.flush()
    for f in futures:
        f.get(timeout=60)
    produce_s = time.perf_counter() - start
    prod.close()
    c = kafka_io.intake_consumer(t, client)
    try:
        c.assign({tp: 0 for tp in kafka_io.partitions_of(topic, partitions)})
        got, start, cpu = 0, time.perf_counter(), time.process_time()  # process time: the client's threads too
        deadline = start + 120
        while got < n * len(record) and time.perf_counter() < deadline:
            for records in c.poll(timeout_ms=200, max_records=500).values():
                got += sum(len(r.value) for r in records)
        consume_s, consume_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    finally:
        c.close()
        kafka_io.delete_topics(t, [topic])
    return {"client": client, "record_bytes": len(record), "records": n, "produce_mb_per_s": n * len(record) / produce_s / 1e6,
            "consume_mb_per_s": got / consume_s / 1e6, "consume_cores": consume_cpu_s / consume_s,
            "consume_mb_per_core_s": got / max(consume_cpu_s, 1e-9) / 1e6}


def intake_against_client(rows: list[dict], ceiling: dict) -> list[str]:
    """Each drain row's intake per core the syncer shards used, against what the Kafka client alone
    takes in per core of its process: the share of the client's speed the syncer's own work leaves."""
    client = ceiling["consume_mb_per_core_s"]
    out = []
    for r in rows:
        per_core = r["taken_in_mb_per_s"] / max(r["syncer_cores"], 1e-9)
        out.append(f"{r['params_per_fragment'] / 1e6:.1f}M x {r['shards']} shard(s): the syncer takes in "
                   f"{per_core:.0f} MB/s per core it used, {100 * per_core / client:.0f}% of "
                   f"{ceiling.get('client', 'kafka-python')} alone's {client:.0f} MB/s per core")
    return out


def sweep(base: Config, *, sizes, learners, shards, seconds: float, period_s: float, jitter: float,
          progress=print, drain: bool = False) -> list[dict]:
    rows = []
    for size in sizes:
        for m in learners:
            for s in shards:
                if drain:
                    row = drain_one(base, params=int(size), learners=m, shards=s, seconds=seconds, period_s=period_s)
                else:
                    row = run_one(base, params=int(size), learners=m, shards=s, seconds=seconds, period_s=period_s,
                                  jitter=jitter)
                progress(json.dumps(row))
                rows.append(row)
    return rows


def _markdown(columns: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def drain_table(rows: list[dict]) -> str:
    return _markdown(
        ["params / fragment", "learners", "shards", "backlog (contributions)", "drained in", "taken in MB/s", "merged MB/s",
         "merges/s", "cores used: syncer / broker", "syncer peak RSS",
         "syncer core-s: measured / capacity plan (ratio)"],
        [[f"{r['params_per_fragment'] / 1e6:.1f}M", str(r["learners"]), str(r["shards"]), str(r["published"]),
          f"{r['seconds']:.1f} s", f"{r['taken_in_mb_per_s']:.1f}", f"{r['merged_mb_per_s']:.1f}", f"{r['merges_per_s']:.2f}",
          f"{r['syncer_cores']:.2f} / {r['broker_cores']:.2f}", f"{r['syncer_peak_rss_mb']:.0f} MB",
          f"{r['syncer_core_s']:.2f} / {r['predicted_syncer_core_s']:.2f} "
          f"({r['predicted_syncer_core_s'] / max(r['syncer_core_s'], 1e-9):.2f})"] for r in rows])


def table(rows: list[dict]) -> str:
    return _markdown(
        ["params / fragment", "learners", "shards", "offered MB/s", "sent MB/s", "merged MB/s", "merges/s",
         "lag start -> end (records)", "publish->merge p50 / p99",
         "store bytes per version: all / between snapshots / update", "syncer peak RSS",
         "cores used: syncer (merging) / generator / broker", "machine busy"],
        [[f"{r['params_per_fragment'] / 1e6:.1f}M", str(r["learners"]), str(r["shards"]), f"{r['offered_mb_per_s']:.1f}",
          f"{r['sent_mb_per_s']:.1f}", f"{r['merged_mb_per_s']:.1f}", f"{r['merges_per_s']:.2f}",
          f"{r['lag_records_start']} -> {r['lag_records_end']}", f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} s",
          f"{r['store_bytes_per_version'] / 1e6:.2f} / {r['store_bytes_between_snapshots'] / 1e6:.2f} / "
          f"{r['update_bytes_per_version'] / 1e6:.2f} MB", f"{r['syncer_peak_rss_mb']:.0f} MB",
          f"{r['cores']['syncer']:.2f} ({r['merging_cores']:.2f}) / {r['cores']['generator']:.2f} / "
          f"{r['cores'].get('broker', math.nan):.2f}", f"{100 * r['machine_busy']:.0f}% of {r['cpu_count']}"] for r in rows])
