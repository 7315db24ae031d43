"""The tokenizer files of a GGUF model: ``tokenizer.json``, ``tokenizer_config.json`` (with the chat
template) and ``generation_config.json``, built from the file's ``tokenizer.ggml.*`` metadata.

A GGUF holds no ``tokenizer.json``: it stores the vocabulary, the merges, each token's type and the
special token IDs under llama.cpp's key names, and names the pre-tokenizer (the text splitting before
BPE) by a label, ``tokenizer.ggml.pre``. What we do:

1. Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, StarCoder) is built;
   SentencePiece vocabularies (``"llama"``: Llama 2, TinyLlama, Mistral) are refused with a ConfigError.
2. The pre-tokenizer follows llama.cpp's split for that label (``PRE_TOKENIZERS``); an unknown label is
   refused rather than guessed, since a wrong split silently changes the prompt token IDs.
   transformers' own GGUF conversion ignores some labels: for ``smollm`` it leaves out the split of every
   digit that llama.cpp and SmolLM's own ``tokenizer.json`` make (they differ on text such as two
   spaces before a digit).
3. Tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, as in
   transformers' conversion.
4. The JSON is written by this module, not serialised by ``tokenizers`` or transformers, so the bytes do
   not depend on which version of either is installed. Merges are written as ``"a b"`` strings, which
   every ``tokenizers`` release reads (a byte-level token never holds a space).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from intellect_node.errors import ConfigError

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
"""``tokenizer.ggml.token_type`` values (llama.cpp's ``LLAMA_TOKEN_TYPE_*``)."""

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> dict[str, object]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(pattern: str) -> dict[str, object]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


_DIGITS: dict[str, object] = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, _byte_level(True)]}
_LLAMA3: dict[str, object] = {"type": "Sequence",
                               "pretokenizers": [_split(_LLAMA3_SPLIT), _byte_level(False)]}
PRE_TOKENIZERS: dict[str, tuple[dict[str, object], bool]] = {
    "default": (_byte_level(True), False),
    "gpt2": (_byte_level(True), False),
    "smollm": (_DIGITS, False),
    "starcoder": (_DIGITS, False),
    "refact": (_DIGITS, False),
    "llama-bpe": (_LLAMA3, True),
    "llama3": (_LLAMA3, True),
    "llama-v3": (_LLAMA3, True),
    "smaug-bpe": (_LLAMA3, True),
}
"""``tokenizer.ggml.pre`` -> (pre-tokenizer, ``ignore_merges``), after llama.cpp's ``llama-vocab.cpp``:
GPT-2's regex; each digit apart then GPT-2's regex (``smollm``, ``starcoder``, ``refact``); Llama 3's
regex, where a whole word found in the vocabulary is taken as is (``ignore_merges``, as in Llama 3's own
``tokenizer.json``). GPT-2's regex is what ByteLevel's ``use_regex`` applies."""


@lru_cache(maxsize=1)
def byte_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's byte-to-unicode table spells bytes with."""
    return frozenset(_byte_table().values())


