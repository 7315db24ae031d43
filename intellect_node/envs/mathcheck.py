"""The ``math`` checker: is a completion's final answer mathematically equal to the reference?

Built on math-verify (Hugging Face's answer verifier): it parses LaTeX (``\\frac{1}{2}``, ``\\boxed{}``,
``\\sqrt{2}``, sets, intervals, percentages) and plain expressions into sympy and compares them
symbolically and numerically, so ``0.5``, ``1/2``, ``\\frac12`` and ``$\\boxed{\\frac{1}{2}}$`` all match
a reference of ``1/2``. A completion is either a whole text (math-verify finds its last boxed or final
answer) or an answer an extraction step already cut out.

Text without math delimiters is ambiguous for math-verify: bare LaTeX (``2^{1/2}``) is only read inside
``$...$``, and prose ("the answer is 5") only as plain text. :func:`_parse` decides by the characters the
text holds; the reference answer in a task file goes through the same rule.

sympy can hang (``9^{9^{9^{9}}}``) or exhaust memory on hostile text, and math-verify's own timeout needs
the main thread, so :func:`check_math` runs :func:`verify_in_child` in a scoring process
(:mod:`intellect_node.envs.sandbox`) with math-verify's timeouts off and ours on.
"""

from __future__ import annotations

from intellect_node.envs.sandbox import DEFAULT_TIMEOUT_S, run_checker

_DELIMITERS = ("$", "\\boxed", "\\fbox", "\\(", "\\[")
_LATEX_MARKS = ("\\", "^", "{", "_")


def _parse(text: str) -> list[object]:
    """math-verify's parse of ``text`` (runs in a scoring process)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    if any(d in text for d in _DELIMITERS):
        return list(parse(text, extraction_config=configs, parsing_timeout=None))
    attempts = [f"${text}$", text] if any(m in text for m in _LATEX_MARKS) else [text, f"${text}$"]
    for candidate in attempts:
        found = parse(candidate, extraction_config=configs, parsing_timeout=None)
        if found:
            return list(found)
    return []


def verify_in_child(completion: str, answer: str) -> float:
    """1.0 when the parsed completion equals the parsed reference; 0.0 otherwise (runs in a scoring
    process; may take long or raise, which the sandbox turns into a reason)."""
    from math_verify import verify

    gold = _parse(answer)
    if not gold:
        raise ValueError(f"reference answer {answer[:80]!r} is not parseable as math")
    pred = _parse(completion)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def check_math(completion: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """The ``math`` checker (``CHECKERS["math"]``): raises ``ScoringFailed`` (``timeout`` or
    ``checker_error``) when math-verify could not decide within ``timeout_s``."""
    if not completion.strip():
        return 0.0
    value = run_checker(__name__, "verify_in_child", completion, answer, timeout_s=timeout_s,
                        warm=("math_verify", "sympy"))
    return float(value)
