"""Which problems a worker works on: assigned by a pure function every node recomputes, never chosen.

Seeds fix a problem's samples (``proofs/sampling.py``); this module fixes the problems. A worker's
*assignment window* is a pair (policy version ``v``, window ``k``): the ``k``-th batch it makes while
generating with ``v`` (k = 0, 1, 2, ...). The window's problems are a function of (run, worker key, task
size, ``v``, ``k``) and the run's ``[rl]``/``[run]`` settings, so the worker, each validator and the
trainer compute the same ones:

1. Each worker walks the task in its own order: a keyed pseudo-random permutation of the task's indexes
   (:class:`Permutation`, a Feistel network keyed by the run, task and worker, walked back into range),
   which the validators invert to find where a submitted problem sits.
2. The worker's order is cut into ``async_level + 1`` equal *regions*; version ``v`` draws from region
   ``v mod (async_level + 1)``. Any ``async_level + 1`` consecutive versions (the versions whose rollouts
   are still fresh at once) use different regions, so a problem is assigned to a worker at most once
   among them: it cannot make a problem's group under two fresh versions and submit the one it likes.
3. A region is cut into windows of ``problems_per_batch`` problems: window ``k`` of version ``v`` is the
   region's window ``c * windows_per_version + k`` (modulo the region's windows), where
   ``c = v // (async_level + 1)`` counts the times the region came round and ``windows_per_version`` is
   a few times what a worker submits per version (``roles/common/tasks.run_assignments``). Each time
   round starts past the windows of the last, so a worker goes through its whole region before a
   problem comes back. Every window of the region is valid at ``v`` (``k`` up to the region's windows):
   a trainer that finds no signal does not move on, and the workers must be able to keep feeding it new
   problems at the same version (with only ``windows_per_version`` of them, a run whose groups all had
   equal rewards stalled for good). Windows past the usual ones are what a worker that drops hard
   windows would reach for: :class:`Coverage` shows every window it skipped.
4. A batch holds exactly one window: all of its problems, each ``group_size`` times (checked by
   :meth:`Assignments.check`; a batch of another window, another version's problems or a subset is
   refused as ``not_assigned``).

Shortcut: a task smaller than ``(async_level + 1) * problems_per_batch`` problems has one region, so a
worker's problems recur at consecutive versions; a task smaller than ``problems_per_batch`` makes every
window the whole task. The assignment is public: anyone can compute any key's windows, so keys can be
made until one's windows hold problems the policy finds easy (docs/security.md, "Problem choice").

:class:`Coverage` counts, per worker, the windows it submitted and those it skipped (a window ``k`` of a
version never seen while a later one of the same version was): a worker that drops hard windows shows a
rate of assignments never submitted, which the validator and trainer report in their status.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from intellect_node.envs.tasks import Problem, Task, problem_index
from intellect_node.errors import ConfigError

DOMAIN = b"intellect/assignment/1\0"
ROUNDS = 6
"""Feistel rounds of the permutation: 4 already give a pseudo-random permutation for a keyed round
function (Luby-Rackoff); 6 for margin at the cost of a few microseconds a problem."""


class Permutation:
    """A keyed bijection of ``range(size)`` and its inverse (Feistel network over the smallest even
    number of bits that holds ``size``, cycle-walking values past ``size`` back into range: at most 4
    steps on average, since the network's domain is less than 4 * ``size``)."""

    def __init__(self, key: bytes, size: int) -> None:
        if size < 1:
            raise ValueError(f"a permutation of {size} elements")
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self._half = (bits + 1) // 2
        self._mask = (1 << self._half) - 1
        self._key = hashlib.blake2b(key, digest_size=32).digest()

    def _round(self, i: int, x: int) -> int:
        h = hashlib.blake2b(x.to_bytes(8, "big"), key=self._key, digest_size=8, person=bytes([i]) * 16)
        return int.from_bytes(h.digest(), "big") & self._mask

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for i in range(ROUNDS):
            left, right = right, left ^ self._round(i, right)
        return (left << self._half) | right

    def _decrypt(self, y: int) -> int:
        left, right = y >> self._half, y & self._mask
        for i in reversed(range(ROUNDS)):
            left, right = right ^ self._round(i, left), left
        return (left << self._half) | right

    def __call__(self, x: int) -> int:
        if not 0 <= x < self.size:
            raise ValueError(f"{x} outside 0..{self.size - 1}")
        y = self._encrypt(x)
        while y >= self.size:
            y = self._encrypt(y)
        return y

    def inverse(self, y: int) -> int:
        if not 0 <= y < self.size:
            raise ValueError(f"{y} outside 0..{self.size - 1}")
        x = self._decrypt(y)
        while x >= self.size:
            x = self._decrypt(x)
        return x


@dataclass(frozen=True)
class Layout:
    """How a worker's order of the task is cut (the module docstring's steps 2 and 3)."""

    size: int
    """Problems in the run's task."""
    per_window: int
    """Problems in a window: ``problems_per_batch``, or the whole task when it is smaller."""
    regions: int
    zone: int
    """Positions in a region."""
    slots: int
    """Windows a region holds (``zone // per_window``)."""
    windows: int
    """Windows a version has: all of its region's (``slots``)."""
    stride: int
    """Windows each time round moves on by: ``windows_per_version``, or fewer when a region holds fewer."""

    @classmethod
    def of(cls, size: int, *, problems_per_batch: int, async_level: int,
           windows_per_version: int) -> "Layout":
        if size < 1:
            raise ConfigError("the run's task has no problems", field="rl.task")
        per = min(problems_per_batch, size)
        regions = async_level + 1 if size >= (async_level + 1) * per else 1
        zone = size // regions
        slots = zone // per
        return cls(size=size, per_window=per, regions=regions, zone=zone, slots=slots, windows=slots,
                   stride=max(1, min(windows_per_version, slots)))

    def _first(self, version: int) -> int:
        """The region's window where ``version``'s windows start: past those of the versions before it
        that drew from the same region."""
        return (version // self.regions) * self.stride % self.slots

    def positions(self, version: int, window: int) -> range:
        """The positions (in the worker's order) of window ``window`` of ``version``."""
        if version < 0 or not 0 <= window < self.windows:
            raise ValueError(f"no window {window} at version {version} (0..{self.windows - 1})")
        w = (self._first(version) + window) % self.slots
        start = (version % self.regions) * self.zone + w * self.per_window
        return range(start, start + self.per_window)

    def locate(self, version: int, position: int) -> int | None:
        """The window of ``version`` holding ``position``, or None when no window of it does."""
        region, offset = divmod(position, self.zone)
        if version < 0 or region != version % self.regions:
            return None
        w = offset // self.per_window
        if w >= self.slots:
            return None
        k = (w - self._first(version)) % self.slots
        return k if k < self.windows else None


@runtime_checkable
class IndexedTask(Protocol):
    """A task that is a part of another (the offline filter's kept problems, ``envs.filtering``; the
    training or held-out part, ``envs.heldout``): its indexes are not the ones in its problem IDs."""

    def index_of(self, problem_id: str) -> int: ...


def task_index(task: Task, problem_id: str) -> int:
    """The index of ``problem_id`` in ``task`` (its position in a part of a task: the offline filter's,
    the held-out split's); ConfigError when it is not one of the task's problems."""
    if isinstance(task, IndexedTask):
        return task.index_of(problem_id)
    return problem_index(task.task_id, problem_id)


class Assignments:
    """The run's assignment rule over its task: what a worker must submit, and whether a batch is that."""

    def __init__(self, task: Task, run_id: str, *, problems_per_batch: int, async_level: int,
                 windows_per_version: int) -> None:
        self.task = task
        self.run_id = run_id
        self.layout = Layout.of(len(task), problems_per_batch=problems_per_batch, async_level=async_level,
                                windows_per_version=windows_per_version)

    def order(self, worker: str) -> Permutation:
        """``worker``'s order of the task: position -> task index."""
        key = DOMAIN + "\0".join((self.run_id, self.task.task_id, worker)).encode("utf-8")
        return Permutation(key, self.layout.size)

    def indexes(self, worker: str, version: int, window: int) -> list[int]:
        """The task indexes of ``worker``'s window ``window`` at ``version``, in order."""
        order = self.order(worker)
        return [order(q) for q in self.layout.positions(version, window)]

    def problems(self, worker: str, version: int, window: int) -> list[Problem]:
        """The problems ``worker`` must submit in its window ``window`` at ``version``."""
        return [self.task.problem(i) for i in self.indexes(worker, version, window)]

    def window_of(self, worker: str, version: int, problem_id: str) -> int | None:
        """The window of ``worker`` at ``version`` that holds ``problem_id``, or None."""
        try:
            index = task_index(self.task, problem_id)
        except ConfigError:
            return None
        if not 0 <= index < self.layout.size:
            return None
        return self.layout.locate(version, self.order(worker).inverse(index))

    def check(self, worker: str, version: int, problem_ids: Sequence[str], group_size: int) -> int | str:
        """The window a batch's records (their ``problem_ids`` in order, already in whole groups of
        ``group_size``) fill at ``version``, or why they are not ``worker``'s assignment."""
        distinct = list(dict.fromkeys(problem_ids))
        windows = {pid: self.window_of(worker, version, pid) for pid in distinct}
        outside = next((pid for pid, k in windows.items() if k is None), None)
        if outside is not None:
            return f"{outside} is not in the worker's assignment at v{version}"
        found = set(windows.values())
        if len(found) > 1:
            return f"problems of {len(found)} assignment windows at v{version} in one batch"
        (window,) = found
        want = self.layout.per_window
        if len(distinct) != want or len(problem_ids) != want * group_size:
            return (f"{len(distinct)} problems in {len(problem_ids) // max(group_size, 1)} groups; window "
                    f"{window} at v{version} is {want} problems, one group each")
        assert window is not None
        return window


class Coverage:
    """Per worker, the windows it submitted and skipped (see the module docstring), bounded: the latest
    ``workers`` workers, each with its latest ``versions`` versions in detail and the rest as totals."""

    def __init__(self, workers: int = 65536, versions: int = 8) -> None:
        self.workers = workers
        self.versions = versions
        self._by_worker: OrderedDict[str, tuple[list[int], OrderedDict[int, set[int]]]] = OrderedDict()

    def add(self, worker: str, version: int, window: int) -> None:
        """``worker`` submitted window ``window`` of ``version`` (again: counted once)."""
        if worker in self._by_worker:
            self._by_worker.move_to_end(worker)
        totals, recent = self._by_worker.setdefault(worker, ([0, 0], OrderedDict()))
        recent.setdefault(version, set()).add(window)
        while len(recent) > self.versions:  # the oldest version's counts become totals
            old = recent.pop(min(recent))
            totals[0] += len(old)
            totals[1] += max(old) + 1 - len(old)
        while len(self._by_worker) > self.workers:
            self._by_worker.popitem(last=False)

    def of(self, worker: str) -> dict[str, float | int]:
        """``submitted`` windows, ``skipped`` ones and the ``unsubmitted_rate`` (skipped over both)."""
        got = self._by_worker.get(worker)
        if got is None:
            return {"submitted": 0, "skipped": 0, "unsubmitted_rate": 0.0}
        totals, recent = got
        submitted = totals[0] + sum(len(s) for s in recent.values())
        skipped = totals[1] + sum(max(s) + 1 - len(s) for s in recent.values())
        return {"submitted": submitted, "skipped": skipped,
                "unsubmitted_rate": round(skipped / max(submitted + skipped, 1), 4)}

    def report(self, limit: int) -> dict[str, dict[str, float | int]]:
        """:meth:`of` for the latest ``limit`` workers."""
        return {w: self.of(w) for w in list(self._by_worker)[-limit:]}
