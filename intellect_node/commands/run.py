"""``intellect-node run init`` and ``run publish``: an organiser makes a run and serves it (``run report``,
what a run did, is ``commands/report.py``).

``run init --model M --env E --out DIR`` does what docs/real-runs.md used to list as steps:

1. the keys: the trainer's (``DIR/trainer``) and the validators' (``DIR/validator``...), unless their peer
   IDs are given; the organiser, who signs the run, is the trainer's data dir when it was made here (its
   node then serves the run), else ``--data-dir``;
2. the settings that fit the model and environment (``inference/run_settings.py``, as ``config fit``),
   what ``--config``'s ``[run]``/``[rl]`` and the flags give kept as given;
3. the preflight: the starting model samples the run's problems as the run samples them; when no group
   has unequal rewards nothing is learnable and it refuses (``--allow-unlearnable`` warns instead);
4. the proof thresholds, calibrated on the run's own prompts with the run's settings (or ``--thresholds
   FILE`` calibrated elsewhere, for engine pairs this machine cannot run), pinned by their sha256;
5. the run manifest (``protocol/run_manifest.py``): the shared settings, the thresholds, every model file
   as a blob of the organiser's store, the bootstrap addresses; signed by the organiser and stored as a
   blob whose CID is the run. It prints what it chose and why, and the CID last.

``run publish [--data-dir ORGANISER]`` runs a node (no role) that serves and announces the runs in that
data dir; so does any ``join --run CID`` on it, such as the trainer's.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from intellect_node.commands.common import (
    BootstrapOption,
    DataDirOption,
    ListenOption,
    LogFileOption,
    LogLevelOption,
    NodeConfigOption,
    data_dir,
    data_dir_lock,
    parse_env_args,
)
from intellect_node.errors import ConfigError

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig
    from intellect_node.envs.tasks import Problem
    from intellect_node.protocol.signing import SigningKey

Echo = Callable[[str], object]
"""Where a command's progress lines go (``typer.echo``)."""

MAX_MODEL_FILE_COUNT = 64


def _default_run_id(model: Path, env: str | None) -> str:
    name = f"{model.name}-{(env or 'run').split(':')[-1]}".lower()
    return (re.sub(r"[^a-z0-9._-]+", "-", name).strip("-._") or "run")[:64]


def model_files(folder: Path) -> list[Path]:
    """The files of a model folder a run carries: every regular file at its top level but hidden ones
    and a thresholds file (the run carries its own)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                   and p.name != "proof_thresholds.json")
    if len(files) > MAX_MODEL_FILE_COUNT:
        raise ConfigError(f"--model {folder} holds {len(files)} files; a run carries at most "
                          f"{MAX_MODEL_FILE_COUNT} (merge the weight shards)", field="--model")
    return files


def validator_dirs(n: int) -> list[str]:
    """The data dirs ``run init`` makes validator keys in, under ``--out``."""
    return ["validator" if i == 0 else f"validator-{i + 1}" for i in range(n)]


def _keys(out: Path, trainer: str | None, validators: list[str], n_validators: int,
          echo: Echo) -> tuple[str, list[str], Path | None]:
    """The trainer's and validators' peer IDs, creating keys under ``out`` for those not given; and the
    trainer's data dir when it is here."""
    from intellect_node.errors import ProtocolError
    from intellect_node.p2p import identity
    from intellect_node.protocol.ids import public_key_from_peer_id

    for flag, peer in [("--trainer-peer-id", trainer), *(("--validator-peer-id", v) for v in validators)]:
        try:
            if peer is not None:
                public_key_from_peer_id(peer)
        except ProtocolError as exc:
            raise ConfigError(f"{flag} {peer!r} is not a peer ID (12D3KooW..., what `intellect-node keys "
                              "init` prints)", field=flag) from exc

    def make(d: Path) -> str:
        made = not identity.key_path(d).exists()
        key = identity.load_or_init_key(d)
        echo(f"  {'created' if made else 'kept'} the key of {d.name}: {key.peer_id} ({d})")
        return key.peer_id

    trainer_dir: Path | None = None
    if trainer is None:
        trainer_dir = out / "trainer"
        trainer = make(trainer_dir)
    else:
        echo(f"  trainer: {trainer} (given)")
    if not validators:
        if n_validators < 1:
            raise ConfigError("--validators must be at least 1 (or give --validator-peer-id)",
                              field="--validators")
        validators = [make(out / name) for name in validator_dirs(n_validators)]
    else:
        echo(f"  validators: {', '.join(validators)} (given)")
    return trainer, validators, trainer_dir


