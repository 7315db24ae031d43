"""A scoring process's reply is data, never a pickle.

A child has run a checker on hostile text; if that text ever got control of the child, a pickled reply
would run code in the node. The parent decodes a reply only as ``envs._child.Reply`` (a number or an
error message) under a size limit, and drops a child that sends anything else."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.envs import sandbox
from intellect_node.envs._child import MAX_REPLY_BYTES, Reply, decode_reply, encode_reply


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _child_replying(payload: bytes) -> sandbox._Child:
    """A stand-in child process that answers any request with ``payload`` (length-prefixed)."""
    script = ("import sys, struct\n"
              "data = bytes.fromhex(sys.argv[1])\n"
              "sys.stdin.buffer.read(4)\n"
              "sys.stdout.buffer.write(struct.pack('>I', len(data)) + data)\n"
              "sys.stdout.buffer.flush()\n"
              "sys.stdin.buffer.read()\n")
    child = sandbox._Child.__new__(sandbox._Child)
    child.proc = subprocess.Popen([sys.executable, "-c", script, payload.hex()], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)
    child.imported = set()
    return child


def test_a_pickled_reply_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    child = _child_replying(pickle.dumps(("ok", _Boom(marker))))
    try:
        with pytest.raises(sandbox.ChildGone, match="reply format"):
            child.call(("intellect_node.envs.mathcheck", "verify_in_child", ("1", "1")), 30.0)
    finally:
        child.kill()
    assert not marker.exists()


def test_an_oversize_reply_is_refused() -> None:
    child = _child_replying(b"\0" * (MAX_REPLY_BYTES + 1))
    try:
        with pytest.raises(sandbox.ChildGone, match="byte reply"):
            child.call(("intellect_node.envs.mathcheck", "verify_in_child", ("1", "1")), 30.0)
    finally:
        child.kill()


def test_replies_round_trip_and_nothing_else_decodes() -> None:
    for reply in (Reply(ok=True, value=1.0), Reply(ok=True), Reply(ok=False, error="ValueError: x")):
        assert decode_reply(encode_reply(reply)) == reply
    for bad in (pickle.dumps(("ok", 1.0)), b"", b"\x93\x01\x02\x03", struct.pack(">d", 1.0),
                encode_reply(Reply(ok=False, error="x" * 400))):
        with pytest.raises(ValueError):
            decode_reply(bad)


def test_the_real_child_answers_in_the_new_format() -> None:
    pool = sandbox.ScoringPool(1)
    try:
        assert pool.call("intellect_node.envs.mathcheck", "verify_in_child", "0.5", "1/2") == 1.0
    finally:
        pool.close()
