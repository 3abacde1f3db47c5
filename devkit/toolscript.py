"""A script of tools/ (no .py suffix, so no plain import) loaded as a module, for its tests."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from devkit import REPO

TOOLS = REPO / "tools"


def load(name: str):
    loader = importlib.machinery.SourceFileLoader(name, str(TOOLS / name))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
