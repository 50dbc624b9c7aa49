"""What every cluster job needs from a config: its shape (nodes × ranks per node), checked
before anything is written or submitted, and the command line that reproduces the config
on a node without the original file."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config import Config
from shardwise.errors import ConfigError
from shardwise.training.validate import derive


@dataclass(frozen=True)
class JobShape:
    """Nodes (a range for elastic jobs) and what each node provides."""

    min_nodes: int
    max_nodes: int
    gpus_per_node: int
    cpus_per_node: int
    nproc_per_node: int


def parse_nodes_range(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` (elastic: the job runs on any node count in the range)."""
    lo, _, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nodes {value!r} is not N or MIN:MAX. Fix: --nodes 2") from None
    if not 1 <= low <= high:
        raise ConfigError(f"--nodes {value!r} needs 1 <= MIN <= MAX. Fix: --nodes 2 or 1:4")
    return low, high


def job_shape(nodes: str, gpus: int, cpus: int, nproc: int | None) -> JobShape:
    """Ranks per node: --nproc-per-node, else one per GPU, else one per CPU (CPU clusters)."""
    low, high = parse_nodes_range(nodes)
    for flag, value in (("--gpus-per-node", gpus), ("--cpus-per-node", cpus)):
        if value < 0:
            raise ConfigError(f"{flag}={value} must not be negative. Fix: {flag} 0")
    ranks = nproc if nproc is not None else (gpus or cpus)
    if ranks < 1:
        raise ConfigError(
            "no ranks per node: --gpus-per-node, --cpus-per-node and --nproc-per-node are all "
            "unset or 0. Fix: --gpus-per-node 8 (GPU nodes) or --cpus-per-node 32 (CPU nodes)."
        )
    if gpus and ranks > gpus:
        raise ConfigError(
            f"--nproc-per-node={ranks} exceeds --gpus-per-node={gpus}: two ranks cannot share "
            f"one GPU under NCCL. Fix: --nproc-per-node {gpus}"
        )
    return JobShape(low, high, gpus, cpus, ranks)


def check_config(cfg: Config, shape: JobShape) -> None:
    """Every config error for every world size the job may run at, before submission."""
    for n in range(shape.min_nodes, shape.max_nodes + 1):
        world = n * shape.nproc_per_node
        try:
            derive(cfg, world)
        except ConfigError as exc:
            raise type(exc)(
                f"on {n} node(s) x {shape.nproc_per_node} ranks = {world} ranks: {exc}"
            ) from None
    if cfg.run.device == "cpu" and shape.gpus_per_node:
        raise ConfigError(
            f"run.device='cpu' but --gpus-per-node={shape.gpus_per_node} requests GPUs "
            "that would sit idle. Fix: --gpus-per-node 0 --cpus-per-node N, or --run.device=auto"
        )


def overrides_of(cfg: Config) -> list[str]:
    """`--section.key=value` for every value that differs from the default, so a node needs
    neither the config file nor the working directory it was written in."""
    default, out = Config().to_dict(), []
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            if value != default[section][key]:
                shown = str(value).lower() if isinstance(value, bool) else str(value)
                out.append(f"--{section}.{key}={shown}")
    return out
