"""``intellect-node config fit``: the [rl] settings for a model, as TOML that loads, with the operator's
values kept; ``--preflight`` says whether anything is learnable (exit 1 when not)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from intellect_node.testing.models import make_model
from tests.support.cli import invoke_cli


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "llama", "llama")


def test_fit_prints_settings_that_load_as_the_runs_rl_section(llama: Path, tmp_path: Path) -> None:
    given = tmp_path / "mine.toml"
    given.write_text("[rl]\nlr = 1e-6\n")
    out = invoke_cli("config", "fit", "--model", str(llama), "--config", str(given), "--env-args",
                  "max_digits=2")
    assert out.returncode == 0, out.stderr
    rl = tomllib.loads(out.stdout)["rl"]
    assert rl["lr"] == 1e-6 and rl["env_args"] == {"max_digits": 2}
    assert rl["answer_format"] == "whole" and rl["max_new_tokens"] == 16
    assert "lr = 1e-06  # given" in out.stdout
    # the settings load as a node's config
    from intellect_node.config import load_config

    conf = tmp_path / "run.toml"
    conf.write_text(out.stdout)
    assert load_config(conf, environ={}).rl.env == "reasoning_gym:basic_arithmetic"


def test_preflight_says_when_nothing_is_learnable(llama: Path, tmp_path: Path) -> None:
    # one new token can never close an answer tag: every reward 0
    given = tmp_path / "tags.toml"
    given.write_text('[rl]\nmax_new_tokens = 1\nanswer_format = "answer_tags"\n')
    out = invoke_cli("config", "fit", "--model", str(llama), "--config", str(given), "--preflight")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "WARNING: nothing is learnable" in out.stdout and "every reward is 0" in out.stdout


def test_a_wrong_model_names_the_flag() -> None:
    out = invoke_cli("config", "fit", "--model", "/nonexistent/model")
    assert out.returncode == 2 and "--model" in out.stderr
