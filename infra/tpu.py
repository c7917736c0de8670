"""Production job backends: one TPU slice per learner, v5p and v6e mixed by region, the syncer on CPU.

Everything here is rendered from the run's config. Each region's learners run where its
`backend.slices.<region>` says (project, zone, kube context, namespace); the syncer runs in the home
cluster (`backend.context`, `backend.namespace`). Two kinds:
- `gke`: `GkeJobs` applies a ConfigMap and one JobSet per job with kubectl, in one region's cluster;
- `tpu-vm`: `TpuVmJobs` requests one queued resource per learner with gcloud, waits for it to be
  ACTIVE, copies the config to every host and runs the learner's container there over ssh.
Both are `diloco.infra.jobs.JobBackend`s, as `LocalJobs` is. `jobs_for` gives the backend of one
region (what its region flow's `RunSupervisor` drives) or of the syncer (the run flow's). The command
line inside is the same `diloco learner` / `diloco syncer` that the local backend starts; only the
paths of the config and the corpus change.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from diloco.config import Config, SliceConfig


@dataclass(frozen=True)
class SliceShape:
    accelerator_type: str   # the TPU API's name, e.g. v5p-8 (TensorCores) or v6e-8 (chips)
    gke_accelerator: str    # node label cloud.google.com/gke-tpu-accelerator
    chips: int
    hosts: int
    chips_per_host: int


def slice_shape(s: SliceConfig) -> SliceShape:
    chips = math.prod(int(d) for d in s.topology.split("x"))
    if s.generation == "v5p":  # 4 chips per host, 2 TensorCores per chip
        return SliceShape(f"v5p-{2 * chips}", "tpu-v5p-slice", chips, max(1, chips // 4), min(4, chips))
    per_host = chips if chips <= 8 else 4  # v6e: up to 8 chips on one host, else 4 per host
    return SliceShape(f"v6e-{chips}", "tpu-v6e-slice", chips, chips // per_host, per_host)


COORDINATOR_PORT = 8476  # jax.distributed's coordinator on a learner's first host


JOB_NAME_CHARS = 48  # a JobSet's pods are named <jobset>-slice-0-<i>: that hostname must fit a 63-character label


def job_name(cfg: Config, name: str) -> str:
    """The name of a job of this run (JobSet, ConfigMap, TPU VM): a valid DNS-1035 label, unique by
    construction. Readable from the run id and the job, cut to fit, then a digest of the exact
    (run id, job) pair, so that cutting or replacing characters never gives two jobs one name
    (`us_east-0` and `us-east-0`, or two learners of a long run id)."""
    digest = hashlib.sha256(f"{cfg.run.id}/{name}".encode()).hexdigest()[:8]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"dl-{cfg.run.id}-{name}".lower())
    return f"{readable[:JOB_NAME_CHARS - len(digest) - 1].strip('-')}-{digest}"


def remote_argv(cfg: Config, argv: list[str]) -> list[str]:
    """The same `diloco` arguments with the config and corpus at the paths a remote job sees them."""
    out, paths = list(argv), {"--config": f"{cfg.backend.config_dir}/config.yaml", "--corpus": cfg.backend.corpus_dir}
    for i, arg in enumerate(out[:-1]):
        if arg in paths:
            out[i + 1] = paths[arg]
    return ["diloco", *out]


def job_region(cfg: Config, name: str) -> str | None:
    """The region a job runs in: its learner's, or None for a syncer shard (the home cluster)."""
    return None if name in cfg.syncer_ids() else cfg.region_of(name).name


def config_map(cfg: Config, config_text: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": job_name(cfg, "config"), "namespace": namespace},
            "data": {"config.yaml": config_text}}


