#!/usr/bin/env python
"""Soak: 1,000 inbound connect/disconnect cycles from fresh keys against one node, at the node's own
watermarks (``network.conn_low``/``conn_high`` defaults: an inbound cap of 124), with the inbound-slot
workaround (``inbound-slot-per-connection`` in p2p/compat.py) and, in the same run, with py-libp2p
0.8.1's stock inbound handler as the baseline.

The target runs in this process; the dialers in a child process (this script with ``--dial ADDR``), so
the target's figures are its own. Each cycle starts a dialer ``Swarm`` with a fresh key, connects to the
target, waits until the connection is up, closes it and waits until the target sees it go;
``--parallel`` dialers cycle at once (never more than the cap). Before and after, on the target: inbound
slots in use, trio tasks on its libp2p thread, asyncio tasks, threads, and resident memory. The stock
arm stops at its first refused connection (a dial that fails) and reports how many cycles it took.

    .venv/bin/python bench/inbound_soak.py [--cycles 1000] [--parallel 8]

Exit code 1 when the mended arm refused a connection or did not end with every slot returned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import trio  # noqa: E402

from intellect_node.config import build_config  # noqa: E402
from intellect_node.errors import TransportError  # noqa: E402
from intellect_node.p2p import compat  # noqa: E402
from intellect_node.p2p.connmgr import ConnLimits  # noqa: E402
from intellect_node.p2p.swarm import Swarm  # noqa: E402
from intellect_node.protocol.signing import SigningKey  # noqa: E402

WAIT_S = 30.0
"""Bound on waiting for one connection to come up, or for the slots to return at the end."""
ARM_S = 1800.0
"""Bound on one arm."""


@dataclass(frozen=True)
class Sample:
    slots: int
    trio_tasks: int
    asyncio_tasks: int
    threads: int
    rss_mib: float


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _trio_tasks() -> int:
    def count(task: trio.lowlevel.Task) -> int:
        return 1 + sum(count(t) for n in task.child_nurseries for t in n.child_tasks)

    return count(trio.lowlevel.current_root_task())


async def sample(target: Swarm) -> Sample:
    return Sample(slots=target.inbound().in_use, trio_tasks=await target.bridge.call(_trio_tasks),
                  asyncio_tasks=len(asyncio.all_tasks()), threads=threading.active_count(),
                  rss_mib=round(_rss_mib(), 1))


async def _until(pred: Callable[[], object], what: str, bound: float = WAIT_S) -> None:
    deadline = time.monotonic() + bound
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


# -- the dialers (child process) ---------------------------------------------------------------------

async def dial(addr: str, cycles: int, parallel: int) -> dict[str, int]:
    done = 0
    refused = asyncio.Event()

    async def one() -> bool:
        dialer = await Swarm.start(SigningKey.generate(), run_id="soak", listen=["/ip4/127.0.0.1/tcp/0"],
                                   http_url="http://127.0.0.1:1", conn=ConnLimits(low=1, high=4))
        try:
            try:
                target = await dialer.connect(addr)
            except TransportError:
                return False
            await _until(lambda: target in dialer.connected_peers(), "connected")
            return True
        finally:
            await dialer.close()

    async def loop(share: int) -> None:
        nonlocal done
        for _ in range(share):
            if refused.is_set():
                return
            if not await one():
                refused.set()
                return
            done += 1

    shares = [cycles // parallel + (1 if i < cycles % parallel else 0) for i in range(parallel)]
    await asyncio.gather(*(loop(n) for n in shares))
    return {"done": done, "refused": int(refused.is_set())}


# -- the target (this process) -----------------------------------------------------------------------

async def arm(cycles: int, parallel: int, label: str) -> tuple[Sample, Sample, int, int]:
    """(before, after, cycles connected, refusals the target counted)."""
    target = await Swarm.start(SigningKey.generate(), run_id="soak", listen=["/ip4/127.0.0.1/tcp/0"],
                               http_url="http://127.0.0.1:1", conn=ConnLimits.from_config(build_config()))
    try:
        before = await sample(target)
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--dial", target.listen_addrs()[0], "--cycles", str(cycles),
            "--parallel", str(parallel), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        t0 = time.monotonic()
        while child.returncode is None and time.monotonic() - t0 < ARM_S:
            try:
                await asyncio.wait_for(child.wait(), 15)
            except TimeoutError:
                now = await sample(target)
                print(f"  {label}: {time.monotonic() - t0:.0f} s, {now.slots} slots in use, {now.trio_tasks} "
                      f"trio tasks, {now.threads} threads, {now.rss_mib:.0f} MiB", flush=True)
        if child.returncode is None:
            child.kill()
        out = json.loads((await child.stdout.read()).decode() or "{}") if child.stdout else {}
        await _until(lambda: target.inbound().in_use == 0 or out.get("refused"), "slots return")
        await asyncio.sleep(0)  # let the last closes' tasks finish before the sample
        after = await sample(target)
        return before, after, int(out.get("done", 0)), target.inbound().refused
    finally:
        await target.close()


def _row(name: str, before: float, after: float) -> str:
    ratio = f"{after / before:.2f}x" if before else "-"
    return f"| {name} | {before:g} | {after:g} | {ratio} |"


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--dial", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    compat.apply_fixes()
    if args.dial:
        print(json.dumps(await dial(args.dial, args.cycles, args.parallel)), flush=True)
        return 0
    print(f"mended: {args.cycles} cycles, {args.parallel} at a time", flush=True)
    t0 = time.monotonic()
    before, after, done, refused = await arm(args.cycles, args.parallel, "mended")
    mended_s = time.monotonic() - t0

    from libp2p.network.swarm import Swarm as LibSwarm

    stock = compat.stock("Swarm._handle_inbound_connection")
    LibSwarm._handle_inbound_connection = stock  # type: ignore[method-assign]  # restored / wrapped as above
    print("stock 0.8.1 inbound handler: until the first refusal", flush=True)
    _, s_after, s_done, _ = await arm(args.cycles, args.parallel, "stock")

    print(f"\nmended: {done} of {args.cycles} cycles connected ({mended_s:.0f} s), {refused} refused")
    print(f"stock:  {s_done} cycles connected, then refused; slots held at its end: {s_after.slots}")
    print(f"\n| mended target | before | after {done} cycles | after / before |\n|---|---|---|---|")
    for name in ("slots", "trio_tasks", "asyncio_tasks", "threads", "rss_mib"):
        print(_row(name, getattr(before, name), getattr(after, name)))
    print(f"\ncycles connected before the first refusal, mended / stock: {done} / {s_done} = "
          f"{done / max(s_done, 1):.2f}x")
    return 0 if done == args.cycles and refused == 0 and after.slots == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
