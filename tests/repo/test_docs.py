"""Executable docs: every shell command in README.md and docs/*.md runs, and every number quoted from a benchmark
result matches its JSON.

Commands are the lines of the ```bash fenced blocks (a trailing backslash continues a line; blank lines and
``# comment`` lines are not commands). Each page runs in its own temporary folder laid out like the repository
root (``configs/``, ``docs/`` with ``docs/examples/``, ``benchmarks/``, ``scripts/`` and ``tests/`` linked in,
and ``../shared`` linked when the repository has one), so ``runs/``, ``data/``, ``plan.json`` ... land there;
the commands of a page run in order and may use what earlier ones wrote. ``scaletrain`` and ``.venv/bin/scaletrain``
run as ``sys.executable -m scaletrain.cli``, ``torchrun`` as ``sys.executable -m torch.distributed.run`` and
``python``/``python3``/``.venv/bin/python`` as ``sys.executable`` (bash functions, so loops and ``&`` work), with
``OMP_NUM_THREADS=1`` unless set (these models are tiny; on 2 shared cores one thread each is fastest).

A block is changed for the test, never for the reader, by an HTML comment right before it (GitHub does not
render it). Single-line form ``<!-- docs-test: DIRECTIVE -->``; several directives one per line::

    <!-- docs-test:
    append train: --train.steps=3
    skip 4: needs a GPU
    -->

Directives (N is a command's 1-based position in the block, comma-separated for several):

* ``skip: REASON`` - the whole block is not run; ``skip N: REASON`` - command N is not run.
* ``needs PATH`` - skip the block, saying why, when PATH (relative to the repository root) is missing, as
  ``../shared`` is on a fresh clone.
* ``append: FLAGS`` - FLAGS go at the end of every command; ``append N: FLAGS`` - of command N; ``append
  SUBCOMMAND: FLAGS`` - of every ``scaletrain SUBCOMMAND`` / ``-m scaletrain.cli SUBCOMMAND`` in the block
  (inserted before a trailing ``&``, ``;``, ``|`` or comment, so loops and background jobs work).
* ``setup: COMMAND`` - run COMMAND first (e.g. a short training run that a block of ``eval`` commands needs).
* ``script`` - run the block as one bash script (for ``&`` + ``wait``); it must exit 0.
* ``expect: TEXT`` - the block's output must contain TEXT.
* ``timeout: SECONDS`` - per command (default 600: helpers/waits.py's ceiling for a machine 5x slower).

A marker that no longer fits its block (an index past its end, an ``append SUBCOMMAND`` that matches nothing,
an unknown directive, a marker with no block after it) fails the test, and so does an untagged fenced block
that holds commands (tag it ``bash`` so it is run, or mark it skipped).

Numbers quoted from ``benchmarks/results/*.json``:

* ``<!-- numbers-from: benchmarks/results/X.json -->`` before a table or paragraph: every number in it (up to
  the next blank line) must be a value of X.json as shown, i.e. a value, times 100 (a percentage; also
  (v - 1) x 100 for a ratio shown as a change), 1000, 1e-3, 1e-6, 1e-9, 2^-20 or 2^-30 (units), rounded to the
  decimals shown. ``except: COLUMN, COLUMN`` leaves table columns (by header, or 1-based position) out,
  ``ignore: 5e-2, 41.4`` leaves numbers out that are not from the JSON. Words with digits (``micro-b8``,
  ``768x4``, ``0.81M``) are not numbers.
* ``NUMBER<!-- from: benchmarks/results/X.json key.path[2].key -->`` right after a number in prose: that
  number must be that value as shown (same scales).
* ``<!-- plan-table: ARGS -->`` before a table whose first column is ``--hardware``: each row must be what
  ``scaletrain plan ARGS --hardware ROW`` predicts (best plan, memory, tokens/s, wall time, cost).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.waits import CEILING_S

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = ("configs", "docs", "benchmarks", "scripts", "tests")  # what the commands read, linked into the cwd
# ... copied instead: a documented command that regenerates a committed results JSON (parallelism.md's 4-rank EP
# parity writes benchmarks/results/expert_parallel_4.json) writes the copy, not the repository's file (1.7 MB)
COPIED = ("benchmarks",)
DEFAULT_TIMEOUT = int(CEILING_S)  # a command ends when it ends: this only catches a hang (helpers/waits.py)
TAIL = 3000  # characters of output shown for a failed command

PRELUDE = """
scaletrain() { "$DOCS_TEST_PYTHON" -m scaletrain.cli "$@"; }
torchrun() { "$DOCS_TEST_PYTHON" -m torch.distributed.run "$@"; }
python() { "$DOCS_TEST_PYTHON" "$@"; }
python3() { "$DOCS_TEST_PYTHON" "$@"; }
"""


# -- markdown -> blocks of commands ------------------------------------------------------------------------
@dataclass
class Block:
    """A ```bash block: where it is, its commands and the docs-test directives before it."""

    page: str
    line: int
    commands: list[str]
    directives: list[str] = field(default_factory=list)

    def where(self, index: int | None = None) -> str:
        return f"{self.page}:{self.line}" + (f" command {index + 1}" if index is not None else "")


FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
MARKER = re.compile(r"<!--\s*docs-test\s*:?(.*?)-->", re.S)
COMMAND_START = re.compile(r"^(\.venv/bin/)?(scaletrain|torchrun|python3?|pip)\b")


def split_commands(lines: list[str]) -> list[str]:
    """Logical command lines: continuation backslashes joined, blank and comment-only lines dropped."""
    out, current = [], ""
    for raw in lines:
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1].rstrip() + " "
            continue
        line = current + line.strip() if current else line.strip()
        current = ""
        if line and not line.startswith("#"):
            out.append(line)
    if current.strip():
        out.append(current.strip())
    return out


def parse_page(path: Path) -> tuple[list[Block], list[str]]:
    """The page's ```bash blocks with their directives, and its problems (dangling markers, untagged command
    blocks)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    blocks, problems = [], []
    pending: tuple[int, list[str]] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if "<!--" in line and re.search(r"<!--\s*docs-test", line):
            start = i
            chunk = line
            while "-->" not in chunk and i + 1 < len(lines):
                i += 1
                chunk += "\n" + lines[i]
            m = MARKER.search(chunk)
            if not m:
                problems.append(f"{name}:{start + 1}: unterminated docs-test marker")
            else:
                directives = [d.strip() for d in m.group(1).splitlines() if d.strip()]
                pending = (start + 1, directives)
            i += 1
            continue
        fence = FENCE.match(line)
        if fence:
            indent, mark, info = fence.groups()
            body, j = [], i + 1
            while j < len(lines) and not (lines[j].strip().startswith(mark) and lines[j].strip() == mark):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            commands = split_commands(body)
            if info == "bash":
                blocks.append(Block(name, i + 1, commands, pending[1] if pending else []))
            else:
                if pending:
                    problems.append(f"{name}:{pending[0]}: docs-test marker before a ```{info} block (tag it bash)")
                if not info and commands and all(COMMAND_START.match(c) for c in commands):
                    problems.append(f"{name}:{i + 1}: a fenced block of commands without ```bash: tag it so "
                                    f"tests/repo/test_docs.py runs it (or mark it skipped)")
            pending = None
            i = j + 1
            continue
        if pending and line.strip():
            problems.append(f"{name}:{pending[0]}: docs-test marker not followed by a ```bash block")
            pending = None
        i += 1
    if pending:
        problems.append(f"{name}:{pending[0]}: docs-test marker at the end of the page")
    return blocks, problems


