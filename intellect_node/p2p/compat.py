"""Every py-libp2p workaround, and every touch of its private internals, in one module.

The node pins ``libp2p==0.8.1``. Where that release has a defect we depend on, or where our code must
reach past its public API, the code lives here and nowhere else, and :data:`WORKAROUNDS` records for
each one the defect, the evidence, the test that shows it, its upstream status and when it can go
(docs/libp2p.md renders the same table). A new libp2p version means: run the tests named there, and
delete what the new version fixed. Importing this module refuses any other version.

What is here:

- :func:`apply_fixes` (class-level patches, idempotent, before any host runs): yamux window credits per
  half window; a peer that sends past a yamux receive window loses its connection; yamux writes whole
  messages atomically and reset a stream whose write failed part-way;
  connection tasks (yamux read loop, stream accept loop) that fail end their connection, not the swarm;
  pubsub's per-peer tasks contain their failures; a stale pubsub stream's failure never tears down the
  stream that replaced it; pubsub's per-peer outbound queue is deeper than the stock 32 RPCs and sends
  an RPC that fits as it is; a peer's signed record, attached to every pubsub RPC, is checked once per
  change, not once per RPC; a copy of a message already seen starts no task; an inbound connection
  holds its slot of the inbound cap while it is open, not for the swarm's life, and a refusal at a full
  cap is counted (:func:`inbound_slots`) and logged at WARNING.
- :func:`contain_streams` (per host): the one choke point through which every inbound stream of every
  protocol reaches its handler (see :mod:`intellect_node.p2p.guard`).
- :func:`prune_low_scores` (per gossipsub router): peers whose score fell leave the mesh.
- :func:`allow_ignore` (per pubsub) and :func:`ignoring` (per topic validator): a validator may say
  "ignore" (not forwarded, not delivered, no penalty to the forwarder), which 0.8.1's boolean validators
  cannot.
- :func:`replace_pruner` and :func:`close_peer` (per host): our connection manager
  (:mod:`intellect_node.p2p.connmgr`) trims in place of the stock pruner, and closing a peer keeps a
  connection it opened meanwhile.
- Accessors for private state the node needs (negative dial cache, pubsub blacklist, the subscription
  buffer, the DHT's per-peer provider query, relay reservations, observed addresses) and base classes
  that expose the private hooks of AutoNAT, DCUtR and the relay HOP handler under public names.
"""

from __future__ import annotations

import contextvars
import logging
import re
import struct
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

import trio

if TYPE_CHECKING:
    from libp2p.kad_dht.kad_dht import KadDHT
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

PINNED_VERSION = "0.8.1"


def _check_version() -> None:
    try:
        found = metadata.version("libp2p")
    except metadata.PackageNotFoundError:
        found = "not installed"
    if found != PINNED_VERSION:
        raise ImportError(
            f"intellect-node needs libp2p=={PINNED_VERSION}, found {found}. The workarounds in "
            "intellect_node/p2p/compat.py patch that release's internals; install it with "
            f"`pip install libp2p=={PINNED_VERSION}`, or, to move to a new release, re-run the tests "
            "listed in compat.WORKAROUNDS against it and update the pin.")


_check_version()

# Imported only after the version check: on another version these names may not exist.
from libp2p.abc import IHost, IMuxedConn, INetConn, INetStream, INetwork  # noqa: E402
from libp2p.host.autonat.autonat import AutoNATService, _addr_ip  # noqa: E402
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage  # noqa: E402
from libp2p.io.abc import Reader, ReadWriteCloser  # noqa: E402
from libp2p.io.utils import DEFAULT_RETRY_READ_COUNT  # noqa: E402
from libp2p.network.connection.swarm_connection import SwarmConn  # noqa: E402
from libp2p.network.stream.exceptions import StreamError  # noqa: E402
from libp2p.network.swarm import Swarm as LibSwarm  # noqa: E402
from libp2p.peer.id import ID  # noqa: E402
from libp2p.peer.peerstore import PeerRecordState, PeerStore  # noqa: E402
from libp2p.pubsub import gossipsub as _gossipsub_module  # noqa: E402
from libp2p.pubsub import pubsub as _pubsub_module  # noqa: E402
from libp2p.pubsub import rpc_queue as _rpc_queue  # noqa: E402
from libp2p.pubsub.gossipsub import GossipSub  # noqa: E402
from libp2p.pubsub.pb import rpc_pb2  # noqa: E402
from libp2p.pubsub.pubsub import Pubsub  # noqa: E402
from libp2p.relay.circuit_v2 import dcutr as _dcutr_module  # noqa: E402
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol  # noqa: E402
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage  # noqa: E402
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol  # noqa: E402
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode  # noqa: E402
from libp2p.relay.circuit_v2.resources import Reservation  # noqa: E402
from libp2p.stream_muxer.exceptions import MuxedStreamError  # noqa: E402
from libp2p.stream_muxer.yamux import yamux as _yamux  # noqa: E402
from libp2p.utils.varint import encode_varint_prefixed  # noqa: E402

