"""Closing the libp2p watch ends its loop even when a cancel is lost.

On Python 3.11 ``asyncio.wait_for`` returns its inner result when the cancel of the waiting task lands as
that result arrives; the watch's probe runs under ``wait_for``, so a node stopping just as a probe
answered kept its watch loop running and its stop waited for ever (a full-suite run: one node's stop
hung until the test's 280 s deadline). The probe here loses exactly one cancel, as that race does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from intellect_node.p2p.liveness import Libp2pWatch


class _LosesOneCancel(Libp2pWatch):
    """A probe that never answers by itself and drops the first cancel it gets."""

    lost = 0
    probes = 0

    async def check(self) -> str:
        self.probes += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if not self.lost:  # the race: the probe's answer arrived with the cancel, which is dropped
                self.lost += 1
                return ""
            raise
        return ""


def test_close_ends_the_watch_loop_even_if_a_cancel_is_lost() -> None:
    swarm: Any = SimpleNamespace(bridge=SimpleNamespace(on_exit=None), connected_peers=lambda: [])

    async def main() -> None:
        watch = _LosesOneCancel(swarm, interval=0.01)
        watch.start()
        while not watch.probes:  # the loop is inside its first probe
            await asyncio.sleep(0.01)
        await asyncio.wait_for(watch.close(), 30)
        assert watch.lost == 1
        assert watch._task is not None and watch._task.done()

    asyncio.run(asyncio.wait_for(main(), 60))
