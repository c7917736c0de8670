"""Prefect flows on a real Prefect server: a tiny run end to end (with a learner SIGKILLed and restarted),
cancellation through the API, evals against a direct evaluation, and the TPU backend's rendering."""

from __future__ import annotations

import contextvars
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # before prefect is imported
os.environ["DO_NOT_TRACK"] = "1"

import pytest
import yaml
from helpers import NoRecords, assert_exact_accounting, run_events, run_processes
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings
from prefect.states import Cancelling
from rich.console import Console

from diloco.config import ConfigError, build_config, dump_config, load_config
from diloco.flows import reports
from diloco.flows.evals import eval_path, evaluate_checkpoint
from diloco.flows.training import decoupled_diloco
from diloco.infra import services, tpu
from diloco.run import prepare
from diloco.syncer import state as state_mod

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """`prefect server start` on a free port with its own PREFECT_HOME and sqlite database. Module-scoped:
    the server and its workers keep a share of a core busy, which the rest of the suite should not pay."""
    home = tmp_path_factory.mktemp("prefect-server")
    port = services.free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db"}
    env.pop("PREFECT_API_URL", None)
    with open(home / "server.log", "wb") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def prefect_env(prefect_api, tmp_path):
    """This test's client settings: the session's server, its own PREFECT_HOME."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    with temporary_settings(updates={PREFECT_API_URL: prefect_api, PREFECT_HOME: str(home)}):
        yield {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_HOME": str(home)}


POOLS = ("diloco-local", "diloco-us", "diloco-eu", "diloco-evals")


@pytest.fixture(scope="module")
def region_workers(prefect_api, tmp_path_factory):
    """prefect.yaml deployed, and a process worker for each region's pool (diloco-us, diloco-eu) and the
    evals pool (one eval at a time: the run's learners keep the cores)."""
    from prefect.client.schemas.actions import WorkPoolCreate

    home = tmp_path_factory.mktemp("prefect-workers")
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_HOME": str(home), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    with temporary_settings(updates={PREFECT_API_URL: prefect_api, PREFECT_HOME: str(home)}):
        with get_client(sync_client=True) as client:
            for pool in POOLS:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                       concurrency_limit=1 if pool == "diloco-evals" else None),
                                        overwrite=True)
    prefect = str(Path(sys.executable).parent / "prefect")
    subprocess.run([prefect, "--no-prompt", "deploy", "--all"], env=env, cwd=ROOT, check=True, capture_output=True)
    workers = []
    for pool in POOLS[1:]:
        with open(home / f"{pool}.log", "wb") as log:
            workers.append(subprocess.Popen([prefect, "worker", "start", "--pool", pool], env=env, cwd=ROOT,
                                            stdout=log, stderr=subprocess.STDOUT))
    yield home
    for w in workers:
        w.terminate()
    # every flow run of the module has ended; a process worker that got SIGTERM forwards SIGINT to its
    # worker and may wait on it for minutes, so a few seconds for all of them, then SIGKILL
    deadline = time.time() + 3
    for w in workers:
        try:
            w.wait(max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def artifacts(key: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


@pytest.mark.integration
def test_flow_trains_restarts_a_killed_learner_and_reports(tiny_config, tmp_path, prefect_env, region_workers):
    cfg = tiny_config()
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    killed: list[int] = []

    def kill_us0_once_it_contributed():
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            runs = list(Path(cfg.run.dir).glob("*/config.yaml"))
            if runs:
                run_id = runs[0].parent.name
                state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
                if state.counters().get("accepted", 0) >= 2:
                    for pid, cmd in run_processes(str(runs[0])).items():
                        if " learner " in cmd and "--learner us-0 " in cmd:
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
            time.sleep(0.2)

    killer = threading.Thread(target=kill_us0_once_it_contributed, daemon=True)
    killer.start()
    summary = decoupled_diloco(config=str(tmp_path / "config.yaml"), overrides=["run.restart_backoff_s=0.5"],
                               eval_every=3)
    killer.join()
    assert len(killed) == 1
    assert summary["restarts"] == {"us-0": 1}
    c = summary["contributions"]
    assert c["published"] == c["applied"] > 0 and c["applied_twice"] == c["rejected"] == c["pending"] == 0
    assert_exact_accounting(cfg, summary["run_id"])
    assert summary["eval_loss_end"] < 0.9 * summary["eval_loss_start"], summary
    assert not run_processes(summary["run_dir"])

    (evals,) = artifacts(reports.artifact_key(summary["run_id"], "evals"))
    rows = json.loads(evals.data)
    assert len(rows) >= 2 and rows[0]["version"] == 0 and rows[0]["tokens"] == 0
    assert len({r["fragment versions"] for r in rows}) == len(rows)      # no checkpoint evaluated twice
    assert rows[0]["loss"] == round(summary["eval_loss_start"], 4)
    assert rows[-1]["loss"] == round(summary["eval_loss_end"], 4)        # the end eval is the summary's own
    assert [r["tokens"] for r in rows] == sorted(r["tokens"] for r in rows)
    (plot,) = artifacts(reports.artifact_key(summary["run_id"], "loss-curve"))
    assert plot.data.startswith("![held-out loss against tokens](data:image/png;base64,iVBORw0KGgo")
    (text,) = artifacts(reports.artifact_key(summary["run_id"], "summary"))
    assert f"| contributions published | {c['published']} |" in text.data and "| restarts | us-0 1 |" in text.data


def flow_runs(**filters) -> list:
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(**filters))


def kill_region_once_it_contributed(cfg, region: str, deadline: float) -> tuple[Path, list[str]]:
    """SIGKILL every learner of `region` once the run (the first under cfg.run.dir) accepted 4
    contributions; (the run's config.yaml, the learners killed)."""
    killed: list[str] = []
    while time.time() < deadline:
        runs = list(Path(cfg.run.dir).glob("*/config.yaml"))
        if runs:
            state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, runs[0].parent.name)
            if state.counters().get("accepted", 0) >= 4:
                for pid, cmd in run_processes(str(runs[0])).items():
                    if " learner " in cmd and f"--learner {region}-" in cmd:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(cmd.split("--learner ")[1].split()[0])
                if killed:
                    return runs[0], killed
        time.sleep(0.2)
    raise AssertionError(f"no learner of {region} was killed in time")


