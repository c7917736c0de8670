"""Metrics and the status view, seen from outside: a real Prometheus server scrapes a live tiny run,
a headless Chromium renders the syncer's status page, `diloco status` prints it in a terminal, and
the Grafana dashboard asks only for metrics the code exports."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml
from conftest import TINY
from rich.console import Console
from typer.testing import CliRunner

from diloco import dashboard, metrics, status
from diloco.cli import app
from diloco.config import build_config, dump_config
from diloco.infra.jobs import LocalJobs
from diloco.infra.services import free_port
from diloco.pipelines.prepared import ensure_corpus
from diloco.run import child_env, provision_run
from diloco.syncer import service
from diloco.syncer import state as state_mod

DASHBOARD = Path(__file__).parent.parent / "infra" / "grafana" / "diloco.json"


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("the prometheus binary is not installed (Debian package `prometheus`: make system-deps)")
    return path


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, kafka_bootstrap, redis_url, data_dir, prometheus_bin):
    """A tiny run (us-0, eu-0) whose syncer and learners serve /metrics, scraped every second by a
    Prometheus server started here; yields once the learners finished (the syncer keeps serving)."""
    tmp = tmp_path_factory.mktemp("monitoring")
    syncer_port, learner_base, prom_port = free_port(), free_port(count=2), free_port()  # all distinct
    run_id = f"mon-{time.time_ns() % 10**8}"
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    # slowed to a tenth so each learner trains for ~25 s: a rate needs two scrapes in its window, which a
    # short-lived learner on a busy machine may not get
    tree |= {"regions": [{"name": "us", "learners": 1, "speed": 0.1}, {"name": "eu", "learners": 1, "speed": 0.1}],
             "transport": {"bootstrap_servers": kafka_bootstrap}, "state": {"redis_url": redis_url},
             "store": {"url": f"file://{tmp}/store"}, "outer": {"lr": 1.0, "momentum": 0.0},
             "monitoring": {"host": "127.0.0.1", "syncer_port": syncer_port, "learner_port_base": learner_base}}
    tree["data"] = {**tree["data"], "dir": str(data_dir)}
    tree["run"] = {**tree["run"], "dir": str(tmp / "runs"), "id": run_id}
    tree["inner"] = {**tree["inner"], "steps": 120}
    cfg = build_config(tree)
    conf = tmp / "config.yaml"
    conf.write_text(dump_config(cfg))
    targets = {"syncer": [f"127.0.0.1:{syncer_port}"],
               "learners": [f"127.0.0.1:{cfg.learner_port(lid)}" for lid in cfg.learner_ids()]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]} for job, t in targets.items()]}))
    prom = subprocess.Popen([prometheus_bin, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"))
    corpus = ensure_corpus(cfg.data.corpus, cfg.data.dir, learners=cfg.num_shards,
                           heldout_fraction=cfg.data.heldout_fraction, max_bytes=cfg.data.max_corpus_bytes, seed=0)
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    provision_run(cfg, run_id, state=state)
    jobs = LocalJobs(tmp / "logs", child_env(cfg))
    started = time.time()
    try:
        deadline = time.time() + 60
        while True:
            try:
                if get(f"http://127.0.0.1:{prom_port}/-/ready").startswith(b"Prometheus Server is Ready"):
                    break
            except OSError:
                pass
            assert time.time() < deadline and prom.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)
        jobs.start("syncer", ["syncer", "--config", str(conf)])
        deadline = time.time() + 300
        while "syncer started" not in jobs.jobs["syncer"].log.read_text():  # its merge kernels compile first
            assert time.time() < deadline and jobs.poll("syncer") is None, jobs.tail("syncer", 40)
            time.sleep(0.1)
        for lid in cfg.learner_ids():
            jobs.start(lid, ["learner", "--config", str(conf), "--learner", lid, "--corpus", str(corpus.dir)])
        for lid in cfg.learner_ids():
            assert jobs.wait(lid, timeout=300) == 0, jobs.tail(lid, 40)
        time.sleep(2.5)  # two more scrapes of the syncer (the last rounds wait for the final flush at its stop)
        yield {"cfg": cfg, "conf": conf, "syncer": f"http://127.0.0.1:{syncer_port}",
               "prometheus": f"http://127.0.0.1:{prom_port}", "jobs": jobs, "tmp": tmp,
               "started": started}
    finally:
        jobs.stop_all()
        prom.terminate()
        prom.wait(timeout=30)


def query(prometheus: str, expr: str) -> list[dict]:
    body = json.loads(get(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.integration
def test_prometheus_scrapes_the_syncer_and_every_learner(live_run):
    cfg, prom = live_run["cfg"], live_run["prometheus"]
    up = {r["metric"]["instance"]: r["value"][1] for r in query(prom, "up")}
    assert up[live_run["syncer"].removeprefix("http://")] == "1"
    (v0,) = query(prom, 'diloco_syncer_version{fragment="0"}')
    assert int(v0["value"][1]) > 0
    versions = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, cfg.run.id).versions()
    assert int(v0["value"][1]) == versions[0]     # the syncer is idle now: the scrape says what Redis says
    merges = {r["metric"]["fragment"]: int(float(r["value"][1])) for r in query(prom, "diloco_syncer_merges_total")}
    assert merges == {str(p): v for p, v in versions.items()}
    assert query(prom, "sum(diloco_syncer_lease_held)")[0]["value"][1] == str(cfg.fragments.count)
    (p99,) = query(prom, "histogram_quantile(0.99, sum(rate(diloco_syncer_merge_seconds_bucket[5m])) by (le))")
    assert 0 < float(p99["value"][1]) < 60
    # the learners stopped: their last scraped figures, per learner
    steps = {r["metric"]["learner"]: float(r["value"][1]) for r in query(prom, "max_over_time(diloco_learner_step[10m])")}
    assert set(steps) == set(cfg.learner_ids()) and all(0 < s <= cfg.inner.steps for s in steps.values())
    sent = query(prom, "max_over_time(diloco_learner_sent_bytes_total[10m])")
    assert len(sent) == 2 and all(float(r["value"][1]) > 0 for r in sent)
    # every learner was scraped while it trained, often enough for the dashboard's rates
    scrapes = {r["metric"]["learner"]: int(r["value"][1])
               for r in query(prom, "count_over_time(diloco_learner_tokens_total[10m])")}
    assert set(scrapes) == set(cfg.learner_ids()) and min(scrapes.values()) >= 5, scrapes


@pytest.mark.integration
def test_dashboard_is_drawn_from_the_scrape_without_grafana(live_run):
    cfg, prom, tmp = live_run["cfg"], live_run["prometheus"], live_run["tmp"]
    png = tmp / "dashboard.png"
    drawn = dashboard.render(prom, png, live_run["started"], time.time(), dashboard=DASHBOARD)
    assert list(drawn) == [p["title"] for p in sorted(json.loads(DASHBOARD.read_text())["panels"],
                                                      key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))]
    # what the run exported is drawn: one line per fragment, per learner, ...
    assert drawn["Fragment versions"] == cfg.fragments.count
    assert drawn["Learner step"] == drawn["Learner loss"] == len(cfg.learner_ids())
    assert drawn["Tokens per second"] == len(cfg.learner_ids()) + 1  # and the sum over them
    assert drawn["Bytes up / down per second"] == 2 * len(cfg.learner_ids())
    assert drawn["Leases and learners"] == 1 + 5          # one shard's leases; learners by each of 5 statuses
    assert drawn["Round size and outbox"] == 2 * cfg.fragments.count + 1
    assert drawn["Merge time p50 / p99"] >= 2 and drawn["Step time, queue, versions behind"] >= 2 * len(cfg.learner_ids())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)
    assert min(pixels.shape[:2]) > 500 and float(np.std(pixels[..., :3])) > 0.05
    if os.environ.get("DILOCO_DOCS_DASHBOARD"):  # how docs/dashboard.png was made
        shutil.copy(png, os.environ["DILOCO_DOCS_DASHBOARD"])
    # a query that matches nothing is a panel saying so; one Prometheus refuses is an error naming it
    board = tmp / "board.json"
    board.write_text(json.dumps({"panels": [{"title": "none", "targets": [{"expr": "diloco_no_such_metric"}]}]}))
    assert dashboard.render(prom, tmp / "none.png", time.time() - 60, time.time(), dashboard=board) == {"none": 0}
    board.write_text(json.dumps({"panels": [{"title": "bad", "targets": [{"expr": "sum(diloco_syncer_version"}]}]}))
    with pytest.raises(dashboard.DashboardError, match=re.escape(f"Prometheus at {prom}: query 'sum(diloco_syncer_version'")
                       + ".*parse error"):
        dashboard.render(prom, tmp / "bad.png", time.time() - 60, time.time(), dashboard=board)


@pytest.mark.integration
def test_status_page_renders_in_a_browser_and_in_the_terminal(live_run):
    cfg, url = live_run["cfg"], live_run["syncer"]
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian package `chromium`: make system-deps)")
    status = json.loads(get(url + "/status.json"))
    assert [m["id"] for m in status["members"]] == ["us-0", "eu-0"]
    assert all(m["state"] == "finished" for m in status["members"])
    assert [f["version"] for f in status["fragments"]] == [
        int(v) for _, v in sorted(state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix,
                                                        cfg.run.id).versions().items())]
    assert status["rounds"] and all(r["contributors"] and r["waited_s"] >= 0 for r in status["rounds"])
    page = get(url + "/").decode()
    assert "us-0" in page and "eu-0" in page and "<table id='rounds'>" in page
    browse = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
              "--window-size=1100,1200"]
    shot = live_run["tmp"] / "status.png"
    subprocess.run([*browse, f"--screenshot={shot}", url + "/"], check=True, capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1200, 1100) and float(np.std(pixels[..., :3])) > 0.02  # not one flat colour
    if os.environ.get("DILOCO_STATUS_PNG"):  # how docs/status.png was made
        shutil.copy(shot, os.environ["DILOCO_STATUS_PNG"])
    dom = subprocess.run([*browse, "--dump-dom", url + "/"], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    members = re.search(r"<table id=\"members\">(.*?)</table>", dom, re.S)
    assert members and "us-0" in members.group(1) and "eu-0" in members.group(1)
    out = subprocess.run([sys.executable, "-m", "diloco", "status", "--config", str(live_run["conf"])],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "us-0" in out.stdout and "eu-0" in out.stdout and "rounds" in out.stdout and "finished" in out.stdout


def exported_names() -> set[str]:
    """Every sample name the syncer and a learner export (a labelled metric shows its samples once
    it has a label set)."""
    syncer = metrics.SyncerMetrics(shard=0)
    for m in (syncer.version, syncer.round_size, syncer.pending, syncer.lease, syncer.epoch):
        m.labels("0").set(1)
    syncer.merges.labels("0").inc()
    syncer.merge_seconds.labels("0").observe(1)
    syncer.accept_to_merge.labels("0").observe(1)
    syncer.rejections.labels("0", "stale").inc()
    syncer.lag.labels("t", "0").set(0)
    syncer.learners.labels("alive").set(1)
    learner = metrics.LearnerMetrics("us-0", lambda: {"step": 1, "tokens": 1, "loss": 1.0, "step_time": 1.0,
                                                      "bytes_sent": 1, "bytes_fetched": 1, "queue": 0, "behind": {0: 0}})
    return metrics.names(syncer.registry) | metrics.names(learner.registry)


def test_dashboard_asks_only_for_exported_metrics():
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    used = {n for e in exprs for n in re.findall(r"\bdiloco_[a-z_]+\b", e)}
    exported = exported_names()
    assert used <= exported, sorted(used - exported)
    # every family the code defines is on the dashboard, in one form or another
    assert {n.removesuffix("_total").removesuffix("_bucket") for n in used} >= {
        "diloco_syncer_version", "diloco_syncer_merge_seconds", "diloco_syncer_rejections",
        "diloco_syncer_consumer_lag", "diloco_learner_step", "diloco_learner_loss", "diloco_learner_tokens",
        "diloco_learner_sent_bytes", "diloco_learner_fetched_bytes"}


def test_dashboard_queries_and_legends_are_filled_as_grafana_fills_them():
    assert dashboard.step_for(10) == 1 and dashboard.step_for(600) == 3 and dashboard.step_for(3600) == 18
    rate = "rate(x[$__rate_interval])"
    assert dashboard.substitute(rate, 1, 15) == "rate(x[60s])"              # 4 scrapes
    assert dashboard.substitute(rate, 120, 15) == "rate(x[135s])"           # a step and a scrape
    assert dashboard.substitute(rate, 1, 0.25) == "rate(x[1250ms])"
    assert dashboard.substitute("avg_over_time(x[${__interval}])", 18, 15) == "avg_over_time(x[18s])"
    with pytest.raises(dashboard.DashboardError, match=r"\$fragment, which only Grafana can fill"):
        dashboard.substitute('x{fragment="$fragment"}', 1, 15)
    _, panels = dashboard.load(DASHBOARD)  # every query of ours is one this tool can send
    assert all("$" not in dashboard.substitute(t.expr, 1, 15) for p in panels for t in p.targets)
    assert dashboard.legend("fragment {{fragment}}", {"fragment": "0"}) == "fragment 0"
    assert dashboard.legend("{{ topic }} / {{partition}}", {"topic": "t", "partition": "3"}) == "t / 3"
    assert dashboard.legend("up {{learner}}", {}) == "up "
    assert dashboard.legend("", {"__name__": "up", "job": "syncer", "instance": "h:1"}) == 'up{instance="h:1", job="syncer"}'
    assert dashboard.parse_duration("1h30m") == 5400 and dashboard.parse_duration("500ms") == 0.5
    with pytest.raises(dashboard.DashboardError, match="not a duration"):
        dashboard.parse_duration("10 minutes")
    assert dashboard.parse_time("2026-01-02T03:04:05") == dashboard.parse_time("2026-01-02T03:04:05+00:00") == 1767323045


def test_dashboard_command_names_the_server_and_query_it_could_not_ask(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    res = CliRunner().invoke(app, ["dashboard", "--prometheus", url, "--scrape-interval", "15s", "-o", str(tmp_path / "d.png")])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and f"Prometheus at {url}: query 'diloco_syncer_version': unreachable" in out, out
    assert not (tmp_path / "d.png").exists()
    res = CliRunner().invoke(app, ["dashboard", "--prometheus", url, "--since", "5m", "--start", "0", "-o", "d.png"])
    assert res.exit_code == 1 and "give --since or --start, not both" in res.output
    assert "legendFormat" in CliRunner().invoke(app, ["dashboard", "--help"]).output


def test_status_is_built_from_redis_and_recent_events():
    cfg = build_config({"regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 1}],
                        "syncer": {"silent_after_s": 5.0}})
    now = 1000.0
    snap = {"registry": {"us-0": {"seen": 999.0, "status": "alive", "step": 40, "tokens": 1280, "loss": 2.5, "region": "us"},
                         "eu-0": {"seen": 990.0, "status": "alive", "step": 30, "tokens": 960, "loss": 2.7, "region": "eu"}},
            "members": {}, "versions": {0: 3, 1: 2}, "counters": {"accepted": 9, "applied": 8, "rejected": 1,
                                                                  "merges": 5, "rejected:stale": 1},
            "merges": [{"fragment": 0, "version": 3, "learners": ["us-0", "eu-0"], "missing": [], "late": 0,
                        "reason": "all_arrived", "waited_s": 0.25, "tokens": 640, "time": 998.0}],
            "pending": {0: 1, 1: 0}, "leases": {0: "0:abc", 1: None}, "outbox": 2}
    events = [{"kind": "contribution_rejected", "id": "x1", "reason": "stale", "learner": "eu-0", "fragment": 1,
               "detail": "base version 0 older than 5 - 4", "time": 995.0}, {"kind": "merge", "time": 998.0}]
    st = status.build(cfg, "r1", snap, events, now)
    assert [(m["id"], m["state"], m["heartbeat_age_s"]) for m in st["members"]] == [
        ("us-0", "alive", 1.0), ("us-1", "no heartbeat", None), ("eu-0", "silent", 10.0)]
    assert st["fragments"] == [{"fragment": 0, "version": 3, "pending": 1, "owner": "0"},
                               {"fragment": 1, "version": 2, "pending": 0, "owner": "-"}]
    assert st["rounds"][0]["contributors"] == ["us-0", "eu-0"] and st["rounds"][0]["age_s"] == 2.0
    assert st["rejections"] == {"by_reason": {"stale": 1}, "recent": [
        {"id": "x1", "reason": "stale", "learner": "eu-0", "fragment": 1, "detail": "base version 0 older than 5 - 4",
         "age_s": 5.0}]}
    page = status.html(st)
    assert "<td>us-1</td><td>us</td><td>no heartbeat</td>" in page and "base version 0 older" in page
    json.loads(status.to_json(st))
    Console(file=io.StringIO()).print(*status.tables(st))


@pytest.mark.integration
def test_syncer_metrics_and_status_follow_its_rounds_and_rejections(tiny_config):
    from helpers import Harness

    h = Harness(tiny_config(), f"st-{time.time_ns() % 10**8}")
    h.heartbeat("us-0", step=10, tokens=320, loss=3.0)
    h.rounds(2)
    stale = h.publish("eu-0", 0, base_version=7)  # ahead of the fragment's version: future_version
    h.pump(lambda: h.state.statuses().get(stale.id, "").startswith("rejected"))
    h.syncer.every_observe.reset()
    h.syncer.observe()
    reg = h.syncer.metrics.registry
    assert reg.get_sample_value("diloco_syncer_version", {"fragment": "0"}) == 2
    assert reg.get_sample_value("diloco_syncer_merges_total", {"fragment": "0"}) == 2
    assert reg.get_sample_value("diloco_syncer_round_size", {"fragment": "0"}) == 2
    assert reg.get_sample_value("diloco_syncer_accept_to_merge_seconds_count", {"fragment": "0"}) == 4
    assert reg.get_sample_value("diloco_syncer_rejections_total", {"fragment": "0", "reason": "future_version"}) == 1
    assert reg.get_sample_value("diloco_syncer_lease_held", {"fragment": "1"}) == 1
    st = service.live_status(h.syncer)
    assert [r["version"] for r in st["rounds"] if r["fragment"] == 0] == [2, 1]
    assert st["rejections"]["by_reason"] == {"future_version": 1}
    assert next(m for m in st["members"] if m["id"] == "us-0")["step"] == 10


def test_the_status_survives_events_and_ids_from_outside():
    """One event with a non-numeric time made / and /status.json answer 503, and '[/]' in a learner id
    or a detail crashed `diloco status`."""
    cfg = build_config({})
    snap = {"members": {"[/]": {}}, "registry": {"us-0": {"seen": "later", "status": "alive"}},
            "versions": {0: 3}, "pending": {}, "leases": {}, "counters": {}, "outbox": 0,
            "merges": [{"fragment": 0, "version": 3, "learners": ["us-0"], "time": "soon"}]}
    events = [{"kind": "contribution_rejected", "id": "[/]", "reason": "[bold]", "detail": "[/x]", "time": "later"}]
    st = status.build(cfg, "run", snap, events, time.time())
    assert st["rounds"][0]["age_s"] is None and st["rejections"]["recent"][0]["age_s"] is None
    json.loads(status.to_json(st))
    assert "[/]" in status.html(st)
    out = io.StringIO()
    for t in status.tables(st):
        Console(file=out, width=200).print(t)
    assert "[/]" in out.getvalue() and "[/x]" in out.getvalue()


def test_the_endpoints_listen_on_this_machine_by_default_and_drop_silent_clients():
    assert build_config({}).monitoring.host == "127.0.0.1"
    from prometheus_client import CollectorRegistry
    port = free_port()
    server = metrics.serve(CollectorRegistry(), "127.0.0.1", port)
    try:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(metrics.MAX_REQUESTS)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=metrics.REQUEST_TIMEOUT_S * 3) as r:
            assert r.status == 200                     # served once the silent ones time out
        for s in silent:
            s.close()
    finally:
        server.shutdown()
