"""The validated parallel layout: degrees pp × dp × tp and the DeviceMesh holding their groups."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise.errors import ConfigError

DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Topology:
    """Degrees and groups of one rank. Ranks are laid out row-major over (pp, dp, tp), so tp
    neighbours are adjacent ranks (inside a node) and pp is the outermost dimension."""

    world: int
    rank: int
    pp: int
    dp: int
    tp: int
    mesh: DeviceMesh | None = field(default=None, compare=False)
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.pp * self.dp * self.tp != self.world:
            raise ConfigError(
                f"pp({self.pp}) * dp({self.dp}) * tp({self.tp}) = "
                f"{self.pp * self.dp * self.tp} != world size {self.world}"
            )

    def size(self, dim: str) -> int:
        return getattr(self, dim)

    def coord(self, dim: str) -> int:
        """This rank's index along `dim`."""
        pp_i, rest = divmod(self.rank, self.dp * self.tp)
        dp_i, tp_i = divmod(rest, self.tp)
        return {"pp": pp_i, "dp": dp_i, "tp": tp_i}[dim]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.groups[dim]


def degrees(world: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(pp, dp, tp) with dp = world / (tp·pp), or a message printing every factor."""
    if tp < 1 or pp < 1:
        raise ConfigError(
            f"parallel.tp={tp} and parallel.pp={pp} must be >= 1. Fix: "
            "--parallel.tp=1 --parallel.pp=1 for data parallelism only."
        )
    if world % (tp * pp):
        raise ConfigError(
            f"world size {world} is not divisible by tp({tp}) * pp({pp}) = {tp * pp}."
            " Fix: choose tp and pp whose product divides the number of ranks."
        )
    return pp, world // (tp * pp), tp


def build_topology(tp: int, pp: int, device_type: str, timeout_s: float) -> Topology:
    """Create one process group per mesh line (each with the configured timeout) and the mesh.

    Every rank creates every group in the same order, as `new_group` requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pp_, dp_, tp_ = degrees(world, tp, pp)
    layout = torch.arange(world).view(pp_, dp_, tp_)
    timeout = datetime.timedelta(seconds=timeout_s)
    groups: dict[str, dist.ProcessGroup] = {}
    for axis, name in enumerate(DIMS):
        lines = layout.movedim(axis, -1).reshape(-1, layout.shape[axis])
        for line in lines.tolist():
            group = dist.new_group(line, timeout=timeout, use_local_synchronization=False)
            if rank in line:
                groups[name] = group
    mesh = DeviceMesh.from_group(
        [groups[d] for d in DIMS], device_type, mesh=layout, mesh_dim_names=DIMS
    )
    return Topology(world, rank, pp_, dp_, tp_, mesh, groups)
