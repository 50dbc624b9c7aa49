"""The package's floor plan holds: imports point down the layers of docs/architecture.md, and no
set of modules imports itself in a loop (lazy imports inside functions count too)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Top to bottom; a module may import its own layer or any layer below it. The root modules
# (config, errors, optim) are the ground floor.
LAYERS = [
    ("cli",),
    ("launchers",),
    ("job",),
    ("training",),
    ("plan",),
    ("checkpoint", "profile"),
    ("parallel",),
    ("distributed",),
    ("models", "finetune"),
    ("data",),
    ("config", "errors", "optim"),
]
FLOOR = {name: len(LAYERS) - i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in (SRC / "shardwise").rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that `import name` loads (its longest prefix that is a module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """Every shardwise module `module` imports, at the top or inside a function."""
    tree = ast.parse(modules[module].read_text())
    package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            target = _resolve(name, modules) if name.startswith("shardwise.") else None
            if target not in (None, module, "shardwise"):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: imports_of(m, modules) for m in modules}


def floor_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    if top not in FLOOR:
        raise AssertionError(
            f"{module}: '{top}' is on no floor of tests/test_layers.py LAYERS. Fix: place it "
            "there and in docs/architecture.md's layer list."
        )
    return FLOOR[top]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, f"import circles: {found}"


def test_no_upward_import():
    graph = import_graph()
    upward = [
        f"{m} -> {t}"
        for m, targets in sorted(graph.items())
        if m != "shardwise"
        for t in sorted(targets)
        if floor_of(t) > floor_of(m)
    ]
    assert not upward, "imports that climb a floor:\n" + "\n".join(upward)


def test_the_planner_imports_nothing_of_the_runtime():
    """plan/ prices a description of a job (shapes, layout, hardware): it stands below
    training/ (the floor order above enforces it) and names no training module at all."""
    graph = import_graph()
    assert FLOOR["plan"] < FLOOR["training"]
    leaning = [
        f"{m} -> {t}"
        for m, targets in sorted(graph.items())
        if m.startswith("shardwise.plan.")
        for t in sorted(targets)
        if t.startswith("shardwise.training")
    ]
    assert not leaning, "the planner imports the runtime:\n" + "\n".join(leaning)


def test_no_test_library_in_the_product():
    """`unittest` (mock and the like) is for tests: no module of src/ imports it."""
    found = []
    for module, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{module}: {n}" for n in names if n.split(".")[0] == "unittest"]
    assert not found, found


def test_every_module_is_on_a_floor():
    for module in _modules():
        if module != "shardwise":
            floor_of(module)


def test_the_checks_catch_a_circle_and_a_climb():
    graph = {"shardwise.a": {"shardwise.b"}, "shardwise.b": {"shardwise.a"}, "shardwise.c": set()}
    assert cycles(graph) == [["shardwise.a", "shardwise.b"]]
    assert floor_of("shardwise.cli.main") > floor_of("shardwise.parallel.zero")
    with pytest.raises(AssertionError, match="on no floor"):
        floor_of("shardwise.nowhere.x")


def test_lazy_and_relative_imports_are_seen(tmp_path):
    modules = _modules()
    graph = import_graph()
    # cli.main imports plan.cli's successor inside a function: it must be in the graph
    assert "shardwise.cli.plan" in graph["shardwise.cli.main"]
    assert graph["shardwise.checkpoint.manager"] >= {"shardwise.checkpoint.io"}
    assert set(modules) == set(graph)


def test_the_architecture_page_lists_every_package():
    """`ls src/shardwise/*/` reads like docs/architecture.md's floor table."""
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## Floors") : doc.index("## The two seams")]
    packages = sorted(p.parent.name for p in (SRC / "shardwise").glob("*/__init__.py"))
    for name in packages:
        assert f"`{name}/`" in table, f"docs/architecture.md's floor table lacks {name}/"
        floor_of(f"shardwise.{name}")
