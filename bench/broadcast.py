"""Broadcast benchmark: one origin publishes a checkpoint, N peers fetch it at once, on loopback.

Three transfers of the same file in the same run, each with one origin process and N peer processes
that start together on a "go" line (process start-up and imports are not timed):

- ``intellect``: ``intellect_node.blobs.peer`` processes. The origin has published the file (3 MiB
  chunks by default, signed manifest). Each peer fetches the blob with the origin *and the other peers* as
  providers (swarming: a peer serves what it holds while still downloading), checks every chunk's
  hash (BLAKE3, what its CID names) on arrival, commits it (rename; fsync batched after the fetch) and
  finally writes the assembled file.
  Provider discovery is static here (the DHT lookup, about 0.6 s on this machine, is measured by the
  swarm tests, not here).
- ``shardcast``: shardcast 0.3.2 (``pip install -e '.[bench]'``), origin ``OriginServer`` +
  ``broadcast()``, each peer a ``ClientNode.download_version()`` (wget per 50 MB shard, one blake3 of the
  whole file after reassembly). Two fixed scratch paths of its client (``/tmp/dummy.bin`` and
  ``site-packages/temp_distribution.txt``) collide when several clients share one machine, so the driver
  gives each client its own; its server is bound to 127.0.0.1 instead of 0.0.0.0. Nothing else changes.
- ``raw TCP``: the origin ``sendfile``s the file to each peer over a plain socket, peers write it to disk;
  no hashing, no fsync: the ceiling.

Time-to-all runs from the "go" until the last peer holds the complete, verified checkpoint: for
``intellect`` every chunk in its store (where the node serves and loads it from); ``intellect+file`` adds
writing the assembled file (``blob get -o``: copy_file_range + fsync + atomic rename); for shardcast the
reassembled file after its blake3 check; for raw TCP the written file. Aggregate throughput = N x size /
time-to-all (MB = 10^6 bytes). After each transfer every output is hashed and compared with the source,
outside the timed region. "CPU s/GB" is the CPU time (user + system, from /proc) that all processes of a
transfer used inside the timed region per GB delivered: on a shared, loaded machine it is steadier than
wall time.

Run: ``.venv/bin/python bench/broadcast.py [--size-mib 256] [--peers 4]``. Files go to a temp dir that is
removed at the end (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PY = sys.executable
HERE = Path(__file__).resolve()
MIB = 1 << 20
CPU: dict[str, float] = {}  # transfer -> CPU seconds of all its processes during the timed region


# -- child processes ---------------------------------------------------------------------------------

class Child:
    """A child process speaking JSON lines on stdout; commands on stdin."""

    def __init__(self, args: list[str], cwd: Path | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=cwd)
        self.skipped: list[dict[str, Any]] = []  # events read_until passed over (a peer's chunk events)

    def cpu(self) -> float:
        """CPU seconds this process and its waited-for children (shardcast's wget) have used so far."""
        fields = Path(f"/proc/{self.p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def send(self, obj: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        self.p.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"child {self.p.args!r} exited with {self.p.wait()}")
            line = line.strip()
            if line.startswith("{"):
                ev: dict[str, Any] = json.loads(line)
                return ev

    def read_until(self, kinds: set[str]) -> dict[str, Any]:
        while (ev := self.read()).get("event") not in kinds:
            self.skipped.append(ev)
        return ev

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                assert self.p.stdin is not None
                self.p.stdin.close()
                self.p.wait(timeout=30)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.p.kill()  # our own child, by its Popen handle (PID)
                self.p.wait()


def _fetch_all(kids: list[Child], cid: str, providers: list[dict[str, str]], root: Path,
               cpu: list[Child] | None = None) -> tuple[list[dict[str, Any]], float, float, float]:
    """Every peer fetches ``cid`` from ``providers`` at once, then writes the assembled file:
    ``(done events, seconds to all verified, seconds including the files, CPU s of cpu's processes
    during the fetch)``; RuntimeError if a peer's fetch failed."""
    cpu0 = sum(c.cpu() for c in cpu or [])
    t0 = time.perf_counter()
    for k in kids:
        k.send({"op": "fetch", "cid": cid, "providers": providers})
    done = _wait_all(kids, {"done", "error"})
    elapsed = time.perf_counter() - t0
    cpu_s = sum(c.cpu() for c in cpu or []) - cpu0
    for i, k in enumerate(kids):
        k.send({"op": "export", "cid": cid, "out": str(root / f"out{i}.bin")})
    _wait_all(kids, {"exported"})
    with_export = time.perf_counter() - t0
    for ev in done:
        if ev["event"] != "done":
            raise RuntimeError(f"intellect fetch failed: {ev}")
    return done, elapsed, with_export, cpu_s


def _wait_all(children: list[Child], kinds: set[str]) -> list[dict[str, Any]]:
    """Read each child's next matching event in parallel threads (so no pipe backs up)."""
    out: list[dict[str, Any] | None] = [None] * len(children)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = children[i].read_until(kinds)
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(children))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [o for o in out if o is not None]


# -- the three transfers -----------------------------------------------------------------------------

def run_intellect(src: Path, work: Path, peers: int, chunk_mib: int, *, label: str = "intellect",
                  origin_only: bool = False) -> tuple[float, float]:
    """(time until every peer holds every chunk, verified; time until each also wrote the file)."""
    root = work / label.replace(" ", "-")
    origin = Child([PY, "-m", "intellect_node.blobs.peer", "--root", str(root / "origin")])
    kids: list[Child] = []
    try:
        hello = origin.read_until({"listening"})
        origin.send({"op": "put", "path": str(src), "chunk_size": chunk_mib * MIB})
        cid = origin.read_until({"put"})["cid"]
        kids = [Child([PY, "-m", "intellect_node.blobs.peer", "--root", str(root / f"peer{i}")])
                for i in range(peers)]
        hellos = _wait_all(kids, {"listening"})
        everyone = [{"peer_id": h["peer_id"], "http_url": h["url"]} for h in [hello, *hellos]]
        origin_cpu0 = origin.cpu()
        t0 = time.monotonic()
        done, elapsed, with_export, CPU[label] = _fetch_all(
            kids, cid, everyone[:1] if origin_only else everyone, root, cpu=[origin, *kids])
        firsts = sorted(min(ev["t"] for ev in k.skipped if ev.get("event") == "chunk") - t0 for k in kids)
        ends = ", ".join(f"{ev['seconds']:.2f}" for ev in done)
        print(f"  {label}: first chunk at {', '.join(f'{x:.2f}' for x in firsts)} s; peers done at "
              f"{ends} s; origin CPU "
              f"{origin.cpu() - origin_cpu0:.2f} s of {CPU[label]:.2f} s", flush=True)
        from_peers = sum(n for ev in done for p, n in ev["by_provider"].items() if p != hello["peer_id"])
        total = sum(sum(ev["by_provider"].values()) for ev in done)
        dups = sum(ev.get("endgame_requests", 0) for ev in done)
        print(f"  {label}: {from_peers}/{total} chunks came from other peers; {dups} end-game duplicate "
              "requests", flush=True)
    finally:
        for k in [*kids, origin]:
            k.close()
    _verify(src, [root / f"out{i}.bin" for i in range(peers)])
    return elapsed, with_export


def run_shardcast(src: Path, work: Path, peers: int) -> float:
    root = work / "shardcast"
    origin = Child([PY, str(HERE), "--role", "sc-origin", "--src", str(src), "--dir", str(root / "origin")])
    kids: list[Child] = []
    try:
        hello = origin.read_until({"ready"})
        kids = []
        for i in range(peers):  # started one by one: its client probes the server at construction
            k = Child([PY, str(HERE), "--role", "sc-client", "--url", hello["url"], "--dir",
                       str(root / f"peer{i}"), "--version-name", hello["version"]])
            k.read_until({"ready"})
            kids.append(k)
        cpu0 = sum(c.cpu() for c in [origin, *kids])
        t0 = time.perf_counter()
        for k in kids:
            k.send("go")
        done = _wait_all(kids, {"done"})
        elapsed = time.perf_counter() - t0
        CPU["shardcast"] = sum(c.cpu() for c in [origin, *kids]) - cpu0
        if not all(ev["ok"] for ev in done):
            raise RuntimeError(f"shardcast download failed: {done}")
    finally:
        for k in [*kids, origin]:
            k.close()
    _verify(src, [root / f"peer{i}" / "out.bin" for i in range(peers)])
    return elapsed


def run_tcp(src: Path, work: Path, peers: int) -> float:
    root = work / "tcp"
    root.mkdir(parents=True)
    origin = Child([PY, str(HERE), "--role", "tcp-origin", "--src", str(src)])
    kids: list[Child] = []
    try:
        port = origin.read_until({"ready"})["port"]
        kids = [Child([PY, str(HERE), "--role", "tcp-client", "--port", str(port), "--out",
                       str(root / f"out{i}.bin"), "--size", str(src.stat().st_size)]) for i in range(peers)]
        _wait_all(kids, {"ready"})
        cpu0 = sum(c.cpu() for c in [origin, *kids])
        t0 = time.perf_counter()
        for k in kids:
            k.send("go")
        _wait_all(kids, {"done"})
        elapsed = time.perf_counter() - t0
        CPU["raw TCP"] = sum(c.cpu() for c in [origin, *kids]) - cpu0
    finally:
        for k in [*kids, origin]:
            k.close()
    _verify(src, [root / f"out{i}.bin" for i in range(peers)])
    return elapsed


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(4 * MIB):
            h.update(piece)
    return h.hexdigest()


def _verify(src: Path, outs: list[Path]) -> None:
    want = _sha256(src)
    for o in outs:
        if _sha256(o) != want:
            raise RuntimeError(f"{o} differs from the source")


# -- roles run in child processes --------------------------------------------------------------------

def role_tcp_origin(src: Path) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"event": "ready", "port": srv.getsockname()[1]}), flush=True)

    def serve(conn: socket.socket) -> None:
        with conn, open(src, "rb") as f:
            conn.sendfile(f)

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()  # until the bench closes our stdin
    srv.close()