def jobset(cfg: Config, name: str, argv: list[str]) -> dict:
    """A JobSet for one learner (its region's TPU slice, one pod per host) or a syncer shard (CPU)."""
    b = cfg.backend
    learner = argv[0] == "learner"
    container = {"name": "diloco", "image": b.image, "command": remote_argv(cfg, argv),
                 "volumeMounts": [{"name": "config", "mountPath": b.config_dir, "readOnly": True}]}
    pod = {"restartPolicy": "Never", "containers": [container],
           "volumes": [{"name": "config", "configMap": {"name": job_name(cfg, "config")}}]}
    # passwords come from the Secret by reference: the broker's for every job, Redis's for the syncer (learners
    # never talk to Redis); the key is the env var's name
    wanted = [cfg.transport.sasl_password_env, None if learner else cfg.state.password_env]
    env = [{"name": var, "valueFrom": {"secretKeyRef": {"name": b.secret_name, "key": var}}}
           for var in dict.fromkeys(v for v in wanted if v)]
    hosts, namespace = 1, b.namespace
    labels = {"diloco/run": cfg.run.id, "diloco/job": name}
    if learner:
        s = b.slice_of(cfg.region_of(name).name)
        namespace = s.namespace
        labels["diloco/region"] = cfg.region_of(name).name  # what a region's stop_all selects
        shape = slice_shape(s)
        hosts = shape.hosts
        pod["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": shape.gke_accelerator,
                               "cloud.google.com/gke-tpu-topology": s.topology}
        if s.spot:
            pod["nodeSelector"]["cloud.google.com/gke-spot"] = "true"
        container["resources"] = {"limits": {"google.com/tpu": shape.chips_per_host}}
        if hosts > 1:  # one JAX program over the slice: pod 0 coordinates, each pod knows its index
            env += [
                {"name": "JAX_COORDINATOR_ADDRESS",
                 "value": f"{job_name(cfg, name)}-slice-0-0.{job_name(cfg, name)}:{COORDINATOR_PORT}"},
                {"name": "JAX_NUM_PROCESSES", "value": str(hosts)},
                {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
    if env:
        container["env"] = env
    pod_meta = {"labels": labels}
    if port := cfg.learner_port(name) if learner else cfg.syncer_port(cfg.syncer_ids().index(name)):
        container["ports"] = [{"name": "metrics", "containerPort": port}]
        pod_meta["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                   "prometheus.io/path": "/metrics"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": job_name(cfg, name), "namespace": namespace, "labels": labels,
                     # one slice per learner: no two learners share a node pool
                     "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
                     if learner else {}},
        "spec": {
            "failurePolicy": {"maxRestarts": 0},  # the flow restarts with its own backoff, resuming the step
            "network": {"enableDNSHostnames": True},  # <jobset>-slice-0-<i>.<jobset>: how the hosts find pod 0
            "replicatedJobs": [{"name": "slice" if learner else "syncer", "replicas": 1, "template": {"spec": {
                "parallelism": hosts, "completions": hosts, "backoffLimit": 0, "completionMode": "Indexed",
                "template": {"metadata": pod_meta, "spec": pod}}}}],
        },
    }


def queued_resource_commands(cfg: Config, learner_id: str, argv: list[str], config_file: str) -> dict[str, list]:
    """gcloud commands for one learner on a TPU VM slice in its region's project and zone: request it, read its
    state, copy the config, run the container on every host (replacing one a restart left), stop it, release."""
    b = cfg.backend
    s = b.slice_of(cfg.region_of(learner_id).name)
    node = job_name(cfg, learner_id)
    where = [f"--project={s.project}", f"--zone={s.zone}"]
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node, "--worker=all", *where, "--command"]
    # the config goes to the ssh user's home (config_dir is root's); the container sees it at config_dir
    # a root shell on every host runs this: every value from the config is validated there and quoted here
    q = shlex.quote
    docker = (f"sudo docker rm -f diloco >/dev/null 2>&1; sudo docker run --rm --name diloco --privileged --net=host "
              f"-v \"$HOME\"/{REMOTE_CONFIG}:{q(b.config_dir + '/config.yaml')}:ro "
              f"-v {q(b.corpus_dir + ':' + b.corpus_dir)}:ro {q(b.image)} "
              + " ".join(q(a) for a in remote_argv(cfg, argv)))
    return {
        "create": ["gcloud", "compute", "tpus", "queued-resources", "create", node, f"--node-id={node}", *where,
                   f"--accelerator-type={slice_shape(s).accelerator_type}", f"--runtime-version={s.runtime_version}",
                   *(["--spot"] if s.spot else [])],
        "describe": ["gcloud", "compute", "tpus", "queued-resources", "describe", node, *where, "--format=json"],
        "copy_config": ["gcloud", "compute", "tpus", "tpu-vm", "scp", config_file, f"{node}:{REMOTE_CONFIG}",
                        "--worker=all", *where],
        "run": [*ssh, docker],
        "stop": [*ssh, "sudo docker kill --signal=TERM diloco"],
        "delete": ["gcloud", "compute", "tpus", "queued-resources", "delete", node, "--force", "--quiet", *where],
    }


