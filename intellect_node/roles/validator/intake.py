"""The validator's intake: which rollout notices it works on, in what order, and which it refuses.

A notice costs its sender one signature and costs a validator a fetch, a decode and the tensor checks,
so the intake bounds what one peer can impose (docs/security.md):

- **rate and budget**: a token bucket per peer on notices and one on announced batch bytes; a notice
  over either is refused (``flood``);
- **queue**: at most ``peer_queue`` notices of one peer wait; more are refused (``busy``).

  Neither is a strike: an honest worker of a small model on a fast machine sends a notice a second or
  more, and a validator that falls behind (a loaded machine) must not ban the workers it is slow for.
  The refusal drops the notice cheaply, which is all a flood can buy; what a sender cannot back (an
  unavailable blob, a version from the future) is what counts against it.
- **concurrency**: one batch of a peer in flight at a time; peers are served round-robin, so a peer with
  a full queue waits its turn like everyone else;
- **versions**: a notice for a policy version more than ``max_versions_ahead`` past the newest announced
  one is refused (``future``); a nearer one waits at the head of its sender's queue for that version
  (parked: other peers go on) and expires after ``policy_wait_s``;
- **new identities**: keys are free, so peers never seen before are admitted at ``new_workers_per_min``
  (a burst of ``new_worker_burst``); up to ``newcomer_wait`` more wait their turn and the rest are
  refused (``newcomer_limit``).

This is a pure state machine in the style of prime-rl's schedulers: it owns no task and reads no clock
(every call takes ``now``, monotonic seconds), so tests drive it step by step. The validator turns its
answers into jobs, verdicts and charges against peers.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

from intellect_node.protocol.rl import RolloutNotice

if TYPE_CHECKING:
    from intellect_node.config import ValidatorConfig

MAX_PEERS = 4096
"""Peers whose buckets and queues are kept; past it an idle one is forgotten (keys are free to make, so
nothing per peer may grow without bound)."""
MAX_KNOWN = 65536
"""Peers remembered as already admitted (not new identities); the oldest is forgotten past it."""


class Refusal(NamedTuple):
    """Why a notice is not taken. ``strike``: it counts against the sender (it asked for work it had
    no right to); otherwise it is recorded but not held against it (too many newcomers at once)."""

    reason: str
    detail: str
    strike: bool


@dataclass(frozen=True)
class Limits:
    peer_queue: int = 4
    notices_per_s: float = 1.0
    notice_burst: float = 8.0
    bytes_per_s: float = float(1 << 20)
    bytes_burst: float = float(64 << 20)
    new_per_s: float = 0.1
    new_burst: float = 8.0
    newcomer_wait: int = 16
    max_ahead: int = 2
    park_s: float = 30.0

    @classmethod
    def from_config(cls, vc: ValidatorConfig, *, max_batch_bytes: int) -> Limits:
        """From a ``ValidatorConfig``; the bytes bucket always holds one largest batch."""
        return cls(peer_queue=vc.peer_queue, notices_per_s=vc.peer_notices_per_min / 60.0,
                   notice_burst=float(vc.peer_notice_burst), bytes_per_s=float(vc.peer_bytes_per_s),
                   bytes_burst=float(max_batch_bytes), new_per_s=vc.new_workers_per_min / 60.0,
                   new_burst=float(vc.new_worker_burst), newcomer_wait=vc.newcomer_wait,
                   max_ahead=vc.max_versions_ahead, park_s=vc.policy_wait_s)


@dataclass
class TokenBucket:
    """``rate`` tokens a second up to ``burst``; starts full."""

    rate: float
    burst: float
    tokens: float = math.nan
    at: float = math.nan

    def _refill(self, now: float) -> None:
        if math.isnan(self.tokens):
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now

    def take(self, n: float, now: float) -> bool:
        self._refill(now)
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def available(self, now: float) -> float:
        """Tokens there now (below zero after a :meth:`spend` of more than there was)."""
        self._refill(now)
        return self.tokens

    def spend(self, n: float, now: float) -> None:
        """Take ``n`` whatever is there (a cost known only afterwards)."""
        self._refill(now)
        self.tokens -= n

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (0 if they are)."""
        self._refill(now)
        return max(0.0, (n - self.tokens) / self.rate)


@dataclass
class Pending:
    """A notice taken in: who sent it and when it arrived (verdict latency is measured from here)."""

    notice: RolloutNotice
    worker: str
    arrived: float
    parked_since: float | None = None


@dataclass
class _Peer:
    notices: TokenBucket
    bytes: TokenBucket
    queue: deque[Pending] = field(default_factory=deque)
    busy: bool = False
    waiting: bool = False  # a new identity waiting for a slot under the new-identity rate