def role_tcp_client(port: int, out: Path, size: int) -> None:
    print(json.dumps({"event": "ready"}), flush=True)
    sys.stdin.readline()
    buf = bytearray(MIB)
    view = memoryview(buf)
    got = 0
    with socket.create_connection(("127.0.0.1", port)) as s, open(out, "wb") as f:
        while got < size:
            n = s.recv_into(view)
            if not n:
                break
            f.write(view[:n])
            got += n
    print(json.dumps({"event": "done", "bytes": got}), flush=True)
    sys.stdin.read()  # stay alive until the bench has read our CPU time


def _bind_shardcast_to(host: str) -> int:
    """Bind shardcast's servers to ``host`` (it binds 0.0.0.0) and pick a free port there."""
    import shardcast.server as sc_server

    base_init = sc_server.ShardcastServer.__init__

    def bound_init(self: Any, address: tuple[str, int], *a: Any, **k: Any) -> None:
        base_init(self, (host, address[1]), *a, **k)

    sc_server.ShardcastServer.__init__ = bound_init
    with socket.create_server((host, 0)) as probe:
        port: int = probe.getsockname()[1]
    return port


def role_sc_origin(src: Path, d: Path, host: str) -> None:
    from shardcast import OriginServer

    port = _bind_shardcast_to(host)
    d.mkdir(parents=True)
    (d / "data1.bin").write_bytes(b"\0" * 1024)  # its client fetches this probe file from every server
    origin = OriginServer(str(d), port)
    version = origin.broadcast(str(src))
    print(json.dumps({"event": "ready", "url": f"http://{host}:{port}", "version": version}), flush=True)
    sys.stdin.read()
    origin.shutdown()


