"""`shardwise launch {slurm,k8s}` (write — and for Slurm submit — a cluster job) and the
multi-node form of `train` (`--nnodes N --node-rank R --rdzv HOST:PORT`)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import NoReturn

from shardwise.config import Config, load_config, split_overrides
from shardwise.errors import ConfigError, ShardwiseError, print_error

DESCRIPTION = """targets:
  slurm   write an sbatch script (one task per node running the elastic agent, rendezvous
          on the first node, --requeue); --submit runs sbatch and prints the job id
  k8s     write a Kubeflow PyTorchJob manifest for `kubectl apply -f`

The config is checked for every world size the job may run at before anything is written."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"shardwise launch: {message}. Run `shardwise launch --help`.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="shardwise launch",
        add_help=False,
        usage="%(prog)s {slurm,k8s} [CONFIG.toml] --nodes N[:MAX] [options] "
        "[--section.key=value ...]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", choices=["slurm", "k8s"], help="the cluster manager")
    p.add_argument("config", nargs="?", default=None, help="TOML config of the training job")
    both = p.add_argument_group("both targets")
    both.add_argument("--nodes", required=True, help="N, or MIN:MAX for an elastic job")
    both.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node")
    both.add_argument("--cpus-per-node", type=int, default=0, help="CPUs per node (CPU clusters)")
    both.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node")
    both.add_argument("--name", default=None, help="job name (default: from the config)")
    both.add_argument("--max-restarts", type=int, default=None, help="restarts after a failure")
    both.add_argument(
        "-o", "--output", default=None, help="file to write (default NAME.sbatch/.yaml)"
    )
    slurm = p.add_argument_group("slurm")
    slurm.add_argument("--partition", default="", help="sbatch --partition")
    slurm.add_argument("--time", default="", help="sbatch --time limit")
    slurm.add_argument("--account", default="", help="sbatch --account")
    slurm.add_argument("--port", type=int, default=None, help="rendezvous port (default 29400)")
    slurm.add_argument("--submit", action="store_true", help="run sbatch and print the job id")
    slurm.add_argument(
        "--container-image",
        default="",
        help="run in this image through pyxis/enroot (e.g. shardwise, the repo's Dockerfile)",
    )
    k8s = p.add_argument_group("k8s")
    k8s.add_argument(
        "--image",
        default=None,
        help="container image with shardwise installed (default shardwise:latest, the "
        "repository's Dockerfile)",
    )
    k8s.add_argument("--namespace", default="", help="Kubernetes namespace")
    k8s.add_argument("--claim", default="shardwise-checkpoints", help="PVC for checkpoints")
    k8s.add_argument("--mount-path", default="/workspace", help="where the claim is mounted")
    return p


def _refuse(args: argparse.Namespace, flags: dict[str, object], target: str) -> None:
    """Options of the other target are refused, never silently ignored."""
    for flag, default in flags.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) != default:
            raise ConfigError(f"{flag} does not apply to `launch {target}`. Fix: remove it.")


def _slurm(args: argparse.Namespace, cfg: Config, shape, name: str) -> None:
    from shardwise.launchers.nodes import DEFAULT_PORT
    from shardwise.launchers.slurm import SlurmJob, sbatch_script, submit

    _refuse(args, {"--image": None, "--namespace": "", "--claim": "shardwise-checkpoints"}, "slurm")
    _refuse(args, {"--mount-path": "/workspace"}, "slurm")
    from shardwise.job import check_restarts
    from shardwise.launchers.job import overrides_of

    check_restarts(args.max_restarts or 0, cfg)
    job = SlurmJob(
        name=name,
        shape=shape,
        overrides=overrides_of(cfg),
        partition=args.partition,
        time=args.time,
        account=args.account,
        port=args.port or DEFAULT_PORT,
        max_restarts=args.max_restarts or 0,
        workdir=str(Path.cwd()),
        container_image=args.container_image,
    )
    out = Path(args.output or f"{name}.sbatch")
    out.write_text(sbatch_script(job))
    print(f"wrote {out}")
    if args.submit:
        print(f"submitted Slurm job {submit(str(out))}")


