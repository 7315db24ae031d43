"""What ``intellect-node doctor`` reports: one :class:`Check` per thing looked at, with a status and, when
it is not ok, the fix. The doctor's own checks (``doctor.py``) and the model-memory checks
(``doctor_model.py``) both build them."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
