"""``intellect-node run init``: operator mistakes exit 2 naming the flag and the fix, before any
minutes of work; a run where nothing is learnable is refused (exit 2) unless ``--allow-unlearnable``;
what a manifest cannot carry is refused. The whole command, then a run joined by its CID:
tests/system/test_run_by_cid.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from intellect_node.testing.models import make_model
from tests.support.cli import invoke_cli


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "llama", "llama")


def _init(*args: str) -> object:
    return invoke_cli("run", "init", *args)


@pytest.mark.parametrize("args, flag", [
    (["--model", "/nonexistent/model"], "--model"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--validators", "0"], "--validators"),
    (["--bootstrap", "/dns/nowhere"], "--bootstrap"),
    (["--bootstrap", "/ip4/203.0.113.7/tcp/x"], "--bootstrap"),
    (["--thresholds", "/nonexistent/t.json"], "--thresholds"),
    (["--trainer-peer-id", "nobody"], "--trainer-peer-id"),
])
def test_operator_mistakes_exit_2_naming_the_flag(llama: Path, tmp_path: Path, args: list[str],
                                                  flag: str) -> None:
    full = ["--model", str(llama), *args] if args[0] != "--model" else args
    out = invoke_cli("run", "init", *full, "--out", str(tmp_path / "run"), "--env", "reasoning_gym:chain_sum")
    assert out.returncode == 2, (out.stdout[-1000:], out.stderr[-2000:])
    assert flag in out.stderr, out.stderr
    assert not (tmp_path / "run" / "run.cid").exists()


def test_nothing_learnable_is_refused_unless_allowed(llama: Path, tmp_path: Path) -> None:
    # one new token can never close an answer tag: every reward 0
    given = tmp_path / "tags.toml"
    given.write_text('[rl]\nmax_new_tokens = 1\nanswer_format = "answer_tags"\n')
    out = invoke_cli("run", "init", "--model", str(llama), "--config", str(given), "--out",
                     str(tmp_path / "r"), "--calibrate-n", "2", "--batch-sizes", "1")
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert "every reward is 0" in out.stdout and "--allow-unlearnable" in out.stderr
    assert not (tmp_path / "r" / "run.cid").exists()


def test_a_file_of_the_organisers_machine_cannot_go_into_a_run(llama: Path, tmp_path: Path) -> None:
    given = tmp_path / "filtered.toml"
    given.write_text('[rl]\nsolve_rates_file = "/tmp/rates.json"\n')
    out = invoke_cli("run", "init", "--model", str(llama), "--config", str(given), "--env",
                  "reasoning_gym:chain_sum", "--out", str(tmp_path / "r"))
    assert out.returncode == 2 and "rl.solve_rates_file" in out.stderr, out.stderr