@pytest.mark.integration
def test_regions_run_on_their_pools_and_the_run_outlives_a_region_that_failed(tiny_config, tmp_path, prefect_env,
                                                                               region_workers):
    """Region eu loses every learner for good (run.max_restarts=0): its flow run fails, region us trains to
    the end, and the run completes; version events trigger evals on the evals pool."""
    from prefect.client.schemas.filters import FlowRunFilterTags

    from diloco.flows.training import run_tag

    # The tiny model steps in milliseconds; a WAN latency per contribution stretches the run to several
    # seconds, so that versions (and their eval events) come one after another, as in a real run.
    cfg = tiny_config(run={"max_restarts": 0}, fragments={"count": 2},  # more versions per fragment: more events
                      transport={"wan_latency_ms": 400},
                      regions=[{"name": "us"}, {"name": "eu", "speed": 0.25}])  # eu is killed well before its end
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    killed: list[str] = []

    def kill_eu_once_it_contributed():
        killed.extend(kill_region_once_it_contributed(cfg, "eu", time.time() + 240)[1])

    killer = threading.Thread(target=kill_eu_once_it_contributed, daemon=True)
    killer.start()
    # an eval every second version of each fragment: 4-5 evals, each a flow run of its own on the evals pool
    summary = decoupled_diloco(config=str(tmp_path / "config.yaml"), eval_every=2)
    killer.join()
    assert sorted(killed) == ["eu-0", "eu-1"]
    assert summary["regions"] == {"us": "Completed", "eu": "Failed"}
    assert {lid: row["step"] for lid, row in summary["learners"].items() if lid.startswith("us-")} == {"us-0": 80, "us-1": 80}
    assert all(row["step"] < 80 for lid, row in summary["learners"].items() if lid.startswith("eu-"))
    assert not run_processes(summary["run_dir"])

    regions = {fr.parameters["region"]: fr for fr in flow_runs(tags=FlowRunFilterTags(all_=[run_tag(summary["run_id"])]))}
    assert {r: fr.work_pool_name for r, fr in regions.items()} == {"us": "diloco-us", "eu": "diloco-eu"}
    assert regions["eu"].state.is_failed() and "eu-" in regions["eu"].state.message
    (eu,) = artifacts(reports.artifact_key(summary["run_id"], "region-eu"))
    assert eu.description.startswith(f"region eu of {summary['run_id']}: failed")

    with get_client(sync_client=True) as client:
        eval_dep = client.read_deployment_by_name("diloco-eval/eval")
    deadline = time.time() + 300  # one eval at a time; a loaded machine makes each slow
    while True:  # the evals worker runs one at a time: the last may still be going
        evals = [fr for fr in flow_runs() if fr.deployment_id == eval_dep.id
                 and fr.parameters.get("config") == str(Path(summary["run_dir"]) / "config.yaml")]
        if len(evals) >= 2 and all(fr.state.is_final() for fr in evals):
            break
        assert time.time() < deadline, [(fr.name, fr.state.name, fr.parameters) for fr in evals]
        time.sleep(1)
    assert all(fr.state.is_completed() and fr.work_pool_name == "diloco-evals" for fr in evals)
    assert all(fr.created_by.type == "AUTOMATION" for fr in evals), [fr.created_by for fr in evals]
    versions = [fr.parameters["versions"] for fr in evals]
    assert len({tuple(v) for v in versions}) == len(versions) and all(min(v) >= 1 for v in versions)
    run_cfg = load_config(Path(summary["run_dir"]) / "config.yaml")
    assert all(eval_path(run_cfg, v).is_file() for v in versions)   # each evaluated (or found evaluated)


