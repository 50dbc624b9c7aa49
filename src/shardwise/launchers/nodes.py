"""Multi-node jobs on torch elastic: one agent per node, joined by a c10d rendezvous hosted on
node 0 — what `torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT` does, so a
shardwise job and a torchrun job of the same shape are the same thing.

Also: where each parallel dimension falls relative to nodes. Ranks are laid out row-major
over (pp, dp, tp) and torch elastic numbers ranks node by node, so tp groups stay inside a
node whenever tp divides the ranks per node, and pp (outermost) crosses nodes first."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardwise.config import Config
from shardwise.errors import ConfigError, ShardwiseError

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

    from shardwise.training.validate import Derived

DEFAULT_PORT = 29400  # torchrun's default c10d rendezvous port


@dataclass(frozen=True)
class Nodes:
    """This node's place in a multi-node job."""

    nnodes: int
    node_rank: int
    host: str  # rendezvous host: node 0, which runs the c10d store
    port: int
    nproc_per_node: int

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def _whole(flag: str, value: str, example: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{flag} {value!r} is not a whole number. Fix: {flag} {example}"
        ) from None


def parse_nodes(nnodes: str, node_rank: str | None, rdzv: str | None, nproc: int) -> Nodes:
    """Validate `--nnodes/--node-rank/--rdzv`. Under Slurm the node rank defaults to
    $SLURM_NODEID, so one sbatch line serves every node."""
    n = _whole("--nnodes", nnodes, "2")
    if n < 1:
        raise ConfigError(f"--nnodes={n} must be >= 1. Fix: --nnodes 2")
    if node_rank is None:
        node_rank = os.environ.get("SLURM_NODEID")
        if node_rank is None and n > 1:
            raise ConfigError(
                f"--nnodes {n} needs this node's --node-rank (0 for the node that hosts the "
                f"rendezvous, 1..{n - 1} for the others). Fix: --node-rank 0"
            )
    r = _whole("--node-rank", node_rank or "0", "0")
    if not 0 <= r < n:
        raise ConfigError(f"--node-rank={r} is outside 0..{n - 1} for --nnodes {n}.")
    if rdzv is None:
        if n > 1:
            raise ConfigError(
                f"--nnodes {n} needs --rdzv HOST:PORT, the address of node 0 that every node "
                f"can reach. Fix: --rdzv node0.example.org:{DEFAULT_PORT}"
            )
        rdzv = f"127.0.0.1:{DEFAULT_PORT}"
    host, _, port = rdzv.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv {rdzv!r} is not HOST:PORT. Fix: --rdzv node0:{DEFAULT_PORT}")
    return Nodes(n, r, host.strip("[]"), int(port), nproc)


def route_to(host: str, port: int) -> tuple[str, str | None]:
    """(address, interface) this machine uses to reach `host`: the address the other nodes
    can reach us on, which the hostname need not resolve to on multi-homed hosts."""
    try:
        family, kind, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(target)  # UDP: picks the route, sends nothing
            addr = s.getsockname()[0]
    except OSError as exc:
        raise ConfigError(
            f"--rdzv {host}:{port}: this node has no route to {host} ({exc}). Fix: the "
            "address of node 0 as seen from this node."
        ) from None
    return addr, _interface_of(addr)


def _interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 `addr` (Linux SIOCGIFADDR), or None."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def placement(nproc_per_node: int, pp: int, dp: int, tp: int) -> dict[str, bool]:
    """For each mesh dimension, True when every one of its groups lies inside one node."""
    layout = torch.arange(pp * dp * tp).view(pp, dp, tp)
    inside = {}
    for axis, name in enumerate(("pp", "dp", "tp")):
        lines = layout.movedim(axis, -1).reshape(-1, layout.shape[axis]) // nproc_per_node
        inside[name] = bool((lines == lines[:, :1]).all())
    return inside


def placement_line(nodes: Nodes, pp: int, dp: int, tp: int) -> str:
    """One line for the plan; warns when tensor parallelism would cross nodes."""
    inside = placement(nodes.nproc_per_node, pp, dp, tp)
    where = ", ".join(
        f"{d}={size} {'inside a node' if inside[d] else 'across nodes'}"
        for d, size in (("tp", tp), ("pp", pp), ("dp", dp))
        if size > 1
    )
    line = f"nodes: {nodes.nnodes} x {nodes.nproc_per_node} ranks" + (f"; {where}" if where else "")
    if tp > 1 and not inside["tp"]:
        fits = [d for d in range(1, nodes.nproc_per_node + 1) if nodes.nproc_per_node % d == 0]
        line += (
            f"\nwarning: tp={tp} groups span nodes ({nodes.nproc_per_node} ranks per node); "
            f"tensor parallelism needs the fast intra-node links. Fix: --parallel.tp in {fits}"
        )
    return line


