"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through peft,
made layout-invariant.

peft wraps each target linear layer: `blocks.0.attn.wq` becomes a `peft` `lora.Linear` holding
`base_layer` (the original layer, frozen), `lora_A.default` ([r, in]) and `lora_B.default`
([out, r]), and computes base(x) + B(A(dropout(x))) · alpha / r; every other parameter is
frozen. Three things make that fit the engine:

* values come from (seed, name) like every other parameter (models/init.py): A as peft draws it
  (Kaiming-uniform), B zero, and the base layer under its name without `.base_layer`, so it
  gets exactly the value (or the checkpoint tensor) it has without LoRA;
* peft's dropout draws from torch's global generator, which would make the masks depend on the
  layout: it is replaced by LayoutFreeDropout (masks keyed by seed, step, sample and site);
* tensor parallelism splits A or B with the layer they adapt (parallel/tensor_lora.py), and
  ZeRO keeps trainable and frozen parameters in separate units (parallel/zero.py).
"""

from __future__ import annotations

import fnmatch

from torch import nn

from shardwise.config import FinetuneConfig
from shardwise.errors import ConfigError
from shardwise.models.dropout import LayoutFreeDropout, name_sites
from shardwise.models.families import family_of
from shardwise.models.init import find_spec
from shardwise.models.tp_plans import is_conv1d
from shardwise.optim import quiet_bitsandbytes

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's adapter name: it appears in the parameter names


def is_lora_layer(module: nn.Module) -> bool:
    """A layer peft wrapped (base_layer + lora_A/lora_B)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _heads(model: nn.Module, new: set[str]) -> set[str]:
    """Modules `all-linear` leaves alone: the output head (a language model's, or a new
    classification head, which trains whole)."""
    heads = {"head"} if hasattr(model, "head") else set()
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    names = {id(m): n for n, m in model.named_modules()}
    if out is not None and id(out) in names:
        heads.add(names[id(out)])
    return heads | {name.rpartition(".")[0] for name in new}


def _matches(path: str, pattern: str) -> bool:
    if "." in pattern or any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(path, pattern)
    return path.rpartition(".")[2] == pattern


def _refuse_experts(model: nn.Module, pattern: str) -> None:
    """A pattern naming transformers' stacked experts (or their parameters) is refused with
    why: they are [E, out, in] parameters, not nn.Linear layers, and peft adapts them only
    through `target_parameters` (one adapter over all experts), which shardwise does not
    apply (its adapters are valued, split and sharded per nn.Linear)."""
    from shardwise.models.hf.experts import experts_modules

    owners = {id(m) for m in experts_modules(model)}
    for name, module in model.named_modules():
        if id(module) not in owners:
            continue
        paths = [name] + [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
        if any(_matches(path, pattern) for path in paths):
            raise ConfigError(
                f"finetune.lora_targets pattern '{pattern}' names the stacked experts "
                f"'{name}' of {type(model).__name__}: [experts, out, in] parameters, not "
                "nn.Linear layers; peft adapts those only through target_parameters, which "
                "shardwise does not apply. Fix: adapt the attention projections "
                "(q_proj,k_proj,v_proj,o_proj), or train the experts whole without LoRA."
            )


def target_modules(model: nn.Module, patterns: str, new: set[str] = frozenset()) -> list[str]:
    """The paths of the linear layers `patterns` (finetune.lora_targets) names, in model order;
    every pattern must match one."""
    linear = [n for n, m in model.named_modules() if n and _is_linear(m)]
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    if pats == [ALL_LINEAR]:
        heads = _heads(model, new)
        return [n for n in linear if n not in heads]
    for pat in pats:
        if not any(_matches(n, pat) for n in linear):
            _refuse_experts(model, pat)
            short = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in linear))
            raise ConfigError(
                f"finetune.lora_targets pattern '{pat}' matches no linear layer of "
                f"{type(model).__name__}. Fix: name some of its linear layers ({short}), a "
                f"path pattern such as '{linear[0] if linear else 'blocks.*.attn.wq'}', or "
                f"{ALL_LINEAR}."
            )
    if not pats:
        raise ConfigError(
            "finetune.lora_targets is empty. Fix: e.g. --finetune.lora_targets=all-linear."
        )
    return [n for n in linear if any(_matches(n, p) for p in pats)]


def check(ft: FinetuneConfig) -> None:
    if ft.lora_rank < 0:
        raise ConfigError(
            f"finetune.lora_rank={ft.lora_rank} must be >= 0. Fix: e.g. 16, or 0 for no LoRA."
        )
    if ft.lora_alpha <= 0:
        raise ConfigError(
            f"finetune.lora_alpha={ft.lora_alpha} must be > 0. Fix: e.g. "
            f"--finetune.lora_alpha={2 * max(ft.lora_rank, 8)} (2·r is common)."
        )
    if not 0.0 <= ft.lora_dropout < 1.0:
        raise ConfigError(
            f"finetune.lora_dropout={ft.lora_dropout} is not a probability in [0, 1). Fix: "
            "e.g. 0.05, or 0 for none."
        )


def apply_lora(model: nn.Module, ft: FinetuneConfig) -> list[str]:
    """Wrap the target layers of `model` (on meta) with adapters and freeze the rest; a new
    head (a classifier the checkpoint lacks) stays trainable. Returns the adapted paths."""
    check(ft)
    if ft.lora_rank == 0:
        return []
    quiet_bitsandbytes()  # peft imports it when installed
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError(
            f"finetune.lora_rank={ft.lora_rank} adds LoRA adapters through peft, which is not "
            "installed. Fix: pip install 'shardwise[finetune]' (or peft), or "
            "--finetune.lora_rank=0."
        ) from None

    new = _new_parameters(model)
    targets = target_modules(model, ft.lora_targets, new)
    config = LoraConfig(
        r=ft.lora_rank, lora_alpha=ft.lora_alpha, lora_dropout=0.0, target_modules=targets
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        if name in new:
            p.requires_grad_(True)
    if ft.lora_dropout:
        for module in model.modules():
            if is_lora_layer(module):
                # "features": under tensor parallelism a row-parallel layer's input is cut
                # along its last dimension (parallel/tensor_lora.py sets the shard)
                module.lora_dropout[ADAPTER] = LayoutFreeDropout(ft.lora_dropout, "features")
        name_sites(model)
    return targets


def _new_parameters(model: nn.Module) -> set[str]:
    """Parameters a Hugging Face checkpoint does not hold (a new classification head)."""
    spec = find_spec(model)
    if spec is None or not (family_of(spec).from_checkpoint and family_of(spec).classifier):
        return set()
    from shardwise.models.hf.auto import check_checkpoint

    return set(check_checkpoint(spec))
