"""Turn engine generations into signed rollout records (what a worker submits).

For each problem: build the prompt's token IDs with the model's chat template (and the task's system
prompt; ``ModelTokenizer.prompt_ids``), sample with the engine (noise key from the rollout's seed
and ID; unless given, the seed of the k-th repeat of a problem is ``group_seed(run, version, worker,
problem, k)`` for its k-th occurrence in the batch, which validators recompute), build the TOPLOC
proofs from the returned hidden states, score the completion with the task's checker, and sign the
record with the worker's key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

from intellect_node.envs.tasks import Problem
from intellect_node.inference.base import InferenceEngine, SamplingConfig
from intellect_node.models.tokenizer import ModelTokenizer
from intellect_node.proofs.sampling import batch_seeds, derived_rollout_id, rollout_key
from intellect_node.proofs.toploc import build_proofs_batch
from intellect_node.protocol.ids import cid_from_digest, cid_of
from intellect_node.protocol.rollout import RolloutRecord, SamplingParams, sign_rollout
from intellect_node.protocol.signing import SigningKey


def checkpoint_cid(model_dir: Path) -> str:
    """CID of a model folder's weights (what a rollout names as its policy checkpoint when the run does
    not publish checkpoints as blobs): of ``model.safetensors``, or for a sharded folder of the canonical
    JSON ``{"shards": {file: CID}}`` over the files its index names. Files are hashed in 16 MiB pieces,
    so a multi-GB checkpoint is never read into memory whole."""
    folder = Path(model_dir)
    single = folder / "model.safetensors"
    if single.exists() or not (folder / "model.safetensors.index.json").exists():
        return _file_cid(single)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = {name: _file_cid(folder / name) for name in sorted(set(index["weight_map"].values()))}
    return cid_of(json.dumps({"shards": shards}, sort_keys=True, separators=(",", ":")).encode())


def _file_cid(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(16 << 20):
            digest.update(piece)
    return cid_from_digest(digest.digest())


def generate_rollouts(engine: InferenceEngine, tokenizer: ModelTokenizer, problems: Sequence[Problem], *,
                      key: SigningKey, run_id: str, policy_version: int, checkpoint: str,
                      sampling: SamplingConfig, seeds: Sequence[int] | None = None,
                      rollout_ids: Sequence[str] | None = None) -> list[RolloutRecord]:
    """Sample one rollout per problem (repeat a problem for a GRPO group) and return signed records."""
    n = len(problems)
    seeds = list(seeds) if seeds is not None else \
        batch_seeds(run_id, policy_version, key.peer_id, [p.problem_id for p in problems])
    ids = (list(rollout_ids) if rollout_ids is not None
           else [derived_rollout_id(key.peer_id, s) for s in seeds])
    if len(seeds) != n or len(ids) != n or len(set(ids)) != n:
        raise ValueError("need one seed and one distinct rollout id per problem")
    prompts = [tokenizer.prompt_ids(p.prompt, system=p.system or None) for p in problems]
    gens = engine.generate(prompts, [rollout_key(s, i) for s, i in zip(seeds, ids)], sampling)
    proofs = build_proofs_batch([g.hidden for g in gens])
    out = []
    for p, g, s, rid, pr in zip(problems, gens, seeds, ids, proofs):
        rec = RolloutRecord(
            run_id=run_id, rollout_id=rid, task_id=p.task_id, problem_id=p.problem_id,
            prompt_tokens=g.prompt_tokens, completion_tokens=g.tokens, logprobs=g.logprobs,
            sampling=SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                    max_new_tokens=sampling.max_new_tokens, seed=s),
            policy_version=policy_version, checkpoint_cid=checkpoint, dtype=engine.dtype,
            reward=p.reward(tokenizer.decode(g.tokens)), proofs=pr, worker=key.peer_id)
        out.append(sign_rollout(rec, key))
    return out
