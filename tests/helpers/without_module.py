"""``scaletrain`` as a subprocess with a module hidden from import, as on an install without that extra:

    python tests/helpers/without_module.py torchao finetune --from BASE ...
"""

from __future__ import annotations

import importlib.abc
import sys


class _Hidden(importlib.abc.MetaPathFinder):
    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ModuleNotFoundError(f"No module named '{fullname}'", name=fullname)
        return None


if __name__ == "__main__":
    hidden = sys.argv[1]
    sys.meta_path.insert(0, _Hidden(hidden))
    from scaletrain.cli import main

    sys.exit(main(sys.argv[2:]))