def spelled(token: str) -> str:
    """A token in the byte alphabet (as transformers' conversion respells one written as plain text)."""
    if set(token) <= byte_alphabet():
        return token
    table = _byte_table()
    return "".join(table[b] for b in token.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_table() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the others are
    moved up past U+0100 in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def tokenizer_files(meta: dict[str, Any], context_length: int) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` (name -> text) from
    a GGUF's metadata (key -> value, as ``models.gguf`` reads it)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"the GGUF's tokenizer is {kind!r}; GGUF import supports byte-level BPE "
                          "tokenizers ('gpt2': SmolLM, Llama 3) only", field="model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"the GGUF's pre-tokenizer {pre!r} is not known here (supported: "
                          f"{', '.join(sorted(PRE_TOKENIZERS))})", field="model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # No merges: only a vocabulary whose ordinary tokens are single characters needs none (the embedded
    # model's, exported); anything longer would silently be tokenized byte by byte.
    single = all(len(t) == 1 for t, k in zip(tokens, types) if k == NORMAL)
    if not tokens or not (merges or single) or len(types) != len(tokens):
        raise ConfigError("the GGUF's tokenizer has no tokens or merges, or a token_type list of another "
                          "length", field="model")

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    pre_tok, ignore_merges = PRE_TOKENIZERS[pre]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": None, "pre_tokenizer": pre_tok,
        "post_processor": _post_processor(bos if add_bos else None, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges,
                  "vocab": {spelled(t): i for i, t in enumerate(tokens)}, "merges": merges},
    }
    tok_cfg: dict[str, object] = {
        "add_bos_token": add_bos, "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": bos, "clean_up_tokenization_spaces": False, "eos_token": eos,
        "model_max_length": context_length, "pad_token": token_of("padding_token_id"),
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": token_of("unknown_token_id")}
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok_cfg["chat_template"] = template
    tok_cfg = {k: v for k, v in tok_cfg.items() if v is not None}
    eos_list = eos_ids(meta)
    gen = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": eos_list[0] if len(eos_list) == 1 else (eos_list or None),
           "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    return {"tokenizer.json": _dump(tokenizer, indent=None), "tokenizer_config.json": _dump(tok_cfg),
            "generation_config.json": _dump({k: v for k, v in gen.items() if v is not None})}


def eos_ids(meta: Mapping[str, object]) -> list[int]:
    """The IDs that end generation: EOS, then end-of-turn and end-of-message where the file names them
    (Llama 3 ends a turn with ``<|eot_id|>``, a document with ``<|end_of_text|>``)."""
    ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool)))


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, object]]:
    """CONTROL tokens as special, USER_DEFINED as plain added tokens, both matched whole in text. A
    CONTROL token outside the byte alphabet is a llama.cpp mislabel and left as an ordinary token."""
    out = []
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL and set(token) <= byte_alphabet():
            special = True
        elif kind == USER_DEFINED:
            special = False
        else:
            continue
        out.append({"id": i, "content": spelled(token) if not special else token, "single_word": False,
                    "lstrip": False, "rstrip": False, "normalized": False, "special": special})
    return out


def _post_processor(bos: str | None, tokens: list[str]) -> dict[str, object]:
    """Add BOS to an encoding only where the file says so (``add_bos_token``); the chat template writes
    it otherwise. (The swarm encodes prompts without special tokens either way.)"""
    single: list[dict[str, object]] = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair: list[dict[str, object]] = single + [{"Sequence": {"id": "B", "type_id": 1}}]
    special: dict[str, object] = {}
    if bos is not None:
        head: dict[str, object] = {"SpecialToken": {"id": bos, "type_id": 0}}
        single, pair = [head, *single], [head, *single, {"SpecialToken": {"id": bos, "type_id": 1}},
                                         {"Sequence": {"id": "B", "type_id": 1}}]
        special = {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


def _dump(obj: Mapping[str, object], indent: int | None = 2) -> str:
    return json.dumps(obj, indent=indent, ensure_ascii=False) + "\n"


# ============================================================================================ export
# The inverse of ``tokenizer_files``: a model folder's tokenizer as GGUF metadata (``models.gguf_export``).

@dataclass(frozen=True)
class GgufVocab:
    """A folder's tokenizer as llama.cpp's ``tokenizer.ggml.*`` keys hold it."""

    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    """Empty for a character vocabulary: GGUF has no empty arrays, so the key is left out and ``scores``
    (all 0) written instead, from which transformers' GGUF loader derives no merges. llama.cpp requires
    merges of a ``gpt2`` tokenizer and refuses such a file."""
    special_ids: dict[str, int]
    """``bos``, ``eos``, ``eot``, ``eom``, ``padding``, ``unknown`` -> token ID, where the folder names
    one."""
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--gguf: {path} is not readable JSON ({exc}); {what}", field="gguf") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"--gguf: {path} does not hold an object; {what}", field="gguf")
    return doc


def _pre_label(tok: dict[str, Any]) -> str:
    """The ``tokenizer.ggml.pre`` label whose split (:data:`PRE_TOKENIZERS`) is this tokenizer's."""
    pre, model = tok.get("pre_tokenizer"), tok.get("model") or {}
    ignore = bool(model.get("ignore_merges", False))
    canon = json.dumps(pre, sort_keys=True)
    for label, (split, ignore_merges) in PRE_TOKENIZERS.items():
        if json.dumps(split, sort_keys=True) == canon and ignore_merges == ignore:
            return label
    raise ConfigError("--gguf: the model's pre-tokenizer (its text split before BPE) is none that llama.cpp "
                      f"names (known: {', '.join(sorted(PRE_TOKENIZERS))}); GGUF export would change the "
                      "prompts' token IDs", field="gguf")


def _ids(value: object) -> list[int]:
    items = value if isinstance(value, list) else [value]
    return [i for i in items if isinstance(i, int) and not isinstance(i, bool)]


def tokenizer_metadata(folder: Path, config: dict[str, Any], vocab_size: int) -> GgufVocab:
    """The tokenizer of the model folder ``folder`` (``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json``) as GGUF metadata for ``vocab_size`` embedding rows: what
    :func:`tokenizer_files` reads back into the same files. Byte-level BPE (``gpt2``) and a vocabulary of
    single characters (the embedded model's; written as byte-level BPE without merges) are supported;
    anything else is a ConfigError naming ``--gguf``."""
    tok = _read_json(folder / "tokenizer.json", "a model folder needs its tokenizer.json")
    tok_cfg, gen = ({} if not (folder / name).is_file() else _read_json(folder / name, "")
                    for name in ("tokenizer_config.json", "generation_config.json"))
    model = tok.get("model") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ConfigError("--gguf: the tokenizer.json has no vocabulary (a unigram or other model type); "
                          "GGUF export supports byte-level BPE tokenizers", field="gguf")
    added = {int(a["id"]): a for a in tok.get("added_tokens") or [] if isinstance(a.get("id"), int)}
    by_id: dict[int, str] = {int(i): str(t) for t, i in vocab.items()}
    for i, a in added.items():
        by_id.setdefault(i, str(a["content"]))
    single_chars = model.get("type") == "WordLevel" and all(len(t) == 1 or i in added or t.startswith("<")
                                                             for i, t in by_id.items())
    if model.get("type") == "BPE" and not model.get("byte_fallback") and tok.get("normalizer") is None:
        pre = _pre_label(tok)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    elif single_chars:
        pre, merges = "default", []
        by_id = {i: t if i in added else spelled(t) for i, t in by_id.items()}
    else:
        fallback = " with byte fallback" if model.get("byte_fallback") else ""
        raise ConfigError(f"--gguf: the tokenizer is {model.get('type')!r}{fallback}; GGUF export supports "
                          "byte-level BPE (SmolLM, Llama 3, Qwen-style) and single-character vocabularies",
                          field="gguf")
    if sorted(by_id) != list(range(len(by_id))) or len(by_id) > vocab_size:
        raise ConfigError(f"--gguf: the tokenizer's {len(by_id)} token IDs are not 0..n-1 within the model's "
                          f"{vocab_size} embedding rows", field="gguf")
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [(CONTROL if added[i].get("special") else USER_DEFINED) if i in added
             else NORMAL if merges or len(t) == 1 else UNUSED  # a character vocabulary's reserved entries
             for i, t in enumerate(tokens)]
    # Embedding rows past the tokenizer's last ID get placeholder tokens, as llama.cpp's converter adds.
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
    index = {t: i for i, t in enumerate(tokens)}

    def id_of(name: str) -> list[int]:
        value = tok_cfg.get(f"{name}_token")
        if isinstance(value, dict):
            value = value.get("content")
        return [index[value]] if isinstance(value, str) and value in index else []

    eos = _ids(gen.get("eos_token_id")) or _ids(config.get("eos_token_id")) or id_of("eos")
    special: dict[str, int] = {}
    for key, ids in (("bos", _ids(config.get("bos_token_id")) or id_of("bos")), ("eos", eos[:1]),
                     ("eot", eos[1:2]), ("eom", eos[2:3]),
                     ("padding", _ids(config.get("pad_token_id")) or id_of("pad")),
                     ("unknown", id_of("unk"))):
        if ids and 0 <= ids[0] < len(tokens):
            special[key] = ids[0]
    template = tok_cfg.get("chat_template")
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return GgufVocab(pre=pre, tokens=tokens, types=types, merges=merges, special_ids=special,
                     add_bos=bool(tok_cfg.get("add_bos_token", False)),
                     add_eos=bool(tok_cfg.get("add_eos_token", False)),
                     chat_template=template if isinstance(template, str) and template else None)
