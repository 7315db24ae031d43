"""``intellect-node model export``: a model folder, or a policy version a run trained, as a Hugging Face
folder (and a GGUF file). The policy comes from a data dir (below) or, with ``--run CID``, from the swarm:
the run fetched and checked as ``join --run`` does, then the version its trainer announces, fetched by
hash as a worker follows it (``export_from_swarm``).

Where a data dir holds policy versions (each a canonical policy file, ``policy/weights.py``, whose content
hash is the version's announced hash):

- ``trainer/checkpoints/vNNNNNNNN/model.safetensors``: the trainer's checkpoints (its two newest,
  ``trainer/checkpoint.py``);
- ``trainer/policy/vNNNNNNNNNN.safetensors``: the trainer's newest published version
  (``roles/common/policy.py``, the publisher);
- ``<role>/policy/vNNNNNNNNNN.safetensors``: the version a worker or validator holds (the follower).

The model the policy is of (config, tokenizer): ``--model``, else the run folders the data dir holds
(``runs/<cid>/model``, written by ``join --run``), ``run.model`` of ``<data-dir>/config.toml`` and the
embedded model (a run's default), the first whose tensors the policy fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer

from intellect_node.errors import ConfigError

_CKPT = re.compile(r"^v(\d{8})$")
_POLICY = re.compile(r"^v(\d{10})\.safetensors$")


@dataclass(frozen=True)
class HeldVersion:
    version: int
    path: Path
    where: str
    """``checkpoint``, ``published`` or ``held`` (a follower's)."""


def held_versions(data_dir: Path) -> dict[int, HeldVersion]:
    """Every policy version whose weights file the data dir holds (a checkpoint first where a version is
    in two places)."""
    found: dict[int, HeldVersion] = {}
    ckpts = data_dir / "trainer" / "checkpoints"
    for d in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
        m = _CKPT.match(d.name)
        if m and (d / "model.safetensors").is_file():
            v = int(m.group(1))
            found.setdefault(v, HeldVersion(v, d / "model.safetensors", "checkpoint"))
    for folder in sorted(data_dir.glob("*/policy")):
        for f in sorted(folder.iterdir()):
            m = _POLICY.match(f.name)
            if m and f.is_file():
                where = "published" if folder.parent.name == "trainer" else "held"
                found.setdefault(int(m.group(1)), HeldVersion(int(m.group(1)), f, where))
    return dict(sorted(found.items()))


def pick_version(data_dir: Path, version: str) -> HeldVersion:
    """``--version N|latest`` among the data dir's versions; ConfigError naming the flag otherwise."""
    if not data_dir.is_dir():
        raise ConfigError(f"--data-dir {data_dir}: no such folder", field="data_dir")
    held = held_versions(data_dir)
    if not held:
        raise ConfigError(f"--data-dir {data_dir} holds no policy version (no trainer/checkpoints/, no "
                          "<role>/policy/); give the data dir of the run's trainer, a worker or a validator",
                          field="data_dir")
    if version == "latest":
        return held[max(held)]
    if not version.isdigit():
        raise ConfigError(f"--version {version!r} is neither a version number nor 'latest'", field="version")
    if int(version) not in held:
        raise ConfigError(f"--version {version}: {data_dir} does not hold it (held: "
                          f"{', '.join(str(v) for v in held)}; the trainer keeps its newest checkpoints "
                          "only)", field="version")
    return held[int(version)]


def _model_candidates(data_dir: Path) -> list[Path]:
    out = [m for m in sorted((data_dir / "runs").glob("*/model")) if (m / "config.json").is_file()]
    if (data_dir / "config.toml").is_file():
        from intellect_node.config.loader import load_config

        cfg = load_config(data_dir / "config.toml", environ={})
        if cfg.run.model:
            out.append(Path(cfg.run.model))
    from intellect_node.models.loader import embedded_model_dir

    return [*out, embedded_model_dir()]  # a run's model defaults to the embedded one (run.model unset)


def policy_model(data_dir: Path, model: Optional[Path], shapes: dict[str, tuple[int, ...]]) -> Path:
    """The model folder the policy (``shapes``: name -> shape) is of: ``--model`` or the first candidate
    of the data dir whose tensors all fit (the module docstring)."""
    from intellect_node.models.loader import read_weight_shapes, resolve_model_dir

    if model is not None:
        return resolve_model_dir(model)
    tried = []
    for cand in _model_candidates(data_dir):
        try:
            path = resolve_model_dir(cand)
            want = read_weight_shapes(path)
        except ConfigError:
            continue
        tried.append(str(path))
        if all(k in shapes and tuple(v.shape) == shapes[k] for k, v in want.items() if k != "lm_head.weight"):
            return path
    raise ConfigError(f"--model: cannot tell which model the policy of {data_dir} is of (none of "
                      f"{', '.join(tried)} fits); give --model DIR, the run's model folder", field="model")


def export_policy(data_dir: Path, version: str, out: Path, *, model: Optional[Path], dtype: Optional[str]
                  ) -> tuple[Path, HeldVersion, str]:
    """Write version ``version`` of the data dir's policy as a Hugging Face folder ``out``; (the folder,
    the version, its policy hash)."""
    from intellect_node.errors import ProtocolError
    from intellect_node.inference.rollouts import checkpoint_cid
    from intellect_node.models.export import export_folder
    from intellect_node.policy.weights import PolicyWeights

    held = pick_version(data_dir, version)
    try:
        policy = PolicyWeights.load(held.path, max_size=1 << 62)
    except (OSError, ProtocolError) as exc:
        raise ConfigError(f"--version {held.version}: {held.path} is not a readable policy file ({exc})",
                          field="version") from exc
    base = policy_model(data_dir, model, {k: t.shape for k, t in policy.tensors.items()})
    provenance: dict[str, object] = {"version": held.version, "policy_hash": policy.content_hash,
                                     "source": str(held.path), "from": held.where, "base_model": str(base),
                                     "base_checkpoint_cid": checkpoint_cid(base)}
    path = export_folder(base, policy.to_state_dict(), out, dtype=dtype, provenance=provenance)
    return path, held, policy.content_hash


SWARM_POLICY_DIR = Path("exported") / "policy"
"""Where ``--run`` keeps the version it fetched (``held_versions`` finds it there afterwards)."""


async def _fetch_announced(cfg: Any, d: Path, timeout: float) -> tuple[Any, Any]:
    """(the newest announcement heard from the run's trainer, that version's policy) through a lookup
    swarm: the announcement on the run's policy topic (the trainer repeats it every few seconds), then
    the version as a follower obtains it (the announced delta chain from the full checkpoint, or from
    version 0 built from the run's model folder), its bytes checked against the announced hash."""
    import asyncio
    from functools import partial

    from intellect_node.errors import TransportError
    from intellect_node.protocol.policy import POLICY_KIND, PolicyAnnouncement, announcement_validator
    from intellect_node.protocol.topics import topic
    from intellect_node.roles.common.fetch import HintedFetcher
    from intellect_node.roles.common.models import MAX_POLICY_BYTES
    from intellect_node.roles.common.policy import PolicyFollower
    from intellect_node.roles.runs import client_swarm, lookup_listen
    from intellect_node.trainer.model import initial_policy

    run_id, trainer = cfg.run.run_id, cfg.run.trainer_peer_id
    async with client_swarm(list(cfg.network.bootstrap), listen=lookup_listen(cfg.network.listen),
                            data_dir=d) as (swarm, blobs):
        heard: asyncio.Future[PolicyAnnouncement] = asyncio.get_running_loop().create_future()

        def on_announcement(ann: PolicyAnnouncement, origin: str) -> None:
            if not heard.done():
                heard.set_result(ann)

        swarm.subscribe(topic(run_id, POLICY_KIND), announcement_validator(run_id, trainer), on_announcement)
        try:
            async with asyncio.timeout(timeout):
                ann = await heard
        except TimeoutError:
            raise TransportError(f"no policy announcement from the run's trainer {trainer} in "
                                 f"{timeout:.0f} s; is it up, and reachable from the bootstrap peers?"
                                 ) from None
        follower = PolicyFollower(d / SWARM_POLICY_DIR, HintedFetcher(blobs, swarm).holding([trainer]),
                                  run_id=run_id, trainer=trainer, max_checkpoint_bytes=MAX_POLICY_BYTES,
                                  base=partial(initial_policy, Path(cfg.run.model)))
        res = await follower.obtain(ann)
    return ann, res.checkpoint


def export_from_swarm(run_ref: str, organiser: Optional[str], bootstrap: list[str], d: Path, version: str,
                      out: Path, *, dtype: Optional[str], timeout: float) -> tuple[Path, int, str]:
    """``--run``: the run fetched and checked as ``join --run`` does (``commands/runs.config_for_run``),
    its newest announced policy fetched by hash, written as a Hugging Face folder ``out``; (the folder,
    the version, its hash). Only the version the trainer announces can be had from the swarm."""
    import asyncio

    from intellect_node.commands.runs import config_for_run
    from intellect_node.inference.rollouts import checkpoint_cid
    from intellect_node.models.export import export_folder

    if version != "latest" and not version.isdigit():
        raise ConfigError(f"--version {version!r} is neither a version number nor 'latest'", field="version")
    flags = {"network": {"bootstrap": bootstrap}} if bootstrap else {}
    cfg = config_for_run(run_ref, organiser, d, flags=flags, config_file=None,
                         flag_names={"network.bootstrap": "--bootstrap"})
    ann, policy = asyncio.run(_fetch_announced(cfg, d, timeout))
    if version != "latest" and int(version) != ann.version:
        raise ConfigError(f"--version {version}: the run's trainer announces v{ann.version}, the only "
                          "version the swarm hands out; give --data-dir of a node that holds the one you "
                          "want",
                          field="version")
    base = Path(cfg.run.model)
    provenance = {"version": ann.version, "policy_hash": ann.checkpoint_hash, "run_id": cfg.run.run_id,
                  "trainer": cfg.run.trainer_peer_id, "from": "swarm", "base_model": str(base),
                  "base_checkpoint_cid": checkpoint_cid(base)}
    path = export_folder(base, policy.to_state_dict(), out, dtype=dtype, provenance=provenance)
    return path, ann.version, ann.checkpoint_hash


def add_to(group: typer.Typer) -> None:
    """``export`` in the ``model`` group."""

    @group.command("export")
    def export(
        dir: Optional[Path] = typer.Argument(None, help="Folder to write to (the same as --out)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Folder to write the model to (new or empty; "
                                                             "Hugging Face format)."),
        data_dir: Optional[Path] = typer.Option(None, "--data-dir", "-d",
                                                help="A run node's data dir (trainer, worker or validator): "
                                                     "export a policy version it holds."),
        version: str = typer.Option("latest", "--version", help="Policy version to export: N or latest."),
        model: Optional[Path] = typer.Option(None, "--model",
                                             help="The model folder (config, tokenizer); default: the "
                                                  "embedded model, or with --data-dir the run's."),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="Weights dtype: float32, bfloat16 or "
                                                                  "float16 (default: the model folder's)."),
        gguf: Optional[Path] = typer.Option(None, "--gguf", help="Also write a GGUF file (llama.cpp, "
                                                                 "ollama) of the exported folder."),
        gguf_type: str = typer.Option("f16", "--gguf-type", help="GGUF tensor type: f16, q8_0 or f32."),
        run: Optional[str] = typer.Option(None, "--run", help="A run's CID (or ID): fetch its newest "
                                                             "policy by hash from the swarm, as join --run "
                                                             "fetches the run (files kept in --data-dir)."),
        organiser: Optional[str] = typer.Option(None, "--organiser", help="With --run: the peer ID that "
                                                                         "must have signed the run."),
        bootstrap: list[str] = typer.Option([], "--bootstrap", help="With --run: a peer to ask "
                                                                    "(multiaddr; repeatable)."),
        timeout: float = typer.Option(120.0, "--timeout", help="With --run: seconds to wait for the "
                                                               "trainer's policy announcement."),
    ) -> None:
        """Write a model folder (config, safetensors, tokenizer, chat template, generation config) that
        transformers and vLLM load offline: with --data-dir, a policy version the run trained; without,
        the model folder itself (the embedded model by default). --gguf FILE also writes a GGUF."""
        from intellect_node.models.gguf_export import GGUF_TYPES

        if dir is not None and out is not None and dir != out:
            raise ConfigError("give the folder once: DIR or --out", field="out")
        dst = out if out is not None else dir
        if dst is None:
            raise ConfigError("--out DIR: where to write the model folder", field="out")
        if gguf is not None and gguf_type not in GGUF_TYPES:
            raise ConfigError(f"--gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}",
                              field="gguf_type")
        if run is not None:
            from intellect_node.commands.common import data_dir as resolve
            from intellect_node.commands.runs import fail
            from intellect_node.errors import IntellectNodeError
            from intellect_node.p2p.identity import ensure_data_dir

            if model is not None:
                raise ConfigError("--model comes from the run's manifest with --run; drop it", field="model")
            d = resolve(data_dir)
            ensure_data_dir(d)
            try:
                path, got, digest = export_from_swarm(run, organiser, bootstrap, d, version, dst, dtype=dtype,
                                                      timeout=timeout)
            except ConfigError:
                raise
            except IntellectNodeError as exc:  # the run or its policy could not be had: exit 1, why
                fail(exc)
                raise
            typer.echo(f"exported policy v{got} (from the swarm, {digest}) to {path}")
        elif data_dir is not None:
            path, held, digest = export_policy(data_dir.expanduser(), version, dst, model=model, dtype=dtype)
            typer.echo(f"exported policy v{held.version} ({held.where}, {digest}) to {path}")
        elif version != "latest":
            raise ConfigError("--version picks a policy of a run: give --data-dir too", field="version")
        elif dtype is not None:
            from intellect_node.models.export import export_folder
            from intellect_node.models.loader import read_weights, resolve_model_dir

            base = resolve_model_dir(model)
            path = export_folder(base, read_weights(base), dst, dtype=dtype,
                                 provenance={"base_model": str(base)})
            typer.echo(f"wrote {base} in {dtype} to {path}")
        else:
            from intellect_node.models.loader import export_model, resolve_model_dir

            path = export_model(dst, resolve_model_dir(model) if model is not None else None)
            typer.echo(f"wrote the {'model' if model is not None else 'embedded model'} to {path}")
        if gguf is not None:
            from intellect_node.models.gguf_export import export_gguf

            file = export_gguf(path, gguf, gguf_type)
            typer.echo(f"wrote {file} ({gguf_type}, {file.stat().st_size:,} bytes)")
