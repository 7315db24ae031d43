"""Workaround ``pubsub-seen-cache-thread`` (p2p/compat.py): a closed host leaves no thread behind.

py-libp2p 0.8.1's ``Pubsub`` starts a sweeper thread for its seen-message cache when it is built, and
nothing stops it when the pubsub service ends; a node builds a new host at every libp2p restart, and the
tests and benchmarks build hundreds in one process.
"""

from __future__ import annotations

import threading

from libp2p.tools.timed_cache.last_seen_cache import LastSeenCache

from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol.signing import SigningKey
from tests.support.swarm import run
from tests.support.wait import wait_until


def _sweepers() -> int:
    return sum(1 for t in threading.enumerate() if "_background_cleanup" in t.name)


def test_stock_pubsub_leaves_its_seen_cache_thread_running() -> None:
    """The defect: the cache's thread runs from construction until someone calls ``stop()``, which the
    library's pubsub never does."""
    before = _sweepers()
    cache = LastSeenCache(120, 60)
    assert _sweepers() == before + 1
    cache.stop()
    assert _sweepers() == before


def test_a_closed_swarm_leaves_no_sweeper_thread() -> None:
    async def main() -> None:
        before = _sweepers()
        for _ in range(3):
            sw = await Swarm.start(SigningKey.generate(), run_id="test", listen=["/ip4/127.0.0.1/tcp/0"],
                                   http_url="http://127.0.0.1:1")
            await sw.close()
        await wait_until(lambda: _sweepers() == before, 20, what="no sweeper thread left")

    run(main(), timeout=120)
