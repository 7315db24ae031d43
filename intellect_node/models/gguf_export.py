"""GGUF out: a model folder written as a llama.cpp file, the inverse of :mod:`models.gguf` (docs/models.md).

``export_gguf(folder, file, tensor_type)`` writes one GGUF that llama.cpp, ollama and transformers' GGUF
loader read. What we do:

1. Accept the families llama.cpp reads as ``general.architecture = "llama"``: Llama without Llama 3.1's
   frequency scaling (its ``rope_freqs`` tensor is not written, and the import refuses it) and Mistral
   without a sliding window. Other families are refused with a ConfigError naming ``--gguf``.
2. Write the ``llama.*`` keys from ``config.json`` (the ones :func:`models.gguf.model_config` reads) and
   the tokenizer from the folder's files (``models.gguf_tokenizer.tokenizer_metadata``: byte-level BPE,
   or the embedded model's single characters as BPE without merges), with the chat template.
3. Each tensor is named as llama.cpp names it (``models.gguf.gguf_name``), the query and key projections
   permuted as llama.cpp's converter does (``models.gguf.permute``), and stored as ``tensor_type``:
   ``f32``; ``f16`` (matrices; norms and biases stay F32, as llama.cpp's converter keeps them); ``q8_0``
   (matrices whose rows are a multiple of 32 values, the others F16). A tied output head is not written:
   llama.cpp and the import both read a file without ``output.weight`` as tied.
4. The file is written under a temporary name beside ``file`` and renamed into place.

Round trip: a folder the import wrote, exported as ``f32`` (or ``f16`` for a float16 folder) and
imported again in the same dtype, is byte-identical to it (``tests/models/test_gguf_export.py``).
Shortcut: the whole state dict is held in memory while the file is written (the writer quantizes tensor
by tensor, but reads them from the folder's loaded weights).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from intellect_node.errors import ConfigError
from intellect_node.fsutil import fsync_dir
from intellect_node.models.families import architecture
from intellect_node.models.gguf import gguf_module, gguf_name, permute
from intellect_node.models.gguf_tokenizer import GgufVocab, tokenizer_metadata
from intellect_node.models.loader import read_config, read_weights

if TYPE_CHECKING:
    from gguf import GGUFWriter

GGUF_TYPES = ("f16", "q8_0", "f32")
"""``--gguf-type`` values: how the matrices are stored (f16 first: what llama.cpp's converter defaults to)."""
Q8_BLOCK = 32
"""Values per Q8_0 block: a row is quantized only when its length is a multiple of it."""


def _check_family(cfg: dict[str, Any]) -> None:
    arch = architecture(cfg)
    if arch.model_type not in ("llama", "mistral"):
        raise ConfigError(f"--gguf: model_type {arch.model_type!r} is not exported to GGUF (llama and "
                          "mistral models are; the Hugging Face folder loads in vLLM and transformers)",
                          field="gguf")
    if arch.rope["rope_type"] not in ("default", "linear"):
        raise ConfigError(f"--gguf: RoPE scaling {arch.rope['rope_type']!r} needs llama.cpp's rope_freqs "
                          "tensor, which GGUF export does not write (plain and linear RoPE are exported)",
                          field="gguf")
    if arch.sliding_window is not None:
        raise ConfigError("--gguf: a sliding attention window is not exported to GGUF", field="gguf")
    if arch.qk_norm:
        raise ConfigError("--gguf: per-head query/key norms are not exported to GGUF", field="gguf")


def _write_metadata(w: GGUFWriter, gguf: Any, cfg: dict[str, Any], vocab: GgufVocab, name: str,
                    ftype: int) -> None:
    arch = architecture(cfg)
    w.add_name(name)
    w.add_file_type(ftype)
    w.add_block_count(arch.n_layers)
    w.add_context_length(arch.max_positions)
    w.add_embedding_length(arch.hidden_size)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.n_heads)
    w.add_head_count_kv(arch.n_kv_heads)
    w.add_key_length(arch.head_dim)
    w.add_value_length(arch.head_dim)
    w.add_rope_dimension_count(arch.head_dim)
    w.add_rope_freq_base(arch.rope["rope_theta"])
    if arch.rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(arch.rope["factor"])
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    else:  # a character vocabulary (see GgufVocab.merges)
        w.add_token_scores([0.0] * len(vocab.tokens))
    adders = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "eot": w.add_eot_token_id,
              "eom": w.add_eom_token_id, "padding": w.add_pad_token_id, "unknown": w.add_unk_token_id}
    for key, token_id in vocab.special_ids.items():
        adders[key](token_id)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template is not None:
        w.add_chat_template(vocab.chat_template)


def _stored(values: Any, tensor_type: str, gguf: Any) -> tuple[Any, Any]:
    """(data, raw_dtype or None) of one float32 tensor as ``tensor_type`` stores it."""
    import numpy as np

    q = gguf.GGMLQuantizationType
    if values.ndim < 2 or tensor_type == "f32":
        return np.ascontiguousarray(values, dtype=np.float32), None
    if tensor_type == "q8_0" and values.shape[-1] % Q8_BLOCK == 0:
        return gguf.quants.quantize(values, q.Q8_0), q.Q8_0
    return np.ascontiguousarray(values, dtype=np.float16), None


def export_gguf(folder: str | Path, file: str | Path, tensor_type: str = "f16", *,
                name: str | None = None) -> Path:
    """Write the model folder ``folder`` as the GGUF file ``file`` (replaced if it exists) with matrices
    stored as ``tensor_type`` (one of :data:`GGUF_TYPES`); returns ``file``."""
    if tensor_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {tensor_type!r} is not one of {', '.join(GGUF_TYPES)}",
                          field="gguf_type")
    gguf = gguf_module()
    folder = Path(folder)
    cfg = read_config(folder)
    _check_family(cfg)
    arch = architecture(cfg)
    state = read_weights(folder, "float32")
    if "model.embed_tokens.weight" not in state:
        raise ConfigError(f"--gguf: {folder} has no model.embed_tokens.weight", field="gguf")
    vocab = tokenizer_metadata(folder, cfg, int(state["model.embed_tokens.weight"].shape[0]))
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[tensor_type]
    dst = Path(file).expanduser().absolute()
    if dst.is_dir():
        raise ConfigError(f"--gguf {dst} is a folder; give a file name such as model.gguf", field="gguf")
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".writing", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(str(tmp), "llama")
        _write_metadata(w, gguf, cfg, vocab, name or folder.name, int(ftype))
        for hf_name in sorted(state):
            if arch.tied_embeddings and hf_name == "lm_head.weight":
                continue
            gname = gguf_name(hf_name)
            if gname is None:
                raise ConfigError(f"--gguf: tensor {hf_name} has no counterpart in a llama.cpp model",
                                  field="gguf")
            values = state[hf_name].numpy()
            if ".q_proj." in hf_name or ".k_proj." in hf_name:
                values = permute(values, arch.n_heads if ".q_proj." in hf_name else arch.n_kv_heads)
            data, raw_dtype = _stored(values, tensor_type, gguf)
            w.add_tensor(gname, data, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dst.parent)
    return dst
