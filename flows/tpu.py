"""Production job backend: one TPU slice per learner, v5p and v6e mixed by region, the syncer on CPU.

Everything here is rendered from the run's config: GKE JobSet manifests (what `GkeJobs` applies with
kubectl) and, for TPU VMs without GKE, the queued-resource requests and the commands that run a
learner on every host of its slice. The command line inside is the same `diloco learner` / `diloco
syncer` that the local backend starts; only the paths of the config and the corpus change.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
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


def job_name(cfg: Config, name: str) -> str:
    """A DNS-1035 name for a job of this run (JobSet names are capped at 63 characters)."""
    return re.sub(r"[^a-z0-9-]", "-", f"dl-{cfg.run.id}-{name}".lower())[:63].rstrip("-")


def remote_argv(cfg: Config, argv: list[str]) -> list[str]:
    """The same `diloco` arguments with the config and corpus at the paths a remote job sees them."""
    out, paths = list(argv), {"--config": f"{cfg.backend.config_dir}/config.yaml", "--corpus": cfg.backend.corpus_dir}
    for i, arg in enumerate(out[:-1]):
        if arg in paths:
            out[i + 1] = paths[arg]
    return ["diloco", *out]


def config_map(cfg: Config, config_text: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": job_name(cfg, "config"), "namespace": cfg.backend.namespace},
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
    hosts = 1
    if learner:
        s = b.slice_of(cfg.region_of(name).name)
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
    labels = {"diloco/run": cfg.run.id, "diloco/job": name}
    pod_meta = {"labels": labels}
    if port := cfg.learner_port(name) if learner else cfg.syncer_port(cfg.syncer_ids().index(name)):
        container["ports"] = [{"name": "metrics", "containerPort": port}]
        pod_meta["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                   "prometheus.io/path": "/metrics"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": job_name(cfg, name), "namespace": b.namespace, "labels": labels,
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
    """gcloud commands for one learner on a TPU VM slice: request it, copy the config, run, release."""
    b = cfg.backend
    s = b.slice_of(cfg.region_of(learner_id).name)
    node = job_name(cfg, learner_id)
    where = [f"--project={b.project}", f"--zone={s.zone}"]
    docker = (f"sudo docker run --rm --name diloco --privileged --net=host -v {b.config_dir}:{b.config_dir}:ro "
              f"-v {b.corpus_dir}:{b.corpus_dir}:ro {b.image} " + " ".join(remote_argv(cfg, argv)))
    return {
        "create": ["gcloud", "compute", "tpus", "queued-resources", "create", node, f"--node-id={node}", *where,
                   f"--accelerator-type={slice_shape(s).accelerator_type}", f"--runtime-version={s.runtime_version}",
                   *(["--spot"] if s.spot else [])],
        "copy_config": ["gcloud", "compute", "tpus", "tpu-vm", "scp", config_file,
                        f"{node}:{b.config_dir}/config.yaml", "--worker=all", *where],
        "run": ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node, "--worker=all", *where, "--command", docker],
        "delete": ["gcloud", "compute", "tpus", "queued-resources", "delete", node, "--force", "--quiet", *where],
    }


Runner = Callable[..., subprocess.CompletedProcess]


@dataclass
class GkeJob:
    name: str
    argv: list[str]
    log: str  # how to read it: JobSet pods log to the cluster, not to a file here


class GkeJobs:
    """The job interface of `LocalJobs` on a GKE cluster through kubectl; `run` is injectable for tests."""

    def __init__(self, cfg: Config, config_text: str, run: Runner = subprocess.run):
        self.cfg, self.run = cfg, run
        self.jobs: dict[str, GkeJob] = {}
        self.deleted: set[str] = set()  # JobSets signal() deleted: gone means done, not lost
        self._apply(config_map(cfg, config_text))

    def _kubectl(self, *args: str, manifest: dict | None = None) -> subprocess.CompletedProcess:
        return self.run(["kubectl", "--namespace", self.cfg.backend.namespace, *args], check=True, text=True,
                        capture_output=True, input=None if manifest is None else yaml.safe_dump(manifest))

    def _apply(self, manifest: dict) -> None:
        self._kubectl("apply", "-f", "-", manifest=manifest)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, processes: int = 1) -> GkeJob:
        """Apply the job's JobSet (`processes` is the local backend's: here the slice's hosts decide)."""
        self._kubectl("delete", "jobset", job_name(self.cfg, name), "--ignore-not-found", "--wait=true")  # a restart
        self._apply(jobset(self.cfg, name, argv))
        self.deleted.discard(name)
        self.jobs[name] = GkeJob(name, argv, f"kubectl logs -l diloco/job={name} -n {self.cfg.backend.namespace}")
        return self.jobs[name]

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
        self._kubectl("delete", "jobset", "-l", f"diloco/run={self.cfg.run.id}", "--ignore-not-found",
                      f"--timeout={int(timeout)}s")

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return self._kubectl("logs", "-l", f"diloco/job={name}", f"--tail={lines}").stdout
        except subprocess.CalledProcessError as err:
            return f"(no log: {err.stderr.strip()})"


def write_plan(cfg: Config, config_text: str, out: Path) -> list[Path]:
    """Every manifest and command of the run into `out`, for review or `kubectl apply -f`."""
    out.mkdir(parents=True, exist_ok=True)
    conf = ["--config", "config.yaml"]
    docs = [config_map(cfg, config_text), *(jobset(cfg, name, ["syncer", *conf, "--shard", str(i)])
                                            for i, name in enumerate(cfg.syncer_ids()))]
    qr = {}
    for lid in cfg.learner_ids():
        argv = ["learner", *conf, "--learner", lid, "--corpus", "corpus"]
        docs.append(jobset(cfg, lid, argv))
        qr[lid] = queued_resource_commands(cfg, lid, argv, str(out / "config.yaml"))
    (out / "config.yaml").write_text(config_text)
    (out / "jobsets.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
    (out / "queued-resources.json").write_text(json.dumps(qr, indent=1))
    return [out / "jobsets.yaml", out / "queued-resources.json"]
