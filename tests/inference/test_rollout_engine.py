"""The torch engine against transformers, batch invariance of seeded sampling, multi-chunk rollouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.envs.tasks import embedded_task
from intellect_node.inference.base import InferenceEngine, SamplingConfig
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.inference.verifier import Expectations, Verifier
from intellect_node.proofs.thresholds import Thresholds
from intellect_node.protocol.signing import SigningKey
from tests.support.rollouts import random_model, resign

STRICT = Thresholds(exp_mismatches=2, mant_err_mean=0.5, mant_err_median=1.0, logprob_diff=1e-3,
                    sampling_gap=1e-3)


@pytest.fixture(scope="module")
def rand_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model(tmp_path_factory.mktemp("rand"), seed=0)


@pytest.fixture(scope="module")
def eng(rand_dir: Path) -> TorchEngine:
    return TorchEngine.from_dir(str(rand_dir))


def test_engine_matches_transformers(eng: TorchEngine, rand_dir: Path) -> None:
    from intellect_node.models.loader import load_hf_model

    assert isinstance(eng, InferenceEngine)
    tok = eng.loaded.tokenizer
    prompts = [tok.prompt_ids("123+045="), tok.prompt_ids("7+8="), tok.prompt_ids("a longer prompt here")]
    gens = eng.generate(prompts, [1, 2, 3], SamplingConfig(max_new_tokens=24))
    hf = load_hf_model(rand_dir)
    for g in gens:
        assert len(g.tokens) == len(g.logprobs) == g.hidden.shape[0] <= 24
        assert tok.eos_id not in g.tokens[:-1]
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([g.prompt_tokens + g.tokens[:-1]]), output_hidden_states=True)
        start = len(g.prompt_tokens) - 1
        assert torch.allclose(out.hidden_states[-1][0, start:], g.hidden, atol=1e-4)
        lp = torch.log_softmax(out.logits[0, start:].float(), -1).gather(
            -1, torch.tensor(g.tokens).view(-1, 1))
        assert torch.allclose(lp.view(-1), torch.tensor(g.logprobs), atol=1e-4)


def test_seeded_sampling_does_not_depend_on_the_batch(eng: TorchEngine) -> None:
    tok = eng.loaded.tokenizer
    texts = ["1+1=", "999+999=", "hello", "x" * 30, "0=", "12+34=", "abc", "5"]
    prompts = [tok.prompt_ids(t) for t in texts]
    keys = [101 * i + 7 for i in range(len(texts))]
    cfg = SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=20)
    together = eng.generate(prompts, keys, cfg)
    for i in (0, 3, 7):
        alone = eng.generate([prompts[i]], [keys[i]], cfg)[0]
        assert alone.tokens == together[i].tokens
        assert torch.allclose(alone.hidden, together[i].hidden, atol=1e-5)


def test_a_group_computes_its_prompt_once_and_samples_as_if_alone(eng: TorchEngine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tok = eng.loaded.tokenizer
    texts = ["12+34=", "x" * 30, "12+34=", "5", "x" * 30, "12+34="]  # three prompts, two repeated
    prompts = [tok.prompt_ids(t) for t in texts]
    keys = [31 * i + 5 for i in range(len(texts))]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=12)
    rows: list[int] = []
    forward = eng.runner.forward

    def counted(ids: torch.Tensor, *a: Any, **k: Any) -> Any:
        rows.append(ids.shape[0])
        return forward(ids, *a, **k)

    monkeypatch.setattr(eng.runner, "forward", counted)
    grouped = eng.generate(prompts, keys, cfg)
    assert rows[0] == 3 and set(rows[1:]) == {6}  # the prefill: one row per distinct prompt
    monkeypatch.undo()
    for i, (p, key) in enumerate(zip(prompts, keys)):
        alone = eng.generate([p], [key], cfg)[0]
        assert grouped[i].prompt_tokens == p
        assert alone.tokens == grouped[i].tokens, i
        assert torch.allclose(alone.hidden, grouped[i].hidden, atol=1e-5), i
        assert grouped[i].logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_long_rollouts_verify_and_an_edit_deep_inside_is_caught(eng: TorchEngine, rand_dir: Path) -> None:
    key = SigningKey.generate()
    # A random model says <eos> at ~1/128 per token: some of 8 rollouts reach 70 tokens, three proof
    # chunks (32 + 32 + 6). Seeds are fixed, so which ones is deterministic.
    problems = [embedded_task().problem(i) for i in range(11, 19)]
    recs = generate_rollouts(eng, eng.loaded.tokenizer, problems, key=key, run_id="r", policy_version=0,
                             checkpoint=checkpoint_cid(rand_dir), sampling=SamplingConfig(max_new_tokens=70),
                             seeds=list(range(1, 9)))
    verifier = Verifier(eng, STRICT, Expectations(run_id="r", policy_version=0))
    long = [r for r in recs if len(r.completion_tokens) > 64]
    assert long, "expected a rollout with three proof chunks"
    assert all(v.accepted for v in verifier.verify(recs)), verifier.verify(recs)
    r = long[0]
    toks = list(r.completion_tokens)
    toks[50] = (toks[50] + 1) % 90 + 5  # another ordinary character
    forged = resign(r, key, completion_tokens=toks)
    v = verifier.verify([forged])[0]
    assert not v.accepted and v.reason in {"toploc", "logprob", "sampling"}
