"""Your callables named in the config: `model.name`, `data.dataset` and `train.loss` take
`package.module:name` (importable) or `path/to/file.py:name`; the Python entry point turns a
function back into that form, so every rank finds the same object by name. It sits in data/,
the lowest floor that needs it: models/ and data/ both resolve such values, and models/
already reads data/."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from shardwise.errors import ConfigError


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
