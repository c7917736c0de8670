"""Prometheus metrics of the syncer and the learners, and the HTTP endpoint that serves them.

Each process object (a Syncer, a Session) holds its own registry, so several in one process (tests)
do not mix their figures; `serve` puts a registry on a port (monitoring.syncer_port + shard,
monitoring.learner_port_base + data shard), with extra pages beside /metrics (the syncer's status
page). The names are listed in docs/operations.md and used by infra/grafana/diloco.json.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# merges and their latencies: a tiny test round takes milliseconds, a production one minutes
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class SyncerMetrics:
    """What one syncer shard exports, per fragment it owns (the others report the rest)."""

    def __init__(self, shard: int):
        self.registry = r = CollectorRegistry()
        f = ["fragment"]
        self.version = Gauge("diloco_syncer_version", "current global version of the fragment", f, registry=r)
        self.round_size = Gauge("diloco_syncer_round_size", "contributions in the fragment's last merge", f, registry=r)
        self.pending = Gauge("diloco_syncer_round_pending", "contributions accepted into the open round", f, registry=r)
        self.merges = Counter("diloco_syncer_merges", "merges committed", f, registry=r)
        self.merge_seconds = Histogram("diloco_syncer_merge_seconds", "merge, outer step and store write of a round",
                                       f, buckets=SECONDS, registry=r)
        self.accept_to_merge = Histogram("diloco_syncer_accept_to_merge_seconds", "from a contribution's "
                                         "acceptance to the commit of the merge it entered", f, buckets=SECONDS,
                                         registry=r)
        self.rejections = Counter("diloco_syncer_rejections", "contributions and records rejected (fragment '-': "
                                  "the record named none)", ["fragment", "reason"], registry=r)
        self.lag = Gauge("diloco_syncer_consumer_lag", "records behind the partition's high watermark",
                         ["topic", "partition"], registry=r)
        self.outbox = Gauge("diloco_syncer_outbox_depth", "records waiting in the Redis outbox", registry=r)
        self.lease = Gauge("diloco_syncer_lease_held", "1 while this shard holds the fragment's lease", f, registry=r)
        self.epoch = Gauge("diloco_syncer_lease_epoch", "fencing epoch this shard holds for the fragment", f,
                           registry=r)
        self.learners = Gauge("diloco_syncer_learners", "learners in the registry by liveness", ["status"], registry=r)
        Gauge("diloco_syncer_shard", "this process's shard", registry=r).set(shard)

    def held(self, fragments: int, owned: dict, epochs: dict[int, int], lag: dict[tuple, int], outbox: int,
             learners: dict[str, int]) -> None:
        """What the shard holds now, per owned fragment (`owned`: its state, with its version and open
        round); those it no longer owns leave the gauges."""
        versions, pending = {p: st.version for p, st in owned.items()}, {p: len(st.round) for p, st in owned.items()}
        for p in range(fragments):
            self.lease.labels(p).set(p in versions)
        for gauge, values in ((self.version, versions), (self.pending, pending), (self.epoch, epochs)):
            set_all(gauge, {(p,): v for p, v in values.items()})
        set_all(self.lag, lag)
        self.outbox.set(outbox)
        for status, n in learners.items():
            self.learners.labels(status).set(n)

    def merged(self, p: int, contributions: int, seconds: float, waits: list[float]) -> None:
        """A committed merge of fragment p: its size, its time and each contribution's wait for it."""
        self.round_size.labels(p).set(contributions)
        self.merges.labels(p).inc()
        self.merge_seconds.labels(p).observe(seconds)
        for w in waits:
            self.accept_to_merge.labels(p).observe(max(w, 0.0))


class LearnerMetrics:
    """What one learner exports, labelled with its id. The figures are read from the learner when
    scraped (`read` returns them as a dict), so the training loop does nothing for them."""

    GAUGES = {"step": ("diloco_learner_step", "inner steps taken"),
              "loss": ("diloco_learner_loss", "training loss of the last step"),
              "step_time": ("diloco_learner_step_seconds", "inner step time (moving average)"),
              "queue": ("diloco_learner_publish_queue", "contributions waiting to be sent")}
    COUNTERS = {"tokens": ("diloco_learner_tokens", "tokens this process trained"),
                "bytes_sent": ("diloco_learner_sent_bytes", "bytes of contributions the broker acknowledged"),
                "bytes_fetched": ("diloco_learner_fetched_bytes", "bytes of global versions read from the store")}
    BEHIND = ("diloco_learner_versions_behind", "newest announced version of the fragment minus the one applied")

    def __init__(self, learner: str, read: Callable[[], dict]):
        self.learner, self.read = learner, read
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        values = self.read()
        for kinds, family in ((self.GAUGES, GaugeMetricFamily), (self.COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in kinds.items():
                m = family(name, doc, labels=["learner"])
                if values.get(key) is not None:
                    m.add_metric([self.learner], values[key])
                yield m
        m = GaugeMetricFamily(*self.BEHIND, labels=["learner", "fragment"])
        for p, behind in sorted(values.get("behind", {}).items()):
            m.add_metric([self.learner, str(p)], behind)
        yield m


def set_all(gauge: Gauge, values: dict[tuple, float]) -> None:
    """Make `values` (label values -> value) the gauge's whole content: other label sets leave it."""
    held = {tuple(sm.labels.values()) for mt in gauge.collect() for sm in mt.samples}
    for key in held - {tuple(map(str, k)) for k in values}:
        gauge.remove(*key)
    for key, value in values.items():
        gauge.labels(*key).set(value)


def names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry exports (counters with _total, histograms with _bucket...)."""
    return {s.name for m in registry.collect() for s in m.samples}


MAX_REQUESTS = 16      # served at once; more wait in the listen backlog, then are refused
REQUEST_TIMEOUT_S = 10  # a client that sends nothing (or reads nothing) this long is dropped


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per request, at most MAX_REQUESTS at a time; a slow or silent client times out."""
    daemon_threads = True
    request_queue_size = 32

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_REQUESTS)

    def process_request(self, request, client_address):
        # a slot frees within REQUEST_TIMEOUT_S of its request's arrival (then its client is dropped):
        # waiting twice that, a request is dropped only when the server stays full of live requests
        if not self._slots.acquire(timeout=2 * REQUEST_TIMEOUT_S):
            self.shutdown_request(request)
            return
        request.settimeout(REQUEST_TIMEOUT_S)
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a scrape a second must not fill the process's log
        pass


def serve(registry: CollectorRegistry, host: str, port: int,
          pages: dict[str, tuple[str, Callable[[], str]]] | None = None) -> _Server:
    """Serve /metrics from `registry` and each of `pages` (path -> (content type, body maker)) on
    host:port, from a daemon thread; `shutdown()` stops it. Raises OSError if the port is taken."""
    metrics = make_wsgi_app(registry)
    pages = pages or {}

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path not in pages:
            return metrics(environ, start_response)
        kind, body = pages[path]
        try:
            data, status = body().encode(), "200 OK"
        except Exception as err:  # e.g. Redis away: say so on the page, keep serving /metrics
            log.warning("page %s failed: %s: %s", path, type(err).__name__, err)
            data, status, kind = f"{type(err).__name__}: {err}".encode(), "503 Service Unavailable", "text/plain"
        start_response(status, [("Content-Type", f"{kind}; charset=utf-8"), ("Content-Length", str(len(data)))])
        return [data]

    server = make_server(host, port, app, server_class=_Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name=f"metrics-{port}").start()
    return server