def _k8s(args: argparse.Namespace, cfg: Config, shape, name: str) -> None:
    from shardwise.launchers.k8s import DEFAULT_IMAGE, K8sJob, pytorchjob, to_yaml

    slurm_only = {"--partition": "", "--time": "", "--account": "", "--port": None}
    slurm_only["--container-image"] = ""
    _refuse(args, {**slurm_only, "--submit": False}, "k8s")
    job = K8sJob(
        name=name,
        image=DEFAULT_IMAGE if args.image is None else args.image,
        shape=shape,
        namespace=args.namespace,
        claim=args.claim,
        mount=args.mount_path,
        max_restarts=3 if args.max_restarts is None else args.max_restarts,
    )
    out = Path(args.output or f"{name}.yaml")
    out.write_text(to_yaml(pytorchjob(job, cfg)))
    print(f"wrote {out}  (kubectl apply -f {out})")


def launch_main(argv: list[str]) -> int:
    """Entry of `shardwise launch`; returns the exit code like `main`."""
    from shardwise.launchers.job import check_config, job_shape

    if not argv or argv[0] in ("-h", "--help") or "--help" in argv or "-h" in argv:
        print(_parser().format_help())
        return 0
    try:
        own, overrides = split_overrides(argv)
        args = _parser().parse_args(own)
        cfg = load_config(args.config, overrides)
        shape = job_shape(args.nodes, args.gpus_per_node, args.cpus_per_node, args.nproc_per_node)
        if args.max_restarts is not None and args.max_restarts < 0:
            raise ConfigError(f"--max-restarts={args.max_restarts} must be >= 0.")
        check_config(cfg, shape)
        if not cfg.checkpoint.every:
            print(
                "note: checkpoint.every=0 saves no checkpoints, so a requeued or restarted "
                "job starts again from step 0. Fix: --checkpoint.every=N",
                file=sys.stderr,
            )
        name = args.name or re.sub(r"[^a-z0-9-]", "-", f"shardwise-{cfg.model.name}".lower())
        (_slurm if args.target == "slurm" else _k8s)(args, cfg, shape, name)
    except ShardwiseError as exc:
        return print_error(exc)
    return 0


def train_nodes(cfg: Config, nproc: int, args: argparse.Namespace) -> None:
    """`train --nnodes ...`: prepare the job for the whole world, run this node's agent."""
    from shardwise.job import check_restarts, prepare
    from shardwise.launchers.nodes import launch_nodes, parse_nodes, placement_line

    nodes = parse_nodes(args.nnodes, args.node_rank, args.rdzv, nproc)
    restarts = check_restarts(args.max_restarts, cfg)
    # every node plans alike (same inputs); global rank 0 takes the run-dir lock
    plan_auto = getattr(args, "plan", None) == "auto"
    force = getattr(args, "force", False)
    with prepare(cfg, nodes.world, force=force, plan_auto=plan_auto, lock=False) as job:
        d = job.derived
        print(placement_line(nodes, d.pp, d.dp, d.tp), flush=True)
        launch_nodes(job.cfg, nodes, restarts, job.derived)


def explain_world(args: argparse.Namespace, nproc: int) -> int:
    """World size for `explain`: --nnodes × ranks per node; options that only place a node
    in a running job are refused rather than ignored."""
    for flag, value in (("--node-rank", args.node_rank), ("--rdzv", args.rdzv)):
        if value is not None:
            raise ConfigError(f"{flag} is an option of train. Fix: drop it here.")
    if args.nnodes is None:
        return nproc
    from shardwise.launchers.nodes import parse_nodes

    return parse_nodes(args.nnodes, "0", "127.0.0.1:1", nproc).world
