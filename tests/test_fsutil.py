"""``fsutil``'s JSON-lines appender: records one a line, readable after a torn write, and the bounded
diagnostics form (no fsync, rotated past a size)."""

from __future__ import annotations

import json
from pathlib import Path

from intellect_node.fsutil import JsonlAppender, append_jsonl, read_jsonl


def test_records_are_appended_one_a_line_and_a_torn_line_hides_nothing(tmp_path: Path) -> None:
    path = tmp_path / "d" / "log.jsonl"
    append_jsonl(path, {"a": 1}, {"a": 2})
    with open(path, "a") as f:
        f.write('{"a": 3')  # a kill mid-write
    append_jsonl(path, {"a": 4}, fresh_line=True)
    assert [r["a"] for r in read_jsonl(path)] == [1, 2, 4]


def test_a_bounded_log_is_rotated_once_past_its_size_keeping_one_old_file(tmp_path: Path) -> None:
    path = tmp_path / "hops.jsonl"
    line = {"event": "x" * 80}
    size = len(json.dumps({**line, "i": 0})) + 1  # a line, single-digit i
    appender = JsonlAppender(path, fsync=False, max_bytes=3 * size)
    try:
        for i in range(10):
            appender.append([{**line, "i": i}])
    finally:
        appender.close()
    old, new = read_jsonl(path.with_name("hops.jsonl.1")), read_jsonl(path)
    # four lines fill past 3 lines' worth; the fifth append rotates: .1 holds 4-7, the file 8-9
    assert [r["i"] for r in old] == [4, 5, 6, 7] and [r["i"] for r in new] == [8, 9]
    assert path.stat().st_size <= 4 * size and path.with_name("hops.jsonl.1").stat().st_size <= 4 * size
    # one append a call (the roles' hops writers) rotates the same way
    for i in range(10, 20):
        append_jsonl(path, {**line, "i": i}, fsync=False, max_bytes=3 * size)
    assert path.stat().st_size <= 4 * size
    assert [r["i"] for r in read_jsonl(path)][-1] == 19
