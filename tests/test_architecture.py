"""The layering rule (imports point down, no circles) holds for the package, and the checker catches both."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_package_imports_point_down_without_circles():
    problems, checked = _checker().check()
    assert checked > 50
    assert problems == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "scaletrain" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_reports_an_upward_import_and_a_circle(tmp_path):
    src = _write(tmp_path, {
        "__init__.py": "",
        "model/__init__.py": "",
        "model/llama.py": "def f():\n    from scaletrain.config import X  # late, still counted\n",
        "config.py": "from scaletrain.model import llama\nX = 1\n",
        "plan/__init__.py": "",
        "plan/a.py": "from scaletrain.plan import b\n",
        "plan/b.py": "from scaletrain.plan.a import thing\n",
    })
    problems, _ = _checker().check(src)
    assert any("scaletrain.model.llama (layer 1) imports scaletrain.config (layer 2)" in p for p in problems)
    assert any(p.startswith("import circle:") for p in problems)


# Functions fit on a screen (STYLE.md) in the packages a newcomer reads first.
SHORT_PACKAGES = ("train", "checkpoint", "finetune", "model")
MAX_FUNCTION_LINES = 60


def long_functions(src: Path, packages: tuple[str, ...] = SHORT_PACKAGES,
                   limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name (N lines)' of every function or method in ``packages`` longer than ``limit`` lines, from
    its ``def`` to its last line (docstring and comments included)."""
    import ast

    found = []
    for package in packages:
        for path in sorted((src / "scaletrain" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(src)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_60_lines_in_train_checkpoint_finetune_model():
    assert long_functions(ROOT / "src") == []


def test_the_length_check_finds_a_long_method(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    _write(tmp_path, {"model/long.py": f"class A:\n    def long(self):\n{body}\n\n    def short(self):\n        pass\n",
                      "train/fine.py": "def f():\n    return 1\n"})
    assert long_functions(tmp_path) == ["scaletrain/model/long.py:2 long (61 lines)"]
