"""``intellect-node model``: the embedded model (a tiny Llama pretrained on 3-digit addition)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    model = typer.Typer(help="The embedded default model: export it, inspect it.", no_args_is_help=True)

    @model.command("export")
    def export(
        dir: Path = typer.Argument(..., help="Folder to write the model to (Hugging Face format)."),
    ) -> None:
        """Write the embedded model (config, weights, tokenizer, proof thresholds) to DIR."""
        from intellect_node.models.loader import export_model

        out = export_model(dir)
        typer.echo(f"wrote the embedded model to {out}")

    @model.command("info")
    def info(
        model_dir: Path = typer.Option(None, "--model", help="Model folder (default: embedded)."),
    ) -> None:
        """Print the model's architecture, size and checkpoint CID."""
        import json

        from intellect_node.inference.rollouts import checkpoint_cid
        from intellect_node.models.loader import resolve_model_dir

        path = resolve_model_dir(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            typer.echo(f"{k:24} {cfg.get(k)}")
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
        rate = evaluate(model_dir, weights, n=n, seed=seed, max_new_tokens=max_new_tokens)
        typer.echo(f"pass rate {rate:.4f} on {n} problems (seed {seed})")

    app.add_typer(model, name="model")
