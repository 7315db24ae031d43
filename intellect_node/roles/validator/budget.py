"""The validator's scoring budgets: what re-scoring one batch, and one peer's batches, may cost.

Rewards are re-scored in scoring processes under ``rl.reward_timeout_s`` a call (``envs/sandbox.py``), and
a worker chooses its answers: distinct answers that are slow to score (``\\boxed{9^{9^{9^{8}}}}`` for
math-verify) each cost a validator the whole time limit and a process restart. So every batch is scored
under a :class:`~intellect_node.envs.sandbox.Meter` charged to its sender:

1. a batch of ``n`` rollouts may use ``n * scoring_s_per_rollout`` seconds of scoring plus room for
   ``scoring_timeouts_per_batch`` timeouts, and at most that many timeouts or crashes of the scoring
   process together (an honest answer times out rarely: ``reward_timeout_s`` is set far above what one
   needs; a crash's replacement process is started on the batch's time);
2. a peer's batches together may use ``peer_scoring_s_per_min`` (a token bucket holding
   :data:`PEER_BURST_MIN` minutes of it), so a key cannot keep a scoring process busy batch after batch;
3. what a batch used is taken from its sender's bucket when it has been scored.

Past either budget the rest of the batch is not scored and the verdict is ``scoring_budget``, held against
the worker (``rl.ban_after``). A pure state machine like ``intake.py``: no task, no clock (every call takes
``now``, monotonic seconds).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from intellect_node.envs.sandbox import Meter
from intellect_node.roles.validator.intake import MAX_PEERS, TokenBucket

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig

PEER_BURST_MIN = 10.0
"""Minutes of ``peer_scoring_s_per_min`` a peer's bucket holds (and starts with): one large honest batch
(1,024 math-verify answers at tens of ms each) fits at the default rate."""


@dataclass(frozen=True)
class ScoringRules:
    per_rollout_s: float = 0.5
    timeouts: int = 1
    timeout_s: float = 5.0
    peer_s_per_min: float = 30.0

    @classmethod
    def from_config(cls, cfg: NodeConfig) -> ScoringRules:
        vc = cfg.validator
        return cls(per_rollout_s=vc.scoring_s_per_rollout, timeouts=vc.scoring_timeouts_per_batch,
                   timeout_s=cfg.rl.reward_timeout_s, peer_s_per_min=vc.peer_scoring_s_per_min)

    def batch_s(self, n_rollouts: int) -> float:
        """Scoring seconds a batch of ``n_rollouts`` may use (before its sender's bucket is consulted)."""
        return n_rollouts * self.per_rollout_s + self.timeouts * self.timeout_s


class ScoringBudgets:
    """Per-peer scoring buckets and the meter each batch is scored under (see the module doc)."""

    def __init__(self, rules: ScoringRules) -> None:
        self.rules = rules
        self._peers: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently charged first
        self.refused = 0
        """Batches whose scoring stopped at a budget."""

    def meter(self, worker: str, n_rollouts: int, now: float) -> Meter:
        """The meter ``worker``'s batch of ``n_rollouts`` is scored under: the batch's allowance, or less
        when its sender's bucket holds less."""
        held = self._bucket(worker).available(now)
        return Meter(max(0.0, min(self.rules.batch_s(n_rollouts), held)), self.rules.timeouts)

    def charge(self, worker: str, meter: Meter, now: float) -> None:
        """Take what the batch used from its sender's bucket (it may go below zero: the next batch then
        waits for the refill, scored under a meter of 0 s, that is, not scored)."""
        self._bucket(worker).spend(meter.used_s, now)
        self._peers.move_to_end(worker)
        if meter.spent:
            self.refused += 1

    def _bucket(self, worker: str) -> TokenBucket:
        bucket = self._peers.get(worker)
        if bucket is None:
            while len(self._peers) >= MAX_PEERS:
                self._peers.popitem(last=False)  # a forgotten peer starts full again, like a new key
            rate = self.rules.peer_s_per_min / 60.0
            bucket = self._peers[worker] = TokenBucket(rate, rate * 60.0 * PEER_BURST_MIN)
        return bucket

    def status(self) -> dict[str, float | int]:
        return {"peers": len(self._peers), "refused": self.refused}