def _bootstrap(addrs: list[str], organiser: str) -> list[str]:
    """The organiser's addresses as multiaddrs ending ``/p2p/<organiser>`` (appended when missing);
    ConfigError naming the flag for one that is not a multiaddr."""
    from intellect_node.config.loader import build_config

    for a in addrs:
        if "/tcp/" not in a:
            raise ConfigError(f"--bootstrap {a!r} is not a TCP multiaddr participants can dial; e.g. "
                              "--bootstrap /ip4/203.0.113.7/tcp/4101", field="--bootstrap")
    full = [a if "/p2p/" in a else f"{a.rstrip('/')}/p2p/{organiser}" for a in addrs]
    try:
        return build_config({"network": {"bootstrap": full}}).network.bootstrap
    except ConfigError as exc:
        raise ConfigError(f"--bootstrap: {exc}; e.g. --bootstrap /ip4/203.0.113.7/tcp/4101",
                          field="--bootstrap") from exc


def register(app: typer.Typer) -> None:
    run = typer.Typer(help="Make a run (init), serve it (publish), report what it did (report).",
                      no_args_is_help=True)

    @run.command("init")
    def init(
        model: str = typer.Option(..., "--model", help="The starting model: a model folder or a .gguf file."),
        env: Optional[str] = typer.Option(None, "--env", help="Reward environment, e.g. "
                                                              "reasoning_gym:basic_arithmetic."),
        env_args: Optional[str] = typer.Option(None, "--env-args", help="rl.env_args: JSON, or key=value "
                                                                        "pairs separated by commas."),
        out: Optional[Path] = typer.Option(None, "--out", help="Directory for the keys made, run.toml and "
                                                               "the manifest (default: ./<run id>)."),
        run_id: Optional[str] = typer.Option(None, "--run-id", help="The run's name (default: model and "
                                                                    "dataset)."),
        trainer_peer_id: Optional[str] = typer.Option(None, "--trainer-peer-id",
                                                      help="The trainer's peer ID, when its key is "
                                                           "elsewhere (default: a key made in OUT/trainer)."),
        validator_peer_id: list[str] = typer.Option([], "--validator-peer-id",
                                                    help="A validator's peer ID (repeatable; default: "
                                                         "keys made in OUT/validator...)."),
        validators: int = typer.Option(1, "--validators", help="Validator keys to make when no "
                                                               "--validator-peer-id is given."),
        bootstrap: list[str] = typer.Option([], "--bootstrap", help="An address of the organiser's node "
                                            "participants dial (repeatable), e.g. /ip4/203.0.113.7/tcp/4101; "
                                            "/p2p/<organiser> is appended."),
        config_file: Optional[Path] = typer.Option(None, "--config", "-c", help="A config whose [run] and "
                                                   "[rl] values are kept as given."),
        thresholds: Optional[Path] = typer.Option(None, "--thresholds", help="A thresholds file calibrated "
                                                  "elsewhere (e.g. with vllm@cuda) instead of calibrating "
                                                  "torch@cpu here."),
        n: int = typer.Option(64, "--calibrate-n", help="Honest rollouts per batch size to calibrate on."),
        batch_sizes: str = typer.Option("1,32", "--batch-sizes", help="Calibration batch sizes."),
        preflight_problems: int = typer.Option(8, "--preflight-problems",
                                               help="Problems the preflight samples (groups of "
                                                    "rl.group_size)."),
        allow_unlearnable: bool = typer.Option(False, "--allow-unlearnable",
                                               help="Make the run even when the preflight finds nothing "
                                                    "learnable (a warning instead of a refusal)."),
        data_dir_opt: Optional[Path] = DataDirOption,
    ) -> None:
        """Make a run in one command: keys, settings, preflight, thresholds, the signed manifest; prints
        what it chose and why, and the run's CID last."""
        started = time.monotonic()
        from intellect_node.config.loader import build_config, read_toml, toml_table
        from intellect_node.inference.run_settings import fit_settings, model_facts, size_text
        from intellect_node.models.loader import resolve_model_dir

        try:
            sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1 or n < 1:
            raise ConfigError("--batch-sizes must be positive integers (e.g. 1,32) and --calibrate-n at "
                              "least 1", field="--batch-sizes")
        if thresholds is not None and not thresholds.is_file():
            raise ConfigError(f"--thresholds {thresholds}: no such file; pass a file written by "
                              "`intellect-node proofs calibrate`", field="--thresholds")
        folder = resolve_model_dir(model)
        doc = read_toml(config_file) if config_file is not None else {}
        # The operator's TOML, checked field by field when the run's config is built from it below.
        given_rl: dict[str, Any] = toml_table(doc, "rl")
        given_run: dict[str, Any] = {k: v for k, v in toml_table(doc, "run").items()
                                     if k not in ("model", "proof_thresholds", "proof_thresholds_sha256")}
        if env:
            given_rl["env"] = env
        if env_args:
            given_rl["env_args"] = parse_env_args(env_args)
        rid = run_id or given_run.get("run_id") or _default_run_id(folder, given_rl.get("env"))
        out_dir = (out or Path(str(rid))).expanduser()
        echo = typer.echo
        facts = model_facts(folder)
        files = model_files(folder)
        echo(f"run {rid}: {folder} ({size_text(facts.n_params)} parameters, "
             f"{'a chat template' if facts.chat_template else 'no chat template'}, {len(files)} files, "
             f"{sum(f.stat().st_size for f in files)} bytes)")
        echo("keys:")
        given_vals = list(validator_peer_id) or list(given_run.get("validator_peer_ids", []))
        trainer, vals, trainer_dir = _keys(out_dir, trainer_peer_id or given_run.get("trainer_peer_id"),
                                           given_vals, validators, echo)
        organiser_dir = data_dir(data_dir_opt) if data_dir_opt is not None else \
            (trainer_dir or out_dir / "organiser")
        from intellect_node.p2p import identity

        organiser = identity.load_or_init_key(organiser_dir)
        echo(f"  organiser (signs the run, its node serves it): {organiser.peer_id} ({organiser_dir})")
        boot = _bootstrap(list(bootstrap), organiser.peer_id)  # before minutes of work, not after

        choices = fit_settings(facts, given_rl)
        rl = {c.key: c.value for c in choices}
        run_section = {**given_run, "run_id": rid, "trainer_peer_id": trainer, "validator_peer_ids": vals,
                       "model": str(folder)}
        cfg = build_config({"run": run_section, "rl": rl})
        from intellect_node.config.run_manifest import run_sections

        shared = run_sections(cfg)  # refuses what a manifest cannot carry, before minutes of work
        echo("settings:")
        for c in choices:
            echo(c.line())
        if not choices:
            echo("  the defaults (the embedded model's settings)")

        _preflight(folder, cfg, preflight_problems, allow_unlearnable, echo)
        out_dir.mkdir(parents=True, exist_ok=True)
        tpath, text = _thresholds(out_dir, thresholds, folder, cfg, n, sizes, echo)
        cid = seal_run(organiser, organiser_dir, rid, folder, files, shared, text, boot, echo)
        from intellect_node.node.processes import write_config

        write_config(out_dir / "run.toml", {"run": {**shared["run"], "model": str(folder),
                                                    "proof_thresholds": str(tpath)}, "rl": shared["rl"]})
        (out_dir / "run.cid").write_text(cid + "\n")
        echo(f"wrote {out_dir / 'run.toml'} (the same settings as a config file) and {out_dir / 'run.cid'}")
        if not bootstrap:
            echo("note: no --bootstrap address in the run: participants give --bootstrap to join")
        _next_steps(cid, organiser_dir, trainer_dir, [] if given_vals else vals, out_dir, boot,
                    organiser.peer_id, echo)
        echo(f"made in {time.monotonic() - started:.0f} s; the run's CID:")
        echo(cid)

    @run.command("publish")
    def publish(
        data_dir_opt: Optional[Path] = DataDirOption,
        listen: list[str] = ListenOption,
        announce: list[str] = typer.Option([], "--announce", help="Multiaddr to advertise (repeatable)."),
        bootstrap: list[str] = BootstrapOption,
        http_host: Optional[str] = typer.Option(None, "--http-host", help="Bind address of the bulk HTTP "
                                                                          "server."),
        config_file: Optional[Path] = NodeConfigOption,
        log_file: Optional[Path] = LogFileOption,
        log_level: str = LogLevelOption,
    ) -> None:
        """Serve and announce the runs in --data-dir (made by `run init`) until Ctrl-C or SIGTERM: a node
        without a role that holds the manifests and the model files, lists the runs in the DHT and on the
        runs topic. `join --run CID` on the same data dir does the same while it trains."""
        from intellect_node.commands.join import run_node_for

        d = data_dir(data_dir_opt)
        from intellect_node.roles.runs import held_runs

        held = held_runs(d)
        if not held:
            raise ConfigError(f"--data-dir {d} holds no run (no {d}/runs/*.run); make one with "
                              "`intellect-node run init`, or pass the organiser's data dir",
                              field="--data-dir")
        newest = max(held, key=lambda c: held[c].created_ms)
        network = {k: v for k, v in {"listen": listen or None, "announce": announce or None,
                                     "bootstrap": bootstrap or None, "http_host": http_host}.items()
                   if v is not None}
        raise typer.Exit(run_node_for(d, run=newest, organiser=None, roles=[],
                                      flags={"network": network} if network else {},
                                      config_file=config_file, log_file=log_file, log_level=log_level,
                                      headless=True))

    from intellect_node.commands.report import add_to

    add_to(run)  # `run report`: what a run did, one HTML page (commands/report.py)
    app.add_typer(run, name="run")


