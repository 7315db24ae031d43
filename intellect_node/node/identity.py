"""Node identity and data directory.

The node key is an ed25519 seed of 32 bytes kept in ``<data-dir>/node.key`` (mode 0600). The same seed
is the libp2p host identity and signs every protocol message the node sends.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

from intellect_node.errors import ConfigError
from intellect_node.fsutil import atomic_write_bytes
from intellect_node.protocol.signing import SigningKey

KEY_FILE = "node.key"
ENV_DATA_DIR = "INTELLECT_NODE_DATA_DIR"
_KEY_MAGIC = b"intellect-node ed25519 v1\n"


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


def key_path(data_dir: Path) -> Path:
    return data_dir / KEY_FILE


def init_key(data_dir: Path, *, force: bool = False) -> SigningKey:
    path = key_path(data_dir)
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists; pass --force to replace it (the node's peer ID changes)",
                          field="force")
    data_dir.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()
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
        raise ConfigError(f"{path} is not an intellect-node key ({exc}); restore it or re-run keys init --force",
                          field="data_dir") from exc


def load_or_init_key(data_dir: Path) -> SigningKey:
    return load_key(data_dir) if key_path(data_dir).exists() else init_key(data_dir)
