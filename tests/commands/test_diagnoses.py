"""Diagnoses that name the cause: a bootstrap address whose host answers with another peer ID is told
apart from one where nothing listens, in what `join` logs and what `doctor` reports (real hosts on
127.0.0.1)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from intellect_node.commands import doctor
from intellect_node.commands.checks import FAIL, OK, Check
from intellect_node.p2p.swarm import Swarm
from intellect_node.protocol.signing import SigningKey
from tests.support.ports import free_port
from tests.support.swarm import run, swarm_nodes

STALE = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # a peer ID nobody here has




def test_doctor_tells_another_peer_id_from_a_host_that_is_down() -> None:
    down = free_port()

    async def probe() -> tuple[str, list[Check]]:
        async with swarm_nodes(1) as (target,):
            host_port = target.listen_addrs()[0].split("/p2p/")[0]
            wrong = f"{host_port}/p2p/{STALE}"
            # another ID for the dead address: libp2p dials every address it knows for a peer ID
            gone = SigningKey.generate().peer_id
            checks = await doctor._probe([wrong, f"/ip4/127.0.0.1/tcp/{down}/p2p/{gone}",
                                          target.listen_addrs()[0]], {}, "test")
            return target.peer_id, checks

    real_id, checks = run(probe())
    boot = [c for c in checks if c.name == "bootstrap"]
    assert [c.status for c in boot] == [FAIL, FAIL, OK], boot
    assert f"answered as {real_id}, expected {STALE}" in boot[0].detail
    assert boot[0].detail.startswith("127.0.0.1:") and "peer ID" in boot[0].fix
    assert boot[1].detail.startswith(f"127.0.0.1:{down}: connection refused"), boot[1]


def test_join_logs_the_cause_of_a_failed_bootstrap(caplog: pytest.LogCaptureFixture) -> None:
    async def boot() -> tuple[str, list[str]]:
        async with swarm_nodes(1) as (target,):
            host_port = target.listen_addrs()[0].split("/p2p/")[0]
            sw = await Swarm.start(SigningKey.generate(), run_id="test", listen=["/ip4/127.0.0.1/tcp/0"])
            try:
                reached = await sw.bootstrap([f"{host_port}/p2p/{STALE}"], timeout=15)
            finally:
                await sw.close()
            return target.peer_id, reached

    with caplog.at_level(logging.WARNING, logger="intellect_node.p2p.swarm"):
        real_id, reached = run(boot())
    assert reached == []
    said = [r.getMessage() for r in caplog.records if r.name == "intellect_node.p2p.swarm"]
    assert any(f"answered as {real_id}, expected {STALE}" in m for m in said), said


def test_a_mistyped_environment_variable_names_the_one_that_works(tmp_path: Path) -> None:
    from intellect_node.config import load_config
    from intellect_node.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"INTELLECT_NODE_RUN__ID": "x"}, data_dir=tmp_path)
    assert "did you mean INTELLECT_NODE_RUN__RUN_ID?" in str(info.value)
    assert load_config(None, environ={"INTELLECT_NODE_RUN__RUN_ID": "x"}, data_dir=tmp_path).run.run_id == "x"


def test_model_eval_on_a_file_that_is_not_safetensors_is_a_message(tmp_path: Path) -> None:
    from tests.support.cli import invoke_cli

    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"not a checkpoint at all")
    r = invoke_cli("model", "eval", "--weights", str(bad), "--n", "2")
    assert r.returncode == 2 and "is not a safetensors file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = invoke_cli("model", "eval", "--weights", str(tmp_path), "--n", "2")
    assert r.returncode == 2 and "is a folder" in r.stderr, r.stderr


def test_model_info_prints_the_size_its_help_promises() -> None:
    from tests.support.cli import invoke_cli

    r = invoke_cli("model", "info")
    assert r.returncode == 0, r.stderr
    fields = dict(ln.split(None, 1) for ln in r.stdout.splitlines() if len(ln.split(None, 1)) == 2)
    assert int(fields["parameters"].replace(",", "")) > 100_000
    assert "MiB" in fields["size_bytes"]


def test_sweep_worker_and_coordinator_agree_on_the_default_run() -> None:
    import typer.main

    from intellect_node.cli import app
    from intellect_node.commands.sweep import SWEEP_RUN_ID

    sweep = typer.main.get_command(app).commands["sweep"]  # type: ignore[attr-defined]  # typer's group is a click Group
    defaults = {name: next(p.default for p in cmd.params if p.name == "run_id")
                for name, cmd in sweep.commands.items() if name in ("worker", "polysemanticity")}
    assert defaults == {"worker": SWEEP_RUN_ID, "polysemanticity": SWEEP_RUN_ID}


@pytest.mark.parametrize("command", [["join", "--headless"], ["keys", "init"], ["status"]])
def test_a_data_dir_that_cannot_be_created_is_a_message_naming_it(command: list[str]) -> None:
    from tests.support.cli import invoke_cli

    r = invoke_cli(*command, "--data-dir", "/proc/x/node")
    assert r.returncode == 2, r.stderr
    assert "--data-dir /proc/x/node" in r.stderr and "Traceback" not in r.stderr
