"""Compiled blocks (`train.compile=blocks`): each transformer block's forward compiled by
`torch.compile` (TorchInductor), as torchtitan compiles per block.

Only the block's own forward is replaced, never its `__call__`: the hooks the engine hangs on
a block (ZeRO-3's gathers, the pipeline's and the profiler's) stay eager around the compiled
code. Blocks of one shape share one compiled graph: torch treats a module's parameters as
graph inputs (`inline_inbuilt_nn_modules`), so 32 layers compile once, and micro-batches of a
fixed shape never recompile. What Dynamo cannot trace (the layout-free dropout's per-sample
generators, the comm layer's bookkeeping around a tensor-parallel collective) runs eagerly
between compiled pieces: a graph break, counted and reported after the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.families import Family
from shardwise.parallel.recompute import block_names


def apply_compile(model: nn.Module, family: Family, mode: str) -> int:
    """Compile the forward of every block of `model` (`mode` "blocks"; "false": none);
    returns how many were compiled."""
    if mode == "false":
        return 0
    names = set(block_names(model, family))
    compiled = 0
    for name, module in model.named_modules():
        if name in names:
            module.forward = torch.compile(module.forward, dynamic=False)
            compiled += 1
    return compiled


def untraced(family: Family, recompute: str, pp: int, pp_schedule: str, cp: int) -> str | None:
    """What keeps a job's blocks from compiling (None: nothing): the one rule training
    (training/checks.compile_refusal, with each case's message) and the planner's search
    (plan/valid.py) share."""
    if not family.compiles:
        return "a model family that does not compile them"
    if recompute == "selective":
        return "selective recompute"
    if pp > 1 and pp_schedule == "zb":
        return "the zb schedule"
    if cp > 1:
        return "cp"
    return None


def compile_summary() -> dict[str, object]:
    """What Dynamo did in this process so far: graphs compiled, graph breaks by reason (the
    first 80 characters), recompilations past the first graph of a code object."""
    from torch._dynamo.utils import counters

    breaks = {reason[:80]: n for reason, n in counters["graph_break"].items()}
    stats = counters["stats"]
    return {
        "graphs": int(stats.get("unique_graphs", 0)),
        "graph_breaks": sum(breaks.values()),
        "break_reasons": breaks,
    }
