"""The validator role (``role.py``), its intake (``intake.py``), its cheap checks of a decoded batch
before any reward or tensor is computed (``checks.py``) and its scoring budgets (``budget.py``)."""
