"""What a node knows about other peers: liveness, HTTP URLs, rejections, bans, remembered addresses.

Shared by the trio thread (gossip validators record rejections, the connection notifee marks peers
connected) and the asyncio side (roles, status), so every method takes one lock and none blocks.

Liveness: a peer is ``alive`` while its last heartbeat is younger than its timeout: ``peer_timeout``,
or longer for a peer that announced a stretched heartbeat interval (``heard(..., timeout=)``, set by
``p2p/heartbeat.py``); the runtime's sweep marks it ``gone`` after that (a peer frozen with SIGSTOP
stays "connected" at the libp2p level but stops heartbeating, so heartbeats, not connections, decide).
Remembered peers (``peers.json``) are the listen addresses of peers we were connected to, most recent
first, capped at :data:`MAX_REMEMBERED`, written atomically and at most every :data:`SAVE_INTERVAL_S`.

Bans are kept in the same file (``banned``: peer, reason, when), so a restart does not hand a cheater a
clean slate: a validator's verdict or a trainer's ban cost the swarm evidence to reach. They last
:data:`BAN_KEPT_S` from the ban (peer IDs are free to make, so a ban is mostly worth the days after it,
and an honest peer banned automatically by mistake comes back by itself); the newest :data:`MAX_BANS_KEPT`
are written. ``intellect-node peers bans`` lists them and ``peers unban`` lifts one while the node is
stopped.

The peers the run names for a role (``run_peers``: its trainer, validators and auditors) are never banned
automatically: their rejections are counted and shown, but a count is not proof (a replay, a bug, an
honest disagreement can raise it), and banning one of them would stop the run on this node. Their faults
are the run's own rules to judge: audits for the trainer, the quorum for validators; an explicit
:meth:`ban` still holds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from intellect_node.fsutil import atomic_write_text

log = logging.getLogger(__name__)

PEERS_FILE = "peers.json"
MAX_REMEMBERED = 64
MAX_PEERS = 4096
"""Peer records kept in memory; past it an idle record is forgotten: the longest-silent one without
rejections first (its rejection count is kept in :data:`MAX_STRIKES_KEPT` entries apart), then the
oldest ban."""
MAX_BANNED = 2048
"""Banned records kept in memory; past it the oldest ban is forgotten (the newest
:data:`MAX_BANS_KEPT` are also what ``peers.json`` keeps)."""
MAX_STRIKES_KEPT = 16384
"""Rejection counts of forgotten records, so that evicting a record does not reset its count toward
the automatic ban (4096 fresh keys would otherwise wipe every count): the oldest entries go first."""
STRIKE_HALF_LIFE_S = 3600.0
"""A forgotten record's rejection count halves every hour until the peer comes back."""
MAX_CONN_IPS = 4
"""Addresses a peer's connections came from, kept per peer (blob fetches may only go there)."""
MAX_REASONS = 16
"""Recent rejection reasons kept per peer (the count keeps growing)."""
AUTO_BAN_AFTER = 100
"""Rejections after which a peer is banned automatically; honest peers reach a handful at most (a
message that arrives after our clock moved past a deadline, say), a hostile one reaches it fast."""
SAVE_INTERVAL_S = 5.0
BAN_KEPT_S = 7 * 24 * 3600.0
"""A persisted ban is forgotten at the first start this long after it."""
MAX_BANS_KEPT = 1024
REFRESH_S = 600.0
"""A remembered peer's "last seen" is refreshed (and the file rewritten) at most this often."""


@dataclass
class PeerRecord:
    peer_id: str
    connected: bool = False
    state: str = "unknown"  # unknown | alive | gone
    last_heartbeat: float | None = None  # time.monotonic()
    timeout: float | None = None  # seconds of silence before gone; None: the book's peer_timeout
    http_url: str = ""
    addrs: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    rejections: int = 0
    reasons: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_REASONS))
    banned: str | None = None
    banned_at: float | None = None  # unix time
    conn_ips: list[str] = field(default_factory=list)  # where its connections came from, newest last
    had_connection: bool = False

    def snapshot(self, now: float) -> PeerSnapshot:
        return {
            "peer_id": self.peer_id, "connected": self.connected, "state": self.state,
            "last_heartbeat_age_s": (None if self.last_heartbeat is None
                                     else round(now - self.last_heartbeat, 3)),
            "timeout_s": self.timeout, "http_url": self.http_url, "roles": list(self.roles),
            "rejections": self.rejections,
            "last_rejection": self.reasons[-1] if self.reasons else None, "banned": self.banned,
        }


class PeerSnapshot(TypedDict):
    """One peer as ``GET /v1/status`` lists it (``known_peers``)."""

    peer_id: str
    connected: bool
    state: str
    """unknown, alive or gone."""
    last_heartbeat_age_s: float | None
    timeout_s: float | None
    http_url: str
    roles: list[str]
    rejections: int
    last_rejection: str | None
    banned: str | None