def _next_steps(cid: str, organiser_dir: Path, trainer_dir: Path | None, made_validators: list[str],
                out_dir: Path, boot: list[str], organiser: str, echo: Echo) -> None:
    """The commands that start the run: the organiser's node serving it, the trainer and the validators
    whose keys were made here (each in its data dir), and what a participant runs. Every node but the
    organiser's needs an address to fetch the run from: the run's first bootstrap address."""
    at = f" --bootstrap {boot[0]}" if boot else " --bootstrap <the organiser's address>"
    run = f"intellect-node join --run {cid}"
    echo("next:")
    if trainer_dir != organiser_dir:
        echo(f"  intellect-node run publish --data-dir {organiser_dir}   (serves the run)")
    if trainer_dir is None:
        echo(f"  the trainer, on its machine: {run} --role trainer{at}")
    elif trainer_dir == organiser_dir:
        echo(f"  {run} --role trainer --data-dir {trainer_dir}   (serves the run)")
    else:
        echo(f"  {run} --role trainer --data-dir {trainer_dir}{at}")
    for name in validator_dirs(len(made_validators)):
        echo(f"  {run} --role validator --data-dir {out_dir / name}{at}")
    echo(f"  participants: {run} --role worker{at} --organiser {organiser}")


def _thresholds(out_dir: Path, given: Path | None, folder: Path, cfg: NodeConfig, n: int, sizes: list[int],
                echo: Echo) -> tuple[Path, str]:
    """The run's thresholds file in ``out_dir`` and its text: ``given`` (``--thresholds``), else
    calibrated for torch@cpu on ``n`` of the run's prompts with the run's sampling settings."""
    from intellect_node.fsutil import atomic_write_text
    from intellect_node.proofs.thresholds import file_sha256

    path = out_dir / "proof_thresholds.json"
    if given is not None:
        text = given.read_text()
        echo(f"thresholds: {given} (given)")
    else:
        from intellect_node.commands.proofs import calibrate_into

        path.unlink(missing_ok=True)  # a fresh file: the run's pairs only
        echo(f"thresholds: calibrating torch@cpu on {n} of the run's prompts (max_new_tokens "
             f"{cfg.rl.max_new_tokens}, temperature {cfg.rl.temperature}, batch sizes "
             f"{','.join(map(str, sizes))})")
        calibrate_into(path, folder, _problems(cfg, n, seed=0), dtype=cfg.run.dtype, n=n, batch_sizes=sizes,
                       max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature,
                       echo=lambda line: echo(f"  {line}"))
        text = path.read_text()
    atomic_write_text(path, text)
    echo(f"  {path}: sha256 {file_sha256(path)} (the run pins the thresholds by it)")
    return path, text


