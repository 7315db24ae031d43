"""``network.auto_ban_after`` reaches the running node's peerbook: a peer is banned after that many
rejections (0: never automatically), and a bad value is refused naming the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from intellect_node.config import build_config
from intellect_node.errors import ConfigError
from intellect_node.node.assembly import build_node


@pytest.mark.parametrize("after", [3, 0])
def test_auto_ban_after_reaches_the_peerbook(tmp_path: Path, after: int) -> None:
    cfg = build_config(network={"auto_ban_after": after, "http_host": "127.0.0.1"}, run={"run_id": "t"})

    async def main() -> None:
        rt = build_node(cfg, tmp_path / "node", labels=[], services=[], common=False)
        await rt.start()
        try:
            book = rt.swarm.peerbook
            assert book.auto_ban_after == (after or None)
            mallory = "12D3KooWMallory"
            for i in range(5):
                book.record_rejection(mallory, f"bad message {i}")
            assert book.is_banned(mallory) == (after == 3)
        finally:
            await rt.stop()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_negative_auto_ban_after_names_the_field() -> None:
    with pytest.raises(ConfigError, match="auto_ban_after"):
        build_config(network={"auto_ban_after": -1})
