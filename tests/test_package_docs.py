"""Each package's docstring is the map of its folder: it names every module and subpackage in it, so a
reader who opens ``__init__.py`` finds every file there (the top-level package's map is the layer table
of docs/architecture.md, checked by ``tests/test_docs_map.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "intellect_node"
PACKAGES = sorted(p.parent for p in PKG.rglob("__init__.py") if p.parent != PKG)


def _members(folder: Path) -> list[str]:
    modules = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
    subpackages = [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + subpackages)


@pytest.mark.parametrize("folder", PACKAGES, ids=lambda p: str(p.relative_to(PKG)))
def test_package_docstring_names_every_module(folder: Path) -> None:
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    missing = [m for m in _members(folder) if not re.search(rf"(?<!\w){re.escape(m)}(?!\w)", doc)]
    assert not missing, f"{folder.relative_to(PKG)}/__init__.py's docstring does not name {missing}"
