"""`shardwise export RUN_DIR --format dcp OUT`: a checkpoint as a PyTorch distributed
checkpoint (DCP) of the plain model.

OUT is what `torch.distributed.checkpoint.save` writes for the state dict of the model the run
trained, under the model's own names (its parameters and persistent buffers; a LoRA run's
adapters merged into their layers, a quantised base as the dequantised weight it trained
against, as `--format hf` does), so a plain model of the same family takes it with
`dcp.load(sd := model.state_dict(), checkpoint_id=OUT)` and `model.load_state_dict(sd)`,
whatever layout trained it (DCP reshards on load into any sharded state dict too). The fp32
master weights are written where the run kept them, else the parameters. The run's tokenizer
is written beside them, so `model.init_from=OUT` reads text with the ids the weights know.

DCP writes a state dict in one call: the whole model is in host memory once, in its stored
dtype (the Hugging Face export streams one shard at a time instead).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint.export import merging, write_tokenizer
from shardwise.checkpoint.export_dir import writing
from shardwise.checkpoint.export_source import Source, open_source
from shardwise.checkpoint.refusals import check_base
from shardwise.finetune import build_adapted
from shardwise.finetune.lora import is_adapter_name
from shardwise.models import build_on_meta

BASE = ".base_layer"  # peft's name for the layer an adapter wraps


def plain_state(src: Source) -> dict[str, torch.Tensor]:
    """The plain model's state dict from `src`: every key `model.state_dict()` of the run's
    model (built without adapters) has, each tensor read at its full shape."""
    adapted = build_adapted(src.spec, src.cfg.finetune)[0]
    read = merging(src.read, src.cfg, src.spec)
    ours = {
        name.replace(BASE, ""): name
        for name, _ in adapted.named_parameters(remove_duplicate=False)
        if not is_adapter_name(name)
    }
    state = {}
    for key, value in build_on_meta(src.spec).state_dict().items():
        if key in ours:
            state[key] = read(ours[key]).contiguous()
        else:  # a persistent buffer (BatchNorm statistics)
            state[key] = src.tensor(f"buffer/{key}").reshape(value.shape).contiguous()
    return state


def export_dcp(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, overwrite: bool = False
) -> Path:
    """Write `out/` (a DCP of the plain model) from the run's newest checkpoint, or that of
    `step`, replacing an earlier export there whole (export_dir.py); returns the checkpoint
    exported."""
    with open_source(run_dir, step) as src:
        check_base(src.index, src.cfg, src.path)  # a quantised base changed since the save
        about = {"format": "dcp", "checkpoint": str(src.path), "step": src.index["step"]}
        with writing(out, about, src.protected(), overwrite) as tmp, warnings.catch_warnings():
            # torch warns that it assumes one process: it is one
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(plain_state(src), checkpoint_id=tmp, no_dist=True)
            write_tokenizer(src.cfg, src.spec, Path(tmp))
    return src.path
