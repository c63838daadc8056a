"""The layering rule (imports point down, no circles) holds for the package, and the checker catches both."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
        "model/decoder.py": "def f():\n    from scaletrain.config import X  # late, still counted\n",
        "config.py": "from scaletrain.model import decoder\nX = 1\n",
        "plan/__init__.py": "",
        "plan/a.py": "from scaletrain.plan import b\n",
        "plan/b.py": "from scaletrain.plan.a import thing\n",
    })
    problems, _ = _checker().check(src)
    assert any("scaletrain.model.decoder (layer 1) imports scaletrain.config (layer 2)" in p for p in problems)
    assert any(p.startswith("import circle:") for p in problems)


# Each kind of edge the first checker did not see, in a package of its own: each test fails without it.
HIDDEN_EDGES = {
    "a package __init__'s import of its own module": {
        "finetune/__init__.py": "from scaletrain.finetune import sub\n",
        "finetune/sub.py": "from scaletrain.compress import helper\n",
        "compress/__init__.py": "",
        "compress/helper.py": "from scaletrain.finetune import NAME\n",
    },
    "importlib with a literal name": {
        "model/__init__.py": "",
        "model/config.py": "import importlib\n\nEXTRA = importlib.import_module('scaletrain.model.extra')\n",
        "model/extra.py": "from scaletrain.model.config import X\n",
    },
    "importlib with an f-string naming a folder": {
        "model/__init__.py": "",
        "model/config.py": "from scaletrain.model.family import NAMES\n",
        "model/family/__init__.py": "import importlib\n\n"
                                    "NAMES = [importlib.import_module(f'{__name__}.{n}') for n in ('g',)]\n",
        "model/family/g.py": "def f():\n    from scaletrain.model.config import head_width\n",
    },
    "a lazy-export table": {
        "lazy.py": "def lazy_exports(package, where):\n    pass\n",
        "train/__init__.py": "from scaletrain.core.lazy import lazy_exports\n\n_WHERE = {'build': 'step'}\n"
                             "__getattr__ = lazy_exports(__name__, _WHERE)\n",
        "train/step.py": "from scaletrain.train.other import y\n",
        "train/other.py": "from scaletrain.train import build\n",
    },
}


def test_the_checker_follows_every_hidden_kind_of_import(tmp_path):
    for kind, files in HIDDEN_EDGES.items():
        src = _write(tmp_path / kind.replace(" ", "_").replace("'", ""), {"__init__.py": "", **files})
        problems, _ = _checker().check(src)
        assert [p for p in problems if p.startswith("import circle:")], kind


def test_a_circle_between_packages_fails_without_a_circle_between_modules(tmp_path, capsys):
    src = _write(tmp_path, {
        "__init__.py": "", "finetune/__init__.py": "", "compress/__init__.py": "",
        "finetune/a.py": "from scaletrain.compress import b\n",  # finetune and compress share a layer
        "compress/b.py": "X = 1\n",
        "compress/c.py": "from scaletrain.finetune.d import Y\n",
        "finetune/d.py": "Y = 2\n",
    })
    checker = _checker()
    assert checker.check(src)[0] == ["import circle between packages: compress -> finetune -> compress"]
    assert checker.main(src) == 1
    assert "import circle between packages: compress -> finetune -> compress" in capsys.readouterr().out


def test_a_package_cli_module_sits_in_the_cli_layer(tmp_path):
    src = _write(tmp_path, {"__init__.py": "", "data/__init__.py": "", "checkpoint/__init__.py": "",
                            "data/cli.py": "from scaletrain.checkpoint import lock\n",
                            "checkpoint/lock.py": "from scaletrain.data import shards\n", "data/shards.py": ""})
    assert _checker().check(src)[0] == []


# checkpoint/ reads every kind of run through a table the packages above it fill (they register where they live).
LOADER_KINDS = """
import sys
from pathlib import Path
import scaletrain.checkpoint.run as run
from scaletrain.config import JobConfig, to_toml
from scaletrain.core.options import ConfigError
assert not [m for m in sys.modules if m.startswith(("scaletrain.finetune", "scaletrain.compress"))]
folder = Path(sys.argv[1])
(folder / "config.toml").write_text(to_toml(JobConfig()))
(folder / "compress.json").write_text("{}")  # a pruned run
try:
    run.load_run(folder)
except ConfigError as exc:
    print(exc)
