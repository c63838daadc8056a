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
