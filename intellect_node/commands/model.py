"""``intellect-node model``: the embedded model (a tiny Llama pretrained on 3-digit addition)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    model = typer.Typer(help="The embedded default model: export it, inspect it.", no_args_is_help=True)

    @model.command("export")
    def export(dir: Path = typer.Argument(..., help="Folder to write the model to (Hugging Face format).")) -> None:
        """Write the embedded model (config, weights, tokenizer, proof thresholds) to DIR."""
        from intellect_node.trainer.model import export_model

        out = export_model(dir)
        typer.echo(f"wrote the embedded model to {out}")

    @model.command("info")
    def info(model_dir: Path = typer.Option(None, "--model", help="Model folder (default: embedded).")) -> None:
        """Print the model's architecture, size and checkpoint CID."""
        import json

        from intellect_node.node.engines.rollouts import checkpoint_cid
        from intellect_node.trainer.model import resolve_model_dir

        path = resolve_model_dir(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            typer.echo(f"{k:24} {cfg.get(k)}")
        typer.echo(f"{'checkpoint_cid':24} {checkpoint_cid(path)}")
        if (path / "training.json").exists():
            typer.echo(f"{'training':24} {(path / 'training.json').read_text().strip()}")

    app.add_typer(model, name="model")
