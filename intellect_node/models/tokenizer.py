"""A model folder's tokenizer: ``tokenizer.json`` through ``tokenizers``, the chat template through jinja2.

Every node must turn a problem into the *same* prompt token IDs (the validator compares them), so the
prompt is built from the model's own files only: its chat template rendered with one user message (and a
system message when the run's task has a system prompt) and ``add_generation_prompt=True``, then encoded
without adding special tokens again (the template writes them). A model without a template starts from
its BOS token (when it has one) followed by the prompt's tokens.

transformers' ``AutoTokenizer`` would do the same but costs seconds of import per process (measured on
the 2-core development machine: 8.9 s to import it and load the embedded tokenizer, against 0.15 s for
this module), and a worker's hot path needs only encode, decode and one rendering.
The template runs in jinja2's immutable sandbox with the helpers templates expect (``raise_exception``,
``strftime_now``, ``tojson``), as transformers renders it.

EOS IDs are the union of ``config.json``'s and ``generation_config.json``'s ``eos_token_id`` (an int or a
list) and the tokenizer's EOS token: chat models end a turn with one (``<|im_end|>``, ``<|eot_id|>``) and
a document with another, and both must stop generation on every engine and in the verifier.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from jinja2 import Template

PROMPT_CACHE = 4096
"""Prompts whose token IDs a tokenizer keeps (``ModelTokenizer.prompt_ids``)."""

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
TEMPLATE_DATE = datetime(2024, 7, 26)
"""What ``strftime_now`` gives a template (Llama 3.x templates print today's date): a fixed day, because
every node must render the same prompt tokens whatever its clock says (Llama 3.1's own default date)."""


def _read_json(path: Path) -> dict[str, object]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON: {exc}", field="model") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object", field="model")
    return data


def _token_text(value: object) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(path: Path, tok_cfg: Mapping[str, object]) -> str | None:
    """The default chat template: ``chat_template.jinja`` (transformers >= 4.43 writes it apart) or the
    config's ``chat_template`` (a string, or a list of named templates of which ``default`` is used)."""
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    tmpl = tok_cfg.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) and tmpl else None


class ModelTokenizer:
    """Encode, decode and build prompts for the model folder ``path`` (no transformers import)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        tok_file = self.path / "tokenizer.json"
        if not tok_file.exists():
            raise ConfigError(f"{self.path} has no tokenizer.json (a fast tokenizer is required)",
                              field="model")
        self._tok = Tokenizer.from_file(str(tok_file))
        tok_cfg = {**_read_json(self.path / "special_tokens_map.json"),
                   **_read_json(self.path / "tokenizer_config.json")}
        self.specials: dict[str, str] = {}
        for key in SPECIAL_KEYS:
            text = _token_text(tok_cfg.get(key))
            if text is not None:
                self.specials[key] = text
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = len(vocab)
        self.special_ids = frozenset(
            [i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]
            + [vocab[t] for t in self.specials.values() if t in vocab])
        self.bos_id = self._id_of("bos_token", vocab)
        model_cfg = _read_json(self.path / "config.json")
        gen_cfg = _read_json(self.path / "generation_config.json")
        eos = _ids(model_cfg.get("eos_token_id")) + _ids(gen_cfg.get("eos_token_id"))
        tok_eos = self._id_of("eos_token", vocab)
        if tok_eos is not None:
            eos.append(tok_eos)
        if not eos:
            raise ConfigError(f"{self.path}: no EOS token (config.json, generation_config.json or the "
                              "tokenizer's eos_token); generation could never end", field="model")
        self.eos_id: int = eos[0]
        """The first EOS ID (``config.json``'s first): what a completion cut by hand is ended with."""
        self.eos_ids: frozenset[int] = frozenset(eos)
        self.special_ids |= self.eos_ids
        pad = self._id_of("pad_token", vocab)
        self.pad_id: int = pad if pad is not None else self.eos_id
        self.chat_template = _chat_template(self.path, tok_cfg)
        self._template: Template | None = None
        self._prompts: dict[tuple[str, str | None], tuple[int, ...]] = {}
        """``prompt_ids`` answers: a group's rollouts share one prompt, and the worker, validator and
        trainer each need its tokens once per rollout (a chat template's render costs ~0.1 ms)."""

    def _id_of(self, key: str, vocab: dict[str, int]) -> int | None:
        text = self.specials.get(key)
        if text is None:
            return None
        if text not in vocab:
            raise ConfigError(f"{self.path}: {key} {text!r} is not in the tokenizer's vocabulary",
                              field="model")
        return vocab[text]

    def encode(self, text: str) -> list[int]:
        """Token IDs of ``text`` with no special tokens added (special tokens written in it still map to
        their IDs)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` up to (not including) the first EOS ID; other special tokens dropped."""
        out: list[int] = []
        for i in ids:
            if i in self.eos_ids:
                break
            if i not in self.special_ids:
                out.append(i)
        return str(self._tok.decode(out, skip_special_tokens=True))

    def render(self, prompt: str, system: str | None = None) -> str:
        """The chat template's text for one user turn (and a system turn when given), ready for the
        assistant's answer. Only for models with a template."""
        if self.chat_template is None:
            raise ConfigError(f"{self.path} has no chat template", field="model")
        if self._template is None:
            self._template = _compile(self.chat_template)
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        from jinja2.exceptions import TemplateError

        try:
            return str(self._template.render(messages=messages, add_generation_prompt=True, **self.specials))
        except TemplateError as exc:
            raise ConfigError(f"{self.path}: the chat template refuses the prompt: {exc}",
                              field="model") from exc

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        """Token IDs a rollout starts from: the rendered chat template, or BOS + the prompt's tokens."""
        key = (prompt, system)
        ids = self._prompts.get(key)
        if ids is None:
            if self.chat_template is not None:
                ids = tuple(self.encode(self.render(prompt, system)))
            else:
                ids = tuple(([] if self.bos_id is None else [self.bos_id]) + self.encode(prompt))
            if len(self._prompts) >= PROMPT_CACHE:  # bounded; threads share it (a lost entry is recomputed)
                self._prompts.clear()
            self._prompts[key] = ids
        return list(ids)


def _compile(source: str) -> Template:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: object, indent: int | None = None) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: TEMPLATE_DATE.strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ConfigError(f"the model's chat template does not compile: {exc}", field="model") from exc