@pytest.mark.integration
def test_a_failed_region_run_again_by_hand_is_followed_and_resumes_its_learners(tiny_config, tmp_path, prefect_env,
                                                                                 region_workers):
    """Region eu loses every learner for good (run.max_restarts=0): its flow run fails, region us trains on,
    and the eu deployment run again by hand with the run's tag (as docs/prefect.md says) is followed: its
    learners resume where they left off and the run waits for them."""
    from prefect.client.schemas.filters import FlowRunFilterTags

    from diloco.flows.training import run_tag

    # us must still train when eu is run again: eu's pool worker may pick its first flow run up half
    # a minute late on a loaded machine (one CI run: eu's learners joined 29 s after us's, and us at
    # speed 0.25 finished 2 s after eu failed, before the rerun existed). At a tenth, start-up still
    # took most of us's time (another CI run: us joined 1 s after eu, compiled for 20 s, trained its
    # 80 steps in 5 s and finished 7 s after eu failed, before the run flow saw the rerun), so us
    # steps at a thirtieth: about 15 s of training after start-up
    cfg = tiny_config(run={"max_restarts": 0}, fragments={"count": 2},  # more versions per fragment: more events
                      regions=[{"name": "us", "speed": 1 / 30}, {"name": "eu"}])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    killed: list[str] = []
    rerun: list = []

    def kill_eu_once_it_contributed_then_run_it_again():
        deadline = time.time() + 240
        run_cfg, gone = kill_region_once_it_contributed(cfg, "eu", deadline)
        killed.extend(gone)
        tag = run_tag(run_cfg.parent.name)
        while time.time() < deadline and not rerun:
            if any(fr.state.is_failed() for fr in flow_runs(tags=FlowRunFilterTags(all_=[tag]))):
                rerun.append(run_deployment("diloco-region/diloco-eu", timeout=0, tags=[tag],
                                            parameters={"config": str(run_cfg), "region": "eu"}))
            time.sleep(0.2)

    # the thread's Prefect client: this test's settings (a context variable)
    killer = threading.Thread(target=contextvars.copy_context().run, args=(kill_eu_once_it_contributed_then_run_it_again,),
                              daemon=True)
    killer.start()
    # evals are not what this test checks (the regions test above does): no version events, so no eval
    # flow runs start processes beside it or after it
    summary = decoupled_diloco(config=str(tmp_path / "config.yaml"), eval_every=0)
    killer.join()
    assert sorted(killed) == ["eu-0", "eu-1"] and len(rerun) == 1
    assert summary["regions"] == {"us": "Completed", "eu": "Completed"}
    assert {lid: row["step"] for lid, row in summary["learners"].items()} == {f"{r}-{i}": 80 for r in ("us", "eu")
                                                                             for i in (0, 1)}
    assert not run_processes(summary["run_dir"])

    runs_by_region: dict[str, list] = {}
    for fr in sorted(flow_runs(tags=FlowRunFilterTags(all_=[run_tag(summary["run_id"])])), key=lambda f: f.created):
        runs_by_region.setdefault(fr.parameters["region"], []).append(fr)
    assert {r: [fr.work_pool_name for fr in frs] for r, frs in runs_by_region.items()} == {
        "us": ["diloco-us"], "eu": ["diloco-eu", "diloco-eu"]}
    first, again = runs_by_region["eu"]
    assert first.state.is_failed() and "eu-" in first.state.message
    assert again.id == rerun[0].id and again.state.is_completed()
    report = json.loads((Path(summary["run_dir"]) / "regions" / "eu.json").read_text())  # the rerun's
    assert report["state"] == "completed" and [row["step"] for row in report["learners"]] == [80, 80]
    # each eu learner's second incarnation started at the end of the furthest cursor the syncer accepted
    # from its first one: steps it trained but never handed in (past its last contribution) are trained
    # again, whatever its last beat said (issue 53 H2: beats are advisory)
    events = run_events(cfg, summary["run_id"])
    beats = [e for e in events if e["kind"] == "heartbeat" and e["learner"].startswith("eu-")]
    for lid in ("eu-0", "eu-1"):
        incarnations = list(dict.fromkeys(e["incarnation"] for e in beats if e["learner"] == lid))
        if len(incarnations) == 1:  # killed while it still compiled (a loaded machine): nothing to resume from
            assert {e["start_step"] for e in beats if e["learner"] == lid} == {0}, lid
            continue
        assert len(incarnations) == 2, (lid, incarnations)
        last_step = max(e["step"] for e in beats if e["incarnation"] == incarnations[0])
        (start,) = {e["start_step"] for e in beats if e["incarnation"] == incarnations[1]}
        handed = max((e["cursor"][1] for e in events if e["kind"] == "contribution_accepted"
                      and e.get("learner") == lid and e.get("cursor") and e["cursor"][0] < start), default=0)
        assert start == handed > 0, (lid, start, last_step, handed)
    assert artifacts(reports.artifact_key(summary["run_id"], "region-eu"))