REMOTE_CONFIG = "diloco-config.yaml"
Runner = Callable[..., subprocess.CompletedProcess]


@dataclass
class GkeJob:
    name: str
    argv: list[str]
    log: str  # how to read it: JobSet pods log to the cluster, not to a file here


class GkeJobs:
    """A JobBackend over kubectl, in one region's cluster and namespace (`region` None: the
    syncer's, the home cluster); `run` is injectable for tests."""

    def __init__(self, cfg: Config, config_text: str, region: str | None = None, run: Runner = subprocess.run):
        self.cfg, self.region, self.run = cfg, region, run
        b = cfg.backend
        self.context, self.namespace = (b.context, b.namespace) if region is None else \
            (b.slice_of(region).context, b.slice_of(region).namespace)
        self.jobs: dict[str, GkeJob] = {}
        self.deleted: set[str] = set()  # JobSets signal() deleted: gone means done, not lost
        self._apply(config_map(cfg, config_text, self.namespace))

    def _kubectl(self, *args: str, manifest: dict | None = None) -> subprocess.CompletedProcess:
        where = [*(["--context", self.context] if self.context else []), "--namespace", self.namespace]
        return self.run(["kubectl", *where, *args], check=True, text=True,
                        capture_output=True, input=None if manifest is None else yaml.safe_dump(manifest))

    def _apply(self, manifest: dict) -> None:
        self._kubectl("apply", "-f", "-", manifest=manifest)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, processes: int = 1) -> GkeJob:
        """Apply the job's JobSet (`processes` is the local backend's: here the slice's hosts decide)."""
        _check_region(self.cfg, name, self.region)
        self._kubectl("delete", "jobset", job_name(self.cfg, name), "--ignore-not-found", "--wait=true")  # a restart
        self._apply(jobset(self.cfg, name, argv))
        self.deleted.discard(name)
        where = f" --context {self.context}" if self.context else ""
        self.jobs[name] = GkeJob(name, argv, f"kubectl logs -l diloco/job={name}{where} -n {self.namespace}")
        return self.jobs[name]

    def has(self, name: str) -> bool:
        return name in self.jobs

    def where_log(self, name: str) -> str:
        return self.jobs[name].log

    def poll(self, name: str) -> int | None:
        if name in self.deleted:
            return 0 if self._kubectl("get", "jobset", job_name(self.cfg, name), "--ignore-not-found", "-o", "name"
                                      ).stdout.strip() == "" else None
        out = self._kubectl("get", "jobset", job_name(self.cfg, name), "-o", "json").stdout
        terminal = json.loads(out).get("status", {}).get("terminalState")
        return {"Completed": 0, "Failed": 1}.get(terminal)

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Deleting the JobSet sends its pods SIGTERM (SIGKILL after the grace period, at once for SIGKILL)."""
        grace = ["--grace-period=0", "--force"] if sig == signal.SIGKILL else []
        self._kubectl("delete", "jobset", job_name(self.cfg, name), "--ignore-not-found", "--wait=false", *grace)
        self.deleted.add(name)

    def wait(self, name: str, timeout: float | None = None) -> int:
        self._kubectl("wait", f"jobset/{job_name(self.cfg, name)}", "--for=jsonpath={.status.terminalState}",
                      f"--timeout={int(timeout or 0)}s")
        return self.poll(name)

    def stop_all(self, timeout: float = 10.0) -> None:
        """Every JobSet of this run in this cluster and namespace that is this backend's: the region's learners,
        or (home) those without a region, the syncer's."""
        mine = f"diloco/region={self.region}" if self.region else "!diloco/region"
        self._kubectl("delete", "jobset", "-l", f"diloco/run={self.cfg.run.id},{mine}", "--ignore-not-found",
                      f"--timeout={int(timeout)}s")

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return self._kubectl("logs", "-l", f"diloco/job={name}", f"--tail={lines}").stdout
        except subprocess.CalledProcessError as err:
            return f"(no log: {err.stderr.strip()})"


def _check_region(cfg: Config, name: str, region: str | None) -> None:
    if job_region(cfg, name) != region:
        raise ValueError(f"job {name} runs in {job_region(cfg, name) or 'the home cluster'}, not in this backend's "
                         f"{region or 'home cluster'}")


# --- TPU VMs through queued resources ------------------------------------------------------------------------

