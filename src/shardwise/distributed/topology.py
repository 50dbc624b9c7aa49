"""The validated parallel layout: degrees pp × dp × tp and the DeviceMesh holding their groups,
with context parallelism (cp) and expert parallelism (ep) as runs of cp (ep) consecutive ranks
inside each dp line."""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise.errors import ConfigError

DIMS = ("pp", "dp", "tp")  # the mesh's lines; "cp" and "data" are parts of a dp line


@dataclass(frozen=True)
class Topology:
    """Degrees and groups of one rank. Ranks are laid out row-major over (pp, dp, tp), so tp
    neighbours are adjacent ranks (inside a node) and pp is the outermost dimension.

    `dp` counts the replicas that share the parameters: gradients are reduced, and ZeRO
    shards, over it. With context parallelism a dp line is cut into runs of `cp`
    consecutive coordinates that split one sample's sequence between them (Megatron reduces
    over dp × cp the same way): "cp" is the position in the run, "data" which sample stream
    the run reads (dp / cp of them).

    Expert parallelism cuts the dp line the same way into runs of `ep` consecutive
    coordinates ("ep": the position in the run, which experts a rank holds); "edp" links the
    ranks of a pipeline stage that hold the same experts: every ep-th coordinate of the dp
    lines of all tp ranks ((dp / ep) · tp of them; tensor parallelism leaves the experts whole,
    and each tp rank routes its own sequence shard through them): expert gradients are
    reduced, and ZeRO-sharded, over it (Megatron-Core's expert-data-parallel group with an
    expert tensor parallel size of 1)."""

    world: int
    rank: int
    pp: int
    dp: int
    tp: int
    cp: int = 1
    ep: int = 1
    mesh: DeviceMesh | None = field(default=None, compare=False)
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.pp * self.dp * self.tp != self.world:
            raise ConfigError(
                f"pp({self.pp}) * dp({self.dp}) * tp({self.tp}) = "
                f"{self.pp * self.dp * self.tp} != world size {self.world}"
            )
        if self.cp < 1 or self.dp % self.cp:
            raise ConfigError(
                f"parallel.cp={self.cp} must be >= 1 and divide the {self.dp} ranks that share "
                "the parameters (world / (tp * pp)). Fix: a cp dividing that number."
            )
        if self.ep < 1 or self.dp % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must be >= 1 and divide the {self.dp} ranks that share "
                "the dense parameters (world / (tp * pp)). Fix: an ep dividing that number."
            )

    def size(self, dim: str) -> int:
        if dim == "data":
            return self.dp // self.cp
        if dim == "edp":
            return self.dp // self.ep * self.tp
        return getattr(self, dim)

    def coord(self, dim: str) -> int:
        """This rank's index along `dim`."""
        pp_i, rest = divmod(self.rank, self.dp * self.tp)
        dp_i, tp_i = divmod(rest, self.tp)
        data_i, cp_i = divmod(dp_i, self.cp)
        edp_i, ep_i = divmod(dp_i, self.ep)
        coords = {"pp": pp_i, "dp": dp_i, "tp": tp_i, "cp": cp_i, "data": data_i}
        # edp: the index in its group's sorted ranks, (dp line position, tp) row-major
        return {**coords, "ep": ep_i, "edp": edp_i * self.tp + tp_i}[dim]

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


def build_topology(
    tp: int, pp: int, device_type: str, timeout_s: float, cp: int = 1, ep: int = 1
) -> Topology:
    """Create one process group per mesh line (each with the configured timeout) and the mesh,
    with cp > 1 one per run of cp consecutive ranks of a dp line, and with ep > 1 one per run
    of ep consecutive ranks ("ep") and one per stride-ep subset of a dp line ("edp").

    Every rank creates every group in the same order, as `new_group` requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pp_, dp_, tp_ = degrees(world, tp, pp)
    topo = Topology(world, rank, pp_, dp_, tp_, cp, ep)  # checks the degrees before any group
    layout = torch.arange(world).view(pp_, dp_, tp_)
    timeout = datetime.timedelta(seconds=timeout_s)
    groups: dict[str, dist.ProcessGroup] = {}

    def make(name: str, lines: list[list[int]]) -> None:
        for line in lines:
            group = dist.new_group(line, timeout=timeout, use_local_synchronization=False)
            if rank in line:
                groups[name] = group

    for axis, name in enumerate(DIMS):
        make(name, layout.movedim(axis, -1).reshape(-1, layout.shape[axis]).tolist())
    if cp > 1:
        runs = layout.movedim(1, -1).reshape(pp_, tp_, dp_ // cp, cp)
        make("cp", runs.reshape(-1, cp).tolist())
    if ep > 1:
        runs = layout.movedim(1, -1).reshape(pp_, tp_, dp_ // ep, ep)
        make("ep", runs.reshape(-1, ep).tolist())
        # (pp, ep position) -> every (dp / ep, tp) rank holding those experts
        make("edp", runs.permute(0, 3, 2, 1).reshape(pp_ * ep, -1).tolist())
    mesh = DeviceMesh.from_group(
        [groups[d] for d in DIMS], device_type, mesh=layout, mesh_dim_names=DIMS
    )
    return dataclasses.replace(topo, mesh=mesh, groups=groups)
