"""``intellect-node rollout``: generate signed rollouts with proofs, and verify a file of them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError, ProtocolError

if TYPE_CHECKING:
    from intellect_node.protocol.signing import SigningKey

ModelOption = typer.Option(None, "--model", help="Model folder (default: the embedded model).")
DtypeOption = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16; part of the run config: "
                                                      "generation and verification must use the same.")


def _signing_key(data_dir_opt: Optional[Path]) -> SigningKey:
    """The node key when one exists, else an ephemeral key (said so on stderr)."""
    from intellect_node.p2p.identity import key_path, load_key
    from intellect_node.protocol.signing import SigningKey

    d = data_dir(data_dir_opt)
    if key_path(d).exists():
        return load_key(d)
    typer.echo("note: no node key; signing with an ephemeral key (run `intellect-node keys init`)", err=True)
    return SigningKey.generate()


def register(app: typer.Typer) -> None:
    rollout = typer.Typer(help="Rollouts with TOPLOC proofs: generate and verify.", no_args_is_help=True)

    @rollout.command("generate")
    def generate(
        n: int = typer.Option(..., "--n", help="Number of rollouts."),
        out: Path = typer.Option(..., "--out", help="File to write the signed rollout batch to (msgpack)."),
        model_dir: Optional[Path] = ModelOption,
        dtype: str = DtypeOption,
        batch_size: int = typer.Option(32, "--batch-size", help="Rollouts sampled together."),
        max_new_tokens: int = typer.Option(16, "--max-new-tokens"),
        temperature: float = typer.Option(1.0, "--temperature"),
        top_p: float = typer.Option(1.0, "--top-p"),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed for problems and sampling (default: "
                                                                "random)."),
        run_id: str = typer.Option("local", "--run-id"),
        policy_version: int = typer.Option(0, "--policy-version"),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
        data_dir_opt: Optional[Path] = DataDirOption,
    ) -> None:
        """Sample N rollouts of the embedded task, build proofs, sign them, write them to OUT."""
        if n < 1:
            raise ConfigError("--n must be at least 1", field="n")
        if batch_size < 1:
            raise ConfigError("--batch-size must be at least 1", field="batch_size")
        if not 0 < temperature <= 100 or not 0 < top_p <= 1:
            raise ConfigError("--temperature must be in (0, 100] and --top-p in (0, 1]", field="temperature")
        import random
        import secrets

        import torch

        from intellect_node.envs.tasks import embedded_task
        from intellect_node.fsutil import atomic_write_bytes
        from intellect_node.inference.base import SamplingConfig
        from intellect_node.inference.rollouts import checkpoint_cid, generate_rollouts
        from intellect_node.inference.torch_engine import TorchEngine
        from intellect_node.protocol.rollout import RolloutBatch, encode_batch

        torch.set_num_threads(1)
        key = _signing_key(data_dir_opt)
        engine = TorchEngine.from_dir(model_dir, dtype=dtype, device=device)
        rng = random.Random(seed if seed is not None else secrets.randbits(63))
        problems = embedded_task().sample(rng, n)
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        cid = checkpoint_cid(engine.loaded.path)
        records = []
        for start in range(0, n, batch_size):
            chunk = problems[start:start + batch_size]
            records += generate_rollouts(engine, engine.loaded.tokenizer, chunk, key=key, run_id=run_id,
                                         policy_version=policy_version, checkpoint=cid, sampling=sampling,
                                         seeds=[rng.randrange(1 << 63) for _ in chunk])
        atomic_write_bytes(out, encode_batch(RolloutBatch(run_id=run_id, policy_version=policy_version,
                                                          rollouts=records)))
        mean = sum(r.reward for r in records) / len(records)
        typer.echo(f"wrote {len(records)} rollouts to {out} (mean reward {mean:.3f}, worker {key.peer_id})")

    @rollout.command("verify")
    def verify(
        file: Path = typer.Argument(..., help="A rollout batch written by `rollout generate` (or a worker)."),
        model_dir: Optional[Path] = ModelOption,
        dtype: str = DtypeOption,
        thresholds: Optional[Path] = typer.Option(None, "--thresholds", help="Calibrated thresholds file "
                                                  "(default: the model folder's proof_thresholds.json)."),
        policy_version: Optional[int] = typer.Option(None, "--policy-version",
                                                     help="Required policy version (default: the batch's)."),
        checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Required checkpoint CID "
                                                 "(default: the CID of --model's weights; 'any' skips)."),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    ) -> None:
        """Re-check every rollout by prefill; exit 0 if all are valid, 1 if any is rejected."""
        import torch

        from intellect_node.inference.rollouts import checkpoint_cid
        from intellect_node.inference.torch_engine import TorchEngine
        from intellect_node.inference.verifier import Expectations, Verifier
        from intellect_node.proofs.thresholds import load_thresholds
        from intellect_node.protocol.rollout import decode_batch

        if not file.is_file():
            raise ConfigError(f"FILE {file} does not exist; pass a file written by `rollout generate`",
                              field="file")
        try:
            batch = decode_batch(file.read_bytes())
        except ProtocolError as exc:
            typer.echo(f"rejected: {file} is not a valid rollout batch: {exc}")
            raise typer.Exit(1) from exc
        torch.set_num_threads(1)
        engine = TorchEngine.from_dir(model_dir, dtype=dtype, device=device)
        th = load_thresholds(engine.loaded.path, dtype, thresholds)
        cid = None if checkpoint == "any" else (checkpoint or checkpoint_cid(engine.loaded.path))
        version = batch.policy_version if policy_version is None else policy_version
        expect = Expectations(run_id=batch.run_id, checkpoint_cid=cid, policy_version=version)
        verdicts = Verifier(engine, th, expect).verify(batch.rollouts)
        bad = [v for v in verdicts if not v.accepted]
        for v in bad:
            typer.echo(f"rejected {v.rollout_id} {v.reason}: {v.detail}")
        typer.echo(f"{len(verdicts) - len(bad)}/{len(verdicts)} rollouts valid")
        raise typer.Exit(1 if bad else 0)

    app.add_typer(rollout, name="rollout")