# -- directives -> what runs -----------------------------------------------------------------------------------
@dataclass
class Plan:
    """What the test does with one block."""

    skip_block: str = ""
    skip: dict[int, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    script: bool = False
    expect: list[str] = field(default_factory=list)
    timeout: int = DEFAULT_TIMEOUT


def _indices(text: str, block: Block) -> list[int]:
    out = []
    for part in text.split(","):
        n = int(part)
        if not 1 <= n <= len(block.commands):
            raise ValueError(f"{block.where()}: command {n} does not exist (the block has {len(block.commands)})")
        out.append(n - 1)
    return out


def strip_comment(command: str) -> tuple[str, str]:
    """(command, trailing ``# comment``), the comment found outside quotes at the start of a word."""
    quote = ""
    for k, ch in enumerate(command):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or command[k - 1].isspace()):
            return command[:k].rstrip(), command[k:]
    return command, ""


def insert_flags(command: str, flags: str, subcommand: str | None) -> tuple[str, bool]:
    """Insert ``flags`` at the end of the simple command that runs ``scaletrain SUBCOMMAND`` (or of the whole
    command when ``subcommand`` is None): before a trailing ``&``, ``;``, ``|``, ``>`` or comment."""
    body, comment = strip_comment(command)
    if subcommand is None:
        start = 0
    else:
        m = re.search(r"(?:\bscaletrain|-m scaletrain\.cli)\s+" + re.escape(subcommand) + r"\b", body)
        if not m:
            return command, False
        start = m.end()
    end, quote = len(body), ""
    for k in range(start, len(body)):
        ch = body[k]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "&;|>":
            end = k
            break
    head, tail = body[:end].rstrip(), body[end:]
    new = f"{head} {flags}" + (f" {tail.lstrip()}" if tail else "")
    return (new + ("  " + comment if comment else "")), True


