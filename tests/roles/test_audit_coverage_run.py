"""The audit coverage rule with the real roles, in one process (``intellect_node.testing.roles``).

- An honest trainer whose own ``rl.checkpoint_every`` is 1000 still publishes a checkpoint state every
  ``run.audit_checkpoint_every`` (2) trained steps, and a node watching the run reads coverage ``ok`` at
  every record it hears.
- A trainer that never checkpoints (no record carries ``state``): with ``run.require_audits`` the worker
  and the validator, each with the node's audit watch, stop working for it with the reason "audit
  coverage", and a node watching reads ``low``.
- A trainer whose records carry ``state`` on time but name blobs it does not serve: an auditing
  validator cannot fetch the starts, and after three the worker refuses the trainer for it.

The rule itself (out of order, late joiners, starts not fetched) is ``test_audit_coverage.py``'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.signing import open_envelope
from intellect_node.protocol.steps import MAX_RECORD_BYTES, STEP_DOMAIN, StepRecord, StepState
from intellect_node.roles.auditor.windows import WindowPlan
from intellect_node.roles.common.audits import AuditWatch
from intellect_node.roles.trainer.role import Trainer
from intellect_node.roles.validator.role import Validator
from intellect_node.roles.worker.role import Worker
from intellect_node.testing.roles import in_process_swarm, key_of, run_config
from tests.support.wait import wait_until

RL: dict[str, Any] = dict(group_size=4, problems_per_batch=2, groups_per_step=2, max_new_tokens=4,
                          batches_per_version=1, work_ahead=1, checkpoint_every=1000)
EVERY = 2


class NeverCheckpoints(Trainer):
    """The run's trainer, but no step is ever followed by a checkpoint: no record carries ``state``, so
    no window but version 0's can start and an auditor that joins later audits nothing."""

    def _checkpoint_due(self) -> bool:
        return False


def _records(trainer_dir: Path) -> list[StepRecord]:
    out = []
    for path in sorted((trainer_dir / "records").glob("*.rec")):
        rec, _ = open_envelope(path.read_bytes(), STEP_DOMAIN, StepRecord, max_size=MAX_RECORD_BYTES)
        out.append(rec)
    return sorted(out, key=lambda r: r.seq)


def test_an_honest_trainer_keeps_the_run_rule_whatever_its_own_checkpoint_every(tmp_path: Path) -> None:
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL,
                     require_audits=True, audit_checkpoint_every=EVERY)
    seen: list[tuple[int, str]] = []  # (step, coverage) at every record the watcher heard

    async def main() -> dict[str, Any]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, Trainer.for_runtime)
            watcher = await net.start("watcher", cfg, AuditWatch)
            watch: AuditWatch = watcher.role
            heard = watch._record

            def noted(rec: StepRecord) -> None:
                heard(rec)
                seen.append((rec.step, watch.coverage.state))

            watch.binding._on_record = noted
            await net.start("validator", cfg, Validator.for_runtime, audits=True)
            worker = await net.start("w", cfg, Worker.for_runtime, audits=True)
            await wait_until(lambda: trainer.role.step >= 3 * EVERY + 1 and len(seen) >= 3 * EVERY + 1,
                             timeout=300, what="the trainer past step 7, its records heard")
            assert not net.failures(), net.failures()
            assert not worker.status()["audit_refusal"]
            return watch.status()

    st = asyncio.run(main())
    records = _records(tmp_path / "trainer" / "trainer")
    trained = [r for r in records if r.trained]
    assert trained and all((r.state is not None) == (r.step % EVERY == 0) for r in trained), \
        [(r.step, r.state is not None) for r in trained]
    assert seen and all(state == "ok" for _, state in seen), seen
    assert st["coverage"]["state"] == "ok" and st["coverage"]["gap"] < EVERY and not st["refusing"], st