from intellect_node.p2p import guard as guard  # noqa: E402
from intellect_node.p2p.guard import contain_streams as contain_streams  # noqa: E402  (re-exported)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workaround:
    """One entry of the table: why code here exists and how we will know it can go."""

    name: str
    where: str
    defect: str
    evidence: str
    test: str
    """``tests/<file>.py::<test function>`` that shows the defect or the fix (a test checks it exists)."""
    upstream: str
    remove_when: str


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "yamux-window-updates", "apply_fixes: YamuxStream._auto_tune_and_send_window_update",
        "a WINDOW_UPDATE after every read, even each 1-byte read of a varint prefix",
        "6000 updates for 2000 small messages; a relay's read loop fell tens of KB behind and streams "
        "failed negotiation after 10 s (docs/nat.md)",
        "tests/p2p/test_nat_units.py::test_yamux_credits_the_window_per_half_window_not_per_read",
        "not reported", "upstream credits only after half the window was consumed, as go-yamux does"),
    Workaround(
        "yamux-atomic-writes", "apply_fixes: YamuxStream.write",
        "write() takes the stream's write lock per frame, so a message longer than one frame (64 KiB, or "
        "the remaining send window) can have a concurrent writer's frame between its frames; a write "
        "that fails part-way (window timeout, cancellation) leaves a truncated message on an open stream",
        "honest nodes under load sent 761/765-byte pubsub frames that did not parse; pubsub "
        "writes one stream from its send loop, the subscription replay and the pending flush at once",
        "tests/p2p/test_libp2p_compat.py::test_stock_yamux_write_interleaves_concurrent_messages",
        "not reported", "upstream holds a per-stream lock for the whole message and resets a stream "
        "whose write failed part-way (the test then fails: the stock write no longer interleaves)"),
    Workaround(
        "yamux-receive-window", "apply_fixes: YamuxStream.recv_window, Yamux.handle_incoming, "
        "Yamux._read_data_body, the yamux module's read_exactly",
        "DATA past the receive window a peer was granted is logged, the window clamped to 0 and the bytes "
        "buffered anyway, without end, on a stream nobody reads; go-yamux closes such a connection. A DATA "
        "frame for an unknown stream is read whole (up to 16 MiB) only to be dropped; ours drains it in "
        "64 KiB pieces",
        "40 frames of 256 KiB on a stream whose handler had returned: 10 MiB held on one stream, the "
        "connection kept (an experiment on 0.8.1); repeated, any peer could exhaust a node's memory",
        "tests/p2p/test_libp2p_fuzz.py::test_a_peer_that_sends_past_its_receive_window_loses_its_connection",
        "not reported", "upstream closes a connection whose peer exceeds a receive window (GO_AWAY, "
        "protocol error)"),
    Workaround(
        "stream-containment", "contain_streams (p2p/guard.py): the network's common stream handler",
        "an exception a stream handler does not catch escapes to the connection's nursery and stops the "
        "whole Swarm service: 6 bytes on /meshsub/1.1.0 (protobuf DecodeError), a non-UTF-8 multistream "
        "line (UnicodeDecodeError)",
        "`05 ff ff ff ff ff` on /meshsub/1.1.0 took a node off the network until restart",
        "tests/p2p/test_libp2p_fuzz.py::test_hostile_streams_leave_the_node_serving_honest_peers",
        "not reported", "upstream's dispatcher contains handler failures to their stream"),
    Workaround(
        "close-after-handler", "contain_streams (p2p/guard.py): _finish after a handler returns",
        "pubsub's read loop and the relay's HOP handler return on the peer's EOF without closing their "
        "side; the stream stays in the connection's yamux table until the connection closes, uncounted "
        "by any cap (the peer can no longer send on it)",
        "50 meshsub (1.1 or 1.2) or HOP streams opened and closed by one peer: 50 entries left in the "
        "target's table each time (kad, identify, ping, AutoNAT, STOP, DCUtR and ours: 0)",
        "tests/p2p/test_libp2p_fuzz.py::test_streams_the_peer_closed_are_forgotten_once_their_handlers_return",
        "not reported", "upstream handlers close their stream when they return"),
    Workaround(
        "connection-containment", "apply_fixes: SwarmConn.start, Yamux.start",
        "a failure in a connection's task (stream accept loop, yamux read loop) is raised into the "
        "Swarm service manager and stops every connection",
        "read from the 0.8.1 source (Swarm.add_conn runs both with manager.run_task); defence in depth "
        "behind stream-containment",
        "tests/p2p/test_libp2p_compat.py::test_a_failing_connection_task_ends_only_its_connection",
        "not reported", "upstream runs connection tasks so that their failure closes only that connection"),
    Workaround(
        "pubsub-task-containment", "apply_fixes: Pubsub.push_msg and the per-peer tasks it spawns",
        "push_msg runs as a service task per received message; a message with an undecodable `key` "
        "makes signature_validator re-raise, which stops the Pubsub service and the node's libp2p",
        "one signed-looking gossip message with key=b'\\x00' from any peer (fuzz test)",
        "tests/p2p/test_libp2p_fuzz.py::test_hostile_gossip_rpcs_leave_the_node_serving_honest_peers",
        "not reported", "upstream catches failures of per-message and per-peer tasks"),
    Workaround(
        "pubsub-stale-stream", "apply_fixes: Pubsub.write_msg",
        "a write failing on a pubsub stream that was already replaced tears down the replacement "
        "(write_msg calls _handle_dead_peer by peer ID, not by stream)",
        "read from the 0.8.1 source: the replay and flush tasks keep their own reference to the stream",
        "tests/p2p/test_libp2p_compat.py::test_a_failed_pubsub_write_resets_its_stream_and_pubsub_opens_another",
        "not reported", "upstream ties dead-peer handling to the stream that failed"),
    Workaround(
        "negative-dial-cache", "unblock_peer", "a peer whose addresses all failed is refused for 60 s",
        "a bootstrap peer that came up seconds after us stayed unreachable for a minute",
        "tests/node/test_swarm_runtime.py::test_a_node_started_before_its_bootstrap_peer_reaches_it_once_that_peer_listens",
        "by design upstream (it has unblock_peer for this)", "never: explicit dials must dial"),
    Workaround(
        "ban-without-add-to-blacklist", "blacklist",
        "Pubsub.add_to_blacklist's teardown deletes peers[pid] after the reset's own handler did: the "
        "KeyError stops the pubsub service", "seen in the sweep and roles tests",
        "tests/p2p/test_swarm_gossip.py::test_providers_three_hops_away_resolve_to_http_urls_and_bans_hide_them",
        "not reported",
        "upstream's teardown tolerates an already removed peer"),
    Workaround(
        "subscription-buffer", "set_subscription_buffer (pubsub SUBSCRIPTION_CHANNEL_SIZE)",
        "accepted messages reach a subscription through a channel of 32; the rest are dropped",
        "bursts lost on a busy trio thread (docs/swarm.md)",
        "tests/p2p/test_swarm_gossip.py::test_gossip_reaches_every_subscriber_and_bursts_are_not_dropped",
        "not reported", "upstream makes the size a parameter (then pass it)"),
    Workaround(
        "subscription-reannounce", "reannounce_subscription",
        "SUBSCRIBE goes only to peers whose outbound queue exists at that instant",
        "a leaf of a 5-star unknown to the hub for over 45 s (docs/swarm.md)",
        "tests/p2p/test_swarm_gossip.py::test_gossip_reaches_every_subscriber_and_bursts_are_not_dropped",
        "not reported", "upstream announces to peers whose stream opens after the subscription"),
    Workaround(
        "provider-walk", "encode_dht_key, providers_from_peer",
        "KadDHT.find_providers answers from its cache once it holds any record for a key",
        "providers that appear after the first lookup are never found (docs/swarm.md)",
        "tests/p2p/test_swarm_gossip.py::test_providers_three_hops_away_resolve_to_http_urls_and_bans_hide_them",
        "not reported",
        "upstream walks the network when asked (or exposes the per-peer query)"),
    Workaround(
        "autonat-dial-back", "AutoNATBase (hooks _handle_dial, _try_dial; _addr_ip)",
        "the stock server dials back with host.connect, which reuses the request's own connection",
        "NATed and firewalled hosts were told PUBLIC (docs/nat.md)",
        "tests/p2p/test_nat_traversal.py::test_autonat_says_public_for_public_hosts_private_behind_nat_or_firewall",  # noqa: E501
        "not reported",
        "upstream dials back over a fresh connection"),
    Workaround(
        "dcutr-driver", "DCUtRBase (hooks _auto_drive_loop, _perform_hole_punch, _get_observed_addrs)",
        "the stock loop punches from both ends at once; the punch binds to a port from get_addrs(); "
        "CONNECT goes out empty once observations' connections closed",
        "every punch timed out in namespaces (docs/nat.md)",
        "tests/p2p/test_nat_traversal.py::test_private_host_found_through_dht_then_dcutr_goes_direct",
        "not reported",
        "upstream drives from the listener only and keeps observations"),
    Workaround(
        "relay-total-cap", "HopBase (hook _handle_connect, _send_status; resource_manager internals)",
        "no cap on circuits across all reservations; reservations not countable through the API",
        "design (docs/nat.md)",
        "tests/p2p/test_nat_traversal.py::test_private_hosts_find_relays_through_the_dht_reserve_two_and_renew",
        "not reported", "upstream has a total limit and a public count"),
    Workaround(
        "circuit-addrs", "nat.relay.advertise_circuit_addrs (instance get_addrs)",
        "get_addrs strips everything from the first /p2p/, so an addrs_factory cannot carry "
        "circuit addresses",
        "a private node advertised its relay's address as its own (docs/nat.md)",
        "tests/p2p/test_nat_traversal.py::test_private_hosts_find_relays_through_the_dht_reserve_two_and_renew",
        "not reported",
        "upstream keeps circuit addresses"),
    Workaround(
        "close-connections-on-exit", "close_connections (swarm._serve_then_close)",
        "a host whose services are cancelled or fail leaves its connections open (SwarmConn.close, "
        "begun by the cancellation, marks itself closed and is cut short): the peer keeps our dead pubsub "
        "stream and skips the new connection of our restarted host (Pubsub._handle_new_peer: 'already "
        "has pubsub stream'), so it never learns our subscriptions again",
        "after a libp2p restart the peer kept the old stream for minutes and no gossip flowed (liveness)",
        "tests/p2p/test_liveness.py::test_libp2p_failures_are_restarted_resubscribed_and_reported",
        "not reported", "upstream closes connections when the Swarm service stops"),
    Workaround(
        "pubsub-outbound-queue", "apply_fixes: pubsub.RpcQueue (the per-peer outbound queue)",
        "each peer's outbound RPC queue holds 32 RPCs and rejects the rest silently (go-libp2p-pubsub's "
        "default, sized for a Go scheduler): a forwarder whose trio thread stalls for a second on a busy "
        "machine drops the forwards of a burst it already accepted",
        "a 5-node star at load 15: the hub got all 32 messages of a burst, the leaves 23-25 each",
        "tests/p2p/test_libp2p_compat.py::test_stock_pubsub_outbound_queue_rejects_past_32_rpcs",
        "not reported (the size is a constructor argument pubsub never passes)",
        "upstream lets the host choose the size (then pass PEER_OUTBOUND_QUEUE instead)"),
    Workaround(
        "stock-pruner", "replace_pruner (the network's connection_pruner)",
        "ConnectionPruner never closes a connection with an open stream, and every gossipsub peer holds "
        "a pubsub stream for the connection's life, so above the high watermark it closes nothing that "
        "matters; it knows nothing of meshes, relays or the run's trainer",
        "read from the 0.8.1 source (connection_pruner.py: 'never interrupt live traffic'): "
        "16 local nodes held 15 connections each",
        "tests/p2p/test_connmgr.py::test_a_hub_trims_to_low_keeps_protected_peers_and_gossip_reaches_everyone",
        "not reported",
        "upstream lets a host plug in its own trim policy (go-libp2p's ConnManager interface)"),
    Workaround(
        "close-peer-keeps-new-connections", "close_peer (instead of Swarm.close_peer)",
        "Swarm.close_peer awaits each connection's close (about 0.2 s), then drops the peer's whole entry "
        "from the connection table: a connection the peer opened meanwhile is forgotten but stays open, "
        "so the peer believes it is connected and this node does not",
        "a trimmed peer that dialed back at once was connected on its side only (1 run in 4 of the hub "
        "test); a peer redialing as soon as it sees the close: 5 of 5 lost",
        "tests/p2p/test_connmgr.py::test_close_peer_keeps_a_connection_the_peer_opens_meanwhile",
        "not reported", "upstream closes only the connections it found (each removes itself)"),
    Workaround(
        "adaptive-gossip", "P2PHost: GossipSub(adaptive_gossip_enabled=False)",
        "the adaptive mode (on by default) recomputes a 'network health' every 30 s in which peer scores "
        "count only when above 0 and are taken over no topic (so 0 for every honest peer), then slows "
        "the gossipsub heartbeat from 1 s to 30 s (60 s at medium health) and raises D_low/D_high and "
        "the gossip factor: mesh repair after churn or trims takes 30-60 s instead of 1 s",
        "a healthy 5-node ring: heartbeat 1 s -> 30 s, health 0.33, D_low/D_high 4/12 -> 6/15, gossip "
        "factor 0.25 -> 0.45, 30 s after start; a full mesh of 6: 60 s (measured)",
        "tests/p2p/test_gossip_scoring.py::test_stock_adaptive_gossip_slows_the_heartbeat_of_a_healthy_mesh",
        "not reported", "upstream's health counts honest peers as healthy and keeps the configured "
        "heartbeat (the test then fails: the stock mode keeps 1 s)"),
    Workaround(
        "score-mesh-prune", "prune_low_scores (wraps the router's mesh_heartbeat)",
        "peer scoring feeds the gates (publish, gossip, graylist on GRAFT) but the mesh heartbeat neither "
        "removes a mesh peer whose score fell nor avoids grafting one (gossipsub v1.1: peers with a "
        "negative score are pruned), so a peer forwarding invalid messages stays in the mesh",
        "read from the 0.8.1 source (mesh_heartbeat selects by degree only); the stock heartbeat keeps "
        "a peer at score -500 in the mesh",
        "tests/p2p/test_gossip_scoring.py::test_stock_mesh_heartbeat_keeps_a_negative_score_peer",
        "not reported", "upstream prunes and skips peers below a threshold in mesh_heartbeat"),
    Workaround(
        "gossip-ignore", "allow_ignore (wraps the scorer's on_invalid_message), ignoring (topic validators)",
        "a topic validator returns a bool: a message it refuses is charged to the forwarder as an invalid "
        "message (P4) and its failure cached for 300 s, so a copy arriving later is charged to that "
        "forwarder too without the validator being asked; gossipsub v1.1's third outcome, ignore (drop "
        "without forwarding or penalty, for a message that is only too old), is missing",
        "read from the 0.8.1 source (Pubsub.push_msg, validate_msg); an expired verdict forwarded by an "
        "honest peer a moment before it expired cost that peer 10 points of score",
        "tests/security/test_expired_verdicts.py::test_an_expired_verdict_is_ignored_not_forwarded_and_blames_no_one",
        "not reported", "upstream validators return accept/reject/ignore (go-libp2p's ValidationResult)"),
    Workaround(
        "idontwant-threshold", "idontwant_only_for_large (wraps the router's publish and IDONTWANT emit)",
        "gossipsub 1.2's IDONTWANT goes out as its own RPC to every 1.2 mesh peer for every message, "
        "however small; the spec means it for large messages (go-libp2p: 1 KiB and up), where the "
        "copies it saves cost more than the notice",
        "py-spy of an idle node in a 16-node swarm: 6% of its CPU in IDONTWANTs for heartbeats of a few "
        "hundred bytes (bench/README.md, scale)",
        "tests/p2p/test_gossip_scoring.py::test_idontwant_goes_out_for_large_messages_only",
        "not reported", "upstream sends IDONTWANT only above a size threshold"),
    Workaround(
        "graylist-control", "apply_fixes: GossipSub.handle_rpc",
        "the graylist gate refuses a graylisted peer's GRAFTs and (with the publish gate) its messages, "
        "but its IHAVE, IWANT, PRUNE and IDONTWANT are still handled; gossipsub v1.1 ignores every RPC of "
        "a peer whose score is below the graylist threshold",
        "read from the 0.8.1 source (handle_rpc dispatches control messages without a score check); a "
        "graylisted peer's IWANT is answered from the message cache",
        "tests/p2p/test_gossip_scoring.py::test_stock_router_answers_a_graylisted_peers_iwant",
        "not reported", "upstream ignores the control messages of a graylisted peer (the test then fails: "
        "the stock router no longer answers)"),
    Workaround(
        "peer-record-per-rpc", "apply_fixes: maybe_consume_signed_record as pubsub and gossipsub call it",
        "every pubsub RPC carries the sender's signed peer record and the receiver parses it, checks its "
        "ed25519 signature and rewrites the peer's addresses for each one (twice for an RPC with control "
        "messages: pubsub and gossipsub each consume it), though a peer's record changes only when its "
        "addresses do",
        "py-spy of an idle node in a 16-node swarm: 7% of its CPU checking the same records again, about "
        "19 RPCs a second each carrying one (bench/README.md, scale)",
        "tests/p2p/test_compat_idle.py::test_stock_pubsub_checks_the_same_peer_record_on_every_rpc",
        "not reported", "upstream checks a record once per change (or stops attaching it to every RPC; "
        "the test then fails)"),
    Workaround(
        "task-per-duplicate", "apply_fixes: Pubsub._is_subscribed_to_msg (the read loop's filter)",
        "the read loop starts a service task (push_msg) for every copy of a message, and the task's first "
        "step drops a copy already seen; a node in a mesh of degree d gets about d copies of each message",
        "an idle node of a 16-node swarm received 7.3 copies of each heartbeat (bench/scale_profile.py), "
        "each a task started, named and registered by the service manager",
        "tests/p2p/test_compat_idle.py::test_stock_pubsub_starts_a_task_for_every_copy_of_a_message",
        "not reported", "upstream drops seen messages before starting a task (the test then fails)"),
    Workaround(
        "rpc-split-per-send", "apply_fixes: pubsub.RpcQueue.split_rpc",
        "every outbound RPC is rebuilt by the splitter (each published message copied into a new RPC, "
        "control copied into another) even when the whole RPC is far under the size limit; go-libp2p "
        "returns such an RPC as it is",
        "py-spy of an idle node in a 16-node swarm: 6% of its CPU splitting heartbeat forwards of a few "
        "hundred bytes",
        "tests/p2p/test_compat_idle.py::test_stock_rpc_queue_rebuilds_rpcs_that_fit",
        "not reported", "upstream returns an RPC within the limit unsplit (the test then fails)"),
    Workaround(
        "pubsub-seen-cache-thread", "stop_seen_cache (P2PHost.serve's end)",
        "Pubsub's seen-message cache starts a sweeper thread in its constructor and nothing stops it when "
        "the pubsub service ends: each host a process builds leaves a thread, and the cache it holds",
        "bench/inbound_soak.py: 1,000 dialer hosts started and closed in one process left 1,000 "
        "'_background_cleanup' threads and ~180 MiB",
        "tests/p2p/test_compat_threads.py::test_stock_pubsub_leaves_its_seen_cache_thread_running",
        "not reported", "upstream stops the cache when the pubsub service ends (the test then fails)"),
    Workaround(
        "inbound-slot-per-connection", "apply_fixes: Swarm._handle_inbound_connection",
        "the inbound cap's slot (max_connections - min_connections) is taken per connection and given "
        "back only when the whole swarm stops: the handler waits on the swarm's end after the upgrade, "
        "so closing a connection never returns its slot; at the cap every later inbound connection is "
        "closed before multistream (the dialer reads 'failed to negotiate the secure protocol') and the "
        "library logs it at DEBUG only",
        "a demo trainer refused every new peer after 124 inbound connections over its life (74 plain "
        "connect/disconnect cycles from fresh keys, the rest banned attackers redialing) and had not "
        "recovered 4.5 minutes later (shared notes, libp2p-0.8.1)",
        "tests/p2p/test_inbound_slots.py::test_stock_inbound_handler_keeps_the_slot_of_a_closed_connection",
        "not reported", "upstream returns the slot when its connection closes (the test then fails: the "
        "stock handler gives the slot back)"),
)