def plan_block(block: Block, root: Path = ROOT) -> Plan:
    """Apply the block's directives; ValueError for a marker that does not fit the block."""
    plan = Plan(commands=list(block.commands))
    appended: list[tuple[str, str | None, list[int] | None]] = []
    for d in block.directives:
        key, _, value = d.partition(":")
        key, value = key.strip(), value.strip()
        words = key.split()
        if key == "skip":
            plan.skip_block = value or "marked skip"
        elif words[0] == "skip" and len(words) == 2:
            for k in _indices(words[1], block):
                plan.skip[k] = value or "marked skip"
        elif words[0] == "needs" and len(words) == 2 and not value:
            if not (root / words[1]).exists():
                plan.skip_block = f"needs {words[1]}, which is absent (e.g. a fresh clone)"
        elif words[0] == "append":
            if len(words) == 1:
                appended.append((value, None, None))
            elif words[1].replace(",", "").isdigit():
                appended.append((value, None, _indices(words[1], block)))
            else:
                appended.append((value, words[1], None))
        elif key == "setup":
            plan.setup.append(value)
        elif key == "script" and not value:
            plan.script = True
        elif key == "expect":
            plan.expect.append(value)
        elif key == "timeout":
            plan.timeout = int(value)
        else:
            raise ValueError(f"{block.where()}: unknown docs-test directive {d!r}")
    for flags, sub, only in appended:
        hit = False
        for k, command in enumerate(plan.commands):
            if only is not None and k not in only:
                continue
            plan.commands[k], done = insert_flags(command, flags, sub)
            hit |= done
        if not hit:
            raise ValueError(f"{block.where()}: 'append {sub}' matches no command of the block")
    return plan


