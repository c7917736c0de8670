"""Where a run's processes run: the GCP / Kubernetes patterns, SliceConfig and BackendConfig."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diloco.config.sections import _ABS_PATH, _IMAGE, _Section

_PROJECT = r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$"  # a GCP project id
_NAMESPACE = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # a Kubernetes namespace (DNS-1123 label)
_CONTEXT = r"^[^\s]+$"  # a kubeconfig context's name: any non-blank text (gke_<project>_<location>_<cluster>)


class SliceConfig(_Section):
    """One region's learner slice in production: each learner of the region gets one such TPU slice, in the
    region's own project, cluster and namespace when set (else the backend's)."""
    project: str | None = Field(None, pattern=_PROJECT, description="GCP project of this region's slices; "
                                "default backend.project")
    context: str | None = Field(None, pattern=_CONTEXT, description="kubeconfig context (cluster) of this region's "
                                "JobSets (kind gke); default backend.context")
    namespace: str | None = Field(None, pattern=_NAMESPACE, description="namespace of this region's JobSets "
                                  "(kind gke); default backend.namespace")
    generation: Literal["v5p", "v6e"] = "v5p"
    topology: str = Field("2x2x1", pattern=r"^[1-9]\d*(x[1-9]\d*){1,2}$", description="chips per axis, e.g. 2x2x1, 2x4")
    zone: str = "us-east5-a"
    runtime_version: str = Field("v2-alpha-tpuv5", description="TPU VM software (queued resources)")
    spot: bool = False

    @model_validator(mode="after")
    def _topology_fits(self) -> SliceConfig:
        dims = len(self.topology.split("x"))
        if dims != (3 if self.generation == "v5p" else 2):
            raise ValueError(f"topology {self.topology!r}: {self.generation} slices have "
                             f"{3 if self.generation == 'v5p' else 2} axes")
        return self


class BackendConfig(_Section):
    """Where the flow starts the run's processes: `local` child processes; `gke`: one TPU slice per learner (a
    JobSet in its region's cluster) and the syncer on CPU in the home cluster; `tpu-vm`: one queued-resource
    TPU VM slice per learner (gcloud), the syncer still a JobSet in the home cluster."""
    kind: Literal["local", "gke", "tpu-vm"] = "local"
    project: str = Field("my-project", pattern=_PROJECT, description="GCP project; regions may override it (slices)")
    context: str | None = Field(None, pattern=_CONTEXT, description="kubeconfig context of the home cluster (the "
                                "syncer's; regions may override it); default kubectl's current context")
    image: str = Field("us-docker.pkg.dev/my-project/diloco/diloco:latest", pattern=_IMAGE,
                       description="image with `diloco` installed (a registry reference: no spaces or shell characters)")
    namespace: str = Field("default", pattern=_NAMESPACE, description="namespace in the home cluster; regions may "
                           "override it (slices)")
    config_dir: str = Field("/etc/diloco", pattern=_ABS_PATH, description="where a job finds the run's config.yaml "
                            "(an absolute path of letters, digits and ._-/)")
    corpus_dir: str = Field("/data/corpus", pattern=_ABS_PATH, description="where a job finds the prepared corpus (e.g. "
                            "a GCS FUSE mount; an absolute path of letters, digits and ._-/)")
    secret_name: str = Field("diloco-secrets", pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$",
                             description="Kubernetes Secret in the namespace that holds the passwords: each of "
                                         "state.password_env and transport.sasl_password_env is a key of it, and a "
                                         "job's env var of that name is set from it (the value never enters a manifest)")
    slices: dict[str, SliceConfig] = Field(default_factory=dict, description="per region name: its slice and where it "
                                           "runs; regions not listed get the defaults")

    def slice_of(self, region: str) -> SliceConfig:
        """The region's slice with its project, context and namespace resolved (the backend's where unset)."""
        s = self.slices.get(region, SliceConfig())
        return s.model_copy(update={k: getattr(s, k) or getattr(self, k) for k in ("project", "context", "namespace")})
