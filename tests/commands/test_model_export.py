"""``model export --data-dir``: the policy a real (in-process) run trained, out as a Hugging Face folder
that transformers loads offline with the logits and greedy tokens of the node's torch engine on that
policy, and as a GGUF that transformers' GGUF loader reads with the same logits (f16) and the project's
import reads back. Operator mistakes exit 2 naming the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from intellect_node.cli import app
from intellect_node.commands.export import held_versions
from intellect_node.errors import ConfigError
from intellect_node.inference import make_engine
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.evaluate import with_weights
from intellect_node.inference.torch_engine import TorchEngine
from intellect_node.models.gguf import import_gguf
from intellect_node.models.loader import ModelTokenizer, load_model
from intellect_node.protocol.policy import open_announcement
from intellect_node.testing.roles import key_of
from tests.support.common import run_cli
from tests.support.trained_run import trained_run

pytest.importorskip("gguf")
torch.set_num_threads(1)

PROMPTS = ["123+456=", "7+80=", "999+1="]
GREEDY = SamplingConfig(max_new_tokens=8, top_p=1e-9)
"""Greedy decoding: the engine has no greedy mode, and a top-p this small keeps the top token only."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer's data dir after a few trained and checkpointed steps."""
    return trained_run(tmp_path_factory.mktemp("run")) / "trainer"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _engine_greedy(engine: Any, tok: ModelTokenizer) -> list[list[int]]:
    gens = engine.generate([tok.prompt_ids(p) for p in PROMPTS], list(range(len(PROMPTS))), GREEDY)
    return [g.tokens for g in gens]


def test_latest_policy_loads_in_transformers_with_the_engines_greedy_tokens(run: Path, tmp_path: Path,
                                                                            monkeypatch: Any) -> None:
    import transformers

    out = tmp_path / "hf"
    r = invoke("model", "export", "--data-dir", str(run), "--out", str(out))
    assert r.exit_code == 0, r.output
    held = held_versions(run)
    newest = held[max(held)]
    assert f"exported policy v{newest.version}" in r.output
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "policy.json"):
        assert (out / name).is_file(), name
    provenance = json.loads((out / "policy.json").read_text())
    assert provenance["version"] == newest.version
    # the version the trainer announced last, exported, carries the hash it announced
    ann = open_announcement((run / "trainer" / "announcement.bin").read_bytes(), run_id="inproc",
                            trainer=key_of("trainer").peer_id)
    r = invoke("model", "export", "--data-dir", str(run), "--version", str(ann.version), "--out",
               str(tmp_path / "announced"))
    assert r.exit_code == 0, r.output
    announced = json.loads((tmp_path / "announced" / "policy.json").read_text())
    assert announced["policy_hash"] == ann.checkpoint_hash

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                           dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    tok = ModelTokenizer(out)
    assert "{{ bos_token }}" in (hf_tok.chat_template or "")
    # the node's engine on the run's model with the policy file: the reference
    base = load_model(None)
    node = TorchEngine(with_weights(base, newest.path))
    want = _engine_greedy(node, tok)
    trained = node.loaded.state
    assert any(not torch.equal(trained[k], base.state[k]) for k in base.state)  # not the starting model
    for prompt, tokens in zip(PROMPTS, want):
        ids = torch.tensor([tok.prompt_ids(prompt)])
        assert hf_tok.encode(prompt, add_special_tokens=False) == tok.encode(prompt)
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_new_tokens,
                          do_sample=False, eos_token_id=sorted(tok.eos_ids),
                          pad_token_id=tok.pad_id)
        assert got[0, ids.shape[1]:].tolist() == tokens, prompt


def test_gguf_of_a_trained_policy_reads_back_with_the_same_logits(run: Path, tmp_path: Path) -> None:
    import transformers

    out, file = tmp_path / "hf16", tmp_path / "policy.gguf"
    held = held_versions(run)
    older = min(held)
    r = invoke("model", "export", "--data-dir", str(run), "--version", str(older), "--out", str(out),
               "--dtype", "float16", "--gguf", str(file), "--gguf-type", "f16")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "policy.json").read_text())["version"] == older
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                            dtype=torch.float32)
    got = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=file.name,
                                                            dtype=torch.float32)
    got_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    tok = ModelTokenizer(out)
    for prompt in PROMPTS:
        assert got_tok.encode(prompt, add_special_tokens=False) == tok.encode(prompt)
        ids = torch.tensor([tok.prompt_ids(prompt)])
        with torch.no_grad():
            torch.testing.assert_close(got(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)
    # the project's own import reads it back into a folder its engine generates the same tokens with
    back = import_gguf(file, tmp_path / "back")
    assert _engine_greedy(make_engine(back, "torch"), ModelTokenizer(back)) == \
        _engine_greedy(make_engine(out, "torch"), tok)


def test_operator_mistakes_name_the_flag(run: Path, tmp_path: Path) -> None:
    def error(*args: str) -> str:
        r = invoke("model", "export", *args)
        assert isinstance(r.exception, ConfigError), r.output
        return str(r.exception)

    assert "--version 999" in error("--data-dir", str(run), "--version", "999", "--out", str(tmp_path / "a"))
    assert "--version 'newest'" in error("--data-dir", str(run), "--version", "newest", "--out",
                                         str(tmp_path / "a"))
    assert "--data-dir" in error("--data-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "a"))
    assert "--data-dir" in error("--data-dir", str(tmp_path), "--out", str(tmp_path / "a"))  # holds none
    assert "--gguf-type 'q4'" in error("--data-dir", str(run), "--out", str(tmp_path / "a"), "--gguf",
                                       str(tmp_path / "a.gguf"), "--gguf-type", "q4")
    assert "--out" in error("--data-dir", str(run))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    assert "--out" in error("--data-dir", str(run), "--out", str(tmp_path / "full"))
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep"
    assert not (tmp_path / "a").exists()
    # the console script turns the ConfigError into exit code 2 with the message on stderr
    r = run_cli("model", "export", "--data-dir", str(run), "--version", "999", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "--version 999" in r.stderr, r.stderr
