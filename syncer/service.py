"""A syncer shard as a process: connect to the services, serve the status page and metrics, poll
until stopped (SIGTERM or SIGINT), drain what was handed in, and hand the leases over."""

from __future__ import annotations

import logging
import signal
import time

from diloco import metrics as metrics_mod
from diloco import status as status_mod
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.infra import state as infra_state
from diloco.infra.store import FragmentStore
from diloco.syncer import state as state_mod
from diloco.syncer.syncer import Syncer

log = logging.getLogger(__name__)

DRAIN_SETTLE_S = 1.0  # on stop: how long the syncer must stay caught up before it believes it


def main(cfg: Config, run_id: str, shard: int = 0) -> None:
    """Entry point of one syncer shard's process (`diloco syncer`)."""
    r = state_mod.connect(cfg.state)
    producer = kafka_io.producer(cfg.transport)
    consumer = kafka_io.intake_consumer(cfg.transport, cfg.syncer.consumer,
                                        group_id=kafka_io.Topics.for_run(cfg, run_id).syncer_group)
    try:  # whatever stops it, at start too (the state lost, say): no client of it may linger, reconnecting
        syncer = Syncer(cfg, run_id, state=state_mod.SyncerState(r, cfg.state.key_prefix, run_id),
                        store=FragmentStore(cfg.store.url, run_id), producer=producer, consumer=consumer, shard=shard)
        if port := cfg.syncer_port(shard):
            serve(syncer, cfg.monitoring.host, port)
        run(syncer)
    finally:
        consumer.close()
        producer.close(timeout=10)  # a broker gone must not hold the exit forever


def run(syncer: Syncer) -> None:
    """Poll until a signal asks to stop, then until caught up, then stop cleanly (`Syncer.finish`).

    Caught up is judged by the high watermark of a fetch that may predate the last records (a
    learner's final hand-in just before the stop), so it is trusted only once it held over several
    fetches, for DRAIN_SETTLE_S. A shard that lags (a slow broker) may need far longer than the last
    learner's hand-in to catch up: it keeps reading for up to `syncer.drain_timeout_s`, and what it
    still left unread then is logged as an error and named in its `syncer_stopped` event. A Redis
    outage (a cluster mid-failover says CLUSTERDOWN or TRYAGAIN) is waited out and followed by a
    reload from durable state."""
    previous = {sig: signal.signal(sig, lambda *_: setattr(syncer, "stopping", True))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    syncer.start()
    stop_at = settled_at = None
    try:
        while True:
            try:
                syncer.step()
            except infra_state.OUTAGES as err:
                syncer.recover_from_redis_outage(err)
            if syncer.stopping:
                now = syncer.clock()
                stop_at = stop_at or now + syncer.cfg.syncer.drain_timeout_s
                settled_at = (settled_at or now) if syncer.caught_up() else None
                if (settled_at is not None and now - settled_at >= DRAIN_SETTLE_S) or now > stop_at:
                    break
        syncer.finish(caught_up=settled_at is not None)
    finally:
        syncer.ownership.keeper.halt()
        syncer.producer.flush()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def live_status(syncer: Syncer) -> dict:
    """The run's live status (diloco/status.py) as this shard sees it: Redis and its recent events."""
    snap = status_mod.snapshot(syncer.state, len(syncer.plan))
    return status_mod.build(syncer.cfg, syncer.run_id, snap, list(syncer.recent), time.time())


def serve(syncer: Syncer, host: str, port: int):
    """The shard's endpoint: /metrics, the status page at / and /status.json (diloco/status.py)."""
    server = metrics_mod.serve(syncer.metrics.registry, host, port, pages={
        "/": ("text/html", lambda: status_mod.html(live_status(syncer))),
        "/status.json": ("application/json", lambda: status_mod.to_json(live_status(syncer)))})
    log.info("metrics and status page served", extra={"url": f"http://{host}:{port}/", "shard": syncer.shard})
    return server
