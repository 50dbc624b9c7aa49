"""Before any rank starts: does the checkpoint `checkpoint.resume` would load fit this job?

A run dir holding another model's checkpoints (or ones trained with another tokenizer) would
otherwise be found out by every rank after launch. This reads only the checkpoint's
index.json (names, shapes, the recorded data identity, the data cursor), never its tensors,
and compares it with the model built on meta and the data this job prepared. The ranks
check again as they load (state.load_state), which stays the backstop: this check picks the
checkpoint as `resume=auto` would without hashing its files, and leaves a damaged or
unreadable one to the ranks, which skip it or say what is wrong with it.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.checkpoint import io as io
from shardwise.checkpoint import lineage
from shardwise.config import Config
from shardwise.errors import CheckpointError
from shardwise.models.presets import ModelSpec


def resume_target(cfg: Config) -> Path | None:
    """The checkpoint `checkpoint.resume` would load, from indexes alone (None: nothing to
    resume, or nothing readable: the ranks start fresh or say why not)."""
    mode = cfg.checkpoint.resume
    if mode == "none":
        return None
    if mode == "auto":
        root = lineage.checkpoint_root(cfg)
        if not root.is_dir():
            return None
        try:
            order, _ = lineage.resume_order(root)
        except OSError:  # an unreadable `latest`: the ranks report it
            return None
        return next((e.path for e in order if e.index is not None), None)
    path = Path(mode)
    if not (path / io.INDEX).is_file() and (path / io.LATEST).is_file():
        try:
            path = path / (path / io.LATEST).read_text().strip()  # a checkpoint.dir
        except (OSError, UnicodeDecodeError):  # an unreadable `latest`: the ranks report it
            return None
    return path if (path / io.INDEX).is_file() else None


def check_resume(cfg: Config, spec: ModelSpec) -> None:
    """Raise one `CheckpointError` if the checkpoint this job would resume cannot continue
    in it: saved with another data order, for another model, or with another tokenizer or
    labels (or a quantised base that changed since)."""
    if cfg.checkpoint.resume not in ("auto", "none") and _titan_fit(cfg, spec):
        return
    _not_a_model_dir(cfg.checkpoint.resume)
    path = resume_target(cfg)
    if path is None:
        return
    index, problems = io.check_index(path)
    if index is None or problems:
        return
    for check in (_data_order, _model_fit, _data_identity, _base):
        refusal = check(index, cfg, spec, path)
        if refusal:
            raise CheckpointError(refusal)


def _not_a_model_dir(resume: str) -> None:
    """Refuse `checkpoint.resume` naming a Hugging Face model directory (config.json and
    safetensors, no index.json): its weights start a run, it has no state to continue."""
    path = Path(resume)
    if resume in ("auto", "none") or (path / io.INDEX).is_file():
        return
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"checkpoint.resume={resume} is a Hugging Face model directory, not a training "
            "checkpoint: it holds weights but no optimizer or loop state to continue. Fix: "
            f"--model.init_from={resume} (and --checkpoint.resume=auto or none)."
        )


def _titan_fit(cfg: Config, spec: ModelSpec) -> bool:
    """Whether `checkpoint.resume` is a torchtitan step checkpoint (checkpoint/titan.py);
    if so, refuse it unless its optimizer state is there and its weights and moments fit this
    model (from its metadata alone)."""
    from shardwise.checkpoint.titan import is_titan, read_layout, refusal
    from shardwise.models.init import canonical_name

    path = Path(cfg.checkpoint.resume)
    if not is_titan(path):
        return False
    wanted = {}
    for name, p in _meta_model(cfg, spec).named_parameters():
        key = canonical_name(name, spec)
        wanted[f"param/{key}"] = tuple(p.shape)
        if p.requires_grad:  # the optimizer's targets: their moments too
            wanted |= {f"{m}/{key}": tuple(p.shape) for m in ("exp_avg", "exp_avg_sq")}
    why = refusal(read_layout(path), wanted, spec.arch)
    if why:
        raise CheckpointError(why)
    return True


def _data_order(index: dict, cfg: Config, spec: ModelSpec, path: Path) -> str | None:
    from shardwise.checkpoint.refusals import order_refusal

    return order_refusal(index, cfg, path)


def _base(index: dict, cfg: Config, spec: ModelSpec, path: Path) -> str | None:
    from shardwise.checkpoint.refusals import base_change

    return base_change(index, cfg, path)


def _meta_model(cfg: Config, spec: ModelSpec):
    """The model as the ranks build it before parallelising (training/runtime.py): on meta,
    LoRA adapters added, a quantised base's weights no longer parameters."""
    from shardwise.finetune import build_adapted

    return build_adapted(spec, cfg.finetune)[0]


def _model_fit(index: dict, cfg: Config, spec: ModelSpec, path: Path) -> str | None:
    """The refusal of a checkpoint whose saved parameters are not this model's (by name and
    full shape: the same in any layout)."""
    from shardwise.checkpoint.refusals import mismatch_message
    from shardwise.models.init import canonical_name

    saved = index.get("tensors", {})
    problems, needed = [], set()
    for name, p in _meta_model(cfg, spec).named_parameters():  # a tied weight once
        key = canonical_name(name, spec)
        needed.add(key)
        # as state._source reads it: the parameter, or its fp32 master
        entry = saved.get(f"param/{key}") or saved.get(f"master/{key}")
        if entry is None:
            problems.append(("missing", f"param/{key}"))
        elif tuple(entry["shape"]) != tuple(p.shape):
            shape = tuple(p.shape)
            problems.append(("shape", f"param/{key} {tuple(entry['shape'])} saved, {shape} here"))
    problems += [
        ("extra", k) for k in saved if k.startswith("param/") and k[len("param/") :] not in needed
    ]
    return mismatch_message(path, problems, cfg, index) if problems else None


def _data_identity(index: dict, cfg: Config, spec: ModelSpec, path: Path) -> str | None:
    """The refusal of a checkpoint trained with another tokenizer or other labels (a note
    about other data with the same tokenizer is the ranks' to print)."""
    saved = index.get("identity", {}).get("data")
    if not saved:  # saved before checkpoints recorded their data
        return None
    from shardwise.data import data_spec, load_data
    from shardwise.data.identity import compare_data, data_identity
    from shardwise.models.families import family_of

    ds = data_spec(cfg, spec.vocab_size, family_of(spec).classifier)
    if ds.is_user or ds.dataset == "digits":  # no tokenizer or labels to differ: not loaded
        return None
    now = data_identity(ds, load_data(ds, "train"))
    refusal, _ = compare_data(saved, now, path, lineage.new_run(cfg))
    return refusal