# -- class-level fixes -------------------------------------------------------------------------------

WINDOW_WAIT_TIMEOUT_S = 5.0
"""How long a write waits for the peer to open its receive window (the stock value)."""
RESET_TIMEOUT_S = 1.0
"""Bound on sending the RST after a failed write (it is sent even if the writer was cancelled)."""

PEER_OUTBOUND_QUEUE = 256
"""RPCs queued per peer before gossipsub drops: 8 times the stock 32, so a forwarder stalled for a few
seconds keeps a burst. Our messages are small (notices, verdicts, heartbeats: a few KB); the bound in bytes
for a peer that never reads is this times the 512 KiB publish limit, and its connection is closed by then."""


class _DeepRpcQueue(_rpc_queue.RpcQueue):
    """The stock per-peer queue with :data:`PEER_OUTBOUND_QUEUE` as its default size, which sends an RPC
    that fits the size limit as it is (``rpc-split-per-send``)."""

    def __init__(self, max_size: int = PEER_OUTBOUND_QUEUE,
                 max_message_size: int = _rpc_queue.DefaultMaxMessageSize) -> None:
        super().__init__(max_size, max_message_size)

    def split_rpc(self, rpc: rpc_pb2.RPC) -> list[rpc_pb2.RPC]:
        """One RPC within the limit goes out whole, as go-libp2p's ``RPC.split`` returns it; the stock
        splitter copies every part into new RPCs first. An RPC with nothing in it (the stock splitter
        sends none) and one over the limit take the stock path."""
        if _rpc_queue._rpc_has_data(rpc) and rpc.ByteSize() <= self.max_message_size:
            return [rpc]
        return list(super().split_rpc(rpc))


