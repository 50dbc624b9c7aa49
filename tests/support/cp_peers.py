"""Context-parallel attention probes, run inside a `run_world` world as `peer` cases: the whole
world is one cp group (cp = world size, tp = pp = 1).

* `attention_parity`: ring and Ulysses attention on a sequence sharded over cp, forward and
  backward, gathered back to the full sequence and compared with causal SDPA on one process.
  With packed records (`RECORDS`), against SDPA under the single process's per-record mask.
* `attention_bytes`: the cp bytes and calls each kernel's forward and backward record.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.config import Config
from shardwise.distributed.comm import Comm
from shardwise.distributed.topology import build_topology
from shardwise.models.packing import record_positions, unpack
from shardwise.parallel.context_comm import ring_attention, ulysses_attention, zigzag_positions

B, H, S, D = 2, 4, 32, 16
KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}
# bf16 keeps 8 significant bits: rounding an fp32 result to nearest moves it by at most the
# unit roundoff 2^-8 of itself
BF16_REL = 2.0**-8
# packed records of the two samples (0: padding). At cp 4 (zig-zag) rank 0's queries see no
# key of rank 3 (the pair is skipped); sample 1's first record runs to 20, so some pairs are
# seen by sample 1 only and sample 0's rows see nothing of them (no NaN may come of it)
RECORDS = torch.tensor([[1] * 8 + [2] * 8 + [3] * 12 + [0] * 4, [1] * 20 + [2] * 12])


def _cp_comm() -> Comm:
    return Comm(build_topology(1, 1, "cpu", 60.0, cp=dist.get_world_size()))


def _positions(layout: str, n: int, r: int) -> torch.Tensor:
    if layout == "zigzag":
        return zigzag_positions(S, n, r)
    return torch.arange(r * S // n, (r + 1) * S // n)  # keys of later ranks all in the future


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v, dout of the full sequence, the same on every rank, rounded to `dtype`."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(B, H, S, D, generator=gen).to(dtype) for _ in range(4)]


def _reference(full: list[torch.Tensor], packed: bool = False) -> list[torch.Tensor]:
    """out, dq, dk, dv of causal SDPA on one process, fp32, from the same (rounded) inputs;
    `packed`: under the per-record mask models/packing.py builds for one process."""
    q, k, v = (t.float().requires_grad_(True) for t in full[:3])
    if packed:
        _, rows = unpack(torch.stack([torch.zeros_like(RECORDS), RECORDS], 1), torch.float32)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), full[3].float())]


def _gathered(parts: list[torch.Tensor], pos: torch.Tensor, comm: Comm) -> list[torch.Tensor]:
    """Every rank's local out/dq/dk/dv put back at their global positions [B, H, S, D]."""
    n = comm.topo.size("cp")
    local = torch.stack([p.detach().float() for p in parts])
    full = local.new_empty((n * local.shape[0], *local.shape[1:]))
    comm.all_gather(full, local, "cp")
    all_pos = torch.empty(n * pos.numel(), dtype=torch.int64)
    comm.all_gather(all_pos, pos, "cp")
    assert torch.equal(all_pos.sort().values, torch.arange(S)), all_pos  # every token once
    out = torch.empty(len(parts), B, H, S, D)
    for j, block in enumerate(full.chunk(n)):
        out[:, :, :, all_pos[j * pos.numel() : (j + 1) * pos.numel()]] = block
    return list(out)


def _starts(pos: torch.Tensor) -> torch.Tensor:
    """[B, S_local]: where the record of each local query starts (global position)."""
    return pos[None, :] - record_positions(RECORDS)[:, pos]


def _one(kernel: str, layout: str, dtype: torch.dtype, comm: Comm, packed: bool = False) -> dict:
    n, r = comm.topo.size("cp"), comm.topo.coord("cp")
    full = _inputs(dtype)
    pos = _positions(layout, n, r)
    q, k, v = (t[:, :, pos].clone().requires_grad_(True) for t in full[:3])
    out = KERNELS[kernel](q, k, v, pos, comm, _starts(pos) if packed else None)
    grads = torch.autograd.grad(out, (q, k, v), full[3][:, :, pos])
    ours = _gathered([out, *grads], pos, comm)
    result = {"dtype": str(out.dtype), "grad_dtype": str(grads[0].dtype)}
    refs = _reference(full, packed)
    for name, a, ref in zip(("out", "dq", "dk", "dv"), ours, refs, strict=True):
        err = (a - ref).abs()
        result[name] = {
            "max_abs": err.max().item(),
            "max_ref": ref.abs().max().item(),
            "bf16_excess": (err - BF16_REL * ref.abs()).max().item(),
        }
    return result


def attention_parity(cfg: Config) -> dict:
    """Per "kernel/layout/dtype": per tensor (out, dq, dk, dv) the largest absolute
    difference from single-process causal SDPA, the reference's largest entry, and the
    largest excess over one bf16 rounding (|err| - 2^-8·|ref|)."""
    comm = _cp_comm()
    runs = [(k, "zigzag", dt) for k in KERNELS for dt in (torch.float32, torch.bfloat16)]
    runs += [(k, "contiguous", torch.float32) for k in KERNELS]
    out = {
        f"{k}/{layout}/{str(dt).removeprefix('torch.')}": _one(k, layout, dt, comm)
        for k, layout, dt in runs
    }
    for k in KERNELS:  # packed records: a NaN anywhere makes max_abs NaN, which fails
        for layout in ("zigzag", "contiguous"):
            out[f"{k}/{layout}/packed/float32"] = _one(k, layout, torch.float32, comm, True)
    return out


def attention_bytes(cfg: Config) -> dict:
    """Per kernel: the cp bytes and calls `Comm.take_step` reports for the forward, then for
    the backward, and every dimension that reported bytes."""
    comm = _cp_comm()
    n, r = comm.topo.size("cp"), comm.topo.coord("cp")
    pos = zigzag_positions(S, n, r)
    out = {}
    runs = [(name, kernel, None) for name, kernel in KERNELS.items()]
    runs += [(f"{name}/packed", kernel, _starts(pos)) for name, kernel in KERNELS.items()]
    for name, kernel, starts in runs:
        q, k, v, dout = (t[:, :, pos].clone().requires_grad_(True) for t in _inputs(torch.float32))
        comm.start_step()
        y = kernel(q, k, v, pos, comm, starts)
        fwd = comm.take_step()  # what the step's metrics report, per dimension
        y.backward(dout)
        bwd = comm.take_step()
        dims = {d for m in (fwd, bwd) for d, b in m["comm_bytes"].items() if b}
        out[name] = {
            phase: (m["comm_bytes"]["cp"], m["comm_calls"]["cp"])
            for phase, m in (("forward", fwd), ("backward", bwd))
        }
        out[name]["dims"] = sorted(dims)
    return out
