"""The validator role (``role.py``, which maps and wires its parts): its intake (``intake.py``), a batch's
verification from its notice to its verdict (``verification.py``) with the cheap checks of a decoded batch
before any reward or tensor is computed (``checks.py``) and the scoring budgets (``budget.py``), each
worker's record and bans (``reputation.py``), its verdicts out (``publication.py``) and their timestamps
(``hops.py``), and its held-out evaluation: its own results and the re-check of others' (``evals.py``)."""
