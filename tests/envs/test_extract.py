"""Answer extraction: the modes, <think> handling and the length limit, on honest and hostile text."""

from __future__ import annotations

import pytest

from intellect_node.envs.extract import Extraction, extract, last_boxed
from intellect_node.errors import ConfigError

TAGS = Extraction(mode="answer_tags", think="strip")


@pytest.mark.parametrize("text,answer", [
    ("<answer>42</answer>", "42"),
    ("reasoning... <answer> 42 \n</answer> trailing", "42"),
    ("<answer>1</answer> changed my mind <answer>2</answer>", "2"),  # the last one counts
    ("<answer>a<answer>b</answer>", "b"),  # nested opening: the innermost before the last close
    ("<think>try <answer>7</answer>?</think>\n<answer>8</answer>", "8"),  # thinking is dropped
    ("</think><answer>9</answer>", "9"),  # a chat template that opened <think> in the prompt
])
def test_answer_tags(text: str, answer: str) -> None:
    assert extract(text, TAGS) == (answer, "")


@pytest.mark.parametrize("text,reason", [
    ("42", "no_answer"),
    ("<answer>42", "no_answer"),
    ("<answer>   </answer>", "no_answer"),
    ("</answer>42<answer>", "no_answer"),
    ("<think>still thinking <answer>5</answer>", "unclosed_think"),
    ("<think>a</think> <think>again <answer>5</answer>", "unclosed_think"),
    ("x" * 40_000, "too_long"),
])
def test_answer_tags_refusals(text: str, reason: str) -> None:
    assert extract(text, TAGS) == (None, reason)


def test_think_keep_leaves_the_text_alone() -> None:
    keep = Extraction(mode="answer_tags", think="keep")
    assert extract("<think>x <answer>5</answer>", keep) == ("5", "")
    assert extract("<think>x</think>ok", Extraction(mode="whole", think="keep")) == ("<think>x</think>ok", "")
    assert extract("<think>x</think> ok ", Extraction(mode="whole", think="strip")) == ("ok", "")


@pytest.mark.parametrize("text,answer", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\fbox{3}", "3"),
    ("\\boxed{4} and an unbalanced \\boxed{5", "4"),
    ("\\boxed{}", None),
    ("no box", None),
])
def test_boxed(text: str, answer: str | None) -> None:
    assert extract(text, Extraction(mode="boxed"))[0] == answer


def test_boxed_is_linear_on_hostile_text() -> None:
    """Thousands of unbalanced boxes: one brace-matching pass, not a rescan per box (the length limit
    alone would let a quadratic scan run for seconds)."""
    hostile = "\\boxed{" * 4000
    assert last_boxed(hostile) is None
    assert last_boxed(hostile + "1}") == "1"


def test_last_line_and_whole() -> None:
    assert extract("work\n\n  The answer: 12  \n\n", Extraction(mode="last_line")) == ("The answer: 12", "")
    assert extract("   \n", Extraction(mode="last_line")) == (None, "no_answer")
    assert extract("  0168\n", Extraction(mode="whole")) == ("0168", "")


def test_length_limit_is_in_characters() -> None:
    small = Extraction(mode="whole", max_chars=5)
    assert extract("12345", small) == ("12345", "")
    assert extract("123456", small) == (None, "too_long")
    assert extract("ééééé", small) == ("ééééé", "")


@pytest.mark.parametrize("kwargs,field", [
    ({"mode": "regex"}, "rl.answer_format"),
    ({"think": "maybe"}, "rl.think"),
    ({"max_chars": 0}, "rl.max_completion_chars"),
])
def test_bad_settings_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        Extraction(**kwargs)  # type: ignore[arg-type]  # keyword arguments from a table
    assert info.value.field == field