_STOCK: dict[str, Any] = {}
"""The original functions we replaced, by name (tests call them to show the defects)."""


def stock(name: str) -> Any:
    """The unpatched library function ``name`` (``"YamuxStream.write"``, ...), for tests."""
    apply_fixes()
    return _STOCK[name]


def _patch(owner: type, attr: str, fn: object) -> None:
    key = f"{owner.__name__}.{attr}"
    if key not in _STOCK:
        _STOCK[key] = owner.__dict__[attr]
    setattr(owner, attr, fn)


_applied = False


def apply_fixes() -> None:
    """Install the class-level fixes (see :data:`WORKAROUNDS`); idempotent, call before hosts run."""
    global _applied
    if _applied:
        return
    _applied = True
    _patch(_yamux.YamuxStream, "_auto_tune_and_send_window_update", _window_update)
    _patch(_yamux.YamuxStream, "write", _atomic_write)
    # A data descriptor in place of the int attribute (see _ReceiveWindow).
    _yamux.YamuxStream.recv_window = _ReceiveWindow()  # type: ignore[assignment]
    _patch(_yamux.Yamux, "handle_incoming", _enforce_receive_window)
    _STOCK.setdefault("yamux.read_exactly", _yamux.read_exactly)
    _yamux.read_exactly = _read_noting_header  # the name the read loop reads frames with
    _patch(_yamux.Yamux, "_read_data_body", _read_body_within_window)
    _patch(LibSwarm, "_handle_inbound_connection", _inbound_connection)
    _patch(SwarmConn, "start", guard.contained_connection_task(SwarmConn.start, "stream accept loop"))
    _patch(_yamux.Yamux, "start", guard.contained_connection_task(_yamux.Yamux.start, "yamux read loop"))
    _patch(Pubsub, "write_msg", _write_msg)
    _STOCK.setdefault("pubsub.RpcQueue", _pubsub_module.RpcQueue)
    vars(_pubsub_module)["RpcQueue"] = _DeepRpcQueue  # the module global pubsub builds each peer's queue with
    _patch(Pubsub, "push_msg", guard.contained_peer_task(Pubsub.push_msg, "gossip"))
    _patch(Pubsub, "_replay_recent_messages",
           guard.contained_peer_task(Pubsub._replay_recent_messages, "gossip replay"))
    _patch(GossipSub, "flush_pending_messages",
           guard.contained_peer_task(GossipSub.flush_pending_messages, "gossip flush"))
    _patch(GossipSub, "on_peer_subscribed",
           guard.contained_peer_task(GossipSub.on_peer_subscribed, "gossip subscribe"))
    _patch(Pubsub, "_is_subscribed_to_msg", _is_new_and_subscribed)
    _patch(GossipSub, "handle_rpc", _graylist_gated_rpc)
    # Both modules imported the function by name: replace the name each of them calls.
    _STOCK.setdefault("pubsub.maybe_consume_signed_record", _pubsub_module.maybe_consume_signed_record)
    _pubsub_module.maybe_consume_signed_record = _consume_record_once
    _gossipsub_module.maybe_consume_signed_record = _consume_record_once


def stop_seen_cache(pubsub: Pubsub) -> None:
    """Stop the sweeper thread of ``pubsub``'s seen-message cache once its host has stopped (workaround
    ``pubsub-seen-cache-thread``); it wakes at once and the join takes microseconds."""
    pubsub.seen_messages.stop()


# -- inbound connection slots ------------------------------------------------------------------------

INBOUND_WARNING_EVERY_S = 60.0
"""At most one WARNING a minute for inbound connections refused at the cap (each one is counted)."""


@dataclass
class InboundRefusals:
    """Inbound connections one libp2p swarm refused because its inbound cap was full."""

    count: int = 0
    warned_at: float = float("-inf")
    unwarned: int = 0


@dataclass(frozen=True)
class InboundSlots:
    """The inbound cap of one host: slots held by open inbound connections, the cap, refusals so far."""

    in_use: int
    cap: int
    refused: int

    @property
    def full(self) -> bool:
        return self.cap > 0 and self.in_use >= self.cap


_REFUSALS: "weakref.WeakKeyDictionary[LibSwarm, InboundRefusals]" = weakref.WeakKeyDictionary()


def inbound_slots(host: IHost) -> InboundSlots:
    """How full ``host``'s inbound cap is (read on any thread: two ints and a counter)."""
    network = network_of(host)
    limiter: trio.CapacityLimiter = network._inbound_limiter
    refused = _REFUSALS.get(network)
    return InboundSlots(in_use=int(limiter.borrowed_tokens), cap=int(limiter.total_tokens),
                        refused=refused.count if refused else 0)


