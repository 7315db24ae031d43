"""A dishonest trainer: the run's trainer in every way but one, for the audit tests.

:func:`dishonest` makes the role of a MODE, for an in-process swarm (``intellect_node.testing.roles``);
``python -m tests.support.dishonest_trainer MODE DATA_DIR`` runs it as a child process. MODE:

- ``lr``: trains with twice the configured learning rate, while its step records state the run's;
- ``nudge``: adds an update of its own to the weights after each optimizer step (every weight + 1e-4)
  and publishes the result as the step's, from the first step it trains once the file :data:`CUE`
  exists in its data dir (the test makes it when its auditors are in place; made before the start, from
  the first step); its status lists the versions so made (``nudged``);
- ``rejected``: takes a validator's rejection (for the worker's fault) as an acceptance, so it trains on
  batches its validators rejected; the best evidence it can attach is the rejecting verdict itself;
- ``drop``: silently drops the first batch its validators accept (never queued, named by no record); its
  status says which (``dropped_silently``);
- ``claim``: drops the first batch its validators accept and names it in its next record as dropped
  ``not_assigned``, though it is an honest worker's assigned window; its status says which
  (``dropped_claimed``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.support.roles import run_custom_node

CUE = "nudge-now"
"""``nudge`` nudges every step it trains once this file exists in its data dir."""


MODES = ("lr", "nudge", "rejected", "drop", "claim")


def dishonest(mode: str) -> type[Any]:
    """The trainer role of ``mode`` (see the module docstring): the real :class:`Trainer` with one part
    patched. Its ``for_runtime`` runs it in a child process (:func:`main`) or in an in-process swarm
    (``intellect_node.testing.roles``) alike."""
    import msgspec
    import torch

    from intellect_node.protocol.rl import NOT_WORKERS_FAULT, BatchVerdict
    from intellect_node.roles.trainer.role import Trainer

    if mode not in MODES:
        raise ValueError(f"no dishonest trainer {mode!r}")

    class Dishonest(Trainer):
        dropped_silently = ""
        dropped_claimed = ""
        nudged: list[int] = []  # versions made by a nudged step

        def __init__(self, runtime: Any) -> None:
            super().__init__(runtime)
            decide, take_in = self.admission.decide, self.intake._take_in

            def lax_decide(verdict: BatchVerdict, validator: str, **kw: Any) -> Any:
                if not verdict.accepted and verdict.reason not in NOT_WORKERS_FAULT:
                    n = verdict.n_accepted + verdict.n_rejected  # "accepted", with the rejection as evidence
                    verdict = msgspec.structs.replace(verdict, accepted=True, n_accepted=n, n_rejected=0,
                                                      reason="", detail="", ban=False)
                return decide(verdict, validator, **kw)

            async def dropping_take_in(verdict: BatchVerdict, validator: str, evidence: Any) -> None:
                if not self.dropped_silently:
                    self.dropped_silently = verdict.batch_cid  # neither queued nor named: gone
                    return
                await take_in(verdict, validator, evidence)

            async def claiming_take_in(verdict: BatchVerdict, validator: str, evidence: Any) -> None:
                if not self.dropped_claimed:
                    self.dropped_claimed = verdict.batch_cid  # not queued; the next record says why, falsely
                    self.intake.drop(verdict.worker, verdict.batch_cid, "not_assigned")
                    return
                await take_in(verdict, validator, evidence)

            if mode == "rejected":
                self.admission.decide = lax_decide  # type: ignore[method-assign]  # patched for this test
            elif mode == "drop":
                self.intake._take_in = dropping_take_in  # type: ignore[method-assign]  # patched for this test
            elif mode == "claim":
                self.intake._take_in = claiming_take_in  # type: ignore[method-assign]  # patched for this test

        def status(self) -> dict[str, Any]:
            return {**super().status(), "dropped_silently": self.dropped_silently,
                    "dropped_claimed": self.dropped_claimed, "nudged": self.nudged[:16]}

        def _train(self, samples: list[Any], lr: float) -> Any:
            # "lr": the step trains at twice the lr its record states (the record's settings are made apart)
            stats, _ = super()._train(samples, 2 * lr if mode == "lr" else lr)
            if mode == "nudge" and (Path(self.rt.data_dir) / CUE).exists():
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(1e-4)
                self.nudged = [*self.nudged, self.version + 1]  # the step's version (_step counts it next)
            return stats, self._snapshot()

    return Dishonest


def main(mode: str, data_dir: Path) -> int:
    return run_custom_node(data_dir, "trainer", [dishonest(mode).for_runtime])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in MODES:
        sys.exit(main(sys.argv[1], Path(sys.argv[2])))
    sys.exit(f"usage: {sys.argv[0]} lr|nudge|rejected|drop|claim DATA_DIR")