def role_sc_middle(upstream: str, d: Path, host: str, version: str) -> None:
    """shardcast's relay (``MiddleNode``): serves its directory from the start (clients probe it at
    construction); on "go" it starts pulling every shard from ``upstream`` and serving them as they land."""
    import shardcast.middle_node as sc_middle
    import shardcast.server as sc_server

    port = _bind_shardcast_to(host)
    d.mkdir(parents=True)
    (d / "data1.bin").write_bytes(b"\0" * 1024)
    started = sc_server.run_server(str(d), port)
    sc_middle.server.run_server = lambda *a, **k: started
    print(json.dumps({"event": "ready", "url": f"http://{host}:{port}"}), flush=True)
    sys.stdin.readline()
    node = sc_middle.MiddleNode([upstream], str(d), port, check_interval=1)
    while version not in node.processed_versions:
        time.sleep(0.05)
    print(json.dumps({"event": "done", "ok": True}), flush=True)
    sys.stdin.read()


def role_sc_client(url: str, d: Path, version: str) -> None:
    from shardcast import ClientNode
    from shardcast import client as sc_client

    d.mkdir(parents=True)
    scratch = d / "scratch"
    scratch.mkdir()

    # Same logic as ShardDownloader's two methods, with per-client scratch paths instead of fixed ones.
    def init_metrics(self: Any) -> None:
        for server in self.servers:
            tmp = scratch / "dummy.bin"
            if not self._download_file(server, "data1.bin", tmp):
                raise RuntimeError(f"Failed to download dummy file from {server}")
            tmp.unlink()

    def download_distribution_file(self: Any) -> str | None:
        tmp = str(scratch / "temp_distribution.txt")
        if self.download_file("distribution.txt", tmp, update_metrics=False, log_error_on_failure=False):
            with open(tmp) as f:
                content = f.read()
            os.unlink(tmp)
            return content
        return None

    sc_client.ShardDownloader._init_server_metrics = init_metrics
    sc_client.ShardDownloader.download_distribution_file = download_distribution_file
    node = ClientNode(url.split(","), output_dir=str(d))  # one server, or the origin and its relays
    print(json.dumps({"event": "ready"}), flush=True)
    sys.stdin.readline()
    out = node.download_version(version, str(d / "out.bin"))
    print(json.dumps({"event": "done", "ok": out is not None}), flush=True)
    sys.stdin.read()


