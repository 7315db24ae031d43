"""The local control API: an aiohttp app on 127.0.0.1 that the CLI uses to talk to a running node.

``<data-dir>/control.json`` (mode 0600) holds ``{"url": "http://127.0.0.1:<port>", "token": "...",
"pid": N}``; every request needs ``Authorization: Bearer <token>``. The file is written once the node is
up and removed when it stops, so its absence means "no node running here". Other parts add their own
routes (``/v1/blob/...``, ``/v1/ledger/...``) through the runtime's service seam.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from intellect_node.errors import ConfigError, TransportError
from intellect_node.fsutil import atomic_write_text

if TYPE_CHECKING:  # aiohttp costs ~0.6 s to import; the CLI client side below does not need it
    from aiohttp import web

CONTROL_FILE = "control.json"
MAX_CONTROL_FILE = 4096


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_control_file(data_dir: Path, url: str, token: str) -> Path:
    path = data_dir / CONTROL_FILE
    atomic_write_text(path, json.dumps({"url": url, "token": token, "pid": os.getpid()}) + "\n", mode=0o600)
    return path


def remove_control_file(data_dir: Path, token: str) -> None:
    """Remove control.json if it is still ours (a newer node may have replaced it)."""
    path = data_dir / CONTROL_FILE
    try:
        if json.loads(path.read_text()).get("token") == token:
            path.unlink()
    except (OSError, ValueError):
        pass


def read_control_file(data_dir: Path) -> tuple[str, str]:
    """``(url, token)`` of the node running with ``data_dir``; ConfigError if there is none."""
    path = data_dir / CONTROL_FILE
    if not path.exists():
        raise ConfigError(f"no node is running with --data-dir {data_dir} (no {CONTROL_FILE}); start one "
                          f"with `intellect-node join --data-dir {data_dir}`", field="data_dir")
    try:
        raw = path.read_bytes()[:MAX_CONTROL_FILE]
        doc = json.loads(raw)
        url, token = doc["url"], doc["token"]
        if not (isinstance(url, str) and url.startswith("http://127.0.0.1:") and isinstance(token, str)):
            raise ValueError("unexpected url or token")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is damaged ({exc}); stop the node and start it again",
                          field="data_dir") from exc
    return url, token


def request(data_dir: Path, method: str, path: str, body: object = None, *, timeout: float = 10.0) -> Any:
    """Call the control API of the node running with ``data_dir``; returns the decoded JSON answer.

    ConfigError when no node answers (so the CLI exits 2 with a hint), TransportError for other failures.
    """
    url, token = read_control_file(data_dir)
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode("utf-8", "replace")
        raise TransportError(f"node answered {exc.code} to {method} {path}: {detail}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise ConfigError(f"the node of --data-dir {data_dir} does not answer at {url} ({exc}); it may "
                          f"have stopped: start it with `intellect-node join --data-dir {data_dir}`",
                          field="data_dir") from exc


def control_app(token: str, *, status: Callable[[], Mapping[str, object]],
                stop: Callable[[], None]) -> web.Application:
    """The control app: token check, ``GET /v1/status``, ``POST /v1/stop``; more routes via the seam."""
    from aiohttp import web

    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request,
                   handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "missing or wrong token (see control.json)"}, status=401)
        return await handler(request)

    async def get_status(_request: web.Request) -> web.Response:
        return web.json_response(status())

    async def post_stop(_request: web.Request) -> web.Response:
        stop()
        return web.json_response({"stopping": True})

    app = web.Application(middlewares=[auth], client_max_size=1 << 20)
    app.router.add_get("/v1/status", get_status)
    app.router.add_post("/v1/stop", post_stop)
    return app
