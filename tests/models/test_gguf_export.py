"""GGUF export, the inverse of the import: a folder the import wrote comes back byte-identical through
``import(export(x))``, transformers' own GGUF loader (the independent reader) gives the folder's logits and
token IDs, and what GGUF cannot carry is refused naming ``--gguf``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from intellect_node.errors import ConfigError
from intellect_node.models.gguf import import_gguf, read_gguf
from intellect_node.models.gguf_export import export_gguf
from intellect_node.models.loader import ModelTokenizer
from intellect_node.testing.models import make_model
from tests.models.test_gguf import write_gguf

gguf = pytest.importorskip("gguf")
torch.set_num_threads(1)

TEXTS = ["What is 123 + 456? Think step by step.", "The quick brown fox <|im_end|> jumps."]


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a GGUF written as llama.cpp's converter does, its import in float32)."""
    root = tmp_path_factory.mktemp("gguf-export")
    write_gguf(root / "src.gguf")
    return root / "src.gguf", import_gguf(root / "src.gguf", root / "x")


def _same_files(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in a.iterdir():
        assert (b / f.name).read_bytes() == f.read_bytes(), f.name


def test_import_of_the_export_is_byte_identical(imported: Any, tmp_path: Path) -> None:
    src, x = imported
    export_gguf(x, tmp_path / "x.gguf", "f32")
    _same_files(x, import_gguf(tmp_path / "x.gguf", tmp_path / "y"))
    # float16: the folder's values are exactly representable in an F16 file
    half = import_gguf(src, tmp_path / "half", dtype="float16")
    export_gguf(half, tmp_path / "half.gguf", "f16")
    _same_files(half, import_gguf(tmp_path / "half.gguf", tmp_path / "half2", dtype="float16"))
    meta, tensors = read_gguf(tmp_path / "half.gguf")
    kinds = {t.name: t.tensor_type.name for t in tensors}
    assert kinds["blk.0.attn_q.weight"] == "F16" and kinds["output_norm.weight"] == "F32"
    assert meta["tokenizer.chat_template"] == ModelTokenizer(x).chat_template
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_transformers_reads_the_gguf_with_the_folders_logits_and_tokens(imported: Any,
                                                                         tmp_path: Path) -> None:
    import transformers

    src, _ = imported
    half = import_gguf(src, tmp_path / "half", dtype="float16")
    file = export_gguf(half, tmp_path / "m.gguf", "f16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(half), dtype=torch.float32,
                                                            local_files_only=True)
    got = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=file.name,
                                                            dtype=torch.float32)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(half), local_files_only=True)
    got_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    for text in TEXTS:
        ids = ref_tok.encode(text, add_special_tokens=False)
        assert got_tok.encode(text, add_special_tokens=False) == ids
        with torch.no_grad():
            a = ref(torch.tensor([ids])).logits
            b = got(torch.tensor([ids])).logits
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_q8_0_stores_the_matrices_quantized(imported: Any, tmp_path: Path) -> None:
    _, x = imported
    file = export_gguf(x, tmp_path / "q.gguf", "q8_0")
    _, tensors = read_gguf(file)
    kinds = {t.name: t.tensor_type.name for t in tensors}
    assert kinds["blk.0.ffn_up.weight"] == "Q8_0" and kinds["output_norm.weight"] == "F32"
    back = import_gguf(file, tmp_path / "back")  # the import dequantizes it again
    assert (back / "tokenizer.json").read_bytes() == (x / "tokenizer.json").read_bytes()


def test_what_gguf_cannot_carry_is_refused(imported: Any, tmp_path: Path) -> None:
    _, x = imported
    with pytest.raises(ConfigError, match="--gguf-type 'q4_k'"):
        export_gguf(x, tmp_path / "a.gguf", "q4_k")
    qwen = make_model(tmp_path / "qwen", "qwen2")
    with pytest.raises(ConfigError, match="--gguf: model_type 'qwen2'"):
        export_gguf(qwen, tmp_path / "b.gguf")
    llama3 = make_model(tmp_path / "llama3", "llama")  # the testing family carries Llama 3.1 scaling
    with pytest.raises(ConfigError, match="rope_freqs"):
        export_gguf(llama3, tmp_path / "c.gguf")
    with pytest.raises(ConfigError, match="is a folder"):
        export_gguf(x, tmp_path)
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "b.gguf").exists()
