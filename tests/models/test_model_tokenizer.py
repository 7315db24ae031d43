"""ModelTokenizer: the embedded model's prompts unchanged, chat templates rendered as transformers renders
them, EOS sets from the model's own files, the BOS fallback and the chat_template.jinja file."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from intellect_node.envs.tasks import embedded_task
from intellect_node.errors import ConfigError
from intellect_node.models.loader import (
    BOS,
    EOS,
    build_char_tokenizer_json,
    char_vocab,
    embedded_model_dir,
    load_tokenizer,
    tokenizer_config_files,
)
from intellect_node.models.tokenizer import ModelTokenizer
from tests.support.families import VARIANTS, copy_model, family_model

MESSAGES = [("What is 12 + 45?", None), ("What is 12 + 45?", "Answer with digits only.")]


def test_embedded_prompts_are_bos_then_one_id_per_character() -> None:
    tok = load_tokenizer(None)
    vocab = char_vocab()
    problems = embedded_task().sample(random.Random(7), 200)
    for p in problems:
        want = [vocab[BOS]] + [vocab[c] for c in p.prompt]  # what CharTokenizer produced before #13
        assert tok.prompt_ids(p.prompt) == want
        assert tok.prompt_ids(p.prompt, system="Be brief.") == want  # its template ignores a system prompt
    assert tok.eos_ids == {vocab[EOS]} and tok.eos_id == vocab[EOS] and tok.pad_id == vocab["<pad>"]
    assert tok.decode(tok.encode("0168") + [tok.eos_id] + tok.encode("junk")) == "0168"


def test_embedded_tokenizer_files_are_what_make_model_writes() -> None:
    folder = embedded_model_dir()
    assert (folder / "tokenizer.json").read_text() == build_char_tokenizer_json()
    for name, text in tokenizer_config_files().items():
        assert (folder / name).read_text() == text


@pytest.mark.parametrize("kind", [v for v in VARIANTS if v != "llama-sharded"])
def test_chat_template_renders_as_transformers_does(kind: str) -> None:
    from transformers import AutoTokenizer

    path = family_model(kind)
    tok = ModelTokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(path))
    for prompt, system in MESSAGES:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        text = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.render(prompt, system) == text
        ids = tok.prompt_ids(prompt, system)
        assert tok._tok.decode(ids, skip_special_tokens=False) == text
        assert len([i for i in ids if i in tok.special_ids]) >= 2  # the template's markers are special IDs


def test_eos_ids_come_from_config_generation_config_and_tokenizer() -> None:
    llama = ModelTokenizer(family_model("llama"))
    vocab = llama._tok.get_vocab()
    end, eot = vocab["<|end_of_text|>"], vocab["<|eot_id|>"]
    assert llama.eos_ids == {end, eot} and llama.eos_id == end  # config.json's comes first
    assert llama.bos_id == vocab["<|begin_of_text|>"] and llama.pad_id == end  # no pad token: EOS
    qwen = ModelTokenizer(family_model("qwen3"))
    qv = qwen._tok.get_vocab()
    assert qwen.eos_ids == {qv["<|im_end|>"], qv["<|endoftext|>"]} and qwen.bos_id is None
    assert qwen.pad_id == qv["<|endoftext|>"]
    text = llama.encode("The answer is 57.")
    for eos in (end, eot):  # decoding stops at either EOS; other specials are dropped
        assert llama.decode(text + [eos] + llama.encode(" junk")) == "The answer is 57."
    assert llama.decode([vocab["<|start_header_id|>"]] + text) == "The answer is 57."


def test_without_a_template_a_prompt_is_bos_then_its_tokens(tmp_path: Path) -> None:
    path = copy_model("llama", tmp_path / "m")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = ModelTokenizer(path)
    assert tok.chat_template is None
    assert tok.prompt_ids("1+2=") == [tok.bos_id] + tok.encode("1+2=")
    # A chat_template.jinja file (how transformers >= 4.43 saves templates) is the model's template.
    (path / "chat_template.jinja").write_text("{{ bos_token }}Q: {{ messages[-1]['content'] }}\nA:")
    tok = ModelTokenizer(path)
    assert tok.prompt_ids("1+2=") == [tok.bos_id] + tok.encode("Q: 1+2=\nA:")


def test_broken_tokenizer_files_are_config_errors(tmp_path: Path) -> None:
    path = copy_model("qwen2", tmp_path / "m")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% if %}"}))
    with pytest.raises(ConfigError, match="chat template"):
        ModelTokenizer(path).prompt_ids("x")
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|nope|>"}))
    with pytest.raises(ConfigError, match="not in the tokenizer's vocabulary"):
        ModelTokenizer(path)
    empty = tmp_path / "empty"
    shutil.copytree(path, empty)
    (empty / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        ModelTokenizer(empty)