def test_a_trainer_that_never_checkpoints_is_refused_for_audit_coverage(tmp_path: Path) -> None:
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL,
                     require_audits=True, audit_checkpoint_every=EVERY)
    low_at = EVERY + 3  # past the rule and the grace of 2

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            trainer = await net.start("trainer", cfg, NeverCheckpoints)
            watcher = await net.start("watcher", cfg, AuditWatch)
            validator = await net.start("validator", cfg, Validator.for_runtime, audits=True)
            worker = await net.start("w", cfg, Worker.for_runtime, audits=True)
            await wait_until(lambda: worker.status()["audit_refusal"] and validator.status()["audit_refusal"],
                             timeout=300, what="the worker and the validator refusing the trainer")
            assert trainer.role.step >= low_at
            assert not net.failures(), net.failures()
            return worker.status(), validator.status(), watcher.role.status()

    w, v, st = asyncio.run(main())
    assert w["audit_refusal"].startswith("audit coverage too low:"), w["audit_refusal"]
    assert v["audit_refusal"].startswith("audit coverage too low:"), v["audit_refusal"]
    assert st["coverage"]["state"] == "low" and st["coverage"]["state_step"] == -1, st
    assert st["state"] != "failed" and not st["first_failed"]  # not a failed audit: its own reason
    assert all(r.state is None for r in _records(tmp_path / "trainer" / "trainer"))


class WithholdsStarts(Trainer):
    """The run's trainer, but the blobs its records name as each checkpoint's state are none it serves:
    the records carry ``state`` on time, and no auditor can start a window there."""

    async def start(self) -> None:
        await super().start()
        assert self.records is not None
        real = self.records._with_state

        async def withheld(rec: StepRecord, files: Any) -> StepRecord:
            out = await real(rec, files)
            if out.state is None:
                return out
            return msgspec.structs.replace(out, state=StepState(
                weights_cid=cid_of(b"withheld weights %d" % rec.seq),
                optimizer_cid=cid_of(b"withheld optimizer %d" % rec.seq),
                optimizer_hash=out.state.optimizer_hash))

        self.records._with_state = withheld  # type: ignore[method-assign]


def test_a_trainer_withholding_its_start_blobs_is_refused_after_three_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An auditor that skips version 0's window (its secret draw, handed in) and audits every start
    after: each start it tries cannot be fetched (``unavailable``), and after three in a row every node
    reads coverage low, the worker refusing the trainer for it, though every record carries ``state``.
    The auditor gives up on a start far sooner here than in a run: no holder serves those blobs at all, so
    no wait would fetch them."""
    from intellect_node.roles.auditor import chain

    monkeypatch.setattr(chain, "START_FETCH_TIMEOUT_S", 1.0)
    cfg = run_config(trainer=key_of("trainer").peer_id, validators=[key_of("validator").peer_id], rl=RL,
                     require_audits=True, audit_checkpoint_every=1)
    v_cfg = cfg.model_copy(update={"validator": cfg.validator.model_copy(update={"audit": True,
                                                                                 "audit_fraction": 0.5})})
    draws = iter([0.9])  # version 0's window not audited; every later start drawn

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with in_process_swarm(tmp_path) as net:
            await net.start("trainer", cfg, WithholdsStarts)
            watcher = await net.start("watcher", cfg, AuditWatch)
            validator = await net.start("validator", v_cfg, Validator.for_runtime, audits=True)
            validator.role.auditor.plan = WindowPlan(0.5, lambda: next(draws, 0.0))
            worker = await net.start("w", cfg, Worker.for_runtime, audits=True)
            await wait_until(lambda: worker.status()["audit_refusal"], timeout=300,
                             what="the worker refusing the trainer")
            assert not net.failures(), net.failures()
            return worker.status(), validator.status()["audit"], watcher.role.status()

    w, audit, st = asyncio.run(main())
    assert "could not fetch the last 3 window starts" in w["audit_refusal"], w["audit_refusal"]
    assert audit["windows"]["unavailable"] >= 3 and audit["pass"] == 0, audit
    assert st["coverage"]["state"] == "low" and st["coverage"]["gap"] <= 1, st
    assert len(st["coverage"]["starts_unfetched"]) >= 3 and not st["first_failed"], st
