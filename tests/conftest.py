"""pytest hooks and fixtures only. Helpers are modules under ``tests/support/`` (paths and the CLI runner in
``common``, waiting in ``wait``), imported as ``from tests.support.<area> import ...``; this file is never
imported as a module."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")

# No wall-clock deadline on any property test: Hypothesis' default (200 ms an example) is a timing in a
# test, and failed on a loaded machine (`make test-loaded`: one example took 288 ms beside the burners).
settings.register_profile("intellect-node", deadline=None)
settings.load_profile("intellect-node")

# The vLLM tests run under `make test-vllm` in their own environment (.venv-vllm); the main environment
# has no vLLM, so they are not collected there rather than skipped.
# (tests/ is on sys.path, so tests/inference/vllm itself would be found as a namespace package: require a
# real module.)
_vllm_spec = importlib.util.find_spec("vllm")
if _vllm_spec is None or _vllm_spec.origin is None:
    collect_ignore = ["inference/vllm"]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "node"
    d.mkdir()
    return d


# The order files start in. With xdist workers taking a file at a time (`--dist loadfile`), a long
# file that starts last runs alone at the end while the other workers idle: so the files that start whole
# swarms of processes go first, the longest of them (measured, docs/tests.md) at the head, and the many
# short files fill in after. (`make test` passes --no-loadscope-reorder: xdist's own reordering puts the
# files with the most tests first, which is nearly the opposite.)
LONGEST_FIRST = (
    "tests/system/test_run_by_cid.py",
    "tests/system/test_real_model_swarm.py",
    "tests/p2p/test_nat_node.py",
    "tests/system/test_chaos.py",
    "tests/p2p/test_nat_traversal.py",
    "tests/roles/test_sweep_swarm.py",
    "tests/commands/test_demo.py",
    "tests/roles/test_roles_e2e.py",
    "tests/roles/test_audit_nudge.py",
    "tests/system/test_run_by_cid_nat.py",
    "tests/trainer/test_grpo_fsdp.py",
    "tests/p2p/test_libp2p_fuzz.py",
    "tests/p2p/test_inbound_slots.py",
    "tests/trainer/test_policy_memory.py",
    "tests/envs/test_reasoning_gym.py",
    "tests/trainer/test_grpo_checkpoint.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    slow_files = {file_of(i) for i in items if i.get_closest_marker("slow") is not None}
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    order = {file_of(i): n for n, i in reversed(list(enumerate(items)))}  # a file's first position

    def key(item: pytest.Item) -> tuple[int, int, int]:
        f = file_of(item)
        return (first.get(f, len(first)), 0 if f in slow_files else 1, order[f])

    items.sort(key=key)  # stable: tests keep their order inside a file
