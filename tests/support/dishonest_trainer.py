"""A dishonest trainer as a child process: the run's trainer in every way but one, for the audit tests.

``python -m tests.support.dishonest_trainer MODE DATA_DIR``, MODE:

- ``lr``: trains with twice the configured learning rate, while its step records state the run's;
- ``nudge``: adds an update of its own to the weights after each optimizer step (every weight + 1e-4)
  and publishes the result as the step's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.support.roles import run_custom_node


def main(mode: str, data_dir: Path) -> int:
    import torch

    from intellect_node.roles.trainer.role import Trainer
    from intellect_node.trainer.optim import Optimizer
    from intellect_node.trainer.step import make_optimizer

    class Dishonest(Trainer):
        def _optimizer(self, ckpt: Path | None = None) -> Optimizer:
            if mode != "lr":
                return super()._optimizer(ckpt)
            return make_optimizer(self.model, 2 * self.rl.lr)  # a fresh run: no saved state to load

        def _train(self, samples: list[Any]) -> Any:
            stats, _ = super()._train(samples)
            if mode == "nudge":
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(1e-4)
            return stats, self._snapshot()

    return run_custom_node(data_dir, "trainer", [Dishonest.for_runtime])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("lr", "nudge"):
        sys.exit(main(sys.argv[1], Path(sys.argv[2])))
    sys.exit(f"usage: {sys.argv[0]} lr|nudge DATA_DIR")
