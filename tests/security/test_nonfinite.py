"""A forged old log-probability must not turn the policy into NaN.

An unsampled group (``rl.verify_fraction`` < 1) gets only cheap checks, so the trainer can see a record
whose logprobs are finite but absurd (-89 or lower: exp(89) overflows fp32). Each layer is checked: the
loss bounds the log-ratio, a step with a non-finite gradient is skipped, and weights that are not finite
are never written as a policy or a checkpoint."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.errors import IntegrityError
from intellect_node.models.loader import load_hf_model
from intellect_node.policy.weights import PolicyWeights, require_finite
from intellect_node.protocol.signing import SigningKey
from intellect_node.roles.common.policy import PolicyPublisher
from intellect_node.trainer.checkpoint import TrainerState, save_checkpoint
from intellect_node.trainer.grpo import GRPOConfig, grpo_loss
from intellect_node.trainer.step import Sample, make_optimizer, train_step

torch.set_num_threads(1)
G = 4


def test_a_forged_old_logprob_gives_a_finite_loss_and_gradient() -> None:
    logits = torch.zeros(2, 3, requires_grad=True)
    logprobs = torch.log_softmax(logits, -1)
    old = torch.tensor([[-1.1, -1.1, -100.0], [-1.1, -1e30, -1.1]])  # finite, absurd
    parts = grpo_loss(logprobs, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 3), GRPOConfig(group_size=2))
    torch.autograd.backward(parts.loss)
    assert math.isfinite(float(parts.loss.detach())) and logits.grad is not None
    assert bool(torch.isfinite(logits.grad).all())


def _samples(forged: float) -> list[Sample]:
    prompt = (1, 40, 41, 42)
    out = []
    for i in range(G):
        lp = [-0.5, -0.7, forged if i == 0 else -0.6]
        out.append(Sample(prompt, (43, 44, 45 + i), tuple(lp), reward=float(i % 2)))
    return out


def test_a_step_on_a_forged_record_leaves_every_weight_finite() -> None:
    torch.manual_seed(0)
    model = load_hf_model(None)
    opt = make_optimizer(model, 1e-3)
    stats = train_step(model, opt, _samples(-1e4), GRPOConfig(group_size=G, token_budget=64))
    assert not stats.skipped
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_step_with_a_non_finite_gradient_is_skipped() -> None:
    torch.manual_seed(0)
    model = load_hf_model(None)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    first = next(model.parameters())
    first.register_hook(lambda g: torch.full_like(g, float("nan")))  # type: ignore[no-untyped-call]  # untyped in torch
    opt = make_optimizer(model, 1e-3)
    stats = train_step(model, opt, _samples(-0.5), GRPOConfig(group_size=G, token_budget=64))
    assert stats.skipped and not math.isfinite(stats.grad_norm)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weights_that_are_not_finite_are_never_published_or_checkpointed(tmp_path: Path) -> None:
    model = load_hf_model(None)
    name, param = next(iter(model.named_parameters()))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state[name].view(-1)[0] = float("inf")
    with pytest.raises(IntegrityError, match=name):
        require_finite(state)
    # the publisher refuses before it writes a file or touches the blob store (none given here)
    publisher = PolicyPublisher(tmp_path / "policy", None, SigningKey(bytes(32)), "run")  # type: ignore[arg-type]  # a stand-in for it
    for policy in (state, PolicyWeights.from_state_dict(state)):
        with pytest.raises(IntegrityError):
            asyncio.run(publisher.publish(1, policy))
    assert not list((tmp_path / "policy").glob("*.safetensors"))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(IntegrityError):
        save_checkpoint(tmp_path / "ckpt", model, None, TrainerState(version=1, step=1))
    assert not (tmp_path / "ckpt" / "LATEST").exists()


def test_a_skipped_step_is_charged_to_the_batch_behind_it(tmp_path: Path) -> None:
    """The step's batches are tried alone: the one whose loss is not finite alone is held against its
    worker (``nonfinite``, a refusal like a failed check), the honest one beside it is not."""
    from intellect_node.blobs.store import BlobStore
    from intellect_node.protocol.ids import cid_of
    from intellect_node.protocol.steps import STEP_KIND
    from intellect_node.protocol.topics import topic
    from intellect_node.roles.common.grpo import settings_of
    from intellect_node.roles.trainer.batching import Accepted
    from intellect_node.roles.trainer.metrics import MetricsFile
    from intellect_node.roles.trainer.publication import Publication
    from intellect_node.roles.trainer.records import StepRecords
    from intellect_node.trainer.model import TrainOptions
    from tests.security._roles_inproc import GROUP, RUN, trainer_role

    trainer_key, validator, honest, forger = (SigningKey.generate() for _ in range(4))
    poison = 77  # stands in for whatever a record holds that the loss cannot survive
    torch.manual_seed(0)
    model = load_hf_model(None)

    def nan_rows(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        return out.masked_fill((args[0] == poison).any(-1)[:, None, None], float("nan"))

    model.get_input_embeddings().register_forward_hook(nan_rows)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def group(last: int) -> list[Sample]:
        return [Sample((1, 40, 41), (43, 44, last), (-0.5, -0.7, -0.6), reward=float(i))
                for i in range(GROUP)]

    async def main() -> None:
        trainer = trainer_role(tmp_path, trainer_key, [validator.peer_id], checkpoint_every=1000)
        trainer.model, trainer.opt = model, make_optimizer(model, 1e-3)
        trainer.train_options = TrainOptions.from_section(trainer.rl)
        trainer.metrics = MetricsFile(trainer.dir)
        # nothing published before: the step only waits for (and times) the previous publication
        trainer.publication = Publication(None, trainer.rt.swarm, "policy", trainer.dir,  # type: ignore[arg-type]  # a stand-in for it
                                          trainer.rt.board, trainer.tasks, trainer._snapshot)
        # the step's signed record, as start() wires it, into a real blob store
        store = BlobStore(tmp_path / "blobs")

        class Blobs:
            async def put_file(self, path: Any, *, name: str | None = None,
                               announce_min_chunks: int = 0) -> tuple[str, object]:
                return await asyncio.to_thread(store.add_file, path, trainer_key, name=name)

        trainer.records = StepRecords(key=trainer_key, swarm=trainer.rt.swarm, blobs=Blobs(),
                                      topic=topic(RUN, STEP_KIND), directory=trainer.dir, tasks=trainer.tasks)
        trainer.settings = settings_of(trainer.gcfg, lr=trainer.rl.lr, temperature=trainer.rl.temperature,
                                       micro_tokens=None, compute_dtype=None)
        trainer._head_hash = (await asyncio.to_thread(trainer._snapshot)).content_hash
        taken = [Accepted(cid_of(b"honest"), honest.peer_id, 0, [group(45)], 1),
                 Accepted(cid_of(b"forged"), forger.peer_id, 0, [group(poison)], 2)]
        try:
            await trainer._step(taken, [])
        finally:
            trainer.intake.prefetch.close()
        refusals = trainer.intake.refusals
        assert refusals.get(forger.peer_id) == 1 and refusals.get(honest.peer_id) is None
        assert [p for p, reason in trainer.rt.swarm.peerbook.rejections if "nonfinite" in reason] == \
            [forger.peer_id]
        assert trainer.intake.counts["nonfinite_batches"] == 1

    asyncio.run(main())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the step was skipped
