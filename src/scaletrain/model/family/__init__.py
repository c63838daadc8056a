"""The model families, one file each (``<name>.py`` defining ``FAMILY``): the one list of them.

Adding a family is one file here plus a shrunk published config.json in ``tests/fixtures/families/`` (see
docs/architecture.md); nothing else names a family.
"""

from __future__ import annotations

import importlib
import pkgutil

from scaletrain.core.options import ConfigError
from scaletrain.model.family.spec import Family


def _discover() -> dict[str, Family]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name != "spec":
            family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
            found[family.model_type] = family
    # llama first: the default family, and the order messages list them in
    return dict(sorted(found.items(), key=lambda kv: kv[0] != "llama"))


FAMILIES: dict[str, Family] = _discover()
NAMES: tuple[str, ...] = tuple(FAMILIES)
# a wrapper model_type (Gemma 3's multimodal gemma3) -> the family of its text_config
WRAPPERS: dict[str, str] = {w: f.model_type for f in FAMILIES.values() for w in f.wrappers}


def family(name: str, where: str = "model.family") -> Family:
    """The entry of a model_type (or of a wrapper's text decoder); a ConfigError naming the supported ones."""
    name = WRAPPERS.get(name, name)
    if name not in FAMILIES:
        raise ConfigError(f"{where}: model_type {name!r} is not supported (supported: {', '.join(NAMES)}"
                          f"{', and ' + ', '.join(WRAPPERS) if WRAPPERS else ''})")
    return FAMILIES[name]


def presets() -> dict[str, dict]:
    """Every family's published shapes (name -> ModelConfig fields, ``family`` set)."""
    return {name: {"family": f.model_type, **fields} for f in FAMILIES.values() for name, fields in f.presets.items()}
