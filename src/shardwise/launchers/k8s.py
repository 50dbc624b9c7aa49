"""Kubernetes: a Kubeflow Training Operator `PyTorchJob` (kubeflow.org/v1) manifest.

Worker pods run `torchrun -m shardwise.cli.main train ...`: with an elastic policy the
operator gives every pod the rendezvous as PET_* variables (PET_RDZV_ENDPOINT pointing at
worker 0's service, PET_NNODES=min:max, PET_NPROC_PER_NODE, PET_MAX_RESTARTS), which
torchrun reads, and shardwise joins torchrun's ranks. Checkpoints and metrics go to a shared
volume (the pods' working directory), so a restarted or rescheduled pod resumes from them."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from shardwise.checkpoint.manager import GRACE_ENV, SIGNAL_GRACE_S
from shardwise.config import Config
from shardwise.errors import ConfigError
from shardwise.launchers.job import JobShape, overrides_of
from shardwise.launchers.nodes import DEFAULT_PORT

CONTAINER = "pytorch"  # the operator finds the training container by this name
# what `docker build -t shardwise .` makes of the repository's Dockerfile (push it where the
# cluster pulls from, or pass --image)
DEFAULT_IMAGE = "shardwise:latest"


@dataclass(frozen=True)
class K8sJob:
    name: str
    image: str
    shape: JobShape
    namespace: str = ""
    claim: str = "shardwise-checkpoints"  # PersistentVolumeClaim shared by all workers
    mount: str = "/workspace"
    max_restarts: int = 3


def check_names(job: K8sJob, cfg: Config) -> None:
    """Names Kubernetes would reject, and a run.dir that would not survive a pod restart."""
    import re

    dns = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    for flag, value, limit in (("--name", job.name, 63), ("--claim", job.claim, 253)):
        if not dns.match(value) or len(value) > limit:
            raise ConfigError(
                f"{flag}={value!r} is not a valid Kubernetes name (lower-case letters, digits "
                f"and '-', at most {limit} characters). Fix: {flag} shardwise-job"
            )
    if not job.image:
        raise ConfigError(
            "--image is empty. Fix: --image shardwise:latest (the repository's Dockerfile: "
            "docker build -t shardwise .) or your registry's copy of it."
        )
    run_dir = posixpath.normpath(posixpath.join(job.mount, cfg.run.dir))
    if not (run_dir + "/").startswith(posixpath.normpath(job.mount) + "/"):
        raise ConfigError(
            f"run.dir={cfg.run.dir!r} is outside the shared volume mounted at {job.mount}: "
            "a restarted pod would not find its checkpoints. Fix: a relative run.dir "
            "(it resolves on the volume) or --mount-path."
        )


def _container(job: K8sJob, cfg: Config) -> dict[str, Any]:
    s = job.shape
    resources: dict[str, dict[str, Any]] = {}
    if s.gpus_per_node:
        # Quantities are strings in the API (the client's models type them so).
        resources["limits"] = {"nvidia.com/gpu": str(s.gpus_per_node)}
    if s.cpus_per_node:
        resources.setdefault("limits", {})["cpu"] = str(s.cpus_per_node)
        resources["requests"] = {"cpu": str(s.cpus_per_node)}
    threads = max(1, s.cpus_per_node // s.nproc_per_node) if s.cpus_per_node else 1
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.image,
        # The rendezvous comes from the operator's PET_* variables; ranks per pod are given
        # explicitly because operators before 1.8 only export them from a deprecated field.
        "command": ["torchrun", f"--nproc-per-node={s.nproc_per_node}", "-m", "shardwise.cli.main"],
        "args": ["train", *overrides_of(cfg)],
        "workingDir": job.mount,  # relative run.dir lands on the shared volume
        "env": [
            {"name": "OMP_NUM_THREADS", "value": str(threads)},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": GRACE_ENV, "value": str(SIGNAL_GRACE_S)},
        ],
        # The operator's services are headless and it looks the job's port up by this name.
        "ports": [{"name": "pytorchjob-port", "containerPort": DEFAULT_PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": job.mount}],
    }
    if resources:
        container["resources"] = resources
    return container


def pytorchjob(job: K8sJob, cfg: Config) -> dict[str, Any]:
    """The manifest as a dict (serialise with `to_yaml`)."""
    check_names(job, cfg)
    s = job.shape
    metadata: dict[str, Any] = {"name": job.name, "labels": {"app.kubernetes.io/name": "shardwise"}}
    if job.namespace:
        metadata["namespace"] = job.namespace
    pod = {
        # an evicted pod gets SIGTERM, then this long to save before SIGKILL (k8s' default
        # 30 s is short for a large checkpoint); torchrun forwards it to the ranks
        "terminationGracePeriodSeconds": SIGNAL_GRACE_S,
        "containers": [_container(job, cfg)],
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": job.claim}}],
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {
            # torch elastic across pods: c10d rendezvous on worker 0's service; the job keeps
            # running on any worker count in [min, max] and restarts ranks after failures.
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "rdzvPort": DEFAULT_PORT,
                "minReplicas": s.min_nodes,
                "maxReplicas": s.max_nodes,
                "maxRestarts": job.max_restarts,
            },
            "nprocPerNode": str(s.nproc_per_node),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": job.max_restarts},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": s.max_nodes,
                    "restartPolicy": "OnFailure",  # a failed pod restarts and rejoins
                    "template": {"spec": pod},
                }
            },
        },
    }


def to_yaml(manifest: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)
