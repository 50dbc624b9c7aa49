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
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from shardwise.errors import ConfigError

# what a factory may ask for, and where it comes from
FACTORY_ARGS = ("vocab_size", "seq_len")


def is_import_path(name: str) -> bool:
    """`module:attr` or `file.py:attr` (model names, dataset and loss factories)."""
    return ":" in name


def resolve(path: str, key: str = "model.name") -> Callable:
    """The object `path` names: `package.module:attr` (importable) or `file.py:attr`."""
    where, _, attr = path.rpartition(":")
    if not where or not attr:
        raise ConfigError(f"{key}='{path}' is not MODULE:NAME. Fix: e.g. {key}=mymodels:build")
    try:
        module = _load_file(where) if where.endswith(".py") else importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module failed to import: say which and why
        raise ConfigError(
            f"{key}='{path}': importing '{where}' failed: {type(exc).__name__}: {exc}. Fix: a "
            "module on PYTHONPATH (package.module) or a path to a .py file."
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            raise ConfigError(
                f"{key}='{path}': '{where}' has no '{attr}'. Fix: one of {names[:12]}."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}='{path}' is not callable. Fix: name a function or class.")
    return obj


def _load_file(where: str):
    file = Path(where).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"'{where}' is not a file. Fix: the path of your .py file.")
    digest = hashlib.sha256(str(file).encode()).hexdigest()[:12]
    name = f"shardwise_user_{file.stem}_{digest}"  # one module per file, in every process
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def import_path(obj: Callable, key: str) -> str:
    """`module:qualname` of a module-level function or class (how every rank finds it)."""
    qual = getattr(obj, "__qualname__", "")
    module = getattr(obj, "__module__", None)
    if not module or not qual or "<" in qual:
        raise ConfigError(
            f"{key}={obj!r} cannot be found by name in the other processes (a lambda or a "
            "function defined inside another). Fix: define it at the top level of a module."
        )
    if module == "__main__":
        main = sys.modules["__main__"]
        file = getattr(main, "__file__", None)
        if file is None:
            raise ConfigError(
                f"{key}={qual} is defined in an interactive session. Fix: put it in a .py file."
            )
        return f"{Path(file).resolve()}:{qual}"
    if module.startswith("shardwise_user_"):  # loaded from a file by `resolve`
        return f"{sys.modules[module].__file__}:{qual}"
    return f"{module}:{qual}"


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
