"""The validator role (``role.py``), its intake (``intake.py``), its cheap checks of a decoded batch
before any reward or tensor is computed (``checks.py``), its scoring budgets (``budget.py``) and its
held-out evaluation: its own results and the re-check of other nodes' (``evals.py``)."""
