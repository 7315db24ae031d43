"""The roles a node can run: ``trainer``, ``worker``, ``validator`` (``--role`` of ``intellect-node join``),
the sweep coordinator and worker (``sweep``), and policy distribution (``common.policy``: publisher,
follower). One folder per role (``trainer/``, ``validator/``, ``worker/``, each with its ``role.py``, and
``auditor/``, which replays the trainer's steps inside a validator), what they share in ``common/``;
``runs`` is the runs a node lists and serves and the client side that finds them and fetches one by its CID.
Inside, imports flow one way too (``tests/test_layering.py``, ``ROLE_RANK``): ``common`` at the bottom;
``trainer``, ``worker``, ``auditor``, ``runs`` and ``sweep`` on it, none importing another; the
``validator`` on top (a validator with ``validator.audit`` on runs the auditor's chain). They compose the
layers below them (``p2p``, ``blobs``, ``inference``, ``trainer``, ``proofs``, ``protocol``) and plug into a
node as services; ``node/`` assembles them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from intellect_node.roles.common.seams import RoleFactory

ROLES = ("trainer", "worker", "validator")


def role_factory(role: str) -> RoleFactory:
    """The service factory of ``role`` (imported lazily: torch is heavy). It takes the node as a
    :class:`~intellect_node.roles.common.seams.Runtime`, so type-checking ``node/assembly.py``, which
    hands it a ``NodeRuntime``, checks that the runtime provides what the roles use."""
    if role == "trainer":
        from intellect_node.roles.trainer.role import Trainer
        return Trainer.for_runtime
    if role == "worker":
        from intellect_node.roles.worker.role import Worker
        return Worker.for_runtime
    if role == "validator":
        from intellect_node.roles.validator.role import Validator
        return Validator.for_runtime
    from intellect_node.errors import ConfigError
    raise ConfigError(f"--role {role!r} is not one of {', '.join(ROLES)}", field="role")
