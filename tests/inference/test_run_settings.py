"""Settings that fit the model (``inference/run_settings.py``), the preflight, and the demo's plan built
from them (``commands/demo.py``: ``--config``, ``--env-args``, flags win)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from intellect_node.commands.common import parse_env_args
from intellect_node.commands.demo import plan_demo
from intellect_node.envs.tasks import embedded_task
from intellect_node.errors import ConfigError
from intellect_node.inference import make_engine
from intellect_node.inference.run_settings import (
    DEFAULT_ENV,
    SMALL_ARITHMETIC_ARGS,
    TARGET_KL,
    ModelFacts,
    apply,
    fit_settings,
    model_facts,
    preflight,
)
from intellect_node.models.loader import embedded_model_dir
from intellect_node.testing.models import make_model

torch.set_num_threads(1)

SMOL = ModelFacts(n_params=134_515_008, chat_template=True, embedded=False, name="smollm2")


def test_a_small_instruct_model_gets_a_task_format_and_rate_it_can_learn_from() -> None:
    got = apply(fit_settings(SMOL, {}))
    assert got["env"] == DEFAULT_ENV and got["env_args"] == SMALL_ARITHMETIC_ARGS
    assert got["answer_format"] == "whole" and got["system_prompt"] == "Answer with the number only."
    assert got["max_new_tokens"] == 16 and got["groups_per_step"] == 4 and got["work_ahead"] == 1
    assert 1e-6 < got["lr"] < 1e-4 and got["target_kl"] == TARGET_KL
    assert all(not c.given and c.why for c in fit_settings(SMOL, {}))


def test_what_the_operator_gave_is_kept_and_marked_given() -> None:
    choices = fit_settings(SMOL, {"lr": 1e-6, "env": "reasoning_gym:chain_sum"})
    by = {c.key: c for c in choices}
    assert by["lr"].value == 1e-6 and by["lr"].given
    assert by["env"].value == "reasoning_gym:chain_sum" and by["env"].given
    assert "env_args" not in by  # the operator's environment keeps its own sizes
    assert by["max_new_tokens"].value == 16  # chain_sum is arithmetic: a bare number


def test_a_large_model_keeps_answer_tags_and_reasons() -> None:
    got = apply(fit_settings(ModelFacts(n_params=7_000_000_000, chat_template=True, embedded=False), {}))
    assert "answer_format" not in got and "system_prompt" not in got
    assert got["max_new_tokens"] == 256 and got["lr"] == 3e-7
    assert "env_args" not in got  # the dataset's own sizes


def test_a_model_without_chat_template_is_scored_on_its_whole_text() -> None:
    got = apply(fit_settings(ModelFacts(n_params=2_000_000_000, chat_template=False, embedded=False), {}))
    assert got["answer_format"] == "whole" and "system_prompt" not in got


def test_the_embedded_model_gets_no_choices() -> None:
    facts = model_facts(embedded_model_dir())
    assert facts.embedded and fit_settings(facts, {}) == []
    assert apply(fit_settings(facts, {"lr": 1e-3})) == {"lr": 1e-3}


def test_preflight_says_when_nothing_is_learnable() -> None:
    engine = make_engine(None, "torch")
    problems = embedded_task().sample(random.Random(3), 4)
    # One new token cannot hold a 3-digit sum: every reward is 0, every group equal.
    none = preflight(engine, problems, group_size=4, max_new_tokens=1)
    assert not none.ok() and none.all_zero == none.groups == 4 and none.learnable == 0
    assert "WARNING: nothing is learnable" in none.summary() and "rl.max_new_tokens" in none.summary()
    some = preflight(engine, problems, group_size=8, max_new_tokens=5)
    assert some.groups == 4 and some.mean_reward > 0 and "WARNING" not in some.summary()
    assert len(some.examples) == 4 and all(isinstance(t, str) for _a, t, _r in some.examples)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3")


def test_the_demo_plan_layers_config_choices_and_flags(qwen3: Path, tmp_path: Path) -> None:
    conf = tmp_path / "run.toml"
    conf.write_text('[run]\nrun_id = "theirs"\nmodel = "elsewhere"\n[rl]\nlr = 0.001\ngroup_size = 4\n'
                    '[network]\nlisten = ["/ip4/0.0.0.0/tcp/4001"]\n')
    plan = plan_demo(model=str(qwen3), env=None, env_args={"max_digits": 2}, config_file=conf, workers=2)
    rl = plan.extra["rl"]
    assert rl["lr"] == 0.001 and rl["group_size"] == 4  # the file's, kept
    assert rl["env"] == DEFAULT_ENV and rl["env_args"] == {"max_digits": 2}  # the flag's
    assert rl["answer_format"] == "whole" and rl["max_new_tokens"] == 16  # chosen for a tiny model
    assert rl["problems_per_batch"] * 2 >= rl["groups_per_step"]
    assert "network" not in plan.extra and "run_id" not in plan.extra["run"]
    assert "model" not in plan.extra["run"] and plan.folder == qwen3  # --model beats the file's
    # the embedded model: the demo's own settings, nothing chosen
    toy = plan_demo(model=None, env=None, env_args={}, config_file=None, workers=None)
    assert toy.folder is None and toy.choices == [] and toy.workers == 2 and toy.extra["rl"]["lr"] == 2e-4


def test_env_args_flag_forms_and_errors() -> None:
    assert parse_env_args('{"max_digits": 1, "operators": ["+"]}') == {"max_digits": 1, "operators": ["+"]}
    assert parse_env_args("max_digits=1, format_style=natural") == {"max_digits": 1,
                                                                    "format_style": "natural"}
    assert parse_env_args(None) == {}
    for bad in ("{not json", "[1]", "max_digits"):
        with pytest.raises(ConfigError) as exc:
            parse_env_args(bad)
        assert exc.value.field == "--env-args"
    assert json.dumps(parse_env_args("a=true,b=0.5")) == '{"a": true, "b": 0.5}'  # lists: the JSON form
