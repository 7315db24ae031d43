"""Network-namespace topologies for the NAT tests and bench/nat.py (Linux, root, iproute2, iptables).

Test harness (``intellect_node.testing``), never imported by the node.

    public bridge 100.64.77.0/24 (namespace <p>-br holds bridge br0)
      +-- <p>-pubK   100.64.77.(10+K)        public hosts (relay, AutoNAT servers, DHT peers)
      +-- <p>-natJ   wan 100.64.77.(100+J)   NAT router: MASQUERADE out of wan, new inbound dropped
            +-- <p>-privJ  10.J.0.2 (router 10.J.0.1 on lan)

Every namespace name starts with a unique prefix; interfaces are created directly inside the namespaces
(``ip -n A link add ... peer ... netns B``), so nothing touches the root namespace, and deleting the
namespaces deletes every link and rule. ``Topology.close()`` ends the processes it started (by PID),
deletes the namespaces and asserts none with its prefix is left. The address ranges exist only inside
these namespaces: no traffic leaves them.

A NAT "drops new inbound": FORWARD and INPUT accept only ESTABLISHED/RELATED packets arriving on wan, so
unsolicited SYNs vanish (no RST). ``port_preserving=False`` adds ``--random-fully`` to MASQUERADE: every
new flow gets a random external port, which defeats hole punching by design.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from intellect_node.node.processes import http_get_in as http_get_in  # re-exported: the NAT tests' import

PUBLIC_NET = "100.64.77"
AGENT_MODULE = "intellect_node.testing.nat_agent"
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder holding the ``intellect_node`` package: on the agents' ``PYTHONPATH`` (a source checkout
needs it; an installed package is found without it)."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can (probed, not guessed)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the NAT tests as root, e.g. in CI)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 iptables)"
    name = f"inprobe{secrets.token_hex(3)}"
    try:
        r = _run("ip", "netns", "add", name, check=False)
        if r.returncode != 0:
            return f"`ip netns add` failed: {r.stderr.strip()}"
        r = _run("ip", "netns", "exec", name, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "lo",
                 "-j", "MASQUERADE", check=False)
        if r.returncode != 0:
            return f"iptables NAT does not work in a namespace: {r.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


class Agent:
    """A node process (:mod:`intellect_node.testing.nat_agent`) in a namespace, driven by JSON lines on
    stdin/stdout."""

    def __init__(self, topo: "Topology", ns: str, name: str, args: list[str]) -> None:
        self.name = name
        self.ns = ns
        # `ip netns exec` execs (no fork), and the venv's python is a symlink, not a forking shim: the
        # PID we hold is the node's own, so ending it by PID leaves nothing behind in the namespace.
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-u", "-m", AGENT_MODULE, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(topo.log_path(name), "w"),
            text=True, bufsize=1, env={**os.environ, "PYTHONPATH": SOURCE_ROOT, "OMP_NUM_THREADS": "1"})
        topo.procs.append(self.proc)
        self._lines: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._next = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._reader, daemon=True).start()
        self.peer_id = ""
        self.addrs: list[str] = []

    def wait_ready(self, timeout: float = 90.0) -> "Agent":
        ready = self.wait_event("ready", timeout=timeout)
        self.peer_id = ready["peer_id"]
        self.addrs = ready["addrs"]
        return self

    def _reader(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "reply_to" in msg:
                    self._replies[msg["reply_to"]] = msg
                else:
                    self.events.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_event(self, kind: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events:
                    if ev.get("event") == kind and all(ev.get(k) == v for k, v in match.items()):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"{self.name}: no {kind!r} event {match} within {timeout}s "
                                         f"(exit code {self.proc.poll()})")
                self._cond.wait(min(left, 0.2))

    def call(self, op: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        """Send one command and wait for its reply; raise if it failed."""
        self._next += 1
        rid = self._next
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        with self._cond:
            while rid not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"{self.name}: {op} got no reply within {timeout}s "
                                         f"(exit code {self.proc.poll()})")
                self._cond.wait(min(left, 0.2))
            reply = self._replies.pop(rid)
        if not reply.get("ok"):
            raise AssertionError(f"{self.name}: {op} failed: {reply.get('error')}")
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@dataclass
class Topology:
    """A public bridge, public hosts and NATed hosts; use as a context manager."""

    n_public: int = 3
    nats: tuple[bool, ...] = (True, True)
    """One entry per NAT site: True keeps source ports (hole-punch friendly), False randomises them."""
    firewalled_public: int = 0
    """Extra public hosts whose firewall drops new inbound TCP (AutoNAT must call them PRIVATE)."""
    prefix: str = field(default_factory=lambda: f"in{secrets.token_hex(3)}")
    log_dir: Path | None = None
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    public_ns: list[str] = field(default_factory=list)
    private_ns: list[str] = field(default_factory=list)

    # --- addresses ---------------------------------------------------------------------------------

    @staticmethod
    def public_ip(k: int) -> str:
        return f"{PUBLIC_NET}.{10 + k}"

    @staticmethod
    def nat_wan_ip(j: int) -> str:
        return f"{PUBLIC_NET}.{101 + j}"

    @staticmethod
    def private_ip(j: int) -> str:
        return f"10.{j + 1}.0.2"

    def log_path(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.log"

    # --- building ----------------------------------------------------------------------------------

    def _ns(self, name: str) -> str:
        full = f"{self.prefix}-{name}"
        _run("ip", "netns", "add", full)
        self.namespaces.append(full)
        _run("ip", "-n", full, "link", "set", "lo", "up")
        return full

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        _run("ip", "-n", ns_a, "link", "add", if_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        _run("ip", "-n", ns_a, "link", "set", if_a, "up")
        _run("ip", "-n", ns_b, "link", "set", if_b, "up")

    def _ipt(self, ns: str, *rule: str) -> None:
        _run("ip", "netns", "exec", ns, "iptables", *rule)

    def __enter__(self) -> Self:
        if self.log_dir is None:
            self.log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"{self.prefix}-logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        br = self._ns("br")
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        hosts = [("pub", k, False) for k in range(self.n_public)]
        hosts += [("fw", k, True) for k in range(self.firewalled_public)]
        for idx, (kind, k, firewalled) in enumerate(hosts):
            ns = self._ns(f"{kind}{k}")
            self._veth(ns, "eth0", br, f"p{idx}")
            _run("ip", "-n", br, "link", "set", f"p{idx}", "master", "br0")
            _run("ip", "-n", ns, "addr", "add", f"{self.public_ip(idx)}/24", "dev", "eth0")
            if firewalled:
                self._ipt(ns, "-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate",
                          "ESTABLISHED,RELATED", "-j", "ACCEPT")
                self._ipt(ns, "-A", "INPUT", "-i", "eth0", "-j", "DROP")
            self.public_ns.append(ns)
        for j, port_preserving in enumerate(self.nats):
            router = self._ns(f"nat{j}")
            host = self._ns(f"priv{j}")
            self._veth(router, "wan", br, f"n{j}")
            _run("ip", "-n", br, "link", "set", f"n{j}", "master", "br0")
            _run("ip", "-n", router, "addr", "add", f"{self.nat_wan_ip(j)}/24", "dev", "wan")
            self._veth(router, "lan", host, "eth0")
            _run("ip", "-n", router, "addr", "add", f"10.{j + 1}.0.1/24", "dev", "lan")
            _run("ip", "-n", host, "addr", "add", f"{self.private_ip(j)}/24", "dev", "eth0")
            _run("ip", "-n", host, "route", "add", "default", "via", f"10.{j + 1}.0.1")
            _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            masq = ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
            self._ipt(router, *(masq if port_preserving else [*masq, "--random-fully"]))
            for chain in ("FORWARD", "INPUT"):
                self._ipt(router, "-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate",
                          "ESTABLISHED,RELATED", "-j", "ACCEPT")
                self._ipt(router, "-A", chain, "-i", "wan", "-j", "DROP")
            self.private_ns.append(host)

    def firewall(self, ns: str, on: bool) -> None:
        """Drop (or stop dropping) new inbound connections to a public host; established ones pass."""
        op = "-I" if on else "-D"
        self._ipt(ns, op, "INPUT", "-i", "eth0", "-p", "tcp", "-m", "conntrack", "--ctstate", "NEW",
                  "-j", "DROP")

    # --- processes ---------------------------------------------------------------------------------

    def spawn(self, ns: str, name: str, argv: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[str]:
        """Start ``argv`` (a real executable, not a forking shim) in ``ns``; output goes to its log."""
        log = open(self.log_path(name), "w")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.procs.append(proc)
        return proc

    def run_in(self, ns: str, argv: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run a command to completion inside ``ns``."""
        return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def agent(self, ns: str, name: str, *args: str) -> Agent:
        """Start an agent; call ``wait_ready()`` on it (start several first: they import in parallel)."""
        return Agent(self, ns, name, list(args))

    # --- teardown ----------------------------------------------------------------------------------

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
        problems = []
        for ns in self.namespaces:
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            if pids:
                problems.append(f"processes left in {ns}: {pids}")
        for ns in reversed(self.namespaces):
            _run("ip", "netns", "del", ns, check=False)
        left = [n for n in _run("ip", "netns", "list").stdout.split() if n.startswith(self.prefix)]
        if left:
            problems.append(f"namespaces left behind: {left}")
        self.namespaces.clear()
        assert not problems, "; ".join(problems)

    def __exit__(self, *exc: object) -> None:
        self.close()


