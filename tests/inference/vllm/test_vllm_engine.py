"""vLLM engine (run by `make test-vllm` in .venv-vllm): its rollouts verify under the torch prefill."""

from __future__ import annotations

import random

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="run via `make test-vllm`, which installs vLLM in .venv-vllm")

from intellect_node.envs.tasks import embedded_task  # noqa: E402
from intellect_node.inference.base import SamplingConfig  # noqa: E402
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts  # noqa: E402
from intellect_node.inference.torch_engine import TorchEngine  # noqa: E402
from intellect_node.inference.verifier import Expectations, Verifier  # noqa: E402
from intellect_node.inference.vllm_engine import VllmEngine  # noqa: E402
from intellect_node.models.loader import embedded_model_dir  # noqa: E402
from intellect_node.proofs.thresholds import load_thresholds  # noqa: E402
from intellect_node.protocol.signing import SigningKey  # noqa: E402

torch.set_num_threads(1)
KEY = SigningKey(bytes(range(32)))
# Starting vLLM (imports, weight loading, KV-cache profiling) took ~3 minutes on the shared CPU machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def engines() -> tuple[VllmEngine, TorchEngine]:
    return VllmEngine(), TorchEngine.from_dir()


@pytest.mark.parametrize("batch", [1, 16])
def test_vllm_rollouts_verify_under_torch_prefill(engines: tuple[VllmEngine, TorchEngine],
                                                  batch: int) -> None:
    v, t = engines
    problems = embedded_task().sample(random.Random(batch), batch)
    cfg = SamplingConfig(max_new_tokens=16)
    cid = checkpoint_cid(embedded_model_dir())
    recs = generate_rollouts(v, t.loaded.tokenizer, problems, key=KEY, run_id="r", policy_version=0,
                             checkpoint=cid, sampling=cfg, seeds=list(range(batch)))
    verifier = Verifier(t, load_thresholds(t.loaded.path, "float32"),
                        Expectations(run_id="r", checkpoint_cid=cid))
    verdicts = verifier.verify(recs)
    assert all(x.accepted for x in verdicts), [x for x in verdicts if not x.accepted]
    # the same seeds give the same tokens on the torch engine (the sampler is engine-independent)
    again = generate_rollouts(t, t.loaded.tokenizer, problems, key=KEY, run_id="r", policy_version=0,
                              checkpoint=cid, sampling=cfg, seeds=list(range(batch)),
                              rollout_ids=[r.rollout_id for r in recs])
    same = sum(a.completion_tokens == b.completion_tokens for a, b in zip(recs, again))
    assert same >= batch - 1


def test_vllm_long_generation_has_hidden_states_for_every_token(
        engines: tuple[VllmEngine, TorchEngine]) -> None:
    v, t = engines
    prompts = [t.loaded.tokenizer.prompt_ids("123+456=")] * 3
    gens = v.generate(prompts, [1, 2, 3], SamplingConfig(max_new_tokens=70, ignore_eos=True))
    for g in gens:
        assert len(g.tokens) == 70 and g.hidden.shape == (70, 128) and len(g.logprobs) == 70
        hidden, _ = t.prefill([(g.prompt_tokens, g.tokens)])[0]
        assert torch.allclose(hidden, g.hidden, atol=1e-3)
