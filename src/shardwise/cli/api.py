"""`shardwise.train(...)`: the Python entry point, the same job as `shardwise train`.

    import shardwise

    records = shardwise.train(
        {"train": {"steps": 100}, "parallel": {"zero": 3}},
        model=build_model,          # () -> nn.Module (or with vocab_size / seq_len)
        dataset=make_dataset,       # (split) -> (input, target) items, or None
        loss=summed_mse,            # (output, target) -> the micro-batch's summed loss
        nproc=2,
    )

The callables are passed to every rank by name (`module:name`, or `file.py:name` for a script),
so they must be defined at the top level of a module or of the script, and a script must keep
its call under `if __name__ == "__main__":`. Under torchrun or srun each rank calls `train`
itself and `nproc` is the launcher's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torch import nn

from shardwise.config import Config, load_config
from shardwise.errors import ConfigError


def train(
    config: str | Path | Mapping[str, Mapping[str, object]] | Config | None = None,
    *,
    model: Callable[..., nn.Module] | str | None = None,
    dataset: Callable[[str], object] | str | None = None,
    loss: Callable[..., object] | str | None = None,
    nproc: int | None = None,
    overrides: Sequence[str] = (),
    force: bool = False,
) -> list[dict]:
    """Train as `shardwise train` would and return the per-step records of metrics.jsonl.

    `config`: a TOML path, a `{section: {key: value}}` mapping or a `Config` (None: defaults);
    `overrides`: `--section.key=value` strings applied last. `model`, `dataset` and `loss`
    set model.name, data.dataset and train.loss. `nproc`: local ranks (default: one per
    device). `force`: start even if the plan predicts more memory than this machine has."""
    from shardwise.job import prepare
    from shardwise.launchers.local import (
        adopt_slurm_env,
        launch_local,
        rank_main,
        under_external_launcher,
    )

    cfg = _config(config, [*_callables(model, dataset, loss), *overrides])
    if under_external_launcher():
        adopt_slurm_env()
        rank_main(cfg.to_dict())
        return _records(cfg)
    from shardwise.distributed.device import local_device_count

    n = local_device_count() if nproc is None else nproc
    if n < 1:
        raise ConfigError(f"nproc={nproc} must be >= 1. Fix: nproc=2")
    with prepare(cfg, n, force=force) as job:  # the checks and refusals of `shardwise train`
        launch_local(job.cfg, n, derived=job.derived)
    return _records(cfg)


def _callables(model, dataset, loss) -> list[str]:
    from shardwise.data.callables import import_path

    out = []
    for value, key in ((model, "model.name"), (dataset, "data.dataset"), (loss, "train.loss")):
        if value is None:
            continue
        name = value if isinstance(value, str) else import_path(value, key)
        out.append(f"--{key}={name}")
    return out


def _config(config, overrides: list[str]) -> Config:
    if isinstance(config, Config):
        base = [f"--{k}={v}" for k, v in _flatten(config.to_dict())]
        return load_config(None, [*base, *overrides])
    if isinstance(config, Mapping):
        return load_config(None, [*(f"--{k}={v}" for k, v in _flatten(config)), *overrides])
    if config is not None and not isinstance(config, (str, Path)):
        raise ConfigError(
            f"config={config!r} is not a TOML path, a mapping or a Config. Fix: e.g. "
            "{'train': {'steps': 100}}."
        )
    return load_config(config, overrides)


def _flatten(tree: Mapping) -> list[tuple[str, object]]:
    out = []
    for section, values in tree.items():
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"config['{section}'] is {values!r}, not a section. Fix: "
                f"{{'{section}': {{'key': value}}}}."
            )
        out += [(f"{section}.{key}", _text(value)) for key, value in values.items()]
    return out


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _records(cfg: Config) -> list[dict]:
    path = Path(cfg.run.dir) / "metrics.jsonl"
    if not path.exists():  # only rank 0 writes; the others return nothing
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
