"""Tasks, checkers and the char tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from intellect_node.envs.environment import build_task
from intellect_node.envs.tasks import (
    MAX_COMPLETION_CHARS,
    AdditionTask,
    Judgement,
    Problem,
    Task,
    bounded,
    check_integer,
    embedded_task,
    get_task,
    register_task,
    resolve_problem,
)
from intellect_node.errors import ConfigError
from intellect_node.models.loader import ModelTokenizer, write_tokenizer_files


def test_addition_problems_are_addressable_and_scored() -> None:
    task = embedded_task()
    assert isinstance(task, Task) and len(task) == 1_000_000
    p = task.problem(123_045)
    assert (p.prompt, p.answer, p.problem_id) == ("123+045=", "0168", "add3/123045")
    assert task.get(p.problem_id) == p == resolve_problem("add3/123045")
    assert p.reward("0168") == 1.0 and p.reward(" 0168\n") == 1.0 and p.reward("168") == 0.0
    assert all(q.reward(q.answer) == 1.0 for q in task.sample(random.Random(0), 50))
    for bad in ("add3/", "add3/x", "add2/5", "add3/1000000", "add3/0123045", "add3/١٢"):
        with pytest.raises(ConfigError):
            task.get(bad)
    with pytest.raises(ConfigError):
        get_task("nope")


def test_checker_kinds_and_registration() -> None:
    assert check_integer("0168", "168") == 1.0 and check_integer("abc", "1") == 0.0
    with pytest.raises(ConfigError):
        Problem("t", "t/0", "q", "a", checker="nope").reward("a")
    register_task("add2", lambda: AdditionTask(2))
    assert resolve_problem("add2/105").prompt == "01+05="


def test_rewards_never_raise_and_say_why() -> None:
    p = embedded_task().problem(1)
    assert p.judge("0001") == Judgement(1.0) and p.judge("0002") == Judgement(0.0)
    assert p.judge("1" * (MAX_COMPLETION_CHARS + 1)) == Judgement(0.0, "too_long")
    assert Problem("t", "t/0", "q", "5", checker="integer").judge("\udcff9" * 10).reward == 0.0
    assert bounded(float("nan")) == bounded(1.5) == Judgement(0.0, "bad_score")


def test_settings_keep_the_embedded_task_unless_they_change_it() -> None:
    """Default environment settings leave add3 as it was (plain IDs, the same problems); a system prompt
    or extraction setting moves it to add3@<hash>, scored through the extraction."""
    assert build_task().task_id == "add3"
    assert build_task().problem(5) == embedded_task().problem(5)
    settled = build_task(system_prompt="Add the numbers.", answer_format="last_line")
    p = settled.problem(123_045)
    assert settled.task_id.startswith("add3@") and p.problem_id == f"{settled.task_id}/123045"
    assert (p.prompt, p.answer, p.system) == ("123+045=", "0168", "Add the numbers.")
    assert p.reward("hmm\n0168") == 1.0 and p.reward("0168\nhmm") == 0.0
    assert resolve_problem(p.problem_id) == p
    with pytest.raises(ConfigError):
        settled.get("add3/123045")


def test_char_tokenizer_round_trips(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    tok = ModelTokenizer(tmp_path)
    text = "123+045= Hello, world!\n~"
    ids = tok.prompt_ids(text)
    assert ids[0] == tok.bos_id and len(ids) == len(text) + 1
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("0168") + [tok.eos_id] + tok.encode("junk")) == "0168"
    assert tok.vocab_size == 128