class Ban(TypedDict):
    """A banned peer (:meth:`PeerBook.bans`): why, and when (unix time; None in a book written before
    ban times were kept)."""

    peer_id: str
    reason: str
    at: float | None


class PeerBook:
    """Thread-safe per-peer records. ``data_dir`` (optional) is where ``peers.json`` lives."""

    def __init__(self, self_id: str, data_dir: Path | None = None, *, peer_timeout: float = 15.0,
                 auto_ban_after: int | None = AUTO_BAN_AFTER,
                 run_peers: frozenset[str] = frozenset()) -> None:
        self.self_id = self_id
        self.peer_timeout = peer_timeout
        self.auto_ban_after = auto_ban_after
        self.run_peers = run_peers
        """Never banned automatically (the run's trainer, validators and auditors; module docstring)."""
        self._path = data_dir / PEERS_FILE if data_dir is not None else None
        self._lock = threading.Lock()
        self._peers: dict[str, PeerRecord] = {}
        self._remembered: dict[str, tuple[list[str], float]] = {}  # peer -> (addrs, unix time)
        self._strikes: OrderedDict[str, tuple[float, float]] = OrderedDict()  # evicted: (count, when)
        self._dirty = False
        self._last_save = 0.0
        self.on_auto_ban: Callable[[str], None] | None = None
        """Called (on the thread that recorded the last rejection) when a peer is banned automatically."""
        self._load()

    def _rec(self, peer_id: str) -> PeerRecord:
        rec = self._peers.get(peer_id)
        if rec is None:
            if len(self._peers) >= MAX_PEERS:
                self._evict()
            rec = self._peers[peer_id] = PeerRecord(peer_id)
            kept = self._strikes.pop(peer_id, None)
            if kept is not None:  # a peer evicted with rejections: its count comes back, decayed
                count, when = kept
                rec.rejections = int(count * 0.5 ** (max(0.0, time.time() - when) / STRIKE_HALF_LIFE_S))
        return rec

    def _evict(self) -> None:
        """Forget one record (peer IDs are free to make, so a flood of them must not grow memory without
        bound): the longest-silent idle record without rejections, else the longest-silent idle one
        with rejections (its count is kept apart, :data:`MAX_STRIKES_KEPT`), else the oldest ban."""
        idle = [r for r in self._peers.values() if not r.connected and r.banned is None]
        if idle:
            victim = min(idle, key=lambda r: (r.rejections > 0, r.last_heartbeat or 0.0))
            if victim.rejections:
                self._strikes[victim.peer_id] = (float(victim.rejections), time.time())
                while len(self._strikes) > MAX_STRIKES_KEPT:
                    self._strikes.popitem(last=False)
            del self._peers[victim.peer_id]
            return
        self._drop_oldest_ban()

    def _drop_oldest_ban(self) -> None:
        banned = [r for r in self._peers.values() if r.banned is not None and not r.connected]
        if banned:
            victim = min(banned, key=lambda r: r.banned_at or 0.0)
            log.info("forgetting the ban of %s (%s): more than %d banned peers", victim.peer_id,
                     victim.banned, MAX_BANNED)
            del self._peers[victim.peer_id]
            self._dirty = True

    # -- liveness ----------------------------------------------------------------------------------

    def set_connected(self, peer_id: str, connected: bool, *, remote_ip: str | None = None) -> None:
        """Mark ``peer_id`` (dis)connected; ``remote_ip``: the address its new connection came from."""
        with self._lock:
            rec = self._rec(peer_id)
            rec.connected = connected
            if connected:
                rec.had_connection = True
            if remote_ip:
                if remote_ip in rec.conn_ips:
                    rec.conn_ips.remove(remote_ip)
                rec.conn_ips.append(remote_ip)
                del rec.conn_ips[:-MAX_CONN_IPS]

    def addresses(self, peer_id: str) -> tuple[list[str], list[str]]:
        """``(connected, announced)``: the IPs ``peer_id``'s connections came from, and the IPs of the
        listen addresses it signed (``/ip4/`` and ``/ip6/`` ones)."""
        with self._lock:
            rec = self._peers.get(peer_id)
            if rec is None:
                return [], []
            announced = []
            for a in rec.addrs:
                parts = a.split("/")
                if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "p2p-circuit" not in parts:
                    announced.append(parts[2])
            return list(rec.conn_ips), announced

    def announced_addrs(self, peer_id: str) -> list[str]:
        """The listen addresses ``peer_id`` signed (its newest heartbeat or node info)."""
        with self._lock:
            rec = self._peers.get(peer_id)
            return list(rec.addrs) if rec is not None else []

    def heard(self, peer_id: str, *, http_url: str = "", addrs: list[str] | None = None,
              roles: list[str] | None = None, timeout: float | None = None) -> bool:
        """Record a verified heartbeat; True if the peer was not alive before (new or back).
        ``timeout``: how long this peer may now stay silent before it is gone (None: ``peer_timeout``);
        every heartbeat sets it afresh, so a peer that stops stretching is timed by the default again."""
        with self._lock:
            rec = self._rec(peer_id)
            was = rec.state
            rec.state, rec.last_heartbeat, rec.timeout = "alive", time.monotonic(), timeout
            if http_url:
                rec.http_url = http_url
            if addrs:
                rec.addrs = list(addrs)
            if roles is not None:
                rec.roles = list(roles)
            return was != "alive"

    def sweep(self, now: float | None = None) -> list[str]:
        """Mark peers whose last heartbeat is older than their timeout as gone; return them."""
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for rec in self._peers.values():
                timeout = self.peer_timeout if rec.timeout is None else rec.timeout
                if rec.state == "alive" and rec.last_heartbeat is not None \
                        and now - rec.last_heartbeat > timeout:
                    rec.state = "gone"
                    gone.append(rec.peer_id)
        return gone

    def state(self, peer_id: str) -> str:
        with self._lock:
            rec = self._peers.get(peer_id)
            return rec.state if rec else "unknown"

    def alive_peers(self) -> list[str]:
        with self._lock:
            return sorted(p for p, r in self._peers.items() if r.state == "alive")

    def count_alive(self, *, without_roles: frozenset[str] = frozenset()) -> int:
        """Alive peers, leaving out those announcing any of ``without_roles`` (no list built: this runs
        before every heartbeat, in a book of up to :data:`MAX_PEERS` records)."""
        with self._lock:
            return sum(1 for r in self._peers.values()
                       if r.state == "alive" and not without_roles.intersection(r.roles))

    def set_info(self, peer_id: str, *, http_url: str, addrs: list[str], roles: list[str]) -> None:
        with self._lock:
            rec = self._rec(peer_id)
            rec.http_url, rec.addrs, rec.roles = http_url, list(addrs), list(roles)

    def addrs(self, peer_id: str) -> list[str]:
        """The peer's listen addresses as it signed them (heartbeat, node info), else as remembered."""
        with self._lock:
            rec = self._peers.get(peer_id)
            if rec is not None and rec.addrs:
                return list(rec.addrs)
            kept = self._remembered.get(peer_id)
            return list(kept[0]) if kept else []

    def http_url(self, peer_id: str) -> str:
        with self._lock:
            rec = self._peers.get(peer_id)
            return rec.http_url if rec else ""

    # -- misbehaviour --------------------------------------------------------------------------------

    def record_rejection(self, peer_id: str, reason: str, *, counts: bool = True) -> int:
        """Record why input from ``peer_id`` was refused; returns the peer's rejection count.
        ``counts=False``: keep the reason but do not count it toward the automatic ban (a refusal
        that an honest peer can meet, e.g. a validator too busy to queue its notice)."""
        auto_ban = False
        with self._lock:
            rec = self._rec(peer_id)
            rec.rejections += counts
            rec.reasons.append(reason[:200])
            count = rec.rejections
            if self.auto_ban_after is not None and count >= self.auto_ban_after and rec.banned is None \
                    and peer_id not in self.run_peers:
                rec.banned, rec.banned_at = f"auto: {count} rejections, last: {reason[:120]}", time.time()
                self._dirty = auto_ban = True
                self._bound_bans()
        log.info("rejected input from %s: %s", peer_id, reason[:200])
        if auto_ban:
            log.warning("banned %s after %d rejections", peer_id, count)
            if self.on_auto_ban is not None:
                self.on_auto_ban(peer_id)
        return count

    def rejections(self, peer_id: str) -> tuple[int, list[str]]:
        with self._lock:
            rec = self._peers.get(peer_id)
            return (rec.rejections, list(rec.reasons)) if rec else (0, [])

    def ban(self, peer_id: str, reason: str) -> None:
        with self._lock:
            rec = self._rec(peer_id)
            rec.banned, rec.banned_at = reason[:200] or "banned", time.time()
            self._remembered.pop(peer_id, None)
            self._dirty = True
            self._bound_bans()
        log.warning("banned %s: %s", peer_id, reason[:200])

    def _bound_bans(self) -> None:
        """At most :data:`MAX_BANNED` banned records (a key is free: bans must not grow memory forever)."""
        if sum(1 for r in self._peers.values() if r.banned is not None) > MAX_BANNED:
            self._drop_oldest_ban()

    def unban(self, peer_id: str) -> bool:
        """Lift a ban (its rejection count starts again); False when the peer was not banned."""
        with self._lock:
            rec = self._peers.get(peer_id)
            if rec is None or rec.banned is None:
                return False
            rec.banned, rec.banned_at, rec.rejections = None, None, 0
            self._dirty = True
        log.warning("unbanned %s", peer_id)
        return True

    def bans(self) -> list[Ban]:
        """Banned peers, newest ban first: ``peer_id``, ``reason``, ``at`` (unix time)."""
        with self._lock:
            out: list[Ban] = [{"peer_id": r.peer_id, "reason": r.banned, "at": r.banned_at}
                              for r in self._peers.values() if r.banned is not None]
        return sorted(out, key=lambda b: -(b["at"] or 0.0))

    def is_banned(self, peer_id: str) -> bool:
        with self._lock:
            rec = self._peers.get(peer_id)
            return rec is not None and rec.banned is not None

    # -- remembered peers ------------------------------------------------------------------------------

    def remember(self, peer_id: str, addrs: list[str], *, if_connected: bool = False) -> None:
        """Note ``peer_id``'s listen addresses (in memory; :meth:`save` writes them, off the event loops:
        an fsync took 40+ ms on a busy disk). ``if_connected``: only if this node had a connection with
        it (a heartbeat reaches us from any key through gossip: Sybils must not fill the list a
        restarted node dials)."""
        if peer_id == self.self_id or not addrs:
            return
        now = time.time()
        with self._lock:
            rec = self._peers.get(peer_id)
            if rec is not None and rec.banned:
                return
            if if_connected and (rec is None or not rec.had_connection):
                return
            old = self._remembered.get(peer_id)
            addrs = list(addrs)[:8]
            if old is not None and old[0] == addrs and now - old[1] < REFRESH_S:
                return  # unchanged: no rewrite for every heartbeat
            self._remembered[peer_id] = (addrs, now)
            if len(self._remembered) > MAX_REMEMBERED:
                oldest = min(self._remembered, key=lambda p: self._remembered[p][1])
                del self._remembered[oldest]
            self._dirty = True

    def remembered(self) -> list[tuple[str, list[str]]]:
        """Remembered peers, most recently seen first."""
        with self._lock:
            items = sorted(self._remembered.items(), key=lambda kv: -kv[1][1])
            return [(p, list(a)) for p, (a, _t) in items]

    def save(self, force: bool = False) -> None:
        if self._path is None:
            return
        with self._lock:
            if not self._dirty or (not force and time.monotonic() - self._last_save < SAVE_INTERVAL_S):
                return
            banned = sorted((r for r in self._peers.values() if r.banned is not None),
                            key=lambda r: -(r.banned_at or 0.0))[:MAX_BANS_KEPT]
            doc = {"version": 1, "peers": [{"peer_id": p, "addrs": a, "last_seen": round(t, 3)}
                                           for p, (a, t) in self._remembered.items()],
                   "banned": [{"peer_id": r.peer_id, "reason": r.banned,
                               "at": round(r.banned_at or time.time(), 3)} for r in banned]}
            self._dirty, self._last_save = False, time.monotonic()
        try:
            atomic_write_text(self._path, json.dumps(doc, indent=1) + "\n", mode=0o600)
        except OSError as exc:  # a full disk must not take the node down; try again next time
            log.warning("cannot write %s: %s", self._path, exc)
            with self._lock:
                self._dirty = True

    def _load(self) -> None:
        if self._path is None or not self._path.exists():
            return
        try:
            doc = json.loads(self._path.read_text())
            for item in doc["peers"][:MAX_REMEMBERED]:
                peer, addrs, t = item["peer_id"], item["addrs"], float(item["last_seen"])
                if (isinstance(peer, str) and isinstance(addrs, list)
                        and all(isinstance(a, str) for a in addrs)):
                    self._remembered[peer] = (addrs[:8], t)
            now = time.time()
            for item in doc.get("banned", [])[:MAX_BANS_KEPT]:
                peer, reason, at = item["peer_id"], item["reason"], float(item["at"])
                if isinstance(peer, str) and isinstance(reason, str) and now - at < BAN_KEPT_S:
                    rec = self._rec(peer)
                    rec.banned, rec.banned_at = reason[:200] or "banned", at
                    self._remembered.pop(peer, None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Our own cache file; a damaged one only costs the remembered peers.
            log.warning("ignoring unreadable %s: %s", self._path, exc)

    # -- status ------------------------------------------------------------------------------------------

    def snapshot(self) -> list[PeerSnapshot]:
        now = time.monotonic()
        with self._lock:
            return [r.snapshot(now) for r in sorted(self._peers.values(), key=lambda r: r.peer_id)]
