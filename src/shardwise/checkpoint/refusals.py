"""Whether a checkpoint may resume this run (or an export merge its base), and the one-line
refusal when it may not: another data order, another tokenizer or labels, a quantised base
whose files changed, parameters this model does not have. `run_identity` is what a save
records for the identity checks; checkpoint/state.py and checkpoint/precheck.py ask here.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.checkpoint import io as io
from shardwise.checkpoint import lineage
from shardwise.errors import CheckpointError
from shardwise.models.families import family_of


def run_identity(run) -> dict:
    """What the saved weights mean something only with: the data's tokenizer and labels
    (data/identity.py), and the `init_from` base a quantised run does not store."""
    from shardwise.data import data_spec
    from shardwise.data.identity import data_identity

    cfg = run.cfg
    spec = run.derived.spec
    labelled = family_of(spec).classifier
    out = {"data": data_identity(data_spec(cfg, spec.vocab_size, labelled), run.train_data)}
    if cfg.model.init_from:
        from shardwise.models.hf.weights import base_identity

        out["base"] = base_identity(cfg.model.init_from)
    return out


def base_change(index: dict, cfg, path: Path) -> str | None:
    """The refusal of a checkpoint whose quantised base (not stored: re-read from
    `model.init_from` on resume and export) changed since it was saved; None if unchanged."""
    saved = index.get("identity", {}).get("base")
    if cfg.finetune.base_quant == "none" or not cfg.model.init_from or saved is None:
        return None
    from shardwise.models.hf.weights import base_identity

    now = base_identity(cfg.model.init_from)
    changed = sorted(n for n in saved.keys() | now.keys() if saved.get(n) != now.get(n))
    if not changed:
        return None
    return (
        f"checkpoint {path} holds adapters trained against the finetune.base_quant="
        f"{cfg.finetune.base_quant} base read from model.init_from='{cfg.model.init_from}', "
        f"whose files changed since ({', '.join(changed[:4])}): the base is not stored in the "
        "checkpoint, so the adapters would be paired with another model. Fix: restore the "
        "original weights in that folder, or start a new run from this base with "
        "--checkpoint.resume=none and another --run.dir."
    )


def check_base(index: dict, cfg, path: Path) -> None:
    """Raise `base_change`'s refusal, if any (an export merging a quantised base)."""
    refusal = base_change(index, cfg, path)
    if refusal:
        raise CheckpointError(refusal)


def identity_problems(run, index: dict, path: Path) -> tuple[str | None, str | None]:
    """(refusal, note) of resuming `index` in this run: another tokenizer, other labels or a
    changed quantised base are refused; other data with the same tokenizer is noted."""
    from shardwise.data.identity import compare_data

    saved = index.get("identity", {})
    now = run_identity(run)["data"]
    refusal, note = compare_data(saved.get("data"), now, path, lineage.new_run(run.cfg))
    return refusal or base_change(index, run.cfg, path), note


def order_refusal(index: dict, cfg, path: Path) -> str | None:
    """The refusal of a checkpoint saved with another data order (global batch or seed)."""
    data, t = index["loop"]["data"], cfg.train
    if (data["global_batch"], data["seed"]) == (t.global_batch, t.seed):
        return None
    return (
        f"checkpoint {path} was saved with train.global_batch={data['global_batch']} "
        f"and train.seed={data['seed']}; this run has {t.global_batch} and {t.seed}, "
        "which would change the data order. Fix: --train.global_batch="
        f"{data['global_batch']} --train.seed={data['seed']}."
    )


def mismatch_message(path: Path, problems: list[tuple[str, str]], cfg, index: dict) -> str:
    """One line: what of the checkpoint at `path` does not fit this run's model, and how to
    start a new run instead (the model it was saved with named, when another)."""
    parts = []
    for kind, title in (
        ("missing", "missing"),
        ("shape", "of another shape"),
        ("extra", "not in this model"),
    ):
        # parameters first: they say what differs; their optimizer state follows suit
        items = sorted(
            {text for k, text in problems if k == kind},
            key=lambda t: (not t.startswith("param/"), t),
        )
        if items:
            shown = ", ".join(items[:12]) + (", ..." if len(items) > 12 else "")
            parts.append(f"{len(items)} {title}: {shown}")
    was = index.get("config", {}).get("model", {}).get("name")
    names = f" (saved by model.name={was!r}; this run has {cfg.model.name!r})"
    return (
        f"checkpoint {path}{names if was and was != cfg.model.name else ''} does not fit this "
        f"model: {'; '.join(parts)}. Fix: resume with the model config it was saved with (see "
        f"{path / io.INDEX}), or start a new run with {lineage.new_run(cfg)}."
    )


def every_rank(exc: CheckpointError) -> CheckpointError:
    """Mark a failure every rank raises alike: only rank 0 prints it (launchers/local.py)."""
    exc.every_rank = True
    return exc
