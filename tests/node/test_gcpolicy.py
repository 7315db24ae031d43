"""intellect_node/gcpolicy.py: the collector held off during start-up, then the start-up heap frozen.

Each test restores this process's collector (on, nothing frozen) whatever happens."""

from __future__ import annotations

import gc
import time
from typing import Iterator

import pytest

from intellect_node import gcpolicy


@pytest.fixture(autouse=True)
def restore_collector() -> Iterator[None]:
    assert gc.isenabled() and not gcpolicy.deferred()
    try:
        yield
    finally:
        gcpolicy.settle()
        gc.unfreeze()
        gc.enable()


def test_defer_holds_the_collector_off_until_settle_freezes_the_heap_and_turns_it_back_on() -> None:
    gcpolicy.defer()
    assert not gc.isenabled() and gcpolicy.deferred()
    gcpolicy.defer()  # a second call changes nothing
    assert not gc.isenabled()
    kept = [object() for _ in range(100)]
    gcpolicy.settle()
    assert gc.isenabled() and not gcpolicy.deferred()
    assert gc.get_freeze_count() > 0
    assert gc.collect(2) >= 0  # collections work again
    gcpolicy.settle()  # idempotent
    assert gc.isenabled()
    del kept


def test_the_collector_comes_back_after_the_limit_when_nothing_settles() -> None:
    gcpolicy.defer(limit_s=0.2)
    assert not gc.isenabled()
    deadline = time.monotonic() + 30.0  # the limit's timer thread, however busy the machine
    while gcpolicy.deferred() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gc.isenabled() and not gcpolicy.deferred()


def test_a_collector_turned_off_on_purpose_stays_off() -> None:
    gc.disable()
    try:
        gcpolicy.defer()
        assert not gcpolicy.deferred()  # not ours to hold
        gcpolicy.settle()
        assert not gc.isenabled()  # nor ours to turn back on
    finally:
        gc.enable()


@pytest.mark.parametrize("argv, defers", [(["--version"], False), (["keys", "--help"], False),
                                          (["join", "--no-such-flag"], True), (["sweep", "--help"], True)])
def test_the_cli_defers_collections_only_for_commands_that_run_a_node(monkeypatch: pytest.MonkeyPatch,
                                                                      argv: list[str], defers: bool) -> None:
    import sys

    from intellect_node import cli

    monkeypatch.setattr(sys, "argv", ["intellect-node", *argv])
    with pytest.raises(SystemExit):
        cli.main()
    assert gcpolicy.deferred() is defers and gc.isenabled() is not defers