import scaletrain.infer.load
print(sorted(run.LOADERS))
"""


def test_every_kind_of_run_has_a_loader_registered_from_above_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-c", LOADER_KINDS, str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == [f"{tmp_path}: is a pruned run, and no loader of pruned runs is registered; read it with "
                   f"scaletrain.infer.load.load_run", "['finetuned', 'pretrained', 'pruned', 'quantized']"]


# One layer map: scripts/check_layers.py's LAYERS, which its docstring and docs/architecture.md show.
ARCHITECTURE = ROOT / "docs" / "architecture.md"
NAME_COLUMN = 28  # the diagram's names, then the description


def _words(text: str) -> str:
    return " ".join(text.split())


def diagram_problems(text: str, layers: dict[str, int]) -> list[str]:
    """How the layer diagram of ``text`` (docs/architecture.md, the block after "One row a layer, top first")
    disagrees with ``layers``: a name in no layer, a row that mixes layers, rows out of order, names missing."""
    block = text.split("One row a layer, top first:\n\n```\n", 1)[1].split("```", 1)[0]
    rows = [[n.removesuffix("/").removesuffix(".py") for n in line[:NAME_COLUMN].split()]
            for line in block.splitlines() if line[:NAME_COLUMN].strip()]
    problems = [f"{n} is in no layer of LAYERS" for row in rows for n in row if n not in layers]
    if problems:
        return problems
    row_layers = [{layers[n] for n in row} for row in rows]
    problems += [f"row {row} mixes layers {sorted(r)}" for row, r in zip(rows, row_layers) if len(r) > 1]
    order = [max(r) for r in row_layers]
    if order != sorted(order, reverse=True):
        problems.append(f"rows not top first: layers {order}")
    missing = set(layers) - {"__main__"} - {n for row in rows for n in row}
    problems += [f"{n} is drawn in no row" for n in sorted(missing)]
    return problems


def test_the_docstring_and_the_architecture_page_show_the_checkers_layer_map():
    checker = _checker()
    assert _words(checker.layer_map()) in _words(checker.__doc__)
    assert _words(checker.layer_map()) in _words(ARCHITECTURE.read_text(encoding="utf-8"))


def test_the_architecture_diagram_draws_the_checkers_layers_in_order():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    layers = _checker().LAYERS
    assert diagram_problems(text, layers) == []
    swapped = {**layers, "data": layers["parallel"], "parallel": layers["data"]}  # the table changed, not the page
    assert diagram_problems(text, swapped) == ["rows not top first: layers [10, 9, 8, 7, 6, 5, 3, 4, 2, 1, 0, 0, 0]"]
    assert diagram_problems(text, {**layers, "vision": 3}) == ["vision is drawn in no row"]


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


def tree_problems(text: str, src: Path, tests: Path) -> list[str]:
    """How the tree of ``text`` (docs/architecture.md, the block after "## The tree") disagrees with the folders: a
    package (or sub-package) of ``src`` it does not name, a tests/ folder of test files named after no package."""
    block = text.split("## The tree: where a change goes\n\n```\n", 1)[1].split("```", 1)[0]
    drawn = {word.removesuffix("/") for line in block.splitlines() for word in line[:NAME_COLUMN].split()}
    packages = sorted(str(init.parent.relative_to(src)) for init in src.glob("*/**/__init__.py"))
    problems = [f"src/scaletrain/{p}/ is not in the tree" for p in packages if p not in drawn]
    names = {p.split("/")[0] for p in packages} | {path.stem for path in src.glob("*.py")} | {"repo"}
    problems += [f"tests/{d.name}/ is named after no package" for d in sorted(tests.iterdir())
                 if any(d.glob("test_*.py")) and d.name not in names]
    problems += [f"tests/{f.name} is not in a package's folder" for f in sorted(tests.glob("test_*.py"))]
    return problems


def test_the_architecture_tree_names_every_package_and_the_tests_mirror_them(tmp_path):
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert tree_problems(text, ROOT / "src" / "scaletrain", ROOT / "tests") == []
    src, tests = tmp_path / "src", tmp_path / "tests"
    for folder in (src / "model", src / "vision", tests / "vizion"):
        folder.mkdir(parents=True)
    (src / "model" / "__init__.py").write_text("")
    (src / "vision" / "__init__.py").write_text("")
    (tests / "vizion" / "test_v.py").write_text("")
    (tests / "test_flat.py").write_text("")
    assert tree_problems(text, src, tests) == ["src/scaletrain/vision/ is not in the tree",
                                               "tests/vizion/ is named after no package",
                                               "tests/test_flat.py is not in a package's folder"]
