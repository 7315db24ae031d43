"""Imports flow one way, bottom up (see intellect_node/__init__.py); the core never imports rich/typer."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "intellect_node"

RANK = {"errors": 0, "fsutil": 0, "protocol": 1, "proofs": 2, "trainer": 3, "research": 3, "node": 4,
        "commands": 5, "cli": 5, "dashboard": 5}
CORE_FORBIDDEN = {"rich", "typer"}
PURE_FORBIDDEN = {"libp2p", "trio", "aiohttp", "torch", "vllm"}  # not in protocol/


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_imports_flow_bottom_up() -> None:
    problems = []
    for path in PKG.rglob("*.py"):
        layer = _layer(path)
        if layer not in RANK:
            continue
        for mod in _imports(path):
            top = mod.split(".")[0]
            if top == "intellect_node" and len(mod.split(".")) > 1:
                target = mod.split(".")[1]
                if target in RANK and RANK[target] > RANK[layer]:
                    problems.append(f"{path.relative_to(PKG)} imports upward: {mod}")
            if RANK[layer] < 5 and top in CORE_FORBIDDEN:
                problems.append(f"{path.relative_to(PKG)} (core) imports {top}")
            if layer == "protocol" and top in PURE_FORBIDDEN:
                problems.append(f"{path.relative_to(PKG)} (protocol) imports {top}")
            if layer == "proofs" and top in {"libp2p", "trio", "aiohttp", "transformers", "vllm"}:
                problems.append(f"{path.relative_to(PKG)} (proofs) imports {top}")
    assert not problems, "\n".join(problems)
