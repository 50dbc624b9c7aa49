"""What `shardwise export` reads: a run's checkpoint, found, verified and held open.

Paths a run's config records relative to the directory it was started from (run.dir,
checkpoint.dir, model.init_from, data.*) are resolved against that directory — found by taking
the recorded relative run.dir (or checkpoint.dir) off where that directory is now — never
against the exporter's current directory, which may be another project's.

Every file of the checkpoint is checked against the size and SHA-256 its index records (as a
resume does, `checkpoint_io.check_files`) and stays open until the export is written: a
training job pruning the checkpoint meanwhile cannot pull it away, and one pruned before it was
opened is replaced by the run's newest checkpoint then.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.checkpoint import io as cio
from shardwise.checkpoint import slices
from shardwise.config import Config, config_from_dict
from shardwise.errors import CheckpointError, ShardwiseError
from shardwise.models.init import canonical_name
from shardwise.models.presets import ModelSpec
from shardwise.models.spec import spec_from_config

_ATTEMPTS = 3  # checkpoints pruned under us before we hold one open: give up after this many
_TAKES = (
    "a run directory, a checkpoint.dir or one checkpoint (index.json), a Hugging Face Llama or "
    "GPT-2 directory (config.json + model*.safetensors) or a model's PyTorch distributed "
    "checkpoint (.metadata)"
)


class _Gone(Exception):
    """The checkpoint was deleted (pruned) before its files were held open."""


def launch_dir(where: Path, recorded: str) -> Path | None:
    """The directory a run was started from: `where` (the directory as it is now) less the
    relative path `recorded` the config gave for it; None when that cannot be told."""
    rel = Path(recorded)
    if rel.is_absolute() or ".." in rel.parts:
        return None
    for now in (Path(os.path.abspath(where)), where.resolve()):
        n = len(rel.parts)
        if n == 0:
            return now
        if now.parts[-n:] == rel.parts:
            return now.parents[n - 1]
    return None


def _rebased(cfg: Config, base: Path | None) -> Config:
    """`cfg` with its relative paths made absolute against `base` (the launch directory)."""
    if base is None:
        return cfg
    values = cfg.to_dict()

    def fix(section: str, key: str, only_existing: bool) -> None:
        value = values[section][key]
        head, sep, tail = value.partition(":")  # a `file.py:factory` data set
        if not value or Path(head).is_absolute():
            return
        if only_existing and not (base / head).exists():  # stdlib, digits, module:factory
            return
        values[section][key] = str(base / head) + sep + tail

    for section, key in (("run", "dir"), ("checkpoint", "dir"), ("model", "init_from")):
        fix(section, key, only_existing=False)
    for key in ("dataset", "tokenizer", "cache_dir"):
        fix("data", key, only_existing=True)
    return config_from_dict(values)


def _run_config(run_dir: Path) -> Config:
    """The config a run recorded in run.dir/config.json, or one clear refusal."""
    path = run_dir / "config.json"
    try:
        values = json.loads(path.read_text())
        if isinstance(values, dict) and "model_type" in values:  # (weights beside: export_model)
            why = f"a Hugging Face '{values['model_type']}' config with no *.safetensors beside it"
        elif not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
            why = "no [section] tables of a shardwise config"
        else:
            return config_from_dict(values)
    except (ShardwiseError, OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    raise ShardwiseError(
        f"'{path}' is not the config of a shardwise run ({why}), so the run's checkpoints "
        "cannot be found from it. shardwise export takes " + _TAKES + ". Fix: pass one of "
        f"those, e.g. the checkpoint directory itself: {run_dir / 'checkpoints'}."
    )


def _same_run(root: Path, cfg: Config) -> bool:
    """Whether the newest checkpoint under `root` was saved by the run whose (absolute) run.dir
    `cfg` names."""
    found = cio.list_complete(root)
    if not found or not Path(cfg.run.dir).is_absolute():
        return False
    index, problems = cio.check_index(found[0][1])
    return not problems and index["config"]["run"]["dir"] == cfg.run.dir


def _root_of_run(run_dir: Path, cfg: Config) -> Path:
    """The checkpoint.dir of the run in `run_dir`, resolved where the run was started."""
    ckpt = cfg.checkpoint.dir
    if not ckpt:
        return run_dir / "checkpoints"
    if Path(ckpt).is_absolute():
        return Path(ckpt)
    base = launch_dir(run_dir, cfg.run.dir)
    if base is not None:
        return base / ckpt
    if _same_run(Path(ckpt), cfg):  # started here (an absolute run.dir: its checkpoints say so)
        return Path(os.path.abspath(ckpt))
    raise ShardwiseError(
        f"the run in '{run_dir}' recorded checkpoint.dir='{ckpt}', relative to the directory it "
        f"was started from, which cannot be told from run.dir='{cfg.run.dir}'. Fix: pass the "
        "checkpoint directory itself: shardwise export <its checkpoint.dir> --format hf OUT."
    )


def _choose(path: Path, step: int | None) -> tuple[Path, Path, bool]:
    """(checkpoint directory, checkpoint.dir holding it, whether the user named it) for a run
    directory, a checkpoint.dir or one checkpoint directory."""
    if (path / cio.INDEX).is_file():
        if step is not None and path.name != cio.step_dir(path.parent, step).name:
            raise ShardwiseError(
                f"'{path}' is one checkpoint, not step {step}. Fix: pass its checkpoint.dir "
                f"({path.parent}) with --step {step}, or leave out --step."
            )
        return path, path.parent, True
    if (path / cio.LATEST).is_file() or cio.list_complete(path):  # a checkpoint.dir
        root = path
    elif (path / "config.json").is_file():
        root = _root_of_run(path, _run_config(path))
    else:
        raise ShardwiseError(
            f"'{path}' is neither a run directory (no config.json) nor a checkpoint "
            f"(no {cio.INDEX}) nor a model directory: shardwise export takes {_TAKES}. Fix: "
            "pass one of those, e.g. the run.dir of a training run with checkpoint.every > 0."
        )
    if step is not None:
        chosen = cio.step_dir(root, step)
        if not (chosen / cio.INDEX).is_file():
            raise ShardwiseError(
                f"there is no complete checkpoint of step {step} under '{root}' (kept: "
                f"{_steps(root) or 'none'}). Fix: --step with one of those."
            )
        return chosen, root, True
    found = cio.latest(root)
    if found is None or not (found / cio.INDEX).is_file():
        raise ShardwiseError(
            f"no complete checkpoint under '{root}'. Fix: train with --checkpoint.every=N."
        )
    return found, root, False


def _steps(root: Path, but: Path | None = None) -> str:
    return ", ".join(str(s) for s, p in reversed(cio.list_complete(root)) if p != but)


def find_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint a run directory (its newest, or that of `step`), a checkpoint.dir or a
    checkpoint directory names."""
    return _choose(Path(run_dir), step)[0]


