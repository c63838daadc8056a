"""The search space of ``scaletrain tune``: a TOML file naming config fields and their ranges.

Each table whose name is a dotted config field (any field of ``scaletrain train --help``) is one parameter::

    [optim.lr]
    type = "log"          # log | linear | int | categorical
    low = 1e-4
    high = 1e-2

    [model.n_layers]
    type = "int"          # an int field takes "int", or "log" (e.g. a batch size over powers)
    low = 2
    high = 6
    step = 2              # optional (int, linear)

    [schedule.name]
    type = "categorical"
    choices = ["cosine", "wsd"]

Every value a range can produce is checked against the field's type and limits before any trial runs, so a
bad space is one line (``ConfigError``, exit 2) and not a failed trial twenty minutes later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.config import JobConfig, check_field, coerce, iter_fields, read_toml
from scaletrain.core.options import ConfigError

KINDS = ("log", "linear", "int", "categorical")


@dataclass(frozen=True)
class Param:
    """One searched config field."""

    name: str  # dotted config field, e.g. "optim.lr"
    kind: str  # one of KINDS
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    choices: tuple = ()

    def suggest(self, trial: Any) -> Any:
        """The value an Optuna ``trial`` proposes for this field."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int" or (self.kind == "log" and isinstance(self.low, int)):  # log over an int field
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1),
                                     log=self.kind == "log")
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.kind == "log",
                                   step=None if self.kind == "log" or self.step is None else float(self.step))

    def contains(self, value: Any) -> bool:
        """Whether ``value`` (e.g. the job's own setting) is a point of this range."""
        if self.kind == "categorical":
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and (not float(value).is_integer() or (value - self.low) % int(self.step or 1)):
            return False
        return self.low <= value <= self.high


def _tables(raw: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """The parameter tables of the TOML: the innermost tables that hold a ``type`` (or are empty leaves)."""
    out = []
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if not isinstance(value, dict):
            raise ConfigError(f"{name} = {value!r}: each parameter is a table like [optim.lr] with type, low, high "
                              f"(or choices)")
        if "type" in value or not any(isinstance(v, dict) for v in value.values()):
            out.append((name, value))
        else:
            out.extend(_tables(value, f"{name}."))
    return out


def _check_value(param_name: str, value: Any, tp: Any, field: Any, where: str) -> Any:
    """``value`` as the field's type, within its limits (ConfigError naming the parameter otherwise)."""
    value = coerce(value, tp, param_name, where)
    check_field(param_name, value, field, where)
    return value


def parse_space(raw: dict, where: str = "") -> list[Param]:
    """The parameters of a search-space document (a parsed TOML); ConfigError on anything unusable."""
    fields = {name: (tp, f) for name, tp, f in iter_fields(JobConfig)}
    params = []
    for name, table in _tables(raw):
        if name not in fields:
            raise ConfigError(f"{name} is not a config field{where} (the fields are listed by "
                              f"`scaletrain train --help`, e.g. optim.lr, model.dim)")
        if name.startswith("train.run_dir") or name in ("train.resume", "train.overwrite"):
            raise ConfigError(f"{name} cannot be searched{where}: tune sets it for each trial")
        tp, field = fields[name]
        kind = table.get("type")
        unknown = set(table) - {"type", "low", "high", "step", "choices"}
        if kind not in KINDS or unknown:
            what = f"unknown key(s) {', '.join(sorted(unknown))}" if unknown and kind in KINDS else \
                f"type must be one of {', '.join(KINDS)} (got {kind!r})"
            raise ConfigError(f"{name}: {what}{where}")
        if kind == "categorical":
            choices = table.get("choices")
            if not isinstance(choices, list) or not choices:
                raise ConfigError(f"{name}: a categorical parameter needs a non-empty list choices = [...]{where}")
            params.append(Param(name, kind, choices=tuple(_check_value(name, c, tp, field, where) for c in choices)))
            continue
        if "low" not in table or "high" not in table:
            raise ConfigError(f"{name}: a {kind} range needs low and high{where}")
        if tp not in (int, float) or (kind == "int" and tp is not int) or (kind == "linear" and tp is int):
            allowed = "int\" (or \"log\")" if tp is int else "log\" or \"linear" if tp is float else "categorical"
            raise ConfigError(f"{name} is a {getattr(tp, '__name__', tp)} field: use type = \"{allowed}\"{where}")
        low, high = (_check_value(name, table[k], tp, field, where) for k in ("low", "high"))
        if low > high:
            raise ConfigError(f"{name}: low ({low}) > high ({high}){where}; swap them")
        if kind == "log" and low <= 0:
            raise ConfigError(f"{name}: a log range needs low > 0 (got {low}){where}")
        step = table.get("step")
        if step is not None and (kind == "log" or isinstance(step, bool) or not isinstance(step, (int, float))
                                 or step <= 0):
            raise ConfigError(f"{name}: step must be a number > 0, and only for int and linear ranges{where}")
        params.append(Param(name, kind, low, high, step))
    if not params:
        raise ConfigError(f"the search space{where} is empty: add a table such as [optim.lr] with type = \"log\", "
                          f"low = 1e-4, high = 1e-2")
    return params


def load_space(path: str | Path) -> list[Param]:
    """``parse_space`` of a TOML file (missing file and syntax errors are one line too)."""
    return parse_space(read_toml(path), f" in {path}")
