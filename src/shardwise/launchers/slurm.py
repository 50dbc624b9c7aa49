"""Slurm: an sbatch script with ONE TASK PER NODE, each running shardwise's torch elastic
agent (launchers/nodes.py), which starts the node's ranks and meets the other nodes at a
c10d rendezvous on the first node of the allocation.

Why one task per node and not one per device: the per-node agent is the same code path as
local and torchrun runs (one thing to test), it restarts the node's ranks in a new
rendezvous round after a rank fails (`--max-restarts`) without giving up the allocation,
and its rank numbering is node-major, so tensor-parallel groups stay inside a node. A node
that dies ends the step (`--kill-on-bad-exit`); `--requeue` lets Slurm start the job again
on healthy nodes, where `checkpoint.resume=auto` continues from the last checkpoint."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

from shardwise.checkpoint.manager import GRACE_ENV, SIGNAL_GRACE_S
from shardwise.errors import ShardwiseError
from shardwise.launchers.job import JobShape
from shardwise.launchers.nodes import DEFAULT_PORT


@dataclass(frozen=True)
class SlurmJob:
    name: str
    shape: JobShape
    overrides: list[str]  # the config, as --section.key=value
    partition: str = ""
    time: str = ""
    account: str = ""
    port: int = DEFAULT_PORT
    max_restarts: int = 0  # in-allocation restarts of the ranks by the elastic agent
    python: str = sys.executable  # the interpreter (and so the install) that runs shardwise
    workdir: str = ""
    container_image: str = ""  # pyxis/enroot: run in this image (the repo's Dockerfile)


def sbatch_script(job: SlurmJob) -> str:
    """The batch script: directives, the rendezvous address, and one srun line."""
    s = job.shape
    directives = [
        f"--job-name={job.name}",
        f"--nodes={s.min_nodes}"
        if s.min_nodes == s.max_nodes
        else f"--nodes={s.min_nodes}-{s.max_nodes}",
        "--ntasks-per-node=1",  # one elastic agent per node; it starts the ranks
    ]
    if s.cpus_per_node:
        directives.append(f"--cpus-per-task={s.cpus_per_node}")
    if s.gpus_per_node:
        directives.append(f"--gpus-per-node={s.gpus_per_node}")
    directives += [
        f"--{k}={v}"
        for k, v in (("partition", job.partition), ("time", job.time), ("account", job.account))
        if v
    ]
    directives += [
        # SIGTERM to the agents 120 s before the time limit: they forward it to the ranks,
        # which save the step they are in and exit 143 (checkpoint.on_signal)
        f"--signal=TERM@{SIGNAL_GRACE_S}",
        "--requeue",  # after a node failure or `scontrol requeue`: run again, resume
        "--open-mode=append",  # keep the earlier attempts' output in the same log
        "--output=%x-%j.out",
    ]
    if job.workdir:
        directives.append(f"--chdir={job.workdir}")
    threads = max(1, s.cpus_per_node // s.nproc_per_node) if s.cpus_per_node else 1
    # Words in double quotes are expanded by the batch shell; the rest is quoted literally.
    python = "python3" if job.container_image else shlex.quote(job.python)  # the image's
    train = [python, "-m", "shardwise.cli.main", "train"]
    train += ["--nnodes", '"$SLURM_JOB_NUM_NODES"', "--nproc-per-node", str(s.nproc_per_node)]
    train += ["--rdzv", f'"$head_addr:{job.port}"', "--max-restarts", str(job.max_restarts)]
    command = " ".join([*train, *(shlex.quote(o) for o in job.overrides)])
    lines = [
        "#!/bin/bash",
        "# Written by `shardwise launch slurm`: one task per node runs the torch elastic agent,",
        "# which starts --nproc-per-node ranks; the node rank comes from $SLURM_NODEID.",
        *[f"#SBATCH {d}" for d in directives],
        "set -euo pipefail",
        "# The c10d rendezvous runs on the first node, at the address Slurm itself uses for it.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'head_addr=$(scontrol show node "$head_node" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)',
        f"export OMP_NUM_THREADS={threads}",
        f"export {GRACE_ENV}={SIGNAL_GRACE_S}  # a save slower than this warns (checkpoint)",
        "export PYTHONUNBUFFERED=1",
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {_container(job)}{command}",
        "",
    ]
    return "\n".join(lines)


def _container(job: SlurmJob) -> str:
    """pyxis's srun options: the image, and the working directory mounted at the same path
    (run.dir and checkpoints stay on the shared file system)."""
    if not job.container_image:
        return ""
    image = shlex.quote(job.container_image)
    return f'--container-image={image} --container-mounts="$PWD:$PWD" --container-workdir="$PWD" '


def submit(script_path: str) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ShardwiseError(
            "--submit needs `sbatch`, which is not on PATH. Fix: run on a Slurm login node, "
            f"or submit {script_path} there with `sbatch {script_path}`."
        )
    proc = subprocess.run(
        [sbatch, "--parsable", script_path],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.abspath(script_path)),
    )
    if proc.returncode != 0:
        raise ShardwiseError(f"sbatch {script_path} failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]