class GcloudError(RuntimeError):
    """A gcloud request that failed for good: refused (quota, bad argument, not found) or I/O past its retries."""

    def __init__(self, argv: list[str], stderr: str):
        self.stderr = stderr
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        super().__init__(f"`{' '.join(argv[:6])}` failed: {lines[-1] if lines else '(no output)'}")


# gcloud's and ssh's words for a network or server hiccup: worth another try. Anything else (RESOURCE_EXHAUSTED
# i.e. quota, INVALID_ARGUMENT, PERMISSION_DENIED, NOT_FOUND, ALREADY_EXISTS, ...) is a refusal: no retry.
_IO = re.compile(r"UNAVAILABLE|DEADLINE_EXCEEDED|\b50[234]\b|(?i:connection ?error|connection (reset|refused|aborted|"
                 r"closed|timed out)|timed out|network is unreachable|temporary failure in name resolution|"
                 r"max retries exceeded|transport ?error|ssl ?error|lost connection)")
_DOWN = ("FAILED", "SUSPENDING", "SUSPENDED")  # a slice that will not (or no longer) run the learner


@dataclass
class TpuVmJob:
    name: str
    argv: list[str]
    log: Path                             # the ssh's output (every host's), and why the job failed if it did
    commands: dict[str, list]
    held: bool = False                    # its queued resource exists: delete it when done
    proc: subprocess.Popen | None = None  # the ssh running the container on every host, once ACTIVE
    rc: int | None = None                 # once it is over
    release: bool = False                 # SIGTERM sent: give the slice back when the container exits
    look_at: float = 0.0                  # when to read the queued resource's state next


