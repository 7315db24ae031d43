"""Which blobs a node keeps: the policy chain its trainer announces (pinned: what ``blob gc`` and the
node's own collection never remove), and every blob younger than :data:`GC_MIN_AGE_S`.

The trainer publishes from ``<data-dir>/trainer/policy`` (``roles/trainer/role.py``), where
``publisher.json`` names the latest full checkpoint and the deltas after it; peers fetch those from the
trainer first. Light on purpose (JSON only): the CLI reads it without importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from intellect_node.errors import ConfigError

GC_MIN_AGE_S = 3600.0
"""Blobs younger than this stay (their manifest's arrival time): a worker's rollout batch is fetched by
validators and the trainer within minutes, and a policy version a worker fetched is served to the
workers after it for a while; an hour is many policy versions and batches."""
PUBLISHER_STATE = "publisher.json"
"""The publisher's state file in its directory (``roles/common/policy.PolicyPublisher``)."""
TRAINER_POLICY_DIR = Path("trainer") / "policy"
"""Where the trainer of a data dir publishes from, relative to the data dir."""


def published_pins(data_dir: Path) -> dict[str, str]:
    """Blob CID -> why it is pinned: the policy chain the trainer on ``data_dir`` announces. ConfigError
    when the state file is there but unreadable (then nothing may be removed: which blobs the trainer
    needs is unknown)."""
    path = Path(data_dir) / TRAINER_POLICY_DIR / PUBLISHER_STATE
    out: dict[str, str] = {}
    try:
        st = json.loads(path.read_text())
        full_version, full_cid = int(st["full"][0]), str(st["full"][1])
        out[full_cid] = f"trainer: policy v{full_version} (full)"
        for link in st.get("links") or []:
            out[str(link["delta_cid"])] = f"trainer: policy v{int(link['version'])} (delta)"
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}): cannot tell which blobs the trainer needs, so "
                          "none is removed", field="data_dir") from exc
    return out
