"""Imports flow one way, bottom up (see intellect_node/__init__.py); the core never imports rich/typer."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "intellect_node"

RANK = {"errors": 0, "fsutil": 0, "gcpolicy": 0, "protocol": 1, "proofs": 2, "models": 2, "policy": 2,
        "trainer": 3, "envs": 3, "research": 3, "inference": 4, "p2p": 5, "blobs": 6, "roles": 8, "node": 9,
        "commands": 10, "cli": 10, "dashboard": 10, "logsetup": 10, "testing": 11}
"""``testing`` (the shipped test harness, like ``trio.testing``) ranks above everything: it may use any part,
and no part of the product may import it."""
NODE_BELOW_ROLES = {"node.config": 7, "node.ledger": 7, "node.status": 7}
"""The parts of ``node/`` the roles read: the configuration tree, the ledger they record in, and the status
board they report to. The rest of ``node/`` (runtime, assembly, metrics, control) sits above the roles."""
CORE_FORBIDDEN = {"rich", "typer"}
PURE_FORBIDDEN = {"libp2p", "trio", "aiohttp", "torch", "vllm"}  # not in protocol/


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG)
    top = rel.parts[0].removesuffix(".py")
    sub = f"{top}.{rel.parts[1].removesuffix('.py')}" if len(rel.parts) > 1 else top
    return sub if sub in NODE_BELOW_ROLES else top


def _rank(layer: str) -> int:
    return NODE_BELOW_ROLES.get(layer, RANK.get(layer.split(".")[0], -1))


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
        if _rank(layer) < 0:
            continue
        for mod in _imports(path):
            top = mod.split(".")[0]
            if top == "intellect_node" and len(mod.split(".")) > 1:
                parts = mod.split(".")
                target = ".".join(parts[1:3]) if ".".join(parts[1:3]) in NODE_BELOW_ROLES else parts[1]
                if _rank(target) > _rank(layer):
                    problems.append(f"{path.relative_to(PKG)} imports upward: {mod}")
            if _rank(layer) < RANK["commands"] and top in CORE_FORBIDDEN:
                problems.append(f"{path.relative_to(PKG)} (core) imports {top}")
            if layer == "protocol" and top in PURE_FORBIDDEN:
                problems.append(f"{path.relative_to(PKG)} (protocol) imports {top}")
            if layer == "proofs" and top in {"libp2p", "trio", "aiohttp", "transformers", "vllm"}:
                problems.append(f"{path.relative_to(PKG)} (proofs) imports {top}")
    assert not problems, "\n".join(problems)


def test_only_p2p_imports_libp2p() -> None:
    """``testing`` may too: its NAT agent stands in for a remote peer with a bare host (and the node's fixes);
    no part of the node imports it (above)."""
    problems = [f"{path.relative_to(PKG)} imports {mod}" for path in PKG.rglob("*.py")
                if _layer(path) not in ("p2p", "testing")
                for mod in _imports(path) if mod.split(".")[0] == "libp2p"]
    assert not problems, "\n".join(problems)


def test_nothing_outside_the_tests_imports_them() -> None:
    repo = PKG.parent
    problems = [f"{path.relative_to(repo)} imports {mod}"
                for folder in ("intellect_node", "bench", "scripts") for path in (repo / folder).rglob("*.py")
                for mod in _imports(path) if mod.split(".")[0] in ("tests", "conftest") or
                mod.split(".")[0].startswith("support_")]
    assert not problems, "\n".join(problems)
