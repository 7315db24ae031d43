"""The torch engine and the verifier on every family: agreement with transformers' reference forward
(fp32), generation that stops at any of the model's EOS IDs, and honest rollouts accepted while tampered
ones (an edited token, another model's weights, a prompt without the run's system prompt) are rejected.

Tolerances (fp32, CPU): the runner's prefill of a left-padded batch matches
``AutoModelForCausalLM`` to atol 1e-5 on the final-norm hidden states and on the logits (measured: bit
for bit); generation through the static cache to atol 2e-5 on hidden states and logprobs (measured:
<= 4e-6; the cache's decode step adds up keys in another order than a full forward).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.envs.tasks import Problem, embedded_task
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.decoder import left_pad
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.inference.verifier import Expectations, Verifier
from intellect_node.models.loader import load_hf_model, load_model
from intellect_node.proofs.thresholds import Thresholds
from intellect_node.protocol.rollout import RolloutRecord
from intellect_node.protocol.signing import SigningKey
from tests.support.families import VARIANTS, build_family_model, family_model
from tests.support.rollouts import resign

FAMILIES = [v for v in VARIANTS if v != "llama-sharded"]  # the sharded one loads the same tensors
STRICT = Thresholds(exp_mismatches=2, mant_err_mean=0.5, mant_err_median=1.0, logprob_diff=1e-3,
                    sampling_gap=1e-3)
SYSTEM = "Answer with the digits of the sum only."
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=24)
WORKER = SigningKey(bytes(range(32)))
TEXTS = ["What is 12 + 45? Think step by step, then answer.", "1+1",
         "The quick brown fox jumps over the dog."]


def problems(n: int) -> list[Problem]:
    """Embedded-task problems with a system prompt (what a chat model's run sets)."""
    return [dataclasses.replace(embedded_task().problem(i), system=SYSTEM) for i in range(n)]


def resolve(problem_id: str) -> Problem:
    return dataclasses.replace(embedded_task().get(problem_id), system=SYSTEM)


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request: pytest.FixtureRequest) -> TorchEngine:
    return TorchEngine.from_dir(str(family_model(request.param)))


