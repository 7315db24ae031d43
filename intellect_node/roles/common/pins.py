"""Which blobs a node keeps: the policy chain its trainer announces and the runs it serves (pinned: what
``blob gc`` and the node's own collection never remove), and every blob younger than :data:`GC_MIN_AGE_S`.

The runs a node serves are the signed manifests in ``<data-dir>/runs/`` (``roles/runs.py``): each
manifest's blob and its model files' blobs, which participants fetch by their CIDs (``join --run``).

The trainer publishes from ``<data-dir>/trainer/policy`` (``roles/trainer/role.py``), where
``publisher.json`` names the latest full checkpoint and the deltas after it; peers fetch those from the
trainer first. It also keeps the newest checkpoint states its step records name (weights and optimizer
blobs, ``trainer/records/states.json``, ``roles/trainer/records.py``): auditors start windows there. Light
on purpose (JSON only): the CLI reads it without importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from intellect_node.errors import ConfigError, ProtocolError
from intellect_node.protocol.run_manifest import MAX_RUN_ENVELOPE_BYTES, RunManifest, open_run_manifest

GC_MIN_AGE_S = 3600.0
"""Blobs younger than this stay (their manifest's arrival time): a worker's rollout batch is fetched by
validators and the trainer within minutes, and a policy version a worker fetched is served to the
workers after it for a while; an hour is many policy versions and batches."""
PUBLISHER_STATE = "publisher.json"
"""The publisher's state file in its directory (``roles/common/policy.PolicyPublisher``)."""
TRAINER_POLICY_DIR = Path("trainer") / "policy"
"""Where the trainer of a data dir publishes from, relative to the data dir."""
PINNED_STATES = 4
"""Checkpoint states the trainer keeps pinned (``roles/trainer/records.py``): an auditor fetches a
window's start when it hears the record, so the newest few are enough (older ones still stay
:data:`GC_MIN_AGE_S`, like every blob). The audit coverage rule counts a start auditors could not fetch
against the trainer only while it is one of these or younger than half that (``roles/common/audits.py``)."""
TRAINER_STATES = Path("trainer") / "records" / "states.json"
"""The checkpoint states the trainer of a data dir publishes (``roles/trainer/records.STATES_FILE``)."""


RUNS_DIR = "runs"
"""``<data-dir>/runs/``: ``<cid>.run`` (a run's signed manifest) and ``<cid>/`` (its model and thresholds)."""


def held_runs(data_dir: Path) -> dict[str, RunManifest]:
    """The runs in ``<data-dir>/runs/`` whose manifest opens, by the CID of their blob (a damaged file is
    left out: the runs service refuses to list it)."""
    out: dict[str, RunManifest] = {}
    folder = Path(data_dir) / RUNS_DIR
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.run")):
        try:
            out[path.stem] = open_run_manifest(path.read_bytes()[:MAX_RUN_ENVELOPE_BYTES + 1])
        except (OSError, ProtocolError):
            continue
    return out


def published_pins(data_dir: Path) -> dict[str, str]:
    """Blob CID -> why it is pinned: the policy chain the trainer on ``data_dir`` announces, the newest
    checkpoint states it published and the runs it serves. ConfigError when one of the trainer's state
    files is there but unreadable (then nothing may be removed: which blobs the trainer needs is
    unknown)."""
    path = Path(data_dir) / TRAINER_POLICY_DIR / PUBLISHER_STATE
    out: dict[str, str] = {}
    for cid, run in held_runs(data_dir).items():
        out[cid] = f"run {run.run_id}: its manifest"
        for f in run.model_files:
            out.setdefault(f.blob, f"run {run.run_id}: model file {f.path}")
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
    path = Path(data_dir) / TRAINER_STATES
    try:
        for st in json.loads(path.read_text()):
            version = int(st["version"])
            out[str(st["weights_cid"])] = f"trainer: checkpoint v{version} weights (audit window start)"
            out[str(st["optimizer_cid"])] = f"trainer: checkpoint v{version} optimizer state"
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}): cannot tell which blobs the trainer needs, so "
                          "none is removed", field="data_dir") from exc
    return out