class Intake:
    """Per-peer queues, budgets and round-robin dispatch of rollout notices (see the module doc)."""

    def __init__(self, limits: Limits, *, exempt: frozenset[str] = frozenset()) -> None:
        self.limits = limits
        self.exempt = exempt
        """Peers never treated as new identities (the run's worker allowlist)."""
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # order = round-robin order
        self._known: OrderedDict[str, None] = OrderedDict()
        self._newcomers: deque[str] = deque()
        self._new = TokenBucket(limits.new_per_s, limits.new_burst)
        self.refused: dict[str, int] = {}
        """Notices refused so far, by reason."""

    # -- taking notices in ---------------------------------------------------------------------------

    def offer(self, worker: str, notice: RolloutNotice, now: float, newest: int) -> Refusal | None:
        """Queue ``notice`` from ``worker`` or say why not. ``newest``: the newest policy version
        announced so far (-1 when none was heard yet: then nothing is "from the future")."""
        lim = self.limits
        if newest >= 0 and notice.policy_version > newest + lim.max_ahead:
            return self._refuse("future", f"policy v{notice.policy_version} while the newest announced is "
                                          f"v{newest} (at most {lim.max_ahead} ahead)", True)
        peer = self._peer(worker)
        if not peer.notices.take(1, now):
            return self._refuse("flood", f"over {lim.notices_per_s * 60:.0f} notices a minute", False)
        if not peer.bytes.take(notice.batch_bytes, now):
            return self._refuse("flood", f"over {lim.bytes_per_s:.0f} announced bytes a second", False)
        if len(peer.queue) >= lim.peer_queue:
            return self._refuse("busy", f"{len(peer.queue)} notices already waiting", False)
        if not peer.waiting and worker not in self._known and worker not in self.exempt:
            if not self._newcomers and self._new.take(1, now):  # first come, first served
                self._know(worker)
            elif len(self._newcomers) < lim.newcomer_wait:
                peer.waiting = True
                self._newcomers.append(worker)
            else:
                return self._refuse("newcomer_limit", f"{len(self._newcomers)} new peers already wait; "
                                                      f"{lim.new_per_s * 60:.1f} start a minute", False)
        peer.queue.append(Pending(notice, worker, now))
        return None

    def _refuse(self, reason: str, detail: str, strike: bool) -> Refusal:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return Refusal(reason, detail, strike)

    def _peer(self, worker: str) -> _Peer:
        peer = self._peers.get(worker)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self._evict()
            lim = self.limits
            peer = self._peers[worker] = _Peer(TokenBucket(lim.notices_per_s, lim.notice_burst),
                                               TokenBucket(lim.bytes_per_s, lim.bytes_burst))
        return peer

    def _evict(self) -> None:
        for w, p in self._peers.items():
            if not p.queue and not p.busy and not p.waiting:
                del self._peers[w]
                return
        # Every peer has work queued (MAX_PEERS of them): the newcomer limit stops this growing further.

    def _know(self, worker: str) -> None:
        self._known[worker] = None
        self._known.move_to_end(worker)
        while len(self._known) > MAX_KNOWN:
            self._known.popitem(last=False)

    # -- dispatch ------------------------------------------------------------------------------------

    def take(self, now: float, ready: Callable[[int], bool], grant: Callable[[str], bool]) -> list[Pending]:
        """Notices to work on now, at most one per peer and none of a busy peer, in round-robin order.
        ``ready(version)`` says whether a notice of that version can be decided now (else it stays parked
        at the head of its sender's queue); ``grant(worker)`` whether a job slot is free for that peer
        (the caller's pools, taken when it says yes). The caller calls :meth:`done` after each job."""
        self._admit_newcomers(now)
        out: list[Pending] = []
        served: list[str] = []
        for worker, peer in self._peers.items():
            if peer.busy or peer.waiting or not peer.queue:
                continue
            head = peer.queue[0]
            if not ready(head.notice.policy_version):
                if head.parked_since is None:
                    head.parked_since = now
                continue
            if not grant(worker):
                continue
            peer.queue.popleft()
            peer.busy = True
            out.append(head)
            served.append(worker)
        for worker in served:  # served peers go to the back of the round
            self._peers.move_to_end(worker)
        return out

    def _admit_newcomers(self, now: float) -> None:
        while self._newcomers:
            worker = self._newcomers[0]
            peer = self._peers.get(worker)
            if peer is None or not peer.waiting:  # forgotten meanwhile
                self._newcomers.popleft()
                continue
            if not self._new.take(1, now):
                return
            self._newcomers.popleft()
            peer.waiting = False
            self._know(worker)

    def done(self, worker: str) -> None:
        """The job for ``worker``'s notice has finished: its next notice may go."""
        peer = self._peers.get(worker)
        if peer is not None:
            peer.busy = False

    def expired(self, now: float) -> list[Pending]:
        """Parked notices that waited ``park_s`` for their version: removed; the caller gives each a
        verdict."""
        out = []
        for peer in self._peers.values():
            head = peer.queue[0] if peer.queue else None
            if head is not None and not peer.busy and head.parked_since is not None \
                    and now - head.parked_since >= self.limits.park_s:
                out.append(peer.queue.popleft())
        return out

    def next_event(self, now: float) -> float | None:
        """Seconds until time alone changes what :meth:`take`/:meth:`expired` return (a newcomer's slot,
        a parked notice's expiry); None when only a new notice, a finished job or a new policy can."""
        waits: list[float] = []
        if self._newcomers:
            waits.append(self._new.wait_s(1, now))
        for peer in self._peers.values():
            head = peer.queue[0] if peer.queue else None
            if head is not None and head.parked_since is not None:
                waits.append(max(0.0, head.parked_since + self.limits.park_s - now))
        return min(waits) if waits else None

    def forget(self, worker: str) -> int:
        """Drop ``worker``'s waiting notices (it was banned); returns how many."""
        peer = self._peers.get(worker)
        if peer is None:
            return 0
        n = len(peer.queue)
        peer.queue.clear()
        return n

    # -- status --------------------------------------------------------------------------------------

    def queued(self) -> int:
        return sum(len(p.queue) for p in self._peers.values())

    def status(self) -> dict[str, object]:
        return {"queued": self.queued(), "in_flight": sum(p.busy for p in self._peers.values()),
                "peers": len(self._peers), "newcomers_waiting": len(self._newcomers),
                "parked": sum(1 for p in self._peers.values()
                              if p.queue and p.queue[0].parked_since is not None),
                "refused": dict(self.refused)}
