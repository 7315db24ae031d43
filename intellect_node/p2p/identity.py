"""Node identity and data directory.

The node key is an ed25519 seed of 32 bytes kept in ``<data-dir>/node.key`` (mode 0600). The same seed
is the libp2p host identity and signs every protocol message the node sends.

The data dir holds that key, the control API's token, the ledger and the logs, so it is private to its
owner: created 0700, and tightened to 0700 (with a log line) when an older version or the operator left
it readable by others (:func:`ensure_data_dir`). Files inside that say who the operator worked with
(ledger, logs) are created 0600 as well (:func:`ensure_private_file`), so they stay private when copied
out of the dir.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import platformdirs

from intellect_node.errors import ConfigError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.protocol.signing import SigningKey

log = logging.getLogger(__name__)

KEY_FILE = "node.key"
ENV_DATA_DIR = "INTELLECT_NODE_DATA_DIR"
_KEY_MAGIC = b"intellect-node ed25519 v1\n"
DATA_DIR_MODE = 0o700


def default_data_dir() -> Path:
    """``--data-dir`` beats ``INTELLECT_NODE_DATA_DIR`` beats the platform's user data directory."""
    env = os.environ.get(ENV_DATA_DIR)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("intellect-node", appauthor=False))


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    path = Path(data_dir).expanduser() if data_dir else default_data_dir()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--data-dir {path} exists and is not a directory; pick another path",
                          field="data_dir")
    return path


def ensure_data_dir(path: Path) -> Path:
    """Create ``path`` 0700, or tighten an existing one that others can read or enter.

    Parents made on the way keep the default mode (they are the operator's, e.g. ``~/.local/share``).
    A dir this user cannot chmod (someone else's) or create (under ``/proc``, a read-only mount, no
    permission) is a ConfigError naming ``--data-dir``: the operator's mistake, told as a message.
    """
    try:
        path.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--data-dir {path} cannot be created ({exc.strerror or exc}); pick a directory "
                          "this user can write, or set INTELLECT_NODE_DATA_DIR", field="data_dir") from exc
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        try:
            os.chmod(path, DATA_DIR_MODE)
        except OSError as exc:
            raise ConfigError(f"--data-dir {path} is readable by others (mode {mode:o}) and cannot be made "
                              f"private ({exc.strerror}); chown it to this user or pick another --data-dir",
                              field="data_dir") from exc
        log.info("data dir %s was mode %o; tightened to %o (it holds the node key and ledger)", path, mode,
                 DATA_DIR_MODE)
    return path


def key_path(data_dir: Path) -> Path:
    return data_dir / KEY_FILE


def init_key(data_dir: Path, *, force: bool = False) -> SigningKey:
    return store_key(data_dir, SigningKey.generate(), force=force)


def store_key(data_dir: Path, key: SigningKey, *, force: bool = False) -> SigningKey:
    """Write ``key`` as the node key (0600, atomically); ``keys init`` and ``keys import`` use it."""
    path = key_path(data_dir)
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists; pass --force to replace it (the node's peer ID changes)",
                          field="force")
    ensure_data_dir(data_dir)
    atomic_write_bytes(path, _KEY_MAGIC + key.seed.hex().encode() + b"\n", mode=0o600)
    return key


def load_key(data_dir: Path) -> SigningKey:
    path = key_path(data_dir)
    if not path.exists():
        raise ConfigError(f"no node key at {path}; run `intellect-node keys init --data-dir {data_dir}`",
                          field="data_dir")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"{path} is readable by others (mode {mode:o}); run `chmod 600 {path}`",
                          field="data_dir")
    raw = path.read_bytes()
    try:
        if not raw.startswith(_KEY_MAGIC):
            raise ValueError("missing header")
        seed = bytes.fromhex(raw[len(_KEY_MAGIC):].strip().decode("ascii"))
        return SigningKey(seed)
    except ValueError as exc:
        raise ConfigError(f"{path} is not an intellect-node key ({exc}); restore it or re-run keys init "
                          "--force", field="data_dir") from exc


def load_or_init_key(data_dir: Path) -> SigningKey:
    return load_key(data_dir) if key_path(data_dir).exists() else init_key(data_dir)
