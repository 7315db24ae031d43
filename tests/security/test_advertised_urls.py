"""A malformed advertised URL must not crash a fetch.

A heartbeat's or node info's ``http_url`` is any peer's word. Decoding accepts only a plain HTTP(S) base
URL (``protocol.gossip.validate_http_url``), and whatever a provider's record holds, a fetch ends in a
``TransportError`` (a failed source), never in ``ValueError`` or ``UnicodeEncodeError`` out of the
validator's or the trainer's job. Property tests run random addresses through both."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intellect_node.blobs import fetch as fetch_mod
from intellect_node.blobs.fetch import Fetcher, Provider, StaticProvider
from intellect_node.blobs.http import HttpChunkSource
from intellect_node.blobs.store import BlobStore
from intellect_node.errors import ProtocolError, TransportError
from intellect_node.protocol import gossip
from intellect_node.protocol.signing import SigningKey

KEY = SigningKey.generate()
CID = "bafkreighx7ufhvwdm3a4u7uw6g7rrdrk2527at5kwsu277fnbpk2tfj7ki"

HOSTS = st.one_of(
    st.sampled_from(["127.0.0.1", "[::1]", "[x", "[::1", "ü.example", "exa mple", "a..b", "-a", "h", "",
                     "user@127.0.0.1", "[fe80::1%eth0]", "0.0.0.0", "xn--d1acpjx3f.xn--p1ai"]),
    st.text(min_size=0, max_size=20),
)
PORTS = st.one_of(st.just(""), st.sampled_from([":", ":0", ":1", ":80", ":65535", ":65536", ":+1", ": 1",
                                                ":1_0", ":٣"]), st.text(max_size=6).map(lambda t: ":" + t))
PATHS = st.one_of(st.just(""), st.sampled_from(["/", "/p", "/../x", "/a?b", "/#f", "/%2e", "/é"]),
                  st.text(max_size=12).map(lambda t: "/" + t))
URLS = st.one_of(
    st.builds(lambda s, h, p, q: f"{s}://{h}{p}{q}", st.sampled_from(["http", "https", "ftp", "HTTP"]),
              HOSTS, PORTS, PATHS),
    st.text(max_size=300),
)

KNOWN_BAD = ["http://[x", "http://ü/", "http://ü.example:80", "http://user:pw@127.0.0.1:1", "http://h:99999",
             "http://h:0", "http://h:+1", "http://h/../etc", "http://h:1?x=1", "http://h:1#f", "http://[::1",
             "http://h:", "ftp://h", "http://" + "a" * 300]


@pytest.mark.parametrize("url", KNOWN_BAD)
def test_known_bad_urls_are_refused_at_decode(url: str) -> None:
    with pytest.raises(ProtocolError):
        gossip.validate_http_url(url)
    with pytest.raises(ProtocolError):
        gossip.open_heartbeat(_heartbeat(url), run_id="r1", now_ms=int(time.time() * 1000))


def _heartbeat(url: str) -> bytes:
    hb = gossip.Heartbeat(run_id="r1", seq=1, time_ms=int(time.time() * 1000), http_url=url, listen_addrs=[])
    return KEY.seal(gossip.HEARTBEAT_DOMAIN, hb)


@settings(max_examples=400, deadline=None)
@given(URLS)
def test_decode_raises_only_protocol_error_and_accepts_only_usable_urls(url: str) -> None:
    try:
        hb, _ = gossip.open_heartbeat(_heartbeat(url), run_id="r1", now_ms=int(time.time() * 1000))
    except ProtocolError:
        return
    accepted = hb.http_url
    assert accepted == "" or accepted == url
    if accepted:
        parts = urlsplit(accepted)  # parses
        assert parts.scheme in ("http", "https") and parts.hostname and not parts.username
        assert parts.hostname.isascii() and not parts.query and not parts.fragment
        accepted.encode("ascii")
        assert parts.port is None or 0 < parts.port <= 65535
        # The client either uses it or says why not, as a transport error.
        try:
            HttpChunkSource._parse(accepted)
        except TransportError:
            assert accepted.startswith("https://")


class _Exploding:
    """A chunk source whose provider record makes it fail in ways no provider should be able to cause."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def accepts(self, provider: object) -> bool:
        return True

    async def get_manifest(self, provider: object, cid: str) -> bytes:
        raise self.exc

    async def get_have(self, provider: object, manifest_cid: str) -> bytes:
        raise self.exc

    async def read_chunk(self, provider: object, cid: str, length: int, sink: object) -> None:
        raise self.exc


def _fetcher(tmp: Path, providers: Sequence[Provider], sources: list[object]) -> Fetcher:
    async def find(cid: str) -> Sequence[Provider]:
        return list(providers)

    return Fetcher(BlobStore(tmp), sources, find, find_timeout=0.0)  # type: ignore[arg-type]  # a stand-in for it


@pytest.mark.parametrize("exc", [ValueError("Invalid IPv6 URL"), UnicodeEncodeError("ascii", "ü", 0, 1, "no"),
                                 KeyError("x"), AssertionError()])
def test_a_provider_failing_oddly_is_a_failed_source(tmp_path: Path, exc: BaseException,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_mod, "REDISCOVER_ROUNDS", 1)
    f = _fetcher(tmp_path, [StaticProvider("p1", "http://127.0.0.1:9")], [_Exploding(exc)])
    with pytest.raises(TransportError):
        asyncio.run(f.fetch(CID))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(URLS)
def test_fetch_from_any_advertised_address_ends_in_transport_error(tmp_path: Path, url: str) -> None:
    """Whatever URL a provider record holds (not even checked at decode here: an older peerbook entry,
    another source), the HTTP source refuses it or fails to connect: a TransportError."""
    saved = fetch_mod.REDISCOVER_ROUNDS
    fetch_mod.REDISCOVER_ROUNDS = 1
    src = HttpChunkSource(connect_timeout=0.2, read_timeout=0.5)
    # Never a real name lookup: every host is handled as if its resolution failed, except addresses.
    try:
        f = _fetcher(tmp_path / "s", [StaticProvider("p1", url)], [src])

        async def run() -> None:
            loop = asyncio.get_running_loop()
            real = loop.getaddrinfo

            async def no_dns(host: str, *a: object, **k: object) -> object:
                if host.replace(".", "").isdigit() or ":" in host:
                    return await real(host, *a, **k)  # type: ignore[arg-type]  # getaddrinfo's own arguments, passed on
                raise OSError("no name lookups in this test")

            loop.getaddrinfo = no_dns  # type: ignore[method-assign, assignment]  # IP literals only, no DNS
            with pytest.raises(TransportError):
                await f.fetch(CID)

        asyncio.run(run())
    finally:
        fetch_mod.REDISCOVER_ROUNDS = saved
        src.close()