@pytest.mark.integration
def test_eval_flow_matches_a_direct_evaluation(tiny_config, prefect_env):
    setup = prepare(tiny_config(), Console(quiet=True))
    figures = evaluate_checkpoint(str(setup.cfg_path))
    cfg = setup.cfg
    direct = setup.evaluate({p: 0 for p in range(cfg.fragments.count)})
    assert figures["versions"] == [0] * cfg.fragments.count and figures["tokens"] == 0
    assert figures["loss"] == pytest.approx(direct, abs=1e-6) == pytest.approx(setup.eval_start, abs=1e-6)
    assert figures["perplexity"] == pytest.approx(2.718281828 ** direct, rel=1e-6)
    (table,) = artifacts(reports.artifact_key(cfg.run.id, "eval"))
    assert json.loads(table.data)[0]["loss"] == round(direct, 4)


@pytest.mark.integration
def test_the_scale_flow_hands_its_requests_to_the_runner_and_fails_on_a_refusal(tmp_path, prefect_env):
    from diloco import membership
    from diloco.flows.membership import scale

    seen = []

    def runner() -> None:  # stands in for the run's runner: answers what the flow asks
        deadline = time.time() + 60
        while len(seen) < 3 and time.time() < deadline:
            for path, op in membership.pending(tmp_path):
                seen.append(op)
                ok = op.get("learner") != "eu-0"
                membership.answer(path, {"ok": True, "added": ["eu-2"]} if op["op"] == "add" else
                                  {"ok": ok, **({"removed": op["learner"]} if ok else {"error": "keeps at least 1"})})
            time.sleep(0.05)

    threading.Thread(target=runner, daemon=True).start()
    config = str(tmp_path / "config.yaml")
    assert scale(config, region="eu", add=1, remove=["us-1"]) == [{"ok": True, "added": ["eu-2"]},
                                                                  {"ok": True, "removed": "us-1"}]
    with pytest.raises(membership.RequestError, match="keeps at least 1"):
        scale(config, remove=["eu-0"])
    assert seen == [{"op": "add", "region": "eu", "count": 1}, {"op": "remove", "learner": "us-1"},
                    {"op": "remove", "learner": "eu-0"}]