STAR_NET = "100.64.78"


@dataclass
class Star(Topology):
    """Hosts on one bridge, each behind a link shaped to ``rate_mbit`` each way (bench/broadcast_links.py).

        namespace <p>-br holds bridge br0
          +-- <p>-hK   eth0 100.64.78.(10+K)   uplink: tbf on eth0; downlink: tbf on the bridge port sK

    ``tc`` token-bucket shaping (``tbf``) on both ends of every host's veth: egress on the host's eth0 is
    what the host can send (its uplink), egress on the bridge's port towards it is what it can receive
    (its downlink), so a host with many peers still shares one link each way, as behind a real access
    line. No delay is added (``netem`` is not available here); the queue tbf keeps is bounded by
    ``queue_ms``. ``rate_mbit=0`` leaves the links unshaped.
    """

    hosts: int = 2
    rate_mbit: float = 100.0
    queue_ms: int = 50
    """tbf ``latency``: how long a packet may wait in the shaper's queue before it is dropped (what a
    home router's buffer holds; TCP sees drops, not an unbounded queue)."""
    n_public: int = 0
    nats: tuple[bool, ...] = ()
    host_ns: list[str] = field(default_factory=list)

    @staticmethod
    def ip(k: int) -> str:
        return f"{STAR_NET}.{10 + k}"

    def _shape(self, ns: str, dev: str) -> None:
        if not self.rate_mbit:
            return
        # burst: at least one rate/HZ worth of bytes and a few 64 KiB GSO segments (tbf splits larger
        # segments, but a burst below one segment would stall a veth that hands it TSO-sized packets).
        burst = max(256 * 1024, int(self.rate_mbit * 1e6 / 8 / 100))
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
             f"{self.rate_mbit}mbit", "burst", str(burst), "latency", f"{self.queue_ms}ms")

    def _build(self) -> None:
        if self.rate_mbit and shutil.which("tc") is None:
            raise RuntimeError("`tc` is not installed (apt-get install iproute2)")
        br = self._ns("br")
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for k in range(self.hosts):
            ns = self._ns(f"h{k}")
            self._veth(ns, "eth0", br, f"s{k}")
            _run("ip", "-n", br, "link", "set", f"s{k}", "master", "br0")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(k)}/24", "dev", "eth0")
            self._shape(ns, "eth0")
            self._shape(br, f"s{k}")
            self.host_ns.append(ns)