class _Pinned:
    """Every file of one checkpoint, verified against its index and held open."""

    def __init__(self, path: Path, index: dict) -> None:
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}
        files = index.get("files", {})
        try:
            handles = {}  # opened first: the checked bytes are those safe_open maps below
            for name in files:
                with contextlib.suppress(FileNotFoundError):  # check_files says "missing"
                    fh = open(path / name, "rb")  # noqa: SIM115 - closed by the stack
                    handles[name] = self._stack.enter_context(fh)
            problems = cio.check_files(path, files)
            if problems and not path.is_dir():
                raise _Gone
            if problems:
                raise CheckpointError(_damaged(path, problems))
            for name, fh in handles.items():
                if name.endswith(".safetensors"):  # (DCP's files are read by DCP: dcp_format)
                    opened = safe_open(path / name, framework="pt")
                    self._open[name] = self._stack.enter_context(opened)
                if os.stat(path / name).st_ino != os.fstat(fh.fileno()).st_ino:
                    raise _Gone  # replaced meanwhile (the step saved again)
        except FileNotFoundError:
            self._stack.close()
            raise _Gone from None
        except BaseException:
            self._stack.close()
            raise

    def read(self, file: str, key: str, a: int, b: int) -> torch.Tensor:
        if file not in self._open:  # every slice's file must be in the checksummed list
            raise CheckpointError(
                f"the index names {file}, which it gives no checksum for. Fix: export another "
                "checkpoint with --step."
            )
        return self._open[file].get_slice(key)[a:b]

    def close(self) -> None:
        self._stack.close()


