"""Check that imports inside ``src/scaletrain`` point down the layers and never form a circle.

Layers, lowest first (a module may import from its own layer or a lower one; ``LAYERS`` below is the one map,
``docs/architecture.md`` draws the same and ``tests/repo/test_architecture.py`` holds the two together)::

    base (core, hardware, assets)  <  model  <  config  <  parallel
    <  data  <  checkpoint  <  finetune, compress  <  train, infer, evaluation  <  plan, serve
    <  scaling, tune, report  <  cli (cli.py, __main__, commands/ and every package's cli.py)

Every import counts, whatever its form: at module level, inside a function or under ``TYPE_CHECKING``, a
package ``__init__``'s imports of its own modules, ``importlib.import_module`` with a literal name (or an
f-string whose literal start names a folder: every module in it), the submodules a package's lazy-export table
(``scaletrain/core/lazy.py``) names. A late import hides a circle from Python, not from the design (a module
started as a process, ``python -m scaletrain.tune.worker``, is no import). Run ``python scripts/check_layers.py``;
exit status 1 lists each upward import and each circle, between packages and between modules.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "scaletrain"

# The layer of each top-level module or sub-package of scaletrain (higher may import lower), lowest first.
LAYERS: dict[str, int] = {
    "core": 0, "hardware": 0, "assets": 0,
    "model": 1,
    "config": 2,
    "parallel": 3,
    "data": 4,
    "checkpoint": 5,
    "finetune": 6, "compress": 6,
    "train": 7, "infer": 7, "evaluation": 7,
    "plan": 8, "serve": 8,
    "scaling": 9, "tune": 9, "report": 9,
    "cli": 10, "__main__": 10, "commands": 10,
}
BASE_NAMES = ("core", "hardware", "assets")
CLI_NAMES = ("cli.py", "__main__, commands/ and every package's cli.py")


def layer_map() -> str:
    """The layers as one line, lowest first (what the docstring above and docs/architecture.md show)."""
    by_layer: dict[int, list[str]] = {}
    for name, layer in LAYERS.items():
        by_layer.setdefault(layer, []).append(name)
    parts = []
    for layer in sorted(by_layer):
        names = by_layer[layer]
        if set(names) == set(BASE_NAMES):
            parts.append(f"base ({', '.join(names)})")
        elif "cli" in names:
            parts.append(f"cli ({', '.join(CLI_NAMES)})")
        else:
            parts.append(", ".join(names))
    return "  <  ".join(parts)


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_command(module: str) -> bool:
    """A package's ``cli.py`` (data/cli.py is `scaletrain prepare`): a command line sits on top of its package, in
    the cli layer, and counts as part of ``cli`` (not of its package) in the circles between packages."""
    parts = module.split(".")
    return len(parts) == 3 and parts[2] == "cli"


def layer_of(module: str) -> int:
    if is_command(module):
        return LAYERS["cli"]
    parts = module.split(".")
    if len(parts) == 1:  # the root package: nothing imports it for what it holds
        return 0
    if parts[1] not in LAYERS:
        raise SystemExit(f"scripts/check_layers.py: {module} is in no layer; add {parts[1]!r} to LAYERS")
    return LAYERS[parts[1]]


def package_of(module: str) -> str:
    """The node of ``module`` in the graph of packages: its top-level package, or ``cli`` for a command line."""
    if is_command(module):
        return "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports_of(path: Path, module: str, src: Path = SRC, modules: set[str] | None = None) -> set[str]:
    """Every scaletrain module ``path`` reaches (see the module docstring for the forms counted), resolving
    ``from scaletrain.x import name`` to ``scaletrain.x.name`` when that is a module."""
    modules = modules if modules is not None else all_modules(src)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name, modules) for a in node.names if a.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            found.update(_from_import(node, package, modules))
        elif isinstance(node, ast.Call):
            found.update(_dynamic_import(node, module, tree, modules))
    found.discard("")
    return found


def _resolve(name: str, modules: set[str]) -> str:
    """The module ``name`` is, or the nearest enclosing one (``scaletrain.x.Name`` -> ``scaletrain.x``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _from_import(node: ast.ImportFrom, package: str, modules: set[str]) -> Iterator[str]:
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    if not base.startswith(PACKAGE):
        return
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in modules else _resolve(base, modules)


def _dynamic_import(call: ast.Call, module: str, tree: ast.Module, modules: set[str]) -> Iterator[str]:
    """The modules an ``importlib.import_module(...)`` or a ``lazy_exports(package, table)`` call names."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if name == "import_module" and call.args:
        prefix = _literal_prefix(call.args[0], module)
        if prefix is not None:
            yield from _modules_starting(prefix, modules)
    elif name == "lazy_exports" and len(call.args) == 2:
        package = _literal_prefix(call.args[0], module)
        table = _dict_literal(call.args[1], tree)
        if package is not None and table is not None:
            for value in table.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield _resolve(f"{package}.{value.value}", modules)


def _literal_prefix(node: ast.expr, module: str) -> str | None:
    """The literal start of a module name: a string, or an f-string's text up to its first unknown part
    (``__name__`` is this module's name); None when nothing of it is known."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id == "__name__":
        return module
    if not isinstance(node, ast.JoinedStr):
        return None
    text = ""
    for part in node.values:
        if isinstance(part, ast.Constant):
            text += str(part.value)
        elif isinstance(part.value, ast.Name) and part.value.id == "__name__":
            text += module
        else:
            return text + "\0"  # an unknown part: the modules that start with ``text``
    return text


def _modules_starting(prefix: str, modules: set[str]) -> Iterator[str]:
    """The one module ``prefix`` names, or (an f-string's known start) every module directly under it."""
    if not prefix.endswith("\0"):
        if prefix in modules:
            yield prefix
        return
    start = prefix[:-1]
    if not start.startswith(PACKAGE):
        return
    folder = start.rpartition(".")[0] if not start.endswith(".") else start[:-1]
    for name in modules:
        if name.startswith(start) and name.rpartition(".")[0] == folder:
            yield name


def _dict_literal(node: ast.expr, tree: ast.Module) -> ast.Dict | None:
    """``node`` if it is a dict literal, or the dict literal a module-level name of that name is bound to."""
    if isinstance(node, ast.Dict):
        return node
    if not isinstance(node, ast.Name):
        return None
    for statement in tree.body:
        targets = statement.targets if isinstance(statement, ast.Assign) else \
            [statement.target] if isinstance(statement, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == node.id for t in targets) and isinstance(statement.value, ast.Dict):
            return statement.value
    return None


def all_modules(src: Path = SRC) -> set[str]:
    return {module_name(path, src) for path in (src / PACKAGE).rglob("*.py")}


def cycles(graph: dict[str, set[str]], every_member: bool = True) -> list[list[str]]:
    """The circles of ``graph``: in each group of nodes that reach each other (strongly connected components),
    the shortest circle through each member (or, not ``every_member``, through its smallest one), closed
    (``[a, b, a]``), one a set of nodes, in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the graphs are a few hundred nodes, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    found: dict[frozenset[str], list[str]] = {}
    for group in groups:
        for start in sorted(group) if every_member else [min(group)]:
            circle = _circle(start, group, graph)
            found.setdefault(frozenset(circle), circle)
    return sorted(found.values())


def _circle(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest circle from ``start`` back to it, inside its group (breadth first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, ()) & group):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"no circle in the strongly connected group {sorted(group)}")


def check(src: Path = SRC) -> tuple[list[str], int]:
    """(problems, modules checked) for the package under ``src``."""
    modules = all_modules(src)
    graph: dict[str, set[str]] = {}
    problems = []
    for path in sorted((src / PACKAGE).rglob("*.py")):
        module = module_name(path, src)
        targets = imports_of(path, module, src, modules) - {module}
        graph[module] = targets
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                problems.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module != PACKAGE:
            edges = {package_of(t) for t in targets if t != PACKAGE} - {package_of(module)}
            packages.setdefault(package_of(module), set()).update(edges)
    problems += [f"import circle between packages: {' -> '.join(c)}" for c in cycles(packages)]
    # between modules: one circle a group (a family file each would repeat one cause nine times)
    problems += [f"import circle: {' -> '.join(c)}" for c in cycles(graph, every_member=False)]
    return problems, len(graph)


def main(src: Path = SRC) -> int:
    problems, checked = check(src)
    for line in problems:
        print(line)
    print(f"{checked} modules checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
