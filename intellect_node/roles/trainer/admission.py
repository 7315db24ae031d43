"""The trainer's admission of verified work and its choice of each step's batches, as a pure state machine.

No asyncio, no I/O, no clock: the trainer role (``roles/trainer/role.py``) feeds :class:`Admission`
verdicts and its policy version and acts on what it answers (fetching and persisting a batch, counting,
banning). That keeps the rules in one place where unit tests reach every case:

- **Quorum.** ``run.verdict_quorum`` distinct trusted validators must accept a batch; a rejection that
  comes first refuses it (:class:`VerdictTally`). Votes and decisions are per (worker, batch CID)
  (:func:`vote_key`): a verdict on a notice that named another worker's blob cannot decide that worker's
  batch.
- **Abstentions.** A rejection for a reason that is not the worker's fault
  (:data:`~intellect_node.protocol.rl.NOT_WORKERS_FAULT`: the validator lags, lacks the policy, or its
  checker timed out) decides nothing (``abstain``): the batch waits for another validator's verdict, or
  goes stale.
- **Bans.** A verdict's ``ban`` counts as one validator's vote to ban that worker (:class:`BanTally`);
  ``run.verdict_quorum`` distinct validators ban it, and never a ``protected`` peer (the run's trainer
  and validators). The caller counts only verdicts about a batch the worker itself announced.
- **Each batch decided once.** A decided batch (queued, consumed, refused) is ``known``; later verdicts
  on it are ignored. A batch whose admission failed (its blob could not be fetched) is forgotten again, so
  another validator's verdict can bring it back. What is known is kept for the versions still fresh
  (:meth:`Admission.forget_below`): a verdict on an older batch is refused as stale anyway.
- **Bounded staleness.** At policy version v the trainer trains only on rollouts generated with a version
  >= v - ``run.async_level`` (:func:`fresh_floor`; INTELLECT-2 uses 2); older accepted work is refused as
  stale, both when its verdict comes and when it has waited in the queue too long.
- **A step's batches** (:meth:`Admission.take`): whole batches holding at least ``rl.groups_per_step``
  fresh groups, newest policy first, from any workers; the trainer never waits for a particular one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

from intellect_node.protocol.rl import NOT_WORKERS_FAULT, BatchVerdict
from intellect_node.roles.trainer.batching import (
    Accepted,
    BanTally,
    Step,
    VerdictTally,
    fresh_floor,
    vote_key,
)

Decision = Literal["ignore", "not_allowed", "wait", "abstain", "refuse", "banned", "stale", "admit"]
"""What the trainer does with a verdict: nothing (``ignore``: decided before; ``wait``: short of the quorum;
``abstain``: the validator could not judge it; ``banned``: the worker is banned here), count a refusal
(``not_allowed``: a closed run's outsider; ``refuse``: a validator rejected it; ``stale``: too old), or
fetch and queue the batch (``admit``)."""



class Admission:
    """Which verified batches the trainer takes in and which form each step (see the module docstring)."""

    def __init__(self, *, quorum: int, async_level: int, groups_per_step: int,
                 allowed: frozenset[str] = frozenset(), protected: frozenset[str] = frozenset()) -> None:
        self.tally = VerdictTally(quorum)
        self.bans = BanTally(quorum, protected)
        self.async_level = async_level
        self.groups_per_step = groups_per_step
        self.allowed = allowed
        """A closed run's workers (``run.worker_allowlist``); empty: anyone."""
        self.queue: deque[Accepted] = deque()
        self.known: dict[str, int] = {}
        """:func:`vote_key` of the batches decided (queued, consumed or refused) -> their policy version."""

    def decide(self, verdict: BatchVerdict, validator: str, *, version: int, consumed: bool,
               banned: bool, raw: bytes = b"") -> Decision:
        """One trusted validator's verdict (``raw``: its sealed envelope), at policy ``version``.
        ``consumed``: the batch is in a checkpoint already; ``banned``: its worker is banned here. After
        ``admit`` the caller takes the quorum's envelopes (:meth:`evidence`), fetches the batch and reports
        :meth:`add`, :meth:`refused` (it was a duplicate) or :meth:`failed`."""
        key = vote_key(verdict.worker, verdict.batch_cid)
        v = verdict.policy_version
        if key in self.known or consumed:
            return "ignore"
        if self.allowed and verdict.worker not in self.allowed:
            self.known[key] = v
            return "not_allowed"
        if not verdict.accepted and verdict.reason in NOT_WORKERS_FAULT:
            return "abstain"  # this validator could not judge it: another one may
        if self.tally.vote(key, validator, verdict.accepted, v, raw) == "wait":
            return "wait"  # fewer than run.verdict_quorum validators have accepted it so far
        if not verdict.accepted:
            self.known[key] = v
            return "refuse"
        if banned:
            return "banned"
        self.known[key] = v
        if v < fresh_floor(version, self.async_level):
            self.tally.done(key)
            return "stale"
        return "admit"

    def evidence(self, worker: str, cid: str) -> tuple[bytes, ...]:
        """The sealed acceptances that admitted a batch (after ``admit``, before :meth:`add`)."""
        return self.tally.evidence(vote_key(worker, cid))

    def add(self, acc: Accepted) -> None:
        """Queue an admitted batch (after :meth:`decide`, or found in the inbox after a restart)."""
        key = vote_key(acc.worker, acc.cid)
        self.tally.done(key)
        self.known[key] = acc.version
        self.queue.append(acc)

    def refused(self, worker: str, cid: str) -> None:
        """An admitted batch turned out to be refused (it holds rollouts admitted before): decided."""
        self.tally.done(vote_key(worker, cid))

    def failed(self, worker: str, cid: str) -> None:
        """An admission that could not finish (the blob was unavailable): another verdict may retry it."""
        self.known.pop(vote_key(worker, cid), None)

    def forget_below(self, version: int) -> None:
        """The trainer is at policy ``version``: forget decisions and votes on batches now stale."""
        floor = fresh_floor(version, self.async_level)
        for key in [k for k, v in self.known.items() if v < floor]:
            del self.known[key]
        self.tally.forget_below(floor)

    def take(self, version: int) -> Step | None:
        """The next step's batches at policy ``version``, or None while fewer than ``groups_per_step``
        fresh groups are queued. Stale batches leave the queue with it.

        Newest first because workers run ahead of the trainer (``batches_per_version`` > 1): taking the
        oldest would train on rollouts ``async_level`` versions old every step, while the newest are at most
        a version behind. Older fresh batches stay queued and are used if nothing newer comes in time.
        """
        floor = fresh_floor(version, self.async_level)
        fresh = [a for a in self.queue if a.version >= floor]
        if sum(len(a.groups) for a in fresh) < self.groups_per_step:
            return None
        stale = [a for a in self.queue if a.version < floor]
        taken: list[Accepted] = []
        n = 0
        for a in sorted(fresh, key=lambda a: (-a.version, a.seq)):
            if n >= self.groups_per_step:
                break
            taken.append(a)
            n += len(a.groups)
        gone = {a.cid for a in taken} | {a.cid for a in stale}
        self.queue = deque(a for a in self.queue if a.cid not in gone)
        return Step(taken, stale)

    def take_named(self, taken: Sequence[str], stale: Sequence[str]) -> Step | None:
        """The batches a journaled step took (``roles/trainer/inbox.py``: replay after a restart), in that
        order; None, and the queue left as it was, when one of them is not queued (its inbox copy was
        lost)."""
        by_cid = {a.cid: a for a in self.queue}
        if any(c not in by_cid for c in (*taken, *stale)):
            return None
        gone = set(taken) | set(stale)
        self.queue = deque(a for a in self.queue if a.cid not in gone)
        return Step([by_cid[c] for c in taken], [by_cid[c] for c in stale])

    def queued_groups(self) -> int:
        return sum(len(a.groups) for a in self.queue)