def _note_inbound_refusal(network: LibSwarm) -> None:
    seen = _REFUSALS.setdefault(network, InboundRefusals())
    seen.count += 1
    seen.unwarned += 1
    now = time.monotonic()
    if now - seen.warned_at >= INBOUND_WARNING_EVERY_S:
        log.warning("inbound connection cap (%d) full: refused %d new inbound connection(s) since the "
                       "last warning (%d in all); raise network.conn_high if honest peers are turned away",
                       int(network._inbound_limiter.total_tokens), seen.unwarned, seen.count)
        seen.warned_at = now
        seen.unwarned = 0


async def _close_quietly(conn: ReadWriteCloser) -> None:
    try:
        await conn.close()
    except Exception as exc:  # the socket is already gone: nothing is left to release
        log.debug("closing a refused inbound connection: %s", exc)


async def _inbound_connection(self: LibSwarm, conn: ReadWriteCloser, maddr: Multiaddr) -> None:
    """The inbound handler with its slot held while its own connection is open, not the swarm's life.

    What it keeps of the stock handler: the cap taken without a checkpoint (``acquire_nowait``), the
    connection gate, the security and muxer upgrade. What it changes: after the upgrade it waits until
    the connection shuts down (or the swarm ends), so the ``finally`` returns the slot, from the task that
    took it, exactly once; a refusal at the cap is counted (:func:`inbound_slots`) and logged at WARNING,
    rate-limited. Pre-multiplexed transports (QUIC, WebTransport) go to the stock inner handler: the node
    listens on TCP only."""
    try:
        self._inbound_limiter.acquire_nowait()
    except trio.WouldBlock:
        _note_inbound_refusal(self)
        await _close_quietly(conn)
        return
    try:
        if isinstance(conn, IMuxedConn):
            from libp2p.network.swarm import SwarmEvent

            await self._do_handle_inbound_connection(conn, maddr, SwarmEvent())
        else:
            await _upgrade_and_hold(self, conn, maddr)
    finally:
        self._inbound_limiter.release()


async def _upgrade_and_hold(network: LibSwarm, conn: ReadWriteCloser, maddr: Multiaddr) -> None:
    from libp2p.network.connection.raw_connection import RawConnection

    remote = network._build_remote_multiaddr(conn)
    if remote is not None and not await network.connection_gate.is_allowed(remote):
        await _close_quietly(conn)
        return
    raw = RawConnection(conn, False)
    try:
        muxed = await network.upgrade_inbound_raw_conn(raw, maddr)
    except Exception as exc:  # a dialer that fails its handshake ends only its own connection
        log.debug("inbound upgrade from %s failed: %s", remote, exc)
        await _close_quietly(raw)
        return
    shutting_down: trio.Event | None = getattr(muxed, "event_shutting_down", None)
    if shutting_down is None:  # a muxer without the event: hold the slot as the stock handler does
        await network.manager.wait_finished()
        return
    async with trio.open_nursery() as nursery:
        async def swarm_end() -> None:
            await network.manager.wait_finished()
            nursery.cancel_scope.cancel()

        nursery.start_soon(swarm_end)
        await shutting_down.wait()
        nursery.cancel_scope.cancel()


