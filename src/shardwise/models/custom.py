"""Your own `nn.Module`: `model.name=package.module:factory` or `path/to/file.py:factory`.

The factory is called with no arguments, or with those of `vocab_size` and `seq_len` it
declares (text data: the tokenizer's vocabulary and the sequence length). It may build its
parameters anywhere: under shardwise they are created on the meta device (so ZeRO-3 never holds
the whole model on one rank) while buffers (masks, position tables) are computed on the CPU
and restored after materialisation.

Layout invariance: a parameter's value must not depend on how the model is split, so it is
not the factory's draw. Every module's own parameters come from its `reset_parameters()`
(torch's layers all have one) run on a CPU twin of that module alone, under a generator seeded
from (train.seed, the module's name): the same values on one device and in any layout. A
module holding parameters of its own without `reset_parameters()` is refused before launch.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardwise.data.callables import resolve
from shardwise.errors import ConfigError

# what a factory may ask for, and where it comes from
FACTORY_ARGS = ("vocab_size", "seq_len")


def build_custom(spec) -> nn.Module:
    """The factory's module (see `on_meta`)."""
    factory = resolve(spec.factory)
    wanted = _accepted(factory)
    kwargs = {k: getattr(spec, "max_seq_len" if k == "seq_len" else k) for k in wanted}
    model = on_meta(lambda: factory(**kwargs))
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name='{spec.factory}' returned {type(model).__name__}, not a "
            "torch.nn.Module. Fix: return the model (an nn.Module) from the factory."
        )
    model.shardwise_spec = spec
    return model


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()`; under `torch.device("meta")` its parameters are created on meta as they
    are registered while its buffers are computed on the CPU, their values kept in
    `shardwise_buffers` (init.restore_buffers) and the buffers themselves moved to meta."""
    if torch.get_default_device().type != "meta":
        return build()
    with _parameters_on_meta(), torch.device("cpu"):
        model = build()
    if isinstance(model, nn.Module):
        values = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to("meta")
        model.shardwise_buffers = values
    return model


def _accepted(factory: Callable) -> list[str]:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []
    return [k for k in FACTORY_ARGS if k in params]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile is moved to meta as it is registered (buffers
    stay where they are made): the technique of accelerate's `init_empty_weights`."""
    register = nn.Module.register_parameter

    def to_meta(self, name, param):
        register(self, name, param)
        kept = self._parameters[name]
        if kept is not None and not kept.is_meta:  # (a meta one: a tie, kept the same object)
            self._parameters[name] = nn.Parameter(
                kept.detach().to("meta"), requires_grad=kept.requires_grad
            )

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _reset(module: nn.Module) -> Callable[[], object] | None:
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn
    return None


def check_initialisable(model: nn.Module, factory: str) -> None:
    """Every module that holds parameters of its own can re-draw them (reset_parameters)."""
    for name, module in model.named_modules():
        own = [leaf for leaf, p in module.named_parameters(recurse=False)]
        if own and _reset(module) is None:
            where = f"'{name}'" if name else "the model itself"
            raise ConfigError(
                f"model.name='{factory}': {where} ({type(module).__name__}) holds parameters "
                f"{own} but has no reset_parameters(), so shardwise cannot give them values that "
                "are the same in every layout. Fix: define reset_parameters() on "
                f"{type(module).__name__} (it runs under a generator seeded from (train.seed, "
                "the module's name)), or build those parameters from torch layers."
            )


def _fresh(t: torch.Tensor | None, dtype, device: str):
    if t is None:
        return None
    fresh = torch.zeros(tuple(t.shape), dtype=dtype or t.dtype, device=device)
    return nn.Parameter(fresh, requires_grad=False) if isinstance(t, nn.Parameter) else fresh


def _shell(module: nn.Module, device: str, own: bool) -> nn.Module:
    """A shallow copy of `module` with fresh tensors: float32 on `device` for its own
    parameters when `own`, meta everywhere else (children included, recursively), so a
    reset_parameters() that also touches a child (MultiheadAttention's does) writes nowhere."""
    twin = copy.copy(module)  # new tensor dicts below: the original is untouched
    where = device if own else "meta"
    twin._parameters = {  # (None entries stay: `bias=False` registers a None)
        k: _fresh(p, torch.float32, where) for k, p in module._parameters.items()
    }
    twin._buffers = {k: _fresh(b, None, where) for k, b in module._buffers.items()}
    twin._modules = {
        k: None if c is None else _shell(c, device, False) for k, c in module._modules.items()
    }
    return twin


def reset_value(module: nn.Module, leaf: str, seed: int) -> torch.Tensor:
    """Parameter `leaf` of `module` as its reset_parameters() draws it on the CPU with the
    global generator seeded by `seed` (init.initial_value: from (train.seed, the module's
    name)), float32, whatever the model's layout."""
    twin = _shell(module, "cpu", True)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        _reset(twin)()
    return twin._parameters[leaf].detach()
