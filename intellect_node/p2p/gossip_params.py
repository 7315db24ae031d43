"""Gossipsub settings for swarms of hundreds: mesh degrees, message cache, peer scoring.

Everything here is local policy: none of it changes what goes on the wire, so meshsub 1.1/1.2 peers
with other settings (go-libp2p, rust-libp2p, older nodes of ours) interoperate unchanged.

Mesh (go-libp2p-pubsub's defaults, which its authors sized for swarms of thousands): each node keeps
``D`` = 6 full-message peers per topic, between ``D_LOW`` and ``D_HIGH``; a message reaches N nodes in
about log_6(N) hops (4 hops at 1,000 nodes), and a node forwards each message to at most ``D_HIGH``
peers whatever N is. ``D_LOW`` is 4 rather than go's 5: our connection manager keeps as few as
``network.conn_low`` connections, and a smaller swarm (a handful of nodes) should not be forever
grafting. Gossip (IHAVE) goes to ``max(6, 0.25 * non-mesh peers)`` others each heartbeat: py-libp2p
0.8.1 fixes D_lazy = 6 and the gossip factor 0.25 (go's defaults) once its adaptive mode is off
(``adaptive_gossip_enabled=False``, see compat's ``adaptive-gossip``). The message cache keeps
``GOSSIP_HISTORY`` = 5 heartbeats (5 s) of messages for IWANT and advertises the last
``GOSSIP_WINDOW`` = 3 (go's defaults).

Scoring (gossipsub v1.1 peer scoring, py-libp2p 0.8.1's ``PeerScorer``): what it counts and how it is
used is in docs/libp2p.md ("Peer scoring"). In short, only the counters the library actually feeds are
weighted: invalid messages (P4: our validator refused what the peer forwarded), first deliveries (P2:
credit for forwarding valid messages first), and behaviour penalties (P5: GRAFT floods, IHAVE/IWANT
spam). Time in mesh (P1) counts joins, not time, and mesh deliveries (P3) are never recorded in 0.8.1,
so both weigh 0; IP colocation (P7) weighs 0 because honest swarms put many nodes behind one address
(a lab, a cluster, NAT) and our tests run on 127.0.0.1. Counters decay by ``DECAY`` every gossipsub
heartbeat (1 s): a peer's bad record halves in about 23 s.
"""

from __future__ import annotations

from libp2p.pubsub.score import ScoreParams, TopicScoreParams

D = 6
D_LOW = 4
D_HIGH = 12
GOSSIP_WINDOW = 3
"""Heartbeats of message IDs advertised in IHAVE."""
GOSSIP_HISTORY = 5
"""Heartbeats of messages kept to answer IWANT."""

DECAY = 0.97
"""Per heartbeat (1 s): half-life ln 0.5 / ln 0.97 = 23 s."""

INVALID_WEIGHT = 10.0
"""Score lost per invalid message a peer forwarded (P4), up to ``INVALID_CAP`` of them."""
INVALID_CAP = 100.0
FIRST_DELIVERY_WEIGHT = 1.0
"""Score gained per message a peer was first to bring us (P2), up to ``FIRST_DELIVERY_CAP``: an honest
forwarder's credit, capped so that an attacker cannot bank forgiveness for a flood of invalid ones."""
FIRST_DELIVERY_CAP = 50.0
BEHAVIOUR_WEIGHT = 1.0
"""Per unit of behaviour penalty (P5) above ``BEHAVIOUR_THRESHOLD``; the library charges 10 per GRAFT
flood, 5 per IHAVE/IWANT spam burst."""
BEHAVIOUR_THRESHOLD = 20.0

# Thresholds (go-libp2p-pubsub names). An honest peer meets a handful of refusals at most (a message
# that arrives after our deadline passed, a clock a little off): -10 each, offset by its first
# deliveries. The thresholds sit far below that.
MESH_THRESHOLD = -50.0
"""Below it a peer is pruned from our meshes and not grafted (our workaround, compat's
``score-mesh-prune``; the spec prunes below 0, we allow for the handful of honest refusals)."""
GOSSIP_THRESHOLD = -100.0
"""Below it we neither send IHAVE to nor heed IHAVE from the peer (10 recent invalid messages)."""
PUBLISH_THRESHOLD = -200.0
"""Below it (about 20 recent invalid messages) we do not send the peer our messages and, in py-libp2p
0.8.1, drop every message it forwards to us before validation (the library applies this gate on
receipt too, where the spec has the graylist)."""
GRAYLIST_THRESHOLD = PUBLISH_THRESHOLD
"""Below it the peer's GRAFTs are refused with a PRUNE and it gets no IHAVE. The spec puts it below the
publish threshold; in 0.8.1 a peer stops gaining invalid-message penalties at the publish threshold
(its messages no longer reach validation), so a lower graylist would be reached only through behaviour
penalties: the two coincide."""


def score_params() -> ScoreParams:
    """The scoring the node runs with; a fresh object per host (the library keeps it by reference)."""
    return ScoreParams(
        p1_time_in_mesh=TopicScoreParams(weight=0.0, cap=0.0, decay=DECAY),
        p2_first_message_deliveries=TopicScoreParams(weight=FIRST_DELIVERY_WEIGHT, cap=FIRST_DELIVERY_CAP,
                                                     decay=DECAY),
        p3_mesh_message_deliveries=TopicScoreParams(weight=0.0, cap=0.0, decay=DECAY),
        p4_invalid_messages=TopicScoreParams(weight=INVALID_WEIGHT, cap=INVALID_CAP, decay=DECAY),
        p5_behavior_penalty_weight=BEHAVIOUR_WEIGHT, p5_behavior_penalty_decay=DECAY,
        p5_behavior_penalty_threshold=BEHAVIOUR_THRESHOLD,
        p6_appl_slack_weight=0.0, p6_appl_slack_decay=DECAY,
        p7_ip_colocation_weight=0.0,
        publish_threshold=PUBLISH_THRESHOLD, gossip_threshold=GOSSIP_THRESHOLD,
        graylist_threshold=GRAYLIST_THRESHOLD, accept_px_threshold=0.0,
    )