# -- running --------------------------------------------------------------------------------------------------
def make_workdir(tmp: Path) -> Path:
    """``tmp/repo`` (the cwd) with the repository's inputs linked in, and ``tmp/shared`` when there is one."""
    work = tmp / "repo"
    work.mkdir(parents=True)
    for name in LINKED:
        if name in COPIED:
            shutil.copytree(ROOT / name, work / name, symlinks=True)
        else:
            (work / name).symlink_to(ROOT / name, target_is_directory=True)
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (tmp / "shared").symlink_to(shared, target_is_directory=True)
    return work


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's ended children, theirs included: what a command cost,
    whatever else loads the machine (its wall time is not)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def shell(command: str, cwd: Path, timeout: int) -> tuple[int, str, float, float]:
    """Run one command (or script) through bash with the wrappers; (exit status, output, seconds, CPU seconds)."""
    command = command.replace(".venv/bin/", "")
    env = {**os.environ, "DOCS_TEST_PYTHON": sys.executable, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # The environment's other console scripts (accelerate, ...) as a person who activated it has them: CI runs
    # `.venv/bin/python -m pytest` without activating, so they are not on its PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("WORLD_SIZE", None)
    t0, cpu0 = time.perf_counter(), children_cpu_seconds()
    proc = subprocess.Popen(["bash", "-c", PRELUDE + command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the whole process group this command started (torchrun and its ranks)
        out, _ = proc.communicate()
        status, out = 124, out + f"\n[docs-test: killed after {timeout} s]"
    finally:  # what the command left running dies with it: `scaletrain serve ... &` then `kill %1` kills the
        # background subshell of the `scaletrain` wrapper function, not its python (a server left on for the rest
        # of the suite, found in ps); the command's session is its process group
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    return status, out, time.perf_counter() - t0, children_cpu_seconds() - cpu0


def run_page(page: Path, tmp: Path) -> tuple[list[str], list[str], list[str]]:
    """(failures, log lines, skips) of every block of one page, in order, in one work folder."""
    blocks, problems = parse_page(page)
    failures, log, skips = list(problems), [], []
    work = make_workdir(tmp)
    for block in blocks:
        try:
            plan = plan_block(block)
        except ValueError as exc:
            failures.append(str(exc))
            continue
        if plan.skip_block:
            skips += [f"{block.where(k)}: {c}  [skipped: {plan.skip_block}]" for k, c in enumerate(plan.commands)]
            continue
        steps = [("setup", c) for c in plan.setup]
        if plan.script:
            steps.append(("script", "\n".join(c for k, c in enumerate(plan.commands) if k not in plan.skip)))
        else:
            steps += [(k, c) for k, c in enumerate(plan.commands)]
        output = ""
        for k, command in steps:
            if isinstance(k, int) and k in plan.skip:
                skips.append(f"{block.where(k)}: {command}  [skipped: {plan.skip[k]}]")
                continue
            where = block.where(k if isinstance(k, int) else None) + ("" if isinstance(k, int) else f" ({k})")
            status, out, seconds, cpu = shell(command, work, plan.timeout)
            output += out
            log.append(f"{seconds:6.1f} s  {cpu:6.1f} s CPU  exit {status}  {where}: {command}")
            if status != 0:
                failures.append(f"{where}: exit status {status}\n$ {command}\n{out[-TAIL:]}")
        for text in plan.expect:
            if text not in output:
                failures.append(f"{block.where()}: the output does not contain {text!r}\n{output[-TAIL:]}")
    return failures, log, skips


def commands_to_run(page: Path) -> int:
    """How many commands of the page the test runs (a marker that does not fit counts none: the test fails it)."""
    count = 0
    for block in parse_page(page)[0]:
        try:
            plan = plan_block(block)
        except ValueError:
            continue
        count += 0 if plan.skip_block else len(plan.setup) + len(plan.commands) - len(plan.skip)
    return count


def longest_first(pages: list[Path]) -> list[Path]:
    """The pages with the most commands to run first: the workers take them in this order (below)."""
    return sorted(pages, key=lambda page: -commands_to_run(page))


# One test a page, each in its own work folder: pytest-xdist's workers take them one by one, not as one file
# (tests/helpers/schedule.py), so the pages run side by side on all cores, the longest first.
@pytest.mark.slow
@pytest.mark.parametrize("page", longest_first(PAGES), ids=lambda page: page.name)
def test_documented_commands_run(page, tmp_path):
    failures, log, skips = run_page(page, tmp_path)
    print(f"\n{page.relative_to(ROOT)}: {len(log)} commands run, {len(skips)} skipped")
    print("\n".join(log + skips))
    if failures:
        pytest.fail(f"{len(failures)} documented command(s) of {page.relative_to(ROOT)} failed:\n\n"
                    + "\n\n".join(failures), pytrace=False)


# -- numbers quoted from benchmarks/results/*.json -----------------------------------------------------------
NUMBER = re.compile(r"(?<![\w.])([-+±−]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:e([-+]?\d+))?(%|x)?(?!\.?\w)")
SCALES = (1.0, 100.0, 1e3, 1e-3, 1e-6, 1e-9, 2.0 ** -20, 2.0 ** -30)


@dataclass(frozen=True)
class Shown:
    """A number as a page shows it: its value and how far it was rounded."""

    text: str
    value: float
    tolerance: float
    signed: bool
    percent: bool


def numbers_in(text: str) -> list[Shown]:
    out = []
    for m in NUMBER.finditer(text):
        sign, whole, frac, exp, suffix = m.groups()
        frac = frac or ""
        value = float(whole.replace(",", "") + frac) * (10 ** int(exp) if exp else 1)
        decimals = len(frac) - 1 if frac else 0
        tol = 0.5 * 10.0 ** (-decimals) * (10 ** int(exp) if exp else 1)
        if sign in ("-", "−"):
            value = -value
        out.append(Shown(m.group(0), value, tol * (1 + 1e-9) + 1e-12, sign in ("-", "+", "−"), suffix == "%"))
    return out


def json_numbers(doc) -> list[float]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, (int, float)):
        return [float(doc)] if math.isfinite(doc) else []
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in json_numbers(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in json_numbers(v)]
    if isinstance(doc, str):  # numbers inside stored text (a rendered table, a verdict line)
        return [n.value for n in numbers_in(doc)]
    return []


def matches(shown: Shown, values: list[float]) -> bool:
    target = shown.value
    for v in values:
        # units scale down only big values (bytes -> MiB, ms -> s), so a tiny quoted number cannot match by chance
        candidates = [v * s for s in SCALES if s >= 1 or abs(v) >= 100]
        candidates += [(v - 1) * 100] if shown.percent or shown.signed else []
        for c in candidates:
            if abs(c - target) <= shown.tolerance or (not shown.signed and abs(abs(c) - target) <= shown.tolerance):
                return True
    return False


def lookup(doc, path: str):
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        doc = doc[int(part[1:-1])] if part.startswith("[") else doc[part]
    return doc


def _table_cells(lines: list[str], excluded: set[str]) -> list[str]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.strip().startswith("|")]
    if not rows:
        return lines
    header = rows[0]
    missing = {x for x in excluded if not x.isdigit()} - set(header)
    if missing:
        raise ValueError(f"no column {sorted(missing)} in the table (columns: {header})")
    keep = [k for k, h in enumerate(header) if h not in excluded and str(k + 1) not in excluded]
    body = [r for r in rows[1:] if not all(set(c) <= set("-: ") for c in r)]
    return [r[k] for r in body for k in keep if k < len(r)]


def quoted_numbers(page: Path) -> list[tuple[str, str, list[float], str]]:
    """(where, shown text, candidate values, source) for every number under a numbers-from or from marker."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = str(page.relative_to(ROOT))
    out = []
    for i, line in enumerate(lines):
        for m in re.finditer(r"<!--\s*from:\s*(\S+)\s+(\S+)\s*-->", line):
            source, path = m.groups()
            before = numbers_in(re.sub(r"<!--.*?-->", "", line[: m.start()]))
            if not before:
                raise ValueError(f"{name}:{i + 1}: no number before the from marker")
            value = lookup(json.loads((ROOT / source).read_text()), path)
            out.append((f"{name}:{i + 1}", before[-1], [float(value)], f"{source} {path}"))
        m = re.match(r"\s*<!--\s*numbers-from:\s*(\S+)(.*?)-->\s*$", line)
        if not m:
            continue
        source, rest = m.groups()
        excluded = set(x.strip() for x in re.search(r"except:([^;]*)", rest).group(1).split(",")) \
            if "except:" in rest else set()
        ignored = set(x.strip() for x in re.search(r"ignore:([^;]*)", rest).group(1).split(",")) \
            if "ignore:" in rest else set()
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        chunk = []
        while j < len(lines) and lines[j].strip():
            chunk.append(lines[j])
            j += 1
        values = json_numbers(json.loads((ROOT / source).read_text()))
        for cell in _table_cells(chunk, excluded):
            for shown in numbers_in(re.sub(r"<!--.*?-->|`[^`]*`", "", cell)):
                if shown.text.lstrip("+-±−") not in ignored and shown.text not in ignored:
                    out.append((f"{name}:{i + 1}", shown, values, source))
    return out


def test_numbers_quoted_from_benchmark_results_match_the_json():
    wrong, count, sources = [], 0, set()
    for page in PAGES:
        for where, shown, values, source in quoted_numbers(page):
            count += 1
            sources.add(source.split()[0])
            if not matches(shown, values):
                wrong.append(f"{where}: {shown.text} is not in {source}")
    assert not wrong, f"{len(wrong)} of {count} quoted numbers do not match their JSON:\n" + "\n".join(wrong)
    results = {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert sources == results, f"no quoted numbers are checked from {sorted(results - sources)}"


# -- the planner's worked example ---------------------------------------------------------------------------
def _wall(text: str, seconds: float) -> bool:
    value, unit = text.split()
    per = {"h": 3600, "days": 86400, "years": 365.25 * 86400}[unit]
    return round(seconds / per, len(value.partition(".")[2])) == float(value)


def test_planning_worked_example_is_what_plan_prints(tmp_path, capsys):
    from scaletrain.cli import main

    page = ROOT / "docs" / "planning.md"
    lines = page.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if "<!-- plan-table:" in line]
    assert starts, "docs/planning.md has no plan-table marker"
    wrong, rows_checked = [], 0
    for i in starts:
        args = re.search(r"plan-table:(.*?)-->", lines[i]).group(1).split()
        j = i + 1
        while not lines[j].strip().startswith("|"):
            j += 1
        rows = []
        while j < len(lines) and lines[j].strip().startswith("|"):
            rows.append([c.strip() for c in lines[j].strip().strip("|").split("|")])
            j += 1
        for row in rows[2:]:
            hardware, label, memory, tps, wall, hours, on_demand, spot = row
            out = tmp_path / "plan.json"
            assert main(["plan", *args, "--hardware", hardware, "--json", str(out)]) == 0
            best = json.loads(out.read_text())["plans"][0]
            got = {"best plan": best["label"], "memory": f"{best['memory']['total'] / 2 ** 30:.2f} GiB",
                   "tokens/s": f"{best['time']['tokens_per_second']:,.0f}",
                   "device-hours": f"{best['cost']['device_hours']:,.1f}",
                   "on-demand": f"{best['cost']['on_demand_usd']:,.2f}", "spot": f"{best['cost']['spot_usd']:,.2f}"}
            shown = {"best plan": label, "memory": memory, "tokens/s": tps, "device-hours": hours,
                     "on-demand": on_demand, "spot": spot}
            wrong += [f"{hardware} {k}: the page says {shown[k]}, plan prints {got[k]}" for k in got
                      if got[k] != shown[k]]
            if not _wall(wall, best["total_seconds"]):
                wrong.append(f"{hardware} wall time: the page says {wall}, plan predicts {best['total_seconds']:.0f} s")
            rows_checked += 1
    capsys.readouterr()
    assert rows_checked >= 5
    assert not wrong, "docs/planning.md's worked example is stale:\n" + "\n".join(wrong)


# -- the test's own machinery ----------------------------------------------------------------------------------
def test_markers_parse_and_flags_go_where_they_belong():
    block = Block("x.md", 1, ["scaletrain train --config a.toml &", "touch f  # a note",
                              "for n in 0 1; do torchrun -m scaletrain.cli train --x=1 & done; wait"],
                  ["append train: --train.steps=3", "skip 2: not needed"])
    plan = plan_block(block)
    assert plan.commands[0] == "scaletrain train --config a.toml --train.steps=3 &"
    assert plan.commands[2] == "for n in 0 1; do torchrun -m scaletrain.cli train --x=1 --train.steps=3 & done; wait"
    assert plan.skip == {1: "not needed"}
    assert insert_flags("scaletrain eval --run r   # val loss", "--batches 1", "eval")[0] == \
        "scaletrain eval --run r --batches 1  # val loss"
    with pytest.raises(ValueError, match="matches no command"):
        plan_block(Block("x.md", 1, ["scaletrain eval"], ["append train: --a"]))
    with pytest.raises(ValueError, match="does not exist"):
        plan_block(Block("x.md", 1, ["ls"], ["skip 2: x"]))
    with pytest.raises(ValueError, match="unknown docs-test directive"):
        plan_block(Block("x.md", 1, ["ls"], ["run fast"]))
    assert plan_block(Block("x.md", 1, ["ls"], ["needs no/such/folder"])).skip_block.startswith("needs no/such")
    assert split_commands(["a \\", "  --b  # c", "", "# only a comment", "d"]) == ["a --b  # c", "d"]


def test_a_failing_command_fails_the_page_with_its_output(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n<!-- docs-test: skip 2: not here -->\n```bash\nls configs/default.toml\nfalse\n"
                    "echo the-tail; exit 3   # a comment\n```\n\n```\nscaletrain train\n```\n\n"
                    "<!-- docs-test: skip -->\n")
    failures, log, skips = run_page(page, tmp_path / "work")
    assert len(log) == 2 and skips == ["page.md:4 command 2: false  [skipped: not here]"]
    problems, [failed] = failures[:2], failures[2:]
    assert "page.md:10: a fenced block of commands without ```bash" in problems[0]
    assert "page.md:14: docs-test marker at the end of the page" in problems[1]
    assert failed.startswith("page.md:4 command 3: exit status 3\n$ echo the-tail") and failed.endswith("the-tail\n")


def test_number_matching():
    [pct] = numbers_in("-17.8%")
    assert matches(pct, [-0.178]) and not matches(pct, [0.178]) and not matches(pct, [-0.17])
    [ratio, change] = numbers_in("1.015x (+1.5%)")
    assert matches(ratio, [1.0152]) and matches(change, [1.0152])
    assert [n.text for n in numbers_in("micro-b8 768x4 0.81M 9.25 / 9.25 1,458,392 1.3e-7 ±20.2%")] == \
        ["9.25", "9.25", "1,458,392", "1.3e-7", "±20.2%"]
    [mib] = numbers_in("52.0")
    assert matches(mib, [54507008.0])  # bytes shown in MiB


def test_default_toml_is_the_builtin_default_written_out(tmp_path):
    """configs/default.toml is what `scaletrain train` runs with no arguments: the same values, and every
    field written out (regenerate with `scaletrain train --print-config`, keeping the header comment)."""
    from scaletrain.config import load_config, read_toml, to_toml

    path = ROOT / "configs" / "default.toml"
    assert load_config(path) == load_config(None)

    def keys(tree: dict, prefix: str = "") -> set[str]:
        return {k for name, v in tree.items()
                for k in (keys(v, f"{prefix}{name}.") if isinstance(v, dict) else {prefix + name})}

    written = tmp_path / "builtin.toml"
    written.write_text(to_toml(load_config(None)))
    missing, extra = keys(read_toml(written)) - keys(read_toml(path)), keys(read_toml(path)) - keys(read_toml(written))
    assert not missing and not extra, f"configs/default.toml lacks {sorted(missing)}, has unknown {sorted(extra)}"
