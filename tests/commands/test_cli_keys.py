from __future__ import annotations

import stat
from pathlib import Path

from tests.support.cli import invoke_cli


def test_keys_init_show_force(data_dir: Path) -> None:
    r = invoke_cli("keys", "init", "--data-dir", str(data_dir))
    assert r.returncode == 0, r.stderr
    pid = r.stdout.strip().splitlines()[-1]
    assert pid.startswith("12D3KooW")
    assert stat.S_IMODE((data_dir / "node.key").stat().st_mode) == 0o600
    assert invoke_cli("keys", "show", "--data-dir", str(data_dir)).stdout.strip() == pid
    again = invoke_cli("keys", "init", "--data-dir", str(data_dir))
    assert again.returncode == 2 and "--force" in again.stderr
    forced = invoke_cli("keys", "init", "--data-dir", str(data_dir), "--force")
    assert forced.returncode == 0 and forced.stdout.strip().splitlines()[-1] != pid


def test_env_data_dir_and_missing_key(tmp_path: Path) -> None:
    d = tmp_path / "envdir"
    r = invoke_cli("keys", "show", env={"INTELLECT_NODE_DATA_DIR": str(d)})
    assert r.returncode == 2 and "keys init" in r.stderr
    assert invoke_cli("keys", "init", env={"INTELLECT_NODE_DATA_DIR": str(d)}).returncode == 0
    assert (d / "node.key").exists()