def test_every_deployment_in_prefect_yaml_names_a_flow():
    import importlib.util

    from prefect import Flow

    for dep in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]:
        path, attr = dep["entrypoint"].split(":")
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(dep["name"], ROOT / path))
        module.__spec__.loader.exec_module(module)
        assert isinstance(getattr(module, attr), Flow), dep["name"]


@pytest.mark.integration
def test_cancelled_flow_run_leaves_no_processes(tiny_config, tmp_path, prefect_env, region_workers):
    # a run that cannot end by itself before it is cancelled: the regions start seconds apart, and
    # 2,000 steps of the tiny model were over in the first region before the second's learners came up.
    # Its learners step at a tenth of their speed: they only have to be alive when the cancel comes, and
    # at full speed they kept both cores busy while it propagated
    cfg = tiny_config(inner={"steps": 200_000},
                      regions=[{"name": "us", "learners": 2, "speed": 0.1}, {"name": "eu", "learners": 2, "speed": 0.1}])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    serve = "from diloco.flows.training import decoupled_diloco; decoupled_diloco.serve(name='cancel-test')"
    with open(tmp_path / "serve.log", "wb") as log:
        # the runner looks for the run it is to start once a second, not every 10 s (the default)
        server = subprocess.Popen([sys.executable, "-c", serve], env={**prefect_env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"},
                                  cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:  # serve registers the deployment
            try:
                fr = run_deployment("decoupled-diloco/cancel-test", timeout=0,
                                    parameters={"config": str(tmp_path / "config.yaml"), "eval_every": 0})
                break
            except ObjectNotFound:  # not registered yet
                assert time.time() < deadline and server.poll() is None, (tmp_path / "serve.log").read_text()
                time.sleep(1)
        while len([c for c in run_processes(cfg.run.dir).values() if " learner " in c]) < cfg.num_learners:
            assert time.time() < deadline + 120, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(fr.id, Cancelling(), force=True)
            while not client.read_flow_run(fr.id).state.is_final():
                assert time.time() < deadline + 240, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(1)
            assert client.read_flow_run(fr.id).state.is_cancelled()
        while run_processes(cfg.run.dir):  # the flow run stopped its jobs before it exited
            assert time.time() < deadline + 260, run_processes(cfg.run.dir)
            time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_prefect_yaml_deploys_the_training_flow_with_a_valid_config():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == "local"]
    assert dep["entrypoint"] == "flows/training.py:decoupled_diloco"
    cfg = load_config(ROOT / dep["parameters"]["config"], dep["parameters"]["overrides"])
    assert cfg.inner.steps <= 100 and cfg.model.transformer.d_model <= 32   # tiny
    assert dep["work_pool"]["name"]


# --- the tpu backend: every field that comes from the config ---------------------------------------

def J(job: str) -> str:
    """The name the backends give job `job` of tpu_config()'s run (infra/tpu.py: job_name)."""
    return tpu.job_name(tpu_config(), job)


def tpu_config():
    return build_config({
        "run": {"id": "prod_Run-7"},
        "regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 1}],
        "backend": {"kind": "gke", "project": "acme-train", "image": "eu.gcr.io/acme/diloco:1.2", "namespace": "pretrain",
                    "config_dir": "/cfg", "corpus_dir": "/mnt/corpus",
                    "slices": {"us": {"generation": "v5p", "topology": "2x2x2", "zone": "us-east5-a"},
                               "eu": {"generation": "v6e", "topology": "2x4", "zone": "europe-west4-a",
                                      "runtime_version": "v2-alpha-tpuv6e", "spot": True}}},
    })


def test_slice_shapes():
    assert tpu.slice_shape(build_config({}).backend.slice_of("us")) == tpu.SliceShape("v5p-8", "tpu-v5p-slice", 4, 1, 4)
    cfg = tpu_config()
    assert tpu.slice_shape(cfg.backend.slice_of("us")) == tpu.SliceShape("v5p-16", "tpu-v5p-slice", 8, 2, 4)
    assert tpu.slice_shape(cfg.backend.slice_of("eu")) == tpu.SliceShape("v6e-8", "tpu-v6e-slice", 8, 1, 8)
    with pytest.raises(ValueError, match="v6e slices have 2 axes"):
        build_config({"backend": {"slices": {"eu": {"generation": "v6e", "topology": "2x2x1"}}}})


def test_gke_jobsets_carry_every_config_field(tmp_path):
    cfg = tpu_config()
    docs = list(yaml.safe_load_all((tpu.write_plan(cfg, dump_config(cfg), tmp_path)[0]).read_text()))
    cm, syncer, us0, us1, eu0 = docs
    assert cm["kind"] == "ConfigMap" and cm["metadata"] == {"name": J("config"), "namespace": "pretrain"}
    assert load_config(tmp_path / "config.yaml") == cfg and cm["data"]["config.yaml"] == dump_config(cfg)
    for doc, name, cmd, hosts, selector, chips in [
        (syncer, "syncer", ["diloco", "syncer", "--config", "/cfg/config.yaml", "--shard", "0"], 1, None, None),
        (us0, "us-0", ["diloco", "learner", "--config", "/cfg/config.yaml", "--learner", "us-0", "--corpus", "/mnt/corpus"],
         2, {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "2x2x2"}, 4),
        (us1, "us-1", ["diloco", "learner", "--config", "/cfg/config.yaml", "--learner", "us-1", "--corpus", "/mnt/corpus"],
         2, {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "2x2x2"}, 4),
        (eu0, "eu-0", ["diloco", "learner", "--config", "/cfg/config.yaml", "--learner", "eu-0", "--corpus", "/mnt/corpus"],
         1, {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice", "cloud.google.com/gke-tpu-topology": "2x4",
             "cloud.google.com/gke-spot": "true"}, 8),
    ]:
        assert doc["kind"] == "JobSet" and doc["metadata"]["name"] == J(name)
        assert doc["metadata"]["namespace"] == "pretrain"
        assert doc["metadata"]["labels"] == {"diloco/run": "prod_Run-7", "diloco/job": name,
                                             **({"diloco/region": name[:2]} if name != "syncer" else {})}
        assert doc["spec"]["failurePolicy"] == {"maxRestarts": 0}
        (rj,) = doc["spec"]["replicatedJobs"]
        job = rj["template"]["spec"]
        assert job["parallelism"] == job["completions"] == hosts and job["backoffLimit"] == 0
        pod = job["template"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == "eu.gcr.io/acme/diloco:1.2" and c["command"] == cmd
        assert c["volumeMounts"] == [{"name": "config", "mountPath": "/cfg", "readOnly": True}]
        assert pod["volumes"] == [{"name": "config", "configMap": {"name": J("config")}}]
        assert pod.get("nodeSelector") == selector
        assert c.get("resources", {}).get("limits", {}).get("google.com/tpu") == chips
        env = {e["name"]: e for e in c.get("env", [])}
        if hosts > 1:  # the slice's hosts are one JAX program: pod 0 of the indexed job coordinates
            assert job["completionMode"] == "Indexed" and doc["spec"]["network"] == {"enableDNSHostnames": True}
            assert env["JAX_COORDINATOR_ADDRESS"]["value"] == f"{J(name)}-slice-0-0.{J(name)}:8476"
            assert env["JAX_NUM_PROCESSES"]["value"] == str(hosts)
            assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
                "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        else:
            assert "JAX_NUM_PROCESSES" not in env


def test_gke_jobs_read_the_passwords_from_the_secret_never_from_the_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_PW", "redis-secret-value")
    monkeypatch.setenv("KAFKA_PW", "kafka-secret-value")
    tree = tpu_config().model_dump(mode="json")
    cfg = build_config({**tree, "backend": {**tree["backend"], "secret_name": "acme-diloco"},
                        "state": {"username": "diloco", "password_env": "REDIS_PW"},
                        "transport": {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                                      "sasl_username": "diloco", "sasl_password_env": "KAFKA_PW"}})
    text = (tpu.write_plan(cfg, dump_config(cfg), tmp_path)[0]).read_text()
    assert "secret-value" not in text and not any(d["kind"] == "Secret" for d in yaml.safe_load_all(text))

    def secret_env(doc):
        (c,) = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}

    jobs = {d["metadata"]["labels"]["diloco/job"]: d for d in yaml.safe_load_all(text) if d["kind"] == "JobSet"}
    kafka = {"KAFKA_PW": {"name": "acme-diloco", "key": "KAFKA_PW"}}
    assert secret_env(jobs["syncer"]) == {**kafka, "REDIS_PW": {"name": "acme-diloco", "key": "REDIS_PW"}}
    for learner in ("us-0", "us-1", "eu-0"):  # learners never talk to Redis: they get the broker's password only
        assert secret_env(jobs[learner]) == kafka
    assert build_config({}).backend.secret_name == "diloco-secrets"
    docs = yaml.safe_load_all(tpu.write_plan(tpu_config(), "", tmp_path / "plain")[0].read_text())
    assert all(secret_env(d) == {} for d in docs if d["kind"] == "JobSet")  # no password configured: no reference
    with pytest.raises(ConfigError, match="state.password_env"):
        build_config({"state": {"password_env": "REDIS PW"}})  # not an env var name, so not a Secret key either


def test_gke_plan_starts_one_jobset_per_syncer_shard(tmp_path):
    cfg = build_config({**tpu_config().model_dump(mode="json"), "syncer": {"shards": 3}})
    docs = list(yaml.safe_load_all((tpu.write_plan(cfg, dump_config(cfg), tmp_path)[0]).read_text()))
    shards = [d for d in docs if d["kind"] == "JobSet" and d["metadata"]["labels"]["diloco/job"].startswith("syncer")]
    assert [d["metadata"]["name"] for d in shards] == [J(f"syncer-{i}") for i in range(3)]
    for i, d in enumerate(shards):
        (c,) = d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["diloco", "syncer", "--config", "/cfg/config.yaml", "--shard", str(i)]


def test_gke_pods_expose_their_metrics_ports_to_prometheus(tmp_path):
    def pods(cfg):
        docs = yaml.safe_load_all((tpu.write_plan(cfg, dump_config(cfg), tmp_path)[0]).read_text())
        return {d["metadata"]["labels"]["diloco/job"]: d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
                for d in docs if d["kind"] == "JobSet"}
    assert all("annotations" not in p["metadata"] for p in pods(tpu_config()).values())  # monitoring off
    cfg = build_config({**tpu_config().model_dump(mode="json"), "syncer": {"shards": 2},
                        "monitoring": {"host": "0.0.0.0", "syncer_port": 9400, "learner_port_base": 9500}})
    want = {"syncer-0": 9400, "syncer-1": 9401, **{lid: 9500 + cfg.shard_index(lid) for lid in cfg.learner_ids()}}
    got = pods(cfg)
    assert set(got) == set(want)
    for job, pod in got.items():
        assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(want[job]),
                                                  "prometheus.io/path": "/metrics"}
        (c,) = pod["spec"]["containers"]
        assert c["ports"] == [{"name": "metrics", "containerPort": want[job]}]


