"""Model states per rank (the `params`, `grads`, `master` and `optimizer` bytes of
docs/design.md, and their host/disk parts under offload) from a list of ZeRO units.

They follow the engine's layout exactly (parallel/zero.py, optim.py): ZeRO units are flat
buffers padded to a multiple of dp; rank r keeps slice r; AdamW keeps two fp32 moments per
element and a 4-byte step counter per parameter piece; a separate fp32 master exists with
16-bit compute or offload. The report is the max over ranks per category, as training/loop.py's
metrics are. For Ψ parameters on N ranks with 16-bit params and gradients this is the ZeRO
paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (Rajbhandari et al. 2020, fig. 1), plus the step
counters and padding.
"""

from __future__ import annotations

from functools import lru_cache

from shardwise.finetune.quant_shards import layer_bytes
from shardwise.optim import QUANT_BLOCK
from shardwise.plan.buffers import up
from shardwise.plan.layout import Job
from shardwise.plan.shapes import Unit

ADAM8_MAPS = 2 * 256 * 4  # bitsandbytes' signed and unsigned dynamic maps, fp32


def _entry_bytes(e: tuple, bc: int) -> float:
    return e[3] if len(e) > 3 else bc


@lru_cache(maxsize=4096)
def _unit_states(unit: Unit, dp: int, stage: int, bc: int, br: int, align: int = 1) -> tuple:
    """(params, grads, and per rank: master elements, pieces, 8-bit quantisation blocks) of one
    unit (x count). `align`: parameters and shards on multiples of it (zero_units.Unit, for a
    block-wise 8-bit optimizer)."""
    numel = unit.numel
    pbytes = sum(e[0] * _entry_bytes(e, bc) for e in unit.entries)
    trainable = [e[1] for e in unit.entries]
    if stage == 0:
        n_train = sum(e[0] for e in unit.entries if e[1])
        blocks = sum(-(-e[0] // QUANT_BLOCK) for e in unit.entries if e[1])
        return pbytes, n_train * br, (n_train,), (sum(trainable),), (blocks,)
    offsets, end = [], 0
    for e in unit.entries:
        offsets.append(end)
        end = up(end + e[0], align)
    shard = up(-(-end // dp), align)
    own, pieces, blocks = [0] * dp, [0] * dp, [0] * dp
    for e, off in zip(unit.entries, offsets, strict=True):
        if not e[1]:
            continue
        for r in range(off // shard, min(dp - 1, (off + e[0] - 1) // shard) + 1):
            n = min(off + e[0], (r + 1) * shard) - max(off, r * shard)
            own[r], pieces[r], blocks[r] = (
                own[r] + n,
                pieces[r] + 1,
                blocks[r] - (-n // QUANT_BLOCK),
            )
    padded = shard * dp
    pad_bytes = (padded - numel) * bc
    params = pbytes + pad_bytes if stage < 3 else (pbytes + pad_bytes) / dp
    grads = padded * br if stage == 1 else shard * br
    if not any(trainable):  # a frozen unit has no gradient buffer
        grads = 0
    return params, grads, tuple(own), tuple(pieces), tuple(blocks)


def model_states(
    us: list[Unit], job: Job, dp: int, stage: int, offload: str, quantised=None, shards=0
) -> dict[str, float]:
    """Device (and host, with offload) model-state bytes per rank (max over dp ranks);
    `quantised`: (out, in) of the quantised linears beside the units (default: the job's),
    split over `shards` ranks (default: dp under ZeRO-3)."""
    master = 4 if (job.precision != "fp32" or offload != "none") else 0
    key = (tuple(us), dp, stage, offload, job.bc, job.br, master, job.finetune.optim_8bit)
    states = dict(_model_states(*key, job.nvme_chunk))
    shards = shards or (dp if stage == 3 else 1)
    shapes = job.quantised_shapes if quantised is None else quantised
    kind = job.finetune.base_quant
    states["params"] += sum(layer_bytes(a, b, shards, kind) for a, b in shapes)
    return states


@lru_cache(maxsize=8192)
def _model_states(us, dp, stage, offload, bc, br, master, eight, chunk) -> tuple:
    ranks = 1 if stage == 0 else dp
    params = grads = 0.0
    own, pieces, blocks = [0] * ranks, [0] * ranks, [0] * ranks
    for u in us:
        p, g, o, c, k = _unit_states(u, dp, stage, bc, br, QUANT_BLOCK if eight else 1)
        params, grads = params + p * u.count, grads + g * u.count
        for r in range(ranks):
            own[r] += o[r] * u.count
            pieces[r] += c[r] * u.count
            blocks[r] += k[r] * u.count
    if eight:  # bitsandbytes: 1 byte per moment and element, an fp32 absmax per moment and
        # block, the two 256-entry quantisation maps once; its step count is a Python int
        optimizer = max(2 * o + 8 * k for o, k in zip(own, blocks, strict=True)) + ADAM8_MAPS
    else:  # torch: two fp32 moments per element, a 4-byte step tensor per piece
        optimizer = max(8 * o + 4 * c for o, c in zip(own, pieces, strict=True))
    states = {
        "params": params,
        "grads": grads,
        "master": max(master * o for o in own),
        "optimizer": optimizer,
        "buffers": 0.0,
    }
    if offload != "none":  # ZeRO-Offload (Ren et al. 2021): masters and Adam state on the host
        states["host_master"], states["host_optimizer"] = states["master"], states["optimizer"]
        states["master"] = states["optimizer"] = 0.0
    if offload == "optimizer+params":
        states["host_params"], states["params"] = states["params"], 0.0
    if offload == "params+nvme":  # ZeRO-3's slices in files too (parallel/zero_units.py)
        states["disk_params"], states["params"] = states["params"], 0.0
    if offload in ("optimizer+nvme", "params+nvme"):  # optim/nvme.py: masters and moments,
        # streamed through two host slots of `chunk` elements per region (one if it all fits)
        n = max(own)
        slot = min(chunk, n)
        slots = min(2, -(-n // slot)) if n else 0
        states["host_master"], states["host_optimizer"] = 4.0 * slot * slots, 8.0 * slot * slots
        states["disk_optimizer"] = 12.0 * n
    return tuple(states.items())


def states_only(params: int, job: Job, dp: int, stage: int, offload: str = "none") -> dict:
    """Model states of Ψ = `params` parameters as one tensor: the ZeRO paper's accounting."""
    unit = Unit("model", ((params, True),))
    mem = model_states([unit], job, dp, stage, offload)
    mem["optimizer"] -= 4  # the paper counts no step counter
    mem["activations"] = 0.0
    mem["total"] = sum(v for k, v in mem.items() if not k.startswith(("host_", "disk_")))
    return mem


def add_states(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Per-rank model states of two groups of units a rank holds both of (dense and expert
    units): each category adds up (rank 0 of each group holds the most of it)."""
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value
    return into