def launch_nodes(
    cfg: Config, nodes: Nodes, max_restarts: int = 0, derived: Derived | None = None
) -> None:
    """Run this node's agent: it joins the rendezvous, starts `nproc_per_node` ranks, and
    restarts them (up to `max_restarts` times, in a new rendezvous round) when any rank of
    the job fails. `derived`: the job layer's run description for the whole world, handed
    to this node's ranks."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from shardwise.distributed import device
    from shardwise.distributed.store import BIND_ENV
    from shardwise.launchers.local import run_elastic

    # With the rendezvous store shared with the ranks (torch's default), a node that joins
    # a later round — a replacement for a lost node — waits for a MASTER_ADDR the surviving
    # node 0 published only in round 0, and the job deadlocks. One store per round avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    addr, interface = route_to(nodes.host, nodes.port)
    if interface:
        device.pin_socket_interface(interface)
    config = _launch_config(cfg, nodes, addr, max_restarts)
    os.environ[BIND_ENV] = "1"  # rank 0's store on MASTER_ADDR (this node's address) only
    try:
        run_elastic(config, cfg, derived=derived)
    except ShardwiseError as exc:
        lost = _lost_node(exc, nodes, addr, max_restarts)
        if lost is None:
            raise
        raise lost from None
    except (RendezvousError, DistError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ShardwiseError(
            f"node {nodes.node_rank}: the rendezvous at {nodes.endpoint} failed "
            f"({type(exc).__name__}: {first}). Fix: start all {nodes.nnodes} nodes with the "
            f"same --nnodes and --rdzv, node 0 reachable from every node, within "
            f"parallel.timeout_s={cfg.parallel.timeout_s:g} s of each other."
        ) from None


def _launch_config(cfg: Config, nodes: Nodes, addr: str, max_restarts: int) -> LaunchConfig:
    """torch elastic's agent configuration for this node, reachable at `addr`."""
    from torch.distributed.launcher.api import LaunchConfig

    from shardwise.launchers import rendezvous
    from shardwise.launchers.local import scratch_logs

    return LaunchConfig(
        min_nodes=nodes.nnodes,
        max_nodes=nodes.nnodes,
        nproc_per_node=nodes.nproc_per_node,
        # One id per job: the Slurm job survives requeues; elsewhere the endpoint is the job.
        run_id=os.environ.get("SLURM_JOB_ID", "shardwise"),
        # torch's c10d rendezvous, its stores listening on this node's address only
        rdzv_backend=rendezvous.register(),
        rdzv_endpoint=nodes.endpoint,
        # Node 0 hosts the store: c10d's own guess compares hostnames, which fails on
        # multi-homed hosts and names every node a host when they share one.
        rdzv_configs={
            "is_host": nodes.node_rank == 0,
            "bind": addr,
            "join_timeout": cfg.parallel.timeout_s,
        },
        local_addr=addr,
        max_restarts=max_restarts,
        monitor_interval=0.2,
        logs_specs=scratch_logs(),
    )


def _lost_node(
    exc: ShardwiseError, nodes: Nodes, addr: str, max_restarts: int
) -> ShardwiseError | None:
    """The error naming the nodes a rank lost contact with, when `exc` says so (else None)."""
    # gloo names the remote end of the broken connection ("Read error [ADDR]:PORT:
    # Connection reset by peer"): that node's ranks are gone.
    lost = sorted(set(re.findall(r"\[([0-9A-Fa-f.:]+)\]:\d+", str(exc))) - {addr})
    if not lost:
        return None
    hint = (
        ""
        if max_restarts
        else (
            " Fix: --max-restarts N with --checkpoint.every=M keeps the job waiting for the "
            "node (or a replacement) and resumes from the newest checkpoint."
        )
    )
    return ShardwiseError(
        f"node {nodes.node_rank}: lost contact with the node at {', '.join(lost)}: {exc}{hint}"
    )
