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

Stacked expert weights (an MoE layer's [E, ...] parameters, not linear layers) take a pair per
expert of shardwise's own instead (models/expert_lora.py), named by `experts`, a weight's name
or path; expert parallelism cuts the pair with the experts (parallel/expert.py).
"""

from __future__ import annotations

import fnmatch

from torch import nn

from shardwise.config import FinetuneConfig
from shardwise.errors import ConfigError
from shardwise.models.dropout import LayoutFreeDropout, name_sites
from shardwise.models.expert_lora import add_expert_adapters
from shardwise.models.families import family_of
from shardwise.models.init import find_spec
from shardwise.models.moe import MoE
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


def is_path_pattern(pattern: str) -> bool:
    """Whether a finetune.lora_targets pattern names whole module paths ('.' or a wildcard)
    rather than the last part of one."""
    return "." in pattern or any(c in pattern for c in "*?[")


def target_matches(path: str, pattern: str) -> bool:
    """finetune.lora_targets' rule: a path pattern matches the whole path, a plain name its
    last part."""
    if is_path_pattern(pattern):
        return fnmatch.fnmatchcase(path, pattern)
    return path.rpartition(".")[2] == pattern


EXPERTS = "experts"  # the pattern naming every stacked expert weight


def _experts_of(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...], bool]]:
    """(path, module, stacked weight names, is it transformers') of every experts module: our
    MoE layers (models/moe.py) and transformers' stacked experts (models/hf/experts.py)."""
    from shardwise.models.hf.experts import experts_modules, stacked_weights

    theirs = {id(m) for m in experts_modules(model)}
    out = []
    for path, m in model.named_modules():
        if isinstance(m, MoE):
            out.append((path, m, ("w1", "w3", "w2"), False))
        elif id(m) in theirs:
            out.append((path, m, stacked_weights(m), True))
    return out


def expert_targets(model: nn.Module, patterns: str) -> list[tuple[str, nn.Module, list[str]]]:
    """(path, module, weights) of the stacked expert weights `patterns` names: `experts` names
    them all, a weight's name or path pattern ('w1', 'gate_up_proj', 'blocks.*.mlp.w2') that
    weight, and for transformers' classes the experts module's own path ('experts') all its
    weights. `all-linear` names none (they are not linear layers)."""
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    out = []
    for path, module, leaves, theirs in _experts_of(model):
        hit = [
            leaf
            for leaf in leaves
            if any(
                p == EXPERTS
                or target_matches(f"{path}.{leaf}", p)
                or (theirs and target_matches(path, p))
                for p in pats
                if p != ALL_LINEAR
            )
        ]
        if hit:
            out.append((path, module, hit))
    return out


def _check_experts(model: nn.Module, found: list, ft: FinetuneConfig) -> None:
    """Adapters on experts: only where shardwise computes the experts (its own forward) and
    without dropout (the rows of a token are permuted among experts: no per-sample site)."""
    from shardwise.models.hf.experts import computes_experts

    for path, module, _ in found:
        if not isinstance(module, MoE) and not computes_experts(model):
            raise ConfigError(
                f"finetune.lora_targets='{ft.lora_targets}' names the experts '{path}' of "
                f"{type(model).__name__}, whose layout (biases, a post-expert norm or [in, out] "
                "weights) transformers computes itself, so an adapter there would not be "
                "applied. Fix: adapt the attention projections (q_proj,k_proj,v_proj,o_proj)."
            )
    if found and ft.lora_dropout:
        raise ConfigError(
            f"finetune.lora_dropout={ft.lora_dropout} with adapters on experts "
            f"(finetune.lora_targets='{ft.lora_targets}'): dropout is not built for an "
            "expert adapter's input. Fix: --finetune.lora_dropout=0, or leave the experts out "
            "of the targets."
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
        if not any(target_matches(n, pat) for n in linear) and not expert_targets(model, pat):
            short = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in linear))
            experts = f", {EXPERTS} (stacked expert weights)" if _experts_of(model) else ""
            raise ConfigError(
                f"finetune.lora_targets pattern '{pat}' matches no linear layer of "
                f"{type(model).__name__}. Fix: name some of its linear layers ({short}){experts}, "
                f"a path pattern such as '{linear[0] if linear else 'blocks.*.attn.wq'}', or "
                f"{ALL_LINEAR}."
            )
    if not pats:
        raise ConfigError(
            "finetune.lora_targets is empty. Fix: e.g. --finetune.lora_targets=all-linear."
        )
    return [n for n in linear if any(target_matches(n, p) for p in pats)]


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
    experts = expert_targets(model, ft.lora_targets)
    _check_experts(model, experts, ft)
    if targets:
        config = LoraConfig(
            r=ft.lora_rank, lora_alpha=ft.lora_alpha, lora_dropout=0.0, target_modules=targets
        )
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for _, module, leaves in experts:  # ours hold [E, in, out], transformers' [E, out, in]
        in_out = isinstance(module, MoE)
        add_expert_adapters(module, leaves, ft.lora_rank, ft.lora_alpha, in_out=in_out)
    for name, p in model.named_parameters():  # the base frozen (as peft freezes it)
        p.requires_grad_(name in new or is_adapter_name(name))
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