# -- main --------------------------------------------------------------------------------------------

def _make_source(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 4 * MIB)
            f.write(os.urandom(n))
            left -= n


def main() -> None:
    ap = argparse.ArgumentParser(description="Broadcast benchmark (see the module docstring).")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--chunk-mib", type=int, default=3)
    ap.add_argument("--skip-shardcast", action="store_true")
    ap.add_argument("--origin-only", action="store_true",
                    help="also run intellect with the origin as the only provider (no swarming)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    # Child roles (internal).
    ap.add_argument("--role", default="")
    ap.add_argument("--src", type=Path)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--url", default="")
    ap.add_argument("--version-name", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--size", type=int, default=0)
    args = ap.parse_args()
    if args.role == "tcp-origin":
        return role_tcp_origin(args.src)
    if args.role == "tcp-client":
        return role_tcp_client(args.port, args.out, args.size)
    if args.role == "sc-origin":
        return role_sc_origin(args.src, args.dir, args.host)
    if args.role == "sc-middle":
        return role_sc_middle(args.url, args.dir, args.host, args.version_name)
    if args.role == "sc-client":
        return role_sc_client(args.url, args.dir, args.version_name)

    size = args.size_mib * MIB
    work = Path(tempfile.mkdtemp(prefix="intellect-broadcast-"))
    try:
        src = work / "checkpoint.bin"
        _make_source(src, size)
        print(f"broadcast: {args.size_mib} MiB to {args.peers} peers at once on 127.0.0.1, "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
        results: dict[str, float] = {}
        results["raw TCP"] = run_tcp(src, work, args.peers)
        results["intellect"], results["intellect+file"] = run_intellect(src, work, args.peers, args.chunk_mib)
        if args.origin_only:
            results["intellect star"], _ = run_intellect(src, work, args.peers, args.chunk_mib,
                                                         label="intellect star", origin_only=True)
        if not args.skip_shardcast:
            results["shardcast"] = run_shardcast(src, work, args.peers)
        total_mb = args.peers * size / 1e6
        print(f"\n{'transfer':<16}{'time-to-all s':>15}{'aggregate MB/s':>16}{'CPU s/GB':>10}")
        for name, t in results.items():
            cpu = f"{CPU[name] / (total_mb / 1000):>10.2f}" if name in CPU else f"{'':>10}"
            print(f"{name:<16}{t:>15.2f}{total_mb / t:>16.0f}{cpu}")
        ours = total_mb / results["intellect"]
        print(f"\nintellect / raw TCP ceiling: {ours / (total_mb / results['raw TCP']):.2f}x (aim >= 0.5)")
        if "shardcast" in results:
            print(f"intellect / shardcast 0.3.2: {ours / (total_mb / results['shardcast']):.2f}x (aim >= 5)")
            print(f"intellect+file / shardcast 0.3.2: "
                  f"{results['shardcast'] / results['intellect+file']:.2f}x")
        print("every output matched the source's sha2-256; intellect checked every chunk on arrival")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
