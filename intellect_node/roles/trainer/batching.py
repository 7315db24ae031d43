"""The pieces of the trainer's admission (``roles/trainer/admission.py``): the per-batch vote key, the
freshness floor, the validators' verdict and ban tallies, and the accepted batches a step takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from intellect_node.trainer.step import Sample


def vote_key(worker: str, cid: str) -> str:
    """Votes and decisions are per (worker, batch)."""
    return f"{worker}/{cid}"


def fresh_floor(version: int, async_level: int) -> int:
    """The oldest policy version whose rollouts the trainer at ``version`` still trains on."""
    return version - async_level


class VerdictTally:
    """Votes of the trusted validators on each batch: ``quorum`` distinct acceptances admit it and a
    rejection that comes first refuses it. The caller decides each batch once and calls :meth:`done`
    after a successful admission (until then the votes stay, so a failed admission is retried on the next
    acceptance). Each acceptance's signed envelope is kept (:meth:`evidence`): the step record that takes
    the batch carries them. Bounded: beyond ``limit`` batches the oldest counts are forgotten."""

    def __init__(self, quorum: int, limit: int = 4096) -> None:
        self.quorum = quorum
        self.limit = limit
        # key -> (policy version, acceptor -> its sealed verdict, first kept)
        self._votes: dict[str, tuple[int, dict[str, bytes]]] = {}

    def vote(self, cid: str, validator: str, accepted: bool, version: int = 0, raw: bytes = b"") -> str:
        """"admit" (the quorum-th distinct acceptance), "refuse" (a rejection) or "wait". ``raw``: the
        verdict's sealed envelope, as gossiped."""
        if not accepted:
            self._votes.pop(cid, None)
            return "refuse"
        _, votes = self._votes.setdefault(cid, (version, {}))
        votes.setdefault(validator, raw)
        while len(self._votes) > self.limit:
            del self._votes[next(iter(self._votes))]
        return "admit" if len(votes) >= self.quorum else "wait"

    def evidence(self, cid: str) -> tuple[bytes, ...]:
        """The sealed acceptances that made the quorum (the first ``quorum`` distinct validators')."""
        _, votes = self._votes.get(cid, (0, {}))
        return tuple(votes.values())[:self.quorum]

    def done(self, cid: str) -> None:
        self._votes.pop(cid, None)

    def forget_below(self, floor: int) -> None:
        """Batches of versions below ``floor`` are stale: their votes can go."""
        for key in [k for k, (v, _) in self._votes.items() if v < floor]:
            del self._votes[key]

    def __len__(self) -> int:
        """Batches with some acceptances but not yet a decision."""
        return len(self._votes)


class BanTally:
    """Validators' votes to ban a worker: ``quorum`` distinct validators ban it; a ``protected`` peer
    (the run's trainer and validators) never. Bounded: beyond ``limit`` workers the oldest votes go."""

    def __init__(self, quorum: int, protected: frozenset[str] = frozenset(), limit: int = 4096) -> None:
        self.quorum = quorum
        self.protected = protected
        self.limit = limit
        self._votes: dict[str, set[str]] = {}

    def vote(self, worker: str, validator: str) -> bool:
        """Count ``validator``'s ban of ``worker``; True when the quorum is reached (the caller bans)."""
        if worker in self.protected:
            return False
        votes = self._votes.setdefault(worker, set())
        votes.add(validator)
        while len(self._votes) > self.limit:
            del self._votes[next(iter(self._votes))]
        if len(votes) < self.quorum:
            return False
        del self._votes[worker]
        return True


@dataclass
class Accepted:
    """An accepted batch waiting to be trained on (its samples carry recomputed rewards)."""

    cid: str
    worker: str
    version: int
    groups: list[list[Sample]]
    seq: int
    """Arrival order (persisted with the batch, so a restarted trainer queues in the same order)."""
    evidence: tuple[bytes, ...] = ()
    """The sealed accepting verdicts that admitted it (persisted with the batch; its step record's)."""


@dataclass(frozen=True)
class Step:
    """The batches one step trains on, and the queued ones refused as stale on the way."""

    taken: list[Accepted]
    stale: list[Accepted]