def _damaged(path: Path, problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    others = [s for s, p in cio.list_complete(path.parent) if p != path]
    fix = (
        f"export an earlier checkpoint: shardwise export {path.parent} --step {others[0]} ... "
        f"(kept: {_steps(path.parent, but=path)})"
        if others
        else "restore the file from a copy (no other checkpoint is kept)"
    )
    return (
        f"checkpoint {path} is damaged: {problems[0]}{more}; its weights would be wrong. "
        f"Fix: {fix}."
    )


@dataclass
class Source:
    """One verified checkpoint held open: its directory, index, config (paths resolved where
    the run was started) and model spec; `read(name)` gives a parameter at full shape."""

    path: Path
    root: Path
    index: dict
    cfg: Config
    spec: ModelSpec
    given: Path  # what the user passed: a run directory, a checkpoint.dir or a checkpoint
    files: _Pinned = field(repr=False)

    def tensor(self, key: str) -> torch.Tensor:
        """One stored tensor at its full global shape (`slices.read_tensor`, from the
        files held open)."""
        entry = self.index["tensors"][key]
        if self.index.get("storage") == "dcp":  # checkpoint.format=dcp (files checked above)
            from shardwise.checkpoint.dcp_format import read_full

            return read_full(self.path, key, entry)
        shape = tuple(entry["shape"])
        out = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        need = cio.Piece(key, shape, entry["dtype"], cio.full_box(shape), (0, out.numel()))
        slices.load_piece(out.view(-1), need, entry, self.files)
        return out

    def read(self, name: str) -> torch.Tensor:
        """A parameter, its fp32 master when the run kept one apart from low-precision
        parameters (frozen ones have none); checkpoints key parameters by canonical name."""
        name = canonical_name(name, self.spec)
        key = f"master/{name}" if f"master/{name}" in self.index["tensors"] else f"param/{name}"
        return self.tensor(key)

    def protected(self) -> dict[str, Path]:
        """What an export must neither write into nor replace: the run and its inputs."""
        out = {"the checkpoint": self.path, "the checkpoint.dir": self.root}
        if (self.given / "config.json").is_file() and not (self.given / cio.INDEX).is_file():
            out["the run directory"] = self.given
        if Path(self.cfg.run.dir).is_absolute():  # (resolved where the run was started)
            out["run.dir"] = Path(self.cfg.run.dir)
        if self.cfg.model.init_from:
            out["model.init_from"] = Path(self.cfg.model.init_from)
        return out

    def close(self) -> None:
        self.files.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _base(ckpt_root: Path, cfg: Config) -> Path | None:
    """Where the run that saved a checkpoint under `ckpt_root` was started."""
    if cfg.checkpoint.dir:
        return launch_dir(ckpt_root, cfg.checkpoint.dir)
    return launch_dir(ckpt_root.parent, cfg.run.dir)  # checkpoint.dir '' = run.dir/checkpoints


def _recorded_labels(run_dir: Path, cfg: Config) -> tuple[str, ...] | None:
    """The label names a classification run recorded in its run.dir (training/metrics.py)."""
    for root in (run_dir, Path(cfg.run.dir)):
        path = root / "labels.json"
        if path.is_file():
            return tuple(json.loads(path.read_text())["labels"])
    return None


def _spec(cfg: Config, labels: tuple[str, ...] | None = None) -> ModelSpec:
    if cfg.model.init_from and not Path(cfg.model.init_from).is_dir():
        raise ShardwiseError(
            f"the run started from Hugging Face weights at model.init_from="
            f"'{cfg.model.init_from}', which is gone; its config.json gives the model's sizes."
            " Fix: restore that directory (its weights are not read, only config.json)."
        )
    return spec_from_config(cfg, labels)


def _open(given: Path, ckpt: Path, root: Path) -> Source:
    try:
        index = cio.read_index(ckpt)
    except FileNotFoundError:
        raise _Gone from None
    except (OSError, ValueError) as exc:
        raise ShardwiseError(
            f"the checkpoint {ckpt} cannot be read: {exc}. Fix: export another checkpoint "
            f"with --step (kept: {_steps(root, but=ckpt) or 'none'})."
        ) from None
    files = _Pinned(ckpt, index)
    try:
        saved = config_from_dict(index["config"], str(ckpt / cio.INDEX))
        cfg = _rebased(saved, _base(root, saved))
        spec = _spec(cfg, _recorded_labels(given, cfg))
    except BaseException:
        files.close()
        raise
    return Source(ckpt, root, index, cfg, spec, given, files)


def open_source(run_dir: str | Path, step: int | None = None) -> Source:
    """The checkpoint `run_dir` names (see `find_checkpoint`), verified and held open; close
    it (or use it as a context manager) when the export is written."""
    given = Path(run_dir)
    for _ in range(_ATTEMPTS):
        ckpt, root, named = _choose(given, step)
        try:
            return _open(given, ckpt, root)
        except _Gone:
            if named:
                raise ShardwiseError(
                    f"checkpoint {ckpt} was deleted while it was being exported (a training "
                    "job deletes all but its newest checkpoint.keep). Fix: export a newer one "
                    f"(kept: {_steps(root) or 'none'}) with --step, or leave out --step."
                ) from None
    raise ShardwiseError(
        f"the newest checkpoint under '{root}' was deleted {_ATTEMPTS} times while being "
        "opened for export (a training job saving and pruning fast). Fix: export when it has "
        "saved, or name one with --step."
    )
