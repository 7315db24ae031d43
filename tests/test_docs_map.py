"""docs/architecture.md's layer table is the map of the package: every package ``tests/test_layering.py``
ranks appears in it at its rank, and the table names nothing the layering test does not rank."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_layering import RANK

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


def _table() -> dict[str, int]:
    """``{layer: rank}`` from the table's rows (``| rank | `a`, `b/` | holds |``)."""
    ranks: dict[str, int] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        for name in re.findall(r"`([^`]+)`", m.group(2)):
            layer = name.rstrip("/")
            assert layer not in ranks, f"{layer} twice in the layer table"
            ranks[layer] = int(m.group(1))
    return ranks


def test_layer_table_matches_the_layering_ranks() -> None:
    table = _table()
    assert table, "no layer table found in docs/architecture.md"
    assert table == RANK
