"""``intellect-node keys``: create and show the node's ed25519 identity, and move it to another machine.

``keys export --out F`` writes the key as a PKCS#8 PEM file (mode 0600; the format ``openssl pkey``
reads), encrypted with a passphrase when one is given (the ``cryptography`` package's best available
PKCS#8 encryption: AES-256-CBC under a scrypt- or PBKDF2-derived key). ``keys import F`` reads such a file
into the data dir's ``node.key``; it refuses to replace an existing key without ``--force`` and refuses
while a node runs with that data dir. Both print the peer ID, so the operator sees that the identity
that arrived is the one that left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.errors import ConfigError
from intellect_node.p2p import identity
from intellect_node.protocol.signing import SigningKey

MAX_EXPORT_BYTES = 16 * 1024
"""An exported key is a few hundred bytes; anything much larger is not one."""


def _passphrase(file: Optional[Path], ask: bool, *, confirm: bool) -> bytes | None:
    """The passphrase from ``--passphrase-file`` (its first line), a prompt (``--passphrase``), or None."""
    if file is not None:
        try:
            text = file.expanduser().read_text().splitlines()[0] if file.stat().st_size else ""
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--passphrase-file {file}: cannot read it ({exc})", field="passphrase_file") \
                from exc
        if not text:
            raise ConfigError(f"--passphrase-file {file} is empty", field="passphrase_file")
        return text.encode()
    if ask:
        answer: str = typer.prompt("passphrase", hide_input=True, confirmation_prompt=confirm)
        return answer.encode()
    return None


def export_pem(key: SigningKey, passphrase: bytes | None) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    enc: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption())
    return Ed25519PrivateKey.from_private_bytes(key.seed).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def import_pem(raw: bytes, passphrase: bytes | None, source: Path) -> SigningKey:
    """The node key in a PEM file; ConfigError that says what is wrong (not a key, wrong passphrase)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    encrypted = b"ENCRYPTED PRIVATE KEY" in raw
    if encrypted and passphrase is None:
        raise ConfigError(f"{source} is encrypted: give --passphrase-file F or --passphrase",
                          field="passphrase")
    try:
        sk = serialization.load_pem_private_key(raw, password=passphrase if encrypted else None)
    except (ValueError, TypeError) as exc:
        why = "wrong passphrase, or a damaged file" if encrypted else "not a PEM private key"
        raise ConfigError(f"{source}: {why} ({exc})", field="file") from exc
    if not isinstance(sk, Ed25519PrivateKey):
        raise ConfigError(f"{source} holds a {type(sk).__name__}, not an ed25519 node key", field="file")
    seed = sk.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    return SigningKey(seed)


def register(app: typer.Typer) -> None:
    keys = typer.Typer(help="The node's identity: one ed25519 key, its libp2p peer ID and message signer.",
                       no_args_is_help=True)

    @keys.command("init")
    def init(
        data_dir_opt: Optional[Path] = DataDirOption,
        force: bool = typer.Option(False, "--force", help="Replace an existing key (the peer ID changes)."),
    ) -> None:
        """Create the node key (mode 0600) and print its peer ID."""
        d = data_dir(data_dir_opt)
        key = identity.init_key(d, force=force)
        typer.echo(f"created {identity.key_path(d)}")
        typer.echo(key.peer_id)

    @keys.command("show")
    def show(data_dir_opt: Optional[Path] = DataDirOption) -> None:
        """Print the node's peer ID (12D3KooW...)."""
        typer.echo(identity.load_key(data_dir(data_dir_opt)).peer_id)

    @keys.command("export")
    def export(
        out: Path = typer.Option(..., "--out", "-o", help="File to write (mode 0600)."),
        data_dir_opt: Optional[Path] = DataDirOption,
        passphrase: bool = typer.Option(False, "--passphrase", help="Encrypt; ask for the passphrase."),
        passphrase_file: Optional[Path] = typer.Option(
            None, "--passphrase-file", help="Encrypt with the first line of this file as passphrase."),
        force: bool = typer.Option(False, "--force", help="Overwrite --out if it exists."),
    ) -> None:
        """Write the node key to --out (PKCS#8 PEM, 0600; encrypted with a passphrase if given) to move the
        node to another machine with `keys import`. Anyone with the file (and passphrase) is this node."""
        from intellect_node.fsutil import atomic_write_bytes

        key = identity.load_key(data_dir(data_dir_opt))
        dst = out.expanduser()
        if dst.exists() and not force:
            raise ConfigError(f"--out {out} exists; pass --force to overwrite it", field="out")
        secret = _passphrase(passphrase_file, passphrase, confirm=True)
        atomic_write_bytes(dst, export_pem(key, secret), mode=0o600)
        typer.echo(f"exported the key of {key.peer_id} to {dst}"
                   + (" (encrypted)" if secret else " (not encrypted: keep the file private)"))
        typer.echo(key.peer_id)

    @keys.command("import")
    def import_(
        file: Path = typer.Argument(..., help="A file written by `keys export`."),
        data_dir_opt: Optional[Path] = DataDirOption,
        passphrase: bool = typer.Option(False, "--passphrase", help="Ask for the passphrase."),
        passphrase_file: Optional[Path] = typer.Option(
            None, "--passphrase-file", help="The passphrase is the first line of this file."),
        force: bool = typer.Option(False, "--force", help="Replace an existing node key (its peer ID is "
                                                          "lost unless exported)."),
    ) -> None:
        """Make the key in FILE this data dir's node key and print its peer ID."""
        from intellect_node.commands.stop import lock_held

        d = data_dir(data_dir_opt)
        try:
            raw = file.expanduser().read_bytes()[:MAX_EXPORT_BYTES + 1]
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read it ({exc.strerror})", field="file") from exc
        if len(raw) > MAX_EXPORT_BYTES:
            raise ConfigError(f"{file} is too large to be an exported key", field="file")
        key = import_pem(raw, _passphrase(passphrase_file, passphrase, confirm=False), file)
        if lock_held(d):
            raise ConfigError(f"a node is running with --data-dir {d}; stop it (`intellect-node stop`) "
                              "before replacing its key", field="data_dir")
        path = identity.key_path(d)
        if path.exists() and not force:
            try:
                current = identity.load_key(d).peer_id
            except ConfigError:
                current = "a damaged or unreadable key"
            same = " (the same key)" if current == key.peer_id else ""
            raise ConfigError(f"{path} already holds the key of {current}{same}; pass --force to replace it "
                              f"with {key.peer_id}", field="force")
        identity.store_key(d, key, force=True)
        typer.echo(f"imported the key of {key.peer_id} into {path}")
        typer.echo(key.peer_id)

    app.add_typer(keys, name="keys")
