"""load_model on every family: supported types load (sharded like single-file), unsupported ones and
features are refused with the model_type and the fix, hub IDs come from the cache or fail clearly offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from intellect_node.errors import ConfigError
from intellect_node.models.families import SUPPORTED_MODEL_TYPES, architecture
from intellect_node.models.loader import export_model, load_model, resolve_model_dir
from tests.support.common import run_cli
from tests.support.families import VARIANTS, copy_model, family_model


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind", VARIANTS)
def test_every_family_loads_in_each_dtype(kind: str) -> None:
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(family_model(kind), dtype=dtype)
        assert {t.dtype for t in loaded.state.values()} == {getattr(torch, dtype)}
        assert loaded.arch.model_type == kind.removesuffix("-sharded")
    arch = load_model(family_model(kind)).arch
    assert arch.qkv_bias == (kind == "qwen2") and arch.qk_norm == (kind == "qwen3")
    assert arch.tied_embeddings == (kind == "qwen3")
    assert (arch.sliding_window is not None) == (kind == "mistral")
    assert arch.rope["rope_type"] == ("llama3" if kind.startswith("llama") else "default")


def test_sharded_weights_load_like_one_file(tmp_path: Path) -> None:
    one, shards = load_model(family_model("llama")), load_model(family_model("llama-sharded"))
    assert len(list(family_model("llama-sharded").glob("model-*.safetensors"))) > 1
    assert one.state.keys() == shards.state.keys()
    assert all(torch.equal(one.state[k], shards.state[k]) for k in one.state)
    out = export_model(tmp_path / "copy", src=family_model("llama-sharded"))  # shards and index travel
    assert load_model(out).state.keys() == one.state.keys()


def test_an_unsupported_model_type_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    path = copy_model("llama", tmp_path / "gpt2")
    _edit_config(path, model_type="gpt2")
    with pytest.raises(ConfigError) as err:
        load_model(path)
    msg = str(err.value)
    assert "'gpt2'" in msg and ", ".join(SUPPORTED_MODEL_TYPES) in msg and err.value.field == "model"
    res = run_cli("model", "info", "--model", str(path))  # the CLI: a message and exit 2
    assert res.returncode == 2, res.stderr
    assert "gpt2" in res.stderr + res.stdout and "qwen3" in res.stderr + res.stdout


@pytest.mark.parametrize("changes, words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "'yarn'"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None}, "llama3"),
])
def test_features_the_runner_lacks_are_refused(changes: dict[str, object], words: str) -> None:
    cfg = json.loads((family_model("llama") / "config.json").read_text())
    with pytest.raises(ConfigError, match=words):
        architecture({**cfg, **changes})


def test_rope_settings_read_both_transformers_layouts() -> None:
    cfg = json.loads((family_model("llama") / "config.json").read_text())
    nested = architecture(cfg).rope  # transformers 5 writes rope_parameters
    scaling = dict(cfg["rope_parameters"])
    theta = scaling.pop("rope_theta")
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    old.update(rope_theta=theta, rope_scaling={**scaling, "type": scaling.pop("rope_type")})
    assert architecture(old).rope == nested and nested["factor"] == 8.0


def test_missing_weights_are_named(tmp_path: Path) -> None:
    path = copy_model("llama", tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="missing model.safetensors"):
        load_model(path)


def _hub_cache(root: Path, repo: str, src: Path) -> Path:
    """A Hugging Face cache holding ``src`` as the main revision of ``repo`` (the layout the hub library
    writes: models--org--name/{refs/main, snapshots/<commit>/...})."""
    org, name = repo.split("/")
    entry = root / f"models--{org}--{name}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    snapshot.parent.mkdir()
    export_model(snapshot, src=src)
    return snapshot


def test_a_hub_id_resolves_from_the_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # so "tiny-org/tiny-qwen3" is not a folder here
    snapshot = _hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen3", family_model("qwen3"))
    assert resolve_model_dir("tiny-org/tiny-qwen3") == snapshot
    assert load_model("tiny-org/tiny-qwen3").arch.model_type == "qwen3"


def test_an_uncached_hub_id_offline_is_refused_with_the_fix(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_model("Qwen/Qwen3-0.6B")
    msg = str(err.value)
    assert "--model Qwen/Qwen3-0.6B" in msg and "offline" in msg and "download" in msg
    assert "pass a model folder" in msg
    with pytest.raises(ConfigError, match="not a model folder"):  # not hub-shaped: a missing folder
        load_model(str(tmp_path / "no" / "such" / "dir"))


def test_checkpoint_cid_of_one_file_and_of_shards(tmp_path: Path) -> None:
    from intellect_node.inference.rollouts import checkpoint_cid
    from intellect_node.protocol.ids import cid_of

    one = family_model("llama")
    assert checkpoint_cid(one) == cid_of((one / "model.safetensors").read_bytes())
    sharded = family_model("llama-sharded")
    cid = checkpoint_cid(sharded)
    copy = copy_model("llama-sharded", tmp_path / "copy")
    assert checkpoint_cid(copy) == cid != checkpoint_cid(one)
    last = sorted(copy.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-1] + b" ")  # one byte of one shard changed
    assert checkpoint_cid(copy) != cid


@pytest.mark.parametrize("kind", ["llama", "llama-sharded", "qwen3"])
def test_shapes_only_holds_every_tensor_name_and_shape_and_no_data(kind: str) -> None:
    full = load_model(family_model(kind), dtype="bfloat16")
    shell = load_model(family_model(kind), dtype="bfloat16", weights=False)
    assert shell.state.keys() == full.state.keys() and shell.config == full.config
    for k, t in shell.state.items():
        assert (t.shape, t.dtype) == (full.state[k].shape, full.state[k].dtype), k
    assert {t.device.type for t in shell.state.values()} == {"meta"}
