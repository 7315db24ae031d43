"""``join --run <run id>``: a run ID is only the listings' word, so listings that name several
manifests for one ID are refused (exit 2 naming --organiser) unless --organiser pins who made it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from intellect_node.commands.runs import _pick_by_id
from intellect_node.errors import ConfigError


@dataclass
class _Manifest:
    run_id: str
    organiser: str
    created_ms: int = 0


@dataclass
class _Row:
    cid: str
    manifest: _Manifest


HONEST = _Row("bafkreihonest", _Manifest("r1", "12D3KooWorg"))
HOSTILE = _Row("bafkreievil", _Manifest("r1", "12D3KooWbad"))


def test_listings_that_disagree_about_a_run_id_need_organiser() -> None:
    claims = {"r1": {"bafkreihonest", "bafkreievil"}}
    # Only the hostile manifest was fetched (the honest one left out by the lookup's limits): still refused.
    refused = r"--run r1: the peers' listings name 2 manifests.*--organiser"
    with pytest.raises(ConfigError, match=refused) as e:
        _pick_by_id("r1", None, [HOSTILE], claims, 0)
    assert e.value.field == "--organiser"
    pinned = _pick_by_id("r1", "12D3KooWorg", [HONEST, HOSTILE], claims, 0)
    assert pinned == "bafkreihonest"


def test_listings_that_agree_need_no_organiser() -> None:
    claims = {"r1": {"bafkreihonest"}, "r2": {"x", "y"}}
    assert _pick_by_id("r1", None, [HONEST], claims, 0) == "bafkreihonest"
