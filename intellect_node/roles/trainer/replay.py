"""Crash replay: the steps journaled since the last checkpoint, taken again after a restart.

The trainer checkpoints every ``rl.checkpoint_every`` steps but publishes a version every step, so after
a SIGKILL the versions announced since the checkpoint exist only as recipes: the step journal
(``trainer/steps.jsonl``) names the batches each step took, and the inbox holds those batches
(``inbox.py``). A restarted trainer reloads the checkpoint, re-queues every inbox batch not in its
consumed set, and then :func:`replay_steps`:

1. takes each journaled step's batches out of the queue by name, in the journaled order, and trains on
   them; on the CPU the same weights, optimizer state and samples in the same order give bit-identical
   weights;
2. compares the weights of the newest announced version, when the replay reaches it, with the hash its
   announcement carries (the publisher's record of the newest);
3. stops at the first step whose batches are not all queued (an inbox copy lost).

Announced versions must keep their content. When the replay falls short of the newest announced version,
or reaches it with other weights (another device), what the trainer holds goes out as the version after
the newest announced one (:attr:`Replayed.bump_to`), never as different content under an announced
version.

Nothing here references the trainer: it hands in how to take a journaled step's batches and how to train
on them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from intellect_node.policy.weights import PolicyWeights
from intellect_node.roles.trainer.batching import Step
from intellect_node.roles.trainer.inbox import JournalEntry

log = logging.getLogger(__name__)

TakeNamed = Callable[[JournalEntry], "Step | None"]
"""The queued batches a journaled step took, in its order; None when one of them is not queued."""
TrainStep = Callable[[Step, JournalEntry], Awaitable["PolicyWeights | None"]]
"""Train on a step's batches as that journal entry (no new journal line); the new version's weights, or
None when no group carried a signal."""


@dataclass(frozen=True)
class Announced:
    """The newest version announced before the crash, and its weights' content hash."""

    version: int
    checkpoint_hash: str


@dataclass(frozen=True)
class Replayed:
    """What a replay did: ``outcome`` is ``none`` (nothing journaled), ``replayed``, ``identical`` (the
    newest announced version came out with its announced hash) or ``bumped``."""

    steps: int
    outcome: str
    newest: PolicyWeights | None
    """The weights of the newest version the replay trained (None: the checkpoint's are current)."""
    bump_to: int | None = None
    """Set when ``outcome`` is ``bumped``: the version to publish what the trainer holds as."""


async def replay_steps(entries: list[JournalEntry], *, version: Callable[[], int], take: TakeNamed,
                       train: TrainStep, announced: Announced | None) -> Replayed:
    """Replay ``entries`` (the journal after the checkpoint); ``version()`` is the trainer's current
    policy version, which ``train`` moves on by one for each step that trained."""
    steps = 0
    newest: PolicyWeights | None = None
    identical: bool | None = None
    for entry in entries:
        got = take(entry) if entry.version == version() else None
        if got is None:
            log.warning("replay stopped at step %d (v%d): its batches are not all in the inbox",
                        entry.seq, entry.version)
            break
        weights = await train(got, entry)
        steps += 1
        if weights is not None:
            newest = weights
            if announced is not None and version() == announced.version:
                identical = announced.checkpoint_hash == weights.content_hash
    reached = version()
    if announced is not None and (reached < announced.version or
                                  (reached == announced.version and identical is False)):
        log.warning("replay reached v%d (%s) but v%d was announced: publishing these weights as v%d",
                    reached, "different weights" if identical is False else "short",
                    announced.version, announced.version + 1)
        return Replayed(steps, "bumped", newest, bump_to=announced.version + 1)
    if not entries:
        return Replayed(0, "none", None)
    outcome = "identical" if identical else "replayed"
    log.info("replayed %d journaled steps to v%d (%s)", steps, reached, outcome)
    return Replayed(steps, outcome, newest)
