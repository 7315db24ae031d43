"""Tasks, checkers and the char tokenizer."""

from __future__ import annotations

import random

import pytest

from intellect_node.errors import ConfigError
from intellect_node.models.loader import ModelTokenizer, write_tokenizer_files
from intellect_node.trainer.tasks import (
    AdditionTask,
    Problem,
    Task,
    check_integer,
    embedded_task,
    get_task,
    register_task,
    resolve_problem,
)


def test_addition_problems_are_addressable_and_scored() -> None:
    task = embedded_task()
    assert isinstance(task, Task) and len(task) == 1_000_000
    p = task.problem(123_045)
    assert (p.prompt, p.answer, p.problem_id) == ("123+045=", "0168", "add3/123045")
    assert task.get(p.problem_id) == p == resolve_problem("add3/123045")
    assert p.reward("0168") == 1.0 and p.reward(" 0168\n") == 1.0 and p.reward("168") == 0.0
    assert all(q.reward(q.answer) == 1.0 for q in task.sample(random.Random(0), 50))
    for bad in ("add3/", "add3/x", "add2/5", "add3/1000000"):
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


def test_char_tokenizer_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write_tokenizer_files(tmp_path)
    tok = ModelTokenizer(tmp_path)
    text = "123+045= Hello, world!\n~"
    ids = tok.prompt_ids(text)
    assert ids[0] == tok.bos_id and len(ids) == len(text) + 1
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("0168") + [tok.eos_id] + tok.encode("junk")) == "0168"
    assert tok.vocab_size == 128