def test_queued_resource_requests_carry_every_config_field(tmp_path):
    cfg = tpu_config()
    plan = json.loads(tpu.write_plan(cfg, dump_config(cfg), tmp_path)[1].read_text())
    assert sorted(plan) == ["eu-0", "us-0", "us-1"]
    us, eu = plan["us-1"], plan["eu-0"]
    where = ["--project=acme-train", "--zone=us-east5-a"]
    assert us["create"] == ["gcloud", "compute", "tpus", "queued-resources", "create", J("us-1"),
                            f"--node-id={J('us-1')}", *where, "--accelerator-type=v5p-16",
                            "--runtime-version=v2-alpha-tpuv5"]
    assert eu["create"][-3:] == ["--accelerator-type=v6e-8", "--runtime-version=v2-alpha-tpuv6e", "--spot"]
    assert "--zone=europe-west4-a" in eu["create"]
    assert us["copy_config"] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(tmp_path / "config.yaml"),
                                 f"{J('us-1')}:diloco-config.yaml", "--worker=all", *where]
    assert us["run"][:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", J("us-1"), "--worker=all", *where][:8]
    assert us["run"][-2] == "--command" and us["run"][-1].endswith(
        "eu.gcr.io/acme/diloco:1.2 diloco learner --config /cfg/config.yaml --learner us-1 --corpus /mnt/corpus")
    assert '-v "$HOME"/diloco-config.yaml:/cfg/config.yaml:ro -v /mnt/corpus:/mnt/corpus:ro' in us["run"][-1]
    assert us["delete"] == ["gcloud", "compute", "tpus", "queued-resources", "delete", J("us-1"), "--force",
                            "--quiet", *where]


def test_adding_and_removing_learners_of_a_live_run_applies_and_deletes_their_jobsets(tmp_path):
    """`diloco learners add/remove` reach a run on GKE through the runner: the new learner's JobSet is
    rendered and applied, the removed one's deleted gracefully (SIGTERM: it hands in and says left),
    and a JobSet gone after that counts as done, not as a failure to restart."""
    from diloco.supervisor import RunSupervisor

    cfg = tpu_config()
    cfg = cfg.model_copy(update={"regions": tuple(r.model_copy(update={"max_learners": 2}) for r in cfg.regions)})
    calls = []

    def fake(argv, **kw):  # every JobSet runs; one that was deleted is gone
        calls.append((argv, yaml.safe_load(kw["input"]) if kw.get("input") else None))
        return subprocess.CompletedProcess(argv, 0, json.dumps({"status": {}}) if argv[-1] == "json" else "", "")

    (tmp_path / "config.yaml").write_text(dump_config(cfg))

    def region_runner(region):  # what a region's flow run drives: its region's backend alone
        jobs = tpu.jobs_for(cfg, region, tmp_path / "config.yaml", tmp_path / "logs", run=fake)
        return jobs, RunSupervisor(cfg, tmp_path / "config.yaml", type("Corpus", (), {"dir": Path("/x")})(), jobs, None,
                              Console(quiet=True), [], regions=(region,), syncer=False, state=NoRecords())
    _, run = region_runner("eu")
    assert run.carry_out({"op": "add", "region": "eu"}, 0.0) == {"added": ["eu-1"], "start_step": 0}
    applied = [m for a, m in calls if a[3:4] == ["apply"] and m["kind"] == "JobSet"]
    assert applied[-1]["metadata"]["name"] == J("eu-1")
    assert "--learner eu-1" in " ".join(applied[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
                                        ["spec"]["containers"][0]["command"])
    jobs, run = region_runner("us")
    assert run.carry_out({"op": "remove", "learner": "us-1"}, 1.0) == {"removed": "us-1"}
    ns = ["kubectl", "--namespace", "pretrain"]
    assert calls[-1][0] == [*ns, "delete", "jobset", J("us-1"), "--ignore-not-found", "--wait=false"]
    assert jobs.poll("us-1") == 0 and calls[-1][0][3:5] == ["get", "jobset"]


def test_gke_jobs_drive_kubectl(tmp_path):
    cfg = tpu_config()
    calls = []

    def fake(argv, **kw):
        calls.append((argv, yaml.safe_load(kw["input"]) if kw.get("input") else None))
        out = json.dumps({"status": {"terminalState": "Failed"}}) if argv[3:5] == ["get", "jobset"] else ""
        return subprocess.CompletedProcess(argv, 0, out, "")

    jobs = tpu.GkeJobs(cfg, dump_config(cfg), "eu", run=fake)
    jobs.start("eu-0", ["learner", "--config", str(tmp_path / "c.yaml"), "--learner", "eu-0", "--corpus", "/x",
                        "--start-step", "40"])
    assert jobs.poll("eu-0") == 1
    jobs.signal("eu-0", signal.SIGKILL)
    jobs.stop_all()
    ns = ["kubectl", "--namespace", "pretrain"]
    assert [a for a, _ in calls] == [
        [*ns, "apply", "-f", "-"],
        [*ns, "delete", "jobset", J("eu-0"), "--ignore-not-found", "--wait=true"],
        [*ns, "apply", "-f", "-"],
        [*ns, "get", "jobset", J("eu-0"), "-o", "json"],
        [*ns, "delete", "jobset", J("eu-0"), "--ignore-not-found", "--wait=false", "--grace-period=0", "--force"],
        [*ns, "delete", "jobset", "-l", "diloco/run=prod_Run-7,diloco/region=eu", "--ignore-not-found", "--timeout=10s"],
    ]
    assert calls[0][1]["kind"] == "ConfigMap"
    assert calls[2][1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"][-2:] \
        == ["--start-step", "40"]
