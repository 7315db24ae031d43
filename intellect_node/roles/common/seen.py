"""Each rollout is counted once: rollout keys and the per-version memory of them; and a bounded map.

A rollout's identity is (run, policy version, worker, problem, sample index) (the index is the k-th
occurrence of the problem in its batch, as ``proofs.sampling.batch_seeds`` numbers them), and, on the
side, its rollout ID. The same records under another blob name, in another batch or mixed with new ones
are the same rollouts: validators and the trainer refuse them (``duplicate``) whatever the batch CID.

Memory is bounded by version: a rollout older than ``async_level`` versions is refused as stale before
its keys are looked at, so the keys of such versions can go (:meth:`SeenRollouts.forget_below`). The
trainer journals its memory (``roles/trainer/admitted.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterable, Sequence, TypeVar

from intellect_node.config.status import clean_text
from intellect_node.protocol.rollout import RolloutRecord

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def rollout_keys(records: Sequence[RolloutRecord]) -> list[str]:
    """Two keys per record, both scoped to its worker: (run, worker, problem, sample index) and the
    rollout ID. The policy version is the caller's outer key."""
    index: dict[str, int] = {}
    out = []
    for r in records:
        k = index.get(r.problem_id, 0)
        index[r.problem_id] = k + 1
        out.append(f"s\0{r.run_id}\0{r.worker}\0{r.problem_id}\0{k}")
        out.append(f"i\0{r.worker}\0{r.rollout_id}")
    return out


def describe_key(key: str) -> str:
    """A key as a reader wants it in a refusal's detail (its IDs are the worker's: cleaned and cut)."""
    parts = key.split("\0")
    if parts[0] == "s" and len(parts) == 5:
        return f"sample {parts[4]} of {clean_text(parts[3], 80)}"
    if parts[0] == "i" and len(parts) == 3:
        return f"rollout ID {clean_text(parts[2], 80)}"
    return clean_text(repr(key), 120)


class SeenRollouts:
    """Rollout keys counted so far, per policy version."""

    def __init__(self) -> None:
        self._by_version: dict[int, set[str]] = {}

    def first_seen(self, version: int, keys: Iterable[str]) -> str | None:
        """The first of ``keys`` already counted at ``version``, or None."""
        have = self._by_version.get(version)
        if not have:
            return None
        return next((k for k in keys if k in have), None)

    def add(self, version: int, keys: Iterable[str]) -> None:
        self._by_version.setdefault(version, set()).update(keys)

    def discard(self, version: int, keys: Iterable[str]) -> None:
        have = self._by_version.get(version)
        if have is not None:
            have.difference_update(keys)
            if not have:
                del self._by_version[version]

    def forget_below(self, floor: int) -> list[int]:
        """Drop the keys of versions below ``floor``; returns the versions dropped."""
        gone = [v for v in self._by_version if v < floor]
        for v in gone:
            del self._by_version[v]
        return gone

    def versions(self) -> list[int]:
        return sorted(self._by_version)

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_version.values())


class BoundedMap(Generic[K, V]):
    """A dict that forgets its oldest entries past ``limit`` (what a peer can make us remember must be
    bounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._d: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        return self._d.get(key)

    def put(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)

    def pop(self, key: K) -> V | None:
        return self._d.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def items(self) -> list[tuple[K, V]]:
        return list(self._d.items())