def _problems(cfg: NodeConfig, n: int, *, seed: int = 7) -> list[Problem]:
    """``n`` of the run's problems (the run's task, extraction and system prompt)."""
    from intellect_node.roles.common.tasks import run_task

    return list(run_task(cfg).sample(random.Random(seed), n))


def _preflight(folder: Path, cfg: NodeConfig, n_problems: int, allow: bool, echo: Echo) -> None:
    """The solve-rate preflight on ``n_problems`` of the run's problems; ConfigError (exit 2) naming
    the settings to change when nothing is learnable, unless ``allow``."""
    import torch

    from intellect_node.inference import make_engine
    from intellect_node.inference.run_settings import preflight

    torch.set_num_threads(1)
    problems = _problems(cfg, max(n_problems, 1))
    pre = preflight(make_engine(folder, "torch"), problems, group_size=cfg.rl.group_size,
                    max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature)
    echo(f"preflight of the starting model on {len(problems)} of the run's problems, "
         f"{cfg.rl.group_size} samples each:")
    for line in pre.summary().splitlines():
        echo(f"  {line}")
    if not pre.ok():
        if not allow:
            raise ConfigError("nothing is learnable with these settings (the preflight above says why); "
                              "change --env/--env-args or the [rl] settings of --config, or pass "
                              "--allow-unlearnable to make the run anyway", field="--env-args")
        echo("  WARNING: making the run anyway (--allow-unlearnable)")


