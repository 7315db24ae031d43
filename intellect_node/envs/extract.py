"""Answer extraction: which part of a completion a checker sees.

A run's extraction settings are part of its environment and hashed into its task ID, so a worker, a
validator and the trainer cut the same answer out of the same text. Steps, in order:

1. **Length**: a completion over ``max_chars`` characters gets no answer (``too_long``): a bound on the
   work any completion can cause before a checker runs.
2. **Reasoning** (``think="strip"``): everything up to the last ``</think>`` is dropped; a ``<think>``
   left open after it means the model never finished thinking, so there is no answer (``unclosed_think``).
   A completion with no think tags is kept whole (models whose chat template opens ``<think>`` in the
   prompt write only the closing tag). ``think="keep"`` leaves the text alone.
3. **Answer** (``mode``): ``answer_tags``: the inside of the last ``<answer>...</answer>``; ``boxed``: the
   inside of the last ``\\boxed{...}`` (braces balanced); ``last_line``: the last non-blank line;
   ``whole``: the text. Answers are stripped of surrounding whitespace; an empty one is no answer.

The matching is linear-time string scanning (no backtracking regular expressions), since the text is
hostile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from intellect_node.errors import ConfigError

Mode = Literal["answer_tags", "boxed", "last_line", "whole"]
Think = Literal["strip", "keep"]
MODES: tuple[str, ...] = ("answer_tags", "boxed", "last_line", "whole")
THINK: tuple[str, ...] = ("strip", "keep")


@dataclass(frozen=True)
class Extraction:
    """How an answer is cut out of a completion (the same on every node of a run)."""

    mode: Mode = "whole"
    think: Think = "keep"
    max_chars: int = 32_768

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"answer format {self.mode!r} is not one of {list(MODES)}",
                              field="rl.answer_format")
        if self.think not in THINK:
            raise ConfigError(f"think {self.think!r} is not one of {list(THINK)}", field="rl.think")
        if self.max_chars < 1:
            raise ConfigError(f"max_completion_chars must be at least 1, got {self.max_chars}",
                              field="rl.max_completion_chars")

    def canonical(self) -> dict[str, object]:
        """What goes into the settings hash."""
        return {"mode": self.mode, "think": self.think, "max_chars": self.max_chars}


def strip_reasoning(text: str) -> str | None:
    """The text after the last ``</think>``; None when a ``<think>`` is still open at the end."""
    close = text.rfind("</think>")
    rest = text[close + len("</think>"):] if close >= 0 else text
    if "<think>" in rest:
        return None
    return rest


def last_tagged(text: str, tag: str) -> str | None:
    """The inside of the last complete ``<tag>...</tag>`` (the last closing tag and the last opening
    tag before it); None when there is none."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    opening = f"<{tag}>"
    start = text.rfind(opening, 0, close)
    if start < 0:
        return None
    return text[start + len(opening):close]


def last_boxed(text: str) -> str | None:
    """The inside of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces balance; None if none.

    One pass matches every brace (a stack), so a text of thousands of unbalanced boxes costs O(n), not a
    rescan per box."""
    starts: list[int] = []  # index of the "{" of each macro, in order
    for macro in ("\\boxed{", "\\fbox{"):
        i = text.find(macro)
        while i >= 0:
            starts.append(i + len(macro) - 1)
            i = text.find(macro, i + 1)
    if not starts:
        return None
    closes: dict[int, int] = {}
    stack: list[int] = []
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            closes[stack.pop()] = i
    for open_at in sorted(starts, reverse=True):
        if open_at in closes:
            return text[open_at + 1:closes[open_at]]
    return None


def last_line(text: str) -> str | None:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line
    return None


def extract(text: str, how: Extraction) -> tuple[str | None, str]:
    """``(answer, "")``, or ``(None, reason)`` with reason ``too_long``, ``unclosed_think`` or
    ``no_answer``."""
    if len(text) > how.max_chars:
        return None, "too_long"
    if how.think == "strip":
        kept = strip_reasoning(text)
        if kept is None:
            return None, "unclosed_think"
        text = kept
    if how.mode == "answer_tags":
        found = last_tagged(text, "answer")
    elif how.mode == "boxed":
        found = last_boxed(text)
    elif how.mode == "last_line":
        found = last_line(text)
    else:
        found = text
    if found is None or not found.strip():
        return None, "no_answer"
    return found.strip(), ""