class TpuVmJobs:
    """A JobBackend for one region's learners, each on its own TPU VM slice (a queued
    resource). start() requests the slice and returns; poll() follows it: WAITING_FOR_RESOURCES / PROVISIONING
    (None), ACTIVE (copy the config, start the ssh that runs the container on every host; then the ssh's exit
    code is the job's), FAILED or SUSPENDED (the job fails with the reason in its log). gcloud calls retry with
    backoff on I/O errors only; a refused request (quota, bad argument) fails the job at once, and the run's
    restart policy decides what follows. `run`, `popen`, `sleep` and `clock` are injectable for tests."""

    def __init__(self, cfg: Config, region: str, config_file: Path, logs: Path, run: Runner = subprocess.run,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen, sleep=time.sleep, clock=time.monotonic,
                 look_every_s: float = 15.0, tries: int = 4):
        self.cfg, self.region, self.config_file, self.logs = cfg, region, config_file, logs
        self.run, self.popen, self.sleep, self.clock = run, popen, sleep, clock
        self.look_every_s, self.tries = look_every_s, tries
        self.jobs: dict[str, TpuVmJob] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def _gcloud(self, argv: list[str]) -> subprocess.CompletedProcess:
        tries = 0
        while (done := self.run(argv, text=True, capture_output=True)).returncode != 0:
            tries += 1
            if tries == self.tries or not _IO.search(done.stderr):
                raise GcloudError(argv, done.stderr)
            self.sleep(2.0 * 2 ** (tries - 1))  # 2 s, 4 s, 8 s, ...
        return done

    def _fail(self, job: TpuVmJob, why: str) -> None:
        with open(job.log, "a") as out:
            out.write(f"[diloco] {job.name}: {why}\n")
        job.rc = 1

    def _release(self, job: TpuVmJob) -> None:
        if job.held:
            try:
                self._gcloud(job.commands["delete"])
            except GcloudError as err:
                if "NOT_FOUND" not in err.stderr:
                    raise
            job.held = False

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, processes: int = 1) -> TpuVmJob:
        """Request the learner's slice (`env` and `processes` are the local backend's: the slice's hosts decide).
        A restart finds its slice still there and runs the new container on it."""
        _check_region(self.cfg, name, self.region)
        job = TpuVmJob(name, argv, self.logs / f"{name}.log",
                       queued_resource_commands(self.cfg, name, argv, str(self.config_file)))
        self.jobs[name] = job
        try:
            self._gcloud(job.commands["create"])
        except GcloudError as err:
            if "ALREADY_EXISTS" not in err.stderr:
                self._fail(job, f"queued resource refused: {err}")
                return job
        job.held = True
        return job

    def has(self, name: str) -> bool:
        return name in self.jobs

    def where_log(self, name: str) -> str:
        return str(self.jobs[name].log)

    def _look(self, job: TpuVmJob) -> None:
        job.look_at = self.clock() + self.look_every_s
        try:
            qr = json.loads(self._gcloud(job.commands["describe"]).stdout)
            state = qr.get("state", {}).get("state", "")
            if state == "ACTIVE":
                self._gcloud(job.commands["copy_config"])
                with open(job.log, "ab") as out:
                    job.proc = self.popen(job.commands["run"], stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
            elif state in _DOWN:
                why = qr["state"].get("failedData", {}).get("error", {}).get("message")
                self._release(job)
                self._fail(job, f"queued resource {state}" + (f": {why}" if why else ""))
        except GcloudError as err:
            self._fail(job, str(err))

    def poll(self, name: str) -> int | None:
        """None while the slice is coming up or the container runs; then its exit code (1: the slice failed).
        A learner that finished, or was told to stop, gives its slice back; a failed one keeps it for its restart."""
        job = self.jobs[name]
        if job.rc is None and job.proc is not None:
            job.rc = job.proc.poll()
            if job.rc == 0 or (job.rc is not None and job.release):
                self._release(job)
        elif job.rc is None and self.clock() >= job.look_at:
            self._look(job)
        return job.rc

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        """SIGTERM to a running container: it gets SIGTERM on every host (a learner hands in and says it left), and
        the slice goes back once it exited. Otherwise (SIGKILL, or not running yet) the slice is deleted now."""
        job = self.jobs[name]
        running = job.proc is not None and job.proc.poll() is None
        if sig == signal.SIGTERM and running:
            self._gcloud(job.commands["stop"])
            job.release = True
            return
        if running:
            job.proc.kill()
            job.proc.wait()
        self._release(job)
        if job.rc is None:
            job.rc = -sig

    def wait(self, name: str, timeout: float | None = None) -> int:
        deadline = None if timeout is None else self.clock() + timeout
        while (rc := self.poll(name)) is None:
            if deadline is not None and self.clock() > deadline:
                raise subprocess.TimeoutExpired(name, timeout)
            self.sleep(1.0)
        return rc

    def stop_all(self, timeout: float = 10.0) -> None:
        """Delete every slice this backend still holds (each delete waits for its operation); every one is tried."""
        failed = []
        for name in self.jobs:
            try:
                self.signal(name, signal.SIGKILL)
            except GcloudError as err:
                failed.append(f"{name}: {err}")
        if failed:
            raise RuntimeError("queued resources not deleted, delete them by hand: " + "; ".join(failed))

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join(self.jobs[name].log.read_text(errors="replace").splitlines()[-lines:])
        except (KeyError, OSError):
            return "(no log)"


# --- every region's backend behind one job interface -------------------------------------------------------------

def jobs_for(cfg: Config, region: str | None, config_file: Path, logs: Path, run: Runner = subprocess.run,
             popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> GkeJobs | TpuVmJobs:
    """The backend of one region's learners (`region` None: the syncer's, a CPU JobSet in the home cluster)."""
    kind = cfg.backend.kind
    if kind == "local":
        raise ValueError("backend.kind local has no per-region backend: LocalJobs runs every job on this machine")
    if region is None or kind == "gke":
        return GkeJobs(cfg, config_file.read_text(), region, run=run)
    return TpuVmJobs(cfg, region, config_file, logs / region, run=run, popen=popen)


def write_plan(cfg: Config, config_text: str, out: Path) -> list[Path]:
    """Every manifest and command of the run into `out`, for review or `kubectl apply -f`."""
    out.mkdir(parents=True, exist_ok=True)
    conf = ["--config", "config.yaml"]
    namespaces = dict.fromkeys([cfg.backend.namespace, *(cfg.backend.slice_of(r.name).namespace for r in cfg.regions)])
    docs = [*(config_map(cfg, config_text, ns) for ns in namespaces),
            *(jobset(cfg, name, ["syncer", *conf, "--shard", str(i)]) for i, name in enumerate(cfg.syncer_ids()))]
    qr = {}
    for lid in cfg.learner_ids():
        argv = ["learner", *conf, "--learner", lid, "--corpus", "corpus"]
        docs.append(jobset(cfg, lid, argv))
        qr[lid] = queued_resource_commands(cfg, lid, argv, str(out / "config.yaml"))
    (out / "config.yaml").write_text(config_text)
    (out / "jobsets.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
    (out / "queued-resources.json").write_text(json.dumps(qr, indent=1))
    return [out / "jobsets.yaml", out / "queued-resources.json"]