def seal_run(organiser: SigningKey, organiser_dir: Path, rid: str, folder: Path, files: list[Path],
          shared: Mapping[str, Mapping[str, object]], thresholds: str, bootstrap: list[str],
          echo: Echo) -> str:
    """Store the model files and the signed manifest as blobs of the organiser's store; keep the
    manifest in ``<organiser>/runs/``. Returns the run's CID."""
    from intellect_node.blobs.service import BLOBS_DIR
    from intellect_node.blobs.store import BlobStore
    from intellect_node.protocol.run_manifest import ModelFile, RunManifest, canonical_json, seal_run_manifest
    from intellect_node.roles.runs import keep_run

    with data_dir_lock(organiser_dir):
        store = BlobStore(organiser_dir / BLOBS_DIR)
        try:
            model_files = []
            for f in files:
                blob, m = store.add_file(f, organiser, name=f.name)
                model_files.append(ModelFile(path=f.name, blob=blob, size=m.total_size))
            manifest = RunManifest(format="intellect-node/run/1", run_id=rid, organiser=organiser.peer_id,
                                   created_ms=int(time.time() * 1000),
                                   model_name=folder.name[:128] or "model",
                                   model_files=model_files, config=canonical_json(shared),
                                   thresholds=thresholds, bootstrap=bootstrap)
            raw = seal_run_manifest(organiser, manifest)
            tmp = organiser_dir / "runs" / f".{rid}.manifest.tmp"
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(raw)
            try:
                cid, _m = store.add_file(tmp, organiser, name=f"{rid}.run")
            finally:
                tmp.unlink(missing_ok=True)
            store.flush()
        finally:
            store.close()
        keep_run(organiser_dir, cid, raw)
    echo(f"manifest: {len(model_files)} model files and the run manifest in {organiser_dir / BLOBS_DIR}, "
         f"signed by {organiser.peer_id}")
    return cid
