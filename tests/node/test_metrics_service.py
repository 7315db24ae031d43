"""The metrics service as an operator scrapes it: process and Python collectors beside the node's own
numbers, the fixed default port (and what happens when it is taken), and the Grafana dashboard in docs/
querying only metrics a node really exports."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from intellect_node.config import build_config
from intellect_node.config.status import StatusBoard
from intellect_node.errors import ConfigError
from intellect_node.node.metrics import DEFAULT_PORT, MetricsService
from tests.support.common import REPO
from tests.support.operator_node import FakeClock, busy_board


def _scrape_names(board: StatusBoard, **kw: Any) -> tuple[set[str], str]:
    async def go() -> tuple[set[str], str]:
        svc = MetricsService(board, port=0, **kw)
        await svc.start()
        try:
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(svc.url + "/metrics", timeout=5)
                                           .read().decode())
        finally:
            await svc.close()
        return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}, svc.url
    return asyncio.run(go())


def test_process_and_python_collectors_are_exported() -> None:
    names, _url = _scrape_names(busy_board(FakeClock()))
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 "python_info", "python_gc_collections_total", "intellect_node_peers"):
        assert name in names, name


def test_default_port_is_fixed_and_a_taken_one_is_named() -> None:
    assert build_config().metrics.port == DEFAULT_PORT == 29464
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        board = busy_board(FakeClock())

        async def start(chosen: bool) -> str:
            svc = MetricsService(board, port=port, port_chosen=chosen)
            await svc.start()
            await svc.close()
            return svc.url

        # the default taken (a second node on the machine): a free port instead, said in the log
        assert not asyncio.run(start(False)).endswith(f":{port}")
        # a port the operator chose: stop, naming the flag
        with pytest.raises(ConfigError) as info:
            asyncio.run(start(True))
        assert "--metrics-port" in str(info.value) and str(port) in str(info.value)


def test_every_metric_the_grafana_dashboard_queries_is_exported() -> None:
    dash = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(next(v["query"] for v in dash["templating"]["list"] if v["name"] == "instance"))
    queried = {m for e in exprs for m in re.findall(r"\b([a-z_][a-z0-9_]*)\s*\{", e)
               + re.findall(r"label_values\((\w+)", e)}
    assert len(queried) >= 15, queried
    names, _url = _scrape_names(busy_board(FakeClock()))
    assert queried <= names, sorted(queried - names)
