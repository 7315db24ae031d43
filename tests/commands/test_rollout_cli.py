"""The model / rollout / proofs commands: the main path through the real console script, the error paths
in-process (typer's CliRunner) to keep the suite fast."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
from typer.testing import CliRunner, Result

from intellect_node.cli import app
from intellect_node.envs.tasks import embedded_task
from intellect_node.errors import ConfigError
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.protocol.rollout import RolloutBatch, decode_batch, encode_batch
from intellect_node.protocol.signing import SigningKey
from tests.support.cli import invoke_cli
from tests.support.rollouts import random_model, resign


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def test_export_generate_verify_and_reject(tmp_path: Path) -> None:
    model = tmp_path / "model"
    r = invoke_cli("model", "export", str(model))
    assert r.returncode == 0, r.stderr
    for name in ("config.json", "model.safetensors", "tokenizer.json", "proof_thresholds.json"):
        assert (model / name).is_file()
    out = tmp_path / "batch.msgpack"
    r = invoke_cli("rollout", "generate", "--model", str(model), "--n", "6", "--batch-size", "4",
                "--out", str(out), "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "wrote 6 rollouts" in r.stdout
    r = invoke_cli("rollout", "verify", str(out), "--model", str(model))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "6/6 rollouts valid" in r.stdout

    batch = decode_batch(out.read_bytes())
    mallory = SigningKey(bytes(range(9, 41)))
    bad = list(batch.rollouts)
    bad[1] = msgspec.structs.replace(bad[1], reward=5.0)                      # edited, not re-signed
    bad[4] = resign(bad[4], mallory, logprobs=[x - 1.0 for x in bad[4].logprobs])  # re-signed, wrong logprobs
    tampered = tmp_path / "tampered.msgpack"
    tampered.write_bytes(encode_batch(RolloutBatch(run_id=batch.run_id, policy_version=batch.policy_version,
                                                   rollouts=bad)))
    r = invoke_cli("rollout", "verify", str(tampered), "--model", str(model))
    assert r.returncode == 1
    assert f"rejected {bad[1].rollout_id} bad_signature" in r.stdout
    assert f"rejected {bad[4].rollout_id} logprob" in r.stdout
    assert "4/6 rollouts valid" in r.stdout

    res = invoke("rollout", "verify", str(out), "--policy-version", "7")
    assert res.exit_code == 1 and res.stdout.count("policy_version") == 6


def test_calibration_and_another_models_rollouts(tmp_path: Path) -> None:
    other = random_model(tmp_path / "other", seed=11)
    r = invoke("proofs", "calibrate", "--model", str(other), "--n", "4", "--batch-sizes", "1,4",
               "--max-new-tokens", "40")
    assert r.exit_code == 0, r.stdout
    data = json.loads((other / "proof_thresholds.json").read_text())
    entry = data["pairs"]["float32/torch@cpu->torch@cpu"]  # format 2: per engine pair
    assert data["format"] == 2 and entry["observed"]["rollouts"] == 8 and entry["batch_sizes"] == [1, 4]
    assert entry["thresholds"]["exp_mismatches"] >= 2

    eng = TorchEngine.from_dir(str(other))
    recs = generate_rollouts(eng, eng.loaded.tokenizer, embedded_task().sample(random.Random(0), 3),
                             key=SigningKey.generate(), run_id="local", policy_version=0,
                             checkpoint=checkpoint_cid(other), sampling=SamplingConfig(), seeds=[1, 2, 3])
    out = tmp_path / "b.msgpack"
    out.write_bytes(encode_batch(RolloutBatch(run_id="local", policy_version=0, rollouts=recs)))
    r = invoke("rollout", "verify", str(out), "--checkpoint", "any")  # checked against the embedded model
    assert r.exit_code == 1 and r.stdout.count(" toploc:") == 3, r.stdout
    r = invoke("rollout", "verify", str(out))  # by default the checkpoint CID must be the model's own
    assert r.exit_code == 1 and r.stdout.count(" checkpoint:") == 3


def test_operator_and_file_errors(tmp_path: Path) -> None:
    junk = tmp_path / "junk.msgpack"
    junk.write_bytes(b"\x93not a batch")
    r = invoke("rollout", "verify", str(junk))
    assert r.exit_code == 1 and "not a valid rollout batch" in r.stdout

    def config_error(*args: str) -> str:
        res = invoke(*args)
        assert isinstance(res.exception, ConfigError), res.stdout
        return str(res.exception)

    assert "FILE" in config_error("rollout", "verify", str(tmp_path / "missing"))
    assert "--n" in config_error("rollout", "generate", "--n", "0", "--out", str(tmp_path / "x"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "pick another DIR" in config_error("model", "export", str(tmp_path / "full"))
    assert "--model" in config_error("rollout", "generate", "--model", str(tmp_path), "--n", "1",
                                     "--out", "y")
    assert "dtype" in config_error("rollout", "generate", "--n", "1", "--out", "z", "--dtype", "float8")
    assert "--batch-sizes" in config_error("proofs", "calibrate", "--batch-sizes", "0")
    # the console script turns a ConfigError into exit code 2 with the message on stderr
    proc = invoke_cli("rollout", "generate", "--n", "0", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--n" in proc.stderr
