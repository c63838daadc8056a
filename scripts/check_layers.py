"""Check that imports inside ``src/scaletrain`` point down the layers and never form a circle.

Layers, lowest first (a module may import from its own layer or a lower one)::

    base (options, files, quiet, invocation)  <  model  <  config, peak  <  data, parallel  <  checkpoint
    <  train, infer, harness  <  plan, report, tune, serve  <  cli

Every import counts, including the ones inside functions: a late import hides a circle from Python,
not from the design. Run ``python scripts/check_layers.py``; exit status 1 lists each violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "scaletrain"

# The layer of each top-level module or sub-package of scaletrain (higher may import lower).
LAYERS: dict[str, int] = {
    "options": 0, "files": 0, "invocation": 0, "assets": 0, "lazy": 0, "allocator": 0, "quiet": 0,
    "model": 1,
    "config": 2, "peak": 2,
    "data": 3, "parallel": 3,
    "checkpoint": 4, "finetune": 4, "compress": 4,
    "train": 5, "infer": 5, "harness": 5,
    "plan": 6, "report": 6, "tune": 6, "scaling": 6, "serve": 6,
    "cli": 7, "__main__": 7,
}
# Modules whose job is a command line: they sit on top of their package (data/cli.py is `scaletrain prepare`).
CLI_MODULES = {"scaletrain.data.cli", "scaletrain.plan.cli", "scaletrain.report.cli", "scaletrain.tune.cli",
               "scaletrain.compress.cli", "scaletrain.infer.cli", "scaletrain.scaling.cli",
               "scaletrain.serve.cli"}


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    if module in CLI_MODULES:
        return LAYERS["cli"]
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else ""
    if key not in LAYERS:
        raise SystemExit(f"scripts/check_layers.py: {module} is in no layer; add {key!r} to LAYERS")
    return LAYERS[key]


def imports_of(path: Path, module: str, src: Path = SRC) -> set[str]:
    """Every scaletrain module ``path`` imports (resolving ``from scaletrain.x import name`` to
    ``scaletrain.x.name`` when that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith(PACKAGE):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _is_module(sub, src) else base)
    return found


def _is_module(name: str, src: Path) -> bool:
    rel = Path(*name.split("."))
    return (src / rel).with_suffix(".py").is_file() or (src / rel / "__init__.py").is_file()


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle between modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def check(src: Path = SRC) -> tuple[list[str], int]:
    """(problems, modules checked) for the package under ``src``."""
    graph: dict[str, set[str]] = {}
    problems = []
    for path in sorted((src / PACKAGE).rglob("*.py")):
        module = module_name(path, src)
        # A package's __init__ re-exporting its own modules is not an edge of the design.
        targets = {t for t in imports_of(path, module, src) if t != module and not t.startswith(module + ".")}
        graph[module] = targets
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                problems.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import circle: " + " -> ".join(cycle))
    return problems, len(graph)


def main() -> int:
    problems, checked = check()
    for line in problems:
        print(line)
    print(f"{checked} modules checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
