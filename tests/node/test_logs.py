"""Library noise in the node's log: py-libp2p's dial-failure bursts become one operator line per peer per
interval; other library errors are rate-limited, not lost. Records are fed as 0.8.1 emits them (same
logger names, format strings and argument types), and once from a real failed dial."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from intellect_node.logsetup import LibraryNoiseGate, quiet_library, setup_logging
from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol.signing import SigningKey
from tests.support.swarm import run

TCP = "libp2p.transport.tcp.tcp"  # `logger = logging.getLogger(__name__)` in libp2p/transport/tcp/tcp.py
SWARM = "libp2p.network.swarm"
STALE = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # a peer ID nobody here has


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


LogLines = tuple[io.StringIO, Clock]  # the log stream and the gate's clock


@pytest.fixture
def log_lines() -> Iterator[LogLines]:
    out = io.StringIO()
    clock = Clock()
    setup_logging(level="INFO", json_lines=True, stream=out)
    quiet_library(gate=LibraryNoiseGate(interval=60.0, clock=clock))
    yield out, clock
    _reset()


def _reset() -> None:
    """Undo setup_logging for the tests that follow in this process: no handler of ours, no gate."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_intellect_node", False)]:
        root.removeHandler(h)
    root.setLevel(logging.WARNING)
    lib = logging.getLogger("libp2p")
    lib.handlers.clear()
    lib.propagate = True
    lib.setLevel(logging.ERROR)
    del lib.intellect_node_gate  # type: ignore[attr-defined]  # our attribute on logging's Logger


def _docs(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in out.getvalue().splitlines() if ln.strip()]


def _refused(port: int) -> OSError:
    # What trio.open_tcp_stream raises when every address refused (tcp.py logs it with "%s").
    return OSError(f"all attempts to connect to 127.0.0.1:{port} failed")


def test_a_burst_of_dial_failures_is_one_info_line_per_peer_per_interval(log_lines: LogLines) -> None:
    out, clock = log_lines
    tcp = logging.getLogger(TCP)
    for _ in range(48):
        tcp.error("Failed to open TCP stream: %s", _refused(4001))
    tcp.error("Failed to open TCP stream: %s", _refused(4002))
    docs = _docs(out)
    assert [d["msg"].split(" (")[0] for d in docs] == ["peer at 127.0.0.1:4001 unreachable",
                                                      "peer at 127.0.0.1:4002 unreachable"]
    assert all(d["level"] == "INFO" and d["logger"] == "intellect_node.p2p" for d in docs)
    assert docs[0]["where"] == "127.0.0.1:4001" and "all attempts" in docs[0]["library"]

    clock.t += 61  # the next interval: said once more, with how many were held back
    tcp.error("Failed to open TCP stream: %s", _refused(4001))
    last = _docs(out)[-1]
    assert last["msg"].startswith("peer at 127.0.0.1:4001 unreachable") and "(47 more since)" in last["msg"]


def test_handshake_failures_name_the_peer_and_other_errors_are_rate_limited(log_lines: LogLines) -> None:
    out, clock = log_lines
    sw = logging.getLogger(SWARM)
    peer = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
    for _ in range(5):
        sw.error("failed to upgrade security for peer %s: %s", peer, "handshake failed")
        sw.error("Error in background prune: %s", RuntimeError("x"))
    docs = _docs(out)
    assert len(docs) == 2
    assert docs[0]["msg"].startswith(f"peer {peer}: connection handshake failed")
    assert docs[0]["level"] == "INFO"
    assert docs[1] == {**docs[1], "level": "ERROR", "logger": SWARM, "msg": "Error in background prune: x"}
    clock.t += 61
    sw.error("Error in background prune: %s", RuntimeError("y"))
    assert _docs(out)[-1]["held_back"] == 4


def test_debug_level_passes_everything_unchanged() -> None:
    out = io.StringIO()
    setup_logging(level="DEBUG", json_lines=True, stream=out)
    try:
        for _ in range(3):
            logging.getLogger(TCP).error("Failed to open TCP stream: %s", _refused(4001))
        msgs = [d["msg"] for d in _docs(out) if d["logger"] == TCP]
        assert msgs == ["Failed to open TCP stream: all attempts to connect to 127.0.0.1:4001 failed"] * 3
    finally:
        _reset()


def test_a_real_failed_dial_logs_one_line_and_the_error_names_the_cause(log_lines: LogLines) -> None:
    out, _clock = log_lines

    async def dial() -> str:
        sw = await Swarm.start(SigningKey.generate(), run_id="r", listen=["/ip4/127.0.0.1/tcp/0"])
        try:
            with pytest.raises(Exception) as info:
                await sw.connect(f"/ip4/127.0.0.1/tcp/1/p2p/{STALE}")
            return str(info.value)
        finally:
            await sw.close()

    why = run(dial())
    assert why.startswith("127.0.0.1:1: connection refused"), why
    lib = [d for d in _docs(out) if d["logger"].startswith(("libp2p", "intellect_node.p2p"))
           and "127.0.0.1:1" in d["msg"]]
    # libp2p 0.8.1 retried the dial (4 ERROR lines from tcp.py); the log has one line saying what it means
    assert [d["msg"].split(" (")[0] for d in lib] == ["peer at 127.0.0.1:1 unreachable"], lib