def test_the_verifiers_prefill_computes_a_repeated_prompt_once_with_the_same_result(
        engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = engine.loaded.tokenizer
    prompts = [tok.prompt_ids(t, system=SYSTEM if i == 0 else None) for i, t in enumerate(TEXTS)]
    g = torch.Generator().manual_seed(4)
    # Groups of 3 per prompt, completions of 0 to 17 tokens: rows cross Mistral's window of 12.
    seqs = [(p, torch.randint(3, 200, (int(n),), generator=g).tolist())
            for p in prompts for n in torch.randint(0, 18, (3,), generator=g)]
    rows: list[int] = []
    forward = engine.runner.forward

    def counted(ids: torch.Tensor, *a: Any, **k: Any) -> Any:
        rows.append(ids.shape[0])
        return forward(ids, *a, **k)

    monkeypatch.setattr(engine.runner, "forward", counted)
    shared = engine.prefill(seqs)
    assert rows == [len(prompts), len(seqs)]  # the prompts once, then every completion
    monkeypatch.undo()
    for (_, c), (h, lg), (h_ref, lg_ref) in zip(seqs, shared, engine._prefill_rows(seqs)):
        assert h.shape == h_ref.shape == (len(c), h_ref.shape[1]) and lg.shape == lg_ref.shape
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(lg, lg_ref, atol=1e-4, rtol=0)


def test_prefill_of_a_left_padded_batch_matches_transformers(engine: TorchEngine) -> None:
    tok = engine.loaded.tokenizer
    seqs = [tok.prompt_ids(t, system=SYSTEM if i == 0 else None) for i, t in enumerate(TEXTS)]
    assert max(map(len, seqs)) > 2 * min(map(len, seqs))  # real padding; Mistral's window (12) is exceeded
    ids, positions, valid = left_pad(seqs, tok.pad_id, engine.device)
    hidden = engine.runner.forward(ids, positions, valid)
    logits = engine.runner.logits(hidden)
    ref = load_hf_model(engine.loaded.path)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=valid.long(), position_ids=positions,
                  output_hidden_states=True)
    torch.testing.assert_close(hidden[valid], out.hidden_states[-1][valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[valid], out.logits[valid].float(), atol=1e-5, rtol=0)


def test_generation_matches_transformers_token_by_token(engine: TorchEngine) -> None:
    tok = engine.loaded.tokenizer
    gens = engine.generate([tok.prompt_ids(t) for t in TEXTS], [11, 12, 13], SAMPLING)
    ref = load_hf_model(engine.loaded.path)
    for g in gens:
        assert len(g.tokens) == len(g.logprobs) == g.hidden.shape[0] <= SAMPLING.max_new_tokens
        with torch.no_grad():
            out = ref(input_ids=torch.tensor([g.prompt_tokens + g.tokens[:-1]]), output_hidden_states=True)
        start = len(g.prompt_tokens) - 1
        torch.testing.assert_close(g.hidden, out.hidden_states[-1][0, start:], atol=2e-5, rtol=0)
        lp = torch.log_softmax(out.logits[0, start:].float(), -1).gather(-1,
                                                                          torch.tensor(g.tokens).view(-1, 1))
        torch.testing.assert_close(torch.tensor(g.logprobs), lp.view(-1), atol=2e-5, rtol=0)


def test_generation_stops_at_any_eos_id() -> None:
    loaded = load_model(family_model("llama"))
    tok = loaded.tokenizer
    assert len(tok.eos_ids) == 2
    head = loaded.state["lm_head.weight"].clone()
    for eos in tok.eos_ids:
        head[eos] *= 4  # make both EOS tokens likely, so a few rows end with each
    engine = TorchEngine(dataclasses.replace(loaded, state={**loaded.state, "lm_head.weight": head}))
    prompts = [tok.prompt_ids(f"What is {i} + {i}?") for i in range(16)]
    gens = engine.generate(prompts, list(range(16)), SAMPLING)
    ends = set()
    for g in gens:
        assert not tok.eos_ids & set(g.tokens[:-1])
        if g.tokens[-1] in tok.eos_ids:
            ends.add(g.tokens[-1])
        else:
            assert len(g.tokens) == SAMPLING.max_new_tokens
    assert ends == tok.eos_ids
    longer = engine.generate(prompts, list(range(16)), dataclasses.replace(SAMPLING, ignore_eos=True))
    assert all(len(g.tokens) == SAMPLING.max_new_tokens for g in longer)
    # The verifier ends a completion at either EOS ID too: tokens after one are a termination failure.
    key = SigningKey(bytes(range(1, 33)))
    recs = generate_rollouts(engine, tok, problems(16), key=key, run_id="r", policy_version=0,
                             checkpoint=checkpoint_cid(loaded.path), sampling=SAMPLING,
                             seeds=list(range(16)))
    verifier = Verifier(engine, STRICT, resolve=resolve)
    assert all(v.accepted for v in verifier.verify(recs))
    stopped = [r for r in recs if r.completion_tokens[-1] in tok.eos_ids]
    assert {r.completion_tokens[-1] for r in stopped} == tok.eos_ids
    for r in stopped:
        if len(r.completion_tokens) < SAMPLING.max_new_tokens:
            more = resign(r, key, completion_tokens=r.completion_tokens + tok.encode("4")[:1],
                          logprobs=r.logprobs + [-1.0])
            assert verifier.verify([more])[0].reason == "termination"


@pytest.fixture(scope="module")
def honest(engine: TorchEngine) -> list[RolloutRecord]:
    return generate_rollouts(engine, engine.loaded.tokenizer, problems(8), key=WORKER, run_id="r",
                             policy_version=0, checkpoint=checkpoint_cid(engine.loaded.path),
                             sampling=SAMPLING, seeds=list(range(100, 108)))


def test_honest_rollouts_are_accepted_and_tampered_ones_rejected(
        engine: TorchEngine, honest: list[RolloutRecord], tmp_path: Path) -> None:
    tok = engine.loaded.tokenizer
    verifier = Verifier(engine, STRICT, Expectations(run_id="r", policy_version=0), resolve=resolve)
    verdicts = verifier.verify(honest)
    assert all(v.accepted for v in verdicts), [v for v in verdicts if not v.accepted]
    # One completion token edited (to another ordinary token), re-signed by the cheating worker.
    forged, vocab = [], engine.runner.vocab_size
    for r in honest:
        toks = list(r.completion_tokens)
        if len(toks) < 3:
            continue
        pos = len(toks) // 2  # never the last token, which may be the EOS
        toks[pos] = next(t for t in ((toks[pos] + j) % vocab for j in range(1, vocab))
                         if t not in tok.special_ids)
        forged.append(resign(r, WORKER, completion_tokens=toks))
    assert len(forged) >= 4
    reasons = [v.reason for v in verifier.verify(forged)]
    assert None not in reasons and set(reasons) <= {"toploc", "logprob", "sampling"}, reasons
    # Generated by other weights of the same family (another seed).
    kind = engine.loaded.arch.model_type
    other = TorchEngine.from_dir(str(build_family_model(kind, tmp_path / "other", seed=1)))
    theirs = generate_rollouts(other, tok, problems(8), key=WORKER, run_id="r", policy_version=0,
                               checkpoint=honest[0].checkpoint_cid, sampling=SAMPLING,
                               seeds=list(range(100, 108)))
    assert {v.reason for v in verifier.verify(theirs)} == {"toploc"}
    # The prompt rendered without the run's system prompt is not the problem's prompt.
    bare = [dataclasses.replace(p, system="") for p in problems(2)]
    no_system = generate_rollouts(engine, tok, bare, key=WORKER, run_id="r", policy_version=0,
                                  checkpoint=honest[0].checkpoint_cid, sampling=SAMPLING, seeds=[1, 2])
    assert {v.reason for v in verifier.verify(no_system)} == {"prompt_mismatch"}
