"""vLLM on a real family (run by `make test-vllm`): a run admitting vllm@cpu, calibrated for that pair,
has its torch validator accept honest vLLM rollouts and reject a re-signed token edit; policy versions
are swapped into the running engine."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="run via `make test-vllm`, which installs vLLM in .venv-vllm")

from intellect_node.fsutil import atomic_write_text  # noqa: E402
from intellect_node.inference import SamplingConfig, make_engine  # noqa: E402
from intellect_node.inference.calibrate import calibrate  # noqa: E402
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts  # noqa: E402
from intellect_node.inference.verifier import Expectations, Verifier  # noqa: E402
from intellect_node.node.config import build_config  # noqa: E402
from intellect_node.proofs.thresholds import merge_into  # noqa: E402
from intellect_node.protocol.rollout import sign_rollout  # noqa: E402
from intellect_node.protocol.signing import SigningKey  # noqa: E402
from intellect_node.roles.engines import run_thresholds  # noqa: E402
from intellect_node.testing.models import make_model  # noqa: E402
from intellect_node.trainer.tasks import embedded_task  # noqa: E402

torch.set_num_threads(1)
KEY = SigningKey(bytes(range(32)))
PEER = "12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxuMFPuEv5zDdu"
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
SAMPLING = SamplingConfig(max_new_tokens=16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any, Path]:
    root = tmp_path_factory.mktemp("vllm-run")
    model = make_model(root / "qwen3", "qwen3")
    torch_engine = make_engine(model, "torch")
    vllm_engine = make_engine(model, "vllm", vllm={"max_model_len": 256, "max_num_seqs": 16})
    path = root / "run-thresholds.json"
    for cal in calibrate(torch_engine, [vllm_engine], n=16, batch_sizes=(1, 8), sampling=SAMPLING):
        atomic_write_text(path, json.dumps(merge_into(path, cal)))
    return model, torch_engine, vllm_engine, path


def _verifier(setup: tuple[Path, Any, Any, Path]) -> Verifier:
    model, torch_engine, _, path = setup
    cfg = build_config({"run": {"model": str(model), "proof_thresholds": str(path), "trainer_peer_id": PEER,
                                "rollout_engines": ["vllm@cpu"]}})
    return Verifier(torch_engine, run_thresholds(cfg, model),
                    Expectations(run_id="r", checkpoint_cid=checkpoint_cid(model)))


def test_torch_validator_accepts_honest_vllm_rollouts_and_rejects_a_token_edit(
        setup: tuple[Path, Any, Any, Path]) -> None:
    model, torch_engine, vllm_engine, _ = setup
    problems = embedded_task().sample(random.Random(5), 8)
    recs = generate_rollouts(vllm_engine, torch_engine.loaded.tokenizer, problems, key=KEY, run_id="r",
                             policy_version=0, checkpoint=checkpoint_cid(model), sampling=SAMPLING,
                             seeds=list(range(50, 58)))
    verifier = _verifier(setup)
    verdicts = verifier.verify(recs)
    assert all(v.accepted for v in verdicts), [v for v in verdicts if not v.accepted]
    tokens = list(recs[0].completion_tokens)
    tokens[len(tokens) // 2] = 3 + (tokens[len(tokens) // 2] + 7) % 300
    forged = sign_rollout(msgspec.structs.replace(recs[0], completion_tokens=tokens), KEY)
    assert not verifier.verify([forged])[0].accepted


def test_a_policy_version_swapped_into_vllm_matches_the_torch_engine_on_it(
        setup: tuple[Path, Any, Any, Path]) -> None:
    from dataclasses import replace

    model, torch_engine, vllm_engine, _ = setup
    new_state = {k: v + 0.01 * torch.randn_like(v) for k, v in torch_engine.loaded.state.items()}
    vllm_engine.load_weights(new_state)
    policy = make_engine(replace(torch_engine.loaded, state=new_state), "torch")
    prompts = [torch_engine.loaded.tokenizer.prompt_ids("123+456=")] * 2
    got = vllm_engine.generate(prompts, [1, 2], SAMPLING)
    want = policy.generate(prompts, [1, 2], SAMPLING)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    vllm_engine.load_weights(torch_engine.loaded.state)  # back to version 0 for the other tests
