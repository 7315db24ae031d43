"""What an auditor checks of a step record without replaying it: admission evidence and accepted work dropped.

The run's rule is that its trainer trains only on batches ``run.verdict_quorum`` of its validators
(``run.validator_peer_ids``) accepted, and that it trains on, or says it dropped, every batch they
accepted. A step record (``protocol/steps.py``) makes both checkable:

1. **Evidence.** Each batch a record took carries the sealed accepting ``BatchVerdict`` envelopes that
   admitted it. :func:`check_evidence` opens each one (signature, strict decoding, size bound) and
   requires: signed by a run validator, a verdict of this run on this batch CID and worker, accepting, at
   least ``run.verdict_quorum`` distinct signers, one policy version among them, and that version fresh at
   the step's base version (not older than ``run.async_level`` versions). A batch the validators rejected
   can carry no such evidence: only they sign verdicts.
2. **Rejections heard.** A rejection (for a reason that is the worker's fault) by a run validator that the
   auditor heard on the run's ``verdicts`` topic fails a step that took the batch only when the trainer
   could have acted on it: a trainer refuses a batch on a rejection that comes before its quorum
   (``roles/trainer/admission.py``) and may take it on a quorum that came first. What the trainer heard
   when is signed nowhere, and the verdicts' own dates prove nothing of it: each validator dates its own
   verdicts (one may backdate a rejection and publish it late, or run on a clock up to the age gossip
   accepts, ``VERDICT_MAX_AGE_MS``, behind). So the check uses what this auditor saw with one clock of
   its own (``heard``'s ``at``): the rejection counts when it was heard at least :data:`REJECT_MARGIN_S`
   before the auditor heard one of the acceptances the record carries as evidence (the trainer held all
   of them when it took the batch, so its quorum was complete after that one reached it). A rejection
   the auditor forwarded that long before was on the run's gossip mesh in time for the trainer to have
   it first. Any other rejection (heard after the quorum, or before it by less than the margin, or with
   the quorum's acceptances never heard here) is a validators' disagreement the trainer may settle
   either way: with ``rl.verify_fraction`` < 1 validators check different groups, and one outside the
   quorum may honestly find what the quorum did not. It is counted (:attr:`AdmissionCheck.disputed`),
   not failed. Clock skew between validators changes nothing here: no validator's date is compared.
3. **Accepted work dropped.** The auditor follows the ``verdicts`` topic live (:meth:`AdmissionCheck.heard`)
   and remembers every batch a quorum accepted, with the newest trainer version heard at that moment. Each
   record audited names batches (taken, ``stale``, ``dropped`` with a reason); a remembered batch no
   record has named once a record's base version reaches its deadline fails that record. The deadline is
   the first base version at which its rollouts are stale (its version + ``run.async_level`` + 1, when an
   honest trainer's ``Admission.take`` names it stale at the latest), and at least
   :data:`DROP_SLACK_VERSIONS` past the newest version heard when the quorum came (the trainer may have
   heard it a step later than the auditor).
4. **Stale claims.** A batch a record names ``stale`` (or dropped as ``stale``) whose version the auditor
   knows (from the verdicts heard) and that was fresh at the record's base version fails.

Shortcuts: what was never heard cannot be checked: an auditor that joined late, or missed the verdicts'
gossip, holds no deadline for those batches, and a trainer may always say it never heard a verdict (it
then cannot train the batch either: it has no evidence). The reasons a record gives for ``dropped``
batches other than ``stale`` are checked on the batches in ``drops.py`` where the batch shows them, and
taken at its word otherwise (they are signed and public, and shown in every worker's receipts). An
honest trainer that crashed after deciding to drop a batch and before journaling the next step forgets
to name it. Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from intellect_node.errors import ProtocolError
from intellect_node.protocol.rl import (
    MAX_VERDICT_BYTES,
    NOT_WORKERS_FAULT,
    VERDICT_DOMAIN,
    VERDICT_MAX_AHEAD_MS,
    BatchVerdict,
    check_verdict,
)
from intellect_node.protocol.signing import open_envelope
from intellect_node.protocol.steps import StepBatch, StepRecord

V = TypeVar("V")

REJECT_MARGIN_S = VERDICT_MAX_AHEAD_MS / 1000
"""How much earlier than one of a record's accepting verdicts this auditor must have heard a rejection of
the batch for it to fail the step (seconds of the auditor's own clock): gossip spreads a message over the
run's mesh in a second or two, so 60 s is room for a slow mesh, never the verdicts' dates."""
DROP_SLACK_VERSIONS = 2
"""Versions past the newest one the auditor had heard when a batch's quorum came before the batch must be
named: the trainer may be a record ahead of what the auditor heard (its record in flight), and decides
on the verdict a moment later."""
BATCHES_KEPT = 65536
"""Batches whose verdicts (and whose naming by a record) are remembered; beyond, the oldest are forgotten."""


@dataclass(frozen=True)
class RunRules:
    """What the run's configuration says of admission (``run.*``)."""

    run_id: str
    validators: frozenset[str]
    quorum: int
    async_level: int


@dataclass(frozen=True)
class Admitted:
    """A batch's evidence, opened: its policy version, when its quorum was complete (unix ms, by its
    signers' dates) and who signed it."""

    version: int
    quorum_ms: int
    signers: frozenset[str] = frozenset()


def _batch(b: StepBatch) -> str:
    return f"batch {b.cid} of worker {b.worker}"


def check_evidence(b: StepBatch, *, base_version: int, rules: RunRules) -> Admitted | str:
    """The evidence ``b`` carries, opened, when it admits ``b`` to a step at ``base_version``; else why."""
    if not b.evidence:
        return f"{_batch(b)} carries no evidence that the run's validators accepted it"
    accepts: dict[str, BatchVerdict] = {}
    for i, raw in enumerate(b.evidence):
        try:
            v, signer = open_envelope(raw, VERDICT_DOMAIN, BatchVerdict, max_size=MAX_VERDICT_BYTES)
            check_verdict(v)
        except ProtocolError as exc:
            return f"{_batch(b)}: evidence {i} is not a valid signed verdict: {exc}"
        if signer not in rules.validators:
            return f"{_batch(b)}: evidence {i} is signed by {signer}, not one of the run's validators"
        if v.run_id != rules.run_id or v.batch_cid != b.cid or v.worker != b.worker:
            return f"{_batch(b)}: evidence {i} is a verdict on another batch ({v.batch_cid} of {v.worker})"
        if not v.accepted:
            return (f"{_batch(b)} was rejected by validator {signer} ({v.reason or 'rejected'}); "
                    "the step trained on it")
        accepts.setdefault(signer, v)
    if len(accepts) < rules.quorum:
        return (f"{_batch(b)}: accepted by {len(accepts)} distinct validator(s), the run's quorum "
                f"(run.verdict_quorum) is {rules.quorum}")
    versions = {v.policy_version for v in accepts.values()}
    if len(versions) != 1:
        return f"{_batch(b)}: its acceptances name policy versions {sorted(versions)}"
    version = versions.pop()
    if version < base_version - rules.async_level:
        return (f"{_batch(b)}: its rollouts of v{version} are stale at base v{base_version} "
                f"(run.async_level {rules.async_level}); the step trained on them")
    times = sorted(v.time_ms for v in accepts.values())
    return Admitted(version, times[rules.quorum - 1], frozenset(accepts))


def _put(d: dict[str, V], key: str, value: V) -> None:
    """Set ``d[key]``, forgetting the oldest entries beyond BATCHES_KEPT."""
    d[key] = value
    while len(d) > BATCHES_KEPT:
        del d[next(iter(d))]


@dataclass
class _Heard:
    """The verdicts heard on one batch."""

    worker: str
    cid: str
    version: int
    accepts: dict[str, float]  # validator -> when this auditor heard its acceptance (its own clock)
    rejects: dict[str, tuple[float, str]]  # validator -> (when heard, reason)
    deadline: int | None = None  # set when the quorum is heard: the base version it must be named by


class AdmissionCheck:
    """An auditor's admission checks (see the module docstring): feed it every verdict heard
    (:meth:`heard`) and each record in audit order (:meth:`check`)."""

    def __init__(self, rules: RunRules) -> None:
        self.rules = rules
        self._heard: dict[str, _Heard] = {}  # "worker/cid" -> verdicts heard (oldest first)
        self._named: dict[str, int] = {}  # cid -> base version of the first record naming it
        self.disputed = 0
        """Batches trained on although a run validator rejected them after the quorum (not a failure)."""

    def heard(self, v: BatchVerdict, validator: str, newest_version: int, *, at: float) -> None:
        """A verdict of a run validator (checked by the gossip validator) heard at ``at`` (seconds of one
        steady clock of this auditor's, ``time.monotonic``) while the newest trainer version heard is
        ``newest_version``."""
        key = f"{v.worker}/{v.batch_cid}"
        got = self._heard.get(key)
        if got is None:
            got = _Heard(v.worker, v.batch_cid, v.policy_version, {}, {})
        if v.accepted:
            got.accepts.setdefault(validator, at)
            if got.deadline is None and len(got.accepts) >= self.rules.quorum:
                got.deadline = max(v.policy_version + self.rules.async_level + 1,
                                   newest_version + DROP_SLACK_VERSIONS)
        elif v.reason not in NOT_WORKERS_FAULT:
            got.rejects.setdefault(validator, (at, v.reason))
        _put(self._heard, key, got)

    def check(self, rec: StepRecord) -> str:
        """Why ``rec`` fails its admission checks ("" when it does not); records in order."""
        rules = self.rules
        for b in rec.batches:
            got = check_evidence(b, base_version=rec.base_version, rules=rules)
            if isinstance(got, str):
                return got
            if why := self._rejected_first(b, got):
                return why
        for b, why in self._stale_claims(rec):
            return f"{_batch(b)}: {why}"
        self.named(rec)
        return self._dropped_silently(rec.base_version)

    def named(self, rec: StepRecord) -> None:
        """Note the batches ``rec`` names (taken, stale or dropped): call it for every record heard, those
        outside the windows audited too, so that a batch one of them named is never taken for dropped."""
        for cid in [b.cid for b in (*rec.batches, *rec.stale)] + [d.cid for d in rec.dropped]:
            if cid not in self._named:
                _put(self._named, cid, rec.base_version)

    def _rejected_first(self, b: StepBatch, got: Admitted) -> str:
        heard = self._heard.get(f"{b.worker}/{b.cid}")
        if heard is None or not heard.rejects:
            return ""
        quorum = [at for signer, at in heard.accepts.items() if signer in got.signers]
        later = max(quorum, default=None)  # the trainer's quorum was complete after this reached it
        for validator, (at, reason) in sorted(heard.rejects.items(), key=lambda kv: kv[1][0]):
            if later is not None and at < later - REJECT_MARGIN_S:
                return (f"{_batch(b)} was rejected by validator {validator} ({reason}), heard here "
                        f"{later - at:.0f} s before an acceptance the step's evidence carries; the step "
                        "trained on it")
        self.disputed += 1
        return ""

    def _stale_claims(self, rec: StepRecord) -> Iterable[tuple[StepBatch, str]]:
        floor = rec.base_version - self.rules.async_level
        stale = [*rec.stale, *(StepBatch(cid=d.cid, worker=d.worker, groups=0)
                               for d in rec.dropped if d.reason == "stale")]
        for b in stale:
            heard = self._heard.get(f"{b.worker}/{b.cid}")
            if heard is not None and heard.accepts and heard.version >= floor:
                yield b, (f"recorded stale at base v{rec.base_version}, but its rollouts of v{heard.version} "
                          f"were fresh (run.async_level {self.rules.async_level})")

    def _dropped_silently(self, base_version: int) -> str:
        for key, heard in list(self._heard.items()):
            if heard.deadline is None or heard.deadline > base_version:
                continue
            del self._heard[key]
            if heard.cid not in self._named:
                return (f"accepted batch {heard.cid} of worker {heard.worker} (rollouts of v{heard.version}) "
                    f"never trained nor recorded stale by base v{base_version}")
        return ""