async def _window_update(self: _yamux.YamuxStream, *, bytes_read: int = 0) -> None:
    """Credit the peer's send window once half of it was consumed (go-yamux), keeping auto-tuning.

    The stock version also credits on every read ("partial slack", "release on read"): three frames
    back to the sender per small message, each a Noise message, a syscall and two scheduler passes in
    the peer's read loop."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        delta = self.target_recv_window - (self.recv_window + buffered)  # consumed since the last credit
        if delta <= 0 or delta < self._grow_threshold():
            return
        self.recv_window += delta
        increment = delta + self._apply_autotune_epoch(buffered)
    await self.send_window_update(increment)


class _ReceiveWindow:
    """``YamuxStream.recv_window`` that notices a peer sending past the window it was granted.

    The stock read loop subtracts each DATA frame from the stream's receive window and, when that goes
    below zero, logs a warning, clamps it to zero and buffers the bytes anyway: a peer that ignores flow
    control grows a stream nobody reads by up to 16 MiB a frame, without end. Every place the loop
    subtracts (DATA, SYN+DATA, ACK+DATA) assigns the result here, so one data descriptor sees them all.
    A negative result marks the connection as exceeded and stops its read loop after that frame
    (:func:`_enforce_receive_window` then closes it). :func:`_read_body_within_window` refuses such a
    frame from its header, before its body is read; this stays as the check of what was actually
    subtracted. Our own credits never exceed the window: it is raised here before the WINDOW_UPDATE
    goes out."""

    def __get__(self, stream: _yamux.YamuxStream | None, owner: type | None = None) -> int | _ReceiveWindow:
        if stream is None:
            return self
        window: int = stream.__dict__.get("_recv_window", 0)
        return window

    def __set__(self, stream: _yamux.YamuxStream, value: int) -> None:
        if value < 0:
            muxer = stream.conn
            if getattr(muxer, "_window_exceeded", None) is None:
                # Our attribute on the library's object (Yamux declares none), as in _read_body_within_window.
                setattr(muxer, "_window_exceeded", (stream.stream_id, -value))  # noqa: B010
            muxer.event_shutting_down.set()  # the read loop ends after this frame
            value = 0
        stream.__dict__["_recv_window"] = value


async def _read_noting_header(reader: Reader, n: int, retry_count: int = DEFAULT_RETRY_READ_COUNT) -> bytes:
    """The yamux module's ``read_exactly``: the read loop reads each frame header with it, so the header
    is kept on the connection for :func:`_read_body_within_window` (a 12-byte body overwrites it too, after
    that check, and the next header replaces it)."""
    data: bytes = await _STOCK["yamux.read_exactly"](reader, n, retry_count)
    if n == _yamux.HEADER_SIZE:
        try:
            setattr(reader, "_intellect_yamux_header", data)  # noqa: B010  # ours, on the library's object
        except AttributeError:  # a connection class with __slots__: the window descriptor still checks
            pass
    return data


async def _read_body_within_window(self: _yamux.Yamux, length: int) -> bytes:
    """``Yamux._read_data_body`` that refuses a DATA frame longer than its stream's window before reading it.

    The stock loop reads the whole body (up to 16 MiB) before it subtracts it from the window, so a peer
    could make a node hold a frame's worth past the window per connection until :class:`_ReceiveWindow`
    ended it. Here the header kept by :func:`_read_noting_header` names the stream: a frame longer than
    that stream's window (a new stream's initial window for a SYN) marks the connection as exceeded, ends
    the read loop and returns no bytes; :func:`_enforce_receive_window` closes the connection.

    A frame for a stream the node does not know (data in flight when it reset it, or a peer's invention)
    is read and dropped, as go-yamux drains it, but in pieces of at most :data:`DRAIN_PIECE` bytes under
    the stock body deadline: the stock loop would first hold the whole body, up to 16 MiB a frame on every
    connection at once, only to drop it."""
    header = getattr(self.secured_conn, "_intellect_yamux_header", None)
    if header is not None and len(header) == _yamux.HEADER_SIZE:
        _, typ, flags, stream_id, announced = struct.unpack(_yamux.YAMUX_HEADER_FORMAT, header)
        if typ == _yamux.TYPE_DATA and announced == length:
            stream = self.streams.get(stream_id)
            window = stream.recv_window if stream is not None else \
                _yamux.DEFAULT_WINDOW_SIZE if flags & _yamux.FLAG_SYN else None
            if window is not None and length > window:
                if getattr(self, "_window_exceeded", None) is None:
                    # Our attribute on the library's object (Yamux declares none): set as it is read.
                    setattr(self, "_window_exceeded", (stream_id, length - window))  # noqa: B010
                self.event_shutting_down.set()  # the read loop ends after this frame
                return b""
            if window is None:  # no such stream: nothing will read these bytes
                with trio.fail_after(_yamux._yamux_data_read_timeout()):
                    left = length
                    while left:  # read_exactly raises IncompleteReadError if the connection ends first
                        left -= len(await _STOCK["yamux.read_exactly"](self.secured_conn,
                                                                       min(left, DRAIN_PIECE)))
                return b""
    body: bytes = await _STOCK["Yamux._read_data_body"](self, length)
    return body


DRAIN_PIECE = 64 * 1024
"""Largest read when dropping the body of a DATA frame for an unknown stream (yamux's own frame size)."""


async def _enforce_receive_window(self: _yamux.Yamux) -> None:
    """``Yamux.handle_incoming`` that closes the connection of a peer that exceeded a receive window.

    go-yamux does the same (ErrRecvWindowExceeded: GO_AWAY with a protocol error, then close). The
    rejection is recorded against the peer through the host's containment (p2p/guard.py)."""
    await _STOCK["Yamux.handle_incoming"](self)
    exceeded = getattr(self, "_window_exceeded", None)
    if exceeded is None:
        return
    stream_id, excess = exceeded
    peer = self.peer_id.to_base58() if self.peer_id is not None else ""
    log.warning("peer %s sent %d bytes beyond the receive window of stream %d: closing its connection",
                peer or "?", excess, stream_id)
    owner = getattr(self.on_close, "__self__", None)  # the SwarmConn that set on_close
    guard.reject_reason(getattr(owner, "swarm", None), peer,
                        f"yamux: {excess} bytes beyond the receive window of stream {stream_id}")
    with trio.CancelScope(shield=True), trio.move_on_after(RESET_TIMEOUT_S):
        try:
            await self._write_frame(struct.pack(_yamux.YAMUX_HEADER_FORMAT, 0, _yamux.TYPE_GO_AWAY, 0, 0,
                                                _yamux.GO_AWAY_PROTOCOL_ERROR))
        except Exception as exc:  # the connection may be gone already: closing it is what matters
            log.debug("GO_AWAY to %s: %r", peer, exc)
    await self._cleanup_on_error()  # as the stock loop's own error paths end


class _WindowTimeout(MuxedStreamError):
    pass


async def _atomic_write(self: _yamux.YamuxStream, data: bytes) -> None:
    """``YamuxStream.write`` that sends one whole message before any other writer of the stream.

    The stream's write lock is held from the first frame to the last, window waits included, so frames
    of concurrent writers never interleave. If the write fails after a frame may have gone out (window
    timeout, cancellation, a broken connection), the stream is reset: the reader sees a reset instead
    of a truncated message followed by the next one, and every later write fails at once."""
    if self.send_closed:
        raise MuxedStreamError("Stream is closed for sending")
    attempted = False
    async with self.rw_lock.write_lock():
        try:
            sent, total = 0, len(data)
            while sent < total:
                n = await _reserve_window(self, total - sent)
                header = struct.pack(_yamux.YAMUX_HEADER_FORMAT, 0, _yamux.TYPE_DATA, 0, self.stream_id, n)
                attempted = True
                await self.conn._write_frame(header + data[sent:sent + n])
                sent += n
        except BaseException as exc:
            if attempted or isinstance(exc, _WindowTimeout):
                await _reset_after_failed_write(self)
            raise


async def _reserve_window(self: _yamux.YamuxStream, wanted: int) -> int:
    """Take up to ``wanted`` bytes (and one frame's worth) of send window, waiting for the peer's credit."""
    with trio.move_on_after(WINDOW_WAIT_TIMEOUT_S):
        while True:
            async with self.window_lock:
                if self.closed or self.send_closed:
                    raise MuxedStreamError("Stream is closed")
                if self.send_window > 0:
                    n = min(self.send_window, _yamux.MAX_MESSAGE_SIZE - _yamux.HEADER_SIZE, wanted)
                    self.send_window -= n
                    return n
            # WINDOW_UPDATE frames arrive through the connection's read loop; the stock code polls too.
            await trio.sleep(0.01)
    raise _WindowTimeout(f"Timed out waiting for window update after {WINDOW_WAIT_TIMEOUT_S:g} seconds.")


async def _reset_after_failed_write(stream: _yamux.YamuxStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(RESET_TIMEOUT_S):
        try:
            await stream.reset()
        except Exception as exc:  # the connection is gone too: the reset is moot
            log.debug("reset after a failed write: %r", exc)
    # Marked closed even if the RST could not be sent: this stream must never carry another message.
    stream.send_closed = stream.closed = True


async def _write_msg(self: Pubsub, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
    """``Pubsub.write_msg`` whose failure on a stale stream does not tear down the peer's current one.

    The replay and flush tasks write through their own reference to a peer's stream; once that stream
    failed and pubsub opened a new one, their failures must not remove the new one."""
    try:
        await stream.write(encode_varint_prefixed(rpc_msg.SerializeToString()))
        return True
    except StreamError as exc:
        peer = stream.muxed_conn.peer_id
        log.debug("pubsub write to %s failed: %r", peer, exc)
        if self.peers.get(peer) is stream:
            self._handle_dead_peer(peer)
        return False


def _is_new_and_subscribed(self: Pubsub, msg: rpc_pb2.Message) -> bool:
    """The read loop's filter before it starts a ``push_msg`` task for a received message: also false for
    a message already seen (``task-per-duplicate``), which that task would drop as its first step after
    the blacklist checks (which drop too); nothing else of it runs for a seen message."""
    return bool(_STOCK["Pubsub._is_subscribed_to_msg"](self, msg)) and not self._is_msg_seen(msg)


async def _graylist_gated_rpc(self: GossipSub, rpc: rpc_pb2.RPC, sender_peer_id: ID) -> None:
    """``GossipSub.handle_rpc`` (the control part of an RPC; its messages and subscriptions were handled
    before) that ignores the whole control part from a peer scoring below the graylist threshold over
    the topics we subscribe to (``graylist-control``); counted in :data:`GRAYLIST_IGNORED`."""
    scorer = getattr(self, "scorer", None)
    if scorer is not None and self.pubsub is not None and rpc.HasField("control") and \
            scorer.is_graylisted(sender_peer_id, list(self.pubsub.topic_ids)):
        GRAYLIST_IGNORED[self] = GRAYLIST_IGNORED.get(self, 0) + 1
        return
    await _STOCK["GossipSub.handle_rpc"](self, rpc, sender_peer_id)


GRAYLIST_IGNORED: weakref.WeakKeyDictionary[GossipSub, int] = weakref.WeakKeyDictionary()
"""Per router: RPCs whose control messages were ignored because their sender was graylisted."""


RECORD_RECHECK_S = 60.0
"""A peer's signed record seen again byte for byte is taken as checked for this long; after it, the next
RPC runs the full check and store once more (the stored addresses' 2-hour TTL is renewed then)."""
RECORD_CACHE_PEERS = 4096
"""Peers whose last record a host remembers as checked; past that the memory starts afresh."""
_Checked = dict[ID, tuple[bytes, "PeerRecordState | None", float]]
_checked_records: weakref.WeakKeyDictionary[PeerStore, _Checked] = weakref.WeakKeyDictionary()
"""Per peerstore: peer -> (record bytes, the peerstore's entry they produced, monotonic time)."""


def _consume_record_once(msg: rpc_pb2.RPC, host: IHost, peer_id: ID) -> bool:
    """``maybe_consume_signed_record`` as pubsub calls it for every RPC, with the verdict on a record
    kept while it is unchanged (``peer-record-per-rpc``).

    The stock check (parse, ed25519 signature, peer ID, sequence number, then replacing the peer's
    addresses in the peerstore) runs when the bytes differ from the last record this peer sent, when the
    peerstore's entry for the peer is no longer the one those bytes produced (a newer record arrived by
    another way, or the entry expired: the stock check then decides as it would have), or after
    :data:`RECORD_RECHECK_S`. A record that fails is never remembered, so each of its RPCs is refused as
    the stock check refuses it."""
    stock = _STOCK["pubsub.maybe_consume_signed_record"]
    if not msg.HasField("senderRecord"):
        return bool(stock(msg, host, peer_id))
    store = host.get_peerstore()
    if not isinstance(store, PeerStore):  # another peerstore than the library's: no memory, the stock check
        return bool(stock(msg, host, peer_id))
    raw = bytes(msg.senderRecord)
    try:
        checked = _checked_records.setdefault(store, {})
    except TypeError:  # a peerstore that cannot be weakly referenced: no memory, the stock check
        return bool(stock(msg, host, peer_id))
    seen = checked.get(peer_id)
    now = time.monotonic()
    entry = store.peer_record_map.get(peer_id)
    if (seen is not None and seen[0] == raw and entry is not None and seen[1] is entry
            and now - seen[2] < RECORD_RECHECK_S):
        return True
    ok = bool(stock(msg, host, peer_id))
    if ok:
        if len(checked) >= RECORD_CACHE_PEERS and peer_id not in checked:
            checked.clear()
        checked[peer_id] = (raw, store.peer_record_map.get(peer_id), now)
    else:
        checked.pop(peer_id, None)
    return ok


# -- what a failed dial means ----------------------------------------------------------------------------

_MISMATCH = re.compile(r"remote_peer=(\S+?),\s*remote_peer_id_from_pubkey=(\S+)")


def _causes(exc: BaseException) -> list[BaseException]:
    """Every exception under ``exc``: causes, contexts, and the members of libp2p's ``MultiError`` (a list in
    ``args[0]``) and of exception groups, depth-first and each once."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 64:
        e = todo.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        members = getattr(e, "exceptions", None)
        if members is None and e.args and isinstance(e.args[0], list):
            members = e.args[0]
        todo.extend(m for m in (members or []) if isinstance(m, BaseException))
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return seen


def dial_failure(exc: BaseException, where: str) -> str:
    """Say what a failed dial of ``where`` (``host:port``) means to an operator.

    libp2p 0.8.1 reports a peer that answers with another identity and a host where nothing listens the same
    way ("unable to connect ..., no addresses established a successful connection"): the Noise handshake's
    ``PeerIDMismatchesPubkey`` (security/noise/patterns.py) and the TCP ``OSError`` sit several causes deep,
    under ``SwarmDialAllFailedError`` -> ``MultiError`` -> ``SwarmException`` -> ``SecurityUpgradeFailure``.
    The two need different fixes (a stale peer ID in the bootstrap list versus a host that is down), so this
    digs them out. The peer IDs come from the exception's text: the class carries no fields."""
    causes = _causes(exc)
    for e in causes:
        if type(e).__name__ == "PeerIDMismatchesPubkey":
            m = _MISMATCH.search(str(e))
            if m:
                return (f"{where} answered as {m.group(2)}, expected {m.group(1)} "
                        "(update the peer ID in the address)")
            return f"{where} answered with another peer ID (update the peer ID in the address)"
    for e in causes:
        if isinstance(e, ConnectionRefusedError):
            return (f"{where}: connection refused (nothing listens there: the node is down or the port "
                    "is wrong)")
    for e in causes:
        if isinstance(e, OSError) and not isinstance(e, ConnectionError) and "connect" in str(e):
            return f"{where}: unreachable ({e})"
    return f"{where}: {exc}"


# -- accessors for private state -------------------------------------------------------------------------

def unblock_peer(network: INetwork, peer: ID) -> None:
    """Forget ``peer`` in the 60 s negative dial cache, so an explicit dial really dials."""
    if not isinstance(network, LibSwarm):
        raise TypeError("a host built by new_host has a py-libp2p Swarm network, not "
                        f"{type(network).__name__}")
    network.unblock_peer(peer)


def blacklist(pubsub: Pubsub, peer: ID) -> None:
    """Refuse ``peer``'s gossip without ``add_to_blacklist`` (see WORKAROUNDS); close its connections
    too, and the connection-closed notifiee removes it from pubsub's tables."""
    pubsub.blacklisted_peers.add(peer)


class _Trimmer(Protocol):
    """What the pruner's stand-in asks of the connection manager (``p2p/connmgr.py``'s ``ConnManager``)."""

    def over_high(self) -> bool: ...

    def wake(self) -> None: ...


class _ManagedPruner:
    """Stands where the library's pruner was: the swarm calls it on each new connection (debounced), and
    it wakes our connection manager instead (``stock-pruner``)."""

    def __init__(self, connmgr: _Trimmer) -> None:
        self._connmgr = connmgr
        self._last_trim_time: float | None = None  # read by Swarm.get_conn_mgr_info

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def maybe_prune_connections(self) -> None:
        if self._connmgr.over_high():
            self._connmgr.wake()


def prune_low_scores(router: GossipSub, threshold: float,
                     on_prune: Callable[[ID, str, float], object] | None = None) -> None:
    """``score-mesh-prune``: after each stock mesh heartbeat, take peers scoring below ``threshold`` out
    of every mesh: PRUNE (with the stock back-off) those that were in it, silently drop those the
    heartbeat had just picked to graft. ``on_prune(peer, topic, score)`` is called for each PRUNE."""
    stock_heartbeat = router.mesh_heartbeat

    def mesh_heartbeat() -> tuple[defaultdict[ID, list[str]], defaultdict[ID, list[str]]]:
        graft, prune = stock_heartbeat()
        scorer = router.scorer
        if scorer is None:
            return graft, prune
        for topic, peers in list(router.mesh.items()):
            for peer in [p for p in list(peers) if scorer.score(p, [topic]) < threshold]:
                peers.discard(peer)
                scorer.on_leave_mesh(peer, topic)
                if topic in graft.get(peer, ()):  # picked just now and not told yet: drop the pick
                    graft[peer].remove(topic)
                    if not graft[peer]:
                        del graft[peer]
                    continue
                prune[peer].append(topic)
                router._add_back_off(peer, topic, False)
                if on_prune is not None:
                    on_prune(peer, topic, scorer.score(peer, [topic]))
        return graft, prune

    router.mesh_heartbeat = mesh_heartbeat  # type: ignore[method-assign]  # this router's, on purpose


_IGNORED: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("gossip_ignored", default=None)
"""The ID of the message the running validator just ignored (set in the push task that validates it)."""
IGNORED = None
"""What a validator wrapped by :func:`ignoring` returns to ignore a message (True accepts, False
rejects)."""


def ignoring(pubsub: Pubsub, validate: Callable[[ID, rpc_pb2.Message], bool | None]
             ) -> Callable[[ID, rpc_pb2.Message], bool]:
    """``gossip-ignore``: a stock topic validator around ``validate(forwarder, msg) -> bool | None``. For
    None the message is marked seen (later copies are dropped unread) and refused; the scorer hook of
    :func:`allow_ignore` then skips the penalty and forgets the cached failure. Between the validator's
    return and the penalty 0.8.1 does not yield (``validate_msg`` raises, ``push_msg`` charges), so the
    context variable set here is the one the hook reads."""

    def validator(forwarder: ID, msg: rpc_pb2.Message) -> bool:
        _IGNORED.set(None)
        outcome = validate(forwarder, msg)
        if outcome is IGNORED:
            _IGNORED.set(pubsub._msg_id_constructor(msg))
            pubsub._mark_msg_seen(msg)
            return False
        return bool(outcome)

    return validator


def allow_ignore(pubsub: Pubsub) -> None:
    """``gossip-ignore``: the router's scorer charges no invalid message for one a validator wrapped by
    :func:`ignoring` ignored, and the failure is not cached (a copy after the seen-cache forgot it is
    asked again, not charged)."""
    scorer = getattr(pubsub.router, "scorer", None)
    if scorer is None:
        return
    stock_invalid = scorer.on_invalid_message

    def on_invalid_message(peer: ID, topic: str) -> None:
        msg_id = _IGNORED.get()
        if msg_id is not None:
            pubsub.validation_cache._remove(msg_id)
            return
        stock_invalid(peer, topic)

    scorer.on_invalid_message = on_invalid_message


IDONTWANT_MIN_BYTES = 1024
"""Messages smaller than this get no IDONTWANT (go-libp2p's default threshold)."""
_SMALL_MESSAGE: contextvars.ContextVar[bool] = contextvars.ContextVar("idontwant_small", default=False)


def idontwant_only_for_large(router: GossipSub, min_bytes: int = IDONTWANT_MIN_BYTES) -> None:
    """``idontwant-threshold``: the router's ``publish`` (forwarding a validated message) tells its
    IDONTWANT step, through a context variable of the task doing it, whether the message is small; a
    small one gets none. Both are wrapped on this router instance only."""
    stock_publish = router.publish
    stock_emit = router._emit_idontwant_for_message

    async def publish(msg_forwarder: ID, pubsub_msg: rpc_pb2.Message) -> None:
        token = _SMALL_MESSAGE.set(len(pubsub_msg.data) < min_bytes)
        try:
            await stock_publish(msg_forwarder, pubsub_msg)
        finally:
            _SMALL_MESSAGE.reset(token)

    async def emit(msg_id: bytes, topic_ids: Iterable[str]) -> None:
        if _SMALL_MESSAGE.get():
            return
        await stock_emit(msg_id, topic_ids)

    # This router's methods, on purpose (the class stays stock).
    router.publish = publish  # type: ignore[method-assign]
    router._emit_idontwant_for_message = emit  # type: ignore[method-assign]


async def close_peer(network: INetwork, peer: ID) -> None:
    """Close the connections to ``peer`` open now, each of which removes itself from the table
    (``close-peer-keeps-new-connections``); never raises: a half-dead connection is going anyway."""
    for conn in list(network.get_connections(peer)):
        try:
            await conn.close()
        except Exception as exc:
            log.debug("closing a connection to %s: %r", peer, exc)


def network_of(host: IHost) -> LibSwarm:
    """``host``'s network as py-libp2p's own ``Swarm``: its transport manager, upgrader and auto-connector,
    which this node uses, are attributes of that class and not of the ``INetworkService`` interface."""
    network = host.get_network()
    if not isinstance(network, LibSwarm):
        raise TypeError("a host built by new_host has a py-libp2p Swarm network, not "
                        f"{type(network).__name__}")
    return network


def replace_pruner(network: INetwork, connmgr: _Trimmer) -> None:
    """Trim with ``connmgr`` (:class:`intellect_node.p2p.connmgr.ConnManager`), not the stock pruner."""
    vars(network)["connection_pruner"] = _ManagedPruner(connmgr)  # the swarm's attribute, not a class's


def set_subscription_buffer(size: int) -> None:
    """Capacity of the channel between pubsub and a new subscription (read when one is created)."""
    _pubsub_module.SUBSCRIPTION_CHANNEL_SIZE = size


async def close_connections(host: IHost) -> None:
    """Close every connection of ``host`` at the muxer (``close-connections-on-exit``); call it shielded
    and bounded while the host's run ends. Not ``SwarmConn.close``: the cancellation that ended the run
    has usually begun it already, and a second call returns at once with the socket still open."""
    async with trio.open_nursery() as nursery:
        for peer, conns in list(host.get_network().connections.items()):
            for conn in list(conns):
                nursery.start_soon(_close_muxed, peer, conn)


async def _close_muxed(peer: ID, conn: INetConn) -> None:
    try:
        await conn.muxed_conn.close()
    except Exception as exc:  # a half-dead connection fails to close in many ways; it is going anyway
        log.debug("closing the connection to %s: %r", peer, exc)


async def reannounce_subscription(pubsub: Pubsub, topic: str) -> None:
    """Send our SUBSCRIBE for ``topic`` to every peer with a stream now (idempotent on receivers)."""
    packet = rpc_pb2.RPC()
    packet.subscriptions.extend([rpc_pb2.RPC.SubOpts(subscribe=True, topicid=topic)])
    await pubsub.message_all_peers(packet.SerializeToString())


def encode_dht_key(text: str) -> bytes:
    from libp2p.kad_dht.kad_dht import _encode_key

    return _encode_key(text)


async def providers_from_peer(dht: KadDHT, peer: ID, key: bytes) -> tuple[list[PeerInfo], list[ID]]:
    """Ask one peer for the providers of ``key``: (providers, closer peers)."""
    return await dht.provider_store._get_providers_from_peer_with_closers(peer, key)


async def push_identify(host: IHost) -> None:
    """Identify push to every connected peer (best effort, never raises)."""
    from libp2p.identity.identify_push.identify_push import push_identify_to_peers

    try:
        await push_identify_to_peers(host)
    except Exception as exc:  # one unreachable peer must not stop the others' update
        log.debug("identify push: %r", exc)


def observed_external_addrs(host: IHost) -> list[Multiaddr]:
    """Addresses at least one peer observed us at (identify), or [] without the manager."""
    manager = getattr(host, "_observed_addr_manager", None)
    return list(manager.addrs(min_observers=1)) if manager is not None else []


addr_ip = _addr_ip
"""The IP of a multiaddr (None for other kinds), as AutoNAT compares them."""


class AutoNATBase(AutoNATService):
    """AutoNATService with its private hooks under public names: override :meth:`serve_dial` and
    :meth:`dial_back`; call ``stock_serve_dial`` for the library's request checks."""

    async def _handle_dial(self, message: AutoNATMessage, observed_ip: str | None,
                           is_relayed: bool) -> AutoNATMessage:
        return await self.serve_dial(message, observed_ip, is_relayed)

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        return await self.dial_back(peer_id, addrs)

    async def serve_dial(self, message: AutoNATMessage, observed_ip: str | None,
                         is_relayed: bool) -> AutoNATMessage:
        return await self.stock_serve_dial(message, observed_ip, is_relayed)

    async def stock_serve_dial(self, message: AutoNATMessage, observed_ip: str | None,
                               is_relayed: bool) -> AutoNATMessage:
        return await AutoNATService._handle_dial(self, message, observed_ip, is_relayed)

    async def dial_back(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        return await AutoNATService._try_dial(self, peer_id, addrs)


class DCUtRBase(DCUtRProtocol):
    """DCUtRProtocol with its private hooks and state under public names."""

    MAX_ATTEMPTS = _dcutr_module.MAX_HOLE_PUNCH_ATTEMPTS

    async def _auto_drive_loop(self) -> None:
        await self.auto_drive_loop()

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False
                                  ) -> bool:
        return await self.perform_hole_punch(peer_id, addrs, as_responder)

    async def _get_observed_addrs(self) -> list[bytes]:
        return await self.observed_addrs()

    async def auto_drive_loop(self) -> None:
        await DCUtRProtocol._auto_drive_loop(self)

    async def perform_hole_punch(self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False
                                 ) -> bool:
        return await DCUtRProtocol._perform_hole_punch(self, peer_id, addrs, as_responder)

    async def observed_addrs(self) -> list[bytes]:
        return await DCUtRProtocol._get_observed_addrs(self)

    def in_progress(self, peer: ID) -> bool:
        return peer in self._in_progress

    def settled(self, peer: ID) -> bool:
        """A punch to ``peer`` is running, succeeded, or used up its attempts: do not start one."""
        return (peer in self._in_progress or peer in self._direct_connections
                or self._hole_punch_attempts.get(peer, 0) >= self.MAX_ATTEMPTS)


class HopBase(CircuitV2Protocol):
    """CircuitV2Protocol (HOP side) with its CONNECT hook and reservation table under public names."""

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        await self.handle_connect(stream, msg)

    async def handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        await CircuitV2Protocol._handle_connect(self, stream, msg)

    async def send_status(self, stream: ReadWriteCloser, code: StatusCode, message: str) -> None:
        await self._send_status(stream, code, message)

    def reservations(self) -> list[Reservation]:
        """Live reservations (expired ones dropped first)."""
        rm = self.resource_manager
        rm._clean_expired()
        return list(rm._reservations.values())
