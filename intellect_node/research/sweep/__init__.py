"""Sweeps of many small training runs farmed out to the swarm, one module per concern.

- :mod:`.grids`: the named grids of jobs, a job's estimated cost and deadline, running one job here;
- :mod:`.coordinator`: the pure state machine that grants jobs, spot-checks and settles results;
- :mod:`.journal`: the append-only file the coordinator's events are persisted to (and resumed from);
- :mod:`.report`: results, summary, table and plot of a finished (or interrupted) sweep.

The names callers use are re-exported here (``from intellect_node.research import sweep``). Nothing in
this package networks; ``roles/sweep.py`` wires it to the swarm.
"""

from __future__ import annotations

from intellect_node.protocol.sweep import JobSpec, job_id
from intellect_node.research.sweep.coordinator import (
    CHECK,
    DEFAULT_CHECK_FRACTION,
    DEFAULT_CHECK_GRACE_S,
    DEFAULT_MAX_VOTES,
    PRIMARY,
    TIEBREAK,
    Coordinator,
    Grant,
    Outcome,
    spot_checked,
)
from intellect_node.research.sweep.grids import (
    GRIDS,
    default_deadline_s,
    estimated_seconds,
    execute,
    grid,
    noise_job,
    poly_job,
)
from intellect_node.research.sweep.journal import Journal
from intellect_node.research.sweep.report import plot, summarize, table, theory, write_outputs, write_report

__all__ = ["CHECK", "DEFAULT_CHECK_FRACTION", "DEFAULT_CHECK_GRACE_S", "DEFAULT_MAX_VOTES", "GRIDS",
           "PRIMARY", "TIEBREAK", "Coordinator", "Grant", "JobSpec", "Journal", "Outcome",
           "default_deadline_s", "estimated_seconds", "execute", "grid", "job_id", "noise_job", "plot",
           "poly_job", "spot_checked", "summarize", "table", "theory", "write_outputs", "write_report"]
