"""Imports flow one way, bottom up (docs/architecture.md, "Layers"): every package and top-level module has
its own rank, nothing imports a part of a higher or equal rank, no two files import each other (directly
or round a cycle), the core never imports rich/typer, and only ``p2p/`` imports libp2p."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "intellect_node"

RANK = {"errors": 0, "fsutil": 1, "aioutil": 1, "gcpolicy": 1, "protocol": 2, "config": 3, "proofs": 4,
        "models": 5, "policy": 6, "envs": 7, "trainer": 8, "research": 9, "inference": 10, "p2p": 11,
        "blobs": 12, "roles": 13, "node": 14, "logsetup": 15, "dashboard": 15, "cli": 15, "commands": 16,
        "testing": 17}
"""The table of docs/architecture.md. ``fsutil``, ``aioutil`` and ``gcpolicy`` are single-file helpers that
import only ``errors``; ``logsetup``, ``dashboard`` and ``cli`` are the CLI's own modules. ``testing`` (the
shipped test harness, like ``trio.testing``) ranks above everything: it may use any part, and no part of
the product may import it."""
CORE_FORBIDDEN = {"rich", "typer"}
PURE_FORBIDDEN = {"libp2p", "trio", "aiohttp", "torch", "vllm"}
"""Not in protocol/, nor in config/ but for torch: the config checks a CUDA device with it (deferred, only
when one is configured)."""


def _layer(path: Path) -> str:
    return path.relative_to(PKG).parts[0].removesuffix(".py")


def _module(path: Path) -> str:
    parts = ("intellect_node", *path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at the top or deferred in a function (``from a import b`` also yields
    ``a.b``, which is a module when ``b`` is one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out.extend(f"{node.module}.{a.name}" for a in node.names)
    return out


def _files() -> list[Path]:
    return [p for p in PKG.rglob("*.py") if p.name != "__init__.py" or p.parent != PKG]


def test_every_part_is_ranked() -> None:
    assert sorted({_layer(p) for p in _files()} - set(RANK)) == []


def test_imports_flow_bottom_up() -> None:
    problems = []
    for path in _files():
        layer = _layer(path)
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "intellect_node" and len(parts) > 1 and parts[1] in RANK and parts[1] != layer:
                if RANK[parts[1]] >= RANK[layer]:
                    problems.append(f"{path.relative_to(PKG)} imports upward: {mod}")
            if RANK[layer] < RANK["logsetup"] and parts[0] in CORE_FORBIDDEN:
                problems.append(f"{path.relative_to(PKG)} (core) imports {parts[0]}")
            allowed = {"torch"} if layer == "config" else set()
            if layer in ("protocol", "config") and parts[0] in PURE_FORBIDDEN - allowed:
                problems.append(f"{path.relative_to(PKG)} ({layer}) imports {parts[0]}")
            if layer == "proofs" and parts[0] in {"libp2p", "trio", "aiohttp", "transformers", "vllm"}:
                problems.append(f"{path.relative_to(PKG)} (proofs) imports {parts[0]}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_no_two_files_import_each_other() -> None:
    """The import graph between files has no cycle (deferred imports count: a cycle that works only
    because one side imports late is still two files that cannot be read apart)."""
    modules = {_module(p): p for p in PKG.rglob("*.py")}

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for imported in _imports(path):
            t = target(imported)
            # A module inside a package may import its own package's __init__ (and the reverse is the
            # package re-exporting it): not a cycle between two files of different purpose.
            if t is not None and t != mod and not mod.startswith(t + ".") and not t.startswith(mod + "."):
                graph[mod].add(t)
    sys.setrecursionlimit(10_000)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_only_p2p_imports_libp2p() -> None:
    problems = [f"{path.relative_to(PKG)} imports {mod}" for path in _files() if _layer(path) != "p2p"
                for mod in _imports(path) if mod.split(".")[0] == "libp2p"]
    assert not problems, "\n".join(problems)


def test_nothing_outside_the_tests_imports_them() -> None:
    repo = PKG.parent
    problems = [f"{path.relative_to(repo)} imports {mod}"
                for folder in ("intellect_node", "bench", "scripts") for path in (repo / folder).rglob("*.py")
                for mod in _imports(path) if mod.split(".")[0] in ("tests", "conftest") or
                mod.split(".")[0].startswith("support_")]
    assert not problems, "\n".join(problems)


ROLE_RANK = {"common": 0, "trainer": 1, "worker": 1, "auditor": 1, "runs": 1, "sweep": 1, "validator": 2}
"""Inside ``roles/`` (docs/architecture.md, "RL roles"): what the roles share is in ``common/``; the trainer,
worker and auditor (and the runs and sweep services) build on it and not on each other; the validator
runs the auditor's chain when ``validator.audit`` is on."""


def test_imports_inside_roles_flow_bottom_up() -> None:
    roles = PKG / "roles"
    problems = []
    for path in roles.rglob("*.py"):
        if path.parent == roles and path.name == "__init__.py":
            continue  # roles/__init__.py: role_factory names every role's module (lazily)
        part = path.relative_to(roles).parts[0].removesuffix(".py")
        assert part in ROLE_RANK, f"roles/{part} has no rank in ROLE_RANK"
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[:2] == ["intellect_node", "roles"] and len(parts) > 2 and parts[2] in ROLE_RANK \
                    and parts[2] != part and ROLE_RANK[parts[2]] >= ROLE_RANK[part]:
                problems.append(f"roles/{path.relative_to(roles)} imports {mod}")
    assert not problems, "\n".join(sorted(set(problems)))
